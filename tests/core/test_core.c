/* Unit tests for da_core (kernels/da.c, kernels/hist.c): dtype conversions, model checks,
 * fingerprint, status names, histogram counts at Prometheus bounds. */
#include <check.h>
#include <stdlib.h>

#include "da.h"
#include "hist.h"
#include "testutil.h"

START_TEST(fp16_round_trips_every_finite_value) {
  for (uint32_t h = 0; h < 0x10000u; h++) {
    float f = da_fp16_to_f32((uint16_t)h);
    if (isnan(f)) {
      ck_assert_msg(isnan(da_fp16_to_f32(da_f32_to_fp16(f))), "NaN %04x lost", h);
      continue;
    }
    ck_assert_msg(da_f32_to_fp16(f) == h, "fp16 %04x -> %a -> %04x", h, (double)f,
                  da_f32_to_fp16(f));
  }
}
END_TEST

START_TEST(fp16_rounds_to_nearest_even) {
  /* 1 + 2^-11 lies halfway between 1 and the next fp16 (1 + 2^-10): ties go to even (1). */
  ck_assert_uint_eq(da_f32_to_fp16(1.0f + 0x1.0p-11f), 0x3c00);
  ck_assert_uint_eq(da_f32_to_fp16(1.0f + 3 * 0x1.0p-11f), 0x3c02);
  ck_assert_uint_eq(da_f32_to_fp16(1.0f + 0x1.8p-11f), 0x3c01);
  ck_assert_uint_eq(da_f32_to_fp16(65520.0f), 0x7c00);      /* overflows to inf */
  ck_assert_uint_eq(da_f32_to_fp16(65504.0f), 0x7bff);      /* largest finite */
  ck_assert_uint_eq(da_f32_to_fp16(0x1.0p-25f), 0x0000);    /* half the smallest subnormal: even */
  ck_assert_uint_eq(da_f32_to_fp16(0x1.8p-25f), 0x0001);
  ck_assert_uint_eq(da_f32_to_fp16(-0x1.0p-24f), 0x8001);
}
END_TEST

START_TEST(bf16_rounds_to_nearest_even) {
  for (uint32_t h = 0; h < 0x10000u; h++) {
    float f = da_bf16_to_f32((uint16_t)h);
    if (isnan(f)) continue;
    ck_assert_uint_eq(da_f32_to_bf16(f), h);
  }
  ck_assert_uint_eq(da_f32_to_bf16(1.0f + 0x1.0p-8f), 0x3f80);  /* tie -> even */
  ck_assert_uint_eq(da_f32_to_bf16(1.0f + 0x1.8p-8f), 0x3f81);
  ck_assert_uint_eq(da_f32_to_bf16(1.0f + 3 * 0x1.0p-8f), 0x3f82);
  ck_assert(isnan(da_bf16_to_f32(da_f32_to_bf16(NAN))));
}
END_TEST

static da_model model(void) {
  da_model m = {.n_layers = 2, .n_q_heads = 8, .n_kv_heads = 2, .head_dim = 128, .dtype = DA_BF16};
  da_model_defaults(&m);
  return m;
}

START_TEST(model_check_rejects_bad_configs) {
  da_numerics nu = {.split_tokens = 512, .tile_tokens = 64};
  da_model m = model();
  char msg[128];
  ck_assert_int_eq(da_model_check(&m, &nu, msg, sizeof(msg)), 0);
  m.n_q_heads = 6; /* not a multiple of 4 kv heads */
  m.n_kv_heads = 4;
  ck_assert_int_eq(da_model_check(&m, &nu, msg, sizeof(msg)), DETATTN_INVALID_ARGUMENT);
  ck_assert_ptr_nonnull(strstr(msg, "multiple"));
  m = model();
  m.head_dim = 96;
  ck_assert_int_eq(da_model_check(&m, &nu, msg, sizeof(msg)), DETATTN_INVALID_ARGUMENT);
  m = model();
  nu.split_tokens = 100;
  ck_assert_int_eq(da_model_check(&m, &nu, msg, sizeof(msg)), DETATTN_INVALID_ARGUMENT);
  ck_assert_ptr_nonnull(strstr(msg, "split"));
}
END_TEST

START_TEST(fingerprint_covers_every_numerics_input) {
  da_numerics nu = {.split_tokens = 512, .tile_tokens = 64};
  da_model m = model();
  uint64_t base = da_fingerprint("cpu", 1, "x86_64", &m, &nu);
  ck_assert_uint_eq(base, da_fingerprint("cpu", 1, "x86_64", &m, &nu));
  ck_assert_uint_ne(base, da_fingerprint("cuda", 1, "x86_64", &m, &nu));
  ck_assert_uint_ne(base, da_fingerprint("cpu", 2, "x86_64", &m, &nu));
  ck_assert_uint_ne(base, da_fingerprint("cpu", 1, "sm_90", &m, &nu));
  da_numerics nu2 = nu;
  nu2.split_tokens = 256;
  ck_assert_uint_ne(base, da_fingerprint("cpu", 1, "x86_64", &m, &nu2));
  nu2 = nu;
  nu2.tile_tokens = 32;
  ck_assert_uint_ne(base, da_fingerprint("cpu", 1, "x86_64", &m, &nu2));
  da_model m2 = m;
  m2.dtype = DA_FP16;
  ck_assert_uint_ne(base, da_fingerprint("cpu", 1, "x86_64", &m2, &nu));
  m2 = m;
  m2.scale = 0.1f;
  ck_assert_uint_ne(base, da_fingerprint("cpu", 1, "x86_64", &m2, &nu));
  m2 = m;
  m2.softcap = 30.0f;
  ck_assert_uint_ne(base, da_fingerprint("cpu", 1, "x86_64", &m2, &nu));
  m2 = m;
  m2.window = 128;
  ck_assert_uint_ne(base, da_fingerprint("cpu", 1, "x86_64", &m2, &nu));
  m2 = m;
  m2.head_dim = 64;
  ck_assert_uint_ne(base, da_fingerprint("cpu", 1, "x86_64", &m2, &nu));
  /* Heads and layers do not change a row's arithmetic: not part of the fingerprint. */
  m2 = m;
  m2.n_layers = 7;
  ck_assert_uint_eq(base, da_fingerprint("cpu", 1, "x86_64", &m2, &nu));
}
END_TEST

START_TEST(status_names_follow_the_map) {
  ck_assert_str_eq(detattn_status_name(DETATTN_RESOURCE_EXHAUSTED), "RESOURCE_EXHAUSTED");
  ck_assert_str_eq(detattn_status_name(14), "UNAVAILABLE");
  ck_assert_str_eq(detattn_status_name(999), "UNKNOWN_STATUS");
  ck_assert_str_eq(detattn_status_str(DETATTN_NOT_FOUND), "not found");
}
END_TEST

START_TEST(rng_is_seeded_and_spread) {
  da_rng a, b;
  da_rng_seed(&a, 42);
  da_rng_seed(&b, 42);
  double sum = 0, sq = 0;
  for (int i = 0; i < 20000; i++) {
    double x = da_rng_normal(&a);
    ck_assert(x == da_rng_normal(&b));
    sum += x;
    sq += x * x;
  }
  ck_assert(fabs(sum / 20000) < 0.05);
  ck_assert(fabs(sq / 20000 - 1.0) < 0.05);
}
END_TEST

START_TEST(hist_count_le_is_exact_at_powers_of_two) {
  da_rng r;
  da_rng_seed(&r, da_test_seed(7));
  static da_hist h;
  da_hist_init(&h);
  enum { N = 50000 };
  static uint64_t v[N];
  for (int i = 0; i < N; i++) {
    v[i] = (uint64_t)(da_rng_uniform(&r) * 1e7) >> (da_rng_u64(&r) % 20);
    da_hist_record(&h, v[i]);
  }
  for (int e = 0; e < 30; e++) {
    uint64_t bound = (1ull << e) - 1, exact = 0;
    for (int i = 0; i < N; i++) exact += v[i] <= bound;
    ck_assert_msg(da_hist_count_le(&h, bound) == exact, "le %llu: %llu, exact %llu", (unsigned long long)bound,
                  (unsigned long long)da_hist_count_le(&h, bound), (unsigned long long)exact);
  }
  ck_assert_uint_eq(da_hist_count_le(&h, UINT64_MAX), N);
}
END_TEST

int main(void) {
  Suite *s = suite_create("core");
  TCase *tc = tcase_create("core");
  tcase_add_test(tc, fp16_round_trips_every_finite_value);
  tcase_add_test(tc, fp16_rounds_to_nearest_even);
  tcase_add_test(tc, bf16_rounds_to_nearest_even);
  tcase_add_test(tc, model_check_rejects_bad_configs);
  tcase_add_test(tc, fingerprint_covers_every_numerics_input);
  tcase_add_test(tc, status_names_follow_the_map);
  tcase_add_test(tc, rng_is_seeded_and_spread);
  tcase_add_test(tc, hist_count_le_is_exact_at_powers_of_two);
  suite_add_tcase(s, tc);
  return da_test_run(s);
}
