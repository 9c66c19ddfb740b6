/*
 * numerics.h — the arithmetic of the CPU backend, in one place: dtype loads, exp/log/tanh,
 * scores, the online-softmax tile update, split finalize and the merge of two split
 * results. Both split modes (in-row and partial + combine) call exactly these functions, so
 * they produce the same bits. Everything here is a fixed sequence of IEEE fp32 operations:
 * the build uses -ffp-contract=off, there is no fmaf, and no libm call (glibc's expf/logf/
 * tanhf pick FMA or non-FMA variants at run time and differ between versions), so the
 * results do not depend on the machine's vector width, the compiler's vectorisation or
 * libm. Each op is written as it is evaluated; the compiler may vectorise across
 * independent elements but never reassociates.
 *
 * Per row (query token at position p, q head h reading kv head h / G), per split j, the
 * state is (m, l, acc[d]) with m = -inf, l = 0, acc = 0 at the start of the split.
 *
 *   score     s_i = (((0 + q_0 k_i0) + q_1 k_i1) + ... + q_{d-1} k_i,d-1) * scale,
 *             summed in ascending c, no FMA. With softcap > 0:
 *             s_i = softcap * tanh(s_i / softcap), tanh as da_cpu_tanhf.
 *   tile      keys [kT, (k+1)T) ascending; only i in the row's valid range [max(kT, w0),
 *             min((k+1)T - 1, p)] take part. A tile with no valid key is skipped: the
 *             state is unchanged bit for bit. Otherwise, in this order:
 *               mt    = max of s_i over valid i, ascending (mt = s_i > mt ? s_i : mt)
 *               mn    = mt > m ? mt : m
 *               alpha = exp(m - mn)                 (0 on the first tile: exp(-inf) = 0)
 *               p_i   = exp(s_i - mn)
 *               lt    = sum of p_i, ascending from +0
 *               l     = l * alpha + lt
 *               pv_c  = sum of p_i * v_ic over valid i, ascending from +0
 *               acc_c = acc_c * alpha + pv_c
 *               m     = mn
 *   finalize  o_j,c = acc_c / l;  lse_j = m + log(l)
 *   merge     (o, lse) <- merge((o, lse), (o_j, lse_j)) for j ascending after the first:
 *               mx = lse > lse_j ? lse : lse_j
 *               wa = exp(lse - mx);  wb = exp(lse_j - mx);  den = wa + wb
 *               o_c = (o_c * wa + o_j,c * wb) / den;  lse = mx + log(den)
 *   output    round(o) to the model dtype (round to nearest even); lse in fp32.
 */
#ifndef DA_CPU_NUMERICS_H
#define DA_CPU_NUMERICS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Always inlined, so that each vector-width variant of the calling kernel (cpu_attn.c)
 * compiles its own copy of these loops. */
#if defined(__GNUC__)
#define DA_CPU_INLINE static inline __attribute__((always_inline))
#else
#define DA_CPU_INLINE static inline
#endif

DA_CPU_INLINE uint32_t da_cpu_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
DA_CPU_INLINE float da_cpu_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* bf16 -> fp32, exact. */
DA_CPU_INLINE float da_cpu_bf16(uint16_t h) { return da_cpu_float((uint32_t)h << 16); }

/* fp16 -> fp32, exact, branch-free so that loops over it vectorise. Equal to
 * da_fp16_to_f32 for all 65536 inputs (tested). Finite values: place exponent and mantissa
 * in fp32 position (a subnormal fp16 lands on an fp32 subnormal) and rebias by an exact
 * multiplication with 2^112; inf and NaN: set the fp32 exponent to all ones. */
DA_CPU_INLINE float da_cpu_fp16(uint16_t h) {
  const uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
  const uint32_t em = (uint32_t)h & 0x7fffu;
  const float fin = da_cpu_float(em << 13) * 0x1.0p112f;
  const uint32_t special = (em << 13) | 0x7f800000u;
  const uint32_t mag = em >= 0x7c00u ? special : da_cpu_bits(fin);
  return da_cpu_float(mag | sign);
}

/* exp(x) for x <= 0 (the only arguments the algorithm produces), including -inf -> 0.
 * Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, degree-7 Taylor polynomial in Horner
 * form, then scaling by 2^n built from bits. Results below 2^-126 (x < -87) are flushed to
 * +0. Relative error below 1e-6 (tested). NaN in, NaN out. */
DA_CPU_INLINE float da_cpu_expf(float x) {
  const float shift = 0x1.8p23f;
  const float xc = x < -87.0f ? -87.0f : x;
  const float t = xc * 0x1.715476p+0f + shift; /* round(x / ln2) in the low bits of t */
  const float n = t - shift;
  float r = xc - n * 0x1.62e400p-1f; /* ln2 high part: n * hi is exact */
  r = r - n * 0x1.7f7d1cp-20f;      /* ln2 low part */
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const uint32_t e = (da_cpu_bits(t) - da_cpu_bits(shift) + 127u) << 23;
  const float y = p * da_cpu_float(e);
  return x < -87.0f ? 0.0f : y;
}

/* log(x) for positive normal finite x (the algorithm only takes logs of l >= 1 and of
 * den in (1, 2]). x = 2^e * f with f in [sqrt(1/2), sqrt(2)), log f = 2 atanh((f-1)/(f+1))
 * by its series to u^9. Relative error below 1e-6 (tested). NaN in, NaN out. */
DA_CPU_INLINE float da_cpu_logf(float x) {
  const uint32_t u = da_cpu_bits(x);
  int e = (int)((u >> 23) & 0xffu) - 127;
  float f = da_cpu_float((u & 0x7fffffu) | 0x3f800000u);
  if (f > 0x1.6a09e6p+0f) {
    f = f * 0.5f;
    e = e + 1;
  }
  const float z = (f - 1.0f) / (f + 1.0f);
  const float z2 = z * z;
  float s = 1.0f / 9.0f;
  s = s * z2 + 1.0f / 7.0f;
  s = s * z2 + 1.0f / 5.0f;
  s = s * z2 + 1.0f / 3.0f;
  s = s * z2 + 1.0f;
  const float lf = (2.0f * z) * s;
  const float ef = (float)e;
  const float y = ef * 0x1.62e400p-1f + (ef * 0x1.7f7d1cp-20f + lf);
  return x == x ? y : x;
}

/* tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|). Absolute error below 1e-6. */
DA_CPU_INLINE float da_cpu_tanhf(float x) {
  const float e = da_cpu_expf(-2.0f * fabsf(x));
  const float t = (1.0f - e) / (1.0f + e);
  return x < 0.0f ? -t : t;
}

/* The online-softmax state of one row within one split. acc: [head_dim]. */
typedef struct da_cpu_row {
  float m, l;
  float *acc;
} da_cpu_row;

DA_CPU_INLINE void da_cpu_row_init(da_cpu_row *st, int d) {
  st->m = -INFINITY;
  st->l = 0.0f;
  for (int c = 0; c < d; c++) st->acc[c] = 0.0f;
}

/* Eight fp32 lanes (GCC vector extension): elementwise IEEE operations, lowered to AVX
 * or to pairs of SSE operations; the bits are the same either way. */
typedef float da_cpu_v8 __attribute__((vector_size(32)));
/* The helpers below are always inlined: no AVX value ever crosses a call. */
#pragma GCC diagnostic ignored "-Wpsabi"
DA_CPU_INLINE da_cpu_v8 da_cpu_ld8(const float *p) {
  da_cpu_v8 v;
  memcpy(&v, p, sizeof(v));
  return v;
}
DA_CPU_INLINE void da_cpu_st8(float *p, da_cpu_v8 v) { memcpy(p, &v, sizeof(v)); }

/* Scores of one query row against keys [i0, i1) of a tile (multiples of 16, i1 <= T).
 * q: [d] fp32; kt: the tile's keys transposed, [d][T] fp32. Writes s[i0, i1). Each s_i is
 * its own ascending sum over c; the lanes run over keys (64 or 16 at a time), so nothing
 * is reassociated. */
DA_CPU_INLINE void da_cpu_scores(const float *restrict q, const float *restrict kt, int d,
                                 int tile, int i0, int i1, float scale, float softcap,
                                 float *restrict s) {
  int ib = i0;
  for (; i1 - ib >= 64; ib += 64) {
    da_cpu_v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    const float *k = kt + ib;
    for (int c = 0; c < d; c++, k += tile) {
      const float qc = q[c];
      a0 = a0 + qc * da_cpu_ld8(k);
      a1 = a1 + qc * da_cpu_ld8(k + 8);
      a2 = a2 + qc * da_cpu_ld8(k + 16);
      a3 = a3 + qc * da_cpu_ld8(k + 24);
      a4 = a4 + qc * da_cpu_ld8(k + 32);
      a5 = a5 + qc * da_cpu_ld8(k + 40);
      a6 = a6 + qc * da_cpu_ld8(k + 48);
      a7 = a7 + qc * da_cpu_ld8(k + 56);
    }
    da_cpu_st8(s + ib, a0 * scale);
    da_cpu_st8(s + ib + 8, a1 * scale);
    da_cpu_st8(s + ib + 16, a2 * scale);
    da_cpu_st8(s + ib + 24, a3 * scale);
    da_cpu_st8(s + ib + 32, a4 * scale);
    da_cpu_st8(s + ib + 40, a5 * scale);
    da_cpu_st8(s + ib + 48, a6 * scale);
    da_cpu_st8(s + ib + 56, a7 * scale);
  }
  for (; ib < i1; ib += 16) {
    da_cpu_v8 a0 = {0}, a1 = {0};
    const float *k = kt + ib;
    for (int c = 0; c < d; c++, k += tile) {
      const float qc = q[c];
      a0 = a0 + qc * da_cpu_ld8(k);
      a1 = a1 + qc * da_cpu_ld8(k + 8);
    }
    da_cpu_st8(s + ib, a0 * scale);
    da_cpu_st8(s + ib + 8, a1 * scale);
  }
  if (softcap > 0.0f)
    for (int i = i0; i < i1; i++) s[i] = softcap * da_cpu_tanhf(s[i] / softcap);
}

/* The tile update of one row over its valid keys [i0, i1) of a tile, i0 < i1.
 * s: scores, p: scratch [T]; vt: the tile's values, [T][d] fp32. */
DA_CPU_INLINE void da_cpu_tile_update(da_cpu_row *restrict st, const float *restrict s,
                                      float *restrict p, const float *restrict vt, int d,
                                      int i0, int i1) {
  float mt = -INFINITY;
  for (int i = i0; i < i1; i++) mt = s[i] > mt ? s[i] : mt;
  const float mn = mt > st->m ? mt : st->m;
  const float alpha = da_cpu_expf(st->m - mn);
  for (int i = i0; i < i1; i++) p[i] = da_cpu_expf(s[i] - mn);
  float lt = 0.0f;
  for (int i = i0; i < i1; i++) lt = lt + p[i];
  st->l = st->l * alpha + lt;
  for (int cb = 0; cb < d; cb += 64) { /* head_dim is a multiple of 64 */
    da_cpu_v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    const float *v = vt + (size_t)i0 * d + cb;
    for (int i = i0; i < i1; i++, v += d) {
      const float pi = p[i];
      a0 = a0 + pi * da_cpu_ld8(v);
      a1 = a1 + pi * da_cpu_ld8(v + 8);
      a2 = a2 + pi * da_cpu_ld8(v + 16);
      a3 = a3 + pi * da_cpu_ld8(v + 24);
      a4 = a4 + pi * da_cpu_ld8(v + 32);
      a5 = a5 + pi * da_cpu_ld8(v + 40);
      a6 = a6 + pi * da_cpu_ld8(v + 48);
      a7 = a7 + pi * da_cpu_ld8(v + 56);
    }
    float *acc = st->acc + cb;
    const da_cpu_v8 pv[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int j = 0; j < 8; j++) da_cpu_st8(acc + 8 * j, da_cpu_ld8(acc + 8 * j) * alpha + pv[j]);
  }
  st->m = mn;
}

/* Split result of a row whose split saw at least one valid key: o: [d]. */
DA_CPU_INLINE float da_cpu_finalize(const da_cpu_row *st, int d, float *restrict o) {
  for (int c = 0; c < d; c++) o[c] = st->acc[c] / st->l;
  return st->m + da_cpu_logf(st->l);
}

/* (o, lse) <- merge((o, lse), (ob, lseb)). o, ob: [d]. */
DA_CPU_INLINE void da_cpu_merge(float *restrict o, float *lse, const float *restrict ob,
                                float lseb, int d) {
  const float la = *lse;
  const float mx = la > lseb ? la : lseb;
  const float wa = da_cpu_expf(la - mx);
  const float wb = da_cpu_expf(lseb - mx);
  const float den = wa + wb;
  for (int c = 0; c < d; c++) o[c] = (o[c] * wa + ob[c] * wb) / den;
  *lse = mx + da_cpu_logf(den);
}

#endif /* DA_CPU_NUMERICS_H */
