/*
 * numerics.h — the arithmetic of the CPU backend, in one place: dtype loads, exp/log/tanh,
 * scores, the online-softmax tile update, split finalize and the merge of two split
 * results. Both split modes (in-row and partial + combine) call exactly these functions, so
 * they produce the same bits. Everything here is a fixed sequence of IEEE fp32 operations:
 * the build uses -ffp-contract=off, there is no fmaf, and no libm call (glibc's expf/logf/
 * tanhf pick FMA or non-FMA variants at run time and differ between versions), so the
 * results do not depend on the machine's vector width, the compiler's vectorisation or
 * libm. Each op is written as it is evaluated; the compiler may vectorise across
 * independent elements but never reassociates. K and V are read from the pool in the
 * model dtype and converted to fp32 exactly; q is converted once per row.
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

/* The online-softmax state of one row within one split. acc: [head_dim] in the
 * accumulator layout (see da_cpu_pv1_bf16). */
typedef struct da_cpu_row {
  float m, l;
  float *acc;
} da_cpu_row;

DA_CPU_INLINE void da_cpu_row_init(da_cpu_row *st, int d) {
  st->m = -INFINITY;
  st->l = 0.0f;
  for (int c = 0; c < d; c++) st->acc[c] = 0.0f;
}

/* Eight fp32 lanes (GCC vector extensions): elementwise IEEE operations, lowered to AVX
 * or to pairs of SSE operations; the bits are the same either way. */
typedef float da_cpu_v8 __attribute__((vector_size(32)));
typedef uint32_t da_cpu_u8 __attribute__((vector_size(32)));
typedef uint16_t da_cpu_h8 __attribute__((vector_size(16)));
/* The helpers below are always inlined: no AVX value ever crosses a call. */
#pragma GCC diagnostic ignored "-Wpsabi"
DA_CPU_INLINE da_cpu_v8 da_cpu_ld8(const float *p) {
  da_cpu_v8 v;
  memcpy(&v, p, sizeof(v));
  return v;
}
DA_CPU_INLINE void da_cpu_st8(float *p, da_cpu_v8 v) { memcpy(p, &v, sizeof(v)); }
DA_CPU_INLINE da_cpu_u8 da_cpu_ldh8(const uint16_t *p) {
  da_cpu_h8 h;
  memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, da_cpu_u8);
}
/* Eight bf16 / fp16 values to fp32, exact: da_cpu_bf16 and da_cpu_fp16 lane by lane. */
DA_CPU_INLINE da_cpu_v8 da_cpu_bf16x8(const uint16_t *p) {
  return (da_cpu_v8)(da_cpu_ldh8(p) << 16);
}
DA_CPU_INLINE da_cpu_v8 da_cpu_fp16_lanes(da_cpu_u8 h);
DA_CPU_INLINE da_cpu_v8 da_cpu_fp16x8(const uint16_t *p) { return da_cpu_fp16_lanes(da_cpu_ldh8(p)); }

/* Sixteen bf16 / fp16 values to fp32, exact, split by parity: lane j of ev holds element
 * 2j, lane j of od element 2j + 1. One 32-byte load, a few integer ops per 8 values. */
DA_CPU_INLINE da_cpu_u8 da_cpu_ld16(const uint16_t *p) {
  da_cpu_u8 u;
  memcpy(&u, p, sizeof(u));
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  u = (u << 16) | (u >> 16);
#endif
  return u;
}
DA_CPU_INLINE da_cpu_v8 da_cpu_fp16_lanes(da_cpu_u8 h) {
  const da_cpu_u8 sign = (h & 0x8000u) << 16;
  const da_cpu_u8 em = h & 0x7fffu;
  const da_cpu_u8 fin = (da_cpu_u8)((da_cpu_v8)(em << 13) * 0x1.0p112f);
  const da_cpu_u8 special = (em << 13) | 0x7f800000u;
  const da_cpu_u8 is_special = (da_cpu_u8)(em >= 0x7c00u);
  return (da_cpu_v8)(((special & is_special) | (fin & ~is_special)) | sign);
}
DA_CPU_INLINE void da_cpu_bf16x16(const uint16_t *p, da_cpu_v8 *ev, da_cpu_v8 *od) {
  const da_cpu_u8 u = da_cpu_ld16(p);
  *ev = (da_cpu_v8)(u << 16);
  *od = (da_cpu_v8)(u & 0xffff0000u);
}
DA_CPU_INLINE void da_cpu_fp16x16(const uint16_t *p, da_cpu_v8 *ev, da_cpu_v8 *od) {
  const da_cpu_u8 u = da_cpu_ld16(p);
  *ev = da_cpu_fp16_lanes(u & 0xffffu);
  *od = da_cpu_fp16_lanes(u >> 16);
}

/* Where a tile's keys and values live: the tile starts at absolute position ts; key i of
 * the tile is at pool page pages[(ts + i) / ptok], slot (ts + i) % ptok. Within a page
 * (of one layer and kv head) keys are stored transposed, [d][ptok], values row-major,
 * [ptok][d], in the model dtype. */
typedef struct da_cpu_kv {
  const uint16_t *k, *v; /* the layer's K and V pools, offset to the kv head */
  const int32_t *pages;
  size_t page_elems;     /* pool elements between consecutive pages */
  int ptok, ptok_log2, ts, d;
} da_cpu_kv;

DA_CPU_INLINE const uint16_t *da_cpu_key8(const da_cpu_kv *kv, int i) {
  const int pos = kv->ts + i;
  return kv->k + (size_t)kv->pages[pos >> kv->ptok_log2] * kv->page_elems +
         (pos & (kv->ptok - 1));
}
DA_CPU_INLINE const uint16_t *da_cpu_value(const da_cpu_kv *kv, int i) {
  const int pos = kv->ts + i;
  return kv->v + (size_t)kv->pages[pos >> kv->ptok_log2] * kv->page_elems +
         (size_t)(pos & (kv->ptok - 1)) * kv->d;
}

/* Scores of n query rows (n = 1, 2 or 4: q heads sharing one kv head and one position)
 * against keys [i0, i1) of a tile (multiples of 8). q: [n][d] fp32; s: [n][T]. Each s_i
 * is its own ascending sum over c of q_c * k_ic from +0 (no FMA), then times scale; with
 * softcap, s_i = softcap * tanh(s_i / softcap). Lanes run over keys in groups of 8 (8
 * keys never straddle a page), 8 / n groups at a time, each key vector loaded and
 * converted once for all n rows. Nothing is reassociated, so a row's bits do not depend
 * on n or on how its keys are grouped. */
#define DA_CPU_SCORES_STEP(N, G, CVT)                                           \
  do {                                                                          \
    da_cpu_v8 a[N][G];                                                          \
    const uint16_t *kp[G];                                                      \
    for (int j = 0; j < G; j++) kp[j] = da_cpu_key8(kv, ib + 8 * j);            \
    for (int r = 0; r < N; r++)                                                 \
      for (int j = 0; j < G; j++) a[r][j] = (da_cpu_v8){0};                     \
    for (int c = 0; c < d; c++) {                                               \
      da_cpu_v8 kc[G];                                                          \
      for (int j = 0; j < G; j++) kc[j] = CVT(kp[j] + (size_t)c * ptok);        \
      for (int r = 0; r < N; r++) {                                             \
        const float qc = q[r * d + c];                                          \
        for (int j = 0; j < G; j++) a[r][j] = a[r][j] + qc * kc[j];             \
      }                                                                         \
    }                                                                           \
    for (int r = 0; r < N; r++)                                                 \
      for (int j = 0; j < G; j++) da_cpu_st8(s + r * tile + ib + 8 * j, a[r][j] * scale); \
    ib += 8 * G;                                                                \
  } while (0)

/* The same sums over groups of 16 keys (pages of 16 tokens or more): even and odd keys in
 * separate lanes from one load. */
#define DA_CPU_SCORES16_STEP(N, G, CVT16)                                       \
  do {                                                                          \
    da_cpu_v8 ae[N][G], ao[N][G];                                               \
    const uint16_t *kp[G];                                                      \
    for (int j = 0; j < G; j++) kp[j] = da_cpu_key8(kv, ib + 16 * j);           \
    for (int r = 0; r < N; r++)                                                 \
      for (int j = 0; j < G; j++) ae[r][j] = ao[r][j] = (da_cpu_v8){0};         \
    for (int c = 0; c < d; c++) {                                               \
      da_cpu_v8 ke[G], ko[G];                                                   \
      for (int j = 0; j < G; j++) CVT16(kp[j] + (size_t)c * ptok, &ke[j], &ko[j]); \
      for (int r = 0; r < N; r++) {                                             \
        const float qc = q[r * d + c];                                          \
        for (int j = 0; j < G; j++) {                                           \
          ae[r][j] = ae[r][j] + qc * ke[j];                                     \
          ao[r][j] = ao[r][j] + qc * ko[j];                                     \
        }                                                                       \
      }                                                                         \
    }                                                                           \
    for (int r = 0; r < N; r++)                                                 \
      for (int j = 0; j < G; j++) {                                             \
        const da_cpu_v8 e = ae[r][j] * scale, o = ao[r][j] * scale;             \
        float *sr = s + r * tile + ib + 16 * j;                                 \
        for (int l = 0; l < 8; l++) {                                           \
          sr[2 * l] = e[l];                                                     \
          sr[2 * l + 1] = o[l];                                                 \
        }                                                                       \
      }                                                                         \
    ib += 16 * G;                                                               \
  } while (0)

#define DA_CPU_DEF_SCORES(N, DT, CVT)                                           \
  DA_CPU_INLINE void da_cpu_scores##N##_##DT(const float *restrict q, const da_cpu_kv *kv, \
                                             int tile, int i0, int i1, float scale,    \
                                             float softcap, float *restrict s) {       \
    const int d = kv->d, ptok = kv->ptok;                                       \
    int ib = i0;                                                                \
    if (ptok >= 16 && (i0 & 15) == 0 && (i1 & 15) == 0) {                       \
      while (i1 - ib >= 64 / N) DA_CPU_SCORES16_STEP(N, 4 / N, CVT##x16);       \
      while (ib < i1) DA_CPU_SCORES16_STEP(N, 1, CVT##x16);                     \
    } else {                                                                    \
      while (i1 - ib >= 64 / N) DA_CPU_SCORES_STEP(N, 8 / N, CVT##x8);          \
      while (ib < i1) DA_CPU_SCORES_STEP(N, 1, CVT##x8);                        \
    }                                                                           \
    if (softcap > 0.0f)                                                         \
      for (int r = 0; r < N; r++)                                               \
        for (int i = i0; i < i1; i++)                                           \
          s[r * tile + i] = softcap * da_cpu_tanhf(s[r * tile + i] / softcap);  \
  }

/* The softmax part of a row's tile update over its valid keys [i0, i1), i0 < i1: updates
 * m and l, writes p[i0, i1), returns alpha for the acc update. */
DA_CPU_INLINE float da_cpu_softmax_tile(float *m, float *l, const float *restrict s,
                                        float *restrict p, int i0, int i1) {
  float mt = -INFINITY;
  for (int i = i0; i < i1; i++) mt = s[i] > mt ? s[i] : mt;
  const float mn = mt > *m ? mt : *m;
  const float alpha = da_cpu_expf(*m - mn);
  for (int i = i0; i < i1; i++) p[i] = da_cpu_expf(s[i] - mn);
  float lt = 0.0f;
  for (int i = i0; i < i1; i++) lt = lt + p[i];
  *l = *l * alpha + lt;
  *m = mn;
  return alpha;
}

/* The acc part of the tile update for n rows sharing the valid keys [i0, i1):
 * acc_r,c = acc_r,c * alpha_r + (sum over i ascending of p_r,i * v_i,c, from +0).
 * acc: [n][d] in the accumulator layout (in each block of 16 columns, the 8 even columns
 * then the 8 odd ones; da_cpu_finalize restores the order); p: [n][T]. Each value vector
 * is loaded and converted once for all n rows; lanes run over columns, 64 / n at a time
 * (head_dim is a multiple of 64). */
#define DA_CPU_DEF_PV(N, DT, CVT16)                                             \
  DA_CPU_INLINE void da_cpu_pv##N##_##DT(float *restrict acc, const float *alpha,        \
                                         const float *restrict p, int tile,              \
                                         const da_cpu_kv *kv, int i0, int i1) {          \
    enum { V = 4 / N };                                                         \
    const int d = kv->d;                                                        \
    for (int cb = 0; cb < d; cb += 16 * V) {                                    \
      da_cpu_v8 ae[N][V], ao[N][V];                                             \
      for (int r = 0; r < N; r++)                                               \
        for (int j = 0; j < V; j++) ae[r][j] = ao[r][j] = (da_cpu_v8){0};       \
      for (int i = i0; i < i1; i++) {                                           \
        const uint16_t *v = da_cpu_value(kv, i) + cb;                           \
        da_cpu_v8 ve[V], vo[V];                                                 \
        for (int j = 0; j < V; j++) CVT16(v + 16 * j, &ve[j], &vo[j]);          \
        for (int r = 0; r < N; r++) {                                           \
          const float pr = p[r * tile + i];                                     \
          for (int j = 0; j < V; j++) {                                         \
            ae[r][j] = ae[r][j] + pr * ve[j];                                   \
            ao[r][j] = ao[r][j] + pr * vo[j];                                   \
          }                                                                     \
        }                                                                       \
      }                                                                         \
      for (int r = 0; r < N; r++)                                               \
        for (int j = 0; j < V; j++) {                                           \
          float *o = acc + (size_t)r * d + cb + 16 * j;                         \
          da_cpu_st8(o, da_cpu_ld8(o) * alpha[r] + ae[r][j]);                   \
          da_cpu_st8(o + 8, da_cpu_ld8(o + 8) * alpha[r] + ao[r][j]);           \
        }                                                                       \
    }                                                                           \
  }

#define DA_CPU_DEF_ROWS(N)                                                      \
  DA_CPU_DEF_SCORES(N, bf16, da_cpu_bf16)                                       \
  DA_CPU_DEF_SCORES(N, fp16, da_cpu_fp16)                                       \
  DA_CPU_DEF_PV(N, bf16, da_cpu_bf16x16)                                        \
  DA_CPU_DEF_PV(N, fp16, da_cpu_fp16x16)
DA_CPU_DEF_ROWS(1)
DA_CPU_DEF_ROWS(2)
DA_CPU_DEF_ROWS(4)

/* Split result of a row whose split saw at least one valid key: o: [d]. */
DA_CPU_INLINE float da_cpu_finalize(const da_cpu_row *st, int d, float *restrict o) {
  for (int b = 0; b < d; b += 16)
    for (int j = 0; j < 8; j++) {
      o[b + 2 * j] = st->acc[b + j] / st->l;
      o[b + 2 * j + 1] = st->acc[b + 8 + j] / st->l;
    }
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
