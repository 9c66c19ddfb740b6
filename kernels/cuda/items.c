/* items.c — work items of the CUDA backend (see items.h). */
#include "items.h"

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void da_cu_block_splits(const da_model *m, int brows, int S, const da_attn *a, int64_t row0, int *j0, int *j1) {
  const int G = m->n_q_heads / m->n_kv_heads;
  const int64_t n_rows = (int64_t)a->n_q * G;
  int64_t last = row0 + brows;
  if (last > n_rows) last = n_rows;
  const int64_t p_min = a->q_pos + row0 / G, p_max = a->q_pos + (last - 1) / G;
  int64_t w0 = m->window > 0 ? p_min - m->window + 1 : 0;
  if (w0 < 0) w0 = 0;
  *j0 = (int)(w0 / S);
  *j1 = (int)(p_max / S) + 1;
}

/* Items of the partial blocks at per splits an item: a block's items are counted whole (128
 * splits in items of 63 are three, and round-robin may give some CTA two long ones). */
static int64_t count_items(const da_model *m, int brows, int S, const da_batch *b, const unsigned char *partial,
                           int per) {
  const int G = m->n_q_heads / m->n_kv_heads;
  int64_t n = 0;
  for (int i = 0; i < b->n_attns; i++) {
    const da_attn *a = &b->attns[i];
    if (!partial[i]) continue;
    for (int64_t r0 = 0; r0 < (int64_t)a->n_q * G; r0 += brows) {
      int j0, j1;
      da_cu_block_splits(m, brows, S, a, r0, &j0, &j1);
      n += (int64_t)m->n_kv_heads * ceil_div(j1 - j0, per);
    }
  }
  return n;
}

int da_cu_partial_per(const da_model *m, int brows, int S, int T, const da_batch *b, const unsigned char *partial,
                      int64_t slots, int64_t *n_items) {
  const int64_t tiles = S / T;
  int64_t best = INT64_MAX;
  int per_best = 1;
  *n_items = 0;
  for (int per = 1; per <= 64; per++) {
    const int64_t n = count_items(m, brows, S, b, partial, per);
    if (n == 0) break;
    const int64_t cost = ceil_div(n, slots) * (per * tiles + 1);
    if (cost <= best) best = cost, per_best = per, *n_items = n;
  }
  return per_best;
}
