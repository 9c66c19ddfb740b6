/*
 * kt.h — helpers for the kernel tests: one sequence of random tokens with its own page
 * table in a shared pool, and batches built from it for kernels/backend.h.
 */
#ifndef DA_KT_H
#define DA_KT_H

#include <check.h>
#include <stdlib.h>

#include "backend.h"
#include "testutil.h"

/* One sequence of len tokens of one layer: q: [len][hq][d], k, v: [len][hk][d]; its pages
 * are drawn at random from a pool. Outputs o: [len][hq][d], lse: [len][hq]. */
/* A model/numerics shape a kernel test runs over. */
typedef struct kt_case {
  const char *name;
  int hq, hk, d;
  da_dtype dt;
  float softcap;
  int window, split, tile, ptok;
} kt_case;

typedef struct kt_seq {
  const da_model *m;
  int layer, len, n_pages;
  int32_t *pages;
  uint16_t *q, *k, *v, *o;
  float *lse;
} kt_seq;

/* Random tokens; q drawn with stddev qs (k, v with 1). Page ids from used[] (see
 * da_test_random_pages_from); aborts the test if the pool is full. */
void kt_seq_make(kt_seq *s, const da_model *m, da_rng *r, int layer, int len, int page_tokens,
                 uint8_t *used, int pool_pages, double qs);
/* A copy of src's tokens (and length) with its own random pages and poisoned outputs. */
void kt_seq_clone(kt_seq *dst, const kt_seq *src, da_rng *r, int page_tokens, uint8_t *used,
                  int pool_pages);
void kt_seq_free(kt_seq *s);
/* Poisons s->o and s->lse so that unwritten outputs show. */
void kt_seq_poison_out(kt_seq *s);

/* Fills an append of tokens [pos, pos + n) and an attention over the same tokens. */
da_append kt_append(const kt_seq *s, int pos, int n);
da_attn kt_attn(const kt_seq *s, int pos, int n);

/* A backend config for tests: poisoned pools. */
da_backend_cfg kt_cfg(const da_model *m, int split, int tile, int page_tokens, int n_pages,
                      int n_threads);
da_backend *kt_open(const da_backend_cfg *cfg);

/* Runs one batch and fails the test (with seed) unless it succeeds. */
void kt_run(da_backend *be, const da_batch *b, uint64_t seed);
/* Runs append + attention of [pos, pos + n) of s as one batch. */
void kt_forward(da_backend *be, const kt_seq *s, int pos, int n, da_split_mode mode,
                uint64_t seed);

/* Asserts o and lse of a and b equal bit for bit over tokens [0, len). */
void kt_assert_same_bits(const kt_seq *a, const kt_seq *b, uint64_t seed, const char *what);

/* Model with defaults filled in. */
da_model kt_model(int layers, int hq, int hk, int d, da_dtype dt, float softcap, int window);

#endif
