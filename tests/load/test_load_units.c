/*
 * Unit tests of detattn-load's parts that need no daemon: the log-linear histogram, the
 * seeded workload (lengths, inputs, trace files, arrivals), and the record format and
 * comparison.
 */
#include <check.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hist.h"
#include "record.h"
#include "testutil.h"
#include "workload.h"

static uint64_t seed_from_env(void) {
  const char *s = getenv("DA_TEST_SEED");
  return s ? strtoull(s, NULL, 0) : 0x10ad5eedull;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

START_TEST(hist_quantiles_within_one_bucket_of_exact) {
  uint64_t seed = seed_from_env();
  da_rng r;
  da_rng_seed(&r, seed);
  enum { N = 20000 };
  static uint64_t v[N];
  static da_hist h;
  da_hist_init(&h);
  for (int i = 0; i < N; i++) {
    v[i] = (uint64_t)(exp(da_rng_normal(&r) * 2.0 + 11.0)); /* lognormal around 60 us in ns */
    da_hist_record(&h, v[i]);
  }
  qsort(v, N, sizeof(v[0]), cmp_u64);
  const double qs[] = {0.0, 0.5, 0.9, 0.99, 0.999, 1.0};
  for (size_t i = 0; i < sizeof(qs) / sizeof(qs[0]); i++) {
    size_t rank = (size_t)ceil(qs[i] * N);
    uint64_t exact = v[rank ? rank - 1 : 0];
    uint64_t got = da_hist_quantile(&h, qs[i]);
    ck_assert_msg(got >= exact && (double)got <= (double)exact * (1.0 + 1.0 / DA_HIST_SUB) + 1,
                  "q=%g exact %" PRIu64 " got %" PRIu64 " (seed %" PRIu64 ")", qs[i], exact, got,
                  seed);
  }
  ck_assert_uint_eq(h.count, N);
  ck_assert_uint_eq(h.min, v[0]);
  ck_assert_uint_eq(h.max, v[N - 1]);
}
END_TEST

START_TEST(hist_buckets_cover_every_value_in_order) {
  uint64_t seed = seed_from_env();
  da_rng r;
  da_rng_seed(&r, seed);
  for (uint32_t b = 0; b < DA_HIST_BUCKETS; b++) {
    uint64_t hi = da_hist_bucket_high(b);
    ck_assert_msg(da_hist_bucket(hi) == b, "bucket %u high %" PRIu64, b, hi);
    if (b + 1 < DA_HIST_BUCKETS) ck_assert_uint_eq(da_hist_bucket(hi + 1), b + 1);
  }
  ck_assert_uint_eq(da_hist_bucket(UINT64_MAX), DA_HIST_BUCKETS - 1);
  for (int i = 0; i < 100000; i++) {
    uint64_t x = da_rng_u64(&r) >> (da_rng_u64(&r) % 64);
    uint32_t b = da_hist_bucket(x);
    ck_assert_msg(da_hist_bucket_high(b) >= x && (b == 0 || da_hist_bucket_high(b - 1) < x),
                  "value %" PRIu64 " in bucket %u (seed %" PRIu64 ")", x, b, seed);
  }
}
END_TEST

START_TEST(hist_merge_equals_recording_everything_in_one) {
  uint64_t seed = seed_from_env();
  da_rng r;
  da_rng_seed(&r, seed);
  static da_hist a, b, all;
  da_hist_init(&a);
  da_hist_init(&b);
  da_hist_init(&all);
  for (int i = 0; i < 5000; i++) {
    uint64_t x = da_rng_u64(&r) % 10000000u;
    da_hist_record(i % 3 ? &a : &b, x);
    da_hist_record(&all, x);
  }
  da_hist_merge(&a, &b);
  ck_assert_uint_eq(a.count, all.count);
  ck_assert_uint_eq(a.min, all.min);
  ck_assert_uint_eq(a.max, all.max);
  ck_assert_int_eq(memcmp(a.buckets, all.buckets, sizeof(a.buckets)), 0);
  ck_assert_uint_eq(da_hist_quantile(&a, 0.99), da_hist_quantile(&all, 0.99));
}
END_TEST

START_TEST(hist_empty_reports_zero) {
  static da_hist h;
  da_hist_init(&h);
  ck_assert_uint_eq(da_hist_quantile(&h, 0.5), 0);
  ck_assert(da_hist_mean(&h) == 0.0);
}
END_TEST

static void small_model(da_workload *w, uint64_t seed) {
  memset(w, 0, sizeof(*w));
  w->seed = seed;
  w->prompt = (da_len_dist){DA_LEN_UNIFORM, 5, 300};
  w->output = (da_len_dist){DA_LEN_UNIFORM, 1, 40};
  w->n_layers = 3;
  w->n_q_heads = 4;
  w->n_kv_heads = 2;
  w->head_dim = 64;
  w->dtype = DA_BF16;
}

START_TEST(workload_lengths_depend_only_on_seed_and_index) {
  uint64_t seed = seed_from_env();
  da_workload w;
  small_model(&w, seed);
  uint32_t p[200], o[200];
  int distinct = 0;
  for (uint64_t i = 0; i < 200; i++) {
    da_workload_lengths(&w, i, &p[i], &o[i]);
    ck_assert_msg(p[i] >= 5 && p[i] <= 300 && o[i] >= 1 && o[i] <= 40,
                  "seq %" PRIu64 " lengths %u,%u (seed %" PRIu64 ")", i, p[i], o[i], seed);
    if (i && p[i] != p[i - 1]) distinct++;
  }
  ck_assert_int_gt(distinct, 100);
  for (int i = 199; i >= 0; i--) { /* any order gives the same lengths */
    uint32_t pp, oo;
    da_workload_lengths(&w, (uint64_t)i, &pp, &oo);
    ck_assert_uint_eq(pp, p[i]);
    ck_assert_uint_eq(oo, o[i]);
  }
}
END_TEST

START_TEST(workload_inputs_do_not_depend_on_chunking) {
  uint64_t seed = seed_from_env();
  da_workload w;
  small_model(&w, seed);
  enum { N = 37 };
  size_t qn = (size_t)N * 4 * 64, kvn = (size_t)N * 2 * 64;
  uint16_t *q = malloc(qn * 2), *k = malloc(kvn * 2), *v = malloc(kvn * 2);
  uint16_t *q2 = malloc(qn * 2), *k2 = malloc(kvn * 2), *v2 = malloc(kvn * 2);
  da_workload_inputs(&w, 7, 2, 100, N, q, k, v);
  for (uint32_t t = 0; t < N; t += 5) {
    uint32_t n = N - t < 5 ? N - t : 5;
    da_workload_inputs(&w, 7, 2, 100 + t, n, q2 + t * 256, k2 + t * 128, v2 + t * 128);
  }
  ck_assert_msg(memcmp(q, q2, qn * 2) == 0 && memcmp(k, k2, kvn * 2) == 0 &&
                memcmp(v, v2, kvn * 2) == 0, "chunked inputs differ (seed %" PRIu64 ")", seed);
  /* Not constant, and another sequence, layer or seed gets other bits. */
  int nonzero = 0;
  for (size_t i = 0; i < qn; i++) nonzero += (q[i] & 0x7fff) != 0;
  ck_assert_int_gt(nonzero, (int)(qn * 9 / 10));
  double sum = 0, sumsq = 0;
  for (size_t i = 0; i < qn; i++) {
    double x = da_to_f32(DA_BF16, q[i]);
    sum += x;
    sumsq += x * x;
  }
  double mean = sum / (double)qn, var = sumsq / (double)qn - mean * mean;
  ck_assert_msg(fabs(mean) < 0.1 && fabs(var - 1.0) < 0.1,
                "inputs mean %g variance %g, want about 0 and 1 (seed %" PRIu64 ")", mean, var, seed);
  da_workload_inputs(&w, 8, 2, 100, N, q2, k2, v2);
  ck_assert(memcmp(q, q2, qn * 2) != 0);
  da_workload_inputs(&w, 7, 1, 100, N, q2, k2, v2);
  ck_assert(memcmp(k, k2, kvn * 2) != 0);
  w.seed = seed + 1;
  da_workload_inputs(&w, 7, 2, 100, N, q2, k2, v2);
  ck_assert(memcmp(v, v2, kvn * 2) != 0);
  free(q); free(k); free(v); free(q2); free(k2); free(v2);
}
END_TEST

START_TEST(len_parse_accepts_fixed_and_range_rejects_garbage) {
  da_len_dist d;
  char msg[128];
  ck_assert_int_eq(da_len_parse("64", &d, msg, sizeof(msg)), DETATTN_OK);
  ck_assert(d.kind == DA_LEN_FIXED && d.lo == 64);
  ck_assert_int_eq(da_len_parse("8:256", &d, msg, sizeof(msg)), DETATTN_OK);
  ck_assert(d.kind == DA_LEN_UNIFORM && d.lo == 8 && d.hi == 256);
  const char *bad[] = {"0", "-3", "9:8", "5:", "x", "", "4:5:6", "12abc"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    d = (da_len_dist){DA_LEN_FIXED, 77, 77};
    msg[0] = '\0';
    ck_assert_msg(da_len_parse(bad[i], &d, msg, sizeof(msg)) == DETATTN_INVALID_ARGUMENT,
                  "\"%s\" accepted", bad[i]);
    ck_assert(strstr(msg, "bad length") != NULL);
    ck_assert_uint_eq(d.lo, 77); /* unchanged */
  }
}
END_TEST

static char tmpdir[64];

static void make_tmpdir(void) {
  snprintf(tmpdir, sizeof(tmpdir), "/tmp/da-load-units-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(tmpdir));
}

static void remove_tmpdir(void) {
  char cmd[128];
  snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
  if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", tmpdir);
}

START_TEST(trace_csv_loads_and_bad_line_is_named) {
  make_tmpdir();
  char path[128], msg[256];
  snprintf(path, sizeof(path), "%s/trace.csv", tmpdir);
  da_test_write_file(path, "prompt,output\n# comment\n100,20\n\n 7 , 3\n512,1\n");
  da_trace_entry *t = NULL;
  size_t n = 0;
  ck_assert_int_eq(da_trace_load(path, &t, &n, msg, sizeof(msg)), DETATTN_OK);
  ck_assert_uint_eq(n, 3);
  ck_assert(t[0].prompt == 100 && t[0].output == 20 && t[1].prompt == 7 && t[1].output == 3 &&
            t[2].prompt == 512 && t[2].output == 1);
  da_workload w;
  small_model(&w, 1);
  w.trace = t;
  w.n_trace = n;
  uint32_t p, o;
  da_workload_lengths(&w, 4, &p, &o); /* 4 mod 3 = 1 */
  ck_assert(p == 7 && o == 3);
  free(t);

  da_test_write_file(path, "10,2\n11,0\n");
  t = NULL;
  ck_assert_int_eq(da_trace_load(path, &t, &n, msg, sizeof(msg)), DETATTN_INVALID_ARGUMENT);
  ck_assert_msg(strstr(msg, "line 2") != NULL, "message: %s", msg);
  ck_assert_ptr_null(t);
  da_test_write_file(path, "# nothing\n");
  ck_assert_int_eq(da_trace_load(path, &t, &n, msg, sizeof(msg)), DETATTN_INVALID_ARGUMENT);
  snprintf(path, sizeof(path), "%s/missing.csv", tmpdir);
  ck_assert_int_eq(da_trace_load(path, &t, &n, msg, sizeof(msg)), DETATTN_NOT_FOUND);
  remove_tmpdir();
}
END_TEST

START_TEST(arrivals_have_the_requested_mean_and_replay_by_seed) {
  uint64_t seed = seed_from_env();
  const double bursts[] = {1.0, 0.25, 4.0};
  for (size_t b = 0; b < 3; b++) {
    da_arrivals a, a2;
    da_arrivals_init(&a, seed, 50.0, bursts[b]);
    da_arrivals_init(&a2, seed, 50.0, bursts[b]);
    enum { N = 40000 };
    double prev = da_arrivals_next(&a), sum = 0, sumsq = 0;
    ck_assert(prev == 0.0 && da_arrivals_next(&a2) == 0.0);
    for (int i = 1; i < N; i++) {
      double t = da_arrivals_next(&a);
      ck_assert(t == da_arrivals_next(&a2));
      double g = t - prev;
      ck_assert(g >= 0);
      sum += g;
      sumsq += g * g;
      prev = t;
    }
    double mean = sum / (N - 1), var = sumsq / (N - 1) - mean * mean;
    double cv2 = var / (mean * mean); /* gamma: 1 / shape */
    ck_assert_msg(fabs(mean - 0.02) < 0.02 * 0.05, "burstiness %g: mean gap %g (seed %" PRIu64 ")",
                  bursts[b], mean, seed);
    ck_assert_msg(fabs(cv2 - 1.0 / bursts[b]) < 0.15 / bursts[b],
                  "burstiness %g: squared CV %g (seed %" PRIu64 ")", bursts[b], cv2, seed);
  }
}
END_TEST

static void fill_record(da_record *r, uint64_t seed) {
  da_rng g;
  da_rng_seed(&g, seed);
  da_record_init(r, 3);
  r->fingerprint = da_rng_u64(&g);
  snprintf(r->numerics, sizeof(r->numerics), "cpu x86_64 kernel=1 split=128 tile=64");
  snprintf(r->workload, sizeof(r->workload), "seed=%" PRIu64 ",prompt:5:300", seed);
  for (uint64_t i = 0; i < 20; i++) {
    da_seq_hashes *s;
    uint64_t idx = 19 - i; /* added out of order */
    ck_assert_int_eq(da_record_add(r, idx * 3, (uint32_t)da_rng_range(&g, 1, 50),
                                   (uint32_t)da_rng_range(&g, 1, 9), &s), DETATTN_OK);
    for (size_t k = 0; k < (size_t)3 * s->n_tokens; k++) s->h[k] = da_rng_u64(&g);
  }
  da_record_sort(r);
}

START_TEST(record_round_trips_through_its_file) {
  uint64_t seed = seed_from_env();
  make_tmpdir();
  char path[128], msg[256];
  snprintf(path, sizeof(path), "%s/run.rec", tmpdir);
  da_record a, b;
  fill_record(&a, seed);
  ck_assert_int_eq(da_record_save(&a, path, msg, sizeof(msg)), DETATTN_OK);
  ck_assert_int_eq(da_record_load(&b, path, msg, sizeof(msg)), DETATTN_OK);
  ck_assert_uint_eq(b.fingerprint, a.fingerprint);
  ck_assert_str_eq(b.workload, a.workload);
  ck_assert_str_eq(b.numerics, a.numerics);
  ck_assert_uint_eq(b.n_seqs, a.n_seqs);
  for (size_t i = 0; i < a.n_seqs; i++) {
    ck_assert_uint_eq(b.seqs[i].index, a.seqs[i].index);
    ck_assert_int_eq(memcmp(b.seqs[i].h, a.seqs[i].h, 3 * a.seqs[i].n_tokens * 8), 0);
  }
  da_record_diff d;
  da_record_compare(&a, &b, &d);
  ck_assert(!d.fingerprints_differ && !d.workloads_differ && d.mismatches == 0 && !d.have_first);
  ck_assert_uint_eq(d.sequences_compared, 20);
  ck_assert_uint_gt(d.outputs_compared, 20);
  da_record_fini(&a);
  da_record_fini(&b);
  remove_tmpdir();
}
END_TEST

START_TEST(record_compare_finds_the_first_planted_difference) {
  uint64_t seed = seed_from_env();
  da_record a, b;
  fill_record(&a, seed);
  fill_record(&b, seed);
  /* Plant differences at sequence index 30 (position 10 of the sorted list) and later. */
  da_seq_hashes *s = &b.seqs[10];
  uint32_t layer = 2, tok = s->n_tokens - 1;
  s->h[(size_t)layer * s->n_tokens + tok] ^= 1;
  b.seqs[15].h[0] ^= 0x8000;
  b.fingerprint ^= 4;
  da_record_diff d;
  da_record_compare(&a, &b, &d);
  ck_assert(d.fingerprints_differ);
  ck_assert_uint_eq(d.mismatches, 2);
  ck_assert(d.have_first);
  ck_assert_uint_eq(d.first_seq, 30);
  ck_assert_uint_eq(d.first_layer, layer);
  ck_assert_uint_eq(d.first_token, tok);
  /* A sequence missing from one side is counted, not compared. */
  free(b.seqs[19].h);
  b.n_seqs--;
  da_record_compare(&a, &b, &d);
  ck_assert_uint_eq(d.sequences_missing, 1);
  ck_assert_uint_eq(d.sequences_compared, 19);
  ck_assert(!da_record_identical(&d));
  /* Without the planted bits, a missing sequence alone is not a difference. */
  b.seqs[10].h[(size_t)layer * s->n_tokens + tok] ^= 1;
  b.seqs[15].h[0] ^= 0x8000;
  da_record_compare(&a, &b, &d);
  ck_assert_uint_eq(d.mismatches, 0);
  ck_assert(da_record_identical(&d));
  /* Nothing in common: not identical. */
  da_record empty;
  da_record_init(&empty, 3);
  da_record_compare(&a, &empty, &d);
  ck_assert(!da_record_identical(&d));
  da_record_fini(&empty);
  da_record_fini(&a);
  da_record_fini(&b);
}
END_TEST

START_TEST(record_load_rejects_a_truncated_file) {
  uint64_t seed = seed_from_env();
  make_tmpdir();
  char path[128], msg[256];
  snprintf(path, sizeof(path), "%s/run.rec", tmpdir);
  da_record a, b;
  fill_record(&a, seed);
  ck_assert_int_eq(da_record_save(&a, path, msg, sizeof(msg)), DETATTN_OK);
  FILE *f = fopen(path, "r+");
  fseek(f, 0, SEEK_END);
  long size = ftell(f);
  fclose(f);
  ck_assert_int_eq(truncate(path, size - 40), 0);
  ck_assert_int_eq(da_record_load(&b, path, msg, sizeof(msg)), DETATTN_DATA_LOSS);
  ck_assert_msg(strstr(msg, "line") != NULL, "message: %s", msg);
  ck_assert_uint_eq(b.n_seqs, 0);
  da_test_write_file(path, "detattn-load-record 2\n");
  ck_assert_int_eq(da_record_load(&b, path, msg, sizeof(msg)), DETATTN_DATA_LOSS);
  snprintf(path, sizeof(path), "%s/none.rec", tmpdir);
  ck_assert_int_eq(da_record_load(&b, path, msg, sizeof(msg)), DETATTN_NOT_FOUND);
  da_record_fini(&a);
  remove_tmpdir();
}
END_TEST

int main(void) {
  Suite *s = suite_create("load_units");
  TCase *h = tcase_create("hist");
  tcase_add_test(h, hist_quantiles_within_one_bucket_of_exact);
  tcase_add_test(h, hist_buckets_cover_every_value_in_order);
  tcase_add_test(h, hist_merge_equals_recording_everything_in_one);
  tcase_add_test(h, hist_empty_reports_zero);
  suite_add_tcase(s, h);
  TCase *w = tcase_create("workload");
  tcase_add_test(w, workload_lengths_depend_only_on_seed_and_index);
  tcase_add_test(w, workload_inputs_do_not_depend_on_chunking);
  tcase_add_test(w, len_parse_accepts_fixed_and_range_rejects_garbage);
  tcase_add_test(w, trace_csv_loads_and_bad_line_is_named);
  tcase_add_test(w, arrivals_have_the_requested_mean_and_replay_by_seed);
  suite_add_tcase(s, w);
  TCase *r = tcase_create("record");
  tcase_add_test(r, record_round_trips_through_its_file);
  tcase_add_test(r, record_compare_finds_the_first_planted_difference);
  tcase_add_test(r, record_load_rejects_a_truncated_file);
  suite_add_tcase(s, r);
  return da_test_run(s);
}
