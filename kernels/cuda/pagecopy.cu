/*
 * pagecopy.cu — copy-on-write page copies: pool page dst = pool page src, whole pages (every
 * layer, K and V), 16 bytes per thread. The copies of one launch must be independent (no
 * page is both a source and a destination); the backend splits dependent copies into
 * ordered launches.
 */
#include "cuda_kernels.h"
#include "pdl.cuh"

namespace {

__global__ void __launch_bounds__(256) page_copy_kernel(uint4 *kv, int64_t page_vecs, const int32_t *pairs) {
  da_pdl_trigger(); /* pdl.cuh */
  const int32_t src = pairs[2 * blockIdx.y], dst = pairs[2 * blockIdx.y + 1];
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < page_vecs;
       i += (int64_t)gridDim.x * blockDim.x)
    kv[(int64_t)dst * page_vecs + i] = kv[(int64_t)src * page_vecs + i];
}

} // namespace

extern "C" int da_cuda_page_copy(void *kv, int64_t page_bytes, const int32_t *pairs, int n,
                                 cudaStream_t stream) {
  if (n == 0) return 0;
  const int64_t vecs = page_bytes / 16;
  int64_t bx = (vecs + 255) / 256;
  if (bx > 64) bx = 64;
  page_copy_kernel<<<dim3((unsigned)bx, (unsigned)n), 256, 0, stream>>>(static_cast<uint4 *>(kv), vecs, pairs);
  return (int)cudaGetLastError();
}
