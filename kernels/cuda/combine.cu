/*
 * combine.cu — the deterministic combine of split partials: a row's splits (o_j fp32,
 * lse_j) from the accumulator pool are folded in ascending j, starting from its first
 * split, with the same da_merge_weights / da_merge_o as the in-row fold in attn.cu. One
 * split: the output is o_0 rounded, no merge applied.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda_kernels.h"
#include "numerics.cuh"

namespace {

constexpr int THREADS = 128;
constexpr int CHUNK = 512; /* splits whose weights are staged in shared memory at once */

/*
 * One CTA per row. Thread 0 runs the row's lse chain (da_merge_weights_chain, in ascending
 * j) and stages each step's weights in shared memory, the reciprocals of s are spread over
 * the threads; every thread then folds its elements of o with da_merge_o in the same order.
 * The o_j loads are batched ahead of the fold; the order of the arithmetic is the left
 * fold's.
 */
template <int D, bool BF16>
__global__ void __launch_bounds__(THREADS) combine_kernel(const da_cu_args a) {
  constexpr int PER = D > THREADS ? D / THREADS : 1;
  constexpr int BATCH = 16;  /* o_j loads in flight per thread (64 measured slower) */
  __shared__ float s_lse[CHUNK], s_a[CHUNK], s_b[CHUNK], s_s[CHUNK], s_y[CHUNK];
  __shared__ float s_out_lse;
  const da_cu_citem ci = a.citems[blockIdx.x];
  const da_cu_attn at = a.attns[ci.attn];
  const int tid = threadIdx.x;
  const int row = ci.row0;
  const int t = row / a.n_q_heads;
  const int p = at.q_pos + t;
  const int w0 = a.window > 0 ? max(0, p - a.window + 1) : 0;
  const int jf = w0 / a.split_tokens, jl = p / a.split_tokens;
  const int64_t slot0 = at.slot_base + (int64_t)row * at.n_splits;
  const bool active = tid < D;
  const int col = active ? tid : 0;

  float o[PER];
#pragma unroll
  for (int e = 0; e < PER; e++) o[e] = a.acc_o[(slot0 + jf) * D + col + e * THREADS];
  float lse = a.acc_lse[slot0 + jf]; /* the chain's state, used by thread 0 */

  for (int c0 = jf + 1; c0 <= jl; c0 += CHUNK) {
    const int n = min(CHUNK, jl - c0 + 1);
    for (int k = tid; k < n; k += THREADS) s_lse[k] = a.acc_lse[slot0 + c0 + k];
    /* Loads of the first batch go out before the weights are ready. */
    float v[BATCH][PER];
#pragma unroll
    for (int k = 0; k < BATCH; k++)
#pragma unroll
      for (int e = 0; e < PER; e++)
        v[k][e] = k < n ? a.acc_o[(slot0 + c0 + k) * D + col + e * THREADS] : 0.0f;
    __syncthreads();
    if (tid == 0) {
      for (int k = 0; k < n; k++) {
        const da_merge_w w = da_merge_weights_chain(lse, s_lse[k]);
        s_a[k] = w.a, s_b[k] = w.b, s_s[k] = w.s.b;
        lse = w.lse;
      }
      s_out_lse = lse;
    }
    __syncthreads();
    /* The reciprocals of s are not part of the chain: every thread takes some. */
    for (int k = tid; k < n; k += THREADS) s_y[k] = da_div_by(s_s[k]).y;
    __syncthreads();
    float o_start[PER]; /* for the exact redo of this chunk */
    da_range g = da_range_init();
#pragma unroll
    for (int e = 0; e < PER; e++) o_start[e] = o[e];
    for (int k0 = 0; k0 < n; k0 += BATCH) {
      float nx[BATCH][PER];
#pragma unroll
      for (int k = 0; k < BATCH; k++)
#pragma unroll
        for (int e = 0; e < PER; e++) {
          const int kk = k0 + BATCH + k;
          nx[k][e] = kk < n ? a.acc_o[(slot0 + c0 + kk) * D + col + e * THREADS] : 0.0f;
        }
#pragma unroll
      for (int k = 0; k < BATCH; k++) {
        if (k0 + k < n) {
          da_merge_w w;
          w.a = s_a[k0 + k], w.b = s_b[k0 + k], w.s = da_div_of(s_s[k0 + k], s_y[k0 + k]), w.lse = 0.0f;
#pragma unroll
          for (int e = 0; e < PER; e++) o[e] = da_merge_o(w, o[e], v[k][e], g);
        }
      }
#pragma unroll
      for (int k = 0; k < BATCH; k++)
#pragma unroll
        for (int e = 0; e < PER; e++) v[k][e] = nx[k][e];
    }
    if (!da_range_ok(g)) {
      /* A quotient outside da_div_fast_ok (zeros, subnormals, inf, NaN, extremes): this
       * thread redoes the chunk with __fdiv_rn, which gives the fast path's bits wherever
       * that applies. Out of the loop, so the loop has no call in it. */
#pragma unroll
      for (int e = 0; e < PER; e++) {
        o[e] = o_start[e];
        for (int k = 0; k < n; k++) {
          da_merge_w w;
          w.a = s_a[k], w.b = s_b[k], w.s = da_div_of(s_s[k], s_y[k]), w.lse = 0.0f;
          o[e] = da_merge_o_exact(w, o[e], a.acc_o[(slot0 + c0 + k) * D + col + e * THREADS]);
        }
      }
    }
    __syncthreads();
  }
  if (tid == 0 && jl == jf) s_out_lse = lse;
  __syncthreads();
  if (!active) return;
  uint16_t *dst = static_cast<uint16_t *>(a.o) + at.o_off + (int64_t)row * D + col;
#pragma unroll
  for (int e = 0; e < PER; e++) {
    if constexpr (BF16) {
      __nv_bfloat16 h = __float2bfloat16_rn(o[e]);
      dst[e * THREADS] = *reinterpret_cast<uint16_t *>(&h);
    } else {
      __half h = __float2half_rn(o[e]);
      dst[e * THREADS] = *reinterpret_cast<uint16_t *>(&h);
    }
  }
  if (at.lse_off >= 0 && tid == 0) a.lse[at.lse_off + row] = da_lse_out(s_out_lse);
}

template <int D, bool BF16>
cudaError_t launch(const da_cu_args *a, cudaStream_t stream) {
  combine_kernel<D, BF16><<<a->n_citems, THREADS, 0, stream>>>(*a);
  return cudaGetLastError();
}

} // namespace

extern "C" int da_cuda_combine(const da_cu_args *a, cudaStream_t stream) {
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
