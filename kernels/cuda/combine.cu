/*
 * combine.cu — the deterministic combine of split partials: a row's splits (o_j fp32,
 * lse_j) from the accumulator pool are folded in ascending j, starting from its first
 * split, with the same da_merge_weights / da_merge_o as the in-row folds. One
 * split: the output is o_0 rounded, no merge applied. Where a prefix item (item.h) folded
 * the row's first splits, its fold in the first split's slot is the state the fold goes on
 * from (da_cu_citem.jc). Two forms with the same arithmetic in the same order:
 * combine_kernel (a CTA a row, the lse chain a chunk ahead of the fold) and, where every row
 * is short, combine_short_kernel (a warp a row).
 */
#include <atomic>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda_kernels.h"
#include "mbarrier.cuh"
#include "numerics.cuh"
#include "pdl.cuh"
#include "trace.cuh"

namespace {

using namespace da_cu;

/*
 * One CTA per row: D fold threads (one column of o each) and one chain warp. The merge
 * weights of split j need the lse merged over the splits before it, a serial chain (max,
 * sub, ex2, add, lg2, add: ~55 cycles a split) that costs more per split than the fold of
 * o does. So the chain warp computes the weights a chunk of CH splits at a time into a ring
 * in shared memory, and the fold threads fold chunk c while the chain computes chunk c + 1:
 * a row takes one chain plus one chunk. The o_j of a row are one contiguous block of the
 * pool; they are copied into a ring of the same chunks (bulk copies on sm_90, cp.async on
 * sm_80) from the start, so the fold reads shared memory only. The arithmetic and its order
 * are the left fold's; only the schedule is new.
 *
 * Ring slot s holds chunk c = s, s + R, s + 2R, ...; mbarriers per slot:
 *   wfull   a, b, s of the chunk are written (one arrival: the chain warp)
 *   dfull   the chunk's o_j have landed (sm_90: one arrival plus the bytes; sm_80: one
 *           arrival per fold thread, made by its cp.async)
 *   wempty  every fold thread is done with the chunk (one arrival: fold thread 0)
 */
template <int D>
struct shape {
  static constexpr int FOLD = D;                 /* fold threads */
  static constexpr int THREADS = FOLD + 32;      /* and the chain warp */
  static constexpr int CH = D <= 128 ? 16 : 8;   /* splits per chunk */
  static constexpr int R = 4;                    /* ring slots: 16 KiB (d 64) or 32 KiB of o_j */
};

/* A combine row's splits: slot `first` (split jf's) holds the fold of splits [jf, js), split
 * jf's own or a prefix item's fold; the n splits from slot `next` (split js's) on are merged
 * into it, in order. */
struct crow {
  int row, jf, jl, n;
  int64_t first, next;
};

__device__ __forceinline__ crow combine_row(const da_cu_args &a, const da_cu_citem &ci, const da_cu_attn &at) {
  crow r;
  r.row = ci.row0;
  const int p = at.q_pos + r.row / a.n_q_heads;
  const int w0 = a.window > 0 ? max(0, p - a.window + 1) : 0;
  r.jf = w0 / a.split_tokens, r.jl = p / a.split_tokens;
  const int js = max(r.jf + 1, min(ci.jc, r.jl + 1));
  r.n = r.jl + 1 - js;
  r.first = at.slot_base + (int64_t)r.row * at.n_splits + r.jf;
  r.next = r.first + (js - r.jf);
  return r;
}

/* A row's output: o rounded to the dtype. */
template <bool BF16>
__device__ __forceinline__ uint16_t round_o(float o) {
  if constexpr (BF16) {
    __nv_bfloat16 h = __float2bfloat16_rn(o);
    return *reinterpret_cast<uint16_t *>(&h);
  } else {
    __half h = __float2half_rn(o);
    return *reinterpret_cast<uint16_t *>(&h);
  }
}

/* The row's o_j are dead once folded, and were stored evict_last: in a launch that streams
 * its K/V over the L2 their dirty lines would hold L2 space and be written back to HBM.
 * Dropped instead (B 8 L 64k: 2 % faster, NOTES v5.12). The pool is written before it is read
 * in every launch, so nothing reads the undefined lines. A split's o_j is D * 4 bytes: whole
 * 128-byte lines. Slots jf .. jl (those a prefix item folded: unwritten); thread t of
 * `threads`. */
template <int D>
__device__ __forceinline__ void drop_row(const da_cu_args &a, const crow &r, int t, int threads) {
  const char *o0 = reinterpret_cast<const char *>(a.acc_o + r.first * D);
  const int lines = (r.jl + 1 - r.jf) * D * 4 / 128;
  for (int i = t; i < lines; i += threads) da_l2_discard(o0 + 128 * i);
}

/* Named barrier 1 over the fold threads (the chain warp runs on without it). */
template <int COUNT>
__device__ __forceinline__ void fold_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(COUNT) : "memory");
}

/*
 * n floats (a multiple of 4) from src to shared dst, completing on mbarrier bar. Called by
 * every fold thread: on sm_90 thread 0 issues one bulk copy, on sm_80 each thread copies
 * its 16-byte pieces and its cp.async arrives on bar when they have landed. Pool slots are
 * D * 4 bytes, so src is 16-byte aligned as both need.
 */
template <int FOLD>
__device__ __forceinline__ void load_chunk(float *dst, const float *src, int n, uint32_t bar, int tid) {
#if __CUDA_ARCH__ >= 900
  if (tid == 0) {
    const uint32_t bytes = (uint32_t)n * 4u;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
  }
#else
  for (int i = tid * 4; i < n; i += FOLD * 4)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst + i)), "l"(src + i) : "memory");
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
#endif
}

template <int D, bool BF16>
__global__ void __launch_bounds__(shape<D>::THREADS) combine_kernel(const da_cu_args a) {
  constexpr int FOLD = shape<D>::FOLD, CH = shape<D>::CH, R = shape<D>::R;
  __shared__ __align__(128) float s_o[R][CH * D]; /* o_j of a chunk: [split][column] */
  __shared__ float4 s_w[R][CH];                   /* a chunk's merges: a, b, s from the chain, then wa, wb */
  __shared__ uint64_t s_bar[3][R];                /* wfull, dfull, wempty */
  DA_TRACE_IF(threadIdx.x == 0, 0); /* timing builds (trace.cuh): the CTA's start */
  da_pdl_trigger(); /* pdl.cuh: the next step's attention may start its prologue */
  const da_cu_citem ci = a.citems[blockIdx.x];
  const da_cu_attn at = a.attns[ci.attn];
  const int tid = threadIdx.x;
  const crow r = combine_row(a, ci, at);
  const int row = r.row, n = r.n;
  const int64_t first = r.first, next = r.next;
  const int nch = (n + CH - 1) / CH;
  const uint32_t wfull = smem_addr(s_bar[0]), dfull = smem_addr(s_bar[1]), wempty = smem_addr(s_bar[2]);
#if __CUDA_ARCH__ >= 900
  constexpr uint32_t DFULL_ARRIVALS = 1;
#else
  constexpr uint32_t DFULL_ARRIVALS = FOLD;
#endif

  if (tid == 0) {
    for (int s = 0; s < R; s++) {
      mbar_init(wfull + 8 * s, 1);
      mbar_init(dfull + 8 * s, DFULL_ARRIVALS);
      mbar_init(wempty + 8 * s, 1);
    }
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
  }
  __syncthreads();
  /* Launched as a programmatic dependent of the attention kernel: the lines above may run
   * during its last wave; the partials are read only once it has completed. */
  da_pdl_wait();
  DA_TRACE_IF(tid == 0, 1); /* the attention grid complete */

  if (tid >= FOLD) {
    /* The chain warp: every lane runs the same chain (no divergence), lane 0 publishes. The
     * lse_j of the next chunk are loaded while this one's chain runs. */
    const bool lead = tid == FOLD;
    const float *lse_j = a.acc_lse + next;
    float lse = a.acc_lse[first];
    float cur[CH], nxt[CH];
#pragma unroll
    for (int k = 0; k < CH; k++) cur[k] = k < n ? lse_j[k] : 0.0f;
    for (int c = 0; c < nch; c++) {
      const int s = c % R, m = min(CH, n - c * CH), j1 = (c + 1) * CH;
#pragma unroll
      for (int k = 0; k < CH; k++) nxt[k] = j1 + k < n ? lse_j[j1 + k] : 0.0f;
      if (c >= R) mbar_wait(wempty + 8 * s, ((c / R) - 1) & 1);
      float4 *w = s_w[s];
      auto step = [&](int k) {
        const da_merge_w mw = da_merge_weights_chain(lse, cur[k]);
        if (lead) w[k] = make_float4(mw.a, mw.b, mw.s, 0.0f);
        lse = mw.lse;
      };
      if (m == CH) {
#pragma unroll
        for (int k = 0; k < CH; k++) step(k);
      } else {
#pragma unroll
        for (int k = 0; k < CH; k++)
          if (k < m) step(k);
      }
      if (lead) mbar_arrive(wfull + 8 * s);
      DA_TRACE_IF(lead && c < 16, 4 + c); /* timing builds: chunk c's chain done */
#pragma unroll
      for (int k = 0; k < CH; k++) cur[k] = nxt[k];
    }
    if (lead && at.lse != nullptr) at.lse[row] = da_lse_out(lse);
    return;
  }

  auto chunk_src = [&](int c) { return a.acc_o + (next + (int64_t)c * CH) * D; };
  auto chunk_len = [&](int c) { return min(CH, n - c * CH); };
  for (int c = 0; c < R && c < nch; c++) load_chunk<FOLD>(s_o[c], chunk_src(c), chunk_len(c) * D, dfull + 8 * c, tid);
  float o = a.acc_o[first * D + tid];
  for (int c = 0; c < nch; c++) {
    const int s = c % R, m = chunk_len(c);
    const uint32_t ph = (c / R) & 1;
    float4 *w = s_w[s];
    mbar_wait(wfull + 8 * s, ph);
    /* The element weights (a reciprocal each) are not part of the chain: taken here, one
     * split per thread. */
    if (tid < m) {
      float4 q = w[tid];
      da_merge_finish(q.x, q.y, q.z, q.x, q.y);
      w[tid] = q;
    }
    fold_sync<FOLD>();
    if (c > 0) {
      /* Every fold thread is past chunk c - 1: its slot takes chunk c - 1 + R. */
      const int sp = (c - 1) % R, cn = c - 1 + R;
      if (tid == 0) mbar_arrive(wempty + 8 * sp);
      if (cn < nch) load_chunk<FOLD>(s_o[sp], chunk_src(cn), chunk_len(cn) * D, dfull + 8 * sp, tid);
    }
    mbar_wait(dfull + 8 * s, ph);
    const float *x = s_o[s] + tid;
    auto merge = [&](int k) {
      const float4 q = w[k];
      o = da_merge_o(q.x, q.y, o, x[k * D]);
    };
    if (m == CH) {
#pragma unroll
      for (int k = 0; k < CH; k++) merge(k);
    } else {
      for (int k = 0; k < m; k++) merge(k);
    }
    DA_TRACE_IF(tid == 0 && c < 16, 20 + c); /* chunk c folded */
  }
  DA_TRACE_IF(tid == 0, 2); /* the row folded */
  static_cast<uint16_t *>(at.o)[(int64_t)row * D + tid] = round_o<BF16>(o);
  if (a.kv_stream) drop_row<D>(a, r, tid, FOLD); /* every chunk's copy has landed (dfull) */
}

/*
 * Rows that merge few splits (a->combine_short: every row of the launch has at most
 * DA_CUDA_COMBINE_SHORT splits): one warp a row, SHORT_WARPS rows a CTA, no shared memory.
 * Each lane folds D / 32 columns straight from the pool and runs the row's lse chain itself
 * (every lane the same chain, as the chain warp above). The same da_merge_weights_chain /
 * da_merge_finish / da_merge_o in the same order as combine_kernel, so the same bits; what
 * goes is that kernel's per-CTA set-up (mbarriers, a ring of 32 KB, one CTA a row), which
 * costs more than a row of one merge: B 1 / 8 L 1k take 0.95x / 0.94x the step. The chain
 * waits on no load (below): at 8 splits (B 1 L 4k) 0.96x, at 32 (B 1 L 16k) still 1.08x, as
 * the CTA form's fold threads share the merges of each split's columns (NOTES.md v5.24).
 */
constexpr int SHORT_WARPS = 4;

/* A lane's V adjacent floats of a row (V 2, 4 or 8; 8-byte aligned at least: slots are D * 4
 * bytes and a lane's columns start at a multiple of V). */
template <int V>
__device__ __forceinline__ void load_cols(float (&x)[V], const float *p) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int i = 0; i < V / 4; i++) {
      const float4 t = reinterpret_cast<const float4 *>(p)[i];
      x[4 * i] = t.x, x[4 * i + 1] = t.y, x[4 * i + 2] = t.z, x[4 * i + 3] = t.w;
    }
  } else {
    static_assert(V == 2, "a lane's columns: 2, 4 or 8");
    const float2 t = *reinterpret_cast<const float2 *>(p);
    x[0] = t.x, x[1] = t.y;
  }
}

template <int D, bool BF16>
__global__ void __launch_bounds__(32 * SHORT_WARPS) combine_short_kernel(const da_cu_args a) {
  constexpr int V = D / 32; /* columns a lane: 2, 4 or 8, adjacent */
  da_pdl_trigger();
  const int lane = threadIdx.x % 32, idx = blockIdx.x * SHORT_WARPS + threadIdx.x / 32;
  if (idx >= a.n_citems) return;
  const da_cu_citem ci = a.citems[idx];
  const da_cu_attn at = a.attns[ci.attn];
  const crow r = combine_row(a, ci, at);
  da_pdl_wait(); /* the attention grid complete: its partials visible */
  const int col = lane * V;
  float o[V];
  load_cols<V>(o, a.acc_o + r.first * D + col);
  float lse = a.acc_lse[r.first];
  const float *lse_j = a.acc_lse + r.next, *o_j = a.acc_o + r.next * D + col;
  /* Nothing the chain waits for is loaded in it: lane k holds the lse of split c + k of the
   * chunk of 32 splits from c (the next chunk's loaded a chunk ahead), taken by shuffle; the
   * o_j go in groups of GR splits, a group ahead of their merges (two register buffers). */
  constexpr int GR = 4;
  float mine = lane < r.n ? lse_j[lane] : 0.0f, ahead = 32 + lane < r.n ? lse_j[32 + lane] : 0.0f;
  float xa[GR][V], xb[GR][V];
  auto load_group = [&](float (&x)[GR][V], int g) {
#pragma unroll
    for (int i = 0; i < GR; i++)
      if (g * GR + i < r.n) load_cols<V>(x[i], o_j + (int64_t)(g * GR + i) * D);
  };
  auto merge_group = [&](const float (&x)[GR][V], int g) {
#pragma unroll
    for (int i = 0; i < GR; i++) {
      const int k = g * GR + i;
      if (k >= r.n) break;
      if (k % 32 == 0 && k > 0) { /* the next chunk (GR divides 32: only at i 0) */
        mine = ahead;
        ahead = k + 32 + lane < r.n ? lse_j[k + 32 + lane] : 0.0f;
      }
      const da_merge_w mw = da_merge_weights_chain(lse, __shfl_sync(0xffffffffu, mine, k % 32));
      float wa, wb;
      da_merge_finish(mw.a, mw.b, mw.s, wa, wb);
      lse = mw.lse;
#pragma unroll
      for (int v = 0; v < V; v++) o[v] = da_merge_o(wa, wb, o[v], x[i][v]);
    }
  };
  const int ng = (r.n + GR - 1) / GR;
  load_group(xa, 0);
  for (int g = 0; g < ng; g += 2) { /* warp-uniform: every lane runs every shuffle */
    load_group(xb, g + 1);
    merge_group(xa, g);
    load_group(xa, g + 2);
    merge_group(xb, g + 1);
  }
  /* pairs of outputs a 32-bit store (o is 4-byte aligned, D and col even) */
  uint32_t *dst = reinterpret_cast<uint32_t *>(static_cast<uint16_t *>(at.o) + (int64_t)r.row * D + col);
#pragma unroll
  for (int v = 0; v < V; v += 2) dst[v / 2] = round_o<BF16>(o[v]) | (uint32_t)round_o<BF16>(o[v + 1]) << 16;
  if (lane == 0 && at.lse != nullptr) at.lse[r.row] = da_lse_out(lse);
  if (a.kv_stream) drop_row<D>(a, r, lane, 32);
}

/*
 * Programmatic dependent launch: the combine's CTAs start while the attention kernel's last
 * CTAs run (both attention kernels trigger it) and wait in da_pdl_wait for its completion. Only
 * where the image that runs was built from sm_90 or later PTX: an sm_80 image (also one
 * JIT-compiled for a newer device) has no wait.
 *
 * Spread: a row's chain is one warp's serial latency chain (~92 cycles a split on an H100),
 * and chain warps sharing an SM slow each other down: the combine CTAs that start early all
 * land on the few SMs the attention leaves free (5 a SM by registers), and there a 128-split
 * row took up to 1.5x as long as alone (traced). So where rows have SPREAD_SPLITS splits or
 * more, each CTA asks for unused dynamic shared memory enough that at most ceil(rows / SMs)
 * fit on an SM. Same work, same bits. Not for short rows: there the big CTAs cost ~0.3 us (B 1
 * L 1k-4k, S 512: 2-3 % slower; 16k 0.7-1.4 % faster, 64k 1.9-2.9 %; H100, NOTES v5.8).
 * Both asked once per device.
 */
constexpr int SPREAD_SPLITS = 32;

struct launch_info {
  std::atomic<int> ready{0}; /* 1: the fields below are set */
  std::atomic<int> pdl{0}, static_smem{0}, sm_smem{0}, n_sm{0};
};

template <int D, bool BF16>
cudaError_t launch(const da_cu_args *a, cudaStream_t stream) {
  static launch_info info[64]; /* per device */
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  launch_info local, *li = dev < 64 ? &info[dev] : &local;
  if (!li->ready.load(std::memory_order_acquire)) {
    cudaFuncAttributes fa;
    int sm_smem = 0, block_smem = 0, n_sm = 0;
    if ((e = cudaFuncGetAttributes(&fa, combine_kernel<D, BF16>)) != cudaSuccess ||
        (e = cudaDeviceGetAttribute(&sm_smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev)) != cudaSuccess ||
        (e = cudaDeviceGetAttribute(&block_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)) != cudaSuccess ||
        (e = cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess ||
        (e = cudaFuncSetAttribute(combine_kernel<D, BF16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  block_smem - (int)fa.sharedSizeBytes)) != cudaSuccess)
      return e;
    li->pdl.store(fa.ptxVersion >= 90 ? 2 : 1, std::memory_order_relaxed);
    li->static_smem.store((int)fa.sharedSizeBytes, std::memory_order_relaxed);
    li->sm_smem.store(sm_smem, std::memory_order_relaxed);
    li->n_sm.store(n_sm, std::memory_order_relaxed);
    li->ready.store(1, std::memory_order_release);
  }
  cudaLaunchAttribute attr;
  const bool pdl = li->pdl.load(std::memory_order_relaxed) == 2;
  if (a->combine_short) {
    const cudaLaunchConfig_t lc =
        da_pdl_config((unsigned)((a->n_citems + SHORT_WARPS - 1) / SHORT_WARPS), 32 * SHORT_WARPS, 0, stream, &attr, pdl);
    return cudaLaunchKernelEx(&lc, combine_short_kernel<D, BF16>, *a);
  }
  /* Dynamic bytes so that a CTA takes more than 1 / (per_sm + 1) of an SM's shared memory
   * (the driver reserves 1 KB a CTA). */
  const int n_sm = li->n_sm.load(std::memory_order_relaxed);
  const int per_sm = (a->n_citems + n_sm - 1) / n_sm;
  const int want = a->combine_splits < SPREAD_SPLITS ? 0
                   : li->sm_smem.load(std::memory_order_relaxed) / (per_sm + 1) + 128 - 1024 -
                         li->static_smem.load(std::memory_order_relaxed);
  const cudaLaunchConfig_t lc =
      da_pdl_config((unsigned)a->n_citems, shape<D>::THREADS, want > 0 ? (size_t)want : 0, stream, &attr, pdl);
  return cudaLaunchKernelEx(&lc, combine_kernel<D, BF16>, *a);
}

} // namespace

extern "C" int da_cuda_combine(const da_cu_args *a, cudaStream_t stream) {
  DA_TRACE_HOST("C");
  if (a->n_citems == 0) return 0;
  switch (a->head_dim * 2 + (a->bf16 ? 1 : 0)) {
  case 64 * 2 + 1: return (int)launch<64, true>(a, stream);
  case 64 * 2: return (int)launch<64, false>(a, stream);
  case 128 * 2 + 1: return (int)launch<128, true>(a, stream);
  case 128 * 2: return (int)launch<128, false>(a, stream);
  case 256 * 2 + 1: return (int)launch<256, true>(a, stream);
  case 256 * 2: return (int)launch<256, false>(a, stream);
  }
  return (int)cudaErrorInvalidValue;
}
