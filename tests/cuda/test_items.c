/*
 * test_items.c — the CUDA backend's work items (kernels/cuda/items.c), without a device:
 * how many splits a partial item takes (per) and how many items that makes. The time of a
 * decode step is the longest CTA's share of the items, which the persistent grid deals out
 * round-robin; the tests deal them out the same way and compare with the even share.
 */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>

#include "items.h"
#include "testutil.h"

#define SLOTS 132 /* an H100's or H200's SMs: the persistent grid */
#define S 512
#define T 64
#define BROWS 128 /* prefill_sm90.cu's block at head_dim 128 */

static const da_model model = {.n_layers = 1, .n_q_heads = 32, .n_kv_heads = 8, .head_dim = 128, .dtype = DA_BF16};

/* The longest CTA's work, in key tiles with one more per item for its start, when items go
 * round-robin to SLOTS CTAs in the backend's order (attention, block, kv head, splits
 * ascending); *n the items dealt. */
static int64_t longest_share(const da_model *m, const da_batch *b, int per, int64_t *n) {
  int64_t share[SLOTS] = {0}, best = 0;
  const int G = m->n_q_heads / m->n_kv_heads;
  *n = 0;
  for (int i = 0; i < b->n_attns; i++) {
    for (int64_t r0 = 0; r0 < (int64_t)b->attns[i].n_q * G; r0 += BROWS) {
      int j0, j1;
      da_cu_block_splits(m, BROWS, S, &b->attns[i], r0, &j0, &j1);
      for (int h = 0; h < m->n_kv_heads; h++) {
        for (int j = j0; j < j1; j += per) {
          int64_t *s = &share[*n % SLOTS];
          *s += (j + per < j1 ? per : j1 - j) * (S / T) + 1;
          if (*s > best) best = *s;
          (*n)++;
        }
      }
    }
  }
  return best;
}

START_TEST(decode_items_keep_the_longest_cta_within_a_tenth_of_the_best_per) {
  static const int Bs[] = {1, 2, 3, 4, 6, 8, 12, 16, 20, 24};
  da_attn attns[24];
  unsigned char partial[24];
  int checked = 0;
  for (size_t bi = 0; bi < sizeof(Bs) / sizeof(Bs[0]); bi++) {
    for (int L = 600; L <= 140000; L += 1337) {
      const int B = Bs[bi];
      for (int i = 0; i < B; i++) {
        attns[i] = (da_attn){.q_pos = L - 1, .n_q = 1};
        partial[i] = 1;
      }
      const da_batch b = {.attns = attns, .n_attns = B};
      int64_t n_items = 0, dealt = 0;
      const int per = da_cu_partial_per(&model, BROWS, S, T, &b, partial, SLOTS, &n_items);
      ck_assert_int_ge(per, 1);
      ck_assert_int_le(per, 64);
      const int64_t longest = longest_share(&model, &b, per, &dealt);
      ck_assert_int_eq(n_items, dealt);
      /* The best any per achieves when dealt round-robin. */
      int64_t best = INT64_MAX, best_per = 0, ignored;
      for (int p = 1; p <= 64; p++) {
        const int64_t t = longest_share(&model, &b, p, &ignored);
        if (t < best) best = t, best_per = p;
      }
      if (longest > 1.1 * (double)best)
        ck_abort_msg("B %d L %d: per %d gives the longest CTA %lld tiles, per %lld gives %lld", B, L, per,
                     (long long)longest, (long long)best_per, (long long)best);
      checked++;
    }
  }
  ck_assert_int_eq(checked, 10 * 105);
}
END_TEST

/* Blocks of a prefill attention see different splits (causal; a sliding window moves j0):
 * the count is whole items per block and kv head, and attentions run in-row add none. The
 * expected count is worked out here from positions, not with da_cu_block_splits. */
static int64_t count_by_hand(const da_model *m, const da_attn *attns, const unsigned char *partial, int n, int per) {
  const int G = m->n_q_heads / m->n_kv_heads;
  int64_t items = 0;
  for (int i = 0; i < n; i++) {
    if (!partial[i]) continue;
    const int64_t rows = (int64_t)attns[i].n_q * G;
    for (int64_t r0 = 0; r0 < rows; r0 += BROWS) {
      const int64_t last = r0 + BROWS < rows ? r0 + BROWS : rows;
      const int64_t p0 = attns[i].q_pos + r0 / G, p1 = attns[i].q_pos + (last - 1) / G;
      const int64_t w0 = m->window > 0 && p0 - m->window + 1 > 0 ? p0 - m->window + 1 : 0;
      const int64_t splits = p1 / S - w0 / S + 1;
      items += m->n_kv_heads * ((splits + per - 1) / per);
    }
  }
  return items;
}

START_TEST(items_are_counted_whole_per_block_and_only_for_partial_attentions) {
  da_model m = model;
  m.window = 700;
  const da_attn attns[3] = {{.q_pos = 3000, .n_q = 1000}, {.q_pos = 9000, .n_q = 1}, {.q_pos = 40000, .n_q = 3}};
  const unsigned char partial[3] = {1, 0, 1};
  const da_batch b = {.attns = attns, .n_attns = 3};
  static const int64_t slots[] = {1, 7, 132, 100000};
  for (size_t k = 0; k < sizeof(slots) / sizeof(slots[0]); k++) {
    int64_t n = 0;
    const int per = da_cu_partial_per(&m, BROWS, S, T, &b, partial, slots[k], &n);
    ck_assert_int_eq(n, count_by_hand(&m, attns, partial, 3, per));
  }
  m.window = 0;
  int64_t n = 0;
  const int per = da_cu_partial_per(&m, BROWS, S, T, &b, partial, SLOTS, &n);
  ck_assert_int_eq(n, count_by_hand(&m, attns, partial, 3, per));
  const unsigned char none[3] = {0, 0, 0};
  n = -1;
  ck_assert_int_eq(da_cu_partial_per(&m, BROWS, S, T, &b, none, SLOTS, &n), 1);
  ck_assert_int_eq(n, 0);
}
END_TEST

int main(void) {
  Suite *s = suite_create("cuda_items");
  TCase *tc = tcase_create("per");
  tcase_add_test(tc, decode_items_keep_the_longest_cta_within_a_tenth_of_the_best_per);
  tcase_add_test(tc, items_are_counted_whole_per_block_and_only_for_partial_attentions);
  suite_add_tcase(s, tc);
  return da_test_run(s);
}
