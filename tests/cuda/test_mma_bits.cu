/*
 * test_mma_bits.cu — do wgmma (sm_90a) and mma.sync.m16n8k16 give the same fp32 bits?
 *
 * On the same seeded 16-bit inputs (bf16 and fp16, head_dim 64 / 128 / 256, seven input
 * families: normal, wide dynamic range, cancellation inside and across k16 chunks,
 * subnormals, large and full-mantissa accumulators, softmax-like P), one warpgroup computes
 *   S = C0 + Q K^T   (64 x 64; k over head_dim ascending in steps of 16, one accumulator)
 *   O = C1 + P V     (64 x D;  k over the 64 keys ascending in steps of 16)
 * with mma.sync (the decode/prefill kernels' instruction, attn.cu) and with wgmma in the
 * forms a Hopper kernel would use, and compares every output bit:
 *   S: ss-group  Q and K from shared memory, all D/16 k-steps in one commit group
 *      ss-chunk  the same, commit + wait after every k-step
 *      rs-group  Q from registers (the mma.sync A fragment), K from shared memory
 *      ss-scale0 the first k-step with scale-d = 0 instead of a zeroed accumulator
 *                (reported, not part of the verdict: the kernels zero the accumulator)
 *      ss-keysM  S^T = C0^T + K Q^T, keys on M: K as A, 8 query rows a wgmma (m64n8k16)
 *   O: rs-group  P from registers, V from shared memory (transposed, MN-major), one group
 *      rs-chunk  the same, commit + wait after every k-step
 *      ss-group  P and V from shared memory
 *      ss-keysM  O^T = C1^T + V^T P^T: V as a transposed (MN-major) A, P as B, 8 query rows
 *                a wgmma (m64n8k16); with ss-keysM for S, the premise of a decode form
 *                whose MMAs carry the keys (NOTES.md v5.5)
 * Shared-memory tiles use the 128-byte swizzle and the descriptors of kernels/cuda/sm90.cuh
 * (the ones prefill_sm90.cu uses), so a descriptor or layout mistake shows as a large error
 * against an fp64 reference, apart from last-bit differences.
 *
 * Prints one line per (dtype, D, family) and the first differing elements, then a verdict.
 * Exit 0: every verdict form equals mma.sync bit for bit; 1: some differ, or a layout error;
 * 77: no sm_90 device (skipped).
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <utility>

#include "sm90.cuh"

using namespace da_sm90;

namespace {

constexpr int NS = 6; /* S variants: mma.sync, ss-group, ss-chunk, rs-group, ss-scale0, ss-keysM */
constexpr int NO = 5; /* O variants: mma.sync, rs-group, rs-chunk, ss-group, ss-keysM */
const char *s_name[NS] = {"mma.sync", "ss-group", "ss-chunk", "rs-group", "ss-scale0", "ss-keysM"};
const char *o_name[NO] = {"mma.sync", "rs-group", "rs-chunk", "ss-group", "ss-keysM"};

template <bool BF16>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint32_t pair(uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); }

/* D (m64n8k16, fp32: warp w rows [16w, 16w + 16), lane l row 16w + l / 4 (+ 8 for e >= 2),
 * column 2 (l % 4) + (e & 1)) += A B, both from shared memory; TA / TB: MN-major operand. */
template <bool BF16, int TA, int TB>
__device__ __forceinline__ void wg_ss_n8(float (&d)[4], uint64_t da, uint64_t db) {
  if constexpr (BF16)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, %6, %7;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "l"(da), "l"(db), "n"(TA), "n"(TB));
  else
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, %6, %7;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "l"(da), "l"(db), "n"(TA), "n"(TB));
}

/* The m16n8k16 A fragment of rows [r0, r0 + 16), k [k0, k0 + 16) of a row-major [.][ld]. */
__device__ __forceinline__ void a_frag(uint32_t (&a)[4], const uint16_t *A, int ld, int r0, int k0, int g, int q) {
  a[0] = pair(A[(r0 + g) * ld + k0 + 2 * q], A[(r0 + g) * ld + k0 + 2 * q + 1]);
  a[1] = pair(A[(r0 + g + 8) * ld + k0 + 2 * q], A[(r0 + g + 8) * ld + k0 + 2 * q + 1]);
  a[2] = pair(A[(r0 + g) * ld + k0 + 2 * q + 8], A[(r0 + g) * ld + k0 + 2 * q + 9]);
  a[3] = pair(A[(r0 + g + 8) * ld + k0 + 2 * q + 8], A[(r0 + g + 8) * ld + k0 + 2 * q + 9]);
}

/* Accumulator fragments of a warp's 16 rows over NT n8 blocks from columns c0 of [.][ld]. */
template <int NT>
__device__ __forceinline__ void c_load(float (&d)[NT][4], const float *C, int ld, int r0, int c0, int g, int q) {
#pragma unroll
  for (int n = 0; n < NT; n++) {
    d[n][0] = C[(r0 + g) * ld + c0 + 8 * n + 2 * q];
    d[n][1] = C[(r0 + g) * ld + c0 + 8 * n + 2 * q + 1];
    d[n][2] = C[(r0 + g + 8) * ld + c0 + 8 * n + 2 * q];
    d[n][3] = C[(r0 + g + 8) * ld + c0 + 8 * n + 2 * q + 1];
  }
}
template <int NT>
__device__ __forceinline__ void c_store(const float (&d)[NT][4], float *C, int ld, int r0, int c0, int g, int q) {
#pragma unroll
  for (int n = 0; n < NT; n++) {
    C[(r0 + g) * ld + c0 + 8 * n + 2 * q] = d[n][0];
    C[(r0 + g) * ld + c0 + 8 * n + 2 * q + 1] = d[n][1];
    C[(r0 + g + 8) * ld + c0 + 8 * n + 2 * q] = d[n][2];
    C[(r0 + g + 8) * ld + c0 + 8 * n + 2 * q + 1] = d[n][3];
  }
}

/* Copies a row-major [64][cols] global tile into the swizzled shared layout. */
__device__ void to_smem(unsigned char *dst, const uint16_t *src, int cols) {
  for (int i = threadIdx.x; i < 64 * cols / 8; i += blockDim.x) {
    const int r = i / (cols / 8), c = i % (cols / 8);
    *reinterpret_cast<uint4 *>(dst + swz128(r, c, 64)) = *reinterpret_cast<const uint4 *>(src + r * cols + c * 8);
  }
}

/* Which product and form a launch computes (one per launch keeps each kernel small, so that
 * the compiler neither spills nor splits a wgmma group). */
enum { V_S_MMA, V_S_SS, V_S_SS_CHUNK, V_S_RS, V_S_SS_SCALE0, V_S_KEYS, V_O_MMA, V_O_RS, V_O_RS_CHUNK, V_O_SS, V_O_KEYS, N_V };

/* One trial per CTA of 128 threads (one warpgroup). s_out: [trial][NS][64][64],
 * o_out: [trial][NO][64][D]. */
template <int D, bool BF16, int VAR>
__global__ void __launch_bounds__(128, 1)
bits_kernel(const uint16_t *gq, const uint16_t *gk, const float *gc0, const uint16_t *gp, const uint16_t *gv,
            const float *gc1, float *s_out, float *o_out) {
  constexpr int ON = D < 128 ? D : 128; /* N of one P.V wgmma */
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  /* The swizzle needs 1024-byte aligned tiles; the launch asks for 1 KiB of slack. */
  unsigned char *smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const int t = blockIdx.x;
  const uint16_t *Q = gq + (size_t)t * 64 * D, *K = gk + (size_t)t * 64 * D, *V = gv + (size_t)t * 64 * D;
  const uint16_t *P = gp + (size_t)t * 64 * 64;
  const float *C0 = gc0 + (size_t)t * 64 * 64, *C1 = gc1 + (size_t)t * 64 * D;
  float *So = s_out + (size_t)t * NS * 64 * 64, *Oo = o_out + (size_t)t * NO * 64 * D;
  unsigned char *qs = smem, *ks = qs + 128 * D, *vs = ks + 128 * D, *ps = vs + 128 * D;
  to_smem(qs, Q, D);
  to_smem(ks, K, D);
  to_smem(vs, V, D);
  to_smem(ps, P, 64);
  fence_async_smem();
  __syncthreads();
  const uint32_t qa = smem_addr(qs), ka = smem_addr(ks), va = smem_addr(vs), pa_s = smem_addr(ps);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int r0 = 16 * warp;

  if constexpr (VAR == V_S_MMA) {
    /* Per n8 block of keys, k-steps ascending into one accumulator (attn.cu's order). */
    float d[8][4];
    c_load<8>(d, C0, 64, r0, 0, g, q);
#pragma unroll 1
    for (int kk = 0; kk < D / 16; kk++) {
      uint32_t a[4];
      a_frag(a, Q, D, r0, 16 * kk, g, q);
#pragma unroll
      for (int n = 0; n < 8; n++) {
        const uint16_t *kr = K + (8 * n + g) * D + 16 * kk + 2 * q;
        mma16816<BF16>(d[n], a, pair(kr[0], kr[1]), pair(kr[8], kr[9]));
      }
    }
    c_store<8>(d, So, 64, r0, 0, g, q);
  } else if constexpr (VAR == V_S_SS || VAR == V_S_SS_CHUNK || VAR == V_S_SS_SCALE0 || VAR == V_S_RS) {
    constexpr int v = VAR == V_S_SS ? 1 : VAR == V_S_SS_CHUNK ? 2 : VAR == V_S_RS ? 3 : 4;
    float d[8][4];
    if constexpr (VAR == V_S_SS_SCALE0) {
#pragma unroll
      for (int n = 0; n < 8; n++) d[n][0] = d[n][1] = d[n][2] = d[n][3] = __int_as_float(0x7fc00000);
    } else {
      c_load<8>(d, C0, 64, r0, 0, g, q);
    }
    uint32_t a[VAR == V_S_RS ? D / 16 : 1][4];
    if constexpr (VAR == V_S_RS) {
#pragma unroll
      for (int kk = 0; kk < D / 16; kk++) a_frag(a[kk], Q, D, r0, 16 * kk, g, q);
    }
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
      const uint32_t off = (kk >> 2) * 64 * 128 + (kk & 3) * 32;
      if constexpr (VAR == V_S_RS) wg_rs<64, BF16, 0>(d, a[kk], desc_kmajor(ka + off), 1);
      else wg_ss<64, BF16, 0>(d, desc_kmajor(qa + off), desc_kmajor(ka + off), VAR == V_S_SS_SCALE0 && kk == 0 ? 0 : 1);
      if constexpr (VAR == V_S_SS_CHUNK) {
        wg_commit();
        wg_wait<0>();
        reg_fence(d);
        wg_fence();
      }
    }
    wg_commit();
    wg_wait<0>();
    reg_fence(d);
    c_store<8>(d, So + v * 64 * 64, 64, r0, 0, g, q);
  } else if constexpr (VAR == V_S_KEYS) {
    /* S^T, 8 query rows (a B block of 8 rows of Q: 1024 bytes) at a time; this thread's
     * elements are keys r0 + g (+ 8) of query rows 8 b + 2 q (+ 1), stored back as S. */
#pragma unroll 1
    for (int b = 0; b < 8; b++) {
      float d[4];
      for (int e = 0; e < 4; e++) d[e] = C0[(8 * b + 2 * q + (e & 1)) * 64 + r0 + g + 8 * (e >> 1)];
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; kk++) {
        const uint32_t off = (kk >> 2) * 64 * 128 + (kk & 3) * 32;
        wg_ss_n8<BF16, 0, 0>(d, desc_kmajor(ka + off), desc_kmajor(qa + off + b * 1024));
      }
      wg_commit();
      wg_wait<0>();
      for (int e = 0; e < 4; e++) asm volatile("" : "+f"(d[e])::"memory");
      for (int e = 0; e < 4; e++) So[(5 * 64 + 8 * b + 2 * q + (e & 1)) * 64 + r0 + g + 8 * (e >> 1)] = d[e];
    }
  } else if constexpr (VAR == V_O_KEYS) {
    /* O^T per 64 columns h and 8 query rows b: A = V^T (MN-major, 16 key rows a k-step),
     * B = P's rows 8 b .. 8 b + 7 (K-major); elements: column 64 h + r0 + g (+ 8) of query
     * rows 8 b + 2 q (+ 1), stored back as O. */
#pragma unroll 1
    for (int h = 0; h < D / 64; h++) {
#pragma unroll 1
      for (int b = 0; b < 8; b++) {
        float d[4];
        for (int e = 0; e < 4; e++) d[e] = C1[(8 * b + 2 * q + (e & 1)) * D + 64 * h + r0 + g + 8 * (e >> 1)];
        wg_fence();
#pragma unroll
        for (int kc = 0; kc < 4; kc++)
          wg_ss_n8<BF16, 1, 0>(d, desc_mnmajor(va + h * 64 * 128 + kc * 16 * 128, 64 * 128),
                               desc_kmajor(pa_s + kc * 32 + b * 1024));
        wg_commit();
        wg_wait<0>();
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(d[e])::"memory");
        for (int e = 0; e < 4; e++) Oo[(4 * 64 + 8 * b + 2 * q + (e & 1)) * D + 64 * h + r0 + g + 8 * (e >> 1)] = d[e];
      }
    }
  } else if constexpr (VAR == V_O_MMA) {
#pragma unroll 1
    for (int h = 0; h < D / ON; h++) {
      float d[ON / 8][4];
      c_load<ON / 8>(d, C1, D, r0, h * ON, g, q);
#pragma unroll 1
      for (int kc = 0; kc < 4; kc++) {
        uint32_t pf[4];
        a_frag(pf, P, 64, r0, 16 * kc, g, q);
#pragma unroll
        for (int n = 0; n < ON / 8; n++) {
          const int col = h * ON + 8 * n + g, k = 16 * kc + 2 * q;
          mma16816<BF16>(d[n], pf, pair(V[k * D + col], V[(k + 1) * D + col]),
                         pair(V[(k + 8) * D + col], V[(k + 9) * D + col]));
        }
      }
      c_store<ON / 8>(d, Oo, D, r0, h * ON, g, q);
    }
  } else {
    constexpr int v = VAR == V_O_RS ? 1 : VAR == V_O_RS_CHUNK ? 2 : 3;
    uint32_t pf[4][4];
#pragma unroll
    for (int kc = 0; kc < 4; kc++) a_frag(pf[kc], P, 64, r0, 16 * kc, g, q);
#pragma unroll 1
    for (int h = 0; h < D / ON; h++) {
      float d[ON / 8][4];
      c_load<ON / 8>(d, C1, D, r0, h * ON, g, q);
      wg_fence();
#pragma unroll
      for (int kc = 0; kc < 4; kc++) {
        const uint64_t db = desc_mnmajor(va + h * (ON / 64) * 64 * 128 + kc * 16 * 128, 64 * 128);
        if constexpr (VAR == V_O_SS) wg_ss<ON, BF16, 1>(d, desc_kmajor(pa_s + kc * 32), db, 1);
        else wg_rs<ON, BF16, 1>(d, pf[kc], db, 1);
        if constexpr (VAR == V_O_RS_CHUNK) {
          wg_commit();
          wg_wait<0>();
          reg_fence(d);
          wg_fence();
        }
      }
      wg_commit();
      wg_wait<0>();
      reg_fence(d);
      c_store<ON / 8>(d, Oo + v * 64 * D, D, r0, h * ON, g, q);
    }
  }
}

/* ---- host ------------------------------------------------------------------------------- */

struct rng {
  uint64_t s;
  uint64_t next() {
    s += 0x9E3779B97F4A7C15ull;
    uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uni() { return (next() >> 11) * (1.0 / 9007199254740992.0); }
  double normal() {
    double u = uni(), v = uni();
    if (u < 1e-300) u = 1e-300;
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
  }
  /* fp32 with a random full mantissa, sign and exponent e: (1 + m) * 2^e. */
  float full(int e) {
    const uint32_t m = (uint32_t)(next() & 0x7FFFFF);
    float f = ldexpf(1.0f + (float)m / 8388608.0f, e);
    return (next() & 1) ? -f : f;
  }
};

static uint16_t to16(double x, bool bf16) {
  if (bf16) {
    __nv_bfloat16 h = __float2bfloat16_rn((float)x);
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
  }
  __half h = __float2half_rn((float)x);
  uint16_t u;
  memcpy(&u, &h, 2);
  return u;
}
static double from16(uint16_t u, bool bf16) {
  if (bf16) {
    __nv_bfloat16 h;
    memcpy(&h, &u, 2);
    return (double)__bfloat162float(h);
  }
  __half h;
  memcpy(&h, &u, 2);
  return (double)__half2float(h);
}

enum { F_NORMAL, F_WIDE, F_CANCEL, F_SUBNORMAL, F_BIGACC, F_FULLACC, F_SOFTMAX, N_FAM };
const char *fam_name[N_FAM] = {"normal", "wide-range", "cancellation", "subnormal", "big-acc", "full-mantissa-acc",
                               "softmax-P"};

struct inputs {
  int D, T;
  bool bf16;
  uint16_t *q, *k, *p, *v;
  float *c0, *c1;
};

/* One value of family f for an input tensor (not the accumulators). */
static double val(rng &r, int f, bool bf16) {
  switch (f) {
  case F_WIDE: return r.normal() * ldexp(1.0, (int)(r.uni() * (bf16 ? 25 : 11)) - (bf16 ? 12 : 5));
  case F_SUBNORMAL:
    if (r.uni() < 0.5) return r.normal();
    return r.normal() * (bf16 ? ldexp(1.0, -(int)(100 + r.uni() * 34)) : ldexp(1.0, -(int)(14 + r.uni() * 10)));
  case F_FULLACC: return r.normal() * (1.0 / 128.0);
  default: return r.normal();
  }
}

static void make_inputs(inputs &in, int f, uint64_t seed) {
  rng r{seed};
  const int D = in.D;
  const bool bf = in.bf16;
  for (int t = 0; t < in.T; t++) {
    uint16_t *q = in.q + (size_t)t * 64 * D, *k = in.k + (size_t)t * 64 * D, *v = in.v + (size_t)t * 64 * D;
    uint16_t *p = in.p + (size_t)t * 64 * 64;
    float *c0 = in.c0 + (size_t)t * 64 * 64, *c1 = in.c1 + (size_t)t * 64 * D;
    for (int i = 0; i < 64 * D; i++) q[i] = to16(val(r, f, bf), bf), k[i] = to16(val(r, f, bf), bf), v[i] = to16(val(r, f, bf), bf);
    for (int i = 0; i < 64 * 64; i++) {
      double x = f == F_WIDE ? -r.uni() * 30.0 : -fabs(r.normal()) * 3.0;
      if (f == F_SUBNORMAL && r.uni() < 0.3) x = -(bf ? 120.0 : 14.0) - r.uni() * 10.0;
      p[i] = to16(exp2(x), bf);
    }
    if (f == F_CANCEL) {
      /* Second half of every k16 chunk cancels the first half up to a relative 2^-6. */
      for (int row = 0; row < 64; row++)
        for (int j = 0; j < D; j++)
          if (j % 16 >= 8) {
            q[row * D + j] = q[row * D + j - 8];
            k[row * D + j] = to16(-from16(k[row * D + j - 8], bf) * (1.0 + r.normal() / 64.0), bf);
          }
      for (int row = 0; row < 64; row++)
        for (int j = 0; j < 64; j++)
          if (j % 16 >= 8) p[row * 64 + j] = p[row * 64 + j - 8];
      for (int key = 0; key < 64; key++)
        if (key % 16 >= 8)
          for (int n = 0; n < D; n++)
            v[key * D + n] = to16(-from16(v[(key - 8) * D + n], bf) * (1.0 + r.normal() / 64.0), bf);
    }
    if (f == F_SOFTMAX) {
      /* P = exp2 of scaled scores minus the row max, rounded to the dtype (what the kernels feed P.V). */
      for (int row = 0; row < 64; row++) {
        double s[64], mx = -1e300;
        for (int n = 0; n < 64; n++) {
          double acc = 0.0;
          for (int j = 0; j < D; j++) acc += from16(q[row * D + j], bf) * from16(k[n * D + j], bf);
          s[n] = acc / sqrt((double)D) * 1.4426950408889634;
          if (s[n] > mx) mx = s[n];
        }
        for (int n = 0; n < 64; n++) p[row * 64 + n] = to16(exp2(s[n] - mx), bf);
      }
    }
    for (int i = 0; i < 64 * 64; i++) {
      switch (f) {
      case F_BIGACC: c0[i] = r.full(10 + (int)(r.uni() * 14)); break;
      case F_FULLACC: c0[i] = r.full(0); break;
      case F_SUBNORMAL: c0[i] = r.uni() < 0.5 ? 0.0f : (float)(r.normal() * ldexp(1.0, -135)); break;
      default: c0[i] = 0.0f;
      }
    }
    for (int i = 0; i < 64 * D; i++) {
      switch (f) {
      case F_BIGACC: c1[i] = r.full(10 + (int)(r.uni() * 14)); break;
      case F_FULLACC: c1[i] = r.full(0); break;
      case F_CANCEL: c1[i] = (float)(r.normal() / 16.0); break;
      case F_SUBNORMAL: c1[i] = (float)(r.normal() * ldexp(1.0, -135)); break;
      default: c1[i] = r.full((int)(r.uni() * 6) - 2);
      }
    }
  }
}

struct cmp {
  long n, diff, maxulp;
  long first; /* element index of the first difference, -1 */
};

static cmp compare(const float *ref, const float *x, long n) {
  cmp c = {n, 0, 0, -1};
  for (long i = 0; i < n; i++) {
    uint32_t a, b;
    memcpy(&a, &ref[i], 4);
    memcpy(&b, &x[i], 4);
    if (a == b) continue;
    if (c.first < 0) c.first = i;
    c.diff++;
    const long u = (a >> 31) == (b >> 31) ? labs((long)(a & 0x7FFFFFFF) - (long)(b & 0x7FFFFFFF)) : 1L << 32;
    if (u > c.maxulp) c.maxulp = u;
  }
  return c;
}

/* max over elements of |x - exact| / (|c| + sum |a b|): ~2^-20 when the layout is right. */
static double s_err(const inputs &in, const float *S, int v) {
  double worst = 0.0;
  for (int t = 0; t < in.T; t++)
    for (int row = 0; row < 64; row++)
      for (int n = 0; n < 64; n++) {
        const uint16_t *q = in.q + ((size_t)t * 64 + row) * in.D, *k = in.k + ((size_t)t * 64 + n) * in.D;
        double c = in.c0[((size_t)t * 64 + row) * 64 + n], ex = c, bound = fabs(c);
        for (int j = 0; j < in.D; j++) {
          const double pr = from16(q[j], in.bf16) * from16(k[j], in.bf16);
          ex += pr, bound += fabs(pr);
        }
        const double x = S[(((size_t)t * NS + v) * 64 + row) * 64 + n];
        const double e = fabs(x - ex) / (bound > 1e-300 ? bound : 1e-300);
        if (!(e <= worst)) worst = e; /* NaN propagates */
      }
  return worst;
}
static double o_err(const inputs &in, const float *O, int v) {
  double worst = 0.0;
  const int D = in.D;
  for (int t = 0; t < in.T; t++)
    for (int row = 0; row < 64; row++)
      for (int n = 0; n < D; n++) {
        double c = in.c1[((size_t)t * 64 + row) * D + n], ex = c, bound = fabs(c);
        for (int j = 0; j < 64; j++) {
          const double pr = from16(in.p[((size_t)t * 64 + row) * 64 + j], in.bf16) *
                            from16(in.v[((size_t)t * 64 + j) * D + n], in.bf16);
          ex += pr, bound += fabs(pr);
        }
        const double x = O[(((size_t)t * NO + v) * 64 + row) * D + n];
        const double e = fabs(x - ex) / (bound > 1e-300 ? bound : 1e-300);
        if (!(e <= worst)) worst = e;
      }
  return worst;
}

#define CK(call)                                                                                   \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__,   \
              cudaGetErrorString(e_));                                                             \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

/* Every variant, one launch each; a failing launch names the variant. */
template <int D, bool BF16, int VAR>
static void launch_one(int T, size_t smem, const uint16_t *q, const uint16_t *k, const float *c0, const uint16_t *p,
                       const uint16_t *v, const float *c1, float *s, float *o) {
  CK(cudaFuncSetAttribute(bits_kernel<D, BF16, VAR>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  bits_kernel<D, BF16, VAR><<<T, 128, smem>>>(q, k, c0, p, v, c1, s, o);
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    fprintf(stderr, "variant %d (d%d %s): %s: %s\n", VAR, D, BF16 ? "bf16" : "fp16", cudaGetErrorName(e),
            cudaGetErrorString(e));
    exit(1);
  }
}
template <int D, bool BF16, int... V>
static void launch_all(std::integer_sequence<int, V...>, int T, size_t smem, const uint16_t *q, const uint16_t *k,
                       const float *c0, const uint16_t *p, const uint16_t *v, const float *c1, float *s, float *o) {
  (launch_one<D, BF16, V>(T, smem, q, k, c0, p, v, c1, s, o), ...);
}

struct totals {
  long verdict_diff, scale0_diff, layout_bad, cases;
};

template <int D, bool BF16>
static void run(int T, uint64_t seed, totals &tot, int &details) {
  inputs in;
  in.D = D, in.T = T, in.bf16 = BF16;
  const size_t nqk = (size_t)T * 64 * D, npp = (size_t)T * 64 * 64;
  in.q = (uint16_t *)malloc(nqk * 2), in.k = (uint16_t *)malloc(nqk * 2), in.v = (uint16_t *)malloc(nqk * 2);
  in.p = (uint16_t *)malloc(npp * 2);
  in.c0 = (float *)malloc(npp * 4), in.c1 = (float *)malloc(nqk * 4);
  float *S = (float *)malloc(npp * NS * 4), *O = (float *)malloc(nqk * NO * 4);
  uint16_t *dq, *dk, *dv, *dp;
  float *dc0, *dc1, *dS, *dO;
  CK(cudaMalloc(&dq, nqk * 2));
  CK(cudaMalloc(&dk, nqk * 2));
  CK(cudaMalloc(&dv, nqk * 2));
  CK(cudaMalloc(&dp, npp * 2));
  CK(cudaMalloc(&dc0, npp * 4));
  CK(cudaMalloc(&dc1, nqk * 4));
  CK(cudaMalloc(&dS, npp * NS * 4));
  CK(cudaMalloc(&dO, nqk * NO * 4));
  const size_t smem = 3 * 128 * D + 64 * 128 + 1024;
  for (int f = 0; f < N_FAM; f++) {
    make_inputs(in, f, seed + 1000 * (uint64_t)f + 10 * D + BF16);
    CK(cudaMemcpy(dq, in.q, nqk * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dk, in.k, nqk * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dv, in.v, nqk * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dp, in.p, npp * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dc0, in.c0, npp * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dc1, in.c1, nqk * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(dS, 0xFF, npp * NS * 4));
    CK(cudaMemset(dO, 0xFF, nqk * NO * 4));
    launch_all<D, BF16>(std::make_integer_sequence<int, N_V>{}, T, smem, dq, dk, dc0, dp, dv, dc1, dS, dO);
    CK(cudaMemcpy(S, dS, npp * NS * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(O, dO, nqk * NO * 4, cudaMemcpyDeviceToHost));
    tot.cases++;
    /* Per trial the variants are contiguous: compare variant v of every trial with variant 0. */
    cmp cs[NS] = {}, co[NO] = {};
    for (int v = 1; v < NS; v++) {
      cmp a = {0, 0, 0, -1};
      for (int t = 0; t < T; t++) {
        cmp c = compare(S + ((size_t)t * NS + 0) * 4096, S + ((size_t)t * NS + v) * 4096, 4096);
        if (a.first < 0 && c.first >= 0) a.first = (long)t * 4096 + c.first;
        a.n += c.n, a.diff += c.diff;
        if (c.maxulp > a.maxulp) a.maxulp = c.maxulp;
      }
      cs[v] = a;
    }
    for (int v = 1; v < NO; v++) {
      cmp a = {0, 0, 0, -1};
      for (int t = 0; t < T; t++) {
        cmp c = compare(O + ((size_t)t * NO + 0) * 64 * D, O + ((size_t)t * NO + v) * 64 * D, 64 * D);
        if (a.first < 0 && c.first >= 0) a.first = (long)t * 64 * D + c.first;
        a.n += c.n, a.diff += c.diff;
        if (c.maxulp > a.maxulp) a.maxulp = c.maxulp;
      }
      co[v] = a;
    }
    const double es0 = s_err(in, S, 0), es1 = s_err(in, S, 1), es3 = s_err(in, S, 3), es5 = s_err(in, S, 5);
    const double eo0 = o_err(in, O, 0), eo1 = o_err(in, O, 1), eo3 = o_err(in, O, 3), eo4 = o_err(in, O, 4);
    const bool layout_ok = es1 < 1e-3 && es3 < 1e-3 && eo1 < 1e-3 && eo3 < 1e-3 && es0 < 1e-3 && eo0 < 1e-3 &&
                           es5 < 1e-3 && eo4 < 1e-3;
    printf("%-4s d%-3d %-17s |", BF16 ? "bf16" : "fp16", D, fam_name[f]);
    for (int v = 1; v < NS; v++) printf(" %s %s", s_name[v], cs[v].diff ? "DIFF" : "=");
    printf(" |");
    for (int v = 1; v < NO; v++) printf(" %s %s", o_name[v], co[v].diff ? "DIFF" : "=");
    printf(" | err S mma %.1e wg %.1e/%.1e/%.1e, O mma %.1e wg %.1e/%.1e/%.1e%s\n", es0, es1, es3, es5, eo0, eo1, eo3,
           eo4, layout_ok ? "" : "  LAYOUT?");
    if (!layout_ok) tot.layout_bad++;
    for (int v = 1; v < NS; v++) {
      if (v != 4) tot.verdict_diff += cs[v].diff;
      else tot.scale0_diff += cs[v].diff;
      if (cs[v].diff && details-- > 0) {
        const long i = cs[v].first, t = i / 4096, row = i % 4096 / 64, col = i % 64;
        const float a = S[((size_t)t * NS) * 4096 + i % 4096], b = S[((size_t)t * NS + v) * 4096 + i % 4096];
        uint32_t ua, ub;
        memcpy(&ua, &a, 4), memcpy(&ub, &b, 4);
        printf("    S %s: %ld of %ld differ, max %ld ulp; first trial %ld row %ld col %ld: mma.sync %.9g (%08x) wgmma %.9g (%08x)\n",
               s_name[v], cs[v].diff, cs[v].n, cs[v].maxulp, t, row, col, a, ua, b, ub);
      }
    }
    for (int v = 1; v < NO; v++) {
      tot.verdict_diff += co[v].diff;
      if (co[v].diff && details-- > 0) {
        const long i = co[v].first, t = i / (64 * D), row = i % (64 * D) / D, col = i % D;
        const float a = O[((size_t)t * NO) * 64 * D + i % (64 * D)], b = O[((size_t)t * NO + v) * 64 * D + i % (64 * D)];
        uint32_t ua, ub;
        memcpy(&ua, &a, 4), memcpy(&ub, &b, 4);
        printf("    O %s: %ld of %ld differ, max %ld ulp; first trial %ld row %ld col %ld: mma.sync %.9g (%08x) wgmma %.9g (%08x)\n",
               o_name[v], co[v].diff, co[v].n, co[v].maxulp, t, row, col, a, ua, b, ub);
      }
    }
    fflush(stdout);
  }
  cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(dp), cudaFree(dc0), cudaFree(dc1), cudaFree(dS), cudaFree(dO);
  free(in.q), free(in.k), free(in.v), free(in.p), free(in.c0), free(in.c1), free(S), free(O);
}

} // namespace

int main(int argc, char **argv) {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    printf("no CUDA device: skipped\n");
    return 77;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9 || prop.minor != 0) {
    printf("device is sm_%d%d, wgmma needs sm_90: skipped\n", prop.major, prop.minor);
    return 77;
  }
  const int T = argc > 1 ? atoi(argv[1]) : 32;
  uint64_t seed = 0x6d6d6132ull;
  if (const char *s = getenv("DETATTN_TEST_SEED")) seed = strtoull(s, NULL, 0);
  printf("device %s, %d trials of 64x64 S and 64xD O per case, seed %llu\n", prop.name, T, (unsigned long long)seed);
  printf("columns: each wgmma form vs mma.sync (= all bits equal, DIFF otherwise); err = max |x - exact| / "
         "(|c| + sum |a*b|) against fp64\n");
  totals tot = {0, 0, 0, 0};
  int details = 40;
  run<64, true>(T, seed, tot, details);
  run<128, true>(T, seed, tot, details);
  run<256, true>(T, seed, tot, details);
  run<64, false>(T, seed, tot, details);
  run<128, false>(T, seed, tot, details);
  run<256, false>(T, seed, tot, details);
  printf("VERDICT: %s: %ld differing fp32 outputs over %ld cases (S ss-group/ss-chunk/rs-group/ss-keysM, O "
         "rs-group/rs-chunk/ss-group/ss-keysM vs mma.sync); scale-d=0 first step: %ld differing; layout errors: %ld\n",
         tot.verdict_diff == 0 && tot.layout_bad == 0 ? "SAME BITS" : "DIFFERENT", tot.verdict_diff, tot.cases,
         tot.scale0_diff, tot.layout_bad);
  return tot.verdict_diff == 0 && tot.layout_bad == 0 ? 0 : 1;
}
