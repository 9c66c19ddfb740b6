/*
 * The attention work items of the CPU backend. A block is one attention item's kv head
 * and up to qb consecutive query tokens: its g * nt rows (token-major, then q head) walk
 * the same tiles, so a tile's K/V stay in L1 while all of them use it; the q heads of one
 * token are processed together, each K/V vector loaded once for up to 4 of them.
 * Main-phase items either run all splits of a block in-row, or one split of a block as a
 * partial into the accumulator pool; combine items fold a block's partials. All
 * arithmetic is in numerics.h.
 */
#include "cpu_internal.h"
#include "numerics.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(DA_CPU_NO_CLONES) && \
    !defined(__SANITIZE_THREAD__)
/* Vector-width variants of the hot functions. Results are identical in every variant:
 * the arithmetic is elementwise IEEE fp32 without contraction, so only the speed differs
 * (tests/kernels/test_kernels_vector_width.c). Off under ThreadSanitizer, whose runtime is
 * not ready when ifunc resolvers run. */
#define DA_CPU_HOT __attribute__((target_clones("avx2", "default")))
#else
#define DA_CPU_HOT
#endif

typedef struct block {
  const da_attn *a;
  int kvh, t0, nt;
  int wmin, pmax; /* keys seen by any row: [wmin, pmax] */
} block;

static inline int row_p(const block *bk, int r, int g) { return bk->a->q_pos + bk->t0 + r / g; }

static int64_t find_attn(const int64_t *offs, int n, int64_t item) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    int mid = lo + (hi - lo + 1) / 2;
    if (offs[mid] <= item) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

static void block_init(const da_cpu *be, block *bk, const da_attn *a, int kvh, int blk) {
  bk->a = a;
  bk->kvh = kvh;
  bk->t0 = blk * be->qb;
  bk->nt = a->n_q - bk->t0 < be->qb ? a->n_q - bk->t0 : be->qb;
  bk->pmax = a->q_pos + bk->t0 + bk->nt - 1;
  bk->wmin = da_cpu_w0(be->cfg.model.window, a->q_pos + bk->t0);
}

static void load_q(const da_cpu *be, const block *bk, float *q) {
  const int d = be->d, g = be->g, rows = bk->nt * g;
  const uint16_t *src = bk->a->q;
  for (int r = 0; r < rows; r++) {
    const uint16_t *x = src + ((size_t)(bk->t0 + r / g) * be->hq + (size_t)bk->kvh * g + r % g) * d;
    float *y = q + (size_t)r * d;
    if (be->cfg.model.dtype == DA_BF16)
      for (int c = 0; c < d; c++) y[c] = da_cpu_bf16(x[c]);
    else
      for (int c = 0; c < d; c++) y[c] = da_cpu_fp16(x[c]);
  }
}

/* Prefetches the pool lines of keys [lo, hi] (the next tile) while this tile computes:
 * pages sit at random places in the pool, beyond the reach of the hardware prefetcher. */
static void prefetch_tile(const da_cpu_kv *kv, int lo, int hi) {
  const size_t d = (size_t)kv->d, ptok = (size_t)kv->ptok;
  for (int pos = lo; pos <= hi;) {
    const size_t slot = (size_t)(pos & (kv->ptok - 1));
    const size_t n = (size_t)(hi - pos + 1) < ptok - slot ? (size_t)(hi - pos + 1) : ptok - slot;
    const size_t page = (size_t)kv->pages[pos >> kv->ptok_log2] * kv->page_elems;
    const char *k = (const char *)(kv->k + page + slot);
    const char *v = (const char *)(kv->v + page + slot * d);
    for (size_t c = 0; c < d; c++)
      for (size_t x = 0; x < n * 2; x += 64) __builtin_prefetch(k + c * ptok * 2 + x);
    for (size_t x = 0; x < n * d * 2; x += 64) __builtin_prefetch(v + x);
    pos += (int)n;
  }
}

static inline int row_in_split(const da_cpu *be, int p, int j) {
  const int w0 = da_cpu_w0(be->cfg.model.window, p);
  const int64_t s0 = (int64_t)j * be->split;
  return s0 <= p && s0 + be->split - 1 >= w0;
}

/* One q-head group of a row block against one tile: scores, softmax, acc update. */
#define GROUP_UPDATE(N, DT)                                                             \
  do {                                                                                  \
    da_cpu_scores##N##_##DT(q, &kv, tile, c0, c1, scale, softcap, sc->s);               \
    for (int h = 0; h < N; h++)                                                         \
      alpha[h] = da_cpu_softmax_tile(&sc->m[r0 + h], &sc->l[r0 + h], sc->s + h * tile,  \
                                     sc->p + h * tile, i0, i1);                         \
    da_cpu_pv##N##_##DT(acc, alpha, sc->p, tile, &kv, i0, i1);                          \
  } while (0)

/* Runs split j for the block's rows that take part in it; leaves their (m, l, acc) in sc.
 * K/V are read straight from the pool pages, converted in registers. */
DA_CPU_HOT
static void run_split(const da_cpu *be, da_cpu_scratch *sc, const block *bk, int j) {
  const int d = be->d, g = be->g, tile = be->tile, rows = bk->nt * g;
  const int gs = g % 4 == 0 ? 4 : g % 2 == 0 ? 2 : 1; /* q heads processed together */
  const int bf16 = be->cfg.model.dtype == DA_BF16;
  const int window = be->cfg.model.window;
  const float scale = be->cfg.model.scale, softcap = be->cfg.model.softcap;
  const int s0 = j * be->split, s1 = s0 + be->split - 1;
  const int a0 = s0 > bk->wmin ? s0 : bk->wmin;
  const int a1 = s1 < bk->pmax ? s1 : bk->pmax;
  if (a0 > a1) return;
  for (int r = 0; r < rows; r++) {
    sc->m[r] = -INFINITY;
    sc->l[r] = 0.0f;
    float *acc = sc->acc + (size_t)r * d;
    for (int c = 0; c < d; c++) acc[c] = 0.0f;
  }
  const size_t head = (size_t)bk->kvh * be->ptok * d;
  const uint16_t *kpool = be->kv + (size_t)bk->a->layer * 2 * be->layer_elems;
  da_cpu_kv kv = {.k = kpool + head, .v = kpool + be->layer_elems + head,
                  .pages = bk->a->pages, .page_elems = be->page_elems, .ptok = be->ptok,
                  .ptok_log2 = __builtin_ctz((unsigned)be->ptok), .d = d};
  const int align = be->ptok >= 16 ? 16 : 8;
  for (int ts = a0 - a0 % tile; ts <= a1; ts += tile) {
    const int lo = ts > a0 ? ts : a0;
    const int hi = ts + tile - 1 < a1 ? ts + tile - 1 : a1;
    kv.ts = ts;
    if (ts + tile <= a1) prefetch_tile(&kv, ts + tile, ts + 2 * tile - 1 < a1 ? ts + 2 * tile - 1 : a1);
    for (int t = 0; t < bk->nt; t++) {
      const int p = bk->a->q_pos + bk->t0 + t;
      const int w0 = da_cpu_w0(window, p);
      const int rlo = lo > w0 ? lo : w0;
      const int rhi = hi < p ? hi : p;
      if (rlo > rhi) continue; /* no valid key: the state stays as it is */
      /* Scores run over whole groups of 16 (or 8) keys, which one page holds; only the
       * valid [i0, i1) are used. */
      const int i0 = rlo - ts, i1 = rhi - ts + 1;
      const int c0 = i0 & -align, c1 = (i1 + align - 1) & -align;
      for (int r0 = t * g; r0 < (t + 1) * g; r0 += gs) {
        const float *q = sc->q + (size_t)r0 * d;
        float *acc = sc->acc + (size_t)r0 * d;
        float alpha[4];
        if (bf16) {
          if (gs == 4) GROUP_UPDATE(4, bf16);
          else if (gs == 2) GROUP_UPDATE(2, bf16);
          else GROUP_UPDATE(1, bf16);
        } else {
          if (gs == 4) GROUP_UPDATE(4, fp16);
          else if (gs == 2) GROUP_UPDATE(2, fp16);
          else GROUP_UPDATE(1, fp16);
        }
      }
    }
  }
}

static void write_out(const da_cpu *be, const block *bk, const da_cpu_scratch *sc) {
  const int d = be->d, g = be->g, rows = bk->nt * g;
  const da_dtype dt = be->cfg.model.dtype;
  for (int r = 0; r < rows; r++) {
    const size_t row = (size_t)(bk->t0 + r / g) * be->hq + (size_t)bk->kvh * g + r % g;
    uint16_t *o = (uint16_t *)bk->a->o + row * d;
    const float *f = sc->fo + (size_t)r * d;
    for (int c = 0; c < d; c++) o[c] = da_from_f32(dt, f[c]);
    if (bk->a->lse != NULL) bk->a->lse[row] = sc->flse[r];
  }
}

/* Folds one split result into row r's fold state: the first split is taken as it is. */
static void fold(const da_cpu *be, da_cpu_scratch *sc, int r, int first, const float *oj,
                 float lsej) {
  float *fo = sc->fo + (size_t)r * be->d;
  if (first) {
    memcpy(fo, oj, sizeof(float) * (size_t)be->d);
    sc->flse[r] = lsej;
  } else {
    da_cpu_merge(fo, &sc->flse[r], oj, lsej, be->d);
  }
}

static void inrow_block(const da_cpu *be, da_cpu_scratch *sc, const block *bk) {
  const int d = be->d, g = be->g, rows = bk->nt * g;
  const int jlo = bk->wmin / be->split, jhi = bk->pmax / be->split;
  load_q(be, bk, sc->q);
  for (int j = jlo; j <= jhi; j++) {
    run_split(be, sc, bk, j);
    for (int r = 0; r < rows; r++) {
      const int p = row_p(bk, r, g);
      if (!row_in_split(be, p, j)) continue;
      da_cpu_row st = {.m = sc->m[r], .l = sc->l[r], .acc = sc->acc + (size_t)r * d};
      const float lsej = da_cpu_finalize(&st, d, sc->oj);
      fold(be, sc, r, j == da_cpu_w0(be->cfg.model.window, p) / be->split, sc->oj, lsej);
    }
  }
  write_out(be, bk, sc);
}

static float *slot_of(const da_cpu *be, const da_cpu_plan *pl, const block *bk, int r, int j) {
  const int g = be->g;
  const int64_t row = (int64_t)(bk->t0 + r / g) * be->hq + (int64_t)bk->kvh * g + r % g;
  return be->acc + (size_t)(pl->slot_base + row * pl->n_splits + (j - pl->jlo)) * be->acc_stride;
}

static void partial_block(const da_cpu *be, da_cpu_scratch *sc, const da_cpu_plan *pl,
                          const block *bk, int j) {
  const int d = be->d, g = be->g, rows = bk->nt * g;
  load_q(be, bk, sc->q);
  run_split(be, sc, bk, j);
  for (int r = 0; r < rows; r++) {
    if (!row_in_split(be, row_p(bk, r, g), j)) continue;
    da_cpu_row st = {.m = sc->m[r], .l = sc->l[r], .acc = sc->acc + (size_t)r * d};
    float *slot = slot_of(be, pl, bk, r, j);
    slot[d] = da_cpu_finalize(&st, d, slot);
  }
}

void da_cpu_main_item(void *arg, int64_t item, int tid) {
  da_cpu *be = arg;
  const int n = be->b->n_attns;
  const int a = (int)find_attn(be->main_offs, n, item);
  const da_cpu_plan *pl = &be->plans[a];
  int64_t rel = item - pl->off_main;
  block bk;
  const int kvh = (int)(rel % be->hk);
  rel /= be->hk;
  if (!pl->partial) {
    block_init(be, &bk, &be->b->attns[a], kvh, (int)rel);
    inrow_block(be, &be->scr[tid], &bk);
  } else {
    const int js = (int)(rel % pl->n_splits);
    block_init(be, &bk, &be->b->attns[a], kvh, (int)(rel / pl->n_splits));
    partial_block(be, &be->scr[tid], pl, &bk, pl->jlo + js);
  }
}

void da_cpu_comb_item(void *arg, int64_t item, int tid) {
  da_cpu *be = arg;
  const int n = be->b->n_attns;
  const int a = (int)find_attn(be->comb_offs, n, item);
  const da_cpu_plan *pl = &be->plans[a];
  const int64_t rel = item - pl->off_comb;
  da_cpu_scratch *sc = &be->scr[tid];
  const int g = be->g;
  block bk;
  block_init(be, &bk, &be->b->attns[a], (int)(rel % be->hk), (int)(rel / be->hk));
  const int rows = bk.nt * g;
  for (int r = 0; r < rows; r++) {
    const int p = row_p(&bk, r, g);
    const int jlo = da_cpu_w0(be->cfg.model.window, p) / be->split, jhi = p / be->split;
    for (int j = jlo; j <= jhi; j++) {
      const float *slot = slot_of(be, pl, &bk, r, j);
      fold(be, sc, r, j == jlo, slot, slot[be->d]);
    }
  }
  write_out(be, &bk, sc);
}
