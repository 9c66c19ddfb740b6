/* items.c — work items of the CUDA backend (see items.h). */
#include "items.h"

#include <stdlib.h>
#include <string.h>

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* The keys [*w0, *p_max] that rows [row0, row0 + brows) of attention a see (the first row's
 * window start, the last row's position). 0 when the block has no rows, else 1. */
static int block_keys(const da_model *m, int brows, const da_attn *a, int64_t row0, int64_t *w0, int64_t *p_max) {
  const int G = m->n_q_heads / m->n_kv_heads;
  const int64_t n_rows = (int64_t)a->n_q * G;
  int64_t last = row0 + brows;
  if (last > n_rows) last = n_rows;
  if (last <= row0) return 0;
  const int64_t p_min = a->q_pos + row0 / G;
  *p_max = a->q_pos + (last - 1) / G;
  *w0 = m->window > 0 && p_min - m->window + 1 > 0 ? p_min - m->window + 1 : 0;
  return 1;
}

int da_cu_attn_kind(da_split_mode mode, int64_t inrow_ctas, int n_sm, int sm90_decode, int tail) {
  const int64_t fill = 3 * (int64_t)n_sm / 2, busy = sm90_decode ? 4 * (int64_t)n_sm / 5 : fill;
  if (mode == DA_SPLIT_PARTIAL || (mode == DA_SPLIT_AUTO && inrow_ctas < busy)) return DA_CU_PART_PER;
  if (mode == DA_SPLIT_AUTO && tail > 0 && inrow_ctas >= fill) return DA_CU_PART_TAIL;
  return DA_CU_INROW;
}

void da_cu_block_splits(const da_model *m, int brows, int S, const da_attn *a, int64_t row0, int *j0, int *j1) {
  int64_t w0 = 0, p_max = -1;
  (void)block_keys(m, brows, a, row0, &w0, &p_max);
  *j0 = (int)(w0 / S);
  *j1 = (int)(p_max / S) + 1;
}

int64_t da_cu_partial_items(const da_model *m, int brows, int S, const da_batch *b, const unsigned char *partial,
                            int per, int per_tail, int64_t *n_first) {
  const int G = m->n_q_heads / m->n_kv_heads;
  int64_t n = 0, first = 0;
  for (int i = 0; i < b->n_attns; i++) {
    const da_attn *a = &b->attns[i];
    if (partial[i] != DA_CU_PART_PER) continue;
    for (int64_t r0 = 0; r0 < (int64_t)a->n_q * G; r0 += brows) {
      int j0, j1;
      da_cu_block_splits(m, brows, S, a, r0, &j0, &j1);
      const int k = da_cu_tail_splits(per_tail, j1 - j0);
      first += (int64_t)m->n_kv_heads * ceil_div(j1 - j0 - k, per);
      n += (int64_t)m->n_kv_heads * k;
    }
  }
  if (n_first != NULL) *n_first = first;
  return n + first;
}

/* A run of `count` DA_CU_PART_PER blocks (kv heads counted) of n splits each. */
typedef struct split_run {
  int64_t n, count;
} split_run;

int da_cu_partial_per(const da_model *m, int brows, int S, int T, const da_batch *b, const unsigned char *partial,
                      int per_tail, int64_t slots, int64_t *n_items) {
  const int64_t tiles = S / T;
  const int G = m->n_q_heads / m->n_kv_heads;
  /* Each block's split count once, equal neighbours as one run (a decode batch's rows are
   * mostly of one count): the choice below then costs a few operations a run and per, not
   * block_keys' divisions a block and per (B 16 L 16k: 13 us of a decode step's staging). */
  int64_t n_blocks = 0, n_runs = 0;
  for (int i = 0; i < b->n_attns; i++)
    if (partial[i] == DA_CU_PART_PER) n_blocks += ceil_div((int64_t)b->attns[i].n_q * G, brows);
  *n_items = 0;
  if (n_blocks == 0) return 1;
  split_run *runs = malloc((size_t)n_blocks * sizeof(*runs));
  for (int i = 0; i < b->n_attns && runs != NULL; i++) {
    const da_attn *a = &b->attns[i];
    if (partial[i] != DA_CU_PART_PER) continue;
    for (int64_t r0 = 0; r0 < (int64_t)a->n_q * G; r0 += brows) {
      int j0, j1;
      da_cu_block_splits(m, brows, S, a, r0, &j0, &j1);
      if (n_runs > 0 && runs[n_runs - 1].n == j1 - j0) runs[n_runs - 1].count += m->n_kv_heads;
      else runs[n_runs++] = (split_run){j1 - j0, m->n_kv_heads};
    }
  }
  int64_t best = INT64_MAX;
  int per_best = 1;
  for (int per = 1; per <= 64; per++) {
    int64_t first = 0, n = 0;
    if (runs == NULL) { /* no memory for the runs: the same counts, a block at a time */
      n = da_cu_partial_items(m, brows, S, b, partial, per, per_tail, &first);
    } else {
      for (int64_t r = 0; r < n_runs; r++) {
        const int k = da_cu_tail_splits(per_tail, runs[r].n);
        first += runs[r].count * ceil_div(runs[r].n - k, per);
        n += runs[r].count * k;
      }
      n += first;
    }
    /* a block's items are counted whole (128 splits in items of 63 are three) */
    const int64_t cost = ceil_div(first, slots) * (per * tiles + 1);
    if (cost <= best) best = cost, per_best = per, *n_items = n;
  }
  free(runs);
  return per_best;
}

int da_cu_tail_splits(int tail, int64_t n) {
  const int64_t k = tail < 0 ? (n >= 32 ? n / 8 : 0) : tail;
  return k > 0 && n > 2 * k ? (int)k : 0;
}

int da_cu_per_tail(int per_tail, int per0) { return per_tail >= 0 ? per_tail : per0 >= 16 ? -1 : 0; }

int da_cu_block_tail(int kind, int prefix_tail, int per_tail, int64_t n) {
  return kind == DA_CU_INROW ? 0 : da_cu_tail_splits(kind == DA_CU_PART_TAIL ? prefix_tail : per_tail, n);
}

int da_cu_prefix_rows(const da_model *m, int brows, int S, const da_attn *a, int64_t r0, int j0) {
  int64_t w0 = 0, p_max = -1;
  if (m->window <= 0) return 1;
  if (!block_keys(m, brows, a, r0, &w0, &p_max)) return 0;
  const int64_t w_last = p_max - m->window + 1; /* the last row's window start */
  return (w_last > 0 ? w_last : 0) / S == j0;
}

int da_cu_first_end(int kind, int per, int k, int j0, int j1) {
  if (kind == DA_CU_PART_TAIL) return j1 - k;
  if (kind == DA_CU_PART_PER) return j0 + per < j1 - k ? j0 + per : j1 - k;
  return j1;
}

int da_cu_pass_has(int pass, int kind) { return pass == 0 ? kind == DA_CU_INROW : kind != DA_CU_INROW; }

/* Item `it` with splits [j0, j1) and flags into *o, field by field: a whole-struct copy of
 * `it` after changing three of its fields made gcc store them to the stack and reload the
 * struct at once, a store-forwarding stall of ~12 ns an item (B 8 L 16k: 2,112 items, ~25 us
 * of a decode step's staging). */
static void put_item(da_cu_item *o, const da_cu_item *it, int j0, int j1, int flags) {
  o->attn = it->attn, o->kv_head = it->kv_head, o->row0 = it->row0;
  o->j0 = j0, o->j1 = j1, o->flags = flags;
}

int da_cu_block_items(int pass, int kind, int per, int k, int prefix, da_cu_item it, int j0, int j1,
                      da_cu_item *out) {
  if (!da_cu_pass_has(pass, kind)) return 0;
  const int je = da_cu_first_end(kind, per, k, j0, j1);
  int n = 0;
  if (pass < 2) /* the block's first item */
    put_item(&out[n++], &it, j0, je, prefix && kind != DA_CU_INROW ? DA_CU_ITEM_PREFIX : 0);
  if (pass == 1 && kind == DA_CU_PART_PER) /* the later items of per splits */
    for (int j = je; j < j1 - k; j += per) put_item(&out[n++], &it, j, j + per < j1 - k ? j + per : j1 - k, 0);
  if (pass == 2) /* the tail's items of one split */
    for (int j = j1 - k; j < j1; j++) put_item(&out[n++], &it, j, j + 1, 0);
  return n;
}

int64_t da_cu_item_tiles(const da_model *m, int brows, int S, int T, const da_attn *a, const da_cu_item *it) {
  int64_t w0, p_max;
  if (!block_keys(m, brows, a, it->row0, &w0, &p_max)) return 0;
  const int64_t tps = S / T;
  int64_t kb = w0 / T, ke = p_max / T;
  if (kb < it->j0 * tps) kb = it->j0 * tps;
  if (ke > it->j1 * tps - 1) ke = it->j1 * tps - 1;
  return ke >= kb ? ke - kb + 1 : 0;
}

/* A min-heap of CTAs by (work so far, index): the key packs both, load above the CTA's
 * 20 bits (a grid has fewer than 2^20 CTAs and no CTA 2^43 key tiles). */
static void heap_down(uint64_t *h, int64_t n, int64_t i) {
  const uint64_t x = h[i];
  for (;;) {
    const int64_t l = 2 * i + 1;
    if (l >= n) break;
    const int64_t s = l + 1 < n && h[l + 1] < h[l] ? l + 1 : l;
    if (h[s] >= x) break;
    h[i] = h[s];
    i = s;
  }
  h[i] = x;
}

int da_cu_deal(const da_model *m, int brows, int S, int T, const da_attn *attns, da_cu_item *items, int64_t n,
               int64_t grid) {
  if (grid <= 1 || n <= grid || grid >= (1 << 20)) return 0; /* nothing to balance (or too many CTAs to key) */
  da_cu_item *out = malloc((size_t)n * sizeof(*out));
  uint64_t *heap = malloc((size_t)grid * sizeof(*heap));
  int64_t *taken = calloc((size_t)grid, sizeof(*taken));
  int rv = -1;
  if (out == NULL || heap == NULL || taken == NULL) goto out;
  for (int64_t c = 0; c < grid; c++) heap[c] = (uint64_t)c;
  int64_t live = grid; /* CTAs with a position free: the heap's size */
  for (int64_t k = 0; k < n; k++) {
    /* The root is the least loaded CTA with room (full ones leave the heap). */
    const int64_t c = (int64_t)(heap[0] & 0xFFFFF);
    out[c + taken[c] * grid] = items[k];
    taken[c]++;
    heap[0] += (uint64_t)(da_cu_item_tiles(m, brows, S, T, &attns[items[k].attn], &items[k]) + 1) << 20;
    if (taken[c] == (n - c + grid - 1) / grid) heap[0] = heap[--live];
    heap_down(heap, live, 0);
  }
  memcpy(items, out, (size_t)n * sizeof(*out));
  rv = 0;
out:
  free(out), free(heap), free(taken);
  return rv;
}
