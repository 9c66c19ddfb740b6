/*
 * numerics.cuh — the ONE definition of the CUDA backend's per-row arithmetic: score
 * transform, mask, online-softmax tile update, split finalize and the left-fold merge.
 * Every kernel (decode rows, prefill rows, in-row folds, the combine pass) calls these
 * functions and nothing else for that arithmetic, so every path performs the same
 * sequence of float operations. Rounding is explicit (__fmul_rn, __fadd_rn, __fdiv_rn,
 * __fmaf_rn); exponentials and logarithms are the hardware ex2.approx.ftz / lg2.approx.ftz
 * instructions by explicit choice. Scores live in the log2 domain (multiplied by log2 e).
 * Compiled with --fmad=false and without --use_fast_math.
 */
#ifndef DA_CUDA_NUMERICS_CUH
#define DA_CUDA_NUMERICS_CUH

#include <math.h>
#include <stdint.h>

#define DA_LN2 0.693147180559945309f

__device__ __forceinline__ float da_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float da_lg2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/* Score in the log2 domain from the raw fp32 dot product q.k. */
__device__ __forceinline__ float da_score(float raw, int softcap, float scale_log2, float cap_in,
                                          float cap_out_log2) {
  if (softcap) return __fmul_rn(tanhf(__fmul_rn(raw, cap_in)), cap_out_log2);
  return __fmul_rn(raw, scale_log2);
}

/* Online softmax state of the two rows a thread holds in an m16n8 accumulator fragment. */
struct da_row_state {
  float m[2]; /* running max (log2 domain), -inf before the first key */
  float l[2]; /* running sum of exp2(x - m) */
};

__device__ __forceinline__ void da_state_reset(da_row_state &st) {
  st.m[0] = st.m[1] = -INFINITY;
  st.l[0] = st.l[1] = 0.0f;
}

/*
 * The online-softmax tile update, in pieces so that a tile's keys may be computed by one
 * warp (prefill rows) or by eight warps sharing 16 rows (decode rows) with the same bits.
 * x[nt][e] holds scores of this thread's rows in m16n8 accumulator fragments: row g for e in
 * {0, 1}, row g + 8 for e in {2, 3}; -inf where masked. For each row r of a tile:
 *   mx = max over the tile (da_quad_max per warp; max is exact, so any grouping agrees),
 *   alpha = da_rescale(state, r, mx, m_use), x = da_exp_row (p = exp2(x - m_use)),
 *   g[k] = da_ntile_sum over keys [8k, 8k + 8) (the thread's pair, then the quad butterfly
 *   xor 1, xor 2), l = alpha * l + the left fold of g0 .. g7 (da_l_update),
 *   and the caller scales its output accumulator by alpha before adding p.V.
 * A fully masked tile leaves (m, l) bit-identical with alpha = 1 (or 0 with l = 0 before
 * any key) and p = 0.
 */
template <int NT>
__device__ __forceinline__ float da_quad_max(const float (&x)[NT][4], int r) {
  float mx = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < NT; nt++) mx = fmaxf(mx, fmaxf(x[nt][2 * r], x[nt][2 * r + 1]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  return mx;
}

__device__ __forceinline__ float da_rescale(da_row_state &st, int r, float tile_max, float &m_use) {
  const float m_new = fmaxf(st.m[r], tile_max);
  m_use = m_new == -INFINITY ? 0.0f : m_new;
  const float alpha = da_ex2(__fsub_rn(st.m[r], m_use));
  st.m[r] = m_new;
  return alpha;
}

template <int NT>
__device__ __forceinline__ void da_exp_row(float (&x)[NT][4], int r, float m_use) {
#pragma unroll
  for (int nt = 0; nt < NT; nt++) {
    x[nt][2 * r] = da_ex2(__fsub_rn(x[nt][2 * r], m_use));
    x[nt][2 * r + 1] = da_ex2(__fsub_rn(x[nt][2 * r + 1], m_use));
  }
}

template <int NT>
__device__ __forceinline__ float da_ntile_sum(const float (&x)[NT][4], int n, int r) {
  float s = __fadd_rn(x[n][2 * r], x[n][2 * r + 1]);
  s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 1));
  s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 2));
  return s;
}

/* l = alpha * l + (((g0 + g1) + g2) + ... + g7), g_k the sum over keys [8k, 8k + 8). */
__device__ __forceinline__ void da_l_update(da_row_state &st, int r, float alpha, const float (&g)[8]) {
  float sum = g[0];
#pragma unroll
  for (int k = 1; k < 8; k++) sum = __fadd_rn(sum, g[k]);
  st.l[r] = __fadd_rn(__fmul_rn(alpha, st.l[r]), sum);
}

/* Split finalize: o_j = acc / l, lse_j = m + log2(l). Only for rows with l > 0. */
__device__ __forceinline__ float da_finalize_o(float acc, float l) { return __fdiv_rn(acc, l); }
__device__ __forceinline__ float da_finalize_lse(float m, float l) { return __fadd_rn(m, da_lg2(l)); }

/* Left-fold merge (o, lse) <- merge((o, lse), (o_j, lse_j)): weights once per row, then
 * one da_merge_o per element. */
struct da_merge_w {
  float a, b, s, lse;
};

__device__ __forceinline__ da_merge_w da_merge_weights(float lse, float lse_j) {
  da_merge_w w;
  const float mx = fmaxf(lse, lse_j);
  w.a = da_ex2(__fsub_rn(lse, mx));
  w.b = da_ex2(__fsub_rn(lse_j, mx));
  w.s = __fadd_rn(w.a, w.b);
  w.lse = __fadd_rn(mx, da_lg2(w.s));
  return w;
}

__device__ __forceinline__ float da_merge_o(const da_merge_w &w, float o, float o_j) {
  return __fdiv_rn(__fmaf_rn(w.a, o, __fmul_rn(w.b, o_j)), w.s);
}

/* Output lse in natural log from the log2-domain value. */
__device__ __forceinline__ float da_lse_out(float lse2) { return __fmul_rn(lse2, DA_LN2); }

#endif /* DA_CUDA_NUMERICS_CUH */
