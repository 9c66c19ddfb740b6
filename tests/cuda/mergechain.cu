/*
 * mergechain.cu — cycles a step of the combine's lse chain (numerics.cuh
 * da_merge_weights_chain: max, sub, two ex2, add, lg2, add) on one warp, with 32 lanes and
 * with one lane running it: whether the MUFU issue of a full warp sets the step's latency.
 * Run: `bash tests/cuda/run_gpu.sh mergechain`.
 */
#include <cstdio>

#include "numerics.cuh"

__global__ void chain_kernel(const float *lse_j, int n, int lanes, long long *cycles, float *out) {
  if ((int)(threadIdx.x & 31) >= lanes) return;
  float lse = lse_j[0];
  const long long t0 = clock64();
  for (int i = 1; i < n; i++) lse = da_merge_weights_chain(lse, lse_j[i & 63]).lse;
  const long long t1 = clock64();
  if (threadIdx.x == 0) *cycles = t1 - t0, *out = lse;
}

int main() {
  float h[64], *d = nullptr, *o = nullptr;
  long long *c = nullptr, hc = 0;
  for (int i = 0; i < 64; i++) h[i] = (float)((i * 37) % 64) * 0.25f - 8.0f;
  cudaMalloc(&d, sizeof(h)), cudaMalloc(&o, 4), cudaMalloc(&c, 8);
  cudaMemcpy(d, h, sizeof(h), cudaMemcpyHostToDevice);
  const int n = 4096;
  for (int lanes : {32, 8, 1}) {
    for (int r = 0; r < 2; r++) chain_kernel<<<1, 32>>>(d, n, lanes, c, o);
    if (cudaMemcpy(&hc, c, 8, cudaMemcpyDeviceToHost) != cudaSuccess) return 1;
    printf("merge chain, %2d active lanes: %.1f cycles a step\n", lanes, (double)hc / (n - 1));
  }
  return 0;
}
