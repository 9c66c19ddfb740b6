/*
 * The attention work items of the CPU backend. A block is one attention item's kv head
 * and up to qb consecutive query tokens: its g * nt rows (token-major, then q head) share
 * every K/V tile read. Main-phase items either run all splits of a block in-row, or one
 * split of a block as a partial into the accumulator pool; combine items fold a block's
 * partials. All arithmetic is in numerics.h.
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

/* Converts keys [lo, hi] of the tile starting at ts into kt (transposed) and vt; the
 * tile's other key columns of kt are zeroed. Only pages holding [lo, hi] are read. In the
 * pool a page's keys are stored transposed ([d][page_tokens]) and its values row-major
 * ([page_tokens][d]), so both copies below run over contiguous memory. */
/* Keys of one page run into the transposed tile, in fixed chunks of 8 that vectorise. */
#define LOAD_K(cvt)                                                            \
  for (int c = 0; c < d; c++) {                                                \
    const uint16_t *kc = k + (size_t)c * ptok;                                 \
    float *kdc = kd + (size_t)c * tile;                                        \
    int i = 0;                                                                 \
    for (; i + 8 <= n; i += 8)                                                 \
      for (int j = 0; j < 8; j++) kdc[i + j] = cvt(kc[i + j]);                 \
    for (; i < n; i++) kdc[i] = cvt(kc[i]);                                    \
  }

DA_CPU_HOT
static void load_tile(const da_cpu *be, const block *bk, int ts, int lo, int hi, float *kt,
                      float *vt) {
  const int d = be->d, tile = be->tile, ptok = be->ptok;
  const int bf16 = be->cfg.model.dtype == DA_BF16;
  const uint16_t *kbase = be->kv + (size_t)bk->a->layer * 2 * be->layer_elems;
  const uint16_t *vbase = kbase + be->layer_elems;
  if (lo > ts || hi < ts + tile - 1)
    for (size_t i = 0; i < (size_t)d * tile; i++) kt[i] = 0.0f;
  for (int pos = lo; pos <= hi;) {
    const int slot = pos % ptok;
    const int n = hi - pos + 1 < ptok - slot ? hi - pos + 1 : ptok - slot;
    const size_t page = (size_t)bk->a->pages[pos / ptok] * be->page_elems +
                        (size_t)bk->kvh * ptok * d;
    const uint16_t *k = kbase + page + slot, *v = vbase + page + (size_t)slot * d;
    float *kd = kt + (pos - ts), *vd = vt + (size_t)(pos - ts) * d;
    const size_t nv = (size_t)n * d;
    if (bf16) {
      LOAD_K(da_cpu_bf16);
      for (size_t i = 0; i < nv; i++) vd[i] = da_cpu_bf16(v[i]);
    } else {
      LOAD_K(da_cpu_fp16);
      for (size_t i = 0; i < nv; i++) vd[i] = da_cpu_fp16(v[i]);
    }
    pos += n;
  }
}

static inline int row_in_split(const da_cpu *be, int p, int j) {
  const int w0 = da_cpu_w0(be->cfg.model.window, p);
  const int64_t s0 = (int64_t)j * be->split;
  return s0 <= p && s0 + be->split - 1 >= w0;
}

/* Runs split j for the block's rows that take part in it; leaves their (m, l, acc) in sc. */
DA_CPU_HOT
static void run_split(const da_cpu *be, da_cpu_scratch *sc, const block *bk, int j) {
  const int d = be->d, g = be->g, tile = be->tile, rows = bk->nt * g;
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
  for (int ts = a0 - a0 % tile; ts <= a1; ts += tile) {
    const int lo = ts > a0 ? ts : a0;
    const int hi = ts + tile - 1 < a1 ? ts + tile - 1 : a1;
    load_tile(be, bk, ts, lo, hi, sc->kt, sc->vt);
    for (int r = 0; r < rows; r++) {
      const int p = row_p(bk, r, g);
      const int w0 = da_cpu_w0(window, p);
      const int rlo = lo > w0 ? lo : w0;
      const int rhi = hi < p ? hi : p;
      if (rlo > rhi) continue; /* no valid key: the state stays as it is */
      const int i0 = rlo - ts, i1 = rhi - ts + 1;
      da_cpu_scores(sc->q + (size_t)r * d, sc->kt, d, tile, i0 & ~15, (i1 + 15) & ~15, scale,
                    softcap, sc->s);
      da_cpu_row st = {.m = sc->m[r], .l = sc->l[r], .acc = sc->acc + (size_t)r * d};
      da_cpu_tile_update(&st, sc->s, sc->p, sc->vt, d, i0, i1);
      sc->m[r] = st.m;
      sc->l[r] = st.l;
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
