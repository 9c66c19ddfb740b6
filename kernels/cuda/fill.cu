/*
 * fill.cu — pool fills: NaN poison for tests (every byte 0xff: NaN in bf16, fp16 and fp32)
 * and hash-based random values for benchmarks (no host transfer of large pools).
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda_kernels.h"
#include "pdl.cuh"

namespace {

__global__ void poison_kernel(uint32_t *dst, size_t n) {
  da_pdl_trigger(); /* pdl.cuh */
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    dst[i] = 0xffffffffu;
}

__device__ __forceinline__ uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void random_kernel(uint16_t *dst, size_t n, int bf16, uint64_t seed) {
  da_pdl_trigger(); /* pdl.cuh */
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const uint64_t h = mix(seed + 0x9e3779b97f4a7c15ull * (i + 1));
    /* Sum of four uniforms in [-0.5, 0.5), scaled to unit variance (Irwin-Hall). */
    float s = 0.0f;
    for (int k = 0; k < 4; k++) s += (float)((h >> (16 * k)) & 0xffff) * (1.0f / 65536.0f) - 0.5f;
    s *= 1.7320508f;
    if (bf16) {
      __nv_bfloat16 b = __float2bfloat16_rn(s);
      dst[i] = *reinterpret_cast<uint16_t *>(&b);
    } else {
      __half b = __float2half_rn(s);
      dst[i] = *reinterpret_cast<uint16_t *>(&b);
    }
  }
}

} // namespace

extern "C" int da_cuda_fill(void *dst, size_t n, int mode, int bf16, uint64_t seed, cudaStream_t stream) {
  if (n == 0) return 0;
  size_t blocks = (n + 255) / 256;
  if (blocks > 8192) blocks = 8192;
  if (mode == 0) poison_kernel<<<(unsigned)blocks, 256, 0, stream>>>(static_cast<uint32_t *>(dst), n);
  else random_kernel<<<(unsigned)blocks, 256, 0, stream>>>(static_cast<uint16_t *>(dst), n, bf16, seed);
  return (int)cudaGetLastError();
}
