/*
 * test_div.cu — numerics.cuh's fast row division against __fdiv_rn, bit for bit.
 *
 * The split finalize (acc / l) and the merge ((a o + b o_j) / s) divide with da_div_fast
 * wherever da_div_fast_ok holds and with __fdiv_rn elsewhere; the kernels' bits (and so the
 * fingerprint) are those of __fdiv_rn only if the two agree on every quotient the fast path
 * takes. Cases, each a grid of 2^24 numerators per divisor family:
 *   finalize  l in [1, 2^21) (a split's softmax sum: >= 1, at most S keys), 4096 mantissas
 *             spread over l's first binade and random ones above, acc of random sign and
 *             exponent over the whole fast range [2^-90, 2^91) and a little beyond
 *   merge     s in [1, 2] (a + b with max(a, b) == 1), numerators as above
 *   edges     divisors at the fast range's ends (2^-32, just under 2^33), powers of two,
 *             all-ones mantissas; numerators at the range's ends and at binade edges
 *   outside   zeros of both signs, subnormals, inf, NaN, huge and tiny numerators: the
 *             fast path must refuse them (da_div_fast_ok false), never return other bits
 * Exit 0: no quotient differs; 1: some differ (the first ones printed); 77: no device.
 */
#include <cuda_runtime.h>

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "numerics.cuh"

namespace {

__host__ __device__ inline uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__device__ inline float from_bits(uint32_t u) { return __uint_as_float(u); }

/* Divisor i of a family. */
__device__ float divisor(int family, uint32_t i, uint64_t seed) {
  const uint64_t r = mix(seed ^ (0x1000000ull * family + i));
  switch (family) {
  case 0: /* finalize: l in [1, 2^20], first binade's mantissas in order, then random */
    if (i < 4096) return from_bits(0x3f800000u | (i << 11) | (uint32_t)(r & 0x7ff));
    return from_bits(((127u + (uint32_t)(r >> 40) % 21u) << 23) | (uint32_t)(r & 0x7fffff));
  case 1: /* merge: s in [1, 2] */
    return i == 0 ? 2.0f : from_bits(0x3f800000u | (uint32_t)(r & 0x7fffff));
  default: { /* edges of the divisor range */
    static const uint32_t e[] = {0x2f800000u, 0x2f800001u, 0x2fffffffu, 0x3f800000u, 0x3fffffffu, 0x3f800001u,
                                 0x4fffffffu, 0x4f800000u, 0x4f7fffffu, 0x47ffffffu, 0x4b000000u, 0x3f7fffffu};
    return from_bits(e[i % (sizeof(e) / sizeof(e[0]))]);
  }
  }
}

/* Numerator k: random sign, exponent over the fast range (and a little beyond, so the
 * refusal is exercised), random mantissa; every 16th one at a binade edge. */
__device__ float numerator(uint32_t k, uint64_t seed) {
  const uint64_t r = mix(seed * 31 + k);
  const uint32_t sign = (uint32_t)(r >> 63) << 31;
  const uint32_t ex = 127u - 94u + (uint32_t)((r >> 32) % 190u); /* 2^-94 .. 2^95 */
  uint32_t man = (uint32_t)(r & 0x7fffff);
  if ((k & 15) == 0) man = (k & 16) ? 0x7fffffu : 0u;
  if ((k & 15) == 1) man = (k & 16) ? 1u : 0x7ffffeu;
  return from_bits(sign | (ex << 23) | man);
}

struct result {
  unsigned long long checked, fast, differ;
  float a, b, got, want; /* the first difference */
};

__global__ void check(int family, uint32_t n_div, uint32_t n_num, uint64_t seed, result *res) {
  const uint64_t total = (uint64_t)n_div * n_num;
  unsigned long long checked = 0, fast = 0, differ = 0;
  for (uint64_t t = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; t < total; t += (uint64_t)gridDim.x * blockDim.x) {
    const float b = divisor(family, (uint32_t)(t / n_num), seed);
    const float a = numerator((uint32_t)(t % n_num), seed ^ (t / n_num));
    const da_div d = da_div_by(b);
    checked++;
    if (!da_div_fast_ok(d, a)) continue;
    fast++;
    const float got = da_div_fast(d, a), want = __fdiv_rn(a, b);
    if (__float_as_uint(got) != __float_as_uint(want)) {
      differ++;
      if (atomicAdd(&res->differ, 1ull) == 0) res->a = a, res->b = b, res->got = got, res->want = want;
      continue;
    }
  }
  atomicAdd(&res->checked, checked);
  atomicAdd(&res->fast, fast);
  (void)differ;
}

/* Values the fast path must refuse, against every divisor family's first divisors. */
__global__ void refuse(int *bad) {
  const uint32_t specials[] = {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x00800000u, 0x7f800000u,
                               0xff800000u, 0x7fc00000u, 0x7f7fffffu, 0x6d000000u, 0x127fffffu, 0x927fffffu};
  const float b = 1.5f;
  const da_div d = da_div_by(b);
  for (int i = 0; i < (int)(sizeof(specials) / sizeof(specials[0])); i++)
    if (da_div_fast_ok(d, __uint_as_float(specials[i]))) atomicAdd(bad, 1);
  const uint32_t bad_div[] = {0x00000000u, 0x7f800000u, 0x7fc00000u, 0x2f7fffffu, 0x50000000u, 0x00400000u};
  for (int i = 0; i < (int)(sizeof(bad_div) / sizeof(bad_div[0])); i++)
    if (da_div_fast_ok(da_div_by(__uint_as_float(bad_div[i])), 1.0f)) atomicAdd(bad, 1);
  /* The bounds themselves: 2^-90 and just under 2^91 are in, their neighbours out. */
  if (!da_div_fast_ok(d, __uint_as_float(0x12800000u)) || !da_div_fast_ok(d, __uint_as_float(0x6cffffffu)))
    atomicAdd(bad, 1);
}

} // namespace

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    printf("no CUDA device: skipped\n");
    return 77;
  }
  static const char *names[] = {"finalize (l in [1, 2^21))", "merge (s in [1, 2])", "divisor range edges"};
  const uint32_t n_div[] = {4096 + 4096, 2048, 12}, n_num = 1u << 15;
  result *res;
  int *bad;
  if (cudaMallocManaged(&res, sizeof(result)) != cudaSuccess || cudaMallocManaged(&bad, sizeof(int)) != cudaSuccess) {
    fprintf(stderr, "cudaMallocManaged failed\n");
    return 1;
  }
  int failed = 0;
  for (int f = 0; f < 3; f++) {
    memset(res, 0, sizeof(*res));
    const uint32_t nn = f == 2 ? n_num * 64 : n_num; /* edges: 2^21 numerators each */
    check<<<1024, 256>>>(f, n_div[f], nn, 0xd1f0 + f, res);
    if (cudaDeviceSynchronize() != cudaSuccess) {
      fprintf(stderr, "kernel failed: %s\n", cudaGetErrorString(cudaGetLastError()));
      return 1;
    }
    printf("%-28s %llu quotients, %llu on the fast path, %llu differ from __fdiv_rn\n", names[f], res->checked,
           res->fast, res->differ);
    if (res->differ > 0) {
      printf("  first: %a / %a: fast %a, __fdiv_rn %a\n", res->a, res->b, res->got, res->want);
      failed = 1;
    }
    if (res->fast < res->checked / 2) {
      printf("  the fast path took fewer than half the quotients: the ranges are wrong\n");
      failed = 1;
    }
  }
  *bad = 0;
  refuse<<<1, 1>>>(bad);
  cudaDeviceSynchronize();
  printf("refusals: %d special values accepted by the fast path (want 0)\n", *bad);
  if (*bad != 0) failed = 1;
  printf("%s\n", failed ? "FAIL" : "OK: the fast division gives __fdiv_rn's bits");
  return failed;
}
