/* The CPU backend's shared numerics (kernels/cpu/numerics.h): exact dtype loads, and the
 * accuracy and exact points of its exp, log, tanh and merge. */
#include <stdio.h>

#include "kt.h"
#include "numerics.h"

START_TEST(fp16_load_equals_reference_conversion_for_all_inputs) {
  for (uint32_t h = 0; h < 65536; h++) {
    const uint32_t a = da_cpu_bits(da_cpu_fp16((uint16_t)h));
    const uint32_t b = da_cpu_bits(da_fp16_to_f32((uint16_t)h));
    ck_assert_msg(a == b, "fp16 0x%04x: 0x%08x vs reference 0x%08x", h, a, b);
  }
}
END_TEST

START_TEST(bf16_load_equals_reference_conversion_for_all_inputs) {
  for (uint32_t h = 0; h < 65536; h++) {
    const uint32_t a = da_cpu_bits(da_cpu_bf16((uint16_t)h));
    const uint32_t b = da_cpu_bits(da_bf16_to_f32((uint16_t)h));
    ck_assert_msg(a == b, "bf16 0x%04x: 0x%08x vs reference 0x%08x", h, a, b);
  }
}
END_TEST

START_TEST(exp_is_accurate_on_its_domain_and_exact_at_zero) {
  ck_assert(da_cpu_expf(0.0f) == 1.0f);
  ck_assert(da_cpu_expf(-0.0f) == 1.0f);
  ck_assert(da_cpu_expf(-INFINITY) == 0.0f);
  ck_assert(da_cpu_bits(da_cpu_expf(-INFINITY)) == 0u);
  ck_assert(isnan(da_cpu_expf(NAN)));
  double worst = 0.0;
  float at = 0.0f;
  for (float x = -87.0f; x <= 0.0f; x = nextafterf(x, 1.0f) + 1e-5f) {
    const double e = fabs((double)da_cpu_expf(x) / exp((double)x) - 1.0);
    if (e > worst) worst = e, at = x;
  }
  printf("exp: max rel err %.3e at %.6f\n", worst, at);
  ck_assert_msg(worst < 4e-7, "exp rel err %.3e at %.9g", worst, at);
}
END_TEST

START_TEST(log_is_accurate_from_one_to_ten_million) {
  ck_assert(da_cpu_logf(1.0f) == 0.0f);
  ck_assert(isnan(da_cpu_logf(NAN)));
  double worst = 0.0;
  float at = 0.0f;
  for (float x = 1.0f; x < 1e7f; x = x * 1.0001f + 1e-7f) {
    const double ref = log((double)x);
    const double e = fabs((double)da_cpu_logf(x) - ref) / (ref > 1.0 ? ref : 1.0);
    if (e > worst) worst = e, at = x;
  }
  printf("log: max err %.3e at %.6f\n", worst, at);
  ck_assert_msg(worst < 4e-7, "log err %.3e at %.9g", worst, at);
}
END_TEST

START_TEST(tanh_is_accurate_and_odd) {
  double worst = 0.0;
  for (float x = -30.0f; x <= 30.0f; x += 0.000731f) {
    const float t = da_cpu_tanhf(x);
    ck_assert(da_cpu_bits(t) == (da_cpu_bits(da_cpu_tanhf(-x)) ^ 0x80000000u) || t == 0.0f);
    const double e = fabs((double)t - tanh((double)x));
    if (e > worst) worst = e;
  }
  printf("tanh: max abs err %.3e\n", worst);
  ck_assert_msg(worst < 4e-7, "tanh abs err %.3e", worst);
}
END_TEST

START_TEST(merge_of_equal_halves_keeps_output_and_adds_log2) {
  const uint64_t seed = da_test_seed(42);
  da_rng r;
  da_rng_seed(&r, seed);
  float o[128], ob[128], o0[128];
  for (int c = 0; c < 128; c++) o[c] = ob[c] = o0[c] = (float)da_rng_normal(&r);
  const float l0 = (float)(da_rng_uniform(&r) * 20.0 - 5.0);
  float lse = l0;
  da_cpu_merge(o, &lse, ob, l0, 128);
  ck_assert_msg(memcmp(o, o0, sizeof(o)) == 0, "seed %llu: merge changed o", (unsigned long long)seed);
  ck_assert_msg(fabs((double)lse - ((double)l0 + log(2.0))) < 1e-5, "seed %llu: lse %.9g",
                (unsigned long long)seed, lse);
}
END_TEST

START_TEST(merge_weights_splits_by_their_lse) {
  const uint64_t seed = da_test_seed(43);
  da_rng r;
  da_rng_seed(&r, seed);
  for (int trial = 0; trial < 100; trial++) {
    float o[64], ob[64];
    double ref[64];
    const double la = da_rng_normal(&r) * 4.0, lb = da_rng_normal(&r) * 4.0;
    for (int c = 0; c < 64; c++) {
      o[c] = (float)da_rng_normal(&r);
      ob[c] = (float)da_rng_normal(&r);
      const double mx = la > lb ? la : lb;
      const double wa = exp(la - mx), wb = exp(lb - mx);
      ref[c] = (o[c] * wa + ob[c] * wb) / (wa + wb);
    }
    float lse = (float)la;
    da_cpu_merge(o, &lse, ob, (float)lb, 64);
    const double lref = fmax(la, lb) + log(exp(la - fmax(la, lb)) + exp(lb - fmax(la, lb)));
    ck_assert_msg(da_test_max_abs_err_f32(o, ref, 64) < 1e-5, "seed %llu trial %d",
                  (unsigned long long)seed, trial);
    ck_assert_msg(fabs(lse - lref) < 1e-5, "seed %llu trial %d: lse %.7g vs %.7g",
                  (unsigned long long)seed, trial, lse, lref);
  }
}
END_TEST

START_TEST(vector_loads_equal_scalar_loads_for_all_inputs) {
  uint16_t h[16];
  for (uint32_t base = 0; base < 65536; base += 16) {
    for (int j = 0; j < 16; j++) h[j] = (uint16_t)(base + j);
    const da_cpu_v8 b = da_cpu_bf16x8(h), f = da_cpu_fp16x8(h);
    da_cpu_v8 be, bo, fe, fo;
    da_cpu_bf16x16(h, &be, &bo);
    da_cpu_fp16x16(h, &fe, &fo);
    for (int j = 0; j < 8; j++) {
      ck_assert_msg(da_cpu_bits(b[j]) == da_cpu_bits(da_cpu_bf16(h[j])), "bf16 0x%04x", h[j]);
      ck_assert_msg(da_cpu_bits(f[j]) == da_cpu_bits(da_cpu_fp16(h[j])), "fp16 0x%04x", h[j]);
      for (int par = 0; par < 2; par++) {
        const uint16_t x = h[2 * j + par];
        ck_assert_msg(da_cpu_bits((par ? bo : be)[j]) == da_cpu_bits(da_cpu_bf16(x)), "bf16x16 0x%04x", x);
        ck_assert_msg(da_cpu_bits((par ? fo : fe)[j]) == da_cpu_bits(da_cpu_fp16(x)), "fp16x16 0x%04x", x);
      }
    }
  }
}
END_TEST

/* One page of T keys of one kv head in the pool layout: keys [d][T], values [T][d]. */
enum { T = 32, D = 64 }; /* T = 1 << 5 */
typedef struct page {
  uint16_t k[D * T], v[T * D];
  int32_t ids[1];
} page;

static void make_page(page *pg, da_rng *r, da_cpu_kv *kv) {
  for (int i = 0; i < D * T; i++) {
    pg->k[i] = da_f32_to_bf16((float)da_rng_normal(r));
    pg->v[i] = da_f32_to_bf16((float)da_rng_normal(r));
  }
  pg->ids[0] = 0;
  *kv = (da_cpu_kv){.k = pg->k, .v = pg->v, .pages = pg->ids, .page_elems = 0, .ptok = T,
                    .ptok_log2 = 5,
                    .ts = 0, .d = D};
}

START_TEST(grouped_rows_give_the_same_bits_as_single_rows) {
  const uint64_t seed = da_test_seed(45);
  da_rng r;
  da_rng_seed(&r, seed);
  page pg;
  da_cpu_kv kv;
  make_page(&pg, &r, &kv);
  float q[4 * D], s4[4 * T], s1[4 * T], p[4 * T], acc4[4 * D], acc1[4 * D], alpha[4];
  for (int i = 0; i < 4 * D; i++) q[i] = (float)da_rng_normal(&r);
  for (int i = 0; i < 4 * D; i++) acc4[i] = acc1[i] = (float)da_rng_normal(&r);
  for (int i = 0; i < 4; i++) alpha[i] = (float)da_rng_uniform(&r);
  for (int i = 0; i < 4 * T; i++) p[i] = (float)da_rng_uniform(&r);
  /* Keys [8, 32) take the 8-key path, [0, 32) the 16-key path; both give the same bits. */
  for (int c0 = 0; c0 <= 8; c0 += 8) {
    da_cpu_scores4_bf16(q, &kv, T, c0, 32, 0.125f, 7.0f, s4);
    for (int h = 0; h < 4; h++)
      da_cpu_scores1_bf16(q + h * D, &kv, T, c0 == 0 ? 8 : 0, 32, 0.125f, 7.0f, s1 + h * T);
    for (int h = 0; h < 4; h++)
      ck_assert_msg(memcmp(s4 + h * T + 8, s1 + h * T + 8, 24 * sizeof(float)) == 0,
                    "seed %llu: scores of row %d differ (from key %d)", (unsigned long long)seed,
                    h, c0);
  }
  da_cpu_pv4_bf16(acc4, alpha, p, T, &kv, 3, 29);
  for (int h = 0; h < 4; h++) da_cpu_pv1_bf16(acc1 + h * D, alpha + h, p + h * T, T, &kv, 3, 29);
  ck_assert_msg(memcmp(acc4, acc1, sizeof(acc4)) == 0, "seed %llu: p.v differs",
                (unsigned long long)seed);
}
END_TEST

START_TEST(tile_updates_in_two_tiles_match_fp64_softmax) {
  const uint64_t seed = da_test_seed(44);
  da_rng r;
  da_rng_seed(&r, seed);
  page pg[2];
  da_cpu_kv kv[2];
  float q[D], s[T], p[T], acc[D], o[D];
  for (int t = 0; t < 2; t++) make_page(&pg[t], &r, &kv[t]);
  for (int c = 0; c < D; c++) q[c] = (float)(da_rng_normal(&r) * 3.0);
  /* Tile 0 uses keys [5, 32), tile 1 keys [0, 20). */
  const int lo[2] = {5, 0}, hi[2] = {T, 20};
  double sc[2][T], ref[D], mx = -INFINITY, l = 0.0;
  for (int t = 0; t < 2; t++)
    for (int i = lo[t]; i < hi[t]; i++) {
      double dot = 0.0;
      for (int c = 0; c < D; c++) dot += (double)q[c] * da_bf16_to_f32(pg[t].k[c * T + i]);
      sc[t][i] = dot * 0.125;
      mx = sc[t][i] > mx ? sc[t][i] : mx;
    }
  for (int c = 0; c < D; c++) ref[c] = 0.0;
  for (int t = 0; t < 2; t++)
    for (int i = lo[t]; i < hi[t]; i++) {
      const double e = exp(sc[t][i] - mx);
      l += e;
      for (int c = 0; c < D; c++) ref[c] += e * da_bf16_to_f32(pg[t].v[i * D + c]);
    }
  for (int c = 0; c < D; c++) ref[c] /= l;
  da_cpu_row st = {.acc = acc};
  da_cpu_row_init(&st, D);
  for (int t = 0; t < 2; t++) {
    da_cpu_scores1_bf16(q, &kv[t], T, lo[t] & ~7, (hi[t] + 7) & ~7, 0.125f, 0.0f, s);
    const float alpha = da_cpu_softmax_tile(&st.m, &st.l, s, p, lo[t], hi[t]);
    da_cpu_pv1_bf16(acc, &alpha, p, T, &kv[t], lo[t], hi[t]);
  }
  const float lse = da_cpu_finalize(&st, D, o);
  ck_assert_msg(da_test_rel_err_f32(o, ref, D) < 1e-5, "seed %llu", (unsigned long long)seed);
  ck_assert_msg(fabs(lse - (mx + log(l))) < 1e-5, "seed %llu", (unsigned long long)seed);
}
END_TEST

int main(void) {
  Suite *s = suite_create("kernels_numerics");
  TCase *tc = tcase_create("cpu");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, fp16_load_equals_reference_conversion_for_all_inputs);
  tcase_add_test(tc, bf16_load_equals_reference_conversion_for_all_inputs);
  tcase_add_test(tc, exp_is_accurate_on_its_domain_and_exact_at_zero);
  tcase_add_test(tc, log_is_accurate_from_one_to_ten_million);
  tcase_add_test(tc, tanh_is_accurate_and_odd);
  tcase_add_test(tc, merge_of_equal_halves_keeps_output_and_adds_log2);
  tcase_add_test(tc, merge_weights_splits_by_their_lse);
  tcase_add_test(tc, vector_loads_equal_scalar_loads_for_all_inputs);
  tcase_add_test(tc, grouped_rows_give_the_same_bits_as_single_rows);
  tcase_add_test(tc, tile_updates_in_two_tiles_match_fp64_softmax);
  suite_add_tcase(s, tc);
  return da_test_run(s);
}
