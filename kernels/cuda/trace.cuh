/*
 * trace.cuh — timeline points for timing builds only (CMAKE_CUDA_FLAGS=-DDA_CUDA_TRACE;
 * `bash tests/cuda/run_gpu.sh trace`). DA_TRACE_IF(cond, slot) stores %globaltimer (ns) into
 * this translation unit's buffer at [blockIdx.x][slot] (blocks < 64, slots < 48) where cond
 * holds; the last write wins, so a bench that replays a graph keeps its last replay.
 * DA_TRACE_HOST(tag), called from a launcher, prints every non-zero entry at exit on stderr
 * as "<tag> <block> <slot> <ns>" (tests/cuda/trace_timeline.py reads them). A store is one
 * mov and one st.global, but the condition can lengthen a chain (it may wait on a load),
 * so a traced build's times are not the untraced build's. Without DA_CUDA_TRACE every macro
 * is empty: the kernels compile to the same code.
 */
#ifndef DA_CUDA_TRACE_CUH
#define DA_CUDA_TRACE_CUH

#ifdef DA_CUDA_TRACE
#include <stdio.h>
#include <stdlib.h>

namespace {
constexpr int DA_TRACE_BLOCKS = 64, DA_TRACE_SLOTS = 48;
__device__ unsigned long long da_trace_buf[DA_TRACE_BLOCKS][DA_TRACE_SLOTS];
const char *da_trace_tag = "?";

__device__ __forceinline__ void da_trace(int slot) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  if (blockIdx.x < DA_TRACE_BLOCKS && slot < DA_TRACE_SLOTS) da_trace_buf[blockIdx.x][slot] = t;
}

void da_trace_dump() {
  static unsigned long long h[DA_TRACE_BLOCKS][DA_TRACE_SLOTS];
  if (cudaDeviceSynchronize() != cudaSuccess || cudaMemcpyFromSymbol(h, da_trace_buf, sizeof(h)) != cudaSuccess) return;
  for (int b = 0; b < DA_TRACE_BLOCKS; b++)
    for (int k = 0; k < DA_TRACE_SLOTS; k++)
      if (h[b][k]) fprintf(stderr, "%s %d %d %llu\n", da_trace_tag, b, k, h[b][k]);
}
} // namespace

#define DA_TRACE_IF(cond, slot) \
  do {                          \
    if (cond) da_trace(slot);   \
  } while (0)
#define DA_TRACE_HOST(tag)        \
  do {                            \
    static int registered_ = 0;   \
    if (!registered_) {           \
      registered_ = 1;            \
      da_trace_tag = (tag);       \
      atexit(da_trace_dump);      \
    }                             \
  } while (0)
#else
#define DA_TRACE_IF(cond, slot) ((void)0)
#define DA_TRACE_HOST(tag) ((void)0)
#endif

#endif /* DA_CUDA_TRACE_CUH */
