/*
 * test_backend_async.c — da_backend_submit / da_backend_finish (kernels/backend.h) against
 * da_backend_run: a seeded sequence of batches (appends then attention, three sequences on
 * random page tables, both layers) run one at a time with run() on one backend instance and
 * pipelined two at a time with submit/finish on a second one must give the same bits; the
 * in-flight limit and an empty finish fail with FAILED_PRECONDITION; ready is called once
 * per submitted batch before its finish returns.
 *
 * Backend: argv[1], "cpu" (the fallback through run()) or "cuda" (the real submit/finish;
 * exits 77 when no device is usable).
 */
#include <check.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "testutil.h"

#define N_SEQS 3
#define N_BATCHES 8
#define PAGES_PER_SEQ 24 /* 384 tokens */
#define POOL 128

static const char *backend_name = "cpu";
static uint64_t seed;

typedef struct fixture {
  da_model m;
  da_backend_cfg cfg;
  int32_t pages[N_SEQS][PAGES_PER_SEQ];
  /* per batch */
  da_append app[N_BATCHES][N_SEQS];
  da_attn att[N_BATCHES][N_SEQS];
  da_batch b[N_BATCHES];
  void *in[N_BATCHES][N_SEQS][3]; /* q, k, v */
  void *o_run[N_BATCHES][N_SEQS], *o_async[N_BATCHES][N_SEQS];
  float *lse_run[N_BATCHES][N_SEQS], *lse_async[N_BATCHES][N_SEQS];
} fixture;

static fixture F;

static void setup(void) {
  seed = da_test_seed(0xa5a5);
  da_rng r;
  da_rng_seed(&r, seed);
  memset(&F, 0, sizeof F);
  F.m = (da_model){.n_layers = 2, .n_q_heads = 8, .n_kv_heads = 2, .head_dim = 128, .dtype = DA_BF16};
  da_model_defaults(&F.m);
  F.cfg = (da_backend_cfg){.model = F.m, .num = {.split_tokens = 64, .tile_tokens = 64}, .page_tokens = 16,
                           .n_pages = POOL, .n_threads = 2, .poison = 1};
  uint8_t used[POOL] = {0};
  for (int s = 0; s < N_SEQS; s++)
    ck_assert_int_eq(da_test_random_pages_from(&r, F.pages[s], PAGES_PER_SEQ, used, POOL), 0);
  int len[N_SEQS][2] = {{0}};
  const size_t qrow = (size_t)F.m.n_q_heads * F.m.head_dim, kvrow = (size_t)F.m.n_kv_heads * F.m.head_dim;
  for (int bi = 0; bi < N_BATCHES; bi++) {
    const int layer = bi % 2;
    for (int s = 0; s < N_SEQS; s++) {
      /* Prefill-sized first chunks, then decode-sized ones: several splits per row. */
      const int n = bi < 2 ? (int)da_rng_range(&r, 40, 150) : (int)da_rng_range(&r, 1, 9);
      const int pos = len[s][layer];
      len[s][layer] += n;
      ck_assert_int_le(len[s][layer], PAGES_PER_SEQ * 16);
      void **in = F.in[bi][s];
      in[0] = da_test_random_tensor(&r, DA_BF16, n * qrow, 1.0);
      in[1] = da_test_random_tensor(&r, DA_BF16, n * kvrow, 1.0);
      in[2] = da_test_random_tensor(&r, DA_BF16, n * kvrow, 1.0);
      F.o_run[bi][s] = calloc(n * qrow, 2);
      F.o_async[bi][s] = calloc(n * qrow, 2);
      F.lse_run[bi][s] = calloc((size_t)n * F.m.n_q_heads, 4);
      F.lse_async[bi][s] = calloc((size_t)n * F.m.n_q_heads, 4);
      ck_assert(in[0] && in[1] && in[2] && F.o_run[bi][s] && F.o_async[bi][s] && F.lse_run[bi][s] &&
                F.lse_async[bi][s]);
      F.app[bi][s] = (da_append){.layer = layer, .pos = pos, .n_tokens = n, .pages = F.pages[s],
                                 .n_pages = PAGES_PER_SEQ, .k = in[1], .v = in[2]};
      F.att[bi][s] = (da_attn){.layer = layer, .q_pos = pos, .n_q = n, .pages = F.pages[s],
                               .n_pages = PAGES_PER_SEQ, .q = in[0]};
    }
    F.b[bi] = (da_batch){.appends = F.app[bi], .n_appends = N_SEQS, .attns = F.att[bi], .n_attns = N_SEQS,
                         .split_mode = (da_split_mode)(bi % 3)};
  }
}

static void teardown(void) {
  for (int bi = 0; bi < N_BATCHES; bi++)
    for (int s = 0; s < N_SEQS; s++) {
      for (int k = 0; k < 3; k++) free(F.in[bi][s][k]);
      free(F.o_run[bi][s]), free(F.o_async[bi][s]), free(F.lse_run[bi][s]), free(F.lse_async[bi][s]);
    }
}

/* Points batch bi's outputs at the run() or the submit/finish buffers. */
static void outputs(int bi, int async) {
  for (int s = 0; s < N_SEQS; s++) {
    F.att[bi][s].o = async ? F.o_async[bi][s] : F.o_run[bi][s];
    F.att[bi][s].lse = async ? F.lse_async[bi][s] : F.lse_run[bi][s];
  }
}

static da_backend *open_ok(void) {
  da_backend *be = NULL;
  char err[256];
  int rv = da_backend_open(&be, backend_name, &F.cfg, err, sizeof err);
  ck_assert_msg(rv == 0, "open %s: %s", backend_name, err);
  return be;
}

static atomic_int n_ready;
static void on_ready(void *arg) {
  (void)arg;
  atomic_fetch_add(&n_ready, 1);
}

START_TEST(two_batches_in_flight_give_the_bits_of_one_at_a_time) {
  da_backend *a = open_ok(), *b = open_ok();
  da_batch_result res;
  for (int bi = 0; bi < N_BATCHES; bi++) {
    outputs(bi, 0);
    int rv = da_backend_run(a, &F.b[bi], &res);
    ck_assert_msg(rv == 0, "run batch %d: %s (seed %llu)", bi, res.err, (unsigned long long)seed);
  }
  atomic_store(&n_ready, 0);
  int submitted = 0, finished = 0;
  for (int bi = 0; bi < N_BATCHES; bi++) {
    outputs(bi, 1);
    int rv = da_backend_submit(b, &F.b[bi], on_ready, NULL, &res);
    ck_assert_msg(rv == 0, "submit batch %d: %s (seed %llu)", bi, res.err, (unsigned long long)seed);
    submitted++;
    if (da_backend_inflight(b) == DA_BACKEND_MAX_INFLIGHT) {
      rv = da_backend_finish(b, &res);
      ck_assert_msg(rv == 0, "finish batch %d: %s (seed %llu)", finished, res.err, (unsigned long long)seed);
      finished++;
      ck_assert_int_ge(atomic_load(&n_ready), finished);
    }
  }
  while (da_backend_inflight(b) > 0) {
    int rv = da_backend_finish(b, &res);
    ck_assert_msg(rv == 0, "finish batch %d: %s (seed %llu)", finished, res.err, (unsigned long long)seed);
    finished++;
  }
  ck_assert_int_eq(finished, N_BATCHES);
  ck_assert_int_eq(atomic_load(&n_ready), submitted);
  const size_t qrow = (size_t)F.m.n_q_heads * F.m.head_dim;
  for (int bi = 0; bi < N_BATCHES; bi++)
    for (int s = 0; s < N_SEQS; s++) {
      const int n = F.att[bi][s].n_q;
      ptrdiff_t d = da_test_first_diff(F.o_run[bi][s], F.o_async[bi][s], n * qrow * 2);
      ck_assert_msg(d < 0, "batch %d seq %d: o differs at byte %td (seed %llu)", bi, s, d, (unsigned long long)seed);
      d = da_test_first_diff(F.lse_run[bi][s], F.lse_async[bi][s], (size_t)n * F.m.n_q_heads * 4);
      ck_assert_msg(d < 0, "batch %d seq %d: lse differs at byte %td (seed %llu)", bi, s, d, (unsigned long long)seed);
    }
  /* Not all zeros or NaN: the comparison compared real outputs. */
  double ref_sum = 0.0;
  for (size_t i = 0; i < (size_t)F.att[0][0].n_q * F.m.n_q_heads; i++) ref_sum += F.lse_run[0][0][i];
  ck_assert_msg(ref_sum == ref_sum && ref_sum != 0.0, "lse sum %g", ref_sum);
  da_backend_close(a);
  da_backend_close(b);
}
END_TEST

START_TEST(a_third_submit_and_an_empty_finish_fail_with_failed_precondition) {
  da_backend *b = open_ok();
  da_batch_result res;
  ck_assert_int_eq(da_backend_finish(b, &res), DETATTN_FAILED_PRECONDITION);
  ck_assert_msg(res.err[0] != '\0', "no message");
  for (int bi = 0; bi < 2; bi++) {
    outputs(bi, 1);
    ck_assert_int_eq(da_backend_submit(b, &F.b[bi], NULL, NULL, &res), 0);
  }
  outputs(2, 1);
  ck_assert_int_eq(da_backend_submit(b, &F.b[2], NULL, NULL, &res), DETATTN_FAILED_PRECONDITION);
  ck_assert_msg(strstr(res.err, "in flight") != NULL, "message: %s", res.err);
  ck_assert_int_eq(da_backend_run(b, &F.b[2], &res), DETATTN_FAILED_PRECONDITION);
  ck_assert_int_eq(da_backend_inflight(b), 2);
  for (int i = 0; i < 2; i++) ck_assert_msg(da_backend_finish(b, &res) == 0, "finish: %s", res.err);
  ck_assert_int_eq(da_backend_inflight(b), 0);
  /* The refused batch changed nothing: it runs now and gives the bits of a one-at-a-time run. */
  ck_assert_msg(da_backend_run(b, &F.b[2], &res) == 0, "run: %s", res.err);
  da_backend *a = open_ok();
  for (int bi = 0; bi < 3; bi++) {
    outputs(bi, 0);
    ck_assert_msg(da_backend_run(a, &F.b[bi], &res) == 0, "run: %s", res.err);
  }
  const size_t qrow = (size_t)F.m.n_q_heads * F.m.head_dim;
  for (int s = 0; s < N_SEQS; s++)
    ck_assert_msg(da_test_first_diff(F.o_run[2][s], F.o_async[2][s], F.att[2][s].n_q * qrow * 2) < 0,
                  "seq %d differs (seed %llu)", s, (unsigned long long)seed);
  da_backend_close(a);
  da_backend_close(b);
}
END_TEST

START_TEST(a_bad_batch_fails_with_invalid_argument_and_leaves_nothing_in_flight) {
  da_backend *b = open_ok();
  da_batch_result res;
  outputs(0, 1);
  da_attn bad = F.att[0][0];
  bad.layer = F.m.n_layers; /* out of range */
  da_batch bb = {.attns = &bad, .n_attns = 1};
  int rv = da_backend_submit(b, &bb, on_ready, NULL, &res);
  if (strcmp(backend_name, "cuda") == 0) {
    /* A backend with submit validates there: refused, nothing in flight. */
    ck_assert_int_eq(rv, DETATTN_INVALID_ARGUMENT);
    ck_assert_int_eq(da_backend_inflight(b), 0);
  } else {
    /* The fallback only queues at submit; run() refuses it in finish. */
    ck_assert_int_eq(rv, 0);
    ck_assert_int_eq(da_backend_finish(b, &res), DETATTN_INVALID_ARGUMENT);
  }
  ck_assert_msg(strstr(res.err, "layer") != NULL, "message: %s", res.err);
  ck_assert_int_eq(da_backend_inflight(b), 0);
  ck_assert_int_eq(da_backend_submit(b, &F.b[0], NULL, NULL, &res), 0);
  ck_assert_msg(da_backend_finish(b, &res) == 0, "finish: %s", res.err);
  da_backend_close(b);
}
END_TEST

int main(int argc, char **argv) {
  if (argc > 1) backend_name = argv[1];
  if (strcmp(backend_name, "cuda") == 0) {
#ifdef DETATTN_HAVE_CUDA
    if (!da_cuda_backend_ops.available()) {
      fprintf(stderr, "no CUDA device: skipped\n");
      return 77;
    }
#else
    fprintf(stderr, "built without CUDA: skipped\n");
    return 77;
#endif
  }
  Suite *s = suite_create("backend_async");
  TCase *tc = tcase_create(backend_name);
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, two_batches_in_flight_give_the_bits_of_one_at_a_time);
  tcase_add_test(tc, a_third_submit_and_an_empty_finish_fail_with_failed_precondition);
  tcase_add_test(tc, a_bad_batch_fails_with_invalid_argument_and_leaves_nothing_in_flight);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
