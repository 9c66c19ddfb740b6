/*
 * segcopy.cu — one launch that copies a list of byte segments between device addresses:
 * how the data planes' tensors enter and leave the batch without a host copy. A source or
 * destination may be device memory of another process (CUDA IPC) or pinned host memory
 * mapped for the device (a shared-memory arena), read or written over PCIe.
 *
 * Grid: x chunks of DA_CU_SEG_CHUNK bytes, y segments (striding past 65535); segcopy.cuh.
 */
#include "cuda_kernels.h"
#include "pdl.cuh"
#include "segcopy.cuh"

namespace {

__global__ void segcopy_kernel(const da_cu_seg *segs, int n) {
  da_pdl_trigger(); /* pdl.cuh */
  for (int s = blockIdx.y; s < n; s += gridDim.y) da_seg_chunk(segs[s], blockIdx.x);
}

} // namespace

extern "C" int da_cuda_segcopy(const da_cu_seg *segs, int n, int64_t max_bytes, cudaStream_t stream) {
  if (n <= 0 || max_bytes <= 0) return 0;
  const int64_t chunks = da_seg_chunks(max_bytes);
  dim3 grid((unsigned)(chunks < 65535 ? chunks : 65535), (unsigned)(n < 65535 ? n : 65535));
  if (chunks > 65535) return (int)cudaErrorInvalidValue; /* 2 GiB segments: larger than any staging */
  segcopy_kernel<<<grid, 256, 0, stream>>>(segs, n);
  return (int)cudaGetLastError();
}
