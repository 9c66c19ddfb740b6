#include <stdio.h>

#include <cuda_runtime.h>

#include "devmem.h"

int da_devmem_available(char *why, size_t len) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    snprintf(why, len, "no CUDA device: %s", e != cudaSuccess ? cudaGetErrorString(e) : "none found");
    (void)cudaGetLastError();
    return 0;
  }
  return 1;
}

void *da_devmem_alloc(size_t n) {
  void *p = NULL;
  if (cudaMalloc(&p, n) != cudaSuccess) {
    (void)cudaGetLastError();
    return NULL;
  }
  return p;
}

void da_devmem_free(void *p) {
  if (p) (void)cudaFree(p);
}

int da_devmem_upload(void *dst, const void *src, size_t n) {
  return cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice) == cudaSuccess ? 0 : -1;
}

int da_devmem_download(void *dst, const void *src, size_t n) {
  return cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost) == cudaSuccess ? 0 : -1;
}

int da_devmem_sync(void) { return cudaDeviceSynchronize() == cudaSuccess ? 0 : -1; }
