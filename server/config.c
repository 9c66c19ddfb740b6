#include "config.h"

#include <errno.h>
#include <ini.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "da.h"
#include "log.h"

typedef enum { T_INT, T_I64, T_FLOAT, T_STR, T_ENUM, T_FLAG } kind;

typedef struct setting {
  const char *name; /* flag name without "--" */
  kind type;
  size_t off;
  double min, max;     /* T_INT, T_I64, T_FLOAT */
  const char *choices; /* T_ENUM: "a|b|c" */
  const char *def;     /* default, as text */
  const char *help;
} setting;

#define F(field) offsetof(da_config, field)

static const setting table[] = {
    {"config", T_STR, F(config_file), 0, 0, NULL, "", "config file (ini: name = value, same names as the flags)"},
    {"listen", T_STR, F(listen), 0, 0, NULL, "",
     "nng URL to listen on (default ipc://$XDG_RUNTIME_DIR/detattn/detattnd.sock, or "
     "ipc:///tmp/detattn-$UID/detattnd.sock)"},
    {"backend", T_ENUM, F(backend), 0, 0, "auto|cpu|cuda", "auto", "attention backend; auto: cuda if a device is present"},
    {"layers", T_INT, F(layers), 1, 4096, NULL, "32", "model: layers"},
    {"q-heads", T_INT, F(q_heads), 1, 1024, NULL, "32", "model: query heads (a multiple of kv-heads)"},
    {"kv-heads", T_INT, F(kv_heads), 1, 1024, NULL, "8", "model: key/value heads"},
    {"head-dim", T_INT, F(head_dim), 64, 256, NULL, "128", "model: head dimension (64, 128 or 256)"},
    {"dtype", T_ENUM, F(dtype), 0, 0, "bf16|fp16", "bf16", "model: tensor dtype on the wire and in the cache"},
    {"page-tokens", T_INT, F(page_tokens), 8, 256, NULL, "16", "KV page size in tokens (a power of two; changes no result; larger is faster on CUDA, coarser in memory)"},
    {"kv-tokens", T_I64, F(kv_tokens), 1, 1LL << 32, NULL, "8192", "KV cache capacity in tokens (rounded up to pages)"},
    {"window", T_INT, F(window), 0, 1 << 30, NULL, "0", "model: sliding window in tokens; 0: full causal"},
    {"softcap", T_FLOAT, F(softcap), 0, 1e6, NULL, "0", "model: logit softcap; 0: off"},
    {"scale", T_FLOAT, F(scale), 0, 1e6, NULL, "0", "model: softmax scale; 0: 1/sqrt(head-dim)"},
    {"split-tokens", T_INT, F(split_tokens), 16, 1 << 20, NULL, "512", "numerics: split size S (a multiple of tile-tokens)"},
    {"tile-tokens", T_INT, F(tile_tokens), 16, 256, NULL, "64", "numerics: tile size T (a power of two)"},
    {"max-batch-tokens", T_INT, F(max_batch_tokens), 2, 1 << 24, NULL, "8192",
     "scheduler: most appended + query tokens in one batch"},
    {"wait-us", T_INT, F(wait_us), 0, 1000000, NULL, "0",
     "scheduler: how long an idle backend waits for a batch to fill, microseconds"},
    {"max-request-tokens", T_INT, F(max_request_tokens), 1, 1 << 24, NULL, "4096",
     "most tokens in one Forward (all its sequences); max-request-tokens + split-tokens <= max-batch-tokens"},
    {"partial-rows", T_INT, F(partial_rows), -1, 1 << 30, NULL, "-1",
     "scheduler: -1, the backend runs each batch's long rows in-row or as partials as suits its "
     "device; N >= 0, batches with fewer (token, q-head) rows than N run long rows as partials, "
     "the rest in-row"},
    {"decode-tokens", T_INT, F(decode_tokens), 1, 4096, NULL, "16",
     "scheduler: a sequence's Forward of at most this many tokens is decode work, batched before prefill"},
    {"max-prefill-tokens", T_INT, F(max_prefill_tokens), 0, 1 << 24, NULL, "2048",
     "scheduler: prefill query tokens per batch; bounds a batch's run time and so how long decode "
     "waits behind prefill; 0: no limit"},
    {"max-message-bytes", T_I64, F(max_message_bytes), 4096, 1LL << 31, NULL, "67108864",
     "largest request message in bytes"},
    {"max-seqs", T_INT, F(max_seqs), 1, 1 << 20, NULL, "1024", "most sequences open at once"},
    {"max-seq-tokens", T_INT, F(max_seq_tokens), 1, 1 << 24, NULL, "32768", "longest sequence in tokens"},
    {"threads", T_INT, F(threads), 0, 1024, NULL, "0", "CPU backend: worker threads; 0: online CPUs"},
    {"contexts", T_INT, F(contexts), 1, 65536, NULL, "256",
     "nng contexts: requests held by the daemon at once (received, queued, running or being answered)"},
    {"acc-slots", T_INT, F(acc_slots), 0, 1 << 28, NULL, "0", "accumulator slots for partial splits; 0: backend default"},
    {"staging-mib", T_INT, F(staging_mib), 0, 1 << 16, NULL, "0", "device backends: staging buffer MiB; 0: sized from the model and --max-batch-tokens (logged at start)"},
    {"device", T_INT, F(device), 0, 64, NULL, "0", "CUDA backend: device ordinal"},
    {"max-connections", T_INT, F(max_connections), 1, 1 << 20, NULL, "256",
     "most client connections at once; more are refused (logged). Checked against the open-file limit at start"},
    {"max-conn-per-peer", T_INT, F(max_conn_per_peer), 1, 1 << 20, NULL, "64",
     "most connections from one peer (an ipc peer process, a tcp peer address)"},
    {"max-inflight-per-conn", T_INT, F(max_inflight_per_conn), 1, 1 << 20, NULL, "32",
     "most requests one connection may have in the daemon; more are answered RESOURCE_EXHAUSTED"},
    {"client-max-seqs", T_INT, F(client_max_seqs), 0, 1 << 20, NULL, "0",
     "quota: sequences one client (a peer process or address, all its connections) may hold; 0: max-seqs "
     "less an eighth"},
    {"client-max-kv-tokens", T_I64, F(client_max_kv_tokens), 0, 1LL << 40, NULL, "0",
     "quota: KV cache tokens one client's sequences may hold (pages x page-tokens); 0: the cache less an eighth"},
    {"client-max-inflight-tokens", T_I64, F(client_max_inflight_tokens), 0, 1LL << 40, NULL, "0",
     "quota: Forward tokens one client may have admitted and unanswered; 0: 4 x max-batch-tokens"},
    {"max-reply-bytes", T_I64, F(max_reply_bytes), 65536, 1LL << 40, NULL, "268435456",
     "most reply bytes queued for one connection that is not reading them; past it the connection is dropped"},
    {"send-timeout-ms", T_INT, F(send_timeout_ms), 10, 1 << 30, NULL, "5000",
     "a reply not taken by its client within this many ms drops that client's connection"},
    {"idle-timeout-ms", T_INT, F(idle_timeout_ms), 0, 1 << 30, NULL, "60000",
     "a connection that owns no sequence and has no request in the daemon is closed after this many ms "
     "without a request; 0: never"},
    {"drain-timeout-ms", T_INT, F(drain_timeout_ms), 100, 1 << 30, NULL, "30000",
     "on SIGTERM, the daemon exits within this many ms (plus 2 s to close) even if work is still running"},
    {"max-arena-bytes", T_I64, F(max_arena_bytes), 4096, 1LL << 40, NULL, "4294967296",
     "shared-memory plane: largest arena a client may register"},
    {"max-arenas", T_INT, F(max_arenas), 0, 1024, NULL, "64",
     "shared-memory plane: arenas per connection (with the cuda plane: arenas, CUDA buffers and events); 0: "
     "no shared-memory or cuda plane"},
    {"cuda-event-timeout-ms", T_INT, F(cuda_event_timeout_ms), 1, 1 << 30, NULL, "10000",
     "cuda plane: a Forward whose wait_event has not completed after this many ms is answered DEADLINE_EXCEEDED"},
    {"doorbell", T_INT, F(doorbell), 0, 1, NULL, "1",
     "offer same-host clients a doorbell: requests through a shared-memory ring instead of nng (ipc:// with "
     "the shared-memory plane); 0: off"},
    {"doorbell-spin-us", T_INT, F(doorbell_spin_us), 0, 100000, NULL, "50",
     "doorbell: the loop scans a ring every turn for this long after its last request or reply, then sleeps "
     "until the client rings its eventfd; 0: sleep at once"},
    {"doorbell-spin-max-us", T_INT, F(doorbell_spin_max_us), -1, 1000000, NULL, "-1",
     "doorbell: after a reply, scan up to this long: 1.5x the ring's last reply-to-request gap (a client "
     "computing between calls); 0: doorbell-spin-us only; -1: 2000 with 8+ online CPUs, else 0"},
    {"worker-spin-us", T_INT, F(worker_spin_us), -1, 100000, NULL, "-1",
     "the backend worker spins (yielding) this long for its next batch before it sleeps; 0: sleep at once; "
     "-1: 20 with 8 or more online CPUs, else 0"},
    {"worker-spin-max-us", T_INT, F(worker_spin_max_us), -1, 1000000, NULL, "-1",
     "the worker spins up to this long: 1.5x its last idle gap, or polling a device batch 1.5x the "
     "last one's time (else 200 us); 0: fixed spins only; -1: 2000 with 8+ online CPUs, else 0"},
    {"phase-timing", T_INT, F(phase_timing), 0, 1, NULL, "0",
     "diagnostics: time each decode Forward from receipt to reply, phase by phase (admission, batch, "
     "worker, backend, back to the loop, reply), and log their p50 / p90 at exit"},
    {"spin-late-us", T_INT, F(spin_late_us), 0, 1000000, NULL, "1000",
     "a spinning loop or worker whose yield comes back this late (no idle core) ends its spin, and for 1 s "
     "spins no longer than the fixed ones; 0: never"},
    {"tls-cert", T_STR, F(tls_cert), 0, 0, NULL, "", "tls+tcp: the daemon's certificate (PEM, may hold the chain)"},
    {"tls-key", T_STR, F(tls_key), 0, 0, NULL, "", "tls+tcp: the daemon's private key (PEM)"},
    {"tls-ca", T_STR, F(tls_ca), 0, 0, NULL, "",
     "tls+tcp: CA certificates (PEM); when set, clients must present a certificate it signed (mutual TLS)"},
    {"insecure-tcp", T_FLAG, F(insecure_tcp), 0, 0, NULL, "0",
     "allow tcp:// on a non-loopback address: no encryption, no authentication (use tls+tcp://)"},
    {"ipc-mode", T_STR, F(ipc_mode), 0, 0, NULL, "0660", "permissions of the ipc socket (octal)"},
    {"allow-uids", T_STR, F(allow_uids), 0, 0, NULL, "",
     "ipc: user ids allowed to connect, comma-separated; the daemon's own uid and root always are. "
     "Empty: also any peer whose primary gid is the daemon's (the socket is group-accessible)"},
    {"allow-gids", T_STR, F(allow_gids), 0, 0, NULL, "", "ipc: group ids whose members may connect, comma-separated"},
    {"stats-uids", T_STR, F(stats_uids), 0, 0, NULL, "",
     "ipc: user ids whose Stats show every client (others see their own sequences and pages); the daemon's "
     "own uid and root always do"},
    {"log-level", T_ENUM, F(log_level), 0, 0, "error|warn|info|debug", "info", "log level"},
    {"log-format", T_ENUM, F(log_format), 0, 0, "text|json", "text",
     "log lines on stderr: text, or json (one object per line: time, level, event, msg, fields)"},
    {"http-listen", T_STR, F(http_listen), 0, 0, NULL, "",
     "http://HOST:PORT serving /metrics (Prometheus), /healthz and /readyz; empty: off"},
    {"fail-after-batches", T_INT, F(fail_after_batches), 0, 1 << 30, NULL, "0",
     "for tests only: batch N (counting from 1) and every later one fail as an injected device "
     "failure (UNAVAILABLE; the daemon answers them and exits 3); 0: off"},
    {"help", T_FLAG, F(help), 0, 0, NULL, "0", "print this help and exit"},
    {"print-config", T_FLAG, F(print_config), 0, 0, NULL, "0", "print an example config file with every setting and exit"},
};
#define N_SETTINGS (sizeof(table) / sizeof(table[0]))

/* Settings for tests only: in --help, left out of --print-config's example file. */
static int test_only(const setting *s) { return strcmp(s->name, "fail-after-batches") == 0; }

static const setting *find(const char *name, size_t len) {
  for (size_t i = 0; i < N_SETTINGS; i++)
    if (strlen(table[i].name) == len && strncmp(table[i].name, name, len) == 0) return &table[i];
  return NULL;
}

static int choice_index(const char *choices, const char *v) {
  size_t vl = strlen(v);
  int i = 0;
  for (const char *p = choices;; i++) {
    const char *bar = strchr(p, '|');
    size_t l = bar ? (size_t)(bar - p) : strlen(p);
    if (l == vl && strncmp(p, v, l) == 0) return i;
    if (bar == NULL) return -1;
    p = bar + 1;
  }
}

static const char *type_name(kind t) {
  switch (t) {
  case T_INT: case T_I64: return "int";
  case T_FLOAT: return "float";
  case T_STR: return "string";
  case T_ENUM: return "choice";
  case T_FLAG: return "flag";
  }
  return "?";
}

/* Parses v into the setting's field; on error writes "<src>: <name>: <why>". */
static int set_value(da_config *c, const setting *s, const char *v, const char *src, char *err,
                     size_t errlen) {
  char *base = (char *)c + s->off;
  char *end = NULL;
  switch (s->type) {
  case T_INT:
  case T_I64: {
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (*v == '\0' || *end != '\0' || errno) {
      snprintf(err, errlen, "%s: %s: '%s' is not an integer", src, s->name, v);
      return DETATTN_INVALID_ARGUMENT;
    }
    if ((double)x < s->min || (double)x > s->max) {
      snprintf(err, errlen, "%s: %s: %lld is out of bounds [%.0f, %.0f]", src, s->name, x, s->min,
               s->max);
      return DETATTN_INVALID_ARGUMENT;
    }
    if (s->type == T_INT) *(int *)base = (int)x;
    else *(int64_t *)base = (int64_t)x;
    return 0;
  }
  case T_FLOAT: {
    errno = 0;
    double x = strtod(v, &end);
    if (*v == '\0' || *end != '\0' || errno || !isfinite(x)) {
      snprintf(err, errlen, "%s: %s: '%s' is not a finite number", src, s->name, v);
      return DETATTN_INVALID_ARGUMENT;
    }
    if (x < s->min || x > s->max) {
      snprintf(err, errlen, "%s: %s: %g is out of bounds [%g, %g]", src, s->name, x, s->min, s->max);
      return DETATTN_INVALID_ARGUMENT;
    }
    *(double *)base = x;
    return 0;
  }
  case T_STR:
    if (strlen(v) >= DA_CONFIG_STR_MAX) {
      snprintf(err, errlen, "%s: %s: value longer than %d bytes", src, s->name, DA_CONFIG_STR_MAX - 1);
      return DETATTN_INVALID_ARGUMENT;
    }
    snprintf(base, DA_CONFIG_STR_MAX, "%s", v);
    return 0;
  case T_ENUM: {
    int i = choice_index(s->choices, v);
    if (i < 0) {
      snprintf(err, errlen, "%s: %s: '%s' is not one of %s", src, s->name, v, s->choices);
      return DETATTN_INVALID_ARGUMENT;
    }
    *(int *)base = i;
    return 0;
  }
  case T_FLAG:
    if (strcmp(v, "1") == 0 || strcmp(v, "true") == 0 || strcmp(v, "yes") == 0) *(int *)base = 1;
    else if (strcmp(v, "0") == 0 || strcmp(v, "false") == 0 || strcmp(v, "no") == 0) *(int *)base = 0;
    else {
      snprintf(err, errlen, "%s: %s: '%s' is not a boolean (1|0|true|false|yes|no)", src, s->name, v);
      return DETATTN_INVALID_ARGUMENT;
    }
    return 0;
  }
  return DETATTN_INTERNAL;
}

typedef struct file_ctx {
  da_config *c;
  const char *path;
  char *err;
  size_t errlen;
  int rv;
} file_ctx;

/* Messages are "file: name: why"; the caller adds the line number inih reports. */
static int on_ini(void *user, const char *section, const char *name, const char *value) {
  file_ctx *fc = user;
  (void)section;
  if (fc->rv) return 0;
  const setting *s = find(name, strlen(name));
  if (s == NULL || s->type == T_FLAG || strcmp(s->name, "config") == 0) {
    snprintf(fc->err, fc->errlen, "unknown setting '%s'", name);
    fc->rv = DETATTN_INVALID_ARGUMENT;
    return 0;
  }
  fc->rv = set_value(fc->c, s, value, "file", fc->err, fc->errlen);
  return fc->rv == 0;
}

static void env_name(const setting *s, char *out, size_t outlen) {
  int n = snprintf(out, outlen, "DETATTND_");
  for (const char *p = s->name; *p && (size_t)n + 1 < outlen; p++)
    out[n++] = *p == '-' ? '_' : (char)(*p >= 'a' && *p <= 'z' ? *p - 'a' + 'A' : *p);
  out[n] = '\0';
}

static const char *env_get(char *const envp[], const char *name) {
  if (envp == NULL) return NULL;
  size_t l = strlen(name);
  for (char *const *e = envp; *e; e++)
    if (strncmp(*e, name, l) == 0 && (*e)[l] == '=') return *e + l + 1;
  return NULL;
}

/* Walks argv; with only_meta set, applies only --config and --help. */
static int parse_flags(da_config *c, int argc, char *const argv[], int only_meta, char *err,
                       size_t errlen) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strncmp(a, "--", 2) != 0) {
      snprintf(err, errlen, "unexpected argument '%s' (settings are --name value)", a);
      return DETATTN_INVALID_ARGUMENT;
    }
    const char *name = a + 2, *eq = strchr(name, '=');
    size_t nl = eq ? (size_t)(eq - name) : strlen(name);
    const setting *s = find(name, nl);
    if (s == NULL) {
      snprintf(err, errlen, "unknown flag '--%.*s' (see --help)", (int)nl, name);
      return DETATTN_INVALID_ARGUMENT;
    }
    const char *v;
    if (eq) v = eq + 1;
    else if (s->type == T_FLAG) v = "1";
    else if (i + 1 < argc) v = argv[++i];
    else {
      snprintf(err, errlen, "flag --%s needs a value", s->name);
      return DETATTN_INVALID_ARGUMENT;
    }
    int meta = s->type == T_FLAG || strcmp(s->name, "config") == 0;
    if (meta != only_meta) continue;
    int rv = set_value(c, s, v, "flag", err, errlen);
    if (rv) return rv;
    if (c->help || c->print_config) return 0;
  }
  return 0;
}

int da_config_id_list(const char *s, uint32_t *out, int max) {
  int n = 0;
  while (*s) {
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (end == s || errno || v > UINT32_MAX || (*end != ',' && *end != '\0') || n >= max) return -1;
    out[n++] = (uint32_t)v;
    s = *end == ',' ? end + 1 : end;
  }
  return n;
}

int da_config_ipc_mode(const da_config *c) { return (int)strtol(c->ipc_mode, NULL, 8); }

static int check_lists(const da_config *c, char *err, size_t errlen) {
  uint32_t ids[64];
  const struct {
    const char *name, *v;
  } lists[] = {{"allow-uids", c->allow_uids}, {"allow-gids", c->allow_gids}, {"stats-uids", c->stats_uids}};
  for (size_t i = 0; i < sizeof(lists) / sizeof(lists[0]); i++)
    if (da_config_id_list(lists[i].v, ids, 64) < 0) {
      snprintf(err, errlen, "%s: '%s' is not a comma-separated list of at most 64 numeric ids", lists[i].name,
               lists[i].v);
      return DETATTN_INVALID_ARGUMENT;
    }
  char *end;
  long mode = strtol(c->ipc_mode, &end, 8);
  if (c->ipc_mode[0] == '\0' || *end != '\0' || mode < 0 || mode > 0777 || (mode & 0600) != 0600) {
    snprintf(err, errlen, "ipc-mode: '%s' is not an octal mode in [0600, 0777] that lets the owner read and write",
             c->ipc_mode);
    return DETATTN_INVALID_ARGUMENT;
  }
  return 0;
}

/* 1 when the host of a tcp URL (after "tcp://" or "tls+tcp://") is a loopback address. */
static int loopback_host(const char *hostport) {
  char host[256];
  const char *colon = strrchr(hostport, ':');
  size_t n = colon ? (size_t)(colon - hostport) : strlen(hostport);
  if (n >= sizeof host) return 0;
  memcpy(host, hostport, n);
  host[n] = '\0';
  return strncmp(host, "127.", 4) == 0 || strcmp(host, "localhost") == 0 || strcmp(host, "[::1]") == 0 ||
         strcmp(host, "::1") == 0;
}

static int check_transport(const da_config *c, char *err, size_t errlen) {
  int tls = strncmp(c->listen, "tls+tcp://", 10) == 0;
  if (tls && (!c->tls_cert[0] || !c->tls_key[0])) {
    snprintf(err, errlen, "listen: %s needs --tls-cert and --tls-key (a TLS listener without a certificate "
             "cannot complete a handshake)", c->listen);
    return DETATTN_INVALID_ARGUMENT;
  }
  if (!tls && (c->tls_cert[0] || c->tls_key[0] || c->tls_ca[0])) {
    snprintf(err, errlen, "--tls-cert, --tls-key and --tls-ca need a tls+tcp:// --listen URL (got %s)", c->listen);
    return DETATTN_INVALID_ARGUMENT;
  }
  if (strncmp(c->listen, "tcp://", 6) == 0 && !loopback_host(c->listen + 6) && !c->insecure_tcp) {
    snprintf(err, errlen, "listen: %s is not a loopback address: anyone who reaches it could use the daemon "
             "unauthenticated; use tls+tcp:// with --tls-cert/--tls-key/--tls-ca, or pass --insecure-tcp", c->listen);
    return DETATTN_INVALID_ARGUMENT;
  }
  return 0;
}

static int check_cross(const da_config *c, char *err, size_t errlen) {
  da_model m = {.n_layers = c->layers, .n_q_heads = c->q_heads, .n_kv_heads = c->kv_heads,
                .head_dim = c->head_dim, .dtype = (da_dtype)c->dtype, .scale = (float)c->scale,
                .softcap = (float)c->softcap, .window = c->window};
  da_numerics nu = {.split_tokens = c->split_tokens, .tile_tokens = c->tile_tokens};
  da_model_defaults(&m);
  char msg[256];
  if (da_model_check(&m, &nu, msg, sizeof(msg)) != 0) {
    snprintf(err, errlen, "model/numerics: %s", msg);
    return DETATTN_INVALID_ARGUMENT;
  }
  if (c->page_tokens & (c->page_tokens - 1)) {
    snprintf(err, errlen, "page-tokens must be a power of two, got %d", c->page_tokens);
    return DETATTN_INVALID_ARGUMENT;
  }
  if ((int64_t)c->max_request_tokens + c->split_tokens > c->max_batch_tokens) {
    long long room = (long long)c->max_batch_tokens - c->split_tokens;
    snprintf(err, errlen,
             "max-request-tokens (%d) + split-tokens (%d) must be <= max-batch-tokens (%d): a "
             "request's first chunk (its K/V append and one split of queries) must fit a batch; raise "
             "--max-batch-tokens to %lld or lower --max-request-tokens to %lld",
             c->max_request_tokens, c->split_tokens, c->max_batch_tokens,
             (long long)c->max_request_tokens + c->split_tokens, room > 0 ? room : 1);
    return DETATTN_INVALID_ARGUMENT;
  }
  if (c->max_request_tokens > c->max_seq_tokens) {
    snprintf(err, errlen, "max-request-tokens (%d) must be <= max-seq-tokens (%d): raise --max-seq-tokens to %d "
             "or lower --max-request-tokens to %d",
             c->max_request_tokens, c->max_seq_tokens, c->max_request_tokens, c->max_seq_tokens);
    return DETATTN_INVALID_ARGUMENT;
  }
  if (check_lists(c, err, errlen) != 0) return DETATTN_INVALID_ARGUMENT;
  if (c->http_listen[0] && strncmp(c->http_listen, "http://", 7) != 0) {
    snprintf(err, errlen, "http-listen: '%s' is not an http://HOST:PORT URL (empty: off)", c->http_listen);
    return DETATTN_INVALID_ARGUMENT;
  }
  if (check_transport(c, err, errlen) != 0) return DETATTN_INVALID_ARGUMENT;
  if (strncmp(c->listen, "ipc://", 6) != 0 && strncmp(c->listen, "tcp://", 6) != 0 &&
      strncmp(c->listen, "tls+tcp://", 10) != 0 && strncmp(c->listen, "inproc://", 9) != 0) {
    snprintf(err, errlen, "listen: '%s' is not an ipc://, tcp://, tls+tcp:// or inproc:// URL", c->listen);
    return DETATTN_INVALID_ARGUMENT;
  }
  return 0;
}

static void default_listen(da_config *c, char *const envp[]) {
  const char *xdg = env_get(envp, "XDG_RUNTIME_DIR");
  if (xdg && xdg[0] == '/' && strlen(xdg) < DA_CONFIG_STR_MAX - 64)
    snprintf(c->listen, DA_CONFIG_STR_MAX, "ipc://%s/detattn/detattnd.sock", xdg);
  else
    snprintf(c->listen, DA_CONFIG_STR_MAX, "ipc:///tmp/detattn-%u/detattnd.sock", (unsigned)getuid());
}

int da_config_load(da_config *c, int argc, char *const argv[], char *const envp[], char *err,
                   size_t errlen) {
  memset(c, 0, sizeof(*c));
  int rv;
  for (size_t i = 0; i < N_SETTINGS; i++)
    if ((rv = set_value(c, &table[i], table[i].def, "default", err, errlen)) != 0) return rv;

  const char *envfile = env_get(envp, "DETATTND_CONFIG");
  if (envfile && (rv = set_value(c, find("config", 6), envfile, "env DETATTND_CONFIG", err, errlen)))
    return rv;
  if ((rv = parse_flags(c, argc, argv, 1, err, errlen)) != 0 || c->help || c->print_config)
    return rv;

  if (c->config_file[0]) {
    char msg[512] = "";
    file_ctx fc = {.c = c, .path = c->config_file, .err = msg, .errlen = sizeof(msg)};
    int r = ini_parse(c->config_file, on_ini, &fc);
    if (fc.rv) {
      snprintf(err, errlen, "%s:%d: %s", c->config_file, r, msg);
      return fc.rv;
    }
    if (r < 0) {
      snprintf(err, errlen, "config file %s: cannot open", c->config_file);
      return DETATTN_INVALID_ARGUMENT;
    }
    if (r > 0) {
      snprintf(err, errlen, "%s:%d: syntax error", c->config_file, r);
      return DETATTN_INVALID_ARGUMENT;
    }
  }
  for (size_t i = 0; i < N_SETTINGS; i++) {
    const setting *s = &table[i];
    if (s->type == T_FLAG || strcmp(s->name, "config") == 0) continue;
    char en[64], src[80];
    env_name(s, en, sizeof(en));
    const char *v = env_get(envp, en);
    snprintf(src, sizeof(src), "env %s", en);
    if (v && (rv = set_value(c, s, v, src, err, errlen)) != 0) return rv;
  }
  if ((rv = parse_flags(c, argc, argv, 0, err, errlen)) != 0) return rv;
  if (c->listen[0] == '\0') default_listen(c, envp);
  return check_cross(c, err, errlen);
}

const char *da_config_backend_name(const da_config *c) {
  static const char *const names[] = {"auto", "cpu", "cuda"};
  return (unsigned)c->backend < 3 ? names[c->backend] : "?";
}

static void bounds_text(const setting *s, char *out, size_t outlen) {
  switch (s->type) {
  case T_INT: case T_I64: snprintf(out, outlen, "[%.0f, %.0f]", s->min, s->max); break;
  case T_FLOAT: snprintf(out, outlen, "[%g, %g]", s->min, s->max); break;
  case T_ENUM: snprintf(out, outlen, "%s", s->choices); break;
  default: out[0] = '\0';
  }
}

void da_config_help(FILE *f) {
  fprintf(f,
          "usage: detattnd [--name value | --name=value]...\n"
          "detattnd serves deterministic, batch-invariant attention over nng.\n"
          "Precedence: defaults < config file < environment DETATTND_<NAME> < flags.\n\n");
  for (size_t i = 0; i < N_SETTINGS; i++) {
    const setting *s = &table[i];
    char b[64], en[64];
    bounds_text(s, b, sizeof(b));
    env_name(s, en, sizeof(en));
    fprintf(f, "  --%-20s %-7s %-22s default: %s\n      %s (env %s)\n", s->name, type_name(s->type),
            b, s->def[0] ? s->def : "(none)", s->help, en);
  }
}

void da_config_example(FILE *f) {
  fprintf(f,
          "; detattnd configuration file (ini). Keys are the command-line flag names; sections\n"
          "; are ignored. Precedence: defaults < this file < environment DETATTND_<NAME> < flags.\n"
          "; Every setting is listed at its default, commented out.\n");
  for (size_t i = 0; i < N_SETTINGS; i++) {
    const setting *s = &table[i];
    if (s->type == T_FLAG || strcmp(s->name, "config") == 0 || test_only(s)) continue;
    char b[64], en[64];
    bounds_text(s, b, sizeof(b));
    env_name(s, en, sizeof(en));
    fprintf(f, "\n; %s\n; %s%s%s, env %s\n;%s = %s\n", s->help, type_name(s->type), b[0] ? " " : "", b, en,
            s->name, s->def);
  }
}
