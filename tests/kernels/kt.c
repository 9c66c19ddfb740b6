#include "kt.h"

#include <stdio.h>

void kt_seq_make(kt_seq *s, const da_model *m, da_rng *r, int layer, int len, int page_tokens,
                 uint8_t *used, int pool_pages, double qs) {
  memset(s, 0, sizeof(*s));
  s->m = m;
  s->layer = layer;
  s->len = len;
  s->n_pages = (len + page_tokens - 1) / page_tokens;
  s->pages = calloc((size_t)s->n_pages + 1, sizeof(int32_t));
  ck_assert_ptr_nonnull(s->pages);
  ck_assert_int_eq(da_test_random_pages_from(r, s->pages, s->n_pages, used, pool_pages), 0);
  const size_t nq = (size_t)len * m->n_q_heads * m->head_dim;
  const size_t nk = (size_t)len * m->n_kv_heads * m->head_dim;
  s->q = da_test_random_tensor(r, m->dtype, nq, qs);
  s->k = da_test_random_tensor(r, m->dtype, nk, 1.0);
  s->v = da_test_random_tensor(r, m->dtype, nk, 1.0);
  s->o = malloc(nq * 2 + 1);
  s->lse = malloc(sizeof(float) * (size_t)len * m->n_q_heads + 1);
  ck_assert(s->q && s->k && s->v && s->o && s->lse);
  kt_seq_poison_out(s);
}

void kt_seq_clone(kt_seq *dst, const kt_seq *src, da_rng *r, int page_tokens, uint8_t *used,
                  int pool_pages) {
  kt_seq_make(dst, src->m, r, src->layer, src->len, page_tokens, used, pool_pages, 1.0);
  const size_t nq = (size_t)src->len * src->m->n_q_heads * src->m->head_dim * 2;
  const size_t nk = (size_t)src->len * src->m->n_kv_heads * src->m->head_dim * 2;
  memcpy(dst->q, src->q, nq);
  memcpy(dst->k, src->k, nk);
  memcpy(dst->v, src->v, nk);
}

void kt_seq_free(kt_seq *s) {
  free(s->pages);
  free(s->q);
  free(s->k);
  free(s->v);
  free(s->o);
  free(s->lse);
  memset(s, 0, sizeof(*s));
}

void kt_seq_poison_out(kt_seq *s) {
  da_test_poison(s->m->dtype, s->o, (size_t)s->len * s->m->n_q_heads * s->m->head_dim);
  da_test_poison_f32(s->lse, (size_t)s->len * s->m->n_q_heads);
}

da_append kt_append(const kt_seq *s, int pos, int n) {
  const size_t row = (size_t)s->m->n_kv_heads * s->m->head_dim;
  return (da_append){.layer = s->layer, .pos = pos, .n_tokens = n, .pages = s->pages,
                     .n_pages = s->n_pages, .k = s->k + pos * row, .v = s->v + pos * row};
}

da_attn kt_attn(const kt_seq *s, int pos, int n) {
  const size_t row = (size_t)s->m->n_q_heads * s->m->head_dim;
  return (da_attn){.layer = s->layer, .q_pos = pos, .n_q = n, .pages = s->pages,
                   .n_pages = s->n_pages, .q = s->q + pos * row, .o = s->o + pos * row,
                   .lse = s->lse + (size_t)pos * s->m->n_q_heads};
}

da_backend_cfg kt_cfg(const da_model *m, int split, int tile, int page_tokens, int n_pages,
                      int n_threads) {
  return (da_backend_cfg){.model = *m,
                          .num = {.split_tokens = split, .tile_tokens = tile},
                          .page_tokens = page_tokens,
                          .n_pages = n_pages,
                          .n_threads = n_threads,
                          .poison = 1};
}

da_backend *kt_open(const da_backend_cfg *cfg) {
  da_backend *be = NULL;
  char err[256] = "";
  int rv = da_backend_open(&be, "cpu", cfg, err, sizeof(err));
  ck_assert_msg(rv == 0, "open cpu backend: %s (%s)", detattn_status_name(rv), err);
  return be;
}

void kt_run(da_backend *be, const da_batch *b, uint64_t seed) {
  da_batch_result res;
  int rv = da_backend_run(be, b, &res);
  ck_assert_msg(rv == 0, "seed %llu: run failed: %s (%s)", (unsigned long long)seed,
                detattn_status_name(rv), res.err);
}

void kt_forward(da_backend *be, const kt_seq *s, int pos, int n, da_split_mode mode,
                uint64_t seed) {
  da_append ap = kt_append(s, pos, n);
  da_attn at = kt_attn(s, pos, n);
  da_batch b = {.appends = &ap, .n_appends = 1, .attns = &at, .n_attns = 1, .split_mode = mode};
  kt_run(be, &b, seed);
}

void kt_assert_same_bits(const kt_seq *a, const kt_seq *b, uint64_t seed, const char *what) {
  const size_t no = (size_t)a->len * a->m->n_q_heads * a->m->head_dim * 2;
  ptrdiff_t d = da_test_first_diff(a->o, b->o, no);
  ck_assert_msg(d < 0, "seed %llu: %s: o differs at byte %td (token %td)",
                (unsigned long long)seed, what, d,
                d / (ptrdiff_t)(a->m->n_q_heads * a->m->head_dim * 2));
  const size_t nl = (size_t)a->len * a->m->n_q_heads * sizeof(float);
  d = da_test_first_diff(a->lse, b->lse, nl);
  ck_assert_msg(d < 0, "seed %llu: %s: lse differs at byte %td", (unsigned long long)seed, what,
                d);
}

da_model kt_model(int layers, int hq, int hk, int d, da_dtype dt, float softcap, int window) {
  da_model m = {.n_layers = layers, .n_q_heads = hq, .n_kv_heads = hk, .head_dim = d,
                .dtype = dt, .softcap = softcap, .window = window};
  da_model_defaults(&m);
  return m;
}
