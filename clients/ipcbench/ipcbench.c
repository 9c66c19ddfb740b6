/*
 * detattn-ipc-bench — what the daemon adds on top of the transport: the round-trip latency
 * of a minimal Forward (1 token, one sequence) through libdetattn and detattnd, over nng and
 * over the same-host doorbell (--doorbell), against a raw nng req0/rep0 ping of the nng
 * Forward's request and reply sizes to an echo server in a thread of this process, measured
 * in the same run. Every loop is closed (one request in flight) and bounded by --seconds.
 * Both Forward loops use the client's default data plane (shm on ipc://).
 *
 * The Forward loop truncates its sequence back to 0 after every Forward, outside the timed
 * part, so every timed Forward attends over exactly one key.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <nng/protocol/reqrep0/req.h>

#include "da.h"
#include "detattn.h"
#include "detattn.pb-c.h"

#define MAX_SAMPLES (1u << 21)

typedef struct samples {
  uint64_t *ns;
  size_t n;
  double seconds; /* sum of the timed intervals */
} samples;

typedef struct echo {
  nng_socket sock;
  size_t reply_len;
  pthread_t thr;
} echo;

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static double pct_us(samples *s, double p) {
  if (!s->n) return 0;
  size_t i = (size_t)(p * (double)(s->n - 1) + 0.5);
  return (double)s->ns[i] * 1e-3;
}

static void *echo_main(void *arg) {
  echo *e = arg;
  for (;;) {
    nng_msg *m;
    if (nng_recvmsg(e->sock, &m, 0) != 0) break;
    /* Same reply size as the daemon's Forward reply. */
    if (nng_msg_realloc(m, e->reply_len) != 0 || nng_sendmsg(e->sock, m, 0) != 0) nng_msg_free(m);
  }
  return NULL;
}

/* Packed sizes of a 1-token Forward request and its reply for model m, with tensors as
 * bytes or, by_ref, as arena references (the shm plane). */
static void message_sizes(const detattn_model *m, int by_ref, size_t *req, size_t *rep) {
  Detattn__V1__ForwardSeq fs = DETATTN__V1__FORWARD_SEQ__INIT;
  Detattn__V1__ForwardSeq *fsp = &fs;
  Detattn__V1__Forward f = DETATTN__V1__FORWARD__INIT;
  Detattn__V1__Request rq = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__ForwardSeqOut so = DETATTN__V1__FORWARD_SEQ_OUT__INIT;
  Detattn__V1__ForwardSeqOut *sop = &so;
  Detattn__V1__ForwardReply fr = DETATTN__V1__FORWARD_REPLY__INIT;
  Detattn__V1__Status st = DETATTN__V1__STATUS__INIT;
  Detattn__V1__Response rs = DETATTN__V1__RESPONSE__INIT;
  size_t qb = (size_t)m->n_q_heads * m->head_dim * 2, kvb = (size_t)m->n_kv_heads * m->head_dim * 2;
  static uint8_t dummy[1];

  fs.seq = 1;
  fs.pos = 0;
  fs.n_tokens = 1;
  Detattn__V1__TensorRef refs[4];
  for (int i = 0; i < 4; i++) {
    refs[i] = (Detattn__V1__TensorRef)DETATTN__V1__TENSOR_REF__INIT;
    refs[i].arena = 1;
    refs[i].offset = 1u << 20;
    refs[i].length = i == 0 || i == 3 ? qb : kvb;
  }
  if (by_ref) {
    fs.q_ref = &refs[0];
    fs.k_ref = &refs[1];
    fs.v_ref = &refs[2];
    fs.o_ref = &refs[3];
  } else {
    fs.q = (ProtobufCBinaryData){qb, dummy};
    fs.k = (ProtobufCBinaryData){kvb, dummy};
    fs.v = (ProtobufCBinaryData){kvb, dummy};
  }
  f.n_seqs = 1;
  f.seqs = &fsp;
  rq.id = 1000000;
  rq.op_case = DETATTN__V1__REQUEST__OP_FORWARD;
  rq.forward = &f;
  *req = detattn__v1__request__get_packed_size(&rq);
  if (!by_ref) so.o = (ProtobufCBinaryData){qb, dummy};
  fr.n_seqs = 1;
  fr.seqs = &sop;
  rs.id = 1000000;
  rs.status = &st;
  rs.result_case = DETATTN__V1__RESPONSE__RESULT_FORWARD;
  rs.forward = &fr;
  *rep = detattn__v1__response__get_packed_size(&rs);
}

/* A Forward loop's client: over nng (doorbell OFF) or over the doorbell (ON). */
typedef struct fwd_loop {
  detattn_client *c;
  uint64_t seq;
  uint16_t *q, *k, *v, *o;
  detattn_seq_io io;
} fwd_loop;

static int fail_st(const char *what, int st) {
  fprintf(stderr, "detattn-ipc-bench: %s: %s: %s\n", what, detattn_status_name(st), detattn_errmsg());
  return st;
}

/* Connects (ON: refused when the daemon offers no doorbell) and opens the sequence. */
static int fwd_open(fwd_loop *f, const char *url, detattn_doorbell bell, detattn_server_info *info) {
  detattn_connect_opts co;
  int st;

  memset(f, 0, sizeof *f);
  detattn_connect_opts_init(&co);
  co.doorbell = bell;
  co.timeout_ms = 10000;
  if ((st = detattn_connect_ex(&f->c, url, &co)) != DETATTN_OK) return fail_st("connect", st);
  if ((st = detattn_hello(f->c, info)) != DETATTN_OK || (st = detattn_seq_open(f->c, &f->seq)) != DETATTN_OK)
    return fail_st("hello", st);
  if (bell == DETATTN_DOORBELL_ON && detattn_data_plane_get(f->c) == DETATTN_PLANE_COPY) {
    fprintf(stderr, "detattn-ipc-bench: the daemon offers no shared-memory plane: a copy Forward does not fit the "
                    "doorbell\n");
    return DETATTN_FAILED_PRECONDITION;
  }
  const detattn_model *m = &info->model;
  size_t qn = (size_t)m->n_q_heads * m->head_dim, kvn = (size_t)m->n_kv_heads * m->head_dim;
  f->q = malloc(qn * 2);
  f->k = malloc(kvn * 2);
  f->v = malloc(kvn * 2);
  f->o = malloc(qn * 2);
  if (!f->q || !f->k || !f->v || !f->o) return DETATTN_RESOURCE_EXHAUSTED;
  da_rng r;
  da_rng_seed(&r, 42);
  da_rng_fill(&r, (da_dtype)m->dtype, f->q, qn, 1.0);
  da_rng_fill(&r, (da_dtype)m->dtype, f->k, kvn, 1.0);
  da_rng_fill(&r, (da_dtype)m->dtype, f->v, kvn, 1.0);
  f->io = (detattn_seq_io){.seq = f->seq, .pos = 0, .n_tokens = 1, .q = f->q, .k = f->k, .v = f->v, .o = f->o};
  return DETATTN_OK;
}

/* Runs Forwards for seconds (after warm untimed ones); the sequence is truncated back to 0
 * after each, outside the timed part. */
static int fwd_run(fwd_loop *f, double seconds, int warm, samples *s) {
  uint64_t end = 0;
  int st = DETATTN_OK;
  for (int i = 0; s->n < MAX_SAMPLES; i++) {
    if (i == warm) end = da_now_ns() + (uint64_t)(seconds * 1e9);
    uint64_t t0 = da_now_ns();
    if ((st = detattn_forward(f->c, 0, &f->io, 1)) != DETATTN_OK) return fail_st("forward", st);
    uint64_t t1 = da_now_ns();
    if (i >= warm) {
      s->ns[s->n++] = t1 - t0;
      s->seconds += (double)(t1 - t0) * 1e-9;
    }
    if ((st = detattn_seq_truncate(f->c, f->seq, 0)) != DETATTN_OK) return fail_st("truncate", st);
    if (i >= warm && t1 >= end) break;
  }
  return st;
}

static void fwd_close(fwd_loop *f) {
  if (f->c && f->seq) detattn_seq_close(f->c, f->seq);
  detattn_close(f->c);
  free(f->q);
  free(f->k);
  free(f->v);
  free(f->o);
  memset(f, 0, sizeof *f);
}

/* The raw nng ping: an echo server in a thread of this process and a req0 client. */
typedef struct ping_loop {
  echo e;
  nng_socket req;
  int listening, dialed;
  size_t req_len;
} ping_loop;

static int ping_open(ping_loop *p, const char *url, size_t req_len, size_t rep_len) {
  int rv;
  memset(p, 0, sizeof *p);
  p->e.reply_len = rep_len;
  p->req_len = req_len;
  if ((rv = nng_rep0_open(&p->e.sock)) != 0 || (rv = nng_listen(p->e.sock, url, NULL, 0)) != 0) {
    fprintf(stderr, "detattn-ipc-bench: echo server on %s: %s\n", url, nng_strerror(rv));
    return -1;
  }
  pthread_create(&p->e.thr, NULL, echo_main, &p->e);
  p->listening = 1;
  if ((rv = nng_req0_open(&p->req)) != 0 ||
      (rv = nng_socket_set_ms(p->req, NNG_OPT_REQ_RESENDTIME, NNG_DURATION_INFINITE)) ||
      (rv = nng_socket_set_ms(p->req, NNG_OPT_RECVTIMEO, 10000)) || (rv = nng_dial(p->req, url, NULL, 0)) != 0) {
    fprintf(stderr, "detattn-ipc-bench: ping client: %s\n", nng_strerror(rv));
    return -1;
  }
  p->dialed = 1;
  return 0;
}

static int ping_run(ping_loop *p, double seconds, int warm, samples *s) {
  uint64_t end = 0;
  int rv = 0;
  for (int i = 0; s->n < MAX_SAMPLES; i++) {
    nng_msg *m;
    if (i == warm) end = da_now_ns() + (uint64_t)(seconds * 1e9);
    uint64_t t0 = da_now_ns();
    if ((rv = nng_msg_alloc(&m, p->req_len)) != 0) break;
    memset(nng_msg_body(m), 0x5a, p->req_len);
    if ((rv = nng_sendmsg(p->req, m, 0)) != 0) {
      nng_msg_free(m);
      break;
    }
    if ((rv = nng_recvmsg(p->req, &m, 0)) != 0) break;
    nng_msg_free(m);
    uint64_t t1 = da_now_ns();
    if (i >= warm) {
      s->ns[s->n++] = t1 - t0;
      s->seconds += (double)(t1 - t0) * 1e-9;
      if (t1 >= end) break;
    }
  }
  if (rv) fprintf(stderr, "detattn-ipc-bench: ping: %s\n", nng_strerror(rv));
  return rv ? -1 : 0;
}

static void ping_close(ping_loop *p) {
  if (p->dialed) nng_close(p->req);
  if (p->listening) {
    nng_close(p->e.sock);
    pthread_join(p->e.thr, NULL);
  }
  memset(p, 0, sizeof *p);
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: detattn-ipc-bench --url URL [--seconds S] [--rounds N] [--doorbell off|on|both] [--json]\n\n"
          "Round-trip latency of a minimal Forward (1 token) through libdetattn and detattnd, over nng and\n"
          "over the same-host doorbell, against a raw nng req/rep ping of the nng Forward's message sizes to\n"
          "an echo server in this process, same run.\n\n"
          "  --url URL      the daemon (default $DETATTN_URL)\n"
          "  --ping-url URL where the echo server listens (default ipc:// in a temporary directory)\n"
          "  --seconds S    measured time per loop (default 2, at most 60)\n"
          "  --rounds N     the loops take turns, N rounds of S/N seconds each, so that a busy machine's\n"
          "                 noise falls on all of them alike (default 5)\n"
          "  --doorbell M   off: the Forward loop over nng only; on: over the doorbell only (needs an ipc://\n"
          "                 daemon that offers it); both (default): both loops, nng first\n"
          "  --json         print JSON\n");
}

static void add_loop(cJSON *o, const char *name, samples *s) {
  cJSON *f = cJSON_AddObjectToObject(o, name);
  cJSON_AddNumberToObject(f, "n", (double)s->n);
  cJSON_AddNumberToObject(f, "p50_us", pct_us(s, 0.50));
  cJSON_AddNumberToObject(f, "p99_us", pct_us(s, 0.99));
  cJSON_AddNumberToObject(f, "req_per_s", s->seconds > 0 ? (double)s->n / s->seconds : 0);
}

static void print_row(const char *name, samples *s) {
  printf("| %-30s | %7zu | %6.1f | %6.1f | %7.0f |\n", name, s->n, pct_us(s, 0.50), pct_us(s, 0.99),
         s->seconds > 0 ? (double)s->n / s->seconds : 0);
}

int main(int argc, char **argv) {
  const char *url = getenv("DETATTN_URL"), *ping_url = NULL, *bell = "both";
  double seconds = 2.0;
  int json = 0, rc = 1, rounds = 5;
  char dir[] = "/tmp/detattn-ipcbench-XXXXXX", sock_url[128] = "", fp[24];

  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--url") == 0 && i + 1 < argc) url = argv[++i];
    else if (strcmp(argv[i], "--ping-url") == 0 && i + 1 < argc) ping_url = argv[++i];
    else if (strcmp(argv[i], "--seconds") == 0 && i + 1 < argc) seconds = strtod(argv[++i], NULL);
    else if (strcmp(argv[i], "--doorbell") == 0 && i + 1 < argc) bell = argv[++i];
    else if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc) rounds = atoi(argv[++i]);
    else if (strcmp(argv[i], "--json") == 0) json = 1;
    else if (strcmp(argv[i], "--help") == 0) {
      usage(stdout);
      return 0;
    } else {
      usage(stderr);
      return 2;
    }
  }
  int want_nng = strcmp(bell, "off") == 0 || strcmp(bell, "both") == 0;
  int want_bell = strcmp(bell, "on") == 0 || strcmp(bell, "both") == 0;
  if (!url || !(seconds > 0 && seconds <= 60) || !(want_nng || want_bell) || rounds < 1 || rounds > 1000) {
    usage(stderr);
    return 2;
  }
  if (!ping_url) {
    if (!mkdtemp(dir)) {
      fprintf(stderr, "detattn-ipc-bench: mkdtemp: %s\n", strerror(errno));
      return 1;
    }
    snprintf(sock_url, sizeof sock_url, "ipc://%s/echo.sock", dir);
    ping_url = sock_url;
  }
  samples fw = {calloc(MAX_SAMPLES, sizeof(uint64_t)), 0, 0}, pg = {calloc(MAX_SAMPLES, sizeof(uint64_t)), 0, 0};
  samples fb = {calloc(MAX_SAMPLES, sizeof(uint64_t)), 0, 0};
  detattn_model m;
  detattn_data_plane plane = DETATTN_PLANE_COPY;
  uint64_t fingerprint = 0;
  size_t req_len = 0, rep_len = 0;
  fwd_loop ln = {0}, lb = {0};
  ping_loop lp = {0};
  detattn_server_info info;
  if (!fw.ns || !pg.ns || !fb.ns) goto done;
  if (want_nng && fwd_open(&ln, url, DETATTN_DOORBELL_OFF, &info) != DETATTN_OK) goto done;
  if (want_bell && fwd_open(&lb, url, DETATTN_DOORBELL_ON, &info) != DETATTN_OK) goto done;
  m = info.model;
  fingerprint = info.fingerprint;
  plane = detattn_data_plane_get(want_nng ? ln.c : lb.c);
  message_sizes(&m, plane != DETATTN_PLANE_COPY, &req_len, &rep_len);
  if (ping_open(&lp, ping_url, req_len, rep_len) != 0) goto done;
  for (int r = 0; r < rounds; r++) {
    double t = seconds / rounds;
    int warm = r == 0 ? 200 : 20;
    if (want_nng && fwd_run(&ln, t, warm, &fw) != DETATTN_OK) goto done;
    if (want_bell && fwd_run(&lb, t, warm, &fb) != DETATTN_OK) goto done;
    if (ping_run(&lp, t, warm, &pg) != 0) goto done;
  }
  qsort(fw.ns, fw.n, sizeof *fw.ns, cmp_u64);
  qsort(fb.ns, fb.n, sizeof *fb.ns, cmp_u64);
  qsort(pg.ns, pg.n, sizeof *pg.ns, cmp_u64);
  double f50 = pct_us(&fw, 0.50), f99 = pct_us(&fw, 0.99), p50 = pct_us(&pg, 0.50), p99 = pct_us(&pg, 0.99);
  double b50 = pct_us(&fb, 0.50), b99 = pct_us(&fb, 0.99);
  snprintf(fp, sizeof fp, "%016llx", (unsigned long long)fingerprint);
  if (json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "url", url);
    cJSON_AddStringToObject(o, "ping_url", ping_url);
    cJSON_AddStringToObject(o, "fingerprint", fp);
    cJSON_AddStringToObject(o, "data_plane", detattn_data_plane_name(plane));
    cJSON_AddNumberToObject(o, "request_bytes", (double)req_len);
    cJSON_AddNumberToObject(o, "reply_bytes", (double)rep_len);
    if (want_nng) add_loop(o, "forward", &fw);
    if (want_bell) add_loop(o, "forward_doorbell", &fb);
    add_loop(o, "ping", &pg);
    if (want_nng) cJSON_AddNumberToObject(o, "overhead_ratio_p50", p50 > 0 ? f50 / p50 : 0);
    if (want_bell) cJSON_AddNumberToObject(o, "doorbell_ratio_p50", p50 > 0 ? b50 / p50 : 0);
    char *s = cJSON_Print(o);
    puts(s);
    free(s);
    cJSON_Delete(o);
  } else {
    printf("detattn-ipc-bench: %s; model %u q / %u kv heads, head_dim %u; %s plane; nng request %zu B, reply %zu B; "
           "%.1f s each\n", url, m.n_q_heads, m.n_kv_heads, m.head_dim, detattn_data_plane_name(plane), req_len,
           rep_len, seconds);
    printf("| loop                           |       n | p50 us | p99 us |   req/s |\n");
    printf("|--------------------------------|--------:|-------:|-------:|--------:|\n");
    if (want_nng) print_row("Forward 1 token, nng", &fw);
    if (want_bell) print_row("Forward 1 token, doorbell", &fb);
    print_row("nng req/rep ping, same sizes", &pg);
    if (want_nng)
      printf("nng Forward: p50 %.2fx the ping (+%.1f us), p99 %.2fx\n", p50 > 0 ? f50 / p50 : 0, f50 - p50,
             p99 > 0 ? f99 / p99 : 0);
    if (want_bell)
      printf("doorbell Forward: p50 %.2fx the ping (%+.1f us), p99 %.2fx\n", p50 > 0 ? b50 / p50 : 0, b50 - p50,
             p99 > 0 ? b99 / p99 : 0);
  }
  rc = 0;
done:
  fwd_close(&ln);
  fwd_close(&lb);
  ping_close(&lp);
  free(fw.ns);
  free(fb.ns);
  free(pg.ns);
  if (sock_url[0]) {
    char path[160];
    snprintf(path, sizeof path, "%s/echo.sock", dir);
    unlink(path);
    rmdir(dir);
  }
  return rc;
}
