/*
 * detattn-ipc-bench — what the daemon adds on top of the transport: the round-trip latency
 * of a minimal Forward (1 token, one sequence) through libdetattn and detattnd, against a
 * raw nng req0/rep0 ping of the same request and reply sizes to an echo server in a thread
 * of this process, measured in the same run. Both loops are closed (one request in flight)
 * and bounded by --seconds each.
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

/* Packed sizes of a 1-token Forward request and its reply for model m. */
static void message_sizes(const detattn_model *m, size_t *req, size_t *rep) {
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
  fs.q = (ProtobufCBinaryData){qb, dummy};
  fs.k = (ProtobufCBinaryData){kvb, dummy};
  fs.v = (ProtobufCBinaryData){kvb, dummy};
  f.n_seqs = 1;
  f.seqs = &fsp;
  rq.id = 1000000;
  rq.op_case = DETATTN__V1__REQUEST__OP_FORWARD;
  rq.forward = &f;
  *req = detattn__v1__request__get_packed_size(&rq);
  so.o = (ProtobufCBinaryData){qb, dummy};
  fr.n_seqs = 1;
  fr.seqs = &sop;
  rs.id = 1000000;
  rs.status = &st;
  rs.result_case = DETATTN__V1__RESPONSE__RESULT_FORWARD;
  rs.forward = &fr;
  *rep = detattn__v1__response__get_packed_size(&rs);
}

static int bench_forward(const char *url, double seconds, detattn_model *model, uint64_t *fp, samples *s) {
  detattn_client *c;
  detattn_server_info info;
  uint64_t seq;
  int st;

  if ((st = detattn_connect(&c, url)) != DETATTN_OK) goto fail;
  detattn_set_timeout(c, 10000);
  if ((st = detattn_hello(c, &info)) != DETATTN_OK || (st = detattn_seq_open(c, &seq)) != DETATTN_OK) goto fail_c;
  *model = info.model;
  *fp = info.fingerprint;
  const detattn_model *m = &info.model;
  size_t qn = (size_t)m->n_q_heads * m->head_dim, kvn = (size_t)m->n_kv_heads * m->head_dim;
  uint16_t *q = malloc(qn * 2), *k = malloc(kvn * 2), *v = malloc(kvn * 2), *o = malloc(qn * 2);
  da_rng r;
  da_rng_seed(&r, 42);
  da_rng_fill(&r, (da_dtype)m->dtype, q, qn, 1.0);
  da_rng_fill(&r, (da_dtype)m->dtype, k, kvn, 1.0);
  da_rng_fill(&r, (da_dtype)m->dtype, v, kvn, 1.0);
  detattn_seq_io io = {.seq = seq, .pos = 0, .n_tokens = 1, .q = q, .k = k, .v = v, .o = o, .lse = NULL};
  uint64_t end = 0, warm = 200;
  for (uint64_t i = 0; s->n < MAX_SAMPLES; i++) {
    if (i == warm) end = da_now_ns() + (uint64_t)(seconds * 1e9);
    uint64_t t0 = da_now_ns();
    if ((st = detattn_forward(c, 0, &io, 1)) != DETATTN_OK) break;
    uint64_t t1 = da_now_ns();
    if (i >= warm) {
      s->ns[s->n++] = t1 - t0;
      s->seconds += (double)(t1 - t0) * 1e-9;
    }
    if ((st = detattn_seq_truncate(c, seq, 0)) != DETATTN_OK) break;
    if (i >= warm && t1 >= end) break;
  }
  free(q);
  free(k);
  free(v);
  free(o);
  if (st == DETATTN_OK) st = detattn_seq_close(c, seq);
fail_c:
  if (st != DETATTN_OK) fprintf(stderr, "detattn-ipc-bench: %s: %s\n", detattn_status_name(st), detattn_errmsg());
  detattn_close(c);
  return st;
fail:
  fprintf(stderr, "detattn-ipc-bench: connect: %s: %s\n", detattn_status_name(st), detattn_errmsg());
  return st;
}

static int bench_ping(const char *url, size_t req_len, size_t rep_len, double seconds, samples *s) {
  echo e = {.reply_len = rep_len};
  nng_socket req;
  int rv;

  if ((rv = nng_rep0_open(&e.sock)) != 0 || (rv = nng_listen(e.sock, url, NULL, 0)) != 0) {
    fprintf(stderr, "detattn-ipc-bench: echo server on %s: %s\n", url, nng_strerror(rv));
    return -1;
  }
  pthread_create(&e.thr, NULL, echo_main, &e);
  if ((rv = nng_req0_open(&req)) != 0 || (rv = nng_socket_set_ms(req, NNG_OPT_REQ_RESENDTIME, NNG_DURATION_INFINITE)) ||
      (rv = nng_socket_set_ms(req, NNG_OPT_RECVTIMEO, 10000)) || (rv = nng_dial(req, url, NULL, 0)) != 0) {
    fprintf(stderr, "detattn-ipc-bench: ping client: %s\n", nng_strerror(rv));
    goto done;
  }
  uint64_t end = 0, warm = 200;
  for (uint64_t i = 0; s->n < MAX_SAMPLES; i++) {
    nng_msg *m;
    if (i == warm) end = da_now_ns() + (uint64_t)(seconds * 1e9);
    uint64_t t0 = da_now_ns();
    if ((rv = nng_msg_alloc(&m, req_len)) != 0) break;
    memset(nng_msg_body(m), 0x5a, req_len);
    if ((rv = nng_sendmsg(req, m, 0)) != 0) {
      nng_msg_free(m);
      break;
    }
    if ((rv = nng_recvmsg(req, &m, 0)) != 0) break;
    nng_msg_free(m);
    uint64_t t1 = da_now_ns();
    if (i >= warm) {
      s->ns[s->n++] = t1 - t0;
      s->seconds += (double)(t1 - t0) * 1e-9;
      if (t1 >= end) break;
    }
  }
  if (rv) fprintf(stderr, "detattn-ipc-bench: ping: %s\n", nng_strerror(rv));
  nng_close(req);
done:
  nng_close(e.sock);
  pthread_join(e.thr, NULL);
  return rv ? -1 : 0;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: detattn-ipc-bench --url URL [--seconds S] [--json]\n\n"
          "Round-trip latency of a minimal Forward (1 token) through libdetattn and detattnd, against a\n"
          "raw nng req/rep ping of the same message sizes to an echo server in this process, same run.\n\n"
          "  --url URL      the daemon (default $DETATTN_URL)\n"
          "  --ping-url URL where the echo server listens (default ipc:// in a temporary directory)\n"
          "  --seconds S    measured time per loop (default 2, at most 60)\n"
          "  --json         print JSON\n");
}

int main(int argc, char **argv) {
  const char *url = getenv("DETATTN_URL"), *ping_url = NULL;
  double seconds = 2.0;
  int json = 0, rc = 1;
  char dir[] = "/tmp/detattn-ipcbench-XXXXXX", sock_url[128] = "", fp[24];

  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--url") == 0 && i + 1 < argc) url = argv[++i];
    else if (strcmp(argv[i], "--ping-url") == 0 && i + 1 < argc) ping_url = argv[++i];
    else if (strcmp(argv[i], "--seconds") == 0 && i + 1 < argc) seconds = strtod(argv[++i], NULL);
    else if (strcmp(argv[i], "--json") == 0) json = 1;
    else if (strcmp(argv[i], "--help") == 0) {
      usage(stdout);
      return 0;
    } else {
      usage(stderr);
      return 2;
    }
  }
  if (!url || !(seconds > 0 && seconds <= 60)) {
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
  detattn_model m;
  uint64_t fingerprint = 0;
  size_t req_len = 0, rep_len = 0;
  if (!fw.ns || !pg.ns) goto done;
  if (bench_forward(url, seconds, &m, &fingerprint, &fw) != DETATTN_OK) goto done;
  message_sizes(&m, &req_len, &rep_len);
  if (bench_ping(ping_url, req_len, rep_len, seconds, &pg) != 0) goto done;
  qsort(fw.ns, fw.n, sizeof *fw.ns, cmp_u64);
  qsort(pg.ns, pg.n, sizeof *pg.ns, cmp_u64);
  double f50 = pct_us(&fw, 0.50), f99 = pct_us(&fw, 0.99), p50 = pct_us(&pg, 0.50), p99 = pct_us(&pg, 0.99);
  double frate = fw.seconds > 0 ? (double)fw.n / fw.seconds : 0, prate = pg.seconds > 0 ? (double)pg.n / pg.seconds : 0;
  snprintf(fp, sizeof fp, "%016llx", (unsigned long long)fingerprint);
  if (json) {
    cJSON *o = cJSON_CreateObject(), *f = cJSON_AddObjectToObject(o, "forward"), *p = cJSON_AddObjectToObject(o, "ping");
    cJSON_AddStringToObject(o, "url", url);
    cJSON_AddStringToObject(o, "ping_url", ping_url);
    cJSON_AddStringToObject(o, "fingerprint", fp);
    cJSON_AddNumberToObject(o, "request_bytes", (double)req_len);
    cJSON_AddNumberToObject(o, "reply_bytes", (double)rep_len);
    cJSON_AddNumberToObject(f, "n", (double)fw.n);
    cJSON_AddNumberToObject(f, "p50_us", f50);
    cJSON_AddNumberToObject(f, "p99_us", f99);
    cJSON_AddNumberToObject(f, "req_per_s", frate);
    cJSON_AddNumberToObject(p, "n", (double)pg.n);
    cJSON_AddNumberToObject(p, "p50_us", p50);
    cJSON_AddNumberToObject(p, "p99_us", p99);
    cJSON_AddNumberToObject(p, "req_per_s", prate);
    cJSON_AddNumberToObject(o, "overhead_ratio_p50", p50 > 0 ? f50 / p50 : 0);
    char *s = cJSON_Print(o);
    puts(s);
    free(s);
    cJSON_Delete(o);
  } else {
    printf("detattn-ipc-bench: %s; model %u q / %u kv heads, head_dim %u; request %zu B, reply %zu B; %.1f s each\n",
           url, m.n_q_heads, m.n_kv_heads, m.head_dim, req_len, rep_len, seconds);
    printf("| loop                          |       n | p50 us | p99 us |   req/s |\n");
    printf("|-------------------------------|--------:|-------:|-------:|--------:|\n");
    printf("| Forward 1 token (detattnd)    | %7zu | %6.1f | %6.1f | %7.0f |\n", fw.n, f50, f99, frate);
    printf("| nng req/rep ping, same sizes  | %7zu | %6.1f | %6.1f | %7.0f |\n", pg.n, p50, p99, prate);
    printf("overhead: p50 %.2fx the ping (+%.1f us), p99 %.2fx\n", p50 > 0 ? f50 / p50 : 0, f50 - p50,
           p99 > 0 ? f99 / p99 : 0);
  }
  rc = 0;
done:
  free(fw.ns);
  free(pg.ns);
  if (sock_url[0]) {
    char path[160];
    snprintf(path, sizeof path, "%s/echo.sock", dir);
    unlink(path);
    rmdir(dir);
  }
  return rc;
}
