/*
 * detattn — the command-line client of a detattnd daemon: hello, stats, forward, verify.
 * Exit status: 0 success; 1 verify found a mismatch (or an error above tolerance); 2 usage
 * error; 3 a call failed (the status and message are printed).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <xxhash.h>

#include "da.h"
#include "detattn.h"
#include "verify.h"

enum { EXIT_MISMATCH = 1, EXIT_USAGE = 2, EXIT_CALL = 3 };

typedef enum opt_type { O_STR, O_INT, O_U64, O_DBL, O_FLAG } opt_type;
typedef struct opt {
  const char *name; /* without "--" */
  opt_type type;
  void *ptr;
  const char *arg;  /* placeholder in the help text */
  const char *help;
} opt;

/* Settings of every command; the option tables below point into it. */
static struct {
  char url[256];
  int timeout_ms, json, help;
  /* forward */
  int layer, tokens;
  uint64_t seed;
  const char *q_file, *k_file, *v_file, *o_file, *lse_file;
  /* verify */
  da_verify_cfg vcfg;
  double tol;
  const char *plane_name;
} g = {.timeout_ms = 60000, .tokens = 16, .seed = 1, .vcfg = {.seed = 1, .decode_steps = 16}};

static const opt common_opts[] = {
    {"url", O_STR, g.url, "URL", "daemon address (default $DETATTN_URL, else detattnd's default ipc socket)"},
    {"timeout", O_INT, &g.timeout_ms, "MS", "per-call timeout in milliseconds (default 60000; 0: none)"},
    {"json", O_FLAG, &g.json, NULL, "print JSON instead of text"},
    {"tls-ca", O_STR, &g.vcfg.tls_ca, "FILE", "tls+tcp://: CA file that signed the daemon's certificate"},
    {"tls-cert", O_STR, &g.vcfg.tls_cert, "FILE", "tls+tcp://: this client's certificate (mutual TLS)"},
    {"tls-key", O_STR, &g.vcfg.tls_key, "FILE", "tls+tcp://: this client's private key"},
    {"help", O_FLAG, &g.help, NULL, "print this help"},
    {NULL, 0, NULL, NULL, NULL}};

static const opt forward_opts[] = {
    {"layer", O_INT, &g.layer, "L", "layer (default 0)"},
    {"tokens", O_INT, &g.tokens, "N", "tokens of random input (default 16; with --q, taken from the file size)"},
    {"seed", O_U64, &g.seed, "S", "seed of the random input (default 1)"},
    {"q", O_STR, &g.q_file, "FILE", "q input: [tokens][q_heads][head_dim] raw little-endian in the model dtype"},
    {"k", O_STR, &g.k_file, "FILE", "k input: [tokens][kv_heads][head_dim] (with --q)"},
    {"v", O_STR, &g.v_file, "FILE", "v input: [tokens][kv_heads][head_dim] (with --q)"},
    {"o", O_STR, &g.o_file, "FILE", "write o: [tokens][q_heads][head_dim] raw"},
    {"lse", O_STR, &g.lse_file, "FILE", "write lse: [tokens][q_heads] fp32 raw"},
    {NULL, 0, NULL, NULL, NULL}};

static const opt verify_opts[] = {
    {"seed", O_U64, &g.vcfg.seed, "S", "workload seed (default 1)"},
    {"seqs", O_INT, &g.vcfg.seqs, "N", "sequences (default 16)"},
    {"clients", O_INT, &g.vcfg.clients, "N", "concurrent connections in the second pass (default 4)"},
    {"layers-used", O_INT, &g.vcfg.layers_used, "N", "layers exercised, spread over the model (default 4, at most the model's)"},
    {"max-prompt", O_INT, &g.vcfg.max_prompt, "N", "longest random prompt in tokens (default 384)"},
    {"decode-steps", O_INT, &g.vcfg.decode_steps, "N", "single-token decode steps per sequence (default 16)"},
    {"check-ref", O_FLAG, &g.vcfg.check_ref, NULL, "also compare with an fp64 reference computed here"},
    {"tol", O_DBL, &g.tol, "X", "with --check-ref: largest accepted relative error (default: 2e-2 bf16, 4e-3 fp16)"},
    {"url-b", O_STR, &g.vcfg.url_b, "URL", "A/B: run the concurrent pass against this second daemon"},
    {"data-plane", O_STR, &g.plane_name, "P",
     "copy|shm|cuda|auto: how the concurrent pass's tensors travel (the reference pass copies; default copy)"},
    {NULL, 0, NULL, NULL, NULL}};

static const opt no_opts[] = {{NULL, 0, NULL, NULL, NULL}};

typedef struct command {
  const char *name;
  int (*run)(detattn_client *c);
  const opt *opts;
  const char *summary;
} command;

static int cmd_hello(detattn_client *c);
static int cmd_stats(detattn_client *c);
static int cmd_forward(detattn_client *c);
static int cmd_verify(detattn_client *c);

static const command commands[] = {
    {"hello", cmd_hello, no_opts, "server version, model, numerics fingerprint and limits"},
    {"stats", cmd_stats, no_opts, "request, batch and KV cache counters"},
    {"forward", cmd_forward, forward_opts,
     "one Forward on a new sequence at position 0 (random seeded input or files); prints a hash of o"},
    {"verify", cmd_verify, verify_opts,
     "the reproducibility proof: the same seeded workload alone and from concurrent clients with other "
     "chunkings; every output must be bit-identical"},
    {NULL, NULL, NULL, NULL}};

static void print_opts(FILE *f, const opt *o) {
  for (; o->name; o++) {
    char left[48];
    snprintf(left, sizeof left, "--%s%s%s", o->name, o->arg ? " " : "", o->arg ? o->arg : "");
    fprintf(f, "  %-22s %s\n", left, o->help);
  }
}

static void usage(FILE *f, const command *cmd) {
  if (cmd) {
    fprintf(f, "usage: detattn [--url URL] %s [options]\n\n%s\n\noptions:\n", cmd->name, cmd->summary);
    print_opts(f, cmd->opts);
    print_opts(f, common_opts);
    return;
  }
  fprintf(f, "usage: detattn [--url URL] [--timeout MS] [--json] COMMAND [options]\n\ncommands:\n");
  for (const command *c = commands; c->name; c++) fprintf(f, "  %-8s %s\n", c->name, c->summary);
  fprintf(f, "\ncommon options:\n");
  print_opts(f, common_opts);
  fprintf(f, "\n'detattn COMMAND --help' lists a command's options.\n"
             "exit status: 0 ok, 1 verify mismatch, 2 usage error, 3 a call failed\n");
}

static const opt *find_opt(const opt *tables[], const char *name) {
  for (int t = 0; tables[t]; t++)
    for (const opt *o = tables[t]; o->name; o++)
      if (strcmp(o->name, name) == 0) return o;
  return NULL;
}

static int set_opt(const opt *o, const char *val) {
  char *end;
  errno = 0;
  switch (o->type) {
  case O_STR:
    if (o->ptr == g.url) snprintf(g.url, sizeof g.url, "%s", val);
    else *(const char **)o->ptr = val;
    return 0;
  case O_INT: {
    long x = strtol(val, &end, 0);
    if (errno || *end || x < -2147483647L || x > 2147483647L) return -1;
    *(int *)o->ptr = (int)x;
    return 0;
  }
  case O_U64: {
    unsigned long long x = strtoull(val, &end, 0);
    if (errno || *end || val[0] == '-') return -1;
    *(uint64_t *)o->ptr = x;
    return 0;
  }
  case O_DBL: {
    double x = strtod(val, &end);
    if (errno || *end) return -1;
    *(double *)o->ptr = x;
    return 0;
  }
  case O_FLAG:
    *(int *)o->ptr = 1;
    return 0;
  }
  return -1;
}

/* Parses argv: options may come before or after the command. */
static int parse(int argc, char **argv, const command **cmd_out) {
  const command *cmd = NULL;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strncmp(a, "--", 2) != 0) {
      if (cmd) {
        fprintf(stderr, "detattn: unexpected argument '%s'\n", a);
        return -1;
      }
      for (const command *c = commands; c->name; c++)
        if (strcmp(c->name, a) == 0) cmd = c;
      if (!cmd) {
        fprintf(stderr, "detattn: unknown command '%s'\n", a);
        return -1;
      }
      continue;
    }
    const opt *tables[] = {common_opts, cmd ? cmd->opts : no_opts, NULL};
    const opt *o = find_opt(tables, a + 2);
    if (!o) {
      fprintf(stderr, "detattn: unknown option '%s'%s\n", a, cmd ? "" : " (command options go after the command)");
      return -1;
    }
    const char *val = NULL;
    if (o->type != O_FLAG) {
      if (i + 1 >= argc) {
        fprintf(stderr, "detattn: option '%s' needs a value\n", a);
        return -1;
      }
      val = argv[++i];
    }
    if (set_opt(o, val) != 0) {
      fprintf(stderr, "detattn: bad value '%s' for '%s'\n", val, a);
      return -1;
    }
  }
  *cmd_out = cmd;
  return 0;
}

static void default_url(void) {
  const char *env = getenv("DETATTN_URL"), *xdg = getenv("XDG_RUNTIME_DIR");
  if (g.url[0]) return;
  if (env && env[0]) snprintf(g.url, sizeof g.url, "%s", env);
  else if (xdg && xdg[0]) snprintf(g.url, sizeof g.url, "ipc://%s/detattn/detattnd.sock", xdg);
  else snprintf(g.url, sizeof g.url, "ipc:///tmp/detattn-%u/detattnd.sock", (unsigned)getuid());
}

static int call_failed(const char *what, int st) {
  fprintf(stderr, "detattn: %s: %s: %s\n", what, detattn_status_name(st), detattn_errmsg());
  return EXIT_CALL;
}

static void print_json(cJSON *o) {
  char *s = cJSON_Print(o);
  if (s) puts(s);
  free(s);
  cJSON_Delete(o);
}

static void hex64(char *buf, size_t len, uint64_t x) { snprintf(buf, len, "%016llx", (unsigned long long)x); }

static int cmd_hello(detattn_client *c) {
  detattn_server_info i;
  char fp[24];
  int st = detattn_hello(c, &i);
  if (st != DETATTN_OK) return call_failed("hello", st);
  const detattn_model *m = &i.model;
  hex64(fp, sizeof fp, i.fingerprint);
  if (g.json) {
    cJSON *o = cJSON_CreateObject(), *mo = cJSON_AddObjectToObject(o, "model");
    cJSON_AddStringToObject(o, "url", g.url);
    cJSON_AddStringToObject(o, "server_version", i.server_version);
    cJSON_AddNumberToObject(o, "protocol_version", i.protocol_version);
    cJSON_AddNumberToObject(mo, "n_layers", m->n_layers);
    cJSON_AddNumberToObject(mo, "n_q_heads", m->n_q_heads);
    cJSON_AddNumberToObject(mo, "n_kv_heads", m->n_kv_heads);
    cJSON_AddNumberToObject(mo, "head_dim", m->head_dim);
    cJSON_AddStringToObject(mo, "dtype", m->dtype == DETATTN_FP16 ? "fp16" : "bf16");
    cJSON_AddNumberToObject(mo, "scale", m->scale);
    cJSON_AddNumberToObject(mo, "softcap", m->softcap);
    cJSON_AddNumberToObject(mo, "window", m->window);
    cJSON_AddNumberToObject(mo, "page_tokens", m->page_tokens);
    cJSON_AddStringToObject(o, "backend", i.backend);
    cJSON_AddStringToObject(o, "arch", i.arch);
    cJSON_AddNumberToObject(o, "kernel_version", i.kernel_version);
    cJSON_AddNumberToObject(o, "split_tokens", i.split_tokens);
    cJSON_AddNumberToObject(o, "tile_tokens", i.tile_tokens);
    cJSON_AddStringToObject(o, "fingerprint", fp);
    cJSON_AddNumberToObject(o, "max_message_bytes", (double)i.max_message_bytes);
    cJSON_AddNumberToObject(o, "max_tokens_per_request", i.max_tokens_per_request);
    cJSON_AddNumberToObject(o, "kv_capacity_tokens", (double)i.kv_capacity_tokens);
    cJSON_AddNumberToObject(o, "kv_pages", i.kv_pages);
    print_json(o);
    return 0;
  }
  printf("server      detattnd %s, protocol %u, at %s\n", i.server_version, i.protocol_version, g.url);
  printf("model       %u layers, %u q heads, %u kv heads, head_dim %u, %s, scale %g, softcap %g, window %u\n",
         m->n_layers, m->n_q_heads, m->n_kv_heads, m->head_dim, m->dtype == DETATTN_FP16 ? "fp16" : "bf16",
         (double)m->scale, (double)m->softcap, m->window);
  printf("numerics    backend %s, arch %s, kernel v%u, split %u tokens, tile %u tokens\n", i.backend, i.arch,
         i.kernel_version, i.split_tokens, i.tile_tokens);
  printf("fingerprint %s\n", fp);
  printf("limits      %llu message bytes, %u tokens per request, KV %llu tokens in %u pages of %u\n",
         (unsigned long long)i.max_message_bytes, i.max_tokens_per_request, (unsigned long long)i.kv_capacity_tokens,
         i.kv_pages, m->page_tokens);
  return 0;
}

static int cmd_stats(detattn_client *c) {
  detattn_stats s;
  int st = detattn_stats_get(c, &s);
  if (st != DETATTN_OK) return call_failed("stats", st);
  if (g.json) {
    cJSON *o = cJSON_CreateObject();
#define N(f) cJSON_AddNumberToObject(o, #f, (double)s.f)
    N(uptime_ms); N(requests); N(errors); N(forwards); N(forward_tokens); N(batches);
    N(batch_tokens_mean); N(batch_tokens_p50); N(batch_tokens_p99); N(batch_tokens_max);
    N(batch_requests_mean); N(batch_requests_max);
    N(queue_us_mean); N(queue_us_p50); N(queue_us_p99); N(queue_us_max);
    N(inrow_items); N(partial_items);
    N(kv_pages_total); N(kv_pages_used); N(kv_pages_free); N(sequences); N(clients);
#undef N
    print_json(o);
    return 0;
  }
  printf("uptime      %.1f s\n", (double)s.uptime_ms / 1000.0);
  printf("requests    %llu (%llu errors), %llu forwards, %llu query tokens\n", (unsigned long long)s.requests,
         (unsigned long long)s.errors, (unsigned long long)s.forwards, (unsigned long long)s.forward_tokens);
  printf("batches     %llu; tokens mean %.1f p50 %.0f p99 %.0f max %.0f; requests mean %.1f max %.0f\n",
         (unsigned long long)s.batches, s.batch_tokens_mean, s.batch_tokens_p50, s.batch_tokens_p99,
         s.batch_tokens_max, s.batch_requests_mean, s.batch_requests_max);
  printf("queue       mean %.0f us, p50 %.0f us, p99 %.0f us, max %.0f us\n", s.queue_us_mean, s.queue_us_p50,
         s.queue_us_p99, s.queue_us_max);
  printf("splits      %llu in-row, %llu partial\n", (unsigned long long)s.inrow_items,
         (unsigned long long)s.partial_items);
  printf("kv pages    %u used, %u free of %u\n", s.kv_pages_used, s.kv_pages_free, s.kv_pages_total);
  printf("sequences   %u open, %u clients\n", s.sequences, s.clients);
  return 0;
}

/* Reads a whole file; *len is its size. NULL on error (message printed). */
static void *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  void *buf = NULL;
  long n;
  if (!f || fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) goto fail;
  if (!(buf = malloc(n ? (size_t)n : 1)) || fread(buf, 1, (size_t)n, f) != (size_t)n) goto fail;
  fclose(f);
  *len = (size_t)n;
  return buf;
fail:
  fprintf(stderr, "detattn: cannot read %s: %s\n", path, strerror(errno));
  free(buf);
  if (f) fclose(f);
  return NULL;
}

static int write_file(const char *path, const void *buf, size_t len) {
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(buf, 1, len, f) != len || fclose(f) != 0) {
    fprintf(stderr, "detattn: cannot write %s: %s\n", path, strerror(errno));
    return -1;
  }
  return 0;
}

static int cmd_forward(detattn_client *c) {
  detattn_server_info info;
  void *q = NULL, *k = NULL, *v = NULL, *o = NULL;
  float *lse = NULL;
  uint64_t seq = 0;
  int st, rc = EXIT_USAGE, opened = 0;

  if ((st = detattn_hello(c, &info)) != DETATTN_OK) return call_failed("hello", st);
  const detattn_model *m = &info.model;
  size_t q_row = (size_t)m->n_q_heads * m->head_dim * 2, kv_row = (size_t)m->n_kv_heads * m->head_dim * 2;
  size_t n;
  if (g.q_file || g.k_file || g.v_file) {
    size_t ql, kl, vl;
    if (!g.q_file || !g.k_file || !g.v_file) {
      fprintf(stderr, "detattn: forward: --q, --k and --v go together\n");
      return EXIT_USAGE;
    }
    if (!(q = read_file(g.q_file, &ql)) || !(k = read_file(g.k_file, &kl)) || !(v = read_file(g.v_file, &vl)))
      goto done;
    n = ql / q_row;
    if (n == 0 || ql != n * q_row || kl != n * kv_row || vl != n * kv_row) {
      fprintf(stderr,
              "detattn: forward: file sizes q %zu, k %zu, v %zu bytes do not hold whole tokens of %zu (q) and %zu "
              "(k, v) bytes, or disagree on the token count\n",
              ql, kl, vl, q_row, kv_row);
      goto done;
    }
  } else {
    da_rng r;
    if (g.tokens < 1) {
      fprintf(stderr, "detattn: forward: --tokens must be at least 1\n");
      return EXIT_USAGE;
    }
    n = (size_t)g.tokens;
    q = malloc(n * q_row);
    k = malloc(n * kv_row);
    v = malloc(n * kv_row);
    if (!q || !k || !v) goto oom;
    da_rng_seed(&r, g.seed);
    da_rng_fill(&r, (da_dtype)m->dtype, q, n * q_row / 2, 1.0);
    da_rng_fill(&r, (da_dtype)m->dtype, k, n * kv_row / 2, 1.0);
    da_rng_fill(&r, (da_dtype)m->dtype, v, n * kv_row / 2, 1.0);
  }
  o = malloc(n * q_row);
  lse = malloc(n * m->n_q_heads * sizeof *lse);
  if (!o || !lse) goto oom;
  rc = EXIT_CALL;
  if ((st = detattn_seq_open(c, &seq)) != DETATTN_OK) {
    call_failed("seq_open", st);
    goto done;
  }
  opened = 1;
  detattn_seq_io io = {.seq = seq, .pos = 0, .n_tokens = (uint32_t)n, .q = q, .k = k, .v = v, .o = o, .lse = lse};
  uint64_t t0 = da_now_ns();
  if ((st = detattn_forward(c, (uint32_t)g.layer, &io, 1)) != DETATTN_OK) {
    call_failed("forward", st);
    goto done;
  }
  double ms = (double)(da_now_ns() - t0) * 1e-6;
  if ((g.o_file && write_file(g.o_file, o, n * q_row)) ||
      (g.lse_file && write_file(g.lse_file, lse, n * m->n_q_heads * sizeof *lse)))
    goto done;
  char fp[24], oh[24], lh[24];
  hex64(fp, sizeof fp, info.fingerprint);
  hex64(oh, sizeof oh, XXH64(o, n * q_row, 0));
  hex64(lh, sizeof lh, XXH64(lse, n * m->n_q_heads * sizeof *lse, 0));
  if (g.json) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "layer", g.layer);
    cJSON_AddNumberToObject(j, "tokens", (double)n);
    cJSON_AddStringToObject(j, "fingerprint", fp);
    cJSON_AddStringToObject(j, "o_xxh64", oh);
    cJSON_AddStringToObject(j, "lse_xxh64", lh);
    cJSON_AddNumberToObject(j, "ms", ms);
    print_json(j);
  } else {
    printf("forward     layer %d, %zu tokens in %.3f ms\nfingerprint %s\no xxh64    %s\nlse xxh64   %s\n", g.layer, n,
           ms, fp, oh, lh);
  }
  rc = 0;
  goto done;
oom:
  fprintf(stderr, "detattn: forward: out of memory\n");
  rc = EXIT_CALL;
done:
  if (opened && (st = detattn_seq_close(c, seq)) != DETATTN_OK && rc == 0) rc = call_failed("seq_close", st);
  free(q);
  free(k);
  free(v);
  free(o);
  free(lse);
  return rc;
}

static int cmd_verify(detattn_client *c) {
  da_verify *v;
  da_verify_result r;
  char msg[512], fp[24], fpb[24];
  int st;
  (void)c;

  g.vcfg.url = g.url;
  g.vcfg.timeout_ms = g.timeout_ms > 0 ? g.timeout_ms : -1;
  if (g.plane_name) {
    static const char *const names[] = {"auto", "copy", "shm", "cuda"};
    int found = -1;
    for (int i = 0; i < 4; i++)
      if (strcmp(g.plane_name, names[i]) == 0) found = i;
    if (found < 0) {
      fprintf(stderr, "detattn: verify: --data-plane %s is not copy, shm, cuda or auto\n", g.plane_name);
      return EXIT_USAGE;
    }
    g.vcfg.data_plane = found;
    g.vcfg.data_plane_set = 1;
  }
  if ((st = da_verify_alloc(&v, &g.vcfg, msg, sizeof msg)) != DETATTN_OK) {
    fprintf(stderr, "detattn: verify: %s\n", msg);
    return st == DETATTN_INVALID_ARGUMENT ? EXIT_USAGE : EXIT_CALL;
  }
  const detattn_server_info *info = da_verify_info(v);
  da_verify_cfg cfg = g.vcfg;
  da_verify_cfg_defaults(&cfg);
  if ((st = da_verify_run(v, &r, msg, sizeof msg)) != DETATTN_OK) {
    fprintf(stderr, "detattn: verify: %s\n", msg);
    da_verify_free(v);
    return EXIT_CALL;
  }
  double tol = g.tol > 0 ? g.tol : info->model.dtype == DETATTN_FP16 ? 4e-3 : 2e-2;
  int ref_ok = !cfg.check_ref || r.max_rel_err <= tol;
  int pass = r.mismatches == 0 && r.outputs_compared > 0 && ref_ok;
  hex64(fp, sizeof fp, r.fingerprint);
  hex64(fpb, sizeof fpb, r.fingerprint_b);
  if (g.json) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "result", pass ? "pass" : "fail");
    cJSON_AddNumberToObject(j, "seed", (double)cfg.seed);
    cJSON_AddNumberToObject(j, "seqs", da_verify_n_seqs(v));
    cJSON_AddNumberToObject(j, "layers_used", da_verify_n_layers(v));
    cJSON_AddNumberToObject(j, "clients", cfg.clients);
    cJSON_AddNumberToObject(j, "outputs_compared", (double)r.outputs_compared);
    cJSON_AddNumberToObject(j, "mismatches", (double)r.mismatches);
    cJSON_AddStringToObject(j, "fingerprint", fp);
    cJSON_AddStringToObject(j, "data_plane",
                            r.data_plane_used < 0 ? "mixed" : detattn_data_plane_name((detattn_data_plane)r.data_plane_used));
    if (cfg.url_b) cJSON_AddStringToObject(j, "fingerprint_b", fpb);
    cJSON_AddNumberToObject(j, "tokens_per_pass", (double)r.tokens);
    cJSON_AddNumberToObject(j, "forwards_reference", (double)r.forwards_ref);
    cJSON_AddNumberToObject(j, "forwards_concurrent", (double)r.forwards_concurrent);
    cJSON_AddNumberToObject(j, "reference_seconds", r.ref_seconds);
    cJSON_AddNumberToObject(j, "concurrent_seconds", r.concurrent_seconds);
    if (r.mismatches) cJSON_AddStringToObject(j, "first_mismatch", r.first_mismatch);
    if (cfg.check_ref) {
      cJSON_AddNumberToObject(j, "max_rel_err", r.max_rel_err);
      cJSON_AddNumberToObject(j, "max_lse_abs_err", r.max_lse_abs_err);
      cJSON_AddNumberToObject(j, "tolerance", tol);
    }
    print_json(j);
  } else {
    printf("verify           seed %llu: %d sequences x %d layers, prompts up to %d tokens + %d decode steps\n",
           (unsigned long long)cfg.seed, da_verify_n_seqs(v), da_verify_n_layers(v), cfg.max_prompt,
           cfg.decode_steps);
    printf("reference pass   %llu forwards, one at a time, in %.2f s\n", (unsigned long long)r.forwards_ref,
           r.ref_seconds);
    printf("concurrent pass  %llu forwards from %d clients, other chunkings, data plane %s, in %.2f s\n",
           (unsigned long long)r.forwards_concurrent, cfg.clients,
           r.data_plane_used < 0 ? "mixed" : detattn_data_plane_name((detattn_data_plane)r.data_plane_used),
           r.concurrent_seconds);
    printf("outputs compared %llu (o and lse, bitwise)\n", (unsigned long long)r.outputs_compared);
    printf("mismatches       %llu%s%s\n", (unsigned long long)r.mismatches, r.mismatches ? ", first: " : "",
           r.first_mismatch);
    printf("fingerprint      %s\n", fp);
    if (cfg.url_b) printf("fingerprint B    %s (%s)\n", fpb, r.fingerprint_b == r.fingerprint ? "equal" : "different");
    if (cfg.check_ref)
      printf("fp64 reference   max rel. error %.3g (tolerance %.3g), max lse abs. error %.3g\n", r.max_rel_err, tol,
             r.max_lse_abs_err);
    printf("result           %s\n", pass ? "PASS: bit-identical under concurrency" : "FAIL");
  }
  da_verify_free(v);
  return pass ? 0 : EXIT_MISMATCH;
}

int main(int argc, char **argv) {
  const command *cmd;
  detattn_client *c = NULL;
  int st, rc;

  if (parse(argc, argv, &cmd) != 0) {
    usage(stderr, NULL);
    return EXIT_USAGE;
  }
  if (g.help || !cmd) {
    usage(g.help ? stdout : stderr, cmd);
    return g.help ? 0 : EXIT_USAGE;
  }
  default_url();
  if (cmd->run != cmd_verify) {
    detattn_connect_opts co;
    detattn_connect_opts_init(&co);
    co.data_plane = DETATTN_PLANE_COPY;
    co.tls_ca = g.vcfg.tls_ca;
    co.tls_cert = g.vcfg.tls_cert;
    co.tls_key = g.vcfg.tls_key;
    if ((st = detattn_connect_ex(&c, g.url, &co)) != DETATTN_OK) return call_failed("connect", st);
    detattn_set_timeout(c, g.timeout_ms);
  }
  rc = cmd->run(c);
  detattn_close(c);
  return rc;
}
