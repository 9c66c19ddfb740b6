/*
 * append.cu — writes the batch's new K/V rows into the paged pool (write before attend).
 * Grid: (chunks of one append's tokens, append index). Each thread moves one 16-byte chunk
 * of one (token, kv head) row of K and the same chunk of V.
 */
#include "cuda_kernels.h"
#include "pdl.cuh"

namespace {

__global__ void __launch_bounds__(256) append_kernel(const da_cu_args a) {
  da_pdl_trigger(); /* pdl.cuh: the attention kernel after it may start its prologue */
  const da_cu_append ap = a.appends[blockIdx.y];
  const int ch = a.head_dim / 8;
  const int64_t per_tok = (int64_t)a.n_kv_heads * ch;
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= per_tok * ap.n_tokens) return;
  const int t = (int)(i / per_tok);
  const int h = (int)((i % per_tok) / ch), c = (int)(i % ch);
  const int pos = ap.pos + t;
  const int64_t slab = (int64_t)a.page_tokens * a.head_dim;
  const int64_t dst = (int64_t)a.pages[ap.pt_off + (pos >> a.page_shift)] * (2 * a.n_layers * a.n_kv_heads * slab) +
                      ((int64_t)ap.layer * 2 * a.n_kv_heads + h) * slab +
                      (int64_t)(pos & (a.page_tokens - 1)) * a.head_dim + c * 8;
  const int64_t src = ((int64_t)t * a.n_kv_heads + h) * a.head_dim + c * 8;
  const uint4 *kin = reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(a.kvin) + ap.k_off + src);
  const uint4 *vin = reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(a.kvin) + ap.v_off + src);
  uint16_t *kv = static_cast<uint16_t *>(a.kv);
  *reinterpret_cast<uint4 *>(kv + dst) = *kin;
  *reinterpret_cast<uint4 *>(kv + dst + a.n_kv_heads * slab) = *vin;
}

} // namespace

extern "C" int da_cuda_append(const da_cu_args *a, cudaStream_t stream) {
  if (a->n_appends == 0 || a->max_append_tokens == 0) return 0;
  const int64_t chunks = (int64_t)a->max_append_tokens * a->n_kv_heads * (a->head_dim / 8);
  const dim3 grid((unsigned)((chunks + 255) / 256), (unsigned)a->n_appends);
  append_kernel<<<grid, 256, 0, stream>>>(*a);
  return (int)cudaGetLastError();
}
