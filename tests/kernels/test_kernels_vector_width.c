/* The CPU backend gives the same bits whatever vector width its loops were compiled for:
 * the default build (AVX2 clones where the CPU has AVX2) against a baseline SSE2 build of
 * the same sources. */
#include <stdio.h>

#include "kt.h"

extern const da_backend_ops da_cpu_sse2_backend_ops;

static const kt_case cases[] = {
    {"bf16 8q/2kv d128", 8, 2, 128, DA_BF16, 0.0f, 0, 64, 64, 16},
    {"fp16 4q/1kv d256 softcap 15 window 70", 4, 1, 256, DA_FP16, 15.0f, 70, 64, 16, 8},
    {"bf16 2q/2kv d64 page 128", 2, 2, 64, DA_BF16, 0.0f, 0, 128, 32, 128},
};
#define POOL 1024

START_TEST(sse2_and_default_builds_give_same_bits) {
  const kt_case *c = &cases[_i];
  const uint64_t seed = da_test_seed(11000 + (uint64_t)_i);
  da_rng r;
  da_rng_seed(&r, seed);
  da_model m = kt_model(1, c->hq, c->hk, c->d, c->dt, c->softcap, c->window);
  da_backend_cfg cfg = kt_cfg(&m, c->split, c->tile, c->ptok, POOL, 2);
  da_backend *fast = kt_open(&cfg);
  void *base = NULL;
  da_backend_info info;
  char err[256];
  ck_assert_int_eq(da_cpu_sse2_backend_ops.create(&base, &cfg, &info, err, sizeof(err)), 0);
  uint8_t used[POOL] = {0};
  enum { N = 3 };
  kt_seq a[N], b[N];
  for (int i = 0; i < N; i++) {
    kt_seq_make(&a[i], &m, &r, 0, (int)da_rng_range(&r, 100, 600), c->ptok, used, POOL, 2.0);
    kt_seq_clone(&b[i], &a[i], &r, c->ptok, used, POOL);
  }
  for (int i = 0; i < N; i++) {
    kt_forward(fast, &a[i], 0, a[i].len, DA_SPLIT_AUTO, seed);
    da_append ap = kt_append(&b[i], 0, b[i].len);
    da_attn at = kt_attn(&b[i], 0, b[i].len);
    da_batch bt = {.appends = &ap, .n_appends = 1, .attns = &at, .n_attns = 1,
                   .split_mode = i == 1 ? DA_SPLIT_PARTIAL : DA_SPLIT_INROW};
    da_batch_result res = {0};
    ck_assert_int_eq(da_cpu_sse2_backend_ops.run(base, &bt, &res), 0);
    kt_assert_same_bits(&a[i], &b[i], seed, c->name);
  }
  for (int i = 0; i < N; i++) {
    kt_seq_free(&a[i]);
    kt_seq_free(&b[i]);
  }
  da_cpu_sse2_backend_ops.destroy(base);
  da_backend_close(fast);
}
END_TEST

int main(void) {
  printf("CPU has AVX2: %s\n", __builtin_cpu_supports("avx2") ? "yes" : "no (both builds are SSE2)");
  Suite *s = suite_create("kernels_vector_width");
  TCase *tc = tcase_create("cpu");
  tcase_set_timeout(tc, 60);
  tcase_add_loop_test(tc, sse2_and_default_builds_give_same_bits, 0,
                      (int)(sizeof(cases) / sizeof(cases[0])));
  suite_add_tcase(s, tc);
  return da_test_run(s);
}
