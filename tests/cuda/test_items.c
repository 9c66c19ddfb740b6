/*
 * test_items.c — the CUDA backend's work items (kernels/cuda/items.c), without a device:
 * how many splits a partial item takes (per) and how many items that makes, prefix items and
 * one-split tails, and how blocks' items cover their splits. The time of a
 * decode step is the longest CTA's share of the items, which the persistent grid deals out
 * round-robin; the tests deal them out the same way and compare with the even share.
 */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
      const int per = da_cu_partial_per(&model, BROWS, S, T, &b, partial, 0, SLOTS, &n_items);
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
 * the count is whole items per block and kv head, and attentions run in-row add none; a
 * block of more than 2 k splits has k one-split tail items more. The expected count is
 * worked out here from positions, not with da_cu_block_splits. */
static int64_t count_by_hand(const da_model *m, const da_attn *attns, const unsigned char *partial, int n, int per,
                             int k) {
  const int G = m->n_q_heads / m->n_kv_heads;
  int64_t items = 0;
  for (int i = 0; i < n; i++) {
    if (!partial[i]) continue;
    const int64_t rows = (int64_t)attns[i].n_q * G;
    for (int64_t r0 = 0; r0 < rows; r0 += BROWS) {
      const int64_t last = r0 + BROWS < rows ? r0 + BROWS : rows;
      const int64_t p0 = attns[i].q_pos + r0 / G, p1 = attns[i].q_pos + (last - 1) / G;
      const int64_t w0 = m->window > 0 && p0 - m->window + 1 > 0 ? p0 - m->window + 1 : 0;
      const int64_t splits = p1 / S - w0 / S + 1, tail = splits > 2 * k ? k : 0;
      items += m->n_kv_heads * ((splits - tail + per - 1) / per + tail);
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
  for (int tail = 0; tail <= 3; tail += 3)
    for (size_t k = 0; k < sizeof(slots) / sizeof(slots[0]); k++) {
      int64_t n = 0;
      const int per = da_cu_partial_per(&m, BROWS, S, T, &b, partial, tail, slots[k], &n);
      ck_assert_int_eq(n, count_by_hand(&m, attns, partial, 3, per, tail));
    }
  m.window = 0;
  int64_t n = 0, first = 0;
  const int per = da_cu_partial_per(&m, BROWS, S, T, &b, partial, 0, SLOTS, &n);
  ck_assert_int_eq(n, count_by_hand(&m, attns, partial, 3, per, 0));
  /* Any per and tail, as DA_CUDA_PARTIAL_PER and DA_CUDA_PER_TAIL set them; *n_first leaves
   * the tails out. */
  for (int k = 1; k <= 64; k *= 2)
    for (int tail = 0; tail <= 5; tail += 5) {
      ck_assert_int_eq(da_cu_partial_items(&m, BROWS, S, &b, partial, k, tail, &first),
                       count_by_hand(&m, attns, partial, 3, k, tail));
      /* one block has a tail: the 3-token attention's 79 splits (the others' are 8 or fewer) */
      ck_assert_int_eq(first, count_by_hand(&m, attns, partial, 3, k, tail) - 8 * tail);
    }
  const unsigned char none[3] = {0, 0, 0};
  n = -1;
  ck_assert_int_eq(da_cu_partial_per(&m, BROWS, S, T, &b, none, 0, SLOTS, &n), 1);
  ck_assert_int_eq(n, 0);
}
END_TEST

/* The tail of a DA_CU_PART_TAIL block: the rule n / 8 from 32 splits, a fixed k, never more
 * than half the block. */
START_TEST(tails_are_an_eighth_from_32_splits_and_less_than_half) {
  ck_assert_int_eq(da_cu_tail_splits(-1, 128), 16);
  ck_assert_int_eq(da_cu_tail_splits(-1, 32), 4);
  ck_assert_int_eq(da_cu_tail_splits(-1, 31), 0);
  ck_assert_int_eq(da_cu_tail_splits(-1, 8), 0);
  ck_assert_int_eq(da_cu_tail_splits(0, 128), 0);
  ck_assert_int_eq(da_cu_tail_splits(2, 8), 2);
  ck_assert_int_eq(da_cu_tail_splits(2, 4), 0);
  ck_assert_int_eq(da_cu_tail_splits(64, 129), 64);
  ck_assert_int_eq(da_cu_tail_splits(64, 128), 0);
}
END_TEST

/* A decode launch takes partial blocks' tails by the rule where its items would be long: B 8
 * (16) decode rows at L 64k over 2 pipes of 132 CTAs are 64 (128) kv-head blocks of 128
 * splits, items of 32 (64) splits; B 1 and 2 make items of 4 and 8, B 4 of 16. A setting
 * (DA_CUDA_PER_TAIL) is taken as it is. */
START_TEST(partial_tails_by_rule_only_after_long_items) {
  static const struct {
    int B, want;
  } cases[] = {{1, 0}, {2, 0}, {4, -1}, {8, -1}, {16, -1}};
  da_attn attns[16];
  unsigned char partial[16];
  for (int i = 0; i < 16; i++) attns[i] = (da_attn){.q_pos = 65535, .n_q = 1}, partial[i] = DA_CU_PART_PER;
  for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
    const da_batch b = {.attns = attns, .n_attns = cases[k].B};
    int64_t n = 0;
    const int per0 = da_cu_partial_per(&model, 16, S, T, &b, partial, 0, 2 * SLOTS, &n);
    ck_assert_int_eq(da_cu_per_tail(-1, per0), cases[k].want);
    ck_assert_int_eq(da_cu_per_tail(0, per0), 0);
    ck_assert_int_eq(da_cu_per_tail(3, per0), 3);
  }
  /* B 8 with the rule's tail (16 of 128 splits): items of 28 splits (112 / 4), 64 x (4 + 16) */
  const da_batch b8 = {.attns = attns, .n_attns = 8};
  int64_t n = 0;
  ck_assert_int_eq(da_cu_partial_per(&model, 16, S, T, &b8, partial, -1, 2 * SLOTS, &n), 28);
  ck_assert_int_eq(n, 64 * (4 + 16));
}
END_TEST

/* Without a window every row of a block starts at its first split; with one, a block whose
 * last row's window starts a split later may not have a prefix item. Positions worked out
 * here: G 4, so a block of 128 rows is 32 tokens. */
/* da_cu_partial_per counts each block's splits once (runs of equal counts); its per and
 * item count must be those of the cost rule evaluated block by block with
 * da_cu_partial_items, on mixed batches: windows, prefill rows, other kinds, every tail. */
START_TEST(per_choice_matches_the_rule_counted_block_by_block) {
  srand(3);
  static const int tails[] = {-1, 0, 2, 4};
  da_attn attns[40];
  unsigned char partial[40];
  for (int rep = 0; rep < 3000; rep++) {
    const int kvh = 1 << (rand() % 4);
    const da_model m = {.n_layers = 1, .n_kv_heads = kvh, .n_q_heads = kvh << (rand() % 4), .head_dim = 128,
                        .dtype = DA_BF16, .window = rand() % 3 == 0 ? 100 + rand() % 3000 : 0};
    const int split = 256 << (rand() % 3), brows = rand() % 2 ? 16 : BROWS, B = 1 + rand() % 40;
    for (int i = 0; i < B; i++) {
      attns[i] = (da_attn){.q_pos = rand() % 70000, .n_q = rand() % 4 == 0 ? 1 + rand() % 40 : 1};
      partial[i] = rand() % 4 ? DA_CU_PART_PER : rand() % 2 ? DA_CU_INROW : DA_CU_PART_TAIL;
    }
    const da_batch b = {.attns = attns, .n_attns = B};
    const int tail = tails[rand() % 4];
    const int64_t slots = 1 + rand() % 400;
    int64_t best = INT64_MAX, want_n = 0;
    int want = 1;
    for (int per = 1; per <= 64; per++) {
      int64_t first = 0;
      const int64_t n = da_cu_partial_items(&m, brows, split, &b, partial, per, tail, &first);
      if (n == 0) break;
      const int64_t cost = (first + slots - 1) / slots * (per * (split / T) + 1);
      if (cost <= best) best = cost, want = per, want_n = n;
    }
    int64_t n = -1;
    ck_assert_int_eq(da_cu_partial_per(&m, brows, split, T, &b, partial, tail, slots, &n), want);
    ck_assert_int_eq(n, want_n);
  }
}
END_TEST

/* The split form of an attention from the batch's in-row blocks on 132 SMs (an H100's or
 * H200's): partials below 105 blocks on the sm90 decode pipes (B 8-13 of 8 kv heads), below
 * 198 on attn.cu; in-row above, and with one-split tails from 198 blocks where the rows have
 * a tail; the forced modes whatever the blocks. */
START_TEST(attn_kind_from_the_blocks_against_the_sms) {
  ck_assert_int_eq(da_cu_attn_kind(DA_SPLIT_AUTO, 64, SLOTS, 1, 4), DA_CU_PART_PER);
  ck_assert_int_eq(da_cu_attn_kind(DA_SPLIT_AUTO, 104, SLOTS, 1, 0), DA_CU_PART_PER);
  ck_assert_int_eq(da_cu_attn_kind(DA_SPLIT_AUTO, 105, SLOTS, 1, 0), DA_CU_INROW);
  ck_assert_int_eq(da_cu_attn_kind(DA_SPLIT_AUTO, 128, SLOTS, 1, 4), DA_CU_INROW);   /* tails wait for 198 */
  ck_assert_int_eq(da_cu_attn_kind(DA_SPLIT_AUTO, 197, SLOTS, 1, 4), DA_CU_INROW);
  ck_assert_int_eq(da_cu_attn_kind(DA_SPLIT_AUTO, 198, SLOTS, 1, 4), DA_CU_PART_TAIL);
  ck_assert_int_eq(da_cu_attn_kind(DA_SPLIT_AUTO, 256, SLOTS, 1, 0), DA_CU_INROW);   /* no tail */
  ck_assert_int_eq(da_cu_attn_kind(DA_SPLIT_AUTO, 128, SLOTS, 0, 0), DA_CU_PART_PER); /* attn.cu */
  ck_assert_int_eq(da_cu_attn_kind(DA_SPLIT_AUTO, 198, SLOTS, 0, 0), DA_CU_INROW);
  ck_assert_int_eq(da_cu_attn_kind(DA_SPLIT_PARTIAL, 1000, SLOTS, 1, 4), DA_CU_PART_PER);
  ck_assert_int_eq(da_cu_attn_kind(DA_SPLIT_INROW, 8, SLOTS, 1, 4), DA_CU_INROW);
}
END_TEST

START_TEST(prefix_rows_need_every_row_to_start_at_the_first_split) {
  da_model m = model;
  const da_attn dec = {.q_pos = 70000, .n_q = 1}, pre = {.q_pos = 5000, .n_q = 100};
  ck_assert(da_cu_prefix_rows(&m, BROWS, S, &dec, 0, 0));
  ck_assert(da_cu_prefix_rows(&m, BROWS, S, &pre, 256, 0));
  m.window = 1000;
  ck_assert(da_cu_prefix_rows(&m, BROWS, S, &dec, 0, 69001 / S));
  /* tokens 5000-5031: windows from 4001-4032, all in split 7 */
  ck_assert(da_cu_prefix_rows(&m, BROWS, S, &pre, 0, 4001 / S));
  /* tokens 5064-5095: windows from 4065 (split 7) to 4096 (split 8) */
  ck_assert(!da_cu_prefix_rows(&m, BROWS, S, &pre, 256, 4065 / S));
  /* tokens 5096-5099 (the last block, 16 rows): windows from 4097-4100, split 8 */
  ck_assert(da_cu_prefix_rows(&m, BROWS, S, &pre, 384, 4097 / S));
}
END_TEST

/* Passes 0-2 of one block and kv head cover its splits once and in order; a partial block's
 * first item is its prefix item where asked and ends at da_cu_first_end; the last k items
 * (da_cu_block_tail) are of one split each and come in pass 2; the counts are those the
 * planner allots (in-row 1, per splits whole items, a tail 1 + k, k more for per's tail). */
START_TEST(block_items_cover_each_split_once) {
  static const int pers[] = {1, 3, 32}, tails[] = {-1, 0, 2, 16};
  da_cu_item out[200];
  int64_t cases = 0;
  for (int kind = DA_CU_INROW; kind <= DA_CU_PART_TAIL; kind++)
    for (size_t pi = 0; pi < sizeof(pers) / sizeof(pers[0]); pi++)
      for (size_t ti = 0; ti < sizeof(tails) / sizeof(tails[0]); ti++)
        for (int prefix = 0; prefix < 2; prefix++)
          for (int j0 = 0; j0 <= 5; j0 += 5)
            for (int n = 1; n <= 140; n++) {
              const int per = pers[pi], j1 = j0 + n;
              const int tail = da_cu_block_tail(kind, tails[ti], tails[ti], n);
              const da_cu_item it = {.attn = 3, .kv_head = 5, .row0 = 256, .flags = 7};
              int total = 0, next = j0, in_pass2 = 0;
              for (int pass = 0; pass < 3; pass++) {
                const int k = da_cu_block_items(pass, kind, per, tail, prefix, it, j0, j1, out + total);
                /* pass 2 of a tail of 0 splits has none */
                ck_assert(pass == 2 ? k == 0 || da_cu_pass_has(pass, kind) : (k > 0) == da_cu_pass_has(pass, kind));
                if (pass == 2) in_pass2 = k;
                total += k;
              }
              ck_assert_int_eq(in_pass2, tail);
              for (int t = total - tail; t < total; t++) ck_assert_int_eq(out[t].j1 - out[t].j0, 1);
              for (int t = 0; t < total; t++) {
                ck_assert_int_eq(out[t].j0, next);
                ck_assert_int_gt(out[t].j1, out[t].j0);
                next = out[t].j1;
                ck_assert(out[t].attn == 3 && out[t].kv_head == 5 && out[t].row0 == 256);
                ck_assert_int_eq(out[t].flags, t == 0 && prefix && kind != DA_CU_INROW ? DA_CU_ITEM_PREFIX : 0);
              }
              ck_assert_int_eq(next, j1);
              ck_assert_int_eq(out[0].j1, da_cu_first_end(kind, per, tail, j0, j1));
              const int want = kind == DA_CU_INROW      ? 1
                               : kind == DA_CU_PART_PER ? (n - tail + per - 1) / per + tail
                                                        : 1 + tail;
              ck_assert_int_eq(total, want);
              cases++;
            }
  ck_assert_int_eq(cases, 3 * 3 * 4 * 2 * 2 * 140);
}
END_TEST

/* In-row prefill items in the backend's build order: per attention, blocks last row first,
 * kv heads inner, every split of the block. */
static int64_t build_prefill(const da_model *m, const da_attn *attns, int n_attns, da_cu_item *its) {
  const int G = m->n_q_heads / m->n_kv_heads;
  int64_t n = 0;
  for (int i = 0; i < n_attns; i++) {
    const int64_t rows = (int64_t)attns[i].n_q * G;
    for (int64_t r0 = (rows + BROWS - 1) / BROWS * BROWS - BROWS; r0 >= 0; r0 -= BROWS) {
      int j0, j1;
      da_cu_block_splits(m, BROWS, S, &attns[i], r0, &j0, &j1);
      for (int h = 0; h < m->n_kv_heads; h++) its[n++] = (da_cu_item){i, h, (int32_t)r0, j0, j1, 0};
    }
  }
  return n;
}

/* The longest CTA's key tiles (one more per item) when CTA c runs positions c, c + grid, ... */
static int64_t dealt_longest(const da_model *m, const da_attn *attns, const da_cu_item *its, int64_t n, int64_t grid) {
  int64_t share[SLOTS] = {0}, best = 0;
  for (int64_t k = 0; k < n; k++) {
    int64_t *sh = &share[k % grid];
    *sh += da_cu_item_tiles(m, BROWS, S, T, &attns[its[k].attn], &its[k]) + 1;
    if (*sh > best) best = *sh;
  }
  return best;
}

static int item_cmp(const void *x, const void *y) {
  const da_cu_item *a = x, *b = y;
  const int32_t ka[5] = {a->attn, a->kv_head, a->row0, a->j0, a->j1}, kb[5] = {b->attn, b->kv_head, b->row0, b->j0, b->j1};
  for (int i = 0; i < 5; i++)
    if (ka[i] != kb[i]) return ka[i] < kb[i] ? -1 : 1;
  return 0;
}

START_TEST(item_tiles_count_the_keys_a_block_sees) {
  da_model m = model;
  const da_attn a = {.q_pos = 1000, .n_q = 300}; /* positions 1000 .. 1299 */
  /* Rows 0-127: tokens 1000-1031 (G 4); keys 0-1031: tiles 0-16, splits 0-2 of 512. */
  ck_assert_int_eq(da_cu_item_tiles(&m, BROWS, S, T, &a, &(da_cu_item){0, 0, 0, 0, 3, 0}), 17);
  ck_assert_int_eq(da_cu_item_tiles(&m, BROWS, S, T, &a, &(da_cu_item){0, 0, 0, 1, 2, 0}), 8);  /* split 1 only */
  ck_assert_int_eq(da_cu_item_tiles(&m, BROWS, S, T, &a, &(da_cu_item){0, 0, 1280, 0, 3, 0}), 0); /* no rows */
  m.window = 100; /* rows 0-127 see keys 901-1031: tiles 14-16 */
  ck_assert_int_eq(da_cu_item_tiles(&m, BROWS, S, T, &a, &(da_cu_item){0, 0, 0, 1, 3, 0}), 3);
}
END_TEST

START_TEST(the_deal_is_a_permutation_that_evens_out_the_ctas) {
  /* Causal prefills of several shapes: heads 32/8 and 8/8, one to eight sequences. */
  static const struct {
    int hq, hkv, B, L;
  } cases[] = {{32, 8, 8, 4096}, {32, 8, 2, 16384}, {32, 8, 1, 4096}, {8, 8, 4, 2048}, {8, 8, 1, 8192}, {32, 8, 3, 3000},
               {8, 8, 1, 1000}, {32, 8, 5, 777}};
  int improved = 0;
  for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
    da_model m = model;
    m.n_q_heads = cases[k].hq, m.n_kv_heads = cases[k].hkv;
    da_attn attns[8];
    for (int i = 0; i < cases[k].B; i++) attns[i] = (da_attn){.q_pos = 0, .n_q = cases[k].L};
    const int64_t cap = (int64_t)cases[k].B * cases[k].L * (cases[k].hq / cases[k].hkv) / BROWS * cases[k].hkv + 64;
    da_cu_item *its = malloc((size_t)cap * sizeof(*its)), *before = malloc((size_t)cap * sizeof(*its));
    ck_assert(its && before);
    const int64_t n = build_prefill(&m, attns, cases[k].B, its);
    ck_assert_int_le(n, cap);
    memcpy(before, its, (size_t)n * sizeof(*its));
    int64_t total = 0, longest_item = 0;
    for (int64_t i = 0; i < n; i++) {
      const int64_t t = da_cu_item_tiles(&m, BROWS, S, T, &attns[its[i].attn], &its[i]) + 1;
      total += t;
      if (t > longest_item) longest_item = t;
    }
    const int64_t rr = dealt_longest(&m, attns, its, n, SLOTS);
    ck_assert_int_eq(da_cu_deal(&m, BROWS, S, T, attns, its, n, SLOTS), 0);
    const int64_t dealt = dealt_longest(&m, attns, its, n, SLOTS);
    /* No CTA gets more than 15 % over the even share (or the longest item, if longer). */
    const double bound = (double)total / SLOTS > (double)longest_item ? (double)total / SLOTS : (double)longest_item;
    if ((double)dealt > 1.15 * bound)
      ck_abort_msg("case %zu: longest CTA %lld tiles, even share %.0f", k, (long long)dealt, bound);
    ck_assert_int_le(dealt, rr);
    improved += dealt < rr;
    /* Every item once. */
    qsort(before, (size_t)n, sizeof(*before), item_cmp);
    qsort(its, (size_t)n, sizeof(*its), item_cmp);
    ck_assert(memcmp(before, its, (size_t)n * sizeof(*its)) == 0);
    free(its), free(before);
  }
  ck_assert_int_ge(improved, 5); /* round-robin in build order is uneven on most of them */
  /* As many items as CTAs or fewer: left as they are. */
  const da_attn one = {.q_pos = 0, .n_q = 32}; /* one block: 8 items */
  da_cu_item few[16];
  const int64_t n = build_prefill(&model, &one, 1, few);
  da_cu_item copy[16];
  memcpy(copy, few, sizeof(few));
  ck_assert_int_eq(da_cu_deal(&model, BROWS, S, T, &one, few, n, SLOTS), 0);
  ck_assert(memcmp(copy, few, (size_t)n * sizeof(*few)) == 0);
}
END_TEST

int main(void) {
  Suite *s = suite_create("cuda_items");
  TCase *tc = tcase_create("per");
  tcase_add_test(tc, decode_items_keep_the_longest_cta_within_a_tenth_of_the_best_per);
  tcase_add_test(tc, items_are_counted_whole_per_block_and_only_for_partial_attentions);
  tcase_add_test(tc, tails_are_an_eighth_from_32_splits_and_less_than_half);
  tcase_add_test(tc, partial_tails_by_rule_only_after_long_items);
  tcase_add_test(tc, per_choice_matches_the_rule_counted_block_by_block);
  tcase_add_test(tc, attn_kind_from_the_blocks_against_the_sms);
  tcase_add_test(tc, prefix_rows_need_every_row_to_start_at_the_first_split);
  tcase_add_test(tc, block_items_cover_each_split_once);
  suite_add_tcase(s, tc);
  tc = tcase_create("deal");
  tcase_add_test(tc, item_tiles_count_the_keys_a_block_sees);
  tcase_add_test(tc, the_deal_is_a_permutation_that_evens_out_the_ctas);
  suite_add_tcase(s, tc);
  return da_test_run(s);
}
