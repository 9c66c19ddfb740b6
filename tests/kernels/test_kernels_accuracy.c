/* CPU backend accuracy against the fp64 reference, over dtypes, GQA shapes, head dims,
 * windows, softcap and long contexts with many splits. */
#include <stdio.h>

#include "kt.h"

typedef struct acc_case {
  const char *name;
  int hq, hk, d;
  da_dtype dt;
  float softcap;
  int window, len, split, tile, ptok;
  double qs;
} acc_case;

static const acc_case cases[] = {
    {"bf16 8q/2kv d128 17 splits", 8, 2, 128, DA_BF16, 0.0f, 0, 1100, 64, 16, 16, 1.0},
    {"fp16 8q/2kv d128 17 splits", 8, 2, 128, DA_FP16, 0.0f, 0, 1100, 64, 16, 16, 1.0},
    {"bf16 4q/1kv d64 window 200", 4, 1, 64, DA_BF16, 0.0f, 200, 900, 128, 32, 8, 1.0},
    {"fp16 4q/1kv d256 softcap 5", 4, 1, 256, DA_FP16, 5.0f, 0, 700, 64, 32, 32, 2.0},
    {"bf16 4q/4kv d256 window+softcap", 4, 4, 256, DA_BF16, 10.0f, 300, 1300, 128, 64, 64, 3.0},
    {"fp16 8q/2kv d64 window 50", 8, 2, 64, DA_FP16, 0.0f, 50, 600, 64, 16, 16, 1.0},
    {"bf16 2q/1kv d128 16 splits page 128", 2, 1, 128, DA_BF16, 0.0f, 0, 2000, 128, 64, 128, 1.5},
    {"fp16 16q/2kv d128 one split", 16, 2, 128, DA_FP16, 0.0f, 0, 509, 512, 64, 16, 1.0},
    {"bf16 8q/1kv d128 sharp scores", 8, 1, 128, DA_BF16, 0.0f, 0, 800, 64, 32, 16, 4.0},
};

/* Checks the queries [pos, pos + n) of s against the reference. */
static void check_range(const kt_seq *s, int pos, int n, const acc_case *c, uint64_t seed,
                        const char *mode) {
  const da_model *m = s->m;
  const size_t row = (size_t)m->n_q_heads * m->head_dim;
  double *ref = malloc(sizeof(double) * row * n);
  double *rlse = malloc(sizeof(double) * m->n_q_heads * n);
  ck_assert(ref && rlse);
  ck_assert_int_eq(da_test_ref_attention(m, s->k, s->v, s->len, s->q + pos * row, pos, n, ref,
                                         rlse), 0);
  const double rel = da_test_rel_err(m->dtype, s->o + pos * row, ref, row * n);
  const double lerr = da_test_max_abs_err_f32(s->lse + (size_t)pos * m->n_q_heads, rlse,
                                              (size_t)m->n_q_heads * n);
  const double bound = m->dtype == DA_BF16 ? 4e-3 : 5e-4;
  printf("accuracy %-36s %-7s queries [%4d,%4d): rel err %.2e (bound %.0e), lse max abs err "
         "%.2e\n", c->name, mode, pos, pos + n, rel, bound, lerr);
  ck_assert_msg(rel < bound, "seed %llu: %s: rel err %.3e >= %.1e", (unsigned long long)seed,
                c->name, rel, bound);
  ck_assert_msg(lerr < 2e-5, "seed %llu: %s: lse err %.3e", (unsigned long long)seed, c->name,
                lerr);
  free(ref);
  free(rlse);
}

START_TEST(output_matches_fp64_reference) {
  const acc_case *c = &cases[_i];
  const uint64_t seed = da_test_seed(1000 + (uint64_t)_i);
  da_rng r;
  da_rng_seed(&r, seed);
  da_model m = kt_model(2, c->hq, c->hk, c->d, c->dt, c->softcap, c->window);
  const int pool = (c->len + c->ptok - 1) / c->ptok + 7;
  uint8_t *used = calloc((size_t)pool, 1);
  kt_seq s;
  kt_seq_make(&s, &m, &r, 1, c->len, c->ptok, used, pool, c->qs);
  da_backend_cfg cfg = kt_cfg(&m, c->split, c->tile, c->ptok, pool, 2);
  da_backend *be = kt_open(&cfg);
  const int head = 8, tail = 24;
  const da_split_mode modes[] = {DA_SPLIT_INROW, DA_SPLIT_PARTIAL};
  const char *names[] = {"in-row", "partial"};
  for (int mi = 0; mi < 2; mi++) {
    kt_seq_poison_out(&s);
    da_append ap = kt_append(&s, 0, c->len);
    da_attn at[2] = {kt_attn(&s, 0, head), kt_attn(&s, c->len - tail, tail)};
    da_batch b = {.appends = &ap, .n_appends = 1, .attns = at, .n_attns = 2,
                  .split_mode = modes[mi]};
    da_batch_result res;
    int rv = da_backend_run(be, &b, &res);
    ck_assert_msg(rv == 0, "seed %llu: %s", (unsigned long long)seed, res.err);
    ck_assert_int_eq(mi == 0 ? res.inrow_rows : res.partial_rows, (head + tail) * c->hq);
    check_range(&s, 0, head, c, seed, names[mi]);
    check_range(&s, c->len - tail, tail, c, seed, names[mi]);
  }
  da_backend_close(be);
  kt_seq_free(&s);
  free(used);
}
END_TEST

int main(void) {
  Suite *s = suite_create("kernels_accuracy");
  TCase *tc = tcase_create("cpu");
  tcase_set_timeout(tc, 60);
  tcase_add_loop_test(tc, output_matches_fp64_reference, 0, (int)(sizeof(cases) / sizeof(cases[0])));
  suite_add_tcase(s, tc);
  return da_test_run(s);
}
