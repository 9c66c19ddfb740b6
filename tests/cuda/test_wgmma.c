/*
 * test_wgmma.c — the sm_90a prefill kernel (prefill_sm90.cu) in each of its variants
 * (DA_CUDA_PREFILL=wgmma-serial, wgmma-pipelined, wgmma-pingpong) against the mma.sync path
 * (attn.cu, DA_CUDA_PREFILL=mma), bit for bit, on the same seeded inputs: one-shot
 * prefill, chunked prefill (random chunk sizes and split modes), token-by-token decode (on
 * prefill_sm90.cu too in the wgmma paths since v3.4, unless DA_CUDA_SM90_DECODE=0), in-row vs
 * partial splits, mixed batches (targets alone vs inside random batches of prefill
 * chunks and decode rows) and decode-only batches (run as pipes); and the wgmma path's accuracy
 * against the fp64 reference. Two backends run side by side, one per path; pools poisoned
 * with NaN. Every comparison prints a line (the first differing element with its token, head
 * and column when it fails), then the test asserts none failed.
 * Exits 77 (skipped) without an sm_90 device or without the sm_90a kernels in this build.
 * Runs with CK_FORK=no: CUDA does not survive fork() after init.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cuda_backend.h"
#include "testutil.h"

typedef struct tcfg {
  int hq, hkv, d, window, S, P;
  da_dtype dt;
  float softcap;
  int T; /* tile_tokens; 0: 64 */
} tcfg;

typedef struct seq {
  int cap;
  int32_t *pages;
  int n_pages;
  uint16_t *k, *v, *q; /* [cap][hkv][d], [cap][hkv][d], [cap][hq][d] */
} seq;

/* A backend of one path (0 mma.sync, then the DA_CU_SM90_* variants 1 serial, 2 pipelined,
 * 3 ping-pong): ctx from da_cuda_backend_ops.create. The wgmma paths run on small persistent
 * grids (DA_CUDA_SM90_GRID), so a CTA walks many items and its K/V ring, barrier phases and
 * ping-pong turns carry over from item to item; the serial one with one CTA per item. */
#define N_PATHS 4
static const char *path_env[N_PATHS] = {"mma", "wgmma-serial", "wgmma-pipelined", "wgmma-pingpong"};
static const char *grid_env[N_PATHS] = {NULL, "items", "3", "2"};
/* WGMMA_TEST_PATHS=1,3 (say) runs only those wgmma paths next to mma.sync (run_wgmma.sh uses it
 * to isolate a failing variant); default all. */
static int path_on[N_PATHS] = {1, 1, 1, 1};
typedef struct path {
  void *ctx;
  const char *name;
} path;

static uint64_t g_seed;
static const int n_layers = 2, pool_pages = 1024;

/* head_dim 64 and 128 (what prefill_sm90.cu takes); MHA and GQA (G = 1, 2, 3, 4, 8), sliding
 * windows, softcap, fp16, page sizes 8-256, S 64-512, tiles of 64 and 128 keys (T = 128: page
 * sizes 8, a tile of 16 TMA boxes, and 256, a page of two tiles). */
static const tcfg cfgs[] = {
    {.hq = 8, .hkv = 2, .d = 128, .window = 0, .S = 128, .P = 16, .dt = DA_BF16},
    {.hq = 4, .hkv = 4, .d = 64, .window = 0, .S = 256, .P = 32, .dt = DA_BF16},
    {.hq = 8, .hkv = 1, .d = 128, .window = 200, .S = 128, .P = 16, .dt = DA_FP16, .softcap = 30.0f},
    {.hq = 4, .hkv = 2, .d = 64, .window = 100, .S = 64, .P = 64, .dt = DA_FP16},
    {.hq = 2, .hkv = 2, .d = 128, .window = 0, .S = 512, .P = 8, .dt = DA_BF16},
    {.hq = 6, .hkv = 2, .d = 64, .window = 0, .S = 192, .P = 16, .dt = DA_BF16, .softcap = 20.0f},
    {.hq = 8, .hkv = 2, .d = 128, .window = 0, .S = 256, .P = 16, .dt = DA_BF16, .T = 128},
    {.hq = 8, .hkv = 1, .d = 128, .window = 300, .S = 384, .P = 256, .dt = DA_FP16, .softcap = 30.0f, .T = 128},
    {.hq = 4, .hkv = 2, .d = 64, .window = 100, .S = 128, .P = 8, .dt = DA_FP16, .softcap = 20.0f, .T = 128},
};
#define N_CFGS (int)(sizeof(cfgs) / sizeof(cfgs[0]))

static da_model model_of(const tcfg *c) {
  da_model m = {.n_layers = n_layers, .n_q_heads = c->hq, .n_kv_heads = c->hkv,
                .head_dim = c->d, .dtype = c->dt, .softcap = c->softcap, .window = c->window};
  da_model_defaults(&m);
  return m;
}

static path open_path(const tcfg *c, int w) {
  da_backend_cfg cfg = {.model = model_of(c),
                        .num = {.split_tokens = c->S, .tile_tokens = c->T ? c->T : 64},
                        .page_tokens = c->P, .n_pages = pool_pages, .acc_slots = 1 << 17,
                        .staging_bytes = 32u << 20, .poison = 1};
  setenv("DA_CUDA_PREFILL", path_env[w], 1);
  if (grid_env[w] != NULL) setenv("DA_CUDA_SM90_GRID", grid_env[w], 1);
  path p = {.ctx = NULL, .name = w ? path_env[w] : "mma.sync"};
  da_backend_info info;
  char err[256] = "";
  int rv = da_cuda_backend_ops.create(&p.ctx, &cfg, &info, err, sizeof(err));
  unsetenv("DA_CUDA_PREFILL");
  unsetenv("DA_CUDA_SM90_GRID");
  ck_assert_msg(rv == 0, "create (%s): %s (seed %llu)", p.name, err, (unsigned long long)g_seed);
  ck_assert_msg(da_cuda_prefill_path(p.ctx) == w, "%s backend: prefill path is %d", p.name,
                da_cuda_prefill_path(p.ctx));
  return p;
}

static void close_path(path *p) {
  da_cuda_backend_ops.destroy(p->ctx);
  p->ctx = NULL;
}

static void seq_init(seq *s, const tcfg *c, int cap, da_rng *r, uint8_t *used) {
  memset(s, 0, sizeof(*s));
  s->cap = cap;
  s->n_pages = (cap + c->P - 1) / c->P;
  s->pages = malloc(sizeof(int32_t) * (size_t)s->n_pages);
  ck_assert(s->pages != NULL);
  ck_assert_int_eq(da_test_random_pages_from(r, s->pages, s->n_pages, used, pool_pages), 0);
  s->k = da_test_random_tensor(r, c->dt, (size_t)cap * c->hkv * c->d, 1.0);
  s->v = da_test_random_tensor(r, c->dt, (size_t)cap * c->hkv * c->d, 1.0);
  s->q = da_test_random_tensor(r, c->dt, (size_t)cap * c->hq * c->d, 1.0);
  ck_assert(s->k && s->v && s->q);
}

static void seq_fini(seq *s) { free(s->pages), free(s->k), free(s->v), free(s->q); }

static da_append mk_append(const tcfg *c, const seq *s, int layer, int pos, int n) {
  return (da_append){.layer = layer, .pos = pos, .n_tokens = n, .pages = s->pages, .n_pages = s->n_pages,
                     .k = s->k + (size_t)pos * c->hkv * c->d, .v = s->v + (size_t)pos * c->hkv * c->d};
}

static da_attn mk_attn(const tcfg *c, const seq *s, int layer, int pos, int n, uint16_t *o, float *lse) {
  return (da_attn){.layer = layer, .q_pos = pos, .n_q = n, .pages = s->pages, .n_pages = s->n_pages,
                   .q = s->q + (size_t)pos * c->hq * c->d, .o = o + (size_t)pos * c->hq * c->d,
                   .lse = lse ? lse + (size_t)pos * c->hq : NULL};
}

static void run_ok(path *p, const da_batch *b) {
  da_batch_result res;
  int rv = da_cuda_backend_ops.run(p->ctx, b, &res);
  ck_assert_msg(rv == 0, "run (%s): %s: %s (seed %llu)", p->name, detattn_status_name(rv), res.err,
                (unsigned long long)g_seed);
}

static void forward(path *p, const tcfg *c, seq *s, int layer, int pos, int n, uint16_t *o, float *lse,
                    da_split_mode mode) {
  da_append ap = mk_append(c, s, layer, pos, n);
  da_attn at = mk_attn(c, s, layer, pos, n, o, lse);
  da_batch b = {.appends = &ap, .n_appends = 1, .attns = &at, .n_attns = 1, .split_mode = mode};
  run_ok(p, &b);
}

/* Compares o ([n][hq][d] in the dtype) and lse ([n][hq]); prints one line; returns 1 on a
 * difference. */
static int same(const tcfg *c, const char *what, int cfg_i, const uint16_t *o1, const uint16_t *o2, const float *l1,
                const float *l2, int n) {
  const size_t no = (size_t)n * c->hq * c->d, nl = (size_t)n * c->hq;
  size_t nd = 0, first = 0, nld = 0, lfirst = 0;
  for (size_t i = 0; i < no; i++)
    if (o1[i] != o2[i] && nd++ == 0) first = i;
  if (l1 != NULL)
    for (size_t i = 0; i < nl; i++)
      if (memcmp(&l1[i], &l2[i], 4) != 0 && nld++ == 0) lfirst = i;
  if (nd == 0 && nld == 0) {
    printf("cfg %d %-40s equal (%zu o, %zu lse)\n", cfg_i, what, no, l1 ? nl : 0);
    return 0;
  }
  printf("cfg %d %-40s DIFFER: %zu of %zu o", cfg_i, what, nd, no);
  if (nd > 0)
    printf(", first token %zu head %zu col %zu: %.8g (%04x) vs %.8g (%04x)", first / ((size_t)c->hq * c->d),
           first / c->d % c->hq, first % c->d, da_to_f32(c->dt, o1[first]), o1[first],
           da_to_f32(c->dt, o2[first]), o2[first]);
  printf("; %zu of %zu lse", nld, l1 ? nl : 0);
  if (nld > 0)
    printf(", first token %zu head %zu: %.9g vs %.9g", lfirst / c->hq, lfirst % c->hq, l1[lfirst], l2[lfirst]);
  printf(" (seed %llu)\n", (unsigned long long)g_seed);
  return 1;
}

/* One-shot prefill, chunked prefill and prefill-then-decode on both paths. */
START_TEST(paths_agree_on_prefill_chunks_and_decode) {
  const tcfg *c = &cfgs[_i];
  const int n = 700, pre = 520;
  da_rng r;
  da_rng_seed(&r, g_seed + (uint64_t)_i);
  uint8_t used[1024] = {0};
  seq s;
  seq_init(&s, c, n, &r, used);
  /* The chunk sizes and split modes, drawn once and replayed on both paths. */
  int chunk[700], mode[700], n_chunks = 0;
  for (int pos = 0; pos < n; n_chunks++) {
    int k = (int)da_rng_range(&r, 1, 300);
    if (k > n - pos) k = n - pos;
    chunk[n_chunks] = k, mode[n_chunks] = (int)da_rng_range(&r, 0, 2);
    pos += k;
  }
  const size_t no = (size_t)n * c->hq * c->d, nl = (size_t)n * c->hq;
  uint16_t *o[N_PATHS][3] = {{NULL}};
  float *lse[N_PATHS][3] = {{NULL}};
  int fails = 0;
  for (int w = 0; w < N_PATHS; w++) {
    if (!path_on[w]) continue;
    path p = open_path(c, w);
    for (int v = 0; v < 3; v++) {
      o[w][v] = malloc(no * 2), lse[w][v] = malloc(nl * 4);
      ck_assert(o[w][v] && lse[w][v]);
    }
    /* Three layers of one pool hold the same tokens: one-shot, chunked, prefill + decode. */
    forward(&p, c, &s, 0, 0, n, o[w][0], lse[w][0], DA_SPLIT_AUTO);
    for (int i = 0, pos = 0; i < n_chunks; pos += chunk[i++])
      forward(&p, c, &s, 1, pos, chunk[i], o[w][1], lse[w][1], (da_split_mode)mode[i]);
    close_path(&p);
    p = open_path(c, w);
    forward(&p, c, &s, 0, 0, pre, o[w][2], lse[w][2], DA_SPLIT_AUTO);
    for (int pos = pre; pos < n; pos++)
      forward(&p, c, &s, 0, pos, 1, o[w][2], lse[w][2], (da_split_mode)(pos % 3));
    close_path(&p);
  }
  static const char *vname[3] = {"one-shot", "chunked", "prefill+decode"};
  char what[80];
  for (int w = 1; w < N_PATHS; w++) {
    if (!path_on[w]) continue;
    for (int v = 0; v < 3; v++) {
      snprintf(what, sizeof(what), "%s: mma.sync vs %s", vname[v], path_env[w]);
      fails += same(c, what, _i, o[0][v], o[w][v], lse[0][v], lse[w][v], n);
    }
    for (int v = 1; v < 3; v++) {
      snprintf(what, sizeof(what), "%s: one-shot vs %s", path_env[w], vname[v]);
      fails += same(c, what, _i, o[w][0], o[w][v], lse[w][0], lse[w][v], n);
    }
  }
  for (int w = 0; w < N_PATHS; w++)
    for (int v = 0; v < 3; v++) free(o[w][v]), free(lse[w][v]);
  seq_fini(&s);
  ck_assert_msg(fails == 0, "cfg %d: %d comparisons differ (seed %llu)", _i, fails, (unsigned long long)g_seed);
}
END_TEST

/* The split modes of the split-mode tests: o[w][m] and lse[w][m] are path w's rows (n
 * tokens) in mode m. */
static const da_split_mode modes[] = {DA_SPLIT_INROW, DA_SPLIT_PARTIAL, DA_SPLIT_AUTO};
static const char *mode_names[] = {"in-row", "partial", "auto"};
#define N_MODES 3

/* Each wgmma path in every mode against mma.sync, and its in-row rows against its partial
 * ones; what prefixes the lines. Returns how many comparisons differ. */
static int modes_agree(const tcfg *c, int cfg_i, const char *what, uint16_t *const o[][N_MODES + 1],
                       float *const lse[][N_MODES + 1], int n) {
  char line[96];
  int fails = 0;
  for (int w = 1; w < N_PATHS; w++) {
    if (!path_on[w]) continue;
    for (int m = 0; m < N_MODES; m++) {
      snprintf(line, sizeof(line), "%s%s: mma.sync vs %s", what, mode_names[m], path_env[w]);
      fails += same(c, line, cfg_i, o[0][m], o[w][m], lse[0][m], lse[w][m], n);
    }
    snprintf(line, sizeof(line), "%s: %sin-row vs partial", path_env[w], what);
    fails += same(c, line, cfg_i, o[w][0], o[w][1], lse[w][0], lse[w][1], n);
  }
  return fails;
}

/* In-row, partial and auto split modes on the wgmma path equal each other and mma.sync. */
START_TEST(paths_agree_in_every_split_mode) {
  const tcfg *c = &cfgs[_i];
  const int n = 900;
  da_rng r;
  da_rng_seed(&r, g_seed + 100 + (uint64_t)_i);
  uint8_t used[1024] = {0};
  seq s;
  seq_init(&s, c, n, &r, used);
  const size_t no = (size_t)n * c->hq * c->d, nl = (size_t)n * c->hq;
  uint16_t *o[N_PATHS][N_MODES + 1] = {{NULL}};
  float *lse[N_PATHS][N_MODES + 1] = {{NULL}};
  int fails = 0;
  for (int w = 0; w < N_PATHS; w++) {
    if (!path_on[w]) continue;
    path p = open_path(c, w);
    da_append ap = mk_append(c, &s, 1, 0, n);
    da_batch b0 = {.appends = &ap, .n_appends = 1};
    run_ok(&p, &b0);
    for (int m = 0; m < N_MODES; m++) {
      o[w][m] = malloc(no * 2), lse[w][m] = malloc(nl * 4);
      da_attn at = mk_attn(c, &s, 1, 0, n, o[w][m], lse[w][m]);
      da_batch b = {.attns = &at, .n_attns = 1, .split_mode = modes[m]};
      run_ok(&p, &b);
    }
    close_path(&p);
  }
  fails += modes_agree(c, _i, "", o, lse, n);
  for (int w = 0; w < N_PATHS; w++)
    for (int m = 0; m < N_MODES; m++) free(o[w][m]), free(lse[w][m]);
  seq_fini(&s);
  ck_assert_msg(fails == 0, "cfg %d: %d comparisons differ (seed %llu)", _i, fails, (unsigned long long)g_seed);
}
END_TEST

/* A decode row and a prefill chunk alone, then inside random mixes of prefill chunks and decode
 * rows of other sequences (shuffled, random split modes), on both paths. */
START_TEST(paths_agree_in_mixed_batches) {
  const tcfg *c = &cfgs[_i];
  enum { NS = 6, TRIALS = 5 };
  const int n = 600, dpos = 577, ppos = 130, pn = 211;
  da_rng r;
  da_rng_seed(&r, g_seed + 200 + (uint64_t)_i);
  uint8_t used[1024] = {0};
  seq s[NS];
  for (int i = 0; i < NS; i++) seq_init(&s[i], c, n, &r, used);
  /* The mixes, drawn once. */
  int q_n[TRIALS][NS], q_pos[TRIALS][NS], lay[TRIALS][NS], perm[TRIALS][2 + NS], smode[TRIALS];
  for (int t = 0; t < TRIALS; t++) {
    for (int i = 0; i < NS; i++) {
      q_n[t][i] = da_rng_range(&r, 0, 1) ? 1 : (int)da_rng_range(&r, 2, 300);
      q_pos[t][i] = (int)da_rng_range(&r, 0, n - q_n[t][i]);
      lay[t][i] = (int)da_rng_range(&r, 0, 1);
    }
    for (int i = 0; i < 2 + NS; i++) perm[t][i] = i;
    for (int i = 2 + NS - 1; i > 0; i--) {
      int j = (int)da_rng_range(&r, 0, i), x = perm[t][i];
      perm[t][i] = perm[t][j], perm[t][j] = x;
    }
    smode[t] = (int)da_rng_range(&r, 0, 2);
  }
  const size_t row = (size_t)c->hq * c->d;
  uint16_t *ref[N_PATHS] = {NULL}, *got = malloc((size_t)(1 + pn) * row * 2), *scratch = malloc((size_t)NS * n * row * 2);
  int fails = 0;
  for (int w = 0; w < N_PATHS; w++) {
    if (!path_on[w]) continue;
    path p = open_path(c, w);
    ref[w] = malloc((size_t)(1 + pn) * row * 2);
    for (int i = 0; i < NS; i++) {
      for (int l = 0; l < 2; l++) {
        da_append ap = mk_append(c, &s[i], l, 0, n);
        da_batch b = {.appends = &ap, .n_appends = 1};
        run_ok(&p, &b);
      }
    }
    for (int t = -1; t < TRIALS; t++) {
      da_attn all[2 + NS], at[2 + NS];
      uint16_t *dst = t < 0 ? ref[w] : got;
      all[0] = mk_attn(c, &s[0], 1, dpos, 1, scratch, NULL);
      all[0].o = dst;
      all[1] = mk_attn(c, &s[1], 1, ppos, pn, scratch, NULL);
      all[1].o = dst + row;
      int na = 2;
      if (t >= 0) {
        for (int i = 0; i < NS; i++)
          all[na++] = mk_attn(c, &s[i], lay[t][i], q_pos[t][i], q_n[t][i], scratch + (size_t)i * n * row, NULL);
        for (int i = 0; i < na; i++) at[i] = all[perm[t][i]];
      } else {
        at[0] = all[0], at[1] = all[1];
      }
      da_batch b = {.attns = at, .n_attns = na, .split_mode = t < 0 ? DA_SPLIT_AUTO : (da_split_mode)smode[t]};
      run_ok(&p, &b);
      if (t >= 0) {
        char what[64];
        snprintf(what, sizeof(what), "%s: alone vs mix %d", p.name, t);
        /* Rows as [1 + pn] tokens of [hq][d]; no lse. */
        fails += same(c, what, _i, ref[w], got, NULL, NULL, 1 + pn);
      }
    }
    close_path(&p);
  }
  for (int w = 1; w < N_PATHS; w++) {
    if (!path_on[w]) continue;
    char what[80];
    snprintf(what, sizeof(what), "alone: mma.sync vs %s", path_env[w]);
    fails += same(c, what, _i, ref[0], ref[w], NULL, NULL, 1 + pn);
  }
  for (int w = 0; w < N_PATHS; w++) free(ref[w]);
  free(got), free(scratch);
  for (int i = 0; i < NS; i++) seq_fini(&s[i]);
  ck_assert_msg(fails == 0, "cfg %d: %d comparisons differ (seed %llu)", _i, fails, (unsigned long long)g_seed);
}
END_TEST

/* Decode-only batches (prefill_sm90.cu runs in-row ones as pipes, DA_CU_SM90_PIPES: two
 * independent pipelines a CTA on the small test grids): NS sequences each decode one token at
 * a random position, in every split mode, against mma.sync, against the partial form, and
 * each row against the same row decoded alone. */
START_TEST(paths_agree_in_decode_batches) {
  const tcfg *c = &cfgs[_i];
  enum { NS = 10 };
  const int n = 800;
  da_rng r;
  da_rng_seed(&r, g_seed + 400 + (uint64_t)_i);
  uint8_t used[1024] = {0};
  seq s[NS];
  int pos[NS];
  for (int i = 0; i < NS; i++) seq_init(&s[i], c, n, &r, used), pos[i] = (int)da_rng_range(&r, 0, n - 1);
  const size_t row = (size_t)c->hq * c->d;
  /* o[w][m]: [NS][hq][d] rows of the batch in mode m; o[w][N_MODES]: each row alone (in-row). */
  uint16_t *o[N_PATHS][N_MODES + 1] = {{NULL}};
  float *lse[N_PATHS][N_MODES + 1] = {{NULL}};
  int fails = 0;
  for (int w = 0; w < N_PATHS; w++) {
    if (!path_on[w]) continue;
    path p = open_path(c, w);
    for (int i = 0; i < NS; i++) {
      da_append ap = mk_append(c, &s[i], 1, 0, n);
      da_batch b = {.appends = &ap, .n_appends = 1};
      run_ok(&p, &b);
    }
    for (int m = 0; m <= N_MODES; m++) {
      o[w][m] = malloc(NS * row * 2), lse[w][m] = malloc(NS * (size_t)c->hq * 4);
      ck_assert(o[w][m] && lse[w][m]);
    }
    da_attn at[NS];
    for (int i = 0; i < NS; i++)
      at[i] = (da_attn){.layer = 1, .q_pos = pos[i], .n_q = 1, .pages = s[i].pages, .n_pages = s[i].n_pages,
                        .q = s[i].q + (size_t)pos[i] * row};
    for (int m = 0; m <= N_MODES; m++) {
      for (int i = 0; i < NS; i++) at[i].o = o[w][m] + i * row, at[i].lse = lse[w][m] + (size_t)i * c->hq;
      if (m < N_MODES) {
        da_batch b = {.attns = at, .n_attns = NS, .split_mode = modes[m]};
        run_ok(&p, &b);
      } else {
        for (int i = 0; i < NS; i++) {
          da_batch b = {.attns = &at[i], .n_attns = 1, .split_mode = DA_SPLIT_INROW};
          run_ok(&p, &b);
        }
      }
    }
    close_path(&p);
  }
  fails += modes_agree(c, _i, "decode ", o, lse, NS);
  for (int w = 1; w < N_PATHS; w++) {
    if (!path_on[w]) continue;
    char what[80];
    snprintf(what, sizeof(what), "%s: decode batch vs alone", path_env[w]);
    fails += same(c, what, _i, o[w][0], o[w][N_MODES], lse[w][0], lse[w][N_MODES], NS);
  }
  for (int w = 0; w < N_PATHS; w++)
    for (int m = 0; m <= N_MODES; m++) free(o[w][m]), free(lse[w][m]);
  for (int i = 0; i < NS; i++) seq_fini(&s[i]);
  ck_assert_msg(fails == 0, "cfg %d: %d comparisons differ (seed %llu)", _i, fails, (unsigned long long)g_seed);
}
END_TEST

/* The wgmma path against the fp64 reference (two chunks, read through the pages). */
START_TEST(wgmma_matches_fp64_reference) {
  const tcfg *c = &cfgs[_i];
  const int n = 541;
  da_rng r;
  da_rng_seed(&r, g_seed + 300 + (uint64_t)_i);
  uint8_t used[1024] = {0};
  seq s;
  seq_init(&s, c, n, &r, used);
  const size_t no = (size_t)n * c->hq * c->d;
  uint16_t *o = malloc(no * 2);
  float *lse = malloc((size_t)n * c->hq * 4);
  double *ro = malloc(no * 8), *rl = malloc((size_t)n * c->hq * 8);
  ck_assert(o && lse && ro && rl);
  da_model m = model_of(c);
  ck_assert_int_eq(da_test_ref_attention(&m, s.k, s.v, n, s.q, 0, n, ro, rl), 0);
  const double tol = c->dt == DA_BF16 ? 4e-3 : 5e-4;
  int bad = 0;
  for (int w = 1; w < N_PATHS; w++) {
    if (!path_on[w]) continue;
    path p = open_path(c, w);
    forward(&p, c, &s, 1, 0, 300, o, lse, DA_SPLIT_AUTO);
    forward(&p, c, &s, 1, 300, n - 300, o, lse, DA_SPLIT_AUTO);
    close_path(&p);
    const double e = da_test_rel_err(c->dt, o, ro, no);
    const double el = da_test_max_abs_err_f32(lse, rl, (size_t)n * c->hq);
    printf("cfg %d accuracy %s (%s d%d hq%d hkv%d win%d cap%g S%d P%d T%d): rel err %.2e (bound %.0e), lse max abs "
           "err %.2e%s\n",
           _i, path_env[w], da_dtype_name(c->dt), c->d, c->hq, c->hkv, c->window, (double)c->softcap, c->S, c->P,
           c->T ? c->T : 64, e, tol, el, e <= tol && el <= 2e-5 ? "" : "  FAIL");
    bad += !(e <= tol && el <= 2e-5);
  }
  ck_assert_msg(bad == 0, "cfg %d: accuracy out of bounds (seed %llu)", _i, (unsigned long long)g_seed);
  free(o), free(lse), free(ro), free(rl);
  seq_fini(&s);
}
END_TEST

int main(void) {
  if (!da_cuda_backend_ops.available()) {
    printf("no CUDA device: skipped\n");
    return 77;
  }
  g_seed = da_test_seed(0x5eed2027ull);
  printf("seed %llu\n", (unsigned long long)g_seed);
  const char *only = getenv("WGMMA_TEST_PATHS");
  if (only != NULL && only[0] != '\0') {
    for (int w = 1; w < N_PATHS; w++) path_on[w] = strchr(only, '0' + w) != NULL;
    printf("wgmma paths:");
    for (int w = 1; w < N_PATHS; w++)
      if (path_on[w]) printf(" %s", path_env[w]);
    printf("\n");
  }
  {
    /* Skip where the wgmma path cannot run: no sm_90a kernels in this build, or not sm_90. */
    da_backend_cfg cfg = {.model = model_of(&cfgs[1]), .num = {.split_tokens = 256, .tile_tokens = 64},
                          .page_tokens = 16, .n_pages = 16};
    da_backend_info info;
    char err[256];
    void *ctx = NULL;
    setenv("DA_CUDA_PREFILL", "wgmma", 1);
    int rv = da_cuda_backend_ops.create(&ctx, &cfg, &info, err, sizeof(err));
    unsetenv("DA_CUDA_PREFILL");
    const int on = rv == 0 && da_cuda_prefill_path(ctx);
    if (rv == 0) da_cuda_backend_ops.destroy(ctx);
    if (!on) {
      printf("the wgmma prefill path is not available here (%s): skipped\n", rv == 0 ? info.arch : err);
      return 77;
    }
  }
  Suite *su = suite_create("wgmma");
  TCase *tc = tcase_create("bits");
  tcase_set_timeout(tc, 120);
  tcase_add_loop_test(tc, paths_agree_on_prefill_chunks_and_decode, 0, N_CFGS);
  tcase_add_loop_test(tc, paths_agree_in_every_split_mode, 0, N_CFGS);
  tcase_add_loop_test(tc, paths_agree_in_mixed_batches, 0, N_CFGS);
  tcase_add_loop_test(tc, paths_agree_in_decode_batches, 0, N_CFGS);
  suite_add_tcase(su, tc);
  tc = tcase_create("accuracy");
  tcase_set_timeout(tc, 60);
  tcase_add_loop_test(tc, wgmma_matches_fp64_reference, 0, N_CFGS);
  suite_add_tcase(su, tc);
  SRunner *sr = srunner_create(su);
  srunner_set_fork_status(sr, CK_NOFORK);
  return da_test_run_runner(sr);
}
