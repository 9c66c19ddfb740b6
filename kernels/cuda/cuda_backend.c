/*
 * cuda_backend.c — the CUDA backend's host side: pools (KV, accumulators, staging) taken
 * once in create(), batch validation, the per-batch work list (attention items, combine
 * items, appends, page copies), the stream and its ordering, error handling. Kernels are in
 * the .cu files behind cuda_kernels.h.
 *
 * A batch: the host packs its inputs into a pinned staging buffer; H2D of that buffer on
 * the copy stream; then on the compute stream (after an event for that copy): page copies,
 * appends, (poison), attention, combine, D2H of the outputs, a host callback (ready) and
 * the batch's done event. finish() waits for that event and unpacks the outputs into the
 * caller's o / lse buffers.
 *
 * Staging has two buffer sets; consecutive batches alternate, and submit() lets two be in
 * flight. What overlaps when batch N+1 is submitted while N runs: the host-side packing of
 * N+1 (memcpy of q, k, v and page tables into pinned memory — the largest host cost) and
 * its H2D (copy engine, copy stream) run during N's kernels; N's unpack on the host runs
 * during N+1's kernels. The compute stream still runs every kernel in submission order,
 * so results do not change; N+1's appends start only after N's attention has read the
 * cache. run() is submit() then finish().
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "backend.h"
#include "cuda_backend.h"
#include "cuda_kernels.h"
#include "items.h"

/* 3: blocks of more than 16 rows run on prefill_sm90.cu by default where it can run (same
 * bits as attn.cu, tests/cuda/test_wgmma.c; a different kernel, so a new version).
 * 4: the tile update of numerics.cuh v4 (scale inside the exponent's FMA, per-thread row
 * sums, lazy running max): fewer instructions per tile, other bits.
 * 5: split ends and merges multiply by a per-row correctly rounded reciprocal instead of
 *    dividing every element exactly (numerics.cuh v5). */
#define KERNEL_VERSION 5u
#define DEFAULT_ACC_SLOTS (1 << 18)
#define DEFAULT_STAGING (64u << 20)
/* DA_CUDA_COMBINE_SHORT: rows of up to 8 splits. Same-call A/B on an H200 (NOTES.md v5.24,
 * the warp form with its loads ahead of the chain): B 1 L 4k (8 splits) 0.96x the step, B 1 /
 * 8 L 1k as before (0.95x / 0.94x of the CTA form), B 8 L 2k even; at 32 splits the CTA form
 * is still ahead (B 1 L 16k 1.08x, B 8 L 16k 1.02x with the warp form). */
#define DEFAULT_COMBINE_SHORT 8
#define ALIGN 256

typedef struct cuda_ctx {
  da_backend_cfg cfg;
  int n_sm, dead;
  int64_t l2_bytes; /* the device's L2: launches whose K/V exceed it stream K/V (args.kv_stream) */
  int sm90_prefill; /* blocks of more than 16 rows on prefill_sm90.cu: 0 no (attn.cu), else DA_CU_SM90_* */
  int sm90_grid;     /* DA_CUDA_SM90_GRID (tests, benchmarks): 0 a persistent grid of one CTA per SM, -1
                       ("items") one CTA per item, k > 0 a persistent grid of at most k CTAs */
  int brows;        /* rows per block of those: DA_CU_BLOCK_ROWS or DA_CU_SM90_BLOCK_ROWS */
  int sm90_decode;  /* blocks of at most 16 rows on prefill_sm90.cu too (unless DA_CUDA_SM90_DECODE=0) */
  int launch_pipes; /* the staged batch runs as pipes (plan.pipes > 1) */
  int partial_per;  /* DA_CUDA_PARTIAL_PER=k (experiments): k splits per partial item; 0 the planner's */
  int deal;         /* prefill_sm90.cu's persistent grid: DEAL_* (DA_CUDA_SM90_DEAL) */
  int l2_promo;     /* args.l2_promo (l2_promo_env) */
  int kv_stream_ok; /* DA_CUDA_KV_STREAM (experiments): 0 never sets args.kv_stream, 1 by size (default) */
  int *ticket;      /* its ticket counter (device, 2 ints, 0 between launches) */
  int sm90_pipes;   /* batches of such blocks only: 0 as any batch, else the variant (DA_CU_SM90_PIPES |
                       form) they run as: pipelined, or serial with DA_CUDA_SM90_DECODE=pipes-serial or
                       DA_CUDA_PREFILL=wgmma-serial; DA_CUDA_SM90_DECODE=1: 0 */
  int q_tma;         /* prefill_sm90.cu loads Q by TMA an item ahead (unless DA_CUDA_SM90_QTMA=0) */
  int pipes_partial; /* batches with partial rows as pipes too (unless DA_CUDA_SM90_DECODE=pipes-inrow) */
  int prefix;        /* a partial block's first item folds in-row (DA_CU_ITEM_PREFIX; DA_CUDA_PREFIX=0: no) */
  int prefix_tail;   /* decode rows that would run in-row run as a prefix item and their last splits as
                        one-split items (DA_CU_PART_TAIL): -1 by rule (da_cu_tail_splits), 0 never, k > 0
                        the last k (DA_CUDA_PREFIX_TAIL) */
  int combine_short; /* rows of at most this many splits are combined a warp a row (DA_CUDA_COMBINE_SHORT) */
  int per_tail;      /* decode launches by ticket: DA_CU_PART_PER blocks' last splits as one-split items
                        (da_cu_tail_splits): -1 by rule, 0 never, k > 0 the last k (DA_CUDA_PER_TAIL) */
  cudaStream_t stream, copy;
  cudaEvent_t ev[3];            /* bench timing */
  cudaEvent_t ev_in[2], ev_done[2]; /* per staging set: H2D done; batch done */
  void *kv;
  size_t kv_bytes;
  int64_t page_bytes;
  float *acc_o, *acc_lse;
  size_t acc_bytes;
  unsigned char *d_in[2], *d_out[2], *h_in[2], *h_out[2];
  size_t stage_bytes;
  int cur;
  da_cu_args args;        /* the last prepared batch */
  size_t out_used;        /* bytes of d_out the last batch wrote */
  int64_t slots_used;
  struct flight *fl;      /* [2] batches in flight, a ring */
  int fl_head, fl_n;
  struct timing *tm;      /* DA_CUDA_TIMING=1 (diagnostics), else NULL */
  uint64_t tm_at[3];      /* with it: host ns at the ends of stage()'s plan, wait and pack */
  char arch[32];
} cuda_ctx;

/* Sticky errors leave the context unusable: the backend is dead from then on. */
static int sticky(cudaError_t e) {
  switch (e) {
  case cudaErrorIllegalAddress:
  case cudaErrorLaunchFailure:
  case cudaErrorAssert:
  case cudaErrorHardwareStackError:
  case cudaErrorIllegalInstruction:
  case cudaErrorMisalignedAddress:
  case cudaErrorInvalidAddressSpace:
  case cudaErrorInvalidPc:
  case cudaErrorECCUncorrectable:
  case cudaErrorLaunchTimeout:
    return 1;
  default:
    return 0;
  }
}

/* The devices this build has kernels for (CMAKE_CUDA_ARCHITECTURES: DA_CUDA_SM80/SM90). */
static int arch_ok(int major, int minor) {
#ifdef DA_CUDA_SM80
  if (major == 8 && minor == 0) return 1;
#endif
#if defined(DA_CUDA_SM90) || !defined(DA_CUDA_SM80)
  if (major == 9 && minor == 0) return 1;
#endif
  return 0;
}

static int cuda_fail(cuda_ctx *c, cudaError_t e, const char *what, int line, char *err,
                     size_t errlen) {
  if (err != NULL && errlen > 0)
    snprintf(err, errlen, "cuda: %s failed (line %d): %s", what, line, cudaGetErrorString(e));
  (void)cudaGetLastError(); /* a non-sticky error must not resurface at the next launch */
  if (c != NULL && sticky(e)) {
    c->dead = 1;
    return DETATTN_UNAVAILABLE;
  }
  if (e == cudaErrorMemoryAllocation) return DETATTN_RESOURCE_EXHAUSTED;
  return DETATTN_INTERNAL;
}

/* Every CUDA call goes through CUDA_GOTO: on error it converts the status, writes the
 * message and jumps to label. */
#define CUDA_GOTO(c, call, label)                                            \
  do {                                                                       \
    cudaError_t e_ = (cudaError_t)(call);                                    \
    if (e_ != cudaSuccess) {                                                 \
      rv = cuda_fail((c), e_, #call, __LINE__, err, errlen);                 \
      goto label;                                                            \
    }                                                                        \
  } while (0)

static int available(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n > 0;
}

/*
 * DA_CUDA_TIMING=1 (diagnostics; unset or 0: off): every batch's stream carries timing
 * events between its phases (staging on the device: the metadata H2D, page copies and the
 * append with its gathers, from when the host has packed the batch; the attention; the
 * combine; the outputs' scatter and D2H), the host times submit's staging (its parts:
 * validate and plan, the wait for the staging set's last batch, pack, then the H2D copy and
 * the staging launches) and launches, and the wall time from submit's entry to finish's
 * event wait, and destroy() prints the medians and 90th percentiles of the last
 * TIMING_N batches to stderr, decode batches (every attention of at most TIMING_DECODE_Q
 * query tokens) apart from the others. The events sit between programmatic dependent
 * launches, so the timed form overlaps a little less than the plain one.
 */
enum {
  TM_STAGE, TM_ATTN, TM_COMBINE, TM_OUT, TM_GPU,
  /* host, us: stage()'s parts (TM_HOST_* .. TM_HOST_LAUNCH - 1 in order), then the launches */
  TM_HOST_PLAN = TM_GPU, TM_HOST_WAIT, TM_HOST_PACK, TM_HOST_ENQ, TM_HOST_LAUNCH, TM_WALL, TM_COLS
};
#define TM_HOST_N (TM_WALL - TM_HOST_PLAN) /* host parts of a batch */
#define TIMING_N 1024
#define TIMING_DECODE_Q 16 /* the daemon's --decode-tokens default */

typedef struct timing {
  cudaEvent_t ev[2][TM_GPU + 1]; /* per staging set: the phases' bounds */
  struct {
    float us[TIMING_N][TM_COLS]; /* the last batches */
    int64_t n;
  } ring[2]; /* decode batches, the others */
} timing;

static const char *const tm_names[TM_COLS] = {"stage", "attention", "combine", "out", "host plan", "host wait",
                                              "host pack", "host enqueue", "host launch", "submit to done"};

static int cmp_float(const void *a, const void *b) {
  const float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

static void timing_report(const timing *t, int kind) {
  const int64_t total = t->ring[kind].n;
  const int n = total < TIMING_N ? (int)total : TIMING_N;
  if (n == 0) return;
  float *col = malloc((size_t)n * sizeof(*col));
  if (col == NULL) return;
  char line[768];
  int k = snprintf(line, sizeof(line), "cuda timing, %s batches: last %d of %lld, us p50 / p90:",
                   kind == 0 ? "decode" : "other", n, (long long)total);
  for (int j = 0; j < TM_COLS && k > 0 && (size_t)k < sizeof(line); j++) {
    for (int i = 0; i < n; i++) col[i] = t->ring[kind].us[i][j];
    qsort(col, (size_t)n, sizeof(*col), cmp_float);
    k += snprintf(line + k, sizeof(line) - (size_t)k, "%s %s %.1f / %.1f", j == 0 ? "" : ",", tm_names[j],
                  col[n / 2], col[(n * 9) / 10]);
  }
  fprintf(stderr, "%s\n", line);
  free(col);
}

/* A finished batch of set `set` (its events complete) into ring `kind` (0 decode). */
static void timing_add(timing *t, int kind, int set, uint64_t t_submit, const float *host) {
  float *row = t->ring[kind].us[t->ring[kind].n % TIMING_N];
  for (int j = 0; j < TM_GPU; j++)
    if (cudaEventElapsedTime(&row[j], t->ev[set][j], t->ev[set][j + 1]) == cudaSuccess) row[j] *= 1e3f;
    else row[j] = -1.0f, (void)cudaGetLastError();
  memcpy(row + TM_HOST_PLAN, host, TM_HOST_N * sizeof(*host));
  row[TM_WALL] = (float)(da_now_ns() - t_submit) * 1e-3f;
  t->ring[kind].n++;
}

static void timing_free(timing *t) {
  if (t == NULL) return;
  timing_report(t, 0);
  timing_report(t, 1);
  for (int s = 0; s < 2; s++)
    for (int j = 0; j <= TM_GPU; j++)
      if (t->ev[s][j] != NULL) cudaEventDestroy(t->ev[s][j]);
  free(t);
}

static void free_all(cuda_ctx *c) {
  for (int i = 0; i < 2; i++) {
    cudaFree(c->d_in[i]);
    cudaFree(c->d_out[i]);
    cudaFreeHost(c->h_in[i]);
    cudaFreeHost(c->h_out[i]);
  }
  cudaFree(c->acc_o);
  cudaFree(c->acc_lse);
  cudaFree(c->ticket);
  cudaFree(c->kv);
  for (int i = 0; i < 3; i++)
    if (c->ev[i] != NULL) cudaEventDestroy(c->ev[i]);
  for (int i = 0; i < 2; i++) {
    if (c->ev_in[i] != NULL) cudaEventDestroy(c->ev_in[i]);
    if (c->ev_done[i] != NULL) cudaEventDestroy(c->ev_done[i]);
  }
  if (c->stream != NULL) cudaStreamDestroy(c->stream);
  if (c->copy != NULL) cudaStreamDestroy(c->copy);
  timing_free(c->tm);
  free(c->fl);
  free(c);
}

static int check_cfg(const da_backend_cfg *cfg, char *err, size_t errlen) {
  char msg[200];
  int rv = da_model_check(&cfg->model, &cfg->num, msg, sizeof(msg));
  if (rv != 0) {
    snprintf(err, errlen, "cuda: %s", msg);
    return rv;
  }
  const int T = cfg->num.tile_tokens;
  if (T != DA_CU_TILE && T != DA_CU_TILE_MAX) {
    snprintf(err, errlen, "cuda: tile_tokens must be %d or %d (the kernels' tiles), got %d", DA_CU_TILE,
             DA_CU_TILE_MAX, T);
    return DETATTN_INVALID_ARGUMENT;
  }
  if (T == DA_CU_TILE_MAX && cfg->model.head_dim > 128) {
    snprintf(err, errlen, "cuda: tile_tokens %d needs head_dim <= 128 (a tile's K and V in shared memory), got %d",
             T, cfg->model.head_dim);
    return DETATTN_INVALID_ARGUMENT;
  }
  if (cfg->page_tokens < 8 || cfg->page_tokens > 256 || (cfg->page_tokens & (cfg->page_tokens - 1))) {
    snprintf(err, errlen, "cuda: page_tokens must be a power of two in [8, 256], got %d",
             cfg->page_tokens);
    return DETATTN_INVALID_ARGUMENT;
  }
  if (cfg->n_pages < 1 || cfg->acc_slots < 0) {
    snprintf(err, errlen, "cuda: n_pages must be >= 1 and acc_slots >= 0 (got %d, %d)",
             cfg->n_pages, cfg->acc_slots);
    return DETATTN_INVALID_ARGUMENT;
  }
  return 0;
}

static struct flight *flights_alloc(void);

/*
 * THE default prefill kernel: what blocks of more than 16 rows run on when DA_CUDA_PREFILL is
 * not set, per head_dim: DA_CU_SM90_* (prefill_sm90.cu) or 0 (attn.cu). Only where the wgmma
 * kernel can run at all (an sm_90a build, an sm_90 device, head_dim 64 or 128); elsewhere
 * attn.cu. Every choice gives the same bits (tests/cuda/test_wgmma.c); this is a speed choice,
 * from tests/cuda/run_wgmma.sh's table.
 * H100, v3.1 (NOTES.md): at head_dim 128 ping-pong beat pipelined by 8-14 % on B 8 L 4k
 * (its warpgroups alternate, so one's split-end finalize can run under the other's MMAs) and
 * lost 1-3 % on B 2 L 16k; at 64 pipelined was 1.5-2.5 % faster. Re-measured on v3.4 (three
 * warpgroups at 64; NOTES.md v3.5): 64 pipelined 5 % faster at S 512 and 2048; 128 ping-pong
 * 10-17 % faster on B 8 L 4k, pipelined 1-7 % faster only on the longest rows at S 2048.
 * T 128 (H200, NOTES.md v5.6, B 8 L 4k): at head_dim 64 (two warpgroups) ping-pong 1.64 ms,
 * serial 1.78, pipelined 1.84; at 128 only the serial form fits the registers (2.63 ms; the
 * pipelined forms spill: 2.97-3.02).
 */
#define DA_CUDA_PREFILL_DEFAULT(head_dim, tile)                                                  \
  ((tile) == 128 ? ((head_dim) == 64 ? DA_CU_SM90_PINGPONG : (head_dim) == 128 ? DA_CU_SM90_SERIAL : 0) \
   : (head_dim) == 64  ? DA_CU_SM90_PIPELINED                                                      \
   : (head_dim) == 128 ? DA_CU_SM90_PINGPONG                                                       \
                       : 0)

/* A path switch (tests and benchmarks): the value of environment variable var among its
 * choices, dflt when unset or empty; anything else fails with the choices in the message. */
typedef struct {
  const char *name;
  int value;
} env_choice;

static int env_pick(const char *var, const env_choice *ch, size_t n, int dflt, int *out, char *err, size_t errlen) {
  const char *env = getenv(var);
  *out = dflt;
  if (env == NULL || env[0] == '\0') return 0;
  for (size_t i = 0; i < n; i++) {
    if (strcmp(env, ch[i].name) == 0) {
      *out = ch[i].value;
      return 0;
    }
  }
  int k = snprintf(err, errlen, "cuda: %s=%s: expected", var, env);
  for (size_t i = 0; i < n && k > 0 && (size_t)k < errlen; i++)
    k += snprintf(err + k, errlen - (size_t)k, "%s %s", i == 0 ? "" : i + 1 == n ? " or" : ",", ch[i].name);
  return DETATTN_INVALID_ARGUMENT;
}

/* DA_CUDA_PREFILL: mma (attn.cu), wgmma (the head_dim's default wgmma variant, pipelined
 * where the default is mma), wgmma-serial, wgmma-pipelined, wgmma-pingpong. */
static int prefill_path(int head_dim, int tile, int *path, char *err, size_t errlen) {
  enum { WGMMA_DEFAULT = -1 };
  static const env_choice names[] = {{"mma", 0},
                                     {"wgmma", WGMMA_DEFAULT},
                                     {"wgmma-serial", DA_CU_SM90_SERIAL},
                                     {"wgmma-pipelined", DA_CU_SM90_PIPELINED},
                                     {"wgmma-pingpong", DA_CU_SM90_PINGPONG}};
  const int dflt = DA_CUDA_PREFILL_DEFAULT(head_dim, tile);
  const int rv = env_pick("DA_CUDA_PREFILL", names, sizeof(names) / sizeof(names[0]), dflt, path, err, errlen);
  if (*path == WGMMA_DEFAULT) *path = dflt != 0 ? dflt : DA_CU_SM90_PIPELINED;
  return rv;
}

/* DA_CUDA_SM90_DECODE, where decode-only batches run on sm_90: 0 attn.cu, 1 prefill_sm90.cu's
 * one ring, pipes (the default), pipes-serial (pipes in the serial form), pipes-inrow (pipes
 * only where no row is split over partial items, the rule before v5.10). */
enum { DEC_ATTN, DEC_RING, DEC_PIPES, DEC_PIPES_SERIAL, DEC_PIPES_INROW };
static int decode_path(int *dec, char *err, size_t errlen) {
  static const env_choice names[] = {{"0", DEC_ATTN},
                                     {"1", DEC_RING},
                                     {"pipes", DEC_PIPES},
                                     {"pipes-serial", DEC_PIPES_SERIAL},
                                     {"pipes-inrow", DEC_PIPES_INROW}};
  return env_pick("DA_CUDA_SM90_DECODE", names, sizeof(names) / sizeof(names[0]), DEC_PIPES, dec, err, errlen);
}

/* DA_CUDA_SM90_DEAL, how prefill_sm90.cu's persistent grid gets its items: round-robin
 * (positions dealt by the planner, da_cu_deal), tickets (each pipe takes the list's next
 * item when it is free, the list in build order), or tickets-inrow (tickets for batches
 * without partial rows, round-robin for the rest). The bits never depend on it. */
enum { DEAL_ROUND_ROBIN, DEAL_TICKETS_INROW, DEAL_TICKETS };
static int deal_env(int *deal, char *err, size_t errlen) {
  static const env_choice names[] = {
      {"round-robin", DEAL_ROUND_ROBIN}, {"tickets-inrow", DEAL_TICKETS_INROW}, {"tickets", DEAL_TICKETS}};
  return env_pick("DA_CUDA_SM90_DEAL", names, sizeof(names) / sizeof(names[0]), DEAL_TICKETS, deal, err, errlen);
}

/* DA_CUDA_L2_PROMO, the L2 promotion of prefill_sm90.cu's K/V tensor map: none or 256 (bytes).
 * A box row is one 128-byte line of a 256-byte K or V row, so 256 fetches the row's other
 * half with it. Same-run A/Bs (NOTES.md v5.14): on an H100 (HBM3, 80 GB) 256 is 1.7-3 %
 * faster at decode B >= 8 and B 1 L 64k, on an H200 (HBM3e, 141 GB) none is 2.1-2.7 % faster
 * there; prefill is the same either way on both. Default by card: none where the device has
 * more than 100 GiB (Hopper's HBM3e parts), else 256. The bits never depend on it. */
static int l2_promo_env(const struct cudaDeviceProp *prop, int *promo, char *err, size_t errlen) {
  static const env_choice names[] = {{"none", 0}, {"256", 256}};
  const int dflt = prop->totalGlobalMem > ((size_t)100 << 30) ? 0 : 256;
  return env_pick("DA_CUDA_L2_PROMO", names, sizeof(names) / sizeof(names[0]), dflt, promo, err, errlen);
}

/* DA_CUDA_KV_STREAM (experiments): auto (default) streams K/V (args.kv_stream: decode loads
 * evict_first, the combine drops its partials' lines) in launches whose K/V exceed the L2;
 * 0 never. The bits never depend on it. */
static int kv_stream_env(int *ok, char *err, size_t errlen) {
  static const env_choice names[] = {{"auto", 1}, {"0", 0}};
  return env_pick("DA_CUDA_KV_STREAM", names, sizeof(names) / sizeof(names[0]), 1, ok, err, errlen);
}

/* An on/off setting var: "1" or "0"; dflt when unset or empty. */
static int switch_env(const char *var, int dflt, int *on, char *err, size_t errlen) {
  static const env_choice names[] = {{"0", 0}, {"1", 1}};
  return env_pick(var, names, sizeof(names) / sizeof(names[0]), dflt, on, err, errlen);
}

/* DA_CUDA_SM90_QTMA, how prefill_sm90.cu's consumers get Q at head_dim 128 (prefill launches,
 * one ring): 1, by TMA from the producer warp an item ahead into a second Q buffer (the
 * default; NOTES.md v5.17: B 8 L 4k 2.2-3.3 % faster on an H200), or 0, loaded and stored by
 * the consumers at the item's start. The bits never depend on it. */
static int q_tma_env(int *on, char *err, size_t errlen) {
  return switch_env("DA_CUDA_SM90_QTMA", 1, on, err, errlen);
}

/* DA_CUDA_PREFIX: 1 (the default), a partial block's first item is a prefix item (item.h):
 * it folds its splits in registers as an in-row item does and leaves one fold for the combine
 * to go on from, instead of a partial a split; 0, every partial item writes its splits. The
 * bits never depend on it. */
static int prefix_env(int *on, char *err, size_t errlen) {
  return switch_env("DA_CUDA_PREFIX", 1, on, err, errlen);
}

/* An integer setting var in [lo, hi]; unset or empty: unset. what names it in the error. */
static int int_env(const char *var, int lo, int hi, int unset, const char *what, int *out, char *err,
                   size_t errlen) {
  const char *env = getenv(var);
  *out = unset;
  if (env == NULL || env[0] == '\0') return 0;
  char *end = NULL;
  const long v = strtol(env, &end, 10);
  if (*end != '\0' || v < lo || v > hi) {
    snprintf(err, errlen, "cuda: %s=%s: expected %s, %d to %d", var, env, what, lo, hi);
    return DETATTN_INVALID_ARGUMENT;
  }
  *out = (int)v;
  return 0;
}

/* DA_CUDA_PREFIX_TAIL and DA_CUDA_PER_TAIL: unset or empty, the planner's rule (-1:
 * da_cu_tail_splits); 0, never; k (1 to 64, experiments), the last k splits of every block
 * that can run so. The bits never depend on them. */
static int tail_env(const char *var, int *tail, char *err, size_t errlen) {
  const char *env = getenv(var);
  if (env != NULL && strcmp(env, "0") == 0) {
    *tail = 0;
    return 0;
  }
  return int_env(var, 1, 64, -1, "tail splits (0 none)", tail, err, errlen);
}

/* DA_CUDA_COMBINE_SHORT: launches whose partial rows have at most k splits (0 to 4096; 0 never)
 * are combined a warp a row (combine.cu's short form) instead of a CTA a row; unset or empty,
 * DEFAULT_COMBINE_SHORT. The bits never depend on it. */
static int combine_short_env(int *k, char *err, size_t errlen) {
  return int_env("DA_CUDA_COMBINE_SHORT", 0, 4096, DEFAULT_COMBINE_SHORT,
                 "the most splits of a row combined a warp a row", k, err, errlen);
}

/* DA_CUDA_PARTIAL_PER (experiments): splits per partial work item, 1 to 64; unset or empty:
 * 0, the planner's choice. The bits never depend on it. */
static int partial_per_env(int *per, char *err, size_t errlen) {
  return int_env("DA_CUDA_PARTIAL_PER", 1, 64, 0, "splits per partial work item", per, err, errlen);
}

/* DA_CUDA_TIMING: 1, the phases of every batch timed (timing_report); unset, empty or 0: off. */
static int timing_env(int *on, char *err, size_t errlen) {
  return switch_env("DA_CUDA_TIMING", 0, on, err, errlen);
}

static int create(void **out, const da_backend_cfg *cfg, da_backend_info *info, char *err,
                  size_t errlen) {
  int rv = check_cfg(cfg, err, errlen);
  if (rv != 0) return rv;
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || cfg->device < 0 || cfg->device >= ndev) {
    (void)cudaGetLastError();
    snprintf(err, errlen, "cuda: device %d not present (%d devices)", cfg->device, ndev);
    return DETATTN_UNAVAILABLE;
  }
  cuda_ctx *c = calloc(1, sizeof(*c));
  if (c == NULL) {
    snprintf(err, errlen, "cuda: out of host memory");
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  c->cfg = *cfg;
  c->fl = flights_alloc();
  if (c->fl == NULL) {
    free(c);
    snprintf(err, errlen, "cuda: out of host memory");
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  struct cudaDeviceProp prop;
  CUDA_GOTO(NULL, cudaSetDevice(cfg->device), fail);
  CUDA_GOTO(NULL, cudaGetDeviceProperties(&prop, cfg->device), fail);
  if (!arch_ok(prop.major, prop.minor)) {
    snprintf(err, errlen, "cuda: built for %s, device %d is sm_%d%d",
#ifdef DA_CUDA_SM80
             "sm_80 and sm_90",
#else
             "sm_90",
#endif
             cfg->device, prop.major, prop.minor);
    rv = DETATTN_UNAVAILABLE;
    goto fail;
  }
  if (prop.major == 8 && cfg->model.head_dim > 128) {
    snprintf(err, errlen, "cuda: head_dim %d needs more shared memory per block than sm_80 has (head_dim <= 128)",
             cfg->model.head_dim);
    rv = DETATTN_UNAVAILABLE;
    goto fail;
  }
  snprintf(c->arch, sizeof(c->arch), "sm_%d%d", prop.major, prop.minor);
  c->n_sm = prop.multiProcessorCount;
  c->l2_bytes = prop.l2CacheSize;

  const da_model *m = &cfg->model;
  {
    int path = 0, dec = 0;
    rv = prefill_path(m->head_dim, cfg->num.tile_tokens, &path, err, errlen);
    if (rv == 0) rv = decode_path(&dec, err, errlen);
    if (rv == 0) rv = partial_per_env(&c->partial_per, err, errlen);
    if (rv == 0) rv = deal_env(&c->deal, err, errlen);
    if (rv == 0) rv = l2_promo_env(&prop, &c->l2_promo, err, errlen);
    if (rv == 0) rv = q_tma_env(&c->q_tma, err, errlen);
    if (rv == 0) rv = prefix_env(&c->prefix, err, errlen);
    if (rv == 0) rv = tail_env("DA_CUDA_PREFIX_TAIL", &c->prefix_tail, err, errlen);
    if (rv == 0) rv = tail_env("DA_CUDA_PER_TAIL", &c->per_tail, err, errlen);
    if (rv == 0) rv = combine_short_env(&c->combine_short, err, errlen);
    if (rv == 0) rv = kv_stream_env(&c->kv_stream_ok, err, errlen);
    int tm_on = 0;
    if (rv == 0) rv = timing_env(&tm_on, err, errlen);
    if (rv != 0) goto fail;
    if (tm_on && (c->tm = calloc(1, sizeof(*c->tm))) == NULL) {
      snprintf(err, errlen, "cuda: out of host memory");
      rv = DETATTN_RESOURCE_EXHAUSTED;
      goto fail;
    }
#ifdef DA_CUDA_HAVE_SM90A
    if (prop.major == 9 && DA_CU_SM90_HEAD_DIM_OK(m->head_dim)) c->sm90_prefill = path;
    const char *grid = getenv("DA_CUDA_SM90_GRID");
    if (grid != NULL && strcmp(grid, "items") == 0) c->sm90_grid = -1;
    else if (grid != NULL && atoi(grid) > 0) c->sm90_grid = atoi(grid);
    /* Decode blocks too: TMA-fed and persistent, 0-22 % faster than attn.cu's split form on
     * an H100 (NOTES.md v3.4), same bits. DA_CUDA_SM90_DECODE=0: attn.cu (tests, A/B). */
    c->sm90_decode = c->sm90_prefill && dec != DEC_ATTN;
    /* Decode-only batches as pipes (prefill_sm90.cu): two warpgroups' latency chains per SM
     * instead of one (NOTES.md v5.3). DA_CUDA_SM90_DECODE=1: one shared pipeline (A/B). */
    if (c->sm90_decode && dec != DEC_RING)
      c->sm90_pipes = DA_CU_SM90_PIPES | (dec == DEC_PIPES_SERIAL || path == DA_CU_SM90_SERIAL ? DA_CU_SM90_SERIAL
                                                                                               : DA_CU_SM90_PIPELINED);
    c->pipes_partial = dec != DEC_PIPES_INROW;
#else
    (void)path, (void)dec;
#endif
  }
  c->brows = c->sm90_prefill ? DA_CU_SM90_BLOCK_ROWS(m->head_dim, cfg->num.tile_tokens) : DA_CU_BLOCK_ROWS;
  c->page_bytes = (int64_t)m->n_layers * 2 * m->n_kv_heads * cfg->page_tokens * m->head_dim * 2;
  c->kv_bytes = (size_t)c->page_bytes * (size_t)cfg->n_pages;
  int slots = cfg->acc_slots > 0 ? cfg->acc_slots : DEFAULT_ACC_SLOTS;
  c->acc_bytes = (size_t)slots * (size_t)(m->head_dim + 1) * 4;
  /* Per token: q in and o out (worst case), k and v in, page ids, lse. */
  size_t per_tok = (size_t)m->n_q_heads * m->head_dim * 2 + 2 * (size_t)m->n_kv_heads * m->head_dim * 2 + 64;
  c->stage_bytes = cfg->staging_bytes;
  if (c->stage_bytes == 0) {
    /* Derived: input and output halves for the daemon's batch budget. */
    c->stage_bytes = DEFAULT_STAGING;
    if (cfg->max_batch_tokens > 0 && 2 * per_tok * (size_t)cfg->max_batch_tokens > c->stage_bytes)
      c->stage_bytes = 2 * per_tok * (size_t)cfg->max_batch_tokens;
  }
  c->stage_bytes = (c->stage_bytes + ALIGN - 1) / ALIGN * ALIGN;
  {
    /* Refuse up front, with the numbers, what cudaMalloc would refuse piecemeal. */
    size_t mfree = 0, mtotal = 0;
    CUDA_GOTO(NULL, cudaMemGetInfo(&mfree, &mtotal), fail);
    const size_t reserve = (size_t)256 << 20; /* kernels, streams, the context's own needs */
    const size_t rest = c->acc_bytes + 4 * c->stage_bytes + reserve;
    if (c->kv_bytes + rest > mfree) {
      long long fit = mfree > rest ? (long long)((mfree - rest) / (size_t)c->page_bytes) : 0;
      snprintf(err, errlen,
               "cuda: device %d has %zu MiB free; the pools need %zu MiB (KV %zu MiB for %d pages, accumulators "
               "%zu MiB, staging 4 x %zu MiB) + %zu MiB reserve: at most %lld pages (%lld tokens) of KV fit",
               cfg->device, mfree >> 20, (c->kv_bytes + c->acc_bytes + 4 * c->stage_bytes) >> 20, c->kv_bytes >> 20,
               cfg->n_pages, c->acc_bytes >> 20, c->stage_bytes >> 20, reserve >> 20, fit,
               fit * (long long)cfg->page_tokens);
      rv = DETATTN_RESOURCE_EXHAUSTED;
      goto fail;
    }
  }

  CUDA_GOTO(NULL, cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), fail);
  CUDA_GOTO(NULL, cudaStreamCreateWithFlags(&c->copy, cudaStreamNonBlocking), fail);
  for (int i = 0; i < 3; i++) CUDA_GOTO(NULL, cudaEventCreate(&c->ev[i]), fail);
  for (int i = 0; i < 2; i++) {
    CUDA_GOTO(NULL, cudaEventCreateWithFlags(&c->ev_in[i], cudaEventDisableTiming), fail);
    CUDA_GOTO(NULL, cudaEventCreateWithFlags(&c->ev_done[i], cudaEventDisableTiming), fail);
  }
  for (int i = 0; i < 2 && c->tm != NULL; i++)
    for (int j = 0; j <= TM_GPU; j++) CUDA_GOTO(NULL, cudaEventCreate(&c->tm->ev[i][j]), fail);
  CUDA_GOTO(NULL, cudaMalloc(&c->kv, c->kv_bytes), fail);
  CUDA_GOTO(NULL, cudaMalloc((void **)&c->acc_o, (size_t)slots * m->head_dim * 4), fail);
  CUDA_GOTO(NULL, cudaMalloc((void **)&c->acc_lse, (size_t)slots * 4), fail);
  CUDA_GOTO(NULL, cudaMalloc((void **)&c->ticket, 2 * sizeof(int)), fail);
  CUDA_GOTO(NULL, cudaMemsetAsync(c->ticket, 0, 2 * sizeof(int), c->stream), fail);
  for (int i = 0; i < 2; i++) {
    CUDA_GOTO(NULL, cudaMalloc((void **)&c->d_in[i], c->stage_bytes), fail);
    CUDA_GOTO(NULL, cudaMalloc((void **)&c->d_out[i], c->stage_bytes), fail);
    CUDA_GOTO(NULL, cudaHostAlloc((void **)&c->h_in[i], c->stage_bytes, cudaHostAllocDefault), fail);
    CUDA_GOTO(NULL, cudaHostAlloc((void **)&c->h_out[i], c->stage_bytes, cudaHostAllocDefault), fail);
  }
  if (cfg->poison) {
    CUDA_GOTO(NULL, da_cuda_fill(c->kv, c->kv_bytes / 4, 0, 0, 0, c->stream), fail);
    CUDA_GOTO(NULL, da_cuda_fill(c->acc_o, (size_t)slots * m->head_dim, 0, 0, 0, c->stream), fail);
    CUDA_GOTO(NULL, da_cuda_fill(c->acc_lse, (size_t)slots, 0, 0, 0, c->stream), fail);
    for (int i = 0; i < 2; i++) {
      CUDA_GOTO(NULL, da_cuda_fill(c->d_in[i], c->stage_bytes / 4, 0, 0, 0, c->stream), fail);
      CUDA_GOTO(NULL, da_cuda_fill(c->d_out[i], c->stage_bytes / 4, 0, 0, 0, c->stream), fail);
    }
  }
  CUDA_GOTO(NULL, cudaStreamSynchronize(c->stream), fail);

  memset(info, 0, sizeof(*info));
  snprintf(info->name, sizeof(info->name), "cuda");
  snprintf(info->arch, sizeof(info->arch), "%s", c->arch);
  info->kernel_version = KERNEL_VERSION;
  info->fingerprint = da_fingerprint("cuda", KERNEL_VERSION, c->arch, m, &cfg->num);
  info->n_pages = cfg->n_pages;
  info->acc_slots = slots;
  info->kv_bytes = c->kv_bytes;
  info->acc_bytes = c->acc_bytes;
  info->staging_bytes = 4 * c->stage_bytes;
  info->max_batch_tokens = (int)((c->stage_bytes / 2) / per_tok);
  if (cudaMemGetInfo(&info->mem_free, &info->mem_total) != cudaSuccess) {
    (void)cudaGetLastError();
    info->mem_free = info->mem_total = 0;
  }
  c->args.n_layers = m->n_layers;
  *out = c;
  return 0;

fail:
  free_all(c);
  return rv;
}

static void flights_free(cuda_ctx *c);

static void destroy(void *ctx) {
  if (ctx == NULL) return;
  cuda_ctx *c = ctx;
  cudaSetDevice(c->cfg.device);
  cudaStreamSynchronize(c->copy);
  cudaStreamSynchronize(c->stream);
  flights_free(c);
  free_all(c);
}

/* ---- batch validation ---------------------------------------------------------------- */

/* Checks that the table holds the pages of tokens [first_tok, end_tok) and, with ids, that
 * those pages' ids lie in the pool. An attention's ids are checked as pack() copies them
 * instead (copy_ids), in one pass over them rather than two. */
static int check_pages(const cuda_ctx *c, const int32_t *pages, int n_pages, int64_t first_tok,
                       int64_t end_tok, int ids, const char *what, int idx, char *err, size_t errlen) {
  if (end_tok <= first_tok) return 0;
  const int P = c->cfg.page_tokens;
  const int64_t need = (end_tok + P - 1) / P;
  if (pages == NULL || n_pages < need) {
    snprintf(err, errlen, "%s %d: page table has %d pages, needs %lld", what, idx, n_pages,
             (long long)need);
    return DETATTN_INVALID_ARGUMENT;
  }
  for (int64_t i = first_tok / P; ids && i < need; i++) {
    if (pages[i] < 0 || pages[i] >= c->cfg.n_pages) {
      snprintf(err, errlen, "%s %d: page id %d at index %lld outside the pool [0, %d)", what, idx,
               pages[i], (long long)i, c->cfg.n_pages);
      return DETATTN_INVALID_ARGUMENT;
    }
  }
  return 0;
}

/* The first key attention a's rows see: its first row's window start. */
static int64_t attn_w0(const da_model *m, const da_attn *a) {
  const int64_t w0 = m->window > 0 ? (int64_t)a->q_pos - m->window + 1 : 0;
  return w0 > 0 ? w0 : 0;
}

static int validate(const cuda_ctx *c, const da_batch *b, int bench, char *err, size_t errlen) {
  const da_model *m = &c->cfg.model;
  if (b->n_copies < 0 || b->n_appends < 0 || b->n_attns < 0 ||
      (b->n_copies > 0 && b->copies == NULL) || (b->n_appends > 0 && b->appends == NULL) ||
      (b->n_attns > 0 && b->attns == NULL)) {
    snprintf(err, errlen, "batch: negative count or NULL array");
    return DETATTN_INVALID_ARGUMENT;
  }
  if (b->split_mode < DA_SPLIT_AUTO || b->split_mode > DA_SPLIT_PARTIAL) {
    snprintf(err, errlen, "batch: unknown split mode %d", (int)b->split_mode);
    return DETATTN_INVALID_ARGUMENT;
  }
  for (int i = 0; i < b->n_copies; i++) {
    const da_page_copy *pc = &b->copies[i];
    if (pc->src < 0 || pc->src >= c->cfg.n_pages || pc->dst < 0 || pc->dst >= c->cfg.n_pages ||
        pc->src == pc->dst) {
      snprintf(err, errlen, "copy %d: pages %d -> %d invalid (pool has %d)", i, pc->src, pc->dst,
               c->cfg.n_pages);
      return DETATTN_INVALID_ARGUMENT;
    }
  }
  for (int i = 0; i < b->n_appends; i++) {
    const da_append *a = &b->appends[i];
    if (a->layer < 0 || a->layer >= m->n_layers || a->pos < 0 || a->n_tokens < 0 ||
        (int64_t)a->pos + a->n_tokens > INT32_MAX / 2 ||
        (a->n_tokens > 0 && (a->k == NULL || a->v == NULL))) {
      snprintf(err, errlen, "append %d: bad layer %d, pos %d, n_tokens %d or NULL k/v", i, a->layer,
               a->pos, a->n_tokens);
      return DETATTN_INVALID_ARGUMENT;
    }
    int rv = check_pages(c, a->pages, a->n_pages, a->pos, (int64_t)a->pos + a->n_tokens, 1, "append",
                         i, err, errlen);
    if (rv != 0) return rv;
  }
  for (int i = 0; i < b->n_attns; i++) {
    const da_attn *a = &b->attns[i];
    if (a->layer < 0 || a->layer >= m->n_layers || a->q_pos < 0 || a->n_q < 0 ||
        (int64_t)a->q_pos + a->n_q > INT32_MAX / 2 ||
        (a->n_q > 0 && ((a->q == NULL && !bench) || (a->o == NULL && !bench)))) {
      snprintf(err, errlen, "attn %d: bad layer %d, q_pos %d, n_q %d or NULL q/o", i, a->layer,
               a->q_pos, a->n_q);
      return DETATTN_INVALID_ARGUMENT;
    }
    int rv = check_pages(c, a->pages, a->n_pages, attn_w0(m, a), (int64_t)a->q_pos + a->n_q, 0, "attn", i, err,
                         errlen);
    if (rv != 0) return rv;
  }
  return 0;
}

/* ---- work list ----------------------------------------------------------------------- */

/* Whether the append kernel reads append a's K and V where the client put them (device
 * addresses, 16-byte aligned for its loads), not from the staging buffer. */
static int direct_kv(const da_append *a) { return a->dev && (((uintptr_t)a->k | (uintptr_t)a->v) & 15) == 0; }

/* Whether the kernels write attention a's o and lse where the client wants them (device
 * addresses, 16-byte aligned), not to the output staging buffer for a scatter after. */
static int direct_o(const da_attn *a) { return a->dev && (((uintptr_t)a->o | (uintptr_t)a->lse) & 15) == 0; }

typedef struct plan {
  int64_t n_items, n_citems, n_pt, n_q_el, n_kv_el, n_o_el, n_lse, slots;
  int max_append_tokens;
  int per; /* splits per partial item */
  int per_tail; /* the DA_CU_PART_PER tail setting of this launch (da_cu_per_tail; 0 where it takes none) */
  int tickets; /* prefill_sm90.cu's grid takes the items by ticket (else round-robin) */
  int max_splits; /* the most splits of a partial attention's rows */
  int pipes; /* prefill_sm90.cu pipes per CTA (DA_CU_SM90_N_PIPES for decode-only batches, else 1) */
  int64_t inrow_rows, partial_rows;
  int64_t kv_tokens; /* keys the launch reads, a kv head's (args.kv_stream) */
  int64_t n_gseg, n_sseg;   /* device-address tensors: segments gathered in, scattered out */
  int64_t n_kv_gseg;        /* of the gathered, an append's K or V (not 16-byte aligned, so not
                               read in place by the append kernel: direct_kv) */
  int64_t gseg_max, sseg_max; /* their largest segment, bytes */
  int host_in, host_out;    /* some inputs come from / outputs go to host memory (copied with the
                               staging buffers; device-address tensors need only the metadata) */
  unsigned char *partial; /* per attn: how it runs, DA_CU_INROW, _PART_PER or _PART_TAIL (items.h) */
  size_t off_attn, off_item, off_citem, off_app, off_copy, off_pt, off_gseg, off_sseg, off_q, off_kvin, in_bytes;
  size_t off_o, off_lse, out_bytes;
} plan;

static size_t up(size_t x) { return (x + ALIGN - 1) / ALIGN * ALIGN; }

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Whether block r0 of a (splits from j0) has a prefix item (items.h). */
static int prefix_block(const cuda_ctx *c, int S, const da_attn *a, int64_t r0, int j0) {
  return c->prefix && da_cu_prefix_rows(&c->cfg.model, c->brows, S, a, r0, j0);
}

static void plan_batch(const cuda_ctx *c, const da_batch *b, int S, plan *pl) {
  const da_model *m = &c->cfg.model;
  const int G = m->n_q_heads / m->n_kv_heads, P = c->cfg.page_tokens;
  int64_t inrow_ctas = 0;
  for (int i = 0; i < b->n_attns; i++)
    inrow_ctas += ceil_div((int64_t)b->attns[i].n_q * G, c->brows) * m->n_kv_heads;
  int64_t slots_free = c->acc_bytes / ((size_t)(m->head_dim + 1) * 4);
  int64_t max_block_rows = 0; /* the most rows of an attention's block, n_q G */
  for (int i = 0; i < b->n_attns; i++)
    if ((int64_t)b->attns[i].n_q * G > max_block_rows) max_block_rows = (int64_t)b->attns[i].n_q * G;
  /* DA_CU_PART_TAIL: decode-only launches on prefill_sm90.cu with prefix items */
  const int tail_ok = c->prefix && c->prefix_tail != 0 && c->sm90_decode && max_block_rows <= 16;
  int64_t n_tail = 0; /* items of DA_CU_PART_TAIL attentions */

  for (int i = 0; i < b->n_attns; i++) {
    const da_attn *a = &b->attns[i];
    const int64_t end = (int64_t)a->q_pos + a->n_q;
    const int64_t nsp = ceil_div(end, S);
    const int64_t w0 = attn_w0(m, a);
    if (a->n_q > 0) pl->kv_tokens += end - w0;
    const int multi = a->n_q > 0 && (end - 1) / S > w0 / S;
    const int64_t need = (int64_t)a->n_q * m->n_q_heads * nsp;
    /* as DA_CU_PART_TAIL: its one block (n_q G <= 16), from w0's split, and its tail */
    const int tail =
        tail_ok && prefix_block(c, S, a, 0, (int)(w0 / S)) ? da_cu_tail_splits(c->prefix_tail, nsp - w0 / S) : 0;
    const int part =
        multi && need <= slots_free ? da_cu_attn_kind(b->split_mode, inrow_ctas, c->n_sm, c->sm90_decode, tail) : 0;
    pl->partial[i] = (unsigned char)part;
    if (part) slots_free -= need, pl->slots += need;
    const int64_t merged = part == DA_CU_PART_TAIL ? tail + 1 : nsp; /* the most splits a combine row merges */
    if (part && merged > pl->max_splits) pl->max_splits = (int)merged;
    if (part == DA_CU_PART_TAIL) n_tail += (int64_t)m->n_kv_heads * (1 + tail); /* one block: n_q G <= 16 */
    const int64_t rows = (int64_t)a->n_q * m->n_q_heads;
    if (part) pl->partial_rows += rows;
    else pl->inrow_rows += rows;
    if (!part) pl->n_items += ceil_div((int64_t)a->n_q * G, c->brows) * m->n_kv_heads;
    if (part) pl->n_citems += ceil_div(rows, DA_CU_COMBINE_ROWS);
    if (a->n_q > 0) pl->n_pt += ceil_div(end, P) - w0 / P; /* the window's pages: pack() */
    pl->n_q_el += rows * m->head_dim;
    const int staged_o = !direct_o(a);
    if (staged_o) pl->n_o_el += rows * m->head_dim;
    if (staged_o && a->lse != NULL) pl->n_lse += rows;
    if (a->dev && rows > 0) {
      const int64_t qb = rows * m->head_dim * 2;
      pl->n_gseg += 1;
      if (qb > pl->gseg_max) pl->gseg_max = qb;
      if (staged_o) pl->n_sseg += 1 + (a->lse != NULL);
      if (staged_o && qb > pl->sseg_max) pl->sseg_max = qb;
    } else if (rows > 0) {
      pl->host_in = pl->host_out = 1;
    }
  }
  /* Decode rows only (every block of at most 16 rows): the launch runs as pipes
   * (prefill_sm90.cu). Same-run A/Bs (NOTES.md v5.3): B 32 1-3 % faster on an H200 and 0-1.4 %
   * on an H100, B 64-128 0-2 %. Batches with partial rows were 0.5-1 % slower as pipes then
   * and kept one ring; with items by ticket (v5.9) they gain (NOTES.md v5.10). */
  pl->pipes = c->sm90_pipes && (pl->partial_rows == 0 || c->pipes_partial) && max_block_rows <= 16
                  ? DA_CU_SM90_N_PIPES
                  : 1;
  /* A partial CTA takes `per` consecutive splits of its block, each finalized and written
   * on its own (the bits do not depend on per). A wave is the persistent grid's CTAs where
   * prefill_sm90.cu runs every item (sm90_decode: one CTA per SM, items round-robin), else
   * two resident CTAs per SM (attn.cu). */
  const int64_t grid = c->sm90_grid > 0 ? c->sm90_grid : c->n_sm;
  const int64_t slots = c->sm90_decode ? grid * pl->pipes : 2 * (int64_t)c->n_sm;
  /* prefill_sm90.cu's persistent grid (not one CTA per item) by ticket or round-robin. */
  pl->tickets = c->sm90_prefill && c->sm90_grid >= 0 &&
                (c->deal == DEAL_TICKETS || (c->deal == DEAL_TICKETS_INROW && pl->partial_rows == 0));
  const int T = c->cfg.num.tile_tokens;
  int64_t n_part = 0;
  pl->per = da_cu_partial_per(m, c->brows, S, T, b, pl->partial, 0, slots, &n_part);
  /* One-split tails of partial blocks: where tickets hand them to the pipes free first; the
   * per then chosen again on the splits the tails leave */
  pl->per_tail = pl->tickets && c->sm90_decode && max_block_rows <= 16 ? da_cu_per_tail(c->per_tail, pl->per) : 0;
  if (pl->per_tail != 0) pl->per = da_cu_partial_per(m, c->brows, S, T, b, pl->partial, pl->per_tail, slots, &n_part);
  if (c->partial_per > 0 && n_part > 0) {
    pl->per = c->partial_per;
    n_part = da_cu_partial_items(m, c->brows, S, b, pl->partial, pl->per, pl->per_tail, NULL);
  }
  pl->n_items += n_part + n_tail;
  for (int i = 0; i < b->n_appends; i++) {
    const da_append *a = &b->appends[i];
    if (a->n_tokens > 0) pl->n_pt += ceil_div((int64_t)a->pos + a->n_tokens, P) - a->pos / P;
    if (!direct_kv(a)) pl->n_kv_el += 2 * (int64_t)a->n_tokens * m->n_kv_heads * m->head_dim;
    if (a->n_tokens > pl->max_append_tokens) pl->max_append_tokens = a->n_tokens;
    if (!a->dev && a->n_tokens > 0) pl->host_in = 1;
    if (a->dev && !direct_kv(a) && a->n_tokens > 0) {
      pl->n_gseg += 2, pl->n_kv_gseg += 2;
      if (a->n_tokens * (int64_t)m->n_kv_heads * m->head_dim * 2 > pl->gseg_max)
        pl->gseg_max = a->n_tokens * (int64_t)m->n_kv_heads * m->head_dim * 2;
    }
  }
  size_t o = 0;
  pl->off_attn = o, o = up(o + (size_t)b->n_attns * sizeof(da_cu_attn));
  pl->off_item = o, o = up(o + (size_t)pl->n_items * sizeof(da_cu_item));
  pl->off_citem = o, o = up(o + (size_t)pl->n_citems * sizeof(da_cu_citem));
  pl->off_app = o, o = up(o + (size_t)b->n_appends * sizeof(da_cu_append));
  pl->off_copy = o, o = up(o + (size_t)b->n_copies * 2 * sizeof(int32_t));
  pl->off_pt = o, o = up(o + (size_t)pl->n_pt * sizeof(int32_t));
  pl->off_gseg = o, o = up(o + (size_t)pl->n_gseg * sizeof(da_cu_seg));
  pl->off_sseg = o, o = up(o + (size_t)pl->n_sseg * sizeof(da_cu_seg));
  pl->off_q = o, o = up(o + (size_t)pl->n_q_el * 2);
  pl->off_kvin = o, o = up(o + (size_t)pl->n_kv_el * 2);
  pl->in_bytes = o;
  o = 0;
  pl->off_o = o, o = up(o + (size_t)pl->n_o_el * 2);
  pl->off_lse = o, o = up(o + (size_t)pl->n_lse * 4);
  pl->out_bytes = o;
}

/* Copies n page ids and says whether every one lies in the pool [0, pool): one pass with no
 * branch (it vectorizes). A decode step of B 32 at L 4k carries 8,192 ids; checking them in
 * validate() and copying them here, each in a loop with branches, took ~25 us of a layer
 * call's ~50 us submit on the GPU machine's host (NOTES v5.26). */
static int copy_ids(int32_t *restrict dst, const int32_t *restrict src, int64_t n, int32_t pool) {
  uint32_t bad = 0;
  for (int64_t k = 0; k < n; k++) {
    const int32_t v = src[k];
    bad |= (uint32_t)v >= (uint32_t)pool;
    dst[k] = v;
  }
  return bad == 0;
}

/* Packs the batch into the pinned buffer h (layout of pl; its device copy d, outputs dout)
 * and fills c->args. Queries of attns with q == NULL are left for the caller to fill on the
 * device. Returns 0, or 1 + the index of an attention whose page table has an id outside the
 * pool (nothing has been enqueued then; the caller reports it). */
static int64_t pack(cuda_ctx *c, const da_batch *b, int S, const plan *pl, unsigned char *h,
                    unsigned char *d, unsigned char *dout) {
  const da_model *m = &c->cfg.model;
  const int G = m->n_q_heads / m->n_kv_heads, P = c->cfg.page_tokens;
  da_cu_attn *ats = (da_cu_attn *)(h + pl->off_attn);
  da_cu_item *its = (da_cu_item *)(h + pl->off_item);
  da_cu_citem *cis = (da_cu_citem *)(h + pl->off_citem);
  da_cu_append *aps = (da_cu_append *)(h + pl->off_app);
  int32_t *cps = (int32_t *)(h + pl->off_copy);
  int32_t *pts = (int32_t *)(h + pl->off_pt);
  uint16_t *qs = (uint16_t *)(h + pl->off_q);
  uint16_t *kvs = (uint16_t *)(h + pl->off_kvin);
  da_cu_seg *gs = (da_cu_seg *)(h + pl->off_gseg), *ss = (da_cu_seg *)(h + pl->off_sseg);
  int64_t pt = 0, q = 0, o = 0, lse = 0, slot = 0, kvo = 0, n_it = 0, n_ci = 0, n_gs = 0, n_ss = 0;

  /* Items with blocks of more than 16 rows first (one launch), then those of at most 16
   * rows (decode; the second launch); in each, in-row items first: they are the long
   * ones, so they start in the first wave. An attention's blocks go last row first: with
   * causal masks those see the most keys, so the short ones fill the last wave. */
  /* Passes 0-2 (da_cu_block_items): in-row items, partial ones (a tail's prefix items), the
   * tails' one-split items after every prefix item. */
  int64_t n_split = 0;
  for (int small = 0; small < 2; small++) {
    for (int pass = 0; pass < 3; pass++) {
      for (int i = 0; i < b->n_attns; i++) {
        const da_attn *a = &b->attns[i];
        const int64_t n_rows = (int64_t)a->n_q * G;
        const int kind = pl->partial[i];
        if (!da_cu_pass_has(pass, kind)) continue;
        for (int64_t r0 = (ceil_div(n_rows, c->brows) - 1) * c->brows; r0 >= 0; r0 -= c->brows) {
          if ((n_rows - r0 <= 16) != small) continue;
          int j0, j1;
          da_cu_block_splits(&c->cfg.model, c->brows, S, a, r0, &j0, &j1);
          const int pfx = kind != DA_CU_INROW && prefix_block(c, S, a, r0, j0);
          const int tail = da_cu_block_tail(kind, c->prefix_tail, pl->per_tail, j1 - j0);
          for (int h2 = 0; h2 < m->n_kv_heads; h2++) {
            const int k = da_cu_block_items(pass, kind, pl->per, tail, pfx, (da_cu_item){i, h2, (int32_t)r0, 0, 0, 0},
                                            j0, j1, its + n_it);
            n_it += k;
            n_split += small ? k : 0;
          }
        }
      }
    }
  }
  /* Round-robin (DA_CUDA_SM90_DEAL): order the items so that each CTA of prefill_sm90.cu's
   * persistent grid gets an even share of key tiles (the order never changes a result;
   * without the scratch memory for it the items stay in the order above). By ticket they
   * stay in build order: long ones first, and the pipes running at once take neighbours. */
  if (c->sm90_prefill && c->sm90_grid >= 0 && !pl->tickets) {
    const int64_t n_l = c->sm90_decode ? n_it : n_it - n_split;
    const int64_t grid = (c->sm90_grid > 0 ? c->sm90_grid : c->n_sm) * pl->pipes;
    (void)da_cu_deal(m, c->brows, S, c->cfg.num.tile_tokens, b->attns, its, n_l, grid < n_l ? grid : n_l);
  }
  for (int i = 0; i < b->n_attns; i++) {
    const da_attn *a = &b->attns[i];
    const int64_t end = (int64_t)a->q_pos + a->n_q, rows = (int64_t)a->n_q * m->n_q_heads;
    da_cu_attn *at = &ats[i];
    memset(at, 0, sizeof(*at));
    at->layer = a->layer, at->q_pos = a->q_pos, at->n_q = a->n_q, at->n_pages = a->n_pages;
    at->n_splits = (int32_t)ceil_div(end, S);
    at->pt_off = pt;
    if (a->n_q > 0) {
      /* Only the pages of the window, [w0 page, end): the kernels read no id of a page before
       * it (a block's keys start at its first row's window, at or after the attention's w0;
       * prefill_sm90.cu's batch_id and attn.cu's page_of read only chunks that meet a block's
       * [w0_min, p_max]), so pt_off points pw entries before them, as an append's does (a
       * 4k window at L 64k packs 256 ids of 16-token pages instead of 4,096). */
      const int64_t np = ceil_div(end, P), pw = attn_w0(m, a) / P;
      if (!copy_ids(pts + pt, a->pages + pw, np - pw, c->cfg.n_pages)) return 1 + i;
      at->pt_off = pt - pw;
      pt += np - pw;
    }
    at->q_off = q;
    const int64_t qb = rows * m->head_dim * 2;
    if (a->dev && rows > 0) /* device addresses: the append's launch gathers q (append.cu) */
      gs[n_gs++] = (da_cu_seg){a->q, d + pl->off_q + (size_t)q * 2, qb};
    else if (a->q != NULL)
      memcpy(qs + q, a->q, (size_t)qb);
    q += rows * m->head_dim;
    if (direct_o(a)) {
      at->o = a->o, at->lse = a->lse;
    } else {
      at->o = dout + pl->off_o + (size_t)o * 2;
      at->lse = a->lse != NULL ? (float *)(dout + pl->off_lse) + lse : NULL;
      if (a->dev && rows > 0) { /* a kernel scatters them after (segcopy.cu) */
        ss[n_ss++] = (da_cu_seg){at->o, a->o, qb};
        if (a->lse != NULL) ss[n_ss++] = (da_cu_seg){at->lse, a->lse, rows * 4};
      }
      o += rows * m->head_dim;
      if (a->lse != NULL) lse += rows;
    }
    at->slot_base = pl->partial[i] ? slot : -1;
    if (pl->partial[i]) {
      slot += rows * at->n_splits;
      /* Combine row r = t n_q_heads + h (one a citem) is block row t G + g (g = h % G) of its
       * kv head; its prefix item's end jc is found once a block, and no row divides (B 64 L
       * 16k: 2,048 rows a decode step). */
      _Static_assert(DA_CU_COMBINE_ROWS == 1, "a combine item a row");
      int64_t r0_jc = -1, r = 0;
      int jc = 0;
      for (int64_t t = 0; t < a->n_q; t++) {
        const int64_t r0_t = t * G / c->brows * c->brows; /* the block of row t G */
        int64_t r0 = r0_t;                                /* the block of row t G + g */
        for (int h = 0, g = 0; h < m->n_q_heads; h++, r++) {
          if (r0 != r0_jc) {
            int j0, j1;
            da_cu_block_splits(m, c->brows, S, a, r0, &j0, &j1);
            jc = prefix_block(c, S, a, r0, j0) ? da_cu_first_end(pl->partial[i], pl->per,
                                                                 da_cu_block_tail(pl->partial[i], c->prefix_tail,
                                                                                  pl->per_tail, j1 - j0),
                                                                 j0, j1)
                                               : 0;
            r0_jc = r0;
          }
          cis[n_ci++] = (da_cu_citem){i, (int32_t)r, jc, 0};
          if (++g == G) g = 0, r0 = r0_t;
          else if (t * G + g == r0 + c->brows) r0 += c->brows;
        }
      }
    }
  }
  for (int i = 0; i < b->n_appends; i++) {
    const da_append *a = &b->appends[i];
    const int64_t el = (int64_t)a->n_tokens * m->n_kv_heads * m->head_dim;
    da_cu_append *ap = &aps[i];
    memset(ap, 0, sizeof(*ap));
    ap->layer = a->layer, ap->pos = a->pos, ap->n_tokens = a->n_tokens;
    ap->pt_off = pt;
    if (a->n_tokens > 0) {
      /* Only the pages the append writes, from the one holding pos: the kernel indexes the
       * table by pos / P from pt_off, which so points p0 entries before them (a decode step's
       * append packs one page id, not the sequence's whole table). validate() has checked
       * these ids against the pool. */
      const int64_t p0 = a->pos / P, np = ceil_div((int64_t)a->pos + a->n_tokens, P);
      memcpy(pts + pt, a->pages + p0, (size_t)(np - p0) * sizeof(*pts));
      ap->pt_off = pt - p0;
      pt += np - p0;
      if (direct_kv(a)) {
        ap->k = a->k, ap->v = a->v;
        continue;
      }
      if (a->dev) {
        gs[n_gs++] = (da_cu_seg){a->k, d + pl->off_kvin + (size_t)kvo * 2, el * 2};
        gs[n_gs++] = (da_cu_seg){a->v, d + pl->off_kvin + (size_t)(kvo + el) * 2, el * 2};
      } else {
        memcpy(kvs + kvo, a->k, (size_t)el * 2);
        memcpy(kvs + kvo + el, a->v, (size_t)el * 2);
      }
    }
    ap->k = d + pl->off_kvin + (size_t)kvo * 2, ap->v = d + pl->off_kvin + (size_t)(kvo + el) * 2;
    kvo += 2 * el;
  }
  for (int i = 0; i < b->n_copies; i++) cps[2 * i] = b->copies[i].src, cps[2 * i + 1] = b->copies[i].dst;

  da_cu_args *g = &c->args;
  g->kv = c->kv;
  g->acc_o = c->acc_o, g->acc_lse = c->acc_lse;
  g->pages = (const int32_t *)(d + pl->off_pt);
  g->attns = (const da_cu_attn *)(d + pl->off_attn);
  g->items = (const da_cu_item *)(d + pl->off_item);
  g->citems = (const da_cu_citem *)(d + pl->off_citem);
  g->appends = (const da_cu_append *)(d + pl->off_app);
  g->q = d + pl->off_q;
  g->kvin = d + pl->off_kvin;
  g->n_items = (int)pl->n_items, g->n_citems = (int)pl->n_citems, g->n_appends = b->n_appends;
  g->n_split_items = (int)n_split;
  g->max_append_tokens = pl->max_append_tokens;
  g->n_layers = m->n_layers, g->n_q_heads = m->n_q_heads, g->n_kv_heads = m->n_kv_heads;
  g->head_dim = m->head_dim, g->page_tokens = P;
  g->page_shift = 0;
  while ((1 << g->page_shift) < P) g->page_shift++;
  g->split_tokens = S, g->tile_tokens = c->cfg.num.tile_tokens, g->window = m->window, g->bf16 = m->dtype == DA_BF16;
  g->has_inrow = pl->inrow_rows > 0 || (c->prefix && pl->partial_rows > 0); /* prefix items fold too */
  g->combine_splits = pl->max_splits;
  g->combine_short = pl->max_splits <= c->combine_short;
  g->ticket = pl->tickets ? c->ticket : NULL;
  g->n_pool_pages = c->cfg.n_pages;
  g->n_sm = c->sm90_grid > 0 ? c->sm90_grid : c->n_sm;
  g->kv_stream = c->kv_stream_ok && pl->kv_tokens * m->n_kv_heads * m->head_dim * 4 > c->l2_bytes;
  g->l2_promo = c->l2_promo;
  g->q_tokens = c->q_tma ? pl->n_q_el / ((int64_t)m->n_q_heads * m->head_dim) : 0;
  c->launch_pipes = pl->pipes > 1;
  g->scale_log2 = (float)((double)m->scale * 1.4426950408889634);
  g->softcap = m->softcap > 0.0f;
  g->cap_in = g->softcap ? (float)((double)m->scale / (double)m->softcap) : 0.0f;
  g->cap_out_log2 = g->softcap ? (float)((double)m->softcap * 1.4426950408889634) : 0.0f;
  g->exp_c = g->softcap ? 1.0f : g->scale_log2; /* numerics.cuh: p = exp2(fma(y, c, -m)) */
  return 0;
}

/* The attention launches: attn.cu for every item, or with sm90_prefill prefill_sm90.cu for
 * the blocks of more than 16 rows and, with sm90_decode, for the rest too (else attn.cu). */
static int attn_launch(cuda_ctx *c) {
#ifdef DA_CUDA_HAVE_SM90A
  if (c->sm90_prefill) {
    da_cu_args d = c->args;
    const int v = c->launch_pipes ? c->sm90_pipes : c->sm90_prefill;
    if (c->sm90_decode) d.n_split_items = 0;
    int e = da_cuda_prefill_sm90(&d, v | (c->sm90_grid < 0 ? DA_CU_SM90_PER_ITEM : 0), c->stream);
    if (e != 0 || c->sm90_decode) return e;
    d.items += d.n_items - d.n_split_items;
    d.n_items = d.n_split_items;
    return da_cuda_attn(&d, c->stream);
  }
#endif
  return da_cuda_attn(&c->args, c->stream);
}

/* Page copies in order: a copy that touches a page an earlier pending copy wrote or read
 * starts a new launch. */
static int run_copies(cuda_ctx *c, const da_batch *b, const int32_t *dpairs, char *err, size_t errlen) {
  int rv = 0, start = 0;
  for (int i = 1; i <= b->n_copies; i++) {
    int dep = 0;
    for (int k = start; k < i && i < b->n_copies; k++) {
      const da_page_copy *x = &b->copies[k], *y = &b->copies[i];
      if (x->dst == y->src || x->dst == y->dst || x->src == y->dst) dep = 1;
    }
    if (dep || i == b->n_copies) {
      CUDA_GOTO(c, da_cuda_page_copy(c->kv, c->page_bytes, dpairs + 2 * start, i - start, c->stream), fail);
      start = i;
    }
  }
fail:
  return rv;
}

/* Stages a batch and enqueues copies, appends and the accumulator poison; leaves the
 * attention launch to the caller. */
static int stage(cuda_ctx *c, const da_batch *b, int S, int bench, uint64_t q_seed, plan *pl,
                 char *err, size_t errlen) {
  int rv = validate(c, b, bench, err, errlen);
  if (rv != 0) return rv;
  memset(pl, 0, sizeof(*pl));
  pl->partial = calloc((size_t)b->n_attns + 1, 1);
  if (pl->partial == NULL) {
    snprintf(err, errlen, "cuda: out of host memory");
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  plan_batch(c, b, S, pl);
  const int tm = c->tm != NULL && !bench;
  if (tm) c->tm_at[0] = da_now_ns();
  if (pl->in_bytes > c->stage_bytes || pl->out_bytes > c->stage_bytes) {
    snprintf(err, errlen, "batch needs %zu bytes of input and %zu of output staging, have %zu each",
             pl->in_bytes, pl->out_bytes, c->stage_bytes);
    rv = DETATTN_RESOURCE_EXHAUSTED;
    goto fail;
  }
  unsigned char *h = c->h_in[c->cur], *d = c->d_in[c->cur];
  /* The set's previous batch was finished already (at most two in flight); the event also
   * covers one whose submit failed midway. */
  CUDA_GOTO(c, cudaEventSynchronize(c->ev_done[c->cur]), fail);
  if (tm) c->tm_at[1] = da_now_ns();
  const int64_t bad = pack(c, b, S, pl, h, d, c->d_out[c->cur]);
  if (tm) c->tm_at[2] = da_now_ns();
  if (bad > 0) { /* an attention's page id outside the pool: its message, nothing enqueued */
    const da_attn *a = &b->attns[bad - 1];
    rv = check_pages(c, a->pages, a->n_pages, attn_w0(&c->cfg.model, a), (int64_t)a->q_pos + a->n_q, 1, "attn",
                     (int)(bad - 1), err, errlen);
    if (rv == 0) { /* not reached: pack and check_pages read the same ids */
      snprintf(err, errlen, "attn %d: page id outside the pool", (int)(bad - 1));
      rv = DETATTN_INVALID_ARGUMENT;
    }
    goto fail;
  }
  size_t h2d = bench || !pl->host_in ? pl->off_q : pl->in_bytes;
  /* DA_CUDA_TIMING: the device's staging phase starts here (the set's last batch is done, so
   * its events are free to record again) */
  if (tm) CUDA_GOTO(c, cudaEventRecord(c->tm->ev[c->cur][TM_STAGE], c->stream), fail);
  if (c->fl_n > 0) { /* on the copy stream, under the batch in flight's kernels */
    CUDA_GOTO(c, cudaMemcpyAsync(d, h, h2d, cudaMemcpyHostToDevice, c->copy), fail);
    CUDA_GOTO(c, cudaEventRecord(c->ev_in[c->cur], c->copy), fail);
    CUDA_GOTO(c, cudaStreamWaitEvent(c->stream, c->ev_in[c->cur], 0), fail);
  } else { /* nothing to overlap: on the batch's own stream, two calls fewer */
    CUDA_GOTO(c, cudaMemcpyAsync(d, h, h2d, cudaMemcpyHostToDevice, c->stream), fail);
  }
  if (bench && pl->n_q_el > 0)
    CUDA_GOTO(c, da_cuda_fill(d + pl->off_q, (size_t)pl->n_q_el, 1, c->args.bf16, q_seed, c->stream), fail);
  /* The gathers ride in the append's launch (append.cu), unless an append's K/V is among them
   * (the append reads it from the staging buffer then). */
  const da_cu_seg *gsegs = (const da_cu_seg *)(d + pl->off_gseg);
  const int apart = pl->n_kv_gseg > 0 || b->n_appends + pl->n_gseg > 65535;
  if (pl->n_gseg > 0 && apart) CUDA_GOTO(c, da_cuda_segcopy(gsegs, (int)pl->n_gseg, pl->gseg_max, c->stream), fail);
  rv = run_copies(c, b, (const int32_t *)(d + pl->off_copy), err, errlen);
  if (rv != 0) goto fail;
  CUDA_GOTO(c, da_cuda_append(&c->args, gsegs, apart ? 0 : (int)pl->n_gseg, pl->gseg_max, c->stream), fail);
  if (c->cfg.poison) {
    CUDA_GOTO(c, da_cuda_fill(c->acc_o, (size_t)pl->slots * c->args.head_dim, 0, 0, 0, c->stream), fail);
    CUDA_GOTO(c, da_cuda_fill(c->acc_lse, (size_t)pl->slots, 0, 0, 0, c->stream), fail);
    CUDA_GOTO(c, da_cuda_fill(c->d_out[c->cur], pl->out_bytes / 4, 0, 0, 0, c->stream), fail);
  }
  c->out_used = pl->out_bytes;
  c->slots_used = pl->slots;
  return 0;
fail:
  /* Whatever was enqueued for this set completes before the set is used again. */
  (void)cudaEventRecord(c->ev_done[c->cur], c->stream);
  (void)cudaGetLastError();
  free(pl->partial);
  pl->partial = NULL;
  return rv;
}

/* ---- submit / finish ----------------------------------------------------------------- */

/* A batch in flight: its plan (offsets of its outputs in h_out[set]) and where they go. */
typedef struct flight {
  const da_batch *b;
  plan pl;
  int set;
  void (*ready)(void *arg);
  void *arg;
  uint64_t t_submit;             /* DA_CUDA_TIMING: host ns at submit's entry */
  float host[TM_HOST_N];         /* and its parts, us (TM_HOST_PLAN ..) */
  int tm_kind;                   /* its ring: 0 decode, 1 the others */
} flight;

static struct flight *flights_alloc(void) { return calloc(2, sizeof(flight)); }

static void flights_free(cuda_ctx *c) {
  for (int i = 0; i < c->fl_n; i++) {
    flight *f = &c->fl[(c->fl_head + i) % 2];
    free(f->pl.partial);
    f->pl.partial = NULL;
  }
  c->fl_n = 0;
}

/* Runs on a driver thread once the batch's outputs are on the host (or the stream failed). */
static void CUDART_CB on_stream_ready(cudaStream_t s, cudaError_t status, void *p) {
  (void)s;
  (void)status;
  flight *f = p;
  f->ready(f->arg);
}

static int submit(void *ctx, const da_batch *b, void (*ready)(void *arg), void *arg,
                  da_batch_result *res) {
  cuda_ctx *c = ctx;
  char *err = res->err;
  size_t errlen = sizeof(res->err);
  int rv = 0;
  if (c->dead) {
    snprintf(err, errlen, "cuda: the device hit a sticky error earlier; backend unavailable");
    return DETATTN_UNAVAILABLE;
  }
  if (c->fl_n >= 2) {
    snprintf(err, errlen, "cuda: two batches in flight already; finish one first");
    return DETATTN_FAILED_PRECONDITION;
  }
  /* The current device is per host thread; submit() may be called from a worker thread. */
  CUDA_GOTO(c, cudaSetDevice(c->cfg.device), out);
  flight *f = &c->fl[(c->fl_head + c->fl_n) % 2];
  memset(f, 0, sizeof(*f));
  c->cur = c->fl_n > 0 ? c->fl[c->fl_head].set ^ 1 : c->cur ^ 1;
  cudaEvent_t *tev = c->tm != NULL ? c->tm->ev[c->cur] : NULL;
  const uint64_t t0 = tev != NULL ? da_now_ns() : 0;
  rv = stage(c, b, c->cfg.num.split_tokens, 0, 0, &f->pl, err, errlen);
  if (rv != 0) return rv;
  const uint64_t t1 = tev != NULL ? da_now_ns() : 0;
  if (tev != NULL) CUDA_GOTO(c, cudaEventRecord(tev[TM_ATTN], c->stream), fail);
  CUDA_GOTO(c, attn_launch(c), fail);
  if (tev != NULL) CUDA_GOTO(c, cudaEventRecord(tev[TM_COMBINE], c->stream), fail);
  CUDA_GOTO(c, da_cuda_combine(&c->args, c->stream), fail);
  if (tev != NULL) CUDA_GOTO(c, cudaEventRecord(tev[TM_OUT], c->stream), fail);
  if (f->pl.n_sseg > 0)
    CUDA_GOTO(c, da_cuda_segcopy((const da_cu_seg *)(c->d_in[c->cur] + f->pl.off_sseg), (int)f->pl.n_sseg,
                                 f->pl.sseg_max, c->stream), fail);
  if (f->pl.out_bytes > 0 && f->pl.host_out)
    CUDA_GOTO(c, cudaMemcpyAsync(c->h_out[c->cur], c->d_out[c->cur], f->pl.out_bytes,
                                 cudaMemcpyDeviceToHost, c->stream), fail);
  if (tev != NULL) {
    CUDA_GOTO(c, cudaEventRecord(tev[TM_GPU], c->stream), fail);
    f->t_submit = t0;
    for (int i = 0; i < b->n_attns && f->tm_kind == 0; i++) f->tm_kind = b->attns[i].n_q > TIMING_DECODE_Q;
    const uint64_t at[TM_HOST_N + 1] = {t0, c->tm_at[0], c->tm_at[1], c->tm_at[2], t1, da_now_ns()};
    for (int j = 0; j < TM_HOST_N; j++) f->host[j] = (float)(at[j + 1] - at[j]) * 1e-3f;
  }
  for (int i = 0; i < b->n_signals; i++)
    CUDA_GOTO(c, cudaEventRecord((cudaEvent_t)b->signals[i], c->stream), fail);
  f->b = b;
  f->set = c->cur;
  f->ready = ready;
  f->arg = arg;
  /* The callback comes before the done event, so finish() returning means it has run. */
  if (ready != NULL) CUDA_GOTO(c, cudaStreamAddCallback(c->stream, on_stream_ready, f, 0), fail);
  CUDA_GOTO(c, cudaEventRecord(c->ev_done[c->cur], c->stream), fail);
  c->fl_n++;
  return 0;
fail:
  (void)cudaEventRecord(c->ev_done[c->cur], c->stream);
  (void)cudaGetLastError();
  free(f->pl.partial);
  f->pl.partial = NULL;
out:
  return rv;
}

static int poll(void *ctx) {
  cuda_ctx *c = ctx;
  if (c->fl_n == 0) return 1;
  cudaError_t e = cudaEventQuery(c->ev_done[c->fl[c->fl_head].set]);
  if (e == cudaErrorNotReady) return 0;
  if (e != cudaSuccess) (void)cudaGetLastError(); /* finish reports it */
  return 1;
}

static int finish(void *ctx, da_batch_result *res) {
  cuda_ctx *c = ctx;
  char *err = res->err;
  size_t errlen = sizeof(res->err);
  int rv = 0;
  if (c->fl_n == 0) {
    snprintf(err, errlen, "cuda: no batch in flight");
    return DETATTN_FAILED_PRECONDITION;
  }
  flight *f = &c->fl[c->fl_head];
  c->fl_head = (c->fl_head + 1) % 2;
  c->fl_n--;
  CUDA_GOTO(c, cudaSetDevice(c->cfg.device), fail);
  CUDA_GOTO(c, cudaEventSynchronize(c->ev_done[f->set]), fail);
  if (c->tm != NULL) timing_add(c->tm, f->tm_kind, f->set, f->t_submit, f->host);
  const da_model *m = &c->cfg.model;
  const unsigned char *hout = c->h_out[f->set];
  const da_batch *b = f->b;
  int64_t o = 0, lse = 0;
  for (int i = 0; i < b->n_attns; i++) {
    const da_attn *a = &b->attns[i];
    const int64_t rows = (int64_t)a->n_q * m->n_q_heads;
    if (direct_o(a)) continue; /* the kernels wrote them in place */
    if (!a->dev) memcpy(a->o, hout + f->pl.off_o + (size_t)o * 2, (size_t)rows * m->head_dim * 2);
    o += rows * m->head_dim;
    if (a->lse != NULL) {
      if (!a->dev) memcpy(a->lse, hout + f->pl.off_lse + (size_t)lse * 4, (size_t)rows * 4);
      lse += rows;
    }
  }
  res->inrow_rows = f->pl.inrow_rows;
  res->partial_rows = f->pl.partial_rows;
fail:
  free(f->pl.partial);
  f->pl.partial = NULL;
  return rv;
}

static int run(void *ctx, const da_batch *b, da_batch_result *res) {
  cuda_ctx *c = ctx;
  if (c->fl_n > 0) {
    snprintf(res->err, sizeof(res->err), "cuda: run() while %d batches are in flight", c->fl_n);
    return DETATTN_FAILED_PRECONDITION;
  }
  int rv = submit(ctx, b, NULL, NULL, res);
  if (rv != 0) return rv;
  return finish(ctx, res);
}

/* ---- bench hooks --------------------------------------------------------------------- */

int da_cuda_bench_fill_kv(void *ctx, uint64_t seed) {
  cuda_ctx *c = ctx;
  char err[256];
  size_t errlen = sizeof(err);
  int rv = 0;
  CUDA_GOTO(c, da_cuda_fill(c->kv, c->kv_bytes / 2, 1, c->cfg.model.dtype == DA_BF16, seed, c->stream), fail);
  CUDA_GOTO(c, cudaStreamSynchronize(c->stream), fail);
fail:
  return rv;
}

int da_cuda_bench_prepare(void *ctx, const da_batch *b, int split_tokens, uint64_t q_seed,
                          da_batch_result *res) {
  cuda_ctx *c = ctx;
  char *err = res->err;
  size_t errlen = sizeof(res->err);
  int S = split_tokens > 0 ? split_tokens : c->cfg.num.split_tokens;
  if (S % c->cfg.num.tile_tokens != 0) {
    snprintf(err, errlen, "split_tokens %d is not a multiple of %d", S, c->cfg.num.tile_tokens);
    return DETATTN_INVALID_ARGUMENT;
  }
  if (c->fl_n > 0) {
    snprintf(err, errlen, "cuda: bench prepare while %d batches are in flight", c->fl_n);
    return DETATTN_FAILED_PRECONDITION;
  }
  plan pl;
  c->cur ^= 1;
  int rv = stage(c, b, S, 1, q_seed, &pl, err, errlen);
  if (rv != 0) return rv;
  res->inrow_rows = pl.inrow_rows;
  res->partial_rows = pl.partial_rows;
  free(pl.partial);
  CUDA_GOTO(c, cudaStreamSynchronize(c->stream), fail);
fail:
  return rv;
}

/* Enqueues n steps of the prepared batch: the attention, and the combine when asked. */
static int bench_steps(cuda_ctx *c, int n, int combine, char *err, size_t errlen) {
  int rv = 0;
  for (int i = 0; i < n; i++) {
    CUDA_GOTO(c, attn_launch(c), fail);
    if (combine) CUDA_GOTO(c, da_cuda_combine(&c->args, c->stream), fail);
  }
fail:
  return rv;
}

/* ms a step of n steps captured in one CUDA graph (launched once to warm it, then timed), or
 * -1 when the stream cannot be captured (the stream is left usable). */
static double graph_ms(cuda_ctx *c, int n, int combine) {
  char err[256];
  size_t errlen = sizeof(err);
  cudaGraph_t g = NULL;
  cudaGraphExec_t x = NULL;
  float ms = -1.0f;
  if (cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) goto out;
  const int rv = bench_steps(c, n, combine, err, errlen);
  if (cudaStreamEndCapture(c->stream, &g) != cudaSuccess || rv != 0) goto out;
  if (cudaGraphInstantiate(&x, g, 0) != cudaSuccess || cudaGraphLaunch(x, c->stream) != cudaSuccess ||
      cudaEventRecord(c->ev[0], c->stream) != cudaSuccess || cudaGraphLaunch(x, c->stream) != cudaSuccess ||
      cudaEventRecord(c->ev[1], c->stream) != cudaSuccess || cudaEventSynchronize(c->ev[1]) != cudaSuccess ||
      cudaEventElapsedTime(&ms, c->ev[0], c->ev[1]) != cudaSuccess)
    ms = -1.0f;
out:
  if (x != NULL) (void)cudaGraphExecDestroy(x);
  if (g != NULL) (void)cudaGraphDestroy(g);
  (void)cudaGetLastError();
  return ms < 0.0f ? -1.0 : ms / n;
}

/* ms a step of n steps launched back to back (the queue never runs dry). */
static int eager_ms(cuda_ctx *c, int n, int combine, double *out, char *err, size_t errlen) {
  int rv = 0;
  float ms = 0.0f;
  CUDA_GOTO(c, cudaEventRecord(c->ev[0], c->stream), fail);
  if ((rv = bench_steps(c, n, combine, err, errlen)) != 0) goto fail;
  CUDA_GOTO(c, cudaEventRecord(c->ev[1], c->stream), fail);
  CUDA_GOTO(c, cudaEventSynchronize(c->ev[1]), fail);
  CUDA_GOTO(c, cudaEventElapsedTime(&ms, c->ev[0], c->ev[1]), fail);
  *out = ms / n;
fail:
  return rv;
}

int da_cuda_bench_time(void *ctx, int warm_ms, int iters, da_cuda_times *t) {
  cuda_ctx *c = ctx;
  char err[256];
  size_t errlen = sizeof(err);
  int rv = 0;
  float ms = 0.0f;
  double lat = 0.0;
  memset(t, 0, sizeof(*t));
  t->n_sm = c->n_sm;
  if (iters <= 0) return 0;
  /* Warm: the GPU's clocks settle under sustained load (an H100's prefill rows ran 5-15 %
   * slower after ~0.1 s of it), so every timing below, like the peers', is of that state. */
  double spent = 0.0;
  for (int k = 0; k < 10000 && spent < warm_ms; k++) {
    double one = 0.0;
    if ((rv = eager_ms(c, iters, 1, &one, err, errlen)) != 0) goto fail;
    spent += one * iters;
  }
  /* The GPU's time a step: no event between the attention and the combine, so the combine
   * starts as a programmatic dependent (resident during the attention's last wave); then the
   * attention alone (the combine's share is the difference). */
  t->step_ms = graph_ms(c, iters, 1);
  t->attn_ms = graph_ms(c, iters, 0);
  t->graph = t->step_ms >= 0.0 && t->attn_ms >= 0.0;
  if (!t->graph) {
    if ((rv = eager_ms(c, iters, 1, &t->step_ms, err, errlen)) != 0) goto fail;
    if ((rv = eager_ms(c, iters, 0, &t->attn_ms, err, errlen)) != 0) goto fail;
  }
  /* One step at a time from an idle stream: the first event fires at once, so the host's
   * launch work is inside the interval (what a lone step waits). */
  for (int i = 0; i < iters; i++) {
    CUDA_GOTO(c, cudaEventRecord(c->ev[0], c->stream), fail);
    if ((rv = bench_steps(c, 1, 1, err, errlen)) != 0) goto fail;
    CUDA_GOTO(c, cudaEventRecord(c->ev[2], c->stream), fail);
    CUDA_GOTO(c, cudaEventSynchronize(c->ev[2]), fail);
    CUDA_GOTO(c, cudaEventElapsedTime(&ms, c->ev[0], c->ev[2]), fail);
    lat += ms;
  }
  t->lat_ms = lat / iters;
  return 0;
fail:
  fprintf(stderr, "%s\n", err);
  return rv;
}

int da_cuda_prefill_path(void *ctx) { return ((cuda_ctx *)ctx)->sm90_prefill; }

/* ---- memory and events of other processes (the data planes) ---------------------------- */

static int map_host(void *ctx, void *p, size_t n, void **dev, char *err, size_t errlen) {
  cuda_ctx *c = ctx;
  int rv = 0;
  CUDA_GOTO(c, cudaSetDevice(c->cfg.device), fail);
  CUDA_GOTO(c, cudaHostRegister(p, n, cudaHostRegisterMapped | cudaHostRegisterPortable), fail);
  cudaError_t e = cudaHostGetDevicePointer(dev, p, 0);
  if (e != cudaSuccess) {
    (void)cudaHostUnregister(p);
    rv = cuda_fail(c, e, "cudaHostGetDevicePointer", __LINE__, err, errlen);
  }
fail:
  return rv;
}

static void unmap_host(void *ctx, void *p) {
  cuda_ctx *c = ctx;
  (void)cudaSetDevice(c->cfg.device);
  if (cudaHostUnregister(p) != cudaSuccess) (void)cudaGetLastError();
}

typedef int (*addr_range_fn)(uintptr_t *base, size_t *size, uintptr_t ptr); /* cuMemGetAddressRange */

static int map_ipc(void *ctx, const void *handle, size_t handle_len, uint64_t size, void **dev, char *err,
                   size_t errlen) {
  cuda_ctx *c = ctx;
  int rv = 0;
  cudaIpcMemHandle_t h;
  if (handle_len != sizeof h) {
    snprintf(err, errlen, "a CUDA IPC memory handle is %zu bytes, not %zu", sizeof h, handle_len);
    return DETATTN_INVALID_ARGUMENT;
  }
  memcpy(&h, handle, sizeof h);
  CUDA_GOTO(c, cudaSetDevice(c->cfg.device), fail);
  cudaError_t e = cudaIpcOpenMemHandle(dev, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    snprintf(err, errlen, "cudaIpcOpenMemHandle: %s (a handle from cudaIpcGetMemHandle of a live allocation of "
             "another process on this GPU)", cudaGetErrorString(e));
    return DETATTN_INVALID_ARGUMENT;
  }
  /* The allocation must hold size bytes from its base: the driver knows its extent. */
  static addr_range_fn range;
  if (range == NULL) {
    enum cudaDriverEntryPointQueryResult q;
    void *fn = NULL;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 3020, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      range = (addr_range_fn)fn;
  }
  uintptr_t base = 0;
  size_t have = 0;
  if (range == NULL || range(&base, &have, (uintptr_t)*dev) != 0) {
    (void)cudaIpcCloseMemHandle(*dev);
    snprintf(err, errlen, "cuMemGetAddressRange of an opened IPC allocation failed");
    return DETATTN_INTERNAL;
  }
  if (have - ((uintptr_t)*dev - base) < size) {
    (void)cudaIpcCloseMemHandle(*dev);
    snprintf(err, errlen, "the allocation behind the handle has %zu bytes, fewer than the %llu registered",
             have - (size_t)((uintptr_t)*dev - base), (unsigned long long)size);
    return DETATTN_INVALID_ARGUMENT;
  }
fail:
  return rv;
}

static void unmap_ipc(void *ctx, void *dev) {
  cuda_ctx *c = ctx;
  (void)cudaSetDevice(c->cfg.device);
  if (cudaIpcCloseMemHandle(dev) != cudaSuccess) (void)cudaGetLastError();
}

static int event_open(void *ctx, const void *handle, size_t handle_len, void **ev, char *err, size_t errlen) {
  cuda_ctx *c = ctx;
  int rv = 0;
  cudaIpcEventHandle_t h;
  if (handle_len != sizeof h) {
    snprintf(err, errlen, "a CUDA IPC event handle is %zu bytes, not %zu", sizeof h, handle_len);
    return DETATTN_INVALID_ARGUMENT;
  }
  memcpy(&h, handle, sizeof h);
  CUDA_GOTO(c, cudaSetDevice(c->cfg.device), fail);
  cudaEvent_t e2 = NULL;
  cudaError_t e = cudaIpcOpenEventHandle(&e2, h);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    snprintf(err, errlen, "cudaIpcOpenEventHandle: %s (an event created with cudaEventInterprocess | "
             "cudaEventDisableTiming by a live process)", cudaGetErrorString(e));
    return DETATTN_INVALID_ARGUMENT;
  }
  *ev = e2;
fail:
  return rv;
}

static void event_close(void *ctx, void *ev) {
  (void)ctx;
  if (cudaEventDestroy((cudaEvent_t)ev) != cudaSuccess) (void)cudaGetLastError();
}

static int event_query(void *ctx, void *ev) {
  (void)ctx;
  cudaError_t e = cudaEventQuery((cudaEvent_t)ev);
  if (e == cudaSuccess) return 1;
  (void)cudaGetLastError();
  if (e == cudaErrorNotReady) return 0;
  return DETATTN_INTERNAL;
}

const da_backend_ops da_cuda_backend_ops = {
    .name = "cuda",
    .available = available,
    .create = create,
    .destroy = destroy,
    .run = run,
    .submit = submit,
    .finish = finish,
    .poll = poll,
    .map_host = map_host,
    .unmap_host = unmap_host,
    .map_ipc = map_ipc,
    .unmap_ipc = unmap_ipc,
    .event_open = event_open,
    .event_close = event_close,
    .event_query = event_query,
};
