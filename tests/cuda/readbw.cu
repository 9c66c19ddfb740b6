/*
 * readbw.cu — the device's memory ceilings for the kernel notes (not a test, not in the
 * build): read-only bandwidth from n SMs (one 1024-thread CTA an SM, forced by its shared
 * memory; four 16-byte non-caching loads in flight a thread over 2 GiB) for n = all SMs down
 * to a quarter of them, and a plain copy. Best of five timed launches after a warm-up.
 * Run: `bash tests/cuda/run_gpu.sh ceiling` (nvcc -O3 for sm_90, then the binary).
 */
#include <cstdint>
#include <cstdio>

#define SMEM (150 * 1024) /* more than half an SM's shared memory: one CTA an SM */

__device__ __forceinline__ uint32_t ld_xor(const uint4 *p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v.x ^ v.y ^ v.z ^ v.w;
}

__global__ void __launch_bounds__(1024, 1) read_kernel(const uint4 *p, size_t n, uint32_t *sink) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  uint32_t x = 0;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i + 3 * stride < n; i += 4 * stride)
    x ^= ld_xor(p + i) ^ ld_xor(p + i + stride) ^ ld_xor(p + i + 2 * stride) ^ ld_xor(p + i + 3 * stride);
  if (x == 0x9e3779b9u) *sink = x; /* keeps the loads; never true for the memset pattern */
}

__global__ void copy_kernel(const uint4 *p, uint4 *q, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) q[i] = p[i];
}

#define CHECK(x)                                                           \
  do {                                                                     \
    cudaError_t e_ = (x);                                                  \
    if (e_ != cudaSuccess) {                                               \
      fprintf(stderr, "readbw: %s: %s\n", #x, cudaGetErrorString(e_));     \
      return 1;                                                            \
    }                                                                      \
  } while (0)

int main() {
  const size_t bytes = 2ull << 30, n = bytes / 16;
  uint4 *p = nullptr, *q = nullptr;
  uint32_t *sink = nullptr;
  CHECK(cudaMalloc(&p, bytes));
  CHECK(cudaMalloc(&q, bytes / 2));
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMemset(p, 1, bytes));
  CHECK(cudaFuncSetAttribute(read_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  int nsm = 0;
  CHECK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("%s, %d SMs\n", prop.name, nsm);
  const int grids[] = {nsm, nsm - 4, 3 * nsm / 4, nsm / 2, nsm / 3, nsm / 4};
  for (int g : grids) {
    float best = 1e30f;
    for (int r = 0; r < 6; r++) {
      CHECK(cudaEventRecord(e0));
      read_kernel<<<g, 1024, SMEM>>>(p, n, sink);
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (r > 0 && ms < best) best = ms;
    }
    printf("read, %3d SMs: %.3f ms, %.3f TB/s, %.1f GB/s an SM\n", g, best, bytes / best / 1e9, bytes / best / 1e6 / g);
  }
  float best = 1e30f;
  for (int r = 0; r < 6; r++) {
    CHECK(cudaEventRecord(e0));
    copy_kernel<<<nsm * 8, 256>>>(p, q, n / 2);
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (r > 0 && ms < best) best = ms;
  }
  printf("copy, 1 GiB read + 1 GiB written: %.3f ms, %.3f TB/s moved\n", best, bytes / best / 1e9);
  CHECK(cudaGetLastError());
  return 0;
}
