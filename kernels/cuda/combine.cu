/*
 * combine.cu — the deterministic combine of split partials: one warp per row folds the
 * row's splits (o_j fp32, lse_j) from the accumulator pool in ascending j, starting from
 * its first split, with the same da_merge_weights / da_merge_o as the in-row fold in
 * attn.cu. One split: the output is o_0 rounded, no merge applied.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda_kernels.h"
#include "numerics.cuh"

namespace {

template <int D, bool BF16>
__global__ void __launch_bounds__(DA_CU_COMBINE_ROWS * 32) combine_kernel(const da_cu_args a) {
  constexpr int PER = D / 32;
  const da_cu_citem ci = a.citems[blockIdx.x];
  const da_cu_attn at = a.attns[ci.attn];
  const int lane = threadIdx.x & 31;
  const int row = ci.row0 + (threadIdx.x >> 5);
  if (row >= at.n_q * a.n_q_heads) return;
  const int t = row / a.n_q_heads;
  const int p = at.q_pos + t;
  const int w0 = a.window > 0 ? max(0, p - a.window + 1) : 0;
  const int jf = w0 / a.split_tokens, jl = p / a.split_tokens;
  const int64_t slot0 = at.slot_base + (int64_t)row * at.n_splits;

  float o[PER];
  const float *src = a.acc_o + (slot0 + jf) * D + lane;
#pragma unroll
  for (int i = 0; i < PER; i++) o[i] = src[i * 32];
  float lse = a.acc_lse[slot0 + jf];
  for (int j = jf + 1; j <= jl; j++) {
    const float *sj = a.acc_o + (slot0 + j) * D + lane;
    const da_merge_w w = da_merge_weights(lse, a.acc_lse[slot0 + j]);
#pragma unroll
    for (int i = 0; i < PER; i++) o[i] = da_merge_o(w, o[i], sj[i * 32]);
    lse = w.lse;
  }
  uint16_t *dst = static_cast<uint16_t *>(a.o) + at.o_off + (int64_t)row * D + lane;
#pragma unroll
  for (int i = 0; i < PER; i++) {
    if constexpr (BF16) {
      __nv_bfloat16 h = __float2bfloat16_rn(o[i]);
      dst[i * 32] = *reinterpret_cast<uint16_t *>(&h);
    } else {
      __half h = __float2half_rn(o[i]);
      dst[i * 32] = *reinterpret_cast<uint16_t *>(&h);
    }
  }
  if (at.lse_off >= 0 && lane == 0) a.lse[at.lse_off + row] = da_lse_out(lse);
}

template <int D, bool BF16>
cudaError_t launch(const da_cu_args *a, cudaStream_t stream) {
  combine_kernel<D, BF16><<<a->n_citems, DA_CU_COMBINE_ROWS * 32, 0, stream>>>(*a);
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
