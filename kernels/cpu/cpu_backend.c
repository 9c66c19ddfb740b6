/*
 * The CPU backend: the determinism contract of DESIGN.md §1 in portable C, multithreaded.
 * Pools in host memory, taken once in create(): the KV pool in the model dtype,
 * [layer][K][page][kv_head][head_dim][page_tokens] for keys (transposed within a page, so
 * that element c of 8 or 16 consecutive keys is one vector load) and
 * [layer][V][page][kv_head][page_tokens][head_dim] for values; the accumulator
 * pool, the plan arrays and per-thread scratch. run() validates the whole batch before it
 * writes anything, then copies pages and appends K/V in the calling thread, then runs the
 * attention work items on the thread pool: a main phase (in-row blocks and partial splits)
 * and a combine phase (folds of partials). Every output row is written by exactly one item.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/utsname.h>
#include <unistd.h>

#include "cpu_internal.h"

#define KERNEL_VERSION 1
#define DEFAULT_ACC_SLOTS 8192
#define MAX_BATCH_TOKENS 65536
#define MAX_THREADS 256
#define MAX_POSITION (1 << 30)
#define ROWS_PER_BLOCK 64

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

static void *alloc64(size_t bytes) { return aligned_alloc(64, round_up(bytes ? bytes : 1, 64)); }

/* a * b * ... without overflow, or 0 on overflow. */
static size_t mul_sizes(const size_t *f, int n) {
  size_t r = 1;
  for (int i = 0; i < n; i++) {
    if (f[i] != 0 && r > SIZE_MAX / f[i]) return 0;
    r *= f[i];
  }
  return r;
}

static int check_cfg(const da_backend_cfg *cfg, char *err, size_t errlen) {
  int rv = da_model_check(&cfg->model, &cfg->num, err, errlen);
  if (rv != 0) return rv;
  const int pt = cfg->page_tokens;
  if (pt < 8 || pt > 256 || (pt & (pt - 1))) {
    snprintf(err, errlen, "page tokens must be a power of two in [8, 256], got %d", pt);
    return DETATTN_INVALID_ARGUMENT;
  }
  if (cfg->n_pages < 1) {
    snprintf(err, errlen, "KV pool must have at least 1 page, got %d", cfg->n_pages);
    return DETATTN_INVALID_ARGUMENT;
  }
  if (cfg->acc_slots < 0) {
    snprintf(err, errlen, "accumulator slots must be >= 0, got %d", cfg->acc_slots);
    return DETATTN_INVALID_ARGUMENT;
  }
  if (cfg->n_threads < 0 || cfg->n_threads > MAX_THREADS) {
    snprintf(err, errlen, "threads must be in [0, %d], got %d", MAX_THREADS, cfg->n_threads);
    return DETATTN_INVALID_ARGUMENT;
  }
  return 0;
}

static void poison_acc(da_cpu *be) {
  const size_t n = (size_t)be->acc_slots * be->acc_stride;
  for (size_t i = 0; i < n; i++) be->acc[i] = NAN;
}

static int alloc_scratch(da_cpu *be) {
  const size_t d = (size_t)be->d, t = (size_t)be->tile, r = (size_t)be->rows_max;
  const size_t sizes[] = {4 * t, 4 * t, r * d, r * d, r, r, r * d, r, d};
  size_t per = 0;
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) per += round_up(sizes[i], 16);
  be->scratch_mem = alloc64(per * sizeof(float) * (size_t)be->cfg.n_threads);
  be->scr = calloc((size_t)be->cfg.n_threads, sizeof(da_cpu_scratch));
  if (be->scratch_mem == NULL || be->scr == NULL) return DETATTN_RESOURCE_EXHAUSTED;
  for (int th = 0; th < be->cfg.n_threads; th++) {
    float *f = (float *)be->scratch_mem + per * (size_t)th;
    float **dst[] = {&be->scr[th].s,  &be->scr[th].p,  &be->scr[th].q,
                     &be->scr[th].acc, &be->scr[th].m, &be->scr[th].l,
                     &be->scr[th].fo, &be->scr[th].flse, &be->scr[th].oj};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
      *dst[i] = f;
      f += round_up(sizes[i], 16);
    }
  }
  return 0;
}

static void free_all(da_cpu *be) {
  free(be->scr);
  free(be->scratch_mem);
  free(be->comb_offs);
  free(be->main_offs);
  free(be->plans);
  free(be->acc);
  free(be->kv);
  free(be);
}

static int create(void **ctx, const da_backend_cfg *cfg, da_backend_info *info, char *err,
                  size_t errlen) {
  int rv = check_cfg(cfg, err, errlen);
  if (rv != 0) return rv;
  da_cpu *be = calloc(1, sizeof(*be));
  if (be == NULL) goto fail_oom;
  be->cfg = *cfg;
  if (be->cfg.n_threads == 0) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    be->cfg.n_threads = n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : (int)n;
  }
  if (be->cfg.acc_slots == 0) be->cfg.acc_slots = DEFAULT_ACC_SLOTS;
  const da_model *m = &cfg->model;
  be->hq = m->n_q_heads;
  be->hk = m->n_kv_heads;
  be->g = be->hq / be->hk;
  be->d = m->head_dim;
  be->tile = cfg->num.tile_tokens;
  be->split = cfg->num.split_tokens;
  be->ptok = cfg->page_tokens;
  be->qb = be->g >= ROWS_PER_BLOCK ? 1 : ROWS_PER_BLOCK / be->g;
  be->rows_max = be->g * be->qb;
  be->page_elems = (size_t)be->hk * (size_t)be->ptok * (size_t)be->d;
  const size_t f[] = {be->page_elems, (size_t)cfg->n_pages, 2, (size_t)m->n_layers,
                      da_dtype_size(m->dtype)};
  const size_t kv_bytes = mul_sizes(f, 5);
  if (kv_bytes == 0) {
    snprintf(err, errlen, "KV pool size overflows: %d pages", cfg->n_pages);
    free(be);
    return DETATTN_INVALID_ARGUMENT;
  }
  be->layer_elems = be->page_elems * (size_t)cfg->n_pages;
  be->kv = alloc64(kv_bytes);
  if (be->kv == NULL) {
    snprintf(err, errlen, "cannot allocate the KV pool: %zu bytes (%d pages)", kv_bytes,
             cfg->n_pages);
    free(be);
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  be->acc_slots = be->cfg.acc_slots;
  be->acc_stride = round_up((size_t)be->d + 1, 16);
  const size_t acc_bytes = (size_t)be->acc_slots * be->acc_stride * sizeof(float);
  be->acc = alloc64(acc_bytes);
  be->max_batch_tokens = MAX_BATCH_TOKENS;
  be->plans = calloc(MAX_BATCH_TOKENS, sizeof(da_cpu_plan));
  be->main_offs = calloc(MAX_BATCH_TOKENS + 1, sizeof(int64_t));
  be->comb_offs = calloc(MAX_BATCH_TOKENS + 1, sizeof(int64_t));
  if (be->acc == NULL || be->plans == NULL || be->main_offs == NULL || be->comb_offs == NULL ||
      alloc_scratch(be) != 0) {
    free_all(be);
    goto fail_oom;
  }
  if (cfg->poison) {
    const size_t n = kv_bytes / 2;
    const uint16_t nan = m->dtype == DA_BF16 ? 0x7fc0u : 0x7e00u;
    for (size_t i = 0; i < n; i++) be->kv[i] = nan;
    poison_acc(be);
  }
  rv = da_cpu_pool_init(&be->pool, be->cfg.n_threads);
  if (rv != 0) {
    snprintf(err, errlen, "cannot start %d worker threads%s", be->cfg.n_threads,
             rv == DETATTN_RESOURCE_EXHAUSTED ? ": out of memory or threads" : "");
    free_all(be);
    return rv;
  }
  memset(info, 0, sizeof(*info));
  snprintf(info->name, sizeof(info->name), "cpu");
  struct utsname un;
  const char *machine = uname(&un) == 0 ? un.machine : "unknown";
  size_t an = strnlen(machine, sizeof(info->arch) - 1);
  memcpy(info->arch, machine, an);
  info->arch[an] = '\0';
  info->kernel_version = KERNEL_VERSION;
  info->fingerprint = da_fingerprint(info->name, info->kernel_version, info->arch, m, &cfg->num);
  info->n_pages = cfg->n_pages;
  info->acc_slots = be->acc_slots;
  info->kv_bytes = kv_bytes;
  info->acc_bytes = acc_bytes;
  info->staging_bytes = 0;
  info->max_batch_tokens = MAX_BATCH_TOKENS;
  *ctx = be;
  return 0;

fail_oom:
  snprintf(err, errlen, "out of memory allocating the CPU backend's pools");
  return DETATTN_RESOURCE_EXHAUSTED;
}

static void destroy(void *ctx) {
  da_cpu *be = ctx;
  if (be == NULL) return;
  da_cpu_pool_fini(&be->pool);
  free_all(be);
}

#define BAD(...)                                       \
  do {                                                 \
    snprintf(res->err, sizeof(res->err), __VA_ARGS__); \
    return DETATTN_INVALID_ARGUMENT;                   \
  } while (0)

/* Checks that a page table covers [0, end) and that the ids of pages holding [from, end)
 * are in the pool. */
static int check_pages(const da_cpu *be, const int32_t *pages, int n_pages, int64_t from,
                       int64_t end, const char *what, int idx, da_batch_result *res) {
  if (pages == NULL) BAD("%s %d: page table is NULL", what, idx);
  if (n_pages < 0 || (int64_t)n_pages * be->ptok < end)
    BAD("%s %d: page table of %d pages does not cover %lld tokens", what, idx, n_pages,
        (long long)end);
  for (int64_t i = from / be->ptok; i <= (end - 1) / be->ptok; i++)
    if (pages[i] < 0 || pages[i] >= be->cfg.n_pages)
      BAD("%s %d: page id %d at index %lld is outside the pool [0, %d)", what, idx, pages[i],
          (long long)i, be->cfg.n_pages);
  return 0;
}

static int validate(const da_cpu *be, const da_batch *b, da_batch_result *res) {
  const int layers = be->cfg.model.n_layers;
  if (b->n_copies < 0 || b->n_appends < 0 || b->n_attns < 0)
    BAD("negative item count (copies %d, appends %d, attns %d)", b->n_copies, b->n_appends,
        b->n_attns);
  if ((b->n_copies && !b->copies) || (b->n_appends && !b->appends) || (b->n_attns && !b->attns))
    BAD("batch item array is NULL");
  if (b->split_mode < DA_SPLIT_AUTO || b->split_mode > DA_SPLIT_PARTIAL)
    BAD("unknown split mode %d", (int)b->split_mode);
  if (b->n_attns > be->max_batch_tokens)
    BAD("%d attention items exceed the batch limit of %d", b->n_attns, be->max_batch_tokens);
  for (int i = 0; i < b->n_copies; i++) {
    const da_page_copy *c = &b->copies[i];
    if (c->src < 0 || c->src >= be->cfg.n_pages || c->dst < 0 || c->dst >= be->cfg.n_pages)
      BAD("copy %d: page %d -> %d outside the pool [0, %d)", i, c->src, c->dst, be->cfg.n_pages);
  }
  int64_t tokens = 0;
  for (int i = 0; i < b->n_appends; i++) {
    const da_append *a = &b->appends[i];
    if (a->layer < 0 || a->layer >= layers)
      BAD("append %d: layer %d outside [0, %d)", i, a->layer, layers);
    if (a->pos < 0 || a->n_tokens < 0 || (int64_t)a->pos + a->n_tokens > MAX_POSITION)
      BAD("append %d: tokens [%d, +%d) outside [0, %d)", i, a->pos, a->n_tokens, MAX_POSITION);
    if (a->n_tokens == 0) continue;
    if (a->k == NULL || a->v == NULL) BAD("append %d: k or v is NULL", i);
    int rv = check_pages(be, a->pages, a->n_pages, a->pos, (int64_t)a->pos + a->n_tokens,
                         "append", i, res);
    if (rv != 0) return rv;
    tokens += a->n_tokens;
  }
  for (int i = 0; i < b->n_attns; i++) {
    const da_attn *a = &b->attns[i];
    if (a->layer < 0 || a->layer >= layers)
      BAD("attn %d: layer %d outside [0, %d)", i, a->layer, layers);
    if (a->q_pos < 0 || a->n_q < 0 || (int64_t)a->q_pos + a->n_q > MAX_POSITION)
      BAD("attn %d: queries [%d, +%d) outside [0, %d)", i, a->q_pos, a->n_q, MAX_POSITION);
    if (a->n_q == 0) continue;
    if (a->q == NULL || a->o == NULL) BAD("attn %d: q or o is NULL", i);
    int rv = check_pages(be, a->pages, a->n_pages, da_cpu_w0(be->cfg.model.window, a->q_pos),
                         (int64_t)a->q_pos + a->n_q, "attn", i, res);
    if (rv != 0) return rv;
    tokens += a->n_q;
  }
  if (tokens > be->max_batch_tokens)
    BAD("batch carries %lld tokens, more than the limit of %d", (long long)tokens,
        be->max_batch_tokens);
  return 0;
}

static void copy_page(da_cpu *be, const da_page_copy *c) {
  if (c->src == c->dst) return;
  for (size_t lk = 0; lk < 2 * (size_t)be->cfg.model.n_layers; lk++) {
    uint16_t *base = be->kv + lk * be->layer_elems;
    memcpy(base + (size_t)c->dst * be->page_elems, base + (size_t)c->src * be->page_elems,
           be->page_elems * sizeof(uint16_t));
  }
}

static void append(da_cpu *be, const da_append *a) {
  const size_t d = (size_t)be->d, row = (size_t)be->hk * d, ptok = (size_t)be->ptok;
  uint16_t *kbase = be->kv + (size_t)a->layer * 2 * be->layer_elems;
  uint16_t *vbase = kbase + be->layer_elems;
  for (int t = 0; t < a->n_tokens; t++) {
    const int pos = a->pos + t;
    const size_t page = (size_t)a->pages[pos / be->ptok] * be->page_elems;
    const size_t slot = (size_t)(pos % be->ptok);
    const uint16_t *k = (const uint16_t *)a->k + (size_t)t * row;
    const uint16_t *v = (const uint16_t *)a->v + (size_t)t * row;
    for (int h = 0; h < be->hk; h++) {
      uint16_t *kd = kbase + page + (size_t)h * ptok * d + slot; /* keys: [d][page_tokens] */
      const uint16_t *ks = k + (size_t)h * d;
      for (size_t c = 0; c < d; c++) kd[c * ptok] = ks[c];
      memcpy(vbase + page + ((size_t)h * ptok + slot) * d, v + (size_t)h * d, d * sizeof(uint16_t));
    }
  }
}

/* Chooses in-row or partial per attention item and lays out the work items. */
static void plan(da_cpu *be, const da_batch *b, da_batch_result *res) {
  int64_t inrow_items = 0;
  for (int i = 0; i < b->n_attns; i++)
    inrow_items += (int64_t)be->hk * ((b->attns[i].n_q + be->qb - 1) / be->qb);
  const int auto_partial = inrow_items < 4 * (int64_t)be->cfg.n_threads;
  int64_t slots_free = be->acc_slots, off_main = 0, off_comb = 0;
  for (int i = 0; i < b->n_attns; i++) {
    const da_attn *a = &b->attns[i];
    da_cpu_plan *pl = &be->plans[i];
    memset(pl, 0, sizeof(*pl));
    pl->off_main = be->main_offs[i] = off_main;
    pl->off_comb = be->comb_offs[i] = off_comb;
    if (a->n_q == 0) continue;
    pl->n_blocks = (a->n_q + be->qb - 1) / be->qb;
    pl->jlo = da_cpu_w0(be->cfg.model.window, a->q_pos) / be->split;
    pl->n_splits = (a->q_pos + a->n_q - 1) / be->split - pl->jlo + 1;
    const int64_t rows = (int64_t)a->n_q * be->hq;
    const int64_t need = rows * pl->n_splits;
    int want = b->split_mode == DA_SPLIT_PARTIAL ||
               (b->split_mode == DA_SPLIT_AUTO && auto_partial && pl->n_splits > 1);
    if (want && need <= slots_free) {
      pl->partial = 1;
      pl->slot_base = be->acc_slots - slots_free;
      slots_free -= need;
      off_main += (int64_t)be->hk * pl->n_blocks * pl->n_splits;
      off_comb += (int64_t)be->hk * pl->n_blocks;
      res->partial_rows += rows;
    } else {
      off_main += (int64_t)be->hk * pl->n_blocks;
      res->inrow_rows += rows;
    }
  }
  be->main_offs[b->n_attns] = off_main;
  be->comb_offs[b->n_attns] = off_comb;
}

static int run(void *ctx, const da_batch *b, da_batch_result *res) {
  da_cpu *be = ctx;
  res->inrow_rows = res->partial_rows = 0;
  res->err[0] = '\0';
  int rv = validate(be, b, res);
  if (rv != 0) return rv;
  if (be->cfg.poison) poison_acc(be);
  for (int i = 0; i < b->n_copies; i++) copy_page(be, &b->copies[i]);
  for (int i = 0; i < b->n_appends; i++) append(be, &b->appends[i]);
  if (b->n_attns == 0) return 0;
  be->b = b;
  plan(be, b, res);
  da_cpu_pool_run(&be->pool, da_cpu_main_item, be, be->main_offs[b->n_attns]);
  da_cpu_pool_run(&be->pool, da_cpu_comb_item, be, be->comb_offs[b->n_attns]);
  be->b = NULL;
  return 0;
}

const da_backend_ops da_cpu_backend_ops = {
    .name = "cpu",
    .available = NULL,
    .create = create,
    .destroy = destroy,
    .run = run,
};
