/*
 * segcopy.cu — one launch that copies a list of byte segments between device addresses:
 * how the data planes' tensors enter and leave the batch without a host copy. A source or
 * destination may be device memory of another process (CUDA IPC) or pinned host memory
 * mapped for the device (a shared-memory arena), read or written over PCIe.
 *
 * Grid: x chunks of DA_CU_SEG_CHUNK bytes, y segments (striding past 65535). A chunk uses
 * 16-byte loads and stores when its segment's source and destination are 16-byte aligned,
 * else 2-byte ones (tensors are dtype-aligned; lengths even).
 */
#include "cuda_kernels.h"
#include "pdl.cuh"

namespace {

__global__ void segcopy_kernel(const da_cu_seg *segs, int n) {
  da_pdl_trigger(); /* pdl.cuh */
  for (int s = blockIdx.y; s < n; s += gridDim.y) {
    const da_cu_seg g = segs[s];
    const int64_t b0 = (int64_t)blockIdx.x * DA_CU_SEG_CHUNK;
    if (b0 >= g.bytes) continue;
    const int64_t b1 = b0 + DA_CU_SEG_CHUNK < g.bytes ? b0 + DA_CU_SEG_CHUNK : g.bytes;
    const char *src = static_cast<const char *>(g.src);
    char *dst = static_cast<char *>(g.dst);
    if ((((uintptr_t)src | (uintptr_t)dst) & 15) == 0) {
      const int64_t v1 = b0 + ((b1 - b0) & ~(int64_t)15);
      for (int64_t i = b0 + 16 * (int64_t)threadIdx.x; i < v1; i += 16 * (int64_t)blockDim.x)
        *reinterpret_cast<uint4 *>(dst + i) = *reinterpret_cast<const uint4 *>(src + i);
      for (int64_t i = v1 + 2 * (int64_t)threadIdx.x; i < b1; i += 2 * (int64_t)blockDim.x)
        *reinterpret_cast<uint16_t *>(dst + i) = *reinterpret_cast<const uint16_t *>(src + i);
    } else {
      for (int64_t i = b0 + 2 * (int64_t)threadIdx.x; i < b1; i += 2 * (int64_t)blockDim.x)
        *reinterpret_cast<uint16_t *>(dst + i) = *reinterpret_cast<const uint16_t *>(src + i);
    }
  }
}

} // namespace

extern "C" int da_cuda_segcopy(const da_cu_seg *segs, int n, int64_t max_bytes, cudaStream_t stream) {
  if (n <= 0 || max_bytes <= 0) return 0;
  const int64_t chunks = (max_bytes + DA_CU_SEG_CHUNK - 1) / DA_CU_SEG_CHUNK;
  dim3 grid((unsigned)(chunks < 65535 ? chunks : 65535), (unsigned)(n < 65535 ? n : 65535));
  if (chunks > 65535) return (int)cudaErrorInvalidValue; /* 2 GiB segments: larger than any staging */
  segcopy_kernel<<<grid, 256, 0, stream>>>(segs, n);
  return (int)cudaGetLastError();
}
