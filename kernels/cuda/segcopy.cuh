/*
 * segcopy.cuh — one CTA's share of a byte-segment copy between device addresses (segcopy.cu's
 * kernel, and the append kernel, whose launch also gathers the batch's queries: append.cu).
 */
#ifndef DA_CUDA_SEGCOPY_CUH
#define DA_CUDA_SEGCOPY_CUH

#include "cuda_kernels.h"

/* Chunk x (DA_CU_SEG_CHUNK bytes) of segment g, by the CTA's threads: 16-byte loads and stores
 * when the segment's source and destination are 16-byte aligned, else 2-byte ones (tensors
 * are dtype-aligned; lengths even). */
__device__ __forceinline__ void da_seg_chunk(const da_cu_seg g, int64_t x) {
  const int64_t b0 = x * DA_CU_SEG_CHUNK;
  if (b0 >= g.bytes) return;
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

/* The CTAs along x that a copy of segments of at most max_bytes takes. */
static inline int64_t da_seg_chunks(int64_t max_bytes) { return (max_bytes + DA_CU_SEG_CHUNK - 1) / DA_CU_SEG_CHUNK; }

#endif /* DA_CUDA_SEGCOPY_CUH */
