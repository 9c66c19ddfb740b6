/*
 * append.cu — writes the batch's new K/V rows into the paged pool (write before attend), and
 * in the same launch gathers the batch's device-address queries into the staging buffer
 * (segcopy.cuh): one launch fewer a layer call for a client on the CUDA data plane.
 * Grid: x chunks, y one row per append, then one per query segment. An append's CTA moves
 * 16-byte chunks, one a thread, of its (token, kv head) rows of K and the same chunks of V.
 */
#include "cuda_kernels.h"
#include "pdl.cuh"
#include "segcopy.cuh"

namespace {

__global__ void __launch_bounds__(256) append_kernel(const da_cu_args a, const da_cu_seg *segs) {
  da_pdl_trigger(); /* pdl.cuh: the attention kernel after it may start its prologue */
  if ((int)blockIdx.y >= a.n_appends) {
    da_seg_chunk(segs[blockIdx.y - a.n_appends], blockIdx.x);
    return;
  }
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
  const uint4 *kin = reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(ap.k) + src);
  const uint4 *vin = reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(ap.v) + src);
  uint16_t *kv = static_cast<uint16_t *>(a.kv);
  *reinterpret_cast<uint4 *>(kv + dst) = *kin;
  *reinterpret_cast<uint4 *>(kv + dst + a.n_kv_heads * slab) = *vin;
}

} // namespace

extern "C" int da_cuda_append(const da_cu_args *a, const da_cu_seg *segs, int n_segs, int64_t seg_max,
                              cudaStream_t stream) {
  const int n_app = a->max_append_tokens > 0 ? a->n_appends : 0;
  if (n_segs <= 0 || seg_max <= 0) n_segs = 0;
  if (n_app + n_segs == 0) return 0;
  if ((int64_t)n_app + n_segs > 65535) return (int)cudaErrorInvalidValue; /* the caller launches them apart */
  const int64_t chunks = (int64_t)a->max_append_tokens * a->n_kv_heads * (a->head_dim / 8);
  int64_t x = n_app > 0 ? (chunks + 255) / 256 : 1;
  if (n_segs > 0 && da_seg_chunks(seg_max) > x) x = da_seg_chunks(seg_max);
  da_cu_args g = *a;
  g.n_appends = n_app;
  append_kernel<<<dim3((unsigned)x, (unsigned)(n_app + n_segs)), 256, 0, stream>>>(g, segs);
  return (int)cudaGetLastError();
}
