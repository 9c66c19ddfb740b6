/*
 * bench_cuda.c — the CUDA path of detattn-bench: times the attention and combine kernels
 * with CUDA events after warm-up, with K/V and queries already on the device (filled there
 * from a seed; the host staging path is not timed).
 *
 * Decode: B in {1, 8, 32, 64, 128} x L in {1k, 4k, 16k, 64k}, Hq 32, Hkv 8, d 128, bf16,
 * page 16 (--page N: 8 to 256), S 512 (fixed splits) and, for comparison only, an
 * occupancy-chosen split size; tiles of T = 64 keys (--tile 128: the contract's 128-key
 * tiles, head_dim <= 128).
 * Prefill: B 8 x L 4096 x H 32 at d 64 and 128, and B 2 x L 16384 x H 32 at d 128, causal
 * (the contract is causal; non-causal rows are reported for the peers only).
 * Prints one CSV line per case (header "kind,B,L,Hq,Hkv,d,causal,mode,S,ms,attn_ms,
 * combine_ms,kv_tbs,tflops,lat_ms,timing"), the input of clients/bench/sdpa_peer.py --ours.
 * ms is the whole step (attention then combine, no event between them, so the combine starts
 * as a programmatic dependent as in the daemon), the GPU's time a step: steps captured in one
 * CUDA graph (timing "graph", as the peers are timed) or, where capture fails, launched back
 * to back ("eager"); attn_ms the attention alone, the same way; combine_ms the difference:
 * what the combine adds to a step; lat_ms one step from an idle stream, host launch included.
 * --split-mode inrow|partial forces the decode cases' split form (default: the planner's).
 * Decode K/V pages: shuffled over the pool (default), --contiguous (each sequence's pages in
 * order, one run after another) or --interleaved (the B sequences' pages dealt in turn,
 * sequence b's i-th page is page i B + b: what B sequences decoding together take from a
 * fresh pool's free stack).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "bench.h"
#include "cuda_backend.h"

/* GPU time each case runs before it is timed, as sdpa_peer.py warms a peer: clocks under
 * sustained load. */
#define WARM_MS 250

/* Tokens per KV page (--page), for the pool and the page tables of every case. */
static int page = 16;
/* Keys per tile T (--tile): 64 or 128. */
static int tile = 64;

static int64_t pages_of(int64_t tokens) { return (tokens + page - 1) / page; }

typedef struct shape {
  const char *kind;
  int B, L, hq, hkv, d;
} shape;

static int open_ctx(void **ctx, int hq, int hkv, int d, int64_t tokens, size_t staging) {
  da_backend_cfg cfg = {.model = {.n_layers = 1, .n_q_heads = hq, .n_kv_heads = hkv,
                                  .head_dim = d, .dtype = DA_BF16},
                        .num = {.split_tokens = DA_DEFAULT_SPLIT_TOKENS, .tile_tokens = tile},
                        .page_tokens = page, .n_pages = (int)pages_of(tokens),
                        .staging_bytes = staging};
  da_model_defaults(&cfg.model);
  da_backend_info info;
  char err[256];
  int rv = da_cuda_backend_ops.create(ctx, &cfg, &info, err, sizeof(err));
  if (rv != 0) {
    fprintf(stderr, "bench cuda: create: %s\n", err);
    return rv;
  }
  static const char *paths[] = {"mma.sync (attn.cu)", "wgmma-serial (prefill_sm90.cu)",
                                "wgmma-pipelined (prefill_sm90.cu)", "wgmma-pingpong (prefill_sm90.cu)"};
  const int path = da_cuda_prefill_path(*ctx);
  fprintf(stderr,
          "bench cuda: %s, KV %.1f GiB in pages of %d tokens, tiles of %d, acc %.0f MiB, staging %.0f MiB, prefill "
          "path %s\n",
          info.arch, info.kv_bytes / 1073741824.0, page, tile, info.acc_bytes / 1048576.0,
          info.staging_bytes / 1048576.0, path >= 0 && path < 4 ? paths[path] : "?");
  return da_cuda_bench_fill_kv(*ctx, 42);
}

/* Times one batch of B sequences of n_q queries ending at L on shuffled pages; n_sm (when
 * not NULL) gets the device's SM count. */
static int time_case(void *ctx, const shape *s, int n_q, int S, da_split_mode mode, const char *label,
                     int32_t *pool_perm, int iters, int *n_sm) {
  da_attn *at = calloc((size_t)s->B, sizeof(*at));
  const int np = (int)pages_of(s->L);
  for (int b = 0; b < s->B; b++)
    at[b] = (da_attn){.layer = 0, .q_pos = s->L - n_q, .n_q = n_q,
                      .pages = pool_perm + (size_t)b * np, .n_pages = np};
  da_batch bt = {.attns = at, .n_attns = s->B, .split_mode = mode};
  da_batch_result res;
  int rv = da_cuda_bench_prepare(ctx, &bt, S, 7, &res);
  free(at);
  if (rv != 0) {
    fprintf(stderr, "bench cuda: prepare %s B=%d L=%d: %s\n", s->kind, s->B, s->L, res.err);
    return rv;
  }
  da_cuda_times t;
  rv = da_cuda_bench_time(ctx, WARM_MS, iters, &t);
  if (rv != 0) return rv;
  if (n_sm != NULL) *n_sm = t.n_sm;
  const double ms = t.step_ms;
  double kv_bytes, flops;
  if (n_q == 1) {
    kv_bytes = (double)s->B * s->L * s->hkv * s->d * 4.0;
    flops = 4.0 * s->B * s->hq * (double)s->L * s->d;
  } else {
    kv_bytes = (double)s->B * s->L * s->hkv * s->d * 4.0;
    flops = 4.0 * s->B * s->hq * s->d * ((double)n_q * (n_q + 1) / 2.0);
  }
  printf("%s,%d,%d,%d,%d,%d,1,%s%s,%d,%.4f,%.4f,%.4f,%.3f,%.1f,%.4f,%s\n", s->kind, s->B, s->L, s->hq,
         s->hkv, s->d, label, res.partial_rows > 0 ? "+partial" : "+inrow", S > 0 ? S : DA_DEFAULT_SPLIT_TOKENS, ms,
         t.attn_ms, ms - t.attn_ms,
         kv_bytes / (ms * 1e-3) / 1e12, flops / (ms * 1e-3) / 1e12, t.lat_ms, t.graph ? "graph" : "eager");
  fflush(stdout);
  return 0;
}

static int32_t *shuffled(int64_t n, uint64_t seed) {
  int32_t *p = malloc(sizeof(int32_t) * (size_t)n);
  da_rng r;
  da_rng_seed(&r, seed);
  for (int64_t i = 0; i < n; i++) p[i] = (int32_t)i;
  for (int64_t i = n - 1; i > 0; i--) {
    int64_t j = da_rng_range(&r, 0, i);
    int32_t t = p[i];
    p[i] = p[j], p[j] = t;
  }
  return p;
}

static int occupancy_split(int B, int hkv, int L, int n_sm) {
  /* What a split-count heuristic does: enough CTAs for two waves of the SMs. */
  int per_row = (2 * n_sm + B * hkv - 1) / (B * hkv);
  if (per_row < 1) per_row = 1;
  int S = (L + per_row - 1) / per_row;
  S = (S + tile - 1) / tile * tile;
  return S < tile ? tile : S;
}

int da_bench_cuda(int argc, char **argv) {
  int quick = 0, do_decode = 1, do_prefill = 1, split = 0;
  /* --one-decode B L, up to MAX_ONES times: those decode cases only, in the order given, in
   * one process (what an earlier case leaves behind shows in a later one). */
  enum { MAX_ONES = 8 };
  int one_b[MAX_ONES], one_l[MAX_ONES], n_one = 0;
  enum { PAGES_SHUFFLED, PAGES_CONTIGUOUS, PAGES_INTERLEAVED } order = PAGES_SHUFFLED; /* the last flag wins */
  da_split_mode mode = DA_SPLIT_AUTO;
  shape one_prefill = {"prefill", 0, 0, 32, 8, 128};
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--quick") == 0) quick = 1;
    else if (strcmp(argv[i], "--decode-only") == 0) do_prefill = 0;
    else if (strcmp(argv[i], "--prefill-only") == 0) do_decode = 0;
    else if (strcmp(argv[i], "--contiguous") == 0) order = PAGES_CONTIGUOUS;
    else if (strcmp(argv[i], "--interleaved") == 0) order = PAGES_INTERLEAVED;
    else if (strcmp(argv[i], "--page") == 0 && i + 1 < argc) {
      page = atoi(argv[++i]);
      if (page < 8 || page > 256 || (page & (page - 1))) {
        fprintf(stderr, "bench cuda: --page wants a power of two in [8, 256]\n");
        return 2;
      }
    }
    else if (strcmp(argv[i], "--tile") == 0 && i + 1 < argc) {
      tile = atoi(argv[++i]);
      if (tile != 64 && tile != 128) {
        fprintf(stderr, "bench cuda: --tile wants 64 or 128\n");
        return 2;
      }
    }
    else if (strcmp(argv[i], "--split") == 0 && i + 1 < argc) {
      /* The fixed split size S of the timed cases (default DA_DEFAULT_SPLIT_TOKENS). */
      split = atoi(argv[++i]);
      if (split < 64 || split % 64 != 0) {
        fprintf(stderr, "bench cuda: --split wants a multiple of 64 (and of --tile)\n");
        return 2;
      }
    }
    else if (strcmp(argv[i], "--split-mode") == 0 && i + 1 < argc) {
      /* The decode cases' in-row / partial choice (the planner's by default). */
      if (bench_parse_split_mode(argv[++i], &mode) != 0) {
        fprintf(stderr, "bench cuda: --split-mode wants auto, inrow or partial\n");
        return 2;
      }
    }
    else if (strcmp(argv[i], "--one-decode") == 0 && i + 2 < argc) {
      /* One decode case, any B and L (profilers, lengths off the table): B L. */
      if (n_one == MAX_ONES) {
        fprintf(stderr, "bench cuda: at most %d --one-decode cases\n", MAX_ONES);
        return 2;
      }
      one_b[n_one] = atoi(argv[++i]), one_l[n_one] = atoi(argv[++i]);
      if (one_b[n_one] < 1 || one_l[n_one] < 1) {
        fprintf(stderr, "bench cuda: --one-decode wants B >= 1 and L >= 1\n");
        return 2;
      }
      n_one++;
      do_prefill = 0;
    } else if (strcmp(argv[i], "--one-prefill") == 0 && i + 2 < argc) {
      /* One causal prefill case of the 32/8-head d-128 model: B sequences of L tokens. */
      one_prefill.B = atoi(argv[++i]), one_prefill.L = atoi(argv[++i]);
      do_decode = 0;
    }
  }
  printf("kind,B,L,Hq,Hkv,d,causal,mode,S,ms,attn_ms,combine_ms,kv_tbs,tflops,lat_ms,timing\n");
  int rv = 0;
  void *ctx = NULL;
  int n_sm = 132;
  if (do_decode) {
    static const int Bs[] = {1, 8, 32, 64, 128};
    static const int Ls[] = {1024, 4096, 16384, 65536};
    const int64_t max_tokens = quick ? (int64_t)8 * 65536 : (int64_t)128 * 65536;
    for (int i = 0; i < n_one; i++)
      if ((int64_t)one_b[i] * one_l[i] > max_tokens) {
        fprintf(stderr, "bench cuda: --one-decode wants B * L <= %lld\n", (long long)max_tokens);
        return 2;
      }
    rv = open_ctx(&ctx, 32, 8, 128, max_tokens, 64u << 20);
    if (rv != 0) return rv;
    int32_t *perm = shuffled(pages_of(max_tokens), order == PAGES_CONTIGUOUS ? 0 : 1);
    if (order == PAGES_CONTIGUOUS)
      for (int64_t i = 0; i < pages_of(max_tokens); i++) perm[i] = (int32_t)i;
    /* The table's B x L, or the --one-decode cases as a list of n_one. */
    const size_t nb = n_one > 0 ? (size_t)n_one : sizeof(Bs) / sizeof(Bs[0]),
                 nl = n_one > 0 ? 1 : sizeof(Ls) / sizeof(Ls[0]);
    for (size_t bi = 0; bi < nb; bi++) {
      for (size_t li = 0; li < nl; li++) {
        shape s = {"decode", n_one > 0 ? one_b[bi] : Bs[bi], n_one > 0 ? one_l[bi] : Ls[li], 32, 8, 128};
        if ((int64_t)s.B * s.L > max_tokens) continue;
        if (quick && s.B > 8) continue;
        if (order == PAGES_INTERLEAVED) { /* sequence b's page i is page i B + b */
          const int64_t np = pages_of(s.L);
          for (int64_t b = 0; b < s.B; b++)
            for (int64_t i = 0; i < np; i++) perm[b * np + i] = (int32_t)(i * s.B + b);
        }
        rv = time_case(ctx, &s, 1, split, mode, "fixedS", perm, 20, &n_sm);
        if (rv != 0) goto out;
        int So = occupancy_split(s.B, s.hkv, s.L, n_sm);
        if (n_one > 0) continue;
        rv = time_case(ctx, &s, 1, So, mode, "occupancyS", perm, 20, NULL);
        if (rv != 0) goto out;
      }
    }
    free(perm);
    da_cuda_backend_ops.destroy(ctx);
    ctx = NULL;
  }
  if (do_prefill) {
    static const shape ps[] = {{"prefill", 8, 4096, 32, 32, 64},
                               {"prefill", 8, 4096, 32, 32, 128},
                               {"prefill", 2, 16384, 32, 32, 128}};
    const size_t n_ps = one_prefill.B > 0 ? 1 : sizeof(ps) / sizeof(ps[0]);
    for (size_t i = 0; i < n_ps; i++) {
      const shape *s = one_prefill.B > 0 ? &one_prefill : &ps[i];
      if (quick && i > 0) break;
      const int64_t tokens = (int64_t)s->B * s->L;
      const size_t staging = (size_t)tokens * s->hq * s->d * 2 + (64u << 20);
      rv = open_ctx(&ctx, s->hq, s->hkv, s->d, tokens, staging);
      if (rv != 0) return rv;
      int32_t *perm = shuffled(pages_of(tokens), 2);
      rv = time_case(ctx, s, s->L, split, DA_SPLIT_AUTO, "fixedS", perm, 10, NULL);
      free(perm);
      da_cuda_backend_ops.destroy(ctx);
      ctx = NULL;
      if (rv != 0) return rv;
    }
  }
out:
  if (ctx != NULL) da_cuda_backend_ops.destroy(ctx);
  return rv;
}
