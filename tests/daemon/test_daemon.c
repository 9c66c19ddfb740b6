/*
 * test_daemon.c — integration tests against the real detattnd (CPU backend, small models),
 * one daemon per test on an ipc:// socket in a temporary directory (daemon_proc.h).
 * Each tcase is its own ctest (CK_RUN_CASE): daemon_verify, daemon_cli, daemon_ipcbench,
 * daemon_ab, daemon_bad_input, daemon_client_killed, daemon_sigterm, daemon_phases.
 *
 * Inputs are seeded random (DETATTN_TEST_SEED overrides; failures print the seed); outputs
 * are checked against the fp64 reference of tests/common (da_testutil).
 */
#include <check.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>

#include "da.h"
#include "daemon_proc.h"
#include "detattn.h"
#include "detattn.pb-c.h"
#include "testutil.h"
#include "verify.h"

static da_daemon_proc D, D2, D3;
static uint64_t seed;

static void start_daemon(const char *const *args) {
  seed = da_test_seed(0x5eedda17ull);
  if (da_daemon_start(&D, DETATTND_PATH, args) != 0) ck_abort_msg("detattnd did not start");
}

static void teardown(void) {
  da_daemon_stop(&D3);
  da_daemon_stop(&D2);
  da_daemon_stop(&D);
  nng_fini(); /* let nng reap closed sockets before exit (LeakSanitizer) */
}

static da_model to_da_model(const detattn_model *m) {
  da_model x = {.n_layers = (int)m->n_layers, .n_q_heads = (int)m->n_q_heads, .n_kv_heads = (int)m->n_kv_heads,
                .head_dim = (int)m->head_dim, .dtype = (da_dtype)m->dtype, .scale = m->scale,
                .softcap = m->softcap, .window = (int)m->window};
  return x;
}

static double tolerance(const detattn_model *m) { return m->dtype == DETATTN_FP16 ? 4e-3 : 2e-2; }

static detattn_client *connect_ok(void) {
  detattn_client *c;
  ck_assert_int_eq(detattn_connect(&c, D.url), DETATTN_OK);
  detattn_set_timeout(c, 20000);
  return c;
}

static detattn_stats stats_ok(detattn_client *c) {
  detattn_stats s;
  int st = detattn_stats_get(c, &s);
  ck_assert_msg(st == DETATTN_OK, "stats: %s: %s", detattn_status_name(st), detattn_errmsg());
  return s;
}

/* The daemon holds no sequence and no KV page. */
static void assert_daemon_empty(void) {
  detattn_client *c = connect_ok();
  detattn_stats s = stats_ok(c);
  ck_assert_uint_eq(s.sequences, 0);
  ck_assert_uint_eq(s.kv_pages_used, 0);
  detattn_close(c);
}

/* ---- verify: concurrency does not change a bit ---- */

#define VERIFY_ARGS(split)                                                                                   \
  "--layers", "3", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64", "--dtype", "bf16", "--page-tokens", \
      "16", "--kv-tokens", "8192", "--split-tokens", split, "--tile-tokens", "16", "--threads", "2", NULL

static void setup_verify(void) {
  static const char *const args[] = {VERIFY_ARGS("64")};
  start_daemon(args);
}

START_TEST(eight_concurrent_clients_match_the_one_at_a_time_pass_bitwise) {
  da_verify_cfg cfg = {.url = D.url, .seed = seed, .seqs = 16, .clients = 8, .layers_used = 3,
                       .max_prompt = 150, .decode_steps = 6, .check_ref = 1};
  da_verify *v;
  da_verify_result r;
  char msg[512];

  int st = da_verify_alloc(&v, &cfg, msg, sizeof msg);
  ck_assert_msg(st == DETATTN_OK, "verify setup: %s (seed %llu)", msg, (unsigned long long)seed);
  st = da_verify_run(v, &r, msg, sizeof msg);
  ck_assert_msg(st == DETATTN_OK, "verify run: %s (seed %llu)", msg, (unsigned long long)seed);
  ck_assert_msg(r.mismatches == 0, "%llu of %llu outputs differ, first: %s (seed %llu)",
                (unsigned long long)r.mismatches, (unsigned long long)r.outputs_compared, r.first_mismatch,
                (unsigned long long)seed);

  const detattn_server_info *info = da_verify_info(v);
  da_model m = to_da_model(&info->model);
  uint64_t rows = 0;
  for (int s = 0; s < da_verify_n_seqs(v); s++) {
    for (int li = 0; li < da_verify_n_layers(v); li++) {
      da_verify_tensors t;
      da_verify_get(v, s, li, &t);
      rows += t.n_tokens;
      size_t n_o = (size_t)t.n_tokens * m.n_q_heads * m.head_dim, n_l = (size_t)t.n_tokens * m.n_q_heads;
      double *o = malloc(n_o * sizeof *o), *lse = malloc(n_l * sizeof *lse);
      ck_assert_int_eq(da_test_ref_attention(&m, t.k, t.v, (int)t.n_tokens, t.q, 0, (int)t.n_tokens, o, lse), 0);
      double rel = da_test_rel_err(m.dtype, t.o, o, n_o), lerr = da_test_max_abs_err_f32(t.lse, lse, n_l);
      ck_assert_msg(rel < tolerance(&info->model), "seq %d layer %u: rel. error %g vs the fp64 reference (seed %llu)",
                    s, t.layer, rel, (unsigned long long)seed);
      ck_assert_msg(lerr < 1e-3, "seq %d layer %u: lse error %g (seed %llu)", s, t.layer, lerr,
                    (unsigned long long)seed);
      free(o);
      free(lse);
    }
  }
  ck_assert_uint_eq(r.outputs_compared, rows);
  ck_assert_uint_gt(r.forwards_concurrent, 0);
  ck_assert_uint_eq(r.fingerprint, info->fingerprint);
  ck_assert_msg(r.max_rel_err < tolerance(&info->model), "verify's own reference check: %g", r.max_rel_err);
  da_verify_free(v);

  assert_daemon_empty();
}
END_TEST

START_TEST(cli_verify_exits_zero_and_reports_json) {
  char cmd[512], out[8192];
  snprintf(cmd, sizeof cmd, "%s --url %s verify --clients 8 --seqs 12 --check-ref --json --seed %llu",
           DETATTN_CLI_PATH, D.url, (unsigned long long)seed);
  int status = da_test_capture(cmd, out, sizeof out);
  ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "detattn verify exited 0x%x: %s (seed %llu)", status,
                out, (unsigned long long)seed);
  cJSON *j = cJSON_Parse(out);
  ck_assert_msg(j != NULL, "not JSON: %s", out);
  cJSON *cmp = cJSON_GetObjectItem(j, "outputs_compared"), *mis = cJSON_GetObjectItem(j, "mismatches"),
        *fp = cJSON_GetObjectItem(j, "fingerprint"), *err = cJSON_GetObjectItem(j, "max_rel_err");
  ck_assert(cJSON_IsNumber(cmp) && cJSON_IsNumber(mis) && cJSON_IsString(fp) && cJSON_IsNumber(err));
  ck_assert_double_gt(cmp->valuedouble, 0);
  ck_assert_double_eq(mis->valuedouble, 0);

  detattn_client *c = connect_ok();
  detattn_server_info info;
  char want[24];
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_OK);
  snprintf(want, sizeof want, "%016llx", (unsigned long long)info.fingerprint);
  ck_assert_str_eq(fp->valuestring, want);
  ck_assert_double_lt(err->valuedouble, tolerance(&info.model));
  detattn_close(c);
  cJSON_Delete(j);
}
END_TEST

static void write_bytes(const char *path, const void *buf, size_t len) {
  FILE *f = fopen(path, "wb");
  ck_assert_ptr_nonnull(f);
  ck_assert_uint_eq(fwrite(buf, 1, len, f), len);
  ck_assert_int_eq(fclose(f), 0);
}

static int run_cli(const char *args) {
  char cmd[2048];
  snprintf(cmd, sizeof cmd, "%s --url %s %s >/dev/null", DETATTN_CLI_PATH, D.url, args);
  int status = system(cmd);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

START_TEST(cli_forward_from_files_matches_the_library_bitwise) {
  detattn_client *c = connect_ok();
  detattn_server_info info;
  da_rng r;
  char path[6][192], args[1024];
  const char *names[6] = {"q.bin", "k.bin", "v.bin", "o.bin", "lse.bin", "short.bin"};
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_OK);
  da_model m = to_da_model(&info.model);
  enum { N = 37 };
  size_t qn = (size_t)N * m.n_q_heads * m.head_dim, kvn = (size_t)N * m.n_kv_heads * m.head_dim;
  uint16_t *q = malloc(qn * 2), *k = malloc(kvn * 2), *v = malloc(kvn * 2), *o = malloc(qn * 2);
  float *lse = malloc((size_t)N * m.n_q_heads * sizeof *lse);
  da_rng_seed(&r, seed);
  da_rng_fill(&r, m.dtype, q, qn, 1.0);
  da_rng_fill(&r, m.dtype, k, kvn, 1.0);
  da_rng_fill(&r, m.dtype, v, kvn, 1.0);
  for (int i = 0; i < 6; i++) snprintf(path[i], sizeof path[i], "%s/%s", D.dir, names[i]);
  write_bytes(path[0], q, qn * 2);
  write_bytes(path[1], k, kvn * 2);
  write_bytes(path[2], v, kvn * 2);
  write_bytes(path[5], k, kvn * 2 - 2);

  snprintf(args, sizeof args, "forward --layer 1 --q %s --k %s --v %s --o %s --lse %s", path[0], path[1], path[2],
           path[3], path[4]);
  ck_assert_int_eq(run_cli(args), 0);
  uint64_t seq;
  ck_assert_int_eq(detattn_seq_open(c, &seq), DETATTN_OK);
  detattn_seq_io io = {.seq = seq, .pos = 0, .n_tokens = N, .q = q, .k = k, .v = v, .o = o, .lse = lse};
  ck_assert_int_eq(detattn_forward(c, 1, &io, 1), DETATTN_OK);
  size_t olen, llen;
  FILE *f = fopen(path[3], "rb");
  ck_assert_ptr_nonnull(f);
  uint8_t *cli_o = malloc(qn * 2 + 1), *cli_l = malloc((size_t)N * m.n_q_heads * 4 + 1);
  olen = fread(cli_o, 1, qn * 2 + 1, f);
  fclose(f);
  f = fopen(path[4], "rb");
  ck_assert_ptr_nonnull(f);
  llen = fread(cli_l, 1, (size_t)N * m.n_q_heads * 4 + 1, f);
  fclose(f);
  ck_assert_uint_eq(olen, qn * 2);
  ck_assert_uint_eq(llen, (size_t)N * m.n_q_heads * 4);
  ck_assert_msg(memcmp(cli_o, o, olen) == 0 && memcmp(cli_l, lse, llen) == 0,
                "the CLI's o/lse differ from the library's for the same inputs (seed %llu)", (unsigned long long)seed);

  /* Files that do not hold whole tokens, or disagree: a usage error, nothing sent. */
  snprintf(args, sizeof args, "forward --q %s --k %s --v %s", path[0], path[5], path[2]);
  ck_assert_int_eq(run_cli(args), 2);
  snprintf(args, sizeof args, "forward --q %s", path[0]);
  ck_assert_int_eq(run_cli(args), 2);
  ck_assert_int_eq(run_cli("forward --layer 99 --tokens 4"), 3);
  detattn_stats s = stats_ok(c);
  ck_assert_uint_eq(s.sequences, 1);
  for (int i = 0; i < 6; i++) unlink(path[i]);
  free(q);
  free(k);
  free(v);
  free(o);
  free(lse);
  free(cli_o);
  free(cli_l);
  detattn_close(c);
}
END_TEST

START_TEST(ipc_bench_is_bounded_and_reports_both_loops) {
  char cmd[1024], out[4096];
  snprintf(cmd, sizeof cmd, "%s --url %s --seconds 0.3 --json", DETATTN_IPCBENCH_PATH, D.url);
  uint64_t t0 = da_now_ns();
  int status = da_test_capture(cmd, out, sizeof out);
  double secs = (double)(da_now_ns() - t0) * 1e-9;
  ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "detattn-ipc-bench exited 0x%x: %s", status, out);
  ck_assert_msg(secs < 10, "detattn-ipc-bench --seconds 0.3 took %.1f s", secs);
  cJSON *j = cJSON_Parse(out);
  ck_assert_msg(j != NULL, "not JSON: %s", out);
  const char *loops[] = {"forward", "ping"};
  for (int i = 0; i < 2; i++) {
    cJSON *l = cJSON_GetObjectItem(j, loops[i]);
    ck_assert_ptr_nonnull(l);
    double n = cJSON_GetNumberValue(cJSON_GetObjectItem(l, "n")), p50 = cJSON_GetNumberValue(cJSON_GetObjectItem(l, "p50_us")),
           p99 = cJSON_GetNumberValue(cJSON_GetObjectItem(l, "p99_us"));
    ck_assert_msg(n > 0 && p50 > 0 && p99 >= p50, "%s: n %g p50 %g p99 %g", loops[i], n, p50, p99);
  }
  ck_assert_double_gt(cJSON_GetNumberValue(cJSON_GetObjectItem(j, "overhead_ratio_p50")), 0);
  cJSON_Delete(j);
  assert_daemon_empty();
}
END_TEST

static void run_ab(const char *url_b, da_verify_result *r) {
  da_verify_cfg cfg = {.url = D.url, .url_b = url_b, .seed = seed, .seqs = 8, .clients = 8, .layers_used = 2,
                       .max_prompt = 120, .decode_steps = 4};
  da_verify *v;
  char msg[512];
  int st = da_verify_alloc(&v, &cfg, msg, sizeof msg);
  ck_assert_msg(st == DETATTN_OK, "verify setup: %s (seed %llu)", msg, (unsigned long long)seed);
  st = da_verify_run(v, r, msg, sizeof msg);
  ck_assert_msg(st == DETATTN_OK, "verify run: %s (seed %llu)", msg, (unsigned long long)seed);
  da_verify_free(v);
}

START_TEST(ab_equal_fingerprints_give_equal_bits_and_other_splits_are_caught) {
  static const char *const same[] = {VERIFY_ARGS("64")}, *const other[] = {VERIFY_ARGS("16")};
  da_verify_result r;
  ck_assert_int_eq(da_daemon_start(&D2, DETATTND_PATH, same), 0);
  ck_assert_int_eq(da_daemon_start(&D3, DETATTND_PATH, other), 0);

  run_ab(D2.url, &r);
  ck_assert_uint_eq(r.fingerprint_b, r.fingerprint);
  ck_assert_uint_gt(r.outputs_compared, 0);
  ck_assert_msg(r.mismatches == 0, "two daemons with equal fingerprints: %llu outputs differ, first: %s (seed %llu)",
                (unsigned long long)r.mismatches, r.first_mismatch, (unsigned long long)seed);

  /* Another split size is another fold order: the comparison must notice. */
  run_ab(D3.url, &r);
  ck_assert_uint_ne(r.fingerprint_b, r.fingerprint);
  ck_assert_msg(r.mismatches > 0, "S=64 and S=16 gave identical bits on all %llu outputs (seed %llu)",
                (unsigned long long)r.outputs_compared, (unsigned long long)seed);
  ck_assert_str_ne(r.first_mismatch, "");
}
END_TEST

/* ---- bad input: a specific code, nothing written, the next request works ---- */

#define BAD_LAYERS 2
#define BAD_HQ 4
#define BAD_HKV 2
#define BAD_D 64
#define BAD_MAX_TOKENS 256
#define BAD_MAX_BYTES 1048576
#define BAD_PAGES 16 /* --kv-tokens 256 / --page-tokens 16 */
#define SEQ_CAP 64

static void setup_bad(void) {
  static const char *const args[] = {
      "--layers", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64", "--dtype", "bf16",
      "--page-tokens", "16", "--kv-tokens", "256", "--split-tokens", "64", "--tile-tokens", "16",
      "--max-request-tokens", "256", "--max-message-bytes", "1048576", "--threads", "1", NULL};
  start_daemon(args);
}

/* The well-behaved sequence every bad request is tried against: its layer-0 tokens so far,
 * so each good step can be checked against the fp64 reference. */
typedef struct good_seq {
  detattn_client *c;
  uint64_t seq;
  uint32_t len;
  uint16_t q[SEQ_CAP * BAD_HQ * BAD_D], k[SEQ_CAP * BAD_HKV * BAD_D], v[SEQ_CAP * BAD_HKV * BAD_D];
  da_rng rng;
  da_model m;
} good_seq;

/* One more token at the right position; its output must match the reference over every
 * token so far, so a bad request that wrote K/V anywhere in this sequence shows here. */
static void good_step(good_seq *g, const char *after) {
  uint16_t o[BAD_HQ * BAD_D];
  float lse[BAD_HQ];
  ck_assert_uint_lt(g->len, SEQ_CAP);
  uint32_t p = g->len;
  da_rng_fill(&g->rng, DA_BF16, g->q + (size_t)p * BAD_HQ * BAD_D, BAD_HQ * BAD_D, 1.0);
  da_rng_fill(&g->rng, DA_BF16, g->k + (size_t)p * BAD_HKV * BAD_D, BAD_HKV * BAD_D, 1.0);
  da_rng_fill(&g->rng, DA_BF16, g->v + (size_t)p * BAD_HKV * BAD_D, BAD_HKV * BAD_D, 1.0);
  detattn_seq_io io = {.seq = g->seq, .pos = p, .n_tokens = 1, .q = g->q + (size_t)p * BAD_HQ * BAD_D,
                       .k = g->k + (size_t)p * BAD_HKV * BAD_D, .v = g->v + (size_t)p * BAD_HKV * BAD_D,
                       .o = o, .lse = lse};
  int st = detattn_forward(g->c, 0, &io, 1);
  ck_assert_msg(st == DETATTN_OK, "after %s: forward at pos %u: %s: %s", after, p, detattn_status_name(st),
                detattn_errmsg());
  g->len++;
  double ro[BAD_HQ * BAD_D], rl[BAD_HQ];
  ck_assert_int_eq(da_test_ref_attention(&g->m, g->k, g->v, (int)g->len, io.q, (int)p, 1, ro, rl), 0);
  double rel = da_test_rel_err(DA_BF16, o, ro, BAD_HQ * BAD_D);
  ck_assert_msg(rel < 2e-2, "after %s: output at pos %u is off by %g: K/V were disturbed (seed %llu)", after, p, rel,
                (unsigned long long)seed);
}

/* The daemon's KV pages and sequences are what they were. */
static void nothing_written(good_seq *g, const detattn_stats *before, const char *after) {
  detattn_stats s = stats_ok(g->c);
  ck_assert_msg(s.kv_pages_used == before->kv_pages_used, "after %s: %u KV pages used, %u before", after,
                s.kv_pages_used, before->kv_pages_used);
  ck_assert_msg(s.sequences == before->sequences, "after %s: %u sequences, %u before", after, s.sequences,
                before->sequences);
}

static void expect(int got, int want, const char *what) {
  ck_assert_msg(got == want, "%s: got %s (%s), want %s", what, detattn_status_name(got), detattn_errmsg(),
                detattn_status_name(want));
}

/* A raw connection: sends bytes as they are, returns the Response's status code. */
typedef struct raw_conn {
  nng_socket sock;
} raw_conn;

static void raw_open(raw_conn *r) {
  ck_assert_int_eq(nng_req0_open(&r->sock), 0);
  nng_socket_set_ms(r->sock, NNG_OPT_REQ_RESENDTIME, NNG_DURATION_INFINITE);
  nng_socket_set_ms(r->sock, NNG_OPT_RECVTIMEO, 10000);
  nng_socket_set_size(r->sock, NNG_OPT_RECVMAXSZ, 16u << 20);
  ck_assert_int_eq(nng_dial(r->sock, D.url, NULL, 0), 0);
}

static int raw_send(raw_conn *r, const void *buf, size_t len, char *msg, size_t msglen, Detattn__V1__Response **out) {
  nng_msg *m;
  ck_assert_int_eq(nng_msg_alloc(&m, len), 0);
  memcpy(nng_msg_body(m), buf, len);
  ck_assert_int_eq(nng_sendmsg(r->sock, m, 0), 0);
  int rv = nng_recvmsg(r->sock, &m, 0);
  ck_assert_msg(rv == 0, "no reply to a raw request: %s", nng_strerror(rv));
  Detattn__V1__Response *resp = detattn__v1__response__unpack(NULL, nng_msg_len(m), nng_msg_body(m));
  nng_msg_free(m);
  ck_assert_ptr_nonnull(resp);
  int code = resp->status ? (int)resp->status->code : 0;
  snprintf(msg, msglen, "%s", resp->status && resp->status->message ? resp->status->message : "");
  if (out) *out = resp;
  else detattn__v1__response__free_unpacked(resp, NULL);
  return code;
}

static int raw_request(raw_conn *r, Detattn__V1__Request *rq, char *msg, size_t msglen, Detattn__V1__Response **out) {
  size_t len = detattn__v1__request__get_packed_size(rq);
  uint8_t *buf = malloc(len);
  detattn__v1__request__pack(rq, buf);
  int code = raw_send(r, buf, len, msg, msglen, out);
  free(buf);
  return code;
}

static void raw_expect(int got, const char *msg, int want, const char *what) {
  ck_assert_msg(got == want, "%s: got %s (%s), want %s", what, detattn_status_name(got), msg, detattn_status_name(want));
  ck_assert_msg(msg[0] != '\0', "%s: %s without a message", what, detattn_status_name(got));
}

START_TEST(each_bad_request_gets_its_code_and_writes_nothing) {
  static good_seq g;
  detattn_server_info info;
  detattn_stats before;
  raw_conn raw;
  char msg[512];
  uint64_t other_seq;

  memset(&g, 0, sizeof g);
  da_rng_seed(&g.rng, seed);
  g.c = connect_ok();
  ck_assert_int_eq(detattn_hello(g.c, &info), DETATTN_OK);
  ck_assert_uint_eq(info.model.n_layers, BAD_LAYERS);
  ck_assert_uint_eq(info.max_tokens_per_request, BAD_MAX_TOKENS);
  g.m = to_da_model(&info.model);
  ck_assert_int_eq(detattn_seq_open(g.c, &g.seq), DETATTN_OK);
  for (int i = 0; i < 3; i++) good_step(&g, "the start");

  /* Malformed protobuf, sent raw. */
  raw_open(&raw);
  before = stats_ok(g.c);
  static const uint8_t garbage[] = {0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f, 0x01, 0x02};
  raw_expect(raw_send(&raw, garbage, sizeof garbage, msg, sizeof msg, NULL), msg, DETATTN_INVALID_ARGUMENT,
             "malformed protobuf");
  nothing_written(&g, &before, "malformed protobuf");
  good_step(&g, "malformed protobuf");

  /* A message over max-message-bytes (but under the transport's hard limit). */
  before = stats_ok(g.c);
  size_t big = BAD_MAX_BYTES + 4096;
  uint8_t *buf = calloc(1, big);
  raw_expect(raw_send(&raw, buf, big, msg, sizeof msg, NULL), msg, DETATTN_RESOURCE_EXHAUSTED, "oversize message");
  free(buf);
  nothing_written(&g, &before, "oversize message");
  good_step(&g, "oversize message");

  /* An op this server does not know: field 15, empty. */
  before = stats_ok(g.c);
  static const uint8_t unknown_op[] = {0x08, 0x07, 0x7a, 0x00};
  raw_expect(raw_send(&raw, unknown_op, sizeof unknown_op, msg, sizeof msg, NULL), msg, DETATTN_INVALID_ARGUMENT,
             "unknown op");
  nothing_written(&g, &before, "unknown op");
  good_step(&g, "unknown op");

  /* Wrong tensor length, on the raw connection's own sequence. */
  {
    Detattn__V1__Request rq = DETATTN__V1__REQUEST__INIT;
    Detattn__V1__SeqOpen so = DETATTN__V1__SEQ_OPEN__INIT;
    Detattn__V1__Response *resp;
    rq.id = 1;
    rq.op_case = DETATTN__V1__REQUEST__OP_SEQ_OPEN;
    rq.seq_open = &so;
    ck_assert_int_eq(raw_request(&raw, &rq, msg, sizeof msg, &resp), DETATTN_OK);
    uint64_t raw_seq = resp->seq_open->seq;
    detattn__v1__response__free_unpacked(resp, NULL);
    before = stats_ok(g.c);
    static uint8_t q[2 * BAD_HQ * BAD_D * 2], kv[2 * BAD_HKV * BAD_D * 2], kv_long[sizeof kv + 2];
    Detattn__V1__ForwardSeq fs = DETATTN__V1__FORWARD_SEQ__INIT, *fsp = &fs;
    Detattn__V1__Forward f = DETATTN__V1__FORWARD__INIT;
    fs.seq = raw_seq;
    fs.pos = 0;
    fs.n_tokens = 2;
    fs.q = (ProtobufCBinaryData){sizeof q - 2, q};
    fs.k = (ProtobufCBinaryData){sizeof kv, kv};
    fs.v = (ProtobufCBinaryData){sizeof kv, kv};
    f.layer = 0;
    f.n_seqs = 1;
    f.seqs = &fsp;
    rq.id = 2;
    rq.op_case = DETATTN__V1__REQUEST__OP_FORWARD;
    rq.forward = &f;
    raw_expect(raw_request(&raw, &rq, msg, sizeof msg, NULL), msg, DETATTN_INVALID_ARGUMENT, "short q");
    nothing_written(&g, &before, "short q");
    fs.q.len = sizeof q;
    fs.v = (ProtobufCBinaryData){sizeof kv_long, kv_long};
    rq.id = 3;
    raw_expect(raw_request(&raw, &rq, msg, sizeof msg, NULL), msg, DETATTN_INVALID_ARGUMENT, "long v");
    nothing_written(&g, &before, "long v");
    /* The same request with the right lengths works: the sequence is still at 0. */
    fs.v = (ProtobufCBinaryData){sizeof kv, kv};
    rq.id = 4;
    ck_assert_int_eq(raw_request(&raw, &rq, msg, sizeof msg, NULL), DETATTN_OK);
    Detattn__V1__SeqClose sc = DETATTN__V1__SEQ_CLOSE__INIT;
    sc.seq = raw_seq;
    rq.id = 5;
    rq.op_case = DETATTN__V1__REQUEST__OP_SEQ_CLOSE;
    rq.seq_close = &sc;
    ck_assert_int_eq(raw_request(&raw, &rq, msg, sizeof msg, NULL), DETATTN_OK);
  }
  nng_close(raw.sock);
  good_step(&g, "wrong tensor lengths");

  /* Library calls: build 1-token (or n-token) inputs from the same generator. */
  static uint16_t q[(BAD_MAX_TOKENS + 1) * BAD_HQ * BAD_D], kv[(BAD_MAX_TOKENS + 1) * BAD_HKV * BAD_D],
      o[(BAD_MAX_TOKENS + 1) * BAD_HQ * BAD_D];
  da_rng_fill(&g.rng, DA_BF16, q, sizeof q / 2, 1.0);
  da_rng_fill(&g.rng, DA_BF16, kv, sizeof kv / 2, 1.0);
  detattn_seq_io io = {.seq = g.seq, .pos = g.len + 1, .n_tokens = 1, .q = q, .k = kv, .v = kv, .o = o};

  before = stats_ok(g.c);
  expect(detattn_forward(g.c, 0, &io, 1), DETATTN_FAILED_PRECONDITION, "pos past the layer's length");
  io.pos = g.len - 1;
  expect(detattn_forward(g.c, 0, &io, 1), DETATTN_FAILED_PRECONDITION, "pos before the layer's length");
  nothing_written(&g, &before, "wrong pos");
  good_step(&g, "wrong pos");

  before = stats_ok(g.c);
  io.pos = 0;
  io.seq = g.seq + 1000003;
  expect(detattn_forward(g.c, 0, &io, 1), DETATTN_NOT_FOUND, "unknown sequence");
  expect(detattn_seq_close(g.c, g.seq + 1000003), DETATTN_NOT_FOUND, "closing an unknown sequence");
  nothing_written(&g, &before, "unknown sequence");
  good_step(&g, "unknown sequence");

  before = stats_ok(g.c);
  detattn_client *other = connect_ok();
  io.seq = g.seq;
  io.pos = g.len;
  expect(detattn_forward(other, 0, &io, 1), DETATTN_NOT_FOUND, "another client's sequence: forward");
  expect(detattn_seq_truncate(other, g.seq, 0), DETATTN_NOT_FOUND, "another client's sequence: truncate");
  expect(detattn_seq_fork(other, g.seq, &other_seq), DETATTN_NOT_FOUND, "another client's sequence: fork");
  expect(detattn_seq_close(other, g.seq), DETATTN_NOT_FOUND, "another client's sequence: close");
  detattn_close(other);
  nothing_written(&g, &before, "another client's sequence");
  good_step(&g, "another client's sequence");

  before = stats_ok(g.c);
  io.pos = g.len;
  expect(detattn_forward(g.c, BAD_LAYERS, &io, 1), DETATTN_INVALID_ARGUMENT, "layer out of range");
  nothing_written(&g, &before, "layer out of range");
  good_step(&g, "layer out of range");

  before = stats_ok(g.c);
  io.pos = g.len;
  io.n_tokens = 0;
  expect(detattn_forward(g.c, 0, &io, 1), DETATTN_INVALID_ARGUMENT, "zero tokens");
  nothing_written(&g, &before, "zero tokens");
  good_step(&g, "zero tokens");

  before = stats_ok(g.c);
  io.pos = g.len;
  io.n_tokens = BAD_MAX_TOKENS + 1;
  expect(detattn_forward(g.c, 0, &io, 1), DETATTN_INVALID_ARGUMENT, "too many tokens");
  nothing_written(&g, &before, "too many tokens");
  good_step(&g, "too many tokens");

  /* KV exhausted, atomically: a valid token for the good sequence and a fresh sequence
   * needing every page at once; neither is written. */
  uint64_t fresh;
  ck_assert_int_eq(detattn_seq_open(g.c, &fresh), DETATTN_OK);
  before = stats_ok(g.c);
  ck_assert_uint_lt(before.kv_pages_free, BAD_MAX_TOKENS / 16);
  detattn_seq_io two[2] = {
      {.seq = g.seq, .pos = g.len, .n_tokens = 1, .q = q, .k = kv, .v = kv, .o = o},
      {.seq = fresh, .pos = 0, .n_tokens = BAD_MAX_TOKENS - 1, .q = q, .k = kv, .v = kv, .o = o}};
  expect(detattn_forward(g.c, 0, two, 2), DETATTN_RESOURCE_EXHAUSTED, "KV exhausted");
  nothing_written(&g, &before, "KV exhausted");
  good_step(&g, "KV exhausted");
  ck_assert_int_eq(detattn_seq_close(g.c, fresh), DETATTN_OK);

  detattn_stats end = stats_ok(g.c);
  ck_assert_uint_eq(end.kv_pages_used, (g.len + 15) / 16);
  ck_assert_uint_gt(end.errors, 10);
  detattn_close(g.c);
}
END_TEST

/* ---- a client killed mid-request gives its pages back ---- */

static void setup_killed(void) {
  static const char *const args[] = {"--layers", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64",
                                     "--dtype", "bf16", "--page-tokens", "16", "--kv-tokens", "4096",
                                     "--split-tokens", "64", "--tile-tokens", "16", "--threads", "1", NULL};
  start_daemon(args);
}

/* The child: opens 3 sequences, prefills 200 tokens each on layer 0, starts a big forward
 * on layer 1, says so on fd, and waits to be killed. Never returns. */
static void victim(int fd) {
  detattn_client *c;
  detattn_server_info info;
  uint64_t seq[3];
  da_rng r;
  enum { PRE = 200, BIG = 1000 };
  if (detattn_connect(&c, D.url) || detattn_hello(c, &info)) _exit(10);
  size_t qn = (size_t)info.model.n_q_heads * info.model.head_dim, kvn = (size_t)info.model.n_kv_heads * info.model.head_dim;
  uint16_t *q = malloc(BIG * qn * 2), *kv = malloc(BIG * kvn * 2), *o = malloc(3 * BIG * qn * 2);
  da_rng_seed(&r, seed);
  da_rng_fill(&r, DA_BF16, q, BIG * qn, 1.0);
  da_rng_fill(&r, DA_BF16, kv, BIG * kvn, 1.0);
  for (int i = 0; i < 3; i++) {
    if (detattn_seq_open(c, &seq[i])) _exit(11);
    detattn_seq_io io = {.seq = seq[i], .pos = 0, .n_tokens = PRE, .q = q, .k = kv, .v = kv, .o = o};
    if (detattn_forward(c, 0, &io, 1)) _exit(12);
  }
  detattn_seq_io big[3];
  for (int i = 0; i < 3; i++)
    big[i] = (detattn_seq_io){.seq = seq[i], .pos = 0, .n_tokens = BIG, .q = q, .k = kv, .v = kv,
                              .o = o + (size_t)i * BIG * qn};
  detattn_call *call;
  if (detattn_forward_start(c, 1, big, 3, &call)) _exit(13);
  if (write(fd, "r", 1) != 1) _exit(14);
  for (;;) pause();
}

START_TEST(killed_client_pages_return_to_the_pool) {
  int fds[2];
  ck_assert_int_eq(pipe(fds), 0);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    close(fds[0]);
    victim(fds[1]);
  }
  close(fds[1]);
  struct pollfd pfd = {.fd = fds[0], .events = POLLIN};
  char b = 0;
  int ready = poll(&pfd, 1, 20000) == 1 && read(fds[0], &b, 1) == 1 && b == 'r';
  close(fds[0]);
  if (!ready) {
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    ck_abort_msg("the client process did not get its sequences going");
  }
  detattn_client *c = connect_ok();
  detattn_stats s = stats_ok(c);
  ck_assert_uint_eq(s.sequences, 3);
  ck_assert_uint_ge(s.kv_pages_used, 3 * 13);
  ck_assert_int_eq(kill(pid, SIGKILL), 0);
  ck_assert_int_eq(waitpid(pid, NULL, 0), pid);

  uint64_t deadline = da_now_ns() + 10000000000ull;
  do {
    s = stats_ok(c);
    if (s.kv_pages_used == 0 && s.sequences == 0) break;
    da_test_sleep_ms(20);
  } while (da_now_ns() < deadline);
  ck_assert_msg(s.kv_pages_used == 0 && s.sequences == 0,
                "10 s after the client died: %u KV pages used, %u sequences open", s.kv_pages_used, s.sequences);
  ck_assert_uint_eq(s.kv_pages_free, s.kv_pages_total);

  /* The daemon still serves. */
  uint64_t seq;
  ck_assert_int_eq(detattn_seq_open(c, &seq), DETATTN_OK);
  ck_assert_int_eq(detattn_seq_close(c, seq), DETATTN_OK);
  detattn_close(c);
}
END_TEST

/* ---- SIGTERM: in-flight work finishes OK, new work is refused, exit 0 ---- */

#define TERM_TOKENS 4096

static void setup_sigterm(void) {
  static const char *const args[] = {"--layers", "1", "--q-heads", "8", "--kv-heads", "2", "--head-dim", "128",
                                     "--dtype", "bf16", "--page-tokens", "16", "--kv-tokens", "8192",
                                     "--split-tokens", "256", "--tile-tokens", "64", "--threads", "1",
                                     "--drain-timeout-ms", "120000", NULL}; /* ThreadSanitizer: ~25 s */
  start_daemon(args);
}

START_TEST(sigterm_finishes_in_flight_work_refuses_new_and_exits_zero) {
  detattn_client *c = connect_ok();
  detattn_set_timeout(c, 45000); /* the in-flight prefill takes ~1 s, ~25 s under ThreadSanitizer */
  detattn_server_info info;
  uint64_t seq, seq2;
  da_rng r;
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_OK);
  da_model m = to_da_model(&info.model);
  size_t qn = (size_t)m.n_q_heads * m.head_dim, kvn = (size_t)m.n_kv_heads * m.head_dim;
  uint16_t *q = malloc(TERM_TOKENS * qn * 2), *k = malloc(TERM_TOKENS * kvn * 2), *v = malloc(TERM_TOKENS * kvn * 2),
           *o = malloc(TERM_TOKENS * qn * 2);
  float *lse = malloc(TERM_TOKENS * m.n_q_heads * sizeof *lse);
  da_rng_seed(&r, seed);
  da_rng_fill(&r, DA_BF16, q, TERM_TOKENS * qn, 1.0);
  da_rng_fill(&r, DA_BF16, k, TERM_TOKENS * kvn, 1.0);
  da_rng_fill(&r, DA_BF16, v, TERM_TOKENS * kvn, 1.0);
  da_test_poison(DA_BF16, o, TERM_TOKENS * qn);
  ck_assert_int_eq(detattn_seq_open(c, &seq), DETATTN_OK);
  /* A second connection sends the request after SIGTERM, with a short timeout of its own:
   * the in-flight forward keeps the default one (a slow build may take seconds). */
  detattn_client *c2 = connect_ok();
  ck_assert_int_eq(detattn_seq_open(c2, &seq2), DETATTN_OK);

  detattn_seq_io io = {.seq = seq, .pos = 0, .n_tokens = TERM_TOKENS, .q = q, .k = k, .v = v, .o = o, .lse = lse};
  detattn_call *call;
  uint64_t t0 = da_now_ns();
  ck_assert_int_eq(detattn_forward_start(c, 0, &io, 1, &call), DETATTN_OK);
  /* Wait until the daemon has admitted the forward (its pages are reserved), however long
   * a loaded machine takes to send 12 MB; it must still be running when SIGTERM lands. */
  detattn_stats s = stats_ok(c);
  for (int i = 0; i < 2000 && s.kv_pages_used == 0; i++) {
    da_test_sleep_ms(5);
    s = stats_ok(c);
  }
  ck_assert_msg(s.kv_pages_used > 0, "the forward was not admitted within 10 s");
  ck_assert_msg(s.forwards == 0, "the forward finished before SIGTERM: it cannot be in flight");
  ck_assert_int_eq(kill(D.pid, SIGTERM), 0);
  for (int i = 0; i < 2000 && !da_daemon_log_has(&D, "draining"); i++) da_test_sleep_ms(5);
  ck_assert_msg(da_daemon_log_has(&D, "draining"), "detattnd did not log that it is draining");

  /* New work while draining (or after exit: no connection): UNAVAILABLE. */
  detattn_set_timeout(c2, 3000);
  detattn_seq_io io2 = {.seq = seq2, .pos = 0, .n_tokens = 1, .q = q, .k = k, .v = v, .o = o + qn};
  uint16_t o2[8 * 128];
  io2.o = o2;
  expect(detattn_forward(c2, 0, &io2, 1), DETATTN_UNAVAILABLE, "a forward sent after SIGTERM");
  detattn_close(c2);

  int st = detattn_call_wait(call);
  ck_assert_msg(st == DETATTN_OK, "the in-flight forward: %s: %s", detattn_status_name(st), detattn_errmsg());
  double ms = (double)(da_now_ns() - t0) * 1e-6;
  /* Check the last rows (full causal span) against the fp64 reference. */
  enum { LAST = 4 };
  double ro[LAST * 8 * 128], rl[LAST * 8];
  ck_assert_int_eq(da_test_ref_attention(&m, k, v, TERM_TOKENS, q + (TERM_TOKENS - LAST) * qn, TERM_TOKENS - LAST, LAST,
                                         ro, rl), 0);
  double rel = da_test_rel_err(DA_BF16, o + (TERM_TOKENS - LAST) * qn, ro, LAST * qn);
  ck_assert_msg(rel < 2e-2, "in-flight forward output off by %g (seed %llu)", rel, (unsigned long long)seed);
  ck_assert_int_eq(da_daemon_wait(&D, 20000), 0);
  ck_assert_msg(WIFEXITED(D.exit_status) && WEXITSTATUS(D.exit_status) == 0, "detattnd exit status 0x%x",
                D.exit_status);
  fprintf(stderr, "sigterm: %d-token forward answered after %.0f ms\n", TERM_TOKENS, ms);
  detattn_close(c);
  free(q);
  free(k);
  free(v);
  free(o);
  free(lse);
}
END_TEST

/* ---- --phase-timing: decode Forwards' phases in the log at exit ---- */

static void setup_phases(void) {
  static const char *const args[] = {"--layers", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64",
                                     "--dtype", "bf16", "--page-tokens", "16", "--kv-tokens", "8192",
                                     "--split-tokens", "64", "--threads", "1", "--phase-timing", "1", NULL};
  start_daemon(args);
}

START_TEST(phase_timing_logs_each_decode_forward_and_no_prefill) {
  enum { PREFILL = 100, STEPS = 7, LAYERS = 2 };
  detattn_client *c = connect_ok();
  detattn_server_info info;
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_OK);
  da_model m = to_da_model(&info.model);
  size_t qn = (size_t)m.n_q_heads * m.head_dim, kvn = (size_t)m.n_kv_heads * m.head_dim;
  uint16_t *q = malloc(PREFILL * qn * 2), *k = malloc(PREFILL * kvn * 2), *v = malloc(PREFILL * kvn * 2),
           *o = malloc(PREFILL * qn * 2);
  da_rng r;
  da_rng_seed(&r, seed);
  da_rng_fill(&r, DA_BF16, q, PREFILL * qn, 1.0);
  da_rng_fill(&r, DA_BF16, k, PREFILL * kvn, 1.0);
  da_rng_fill(&r, DA_BF16, v, PREFILL * kvn, 1.0);
  uint64_t seq[2];
  for (int s = 0; s < 2; s++) ck_assert_int_eq(detattn_seq_open(c, &seq[s]), DETATTN_OK);
  /* a prefill Forward of both sequences a layer (not timed), then decode steps of one
   * token each (timed: LAYERS x STEPS Forwards) */
  for (int l = 0; l < LAYERS; l++) {
    detattn_seq_io io[2];
    for (int s = 0; s < 2; s++)
      io[s] = (detattn_seq_io){.seq = seq[s], .pos = 0, .n_tokens = PREFILL, .q = q, .k = k, .v = v, .o = o};
    ck_assert_int_eq(detattn_forward(c, (uint32_t)l, io, 2), DETATTN_OK);
  }
  for (int t = 0; t < STEPS; t++)
    for (int l = 0; l < LAYERS; l++) {
      detattn_seq_io io[2];
      for (int s = 0; s < 2; s++)
        io[s] = (detattn_seq_io){.seq = seq[s], .pos = (uint32_t)(PREFILL + t), .n_tokens = 1, .q = q + s * qn,
                                 .k = k + s * kvn, .v = v + s * kvn, .o = o + s * qn};
      int st = detattn_forward(c, (uint32_t)l, io, 2);
      ck_assert_msg(st == DETATTN_OK, "decode: %s: %s", detattn_status_name(st), detattn_errmsg());
    }
  detattn_close(c);
  char why[256];
  ck_assert_msg(da_daemon_term_clean(&D, 20000, why, sizeof why) == 0, "%s", why);
  char line[64];
  snprintf(line, sizeof line, "phase timing, %d decode forwards (0 skipped)", STEPS * LAYERS);
  ck_assert_msg(da_daemon_log_has(&D, line), "the log has no \"%s\"", line);
  ck_assert(da_daemon_log_has(&D, "admit"));
  ck_assert(da_daemon_log_has(&D, ", backend "));
  free(q);
  free(k);
  free(v);
  free(o);
}
END_TEST

static Suite *daemon_suite(void) {
  /* One test case per ctest entry (CK_RUN_CASE), each with the daemon its fixture starts. */
  const struct {
    const char *name;
    void (*setup)(void);
    const TTest *tests[2];
  } cases[] = {
      {"verify", setup_verify, {eight_concurrent_clients_match_the_one_at_a_time_pass_bitwise, NULL}},
      {"cli", setup_verify, {cli_verify_exits_zero_and_reports_json, cli_forward_from_files_matches_the_library_bitwise}},
      {"ipcbench", setup_verify, {ipc_bench_is_bounded_and_reports_both_loops, NULL}},
      {"ab", setup_verify, {ab_equal_fingerprints_give_equal_bits_and_other_splits_are_caught, NULL}},
      {"bad_input", setup_bad, {each_bad_request_gets_its_code_and_writes_nothing, NULL}},
      {"client_killed", setup_killed, {killed_client_pages_return_to_the_pool, NULL}},
      {"sigterm", setup_sigterm, {sigterm_finishes_in_flight_work_refuses_new_and_exits_zero, NULL}},
      {"phases", setup_phases, {phase_timing_logs_each_decode_forward_and_no_prefill, NULL}},
  };
  Suite *s = suite_create("daemon");
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    TCase *t = tcase_create(cases[i].name);
    tcase_add_checked_fixture(t, cases[i].setup, teardown);
    tcase_set_timeout(t, 50);
    for (int j = 0; j < 2 && cases[i].tests[j]; j++) tcase_add_test(t, cases[i].tests[j]);
    suite_add_tcase(s, t);
  }
  return s;
}

int main(void) {
  return da_test_run(daemon_suite());
}
