/*
 * test_mma_transpose.cu — does mma.sync.m16n8k16 give the same fp32 bits for C0 + A B^T and
 * for (C0^T + B A^T)^T, i.e. does an element's bits depend on which operand is A?
 *
 * The premise of a decode form with the keys on the MMA's M side (S^T = K Q^T, O^T = V^T P^T;
 * kernels/cuda/NOTES.md v5.5): it keeps the contract's bits only if they do not. Seeded bf16
 * inputs in five families (normal, wide dynamic range, cancellation, softmax-like P, large
 * accumulators), the shapes of S at head_dim 128 (64 x 64 and 64 x 16) and of P V (64 x 128
 * and 16 x 128), k over the inner dimension ascending in steps of 16 both ways. Each result is
 * also checked against an fp64 reference, so that a layout mistake cannot pass as "equal".
 * wgmma equals mma.sync in the usual orientation (test_mma_bits.cu); wgmma with the keys on M
 * is not covered here.
 * Exit 0: no element differs; 1: some differ or a result is wrong; 77: no sm_90 device.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

namespace {

__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pair(const uint16_t *p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 16); }

/* C[M][N] = C0 + A[M][K] B[N][K]^T, k ascending in steps of 16; one warp per 16 x 8 tile. */
__global__ void mm(const uint16_t *A, const uint16_t *B, const float *C0, float *C, int M, int N, int K) {
  const int warp = (int)((blockIdx.x * blockDim.x + threadIdx.x) / 32), lane = (int)threadIdx.x % 32;
  const int r0 = warp / (N / 8) * 16, c0 = warp % (N / 8) * 8;
  if (r0 >= M) return;
  const int g = lane >> 2, q = lane & 3;
  const int e[4][2] = {{r0 + g, c0 + 2 * q}, {r0 + g, c0 + 2 * q + 1}, {r0 + g + 8, c0 + 2 * q}, {r0 + g + 8, c0 + 2 * q + 1}};
  float d[4];
  for (int i = 0; i < 4; i++) d[i] = C0[e[i][0] * N + e[i][1]];
  for (int k0 = 0; k0 < K; k0 += 16) {
    const uint32_t a[4] = {pair(A + (r0 + g) * K + k0 + 2 * q), pair(A + (r0 + g + 8) * K + k0 + 2 * q),
                           pair(A + (r0 + g) * K + k0 + 2 * q + 8), pair(A + (r0 + g + 8) * K + k0 + 2 * q + 8)};
    mma16816(d, a, pair(B + (c0 + g) * K + k0 + 2 * q), pair(B + (c0 + g) * K + k0 + 2 * q + 8));
  }
  for (int i = 0; i < 4; i++) C[e[i][0] * N + e[i][1]] = d[i];
}

uint64_t rng = 88172645463325252ull;
double uniform() {
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return (double)(rng >> 11) * (1.0 / 9007199254740992.0);
}
double gauss() { return sqrt(-2.0 * log(uniform() + 1e-300)) * cos(6.283185307179586 * uniform()); }

uint16_t to_bf16(double x) {
  const __nv_bfloat16 h = __float2bfloat16_rn((float)x);
  uint16_t u;
  memcpy(&u, &h, 2);
  return u;
}
double from_bf16(uint16_t u) {
  uint32_t w = (uint32_t)u << 16;
  float f;
  memcpy(&f, &w, 4);
  return f;
}

/* Family fam's element i of operand `first` (A) or not (B). */
double value(int fam, int i, bool first) {
  double x = gauss();
  if (fam == 1) x *= ldexp(1.0, (int)(uniform() * 40) - 20);                       /* wide range */
  if (fam == 2) x = (first && i % 2 ? -1.0 : 1.0) * (1.0 + 1e-3 * gauss());       /* cancellation */
  if (fam == 3 && first) x = fabs(x) * 0.1;                                        /* softmax-like P */
  return x;
}

bool ok(cudaError_t e, const char *what) {
  if (e == cudaSuccess) return true;
  fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  return false;
}

/* Runs one shape and family; returns the differing elements, or -1 on an error. */
long run(int M, int N, int K, int fam, const char *what) {
  const size_t na = (size_t)M * K, nb = (size_t)N * K, nc = (size_t)M * N;
  uint16_t *A = (uint16_t *)malloc(na * 2), *B = (uint16_t *)malloc(nb * 2);
  float *C0 = (float *)calloc(nc, 4), *C0t = (float *)calloc(nc, 4), *C = (float *)malloc(nc * 4), *T = (float *)malloc(nc * 4);
  for (size_t i = 0; i < na; i++) A[i] = to_bf16(value(fam, (int)i, true));
  for (size_t i = 0; i < nb; i++) B[i] = to_bf16(value(fam, (int)i, false));
  if (fam == 4)
    for (int i = 0; i < M; i++)
      for (int j = 0; j < N; j++) C0[i * N + j] = C0t[j * M + i] = (float)(1000.0 * gauss());
  uint16_t *dA = NULL, *dB = NULL;
  float *dC0 = NULL, *dC0t = NULL, *dC = NULL, *dT = NULL;
  long diff = -1;
  const int warps = M / 16 * (N / 8);
  if (!ok(cudaMalloc(&dA, na * 2), "cudaMalloc") || !ok(cudaMalloc(&dB, nb * 2), "cudaMalloc") ||
      !ok(cudaMalloc(&dC0, nc * 4), "cudaMalloc") || !ok(cudaMalloc(&dC0t, nc * 4), "cudaMalloc") ||
      !ok(cudaMalloc(&dC, nc * 4), "cudaMalloc") || !ok(cudaMalloc(&dT, nc * 4), "cudaMalloc") ||
      !ok(cudaMemcpy(dA, A, na * 2, cudaMemcpyHostToDevice), "copy") ||
      !ok(cudaMemcpy(dB, B, nb * 2, cudaMemcpyHostToDevice), "copy") ||
      !ok(cudaMemcpy(dC0, C0, nc * 4, cudaMemcpyHostToDevice), "copy") ||
      !ok(cudaMemcpy(dC0t, C0t, nc * 4, cudaMemcpyHostToDevice), "copy"))
    goto out;
  mm<<<(warps + 3) / 4, 128>>>(dA, dB, dC0, dC, M, N, K);  /* C = C0 + A B^T */
  mm<<<(warps + 3) / 4, 128>>>(dB, dA, dC0t, dT, N, M, K); /* T = C0^T + B A^T */
  if (!ok(cudaGetLastError(), "launch") || !ok(cudaMemcpy(C, dC, nc * 4, cudaMemcpyDeviceToHost), "copy") ||
      !ok(cudaMemcpy(T, dT, nc * 4, cudaMemcpyDeviceToHost), "copy"))
    goto out;
  diff = 0;
  for (int i = 0; i < M; i++) {
    for (int j = 0; j < N; j++) {
      double ref = C0[i * N + j], mag = fabs(ref);
      for (int k = 0; k < K; k++) {
        const double p = from_bf16(A[i * K + k]) * from_bf16(B[j * K + k]);
        ref += p, mag += fabs(p);
      }
      if (fabs(C[i * N + j] - ref) > 1e-5 * mag + 1e-30) {
        fprintf(stderr, "%s family %d: C[%d][%d] = %.9g, fp64 %.9g: wrong result\n", what, fam, i, j, C[i * N + j], ref);
        diff = -1;
        goto out;
      }
      if (memcmp(&C[i * N + j], &T[j * M + i], 4) != 0) {
        if (diff < 3) printf("  C[%d][%d] %.9g, transposed %.9g\n", i, j, C[i * N + j], T[j * M + i]);
        diff++;
      }
    }
  }
  printf("%-32s family %d: %ld of %zu differ\n", what, fam, diff, nc);
out:
  cudaFree(dA), cudaFree(dB), cudaFree(dC0), cudaFree(dC0t), cudaFree(dC), cudaFree(dT);
  free(A), free(B), free(C0), free(C0t), free(C), free(T);
  return diff;
}

} // namespace

int main() {
  int ndev = 0;
  cudaDeviceProp prop;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0 || cudaGetDeviceProperties(&prop, 0) != cudaSuccess ||
      prop.major < 9) {
    printf("no sm_90 device: skipped\n");
    return 77;
  }
  static const struct {
    int M, N, K;
    const char *what;
  } shapes[] = {{64, 64, 128, "S = Q K^T, 64 x 64, d 128"},
                {64, 16, 128, "S, 64 rows x 16 keys, d 128"},
                {64, 128, 64, "O = P V, 64 x 128"},
                {16, 128, 64, "O, 16 rows x 128"}};
  long total = 0;
  for (int fam = 0; fam < 5; fam++) {
    for (const auto &s : shapes) {
      const long d = run(s.M, s.N, s.K, fam, s.what);
      if (d < 0) return 1;
      total += d;
    }
  }
  printf("%s: %ld elements differ\n", total == 0 ? "PASS" : "FAIL", total);
  return total == 0 ? 0 : 1;
}
