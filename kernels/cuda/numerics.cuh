/*
 * numerics.cuh — the ONE definition of the CUDA backend's per-row arithmetic: score
 * transform, mask, online-softmax tile update, split finalize and the left-fold merge.
 * Every kernel (decode rows, prefill rows, in-row folds, the combine pass) calls these
 * functions and nothing else for that arithmetic, so every path performs the same
 * sequence of float operations. Rounding is explicit (__fmul_rn, __fadd_rn, __frcp_rn,
 * __fmaf_rn); exponentials and logarithms are the hardware ex2.approx.ftz / lg2.approx.ftz
 * instructions by explicit choice. Scores live in the log2 domain (multiplied by log2 e).
 * Compiled with --fmad=false and without --use_fast_math.
 */
#ifndef DA_CUDA_NUMERICS_CUH
#define DA_CUDA_NUMERICS_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
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

/* Two fp32 values rounded to the input dtype (nearest even) and packed: P before P V, and
 * the output (contract step 6). */
template <bool BF16>
__device__ __forceinline__ uint32_t da_pack2(float lo, float hi) {
  if constexpr (BF16) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&h);
  } else {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&h);
  }
}

/*
 * Scores (kernel version 4). A score enters the tile update as y with a factor c: without a
 * softcap y is the raw fp32 dot product q.k and c = scale * log2 e (da_score_c), so the scale
 * is applied inside the exponent's FMA (one rounding, FA3's form); with a softcap y is the
 * capped log2-domain score and c = 1 (fma(y, 1, -m) == y - m exactly).
 */
__device__ __forceinline__ float da_score_y(float raw, int softcap, float cap_in, float cap_out_log2) {
  if (softcap) return __fmul_rn(tanhf(__fmul_rn(raw, cap_in)), cap_out_log2);
  return raw;
}

/* Online softmax state of the two rows a thread holds in an m16n8 accumulator fragment. */
struct da_row_state {
  float m[2]; /* running max (log2 domain, lazily raised: da_rescale), -inf before the first key */
  float l[2]; /* THIS thread's part of the running sum of exp2(y c - m): its keys 2 qd, 2 qd + 1
               * of every n8 fragment; da_l_row sums the quad at the split end */
};

__device__ __forceinline__ void da_state_reset(da_row_state &st) {
  st.m[0] = st.m[1] = -INFINITY;
  st.l[0] = st.l[1] = 0.0f;
}

/*
 * The online-softmax tile update (kernel version 4). x[nt][e] holds y of this thread's
 * rows in m16n8 accumulator fragments over the tile's 64 keys (nt = 0 .. 7): row g for e in
 * {0, 1}, row g + 8 for e in {2, 3}; -inf where masked. Every path (prefill rows, decode rows,
 * wgmma or mma.sync) holds whole tiles per warp in this layout, so each thread performs the
 * same operations on the same values. For each row r of a tile:
 *   mx = max of y over the tile (da_quad_max; max is exact, so any grouping agrees),
 *   da_rescale: mt = mx c; the running max moves to mt only when mt - m > DA_LAZY_MAX (or m is
 *   -inf), else it stays (FA's lazy rescaling: p = exp2(y c - m) <= 2^8, so P and the sums stay
 *   in range, and alpha is exactly 1 on most tiles, where the caller's acc *= alpha is skipped);
 *   da_exp_row: p = exp2(fma(y, c, -m_use));
 *   da_l_update: l = alpha l + the thread's tile sum (pairs, then a balanced tree over nt),
 *   and the caller scales its output accumulator by alpha before adding p.V.
 * No shuffles but the max's two: the row's l is the quad's sum, taken once per split
 * (da_l_row). A fully masked tile leaves (m, l) bit-identical with alpha = 1 (or 0 with l = 0
 * before any key) and p = 0.
 */
#define DA_LAZY_MAX 8.0f

/* op over a row's values of the thread: the pairs op(x[nt][2 r], x[nt][2 r + 1]), then a
 * balanced tree over nt (3 levels at NT 8). */
template <int NT, typename Op>
__device__ __forceinline__ float da_row_tree(const float (&x)[NT][4], int r, Op op) {
  float v[NT];
#pragma unroll
  for (int nt = 0; nt < NT; nt++) v[nt] = op(x[nt][2 * r], x[nt][2 * r + 1]);
#pragma unroll
  for (int w = 1; w < NT; w *= 2)
#pragma unroll
    for (int i = 0; i + w < NT; i += 2 * w) v[i] = op(v[i], v[i + w]);
  return v[0];
}

/* The row's max over the quad (4 dependent FMNMX at NT 8, not 9): max is exact, so the
 * grouping does not show, and an all-NaN tile's NaN is ignored as -inf would be (a NaN mt
 * never moves m). */
template <int NT>
__device__ __forceinline__ float da_quad_max(const float (&x)[NT][4], int r) {
  float mx = da_row_tree<NT>(x, r, [](float a, float b) { return fmaxf(a, b); });
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  return mx;
}

__device__ __forceinline__ float da_rescale(da_row_state &st, int r, float tile_max, float c, float &m_use) {
  const float mt = __fmul_rn(tile_max, c);
  /* -inf - -inf and NaN compare false: m stays. */
  const float m_new = __fsub_rn(mt, st.m[r]) > DA_LAZY_MAX ? mt : st.m[r];
  m_use = m_new == -INFINITY ? 0.0f : m_new;
  const float alpha = da_ex2(__fsub_rn(st.m[r], m_use));
  st.m[r] = m_new;
  return alpha;
}

template <int NT>
__device__ __forceinline__ void da_exp_row(float (&x)[NT][4], int r, float c, float m_use) {
  const float nm = -m_use;
#pragma unroll
  for (int nt = 0; nt < NT; nt++) {
    x[nt][2 * r] = da_ex2(__fmaf_rn(x[nt][2 * r], c, nm));
    x[nt][2 * r + 1] = da_ex2(__fmaf_rn(x[nt][2 * r + 1], c, nm));
  }
}

/* l = alpha l + T, T = da_row_tree of the sums p[nt][2 r] + p[nt][2 r + 1]. */
template <int NT>
__device__ __forceinline__ void da_l_update(da_row_state &st, int r, float alpha, const float (&x)[NT][4]) {
  const float t = da_row_tree<NT>(x, r, [](float a, float b) { return __fadd_rn(a, b); });
  st.l[r] = __fadd_rn(__fmul_rn(alpha, st.l[r]), t);
}

/* A tile's update of the thread's two rows (the steps above, row by row): alpha[r] the
 * rescale factor of row r, x becomes p, l takes the tile's sums. The caller scales its
 * output accumulator by alpha before adding p.V. */
template <int NT>
__device__ __forceinline__ void da_tile_update(da_row_state &st, float (&x)[NT][4], float c, float (&alpha)[2]) {
#pragma unroll
  for (int r = 0; r < 2; r++) {
    float m_use;
    alpha[r] = da_rescale(st, r, da_quad_max<NT>(x, r), c, m_use);
    da_exp_row<NT>(x, r, c, m_use);
    da_l_update<NT>(st, r, alpha[r], x);
  }
}

/* The row's l at a split end: the quad's parts, (l0 + l1) + (l2 + l3) in every lane (a + b ==
 * b + a exactly). Every lane of the warp calls it. */
__device__ __forceinline__ float da_l_row(const da_row_state &st, int r) {
  float l = __fadd_rn(st.l[r], __shfl_xor_sync(0xffffffffu, st.l[r], 1));
  return __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, 2));
}

/*
 * Split result and merge (kernel version 5). A row's divisions are by one value per row (l
 * at the split end, s = a + b in the merge), so each is a correctly rounded reciprocal taken
 * once per row (__frcp_rn) and one multiply per element: RN(x RN(1/b)), within 1.5 ulp of
 * x / b, as ex2.approx stands for exp. Versions 3-4 divided every element exactly (five FMAs
 * and a range check each, a redo with __fdiv_rn outside the range): two divisions per output
 * element per split end were the bulk of a prefill split end (NOTES v5). No operand range
 * is special here: zeros, infinities and NaN go through the same instructions on every path.
 */

/* Split finalize: o_j = acc RN(1/l), lse_j = m + log2(l). Only for rows with l > 0. */
__device__ __forceinline__ float da_recip(float b) { return __frcp_rn(b); }
__device__ __forceinline__ float da_finalize_o(float rl, float acc) { return __fmul_rn(acc, rl); }
__device__ __forceinline__ float da_finalize_lse(float m, float l) { return __fadd_rn(m, da_lg2(l)); }

/*
 * Left-fold merge (o, lse) <- merge((o, lse), (o_j, lse_j)), once per row:
 *   mx = max(lse, lse_j), a = exp2(lse - mx), b = exp2(lse_j - mx), s = a + b,
 *   lse' = mx + log2(s), r = RN(1/s), wa = a r, wb = b r;
 * then per element o' = fma(wa, o, wb o_j).
 */
struct da_merge_w {
  float a, b, s, lse; /* from the lse chain */
  float wa, wb;       /* the element weights */
};

/* The lse chain's part (no reciprocal), for a serial chain that leaves the weights to
 * other threads (combine.cu): da_merge_finish completes it. */
__device__ __forceinline__ da_merge_w da_merge_weights_chain(float lse, float lse_j) {
  da_merge_w w;
  const float mx = fmaxf(lse, lse_j);
  w.a = da_ex2(__fsub_rn(lse, mx));
  w.b = da_ex2(__fsub_rn(lse_j, mx));
  w.s = __fadd_rn(w.a, w.b);
  w.lse = __fadd_rn(mx, da_lg2(w.s));
  w.wa = w.wb = 0.0f;
  return w;
}

__device__ __forceinline__ void da_merge_finish(float a, float b, float s, float &wa, float &wb) {
  const float r = da_recip(s);
  wa = __fmul_rn(a, r);
  wb = __fmul_rn(b, r);
}

__device__ __forceinline__ da_merge_w da_merge_weights(float lse, float lse_j) {
  da_merge_w w = da_merge_weights_chain(lse, lse_j);
  da_merge_finish(w.a, w.b, w.s, w.wa, w.wb);
  return w;
}

__device__ __forceinline__ float da_merge_o(float wa, float wb, float o, float o_j) {
  return __fmaf_rn(wa, o, __fmul_rn(wb, o_j));
}

/*
 * L2 policies for a decode step's traffic (NOTES v5.11, v5.12); a cache hint changes no value.
 * Stores of a split's partial (o_j, lse_j) to the accumulator pools take evict_last: they stay
 * in L2 for the combine. Evicted dirty by the K/V stream, and so written back while it runs,
 * they cost ~1 us a split end a pipe. In launches that stream K/V over the L2, prefill_sm90.cu
 * loads the K/V that one item alone reads evict_first, and combine.cu drops a row's partials
 * once folded (da_l2_discard). Policies are made where they are used (volatile: no register
 * held across the kernels' loops).
 */
__device__ __forceinline__ uint64_t da_l2_evict_last() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ uint64_t da_l2_evict_first() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}
/* The 128-byte L2 line at p (128-byte aligned) is dropped without a write-back: its contents
 * become undefined, so only for data no one reads again before writing it. */
__device__ __forceinline__ void da_l2_discard(const void *p) {
  asm volatile("discard.global.L2 [%0], 128;" ::"l"(p) : "memory");
}
__device__ __forceinline__ void da_st_partial(float *p, float v, uint64_t pol) {
  asm volatile("st.global.L2::cache_hint.f32 [%0], %1, %2;" ::"l"(p), "f"(v), "l"(pol) : "memory");
}
__device__ __forceinline__ void da_st_partial2(float *p, float x, float y, uint64_t pol) {
  asm volatile("st.global.L2::cache_hint.v2.f32 [%0], {%1, %2}, %3;" ::"l"(p), "f"(x), "f"(y), "l"(pol) : "memory");
}

/*
 * The split end of one row r of a thread's m16n8 accumulator fragments acc[NV][4] (the
 * thread's elements of that row: acc[n][2 r], acc[n][2 r + 1]), split state (m, l):
 *   DA_END_WRITE  o_j to the accumulator pool: part + n * 8 gets the pair of fragment n
 *   DA_END_FIRST  o_j into the in-row fold: fold(n, e) (the row's first split)
 *   DA_END_MERGE  fold = merge(fold, o_j) with fold_lse (a later split)
 * fold(n, e) is the float & of element e of fragment n: shared memory (attn.cu) or registers
 * (prefill_sm90.cu). Returns lse_j (WRITE, FIRST) or the merged lse (MERGE).
 */
enum { DA_END_WRITE, DA_END_FIRST, DA_END_MERGE };

template <int NV, class Fold>
__device__ __forceinline__ float da_split_end(const float (&acc)[NV][4], int r, float m, float l, int how, float *part,
                                              Fold &&fold, float fold_lse) {
  const float lse_j = da_finalize_lse(m, l);
  const float rl = da_recip(l);
  if (how == DA_END_WRITE) {
    const uint64_t pol = da_l2_evict_last();
#pragma unroll
    for (int n = 0; n < NV; n++)
      da_st_partial2(part + n * 8, da_finalize_o(rl, acc[n][2 * r]), da_finalize_o(rl, acc[n][2 * r + 1]), pol);
    return lse_j;
  }
  if (how == DA_END_FIRST) {
#pragma unroll
    for (int n = 0; n < NV; n++)
#pragma unroll
      for (int e = 0; e < 2; e++) fold(n, 2 * r + e) = da_finalize_o(rl, acc[n][2 * r + e]);
    return lse_j;
  }
  const da_merge_w mw = da_merge_weights(fold_lse, lse_j);
#pragma unroll
  for (int n = 0; n < NV; n++)
#pragma unroll
    for (int e = 0; e < 2; e++) {
      float &f = fold(n, 2 * r + e);
      f = da_merge_o(mw.wa, mw.wb, f, da_finalize_o(rl, acc[n][2 * r + e]));
    }
  return mw.lse;
}

/* A prefix item's end (item.h) for row r: the fold's elements as DA_END_WRITE lays out an
 * o_j (part + n * 8 gets the pair of fragment n), and fold_lse to *lse_slot where lse_slot is
 * non-null (one lane of the row's), both kept in the L2 for the combine. The combine takes them
 * as its left fold's state, exactly as the in-row fold would have gone on from them. */
template <int NV, class Fold>
__device__ __forceinline__ void da_store_fold(int r, float *part, Fold &&fold, float *lse_slot, float fold_lse) {
  const uint64_t pol = da_l2_evict_last();
#pragma unroll
  for (int n = 0; n < NV; n++) da_st_partial2(part + n * 8, fold(n, 2 * r), fold(n, 2 * r + 1), pol);
  if (lse_slot != nullptr) da_st_partial(lse_slot, fold_lse, pol);
}

/* Output lse in natural log from the log2-domain value. */
__device__ __forceinline__ float da_lse_out(float lse2) { return __fmul_rn(lse2, DA_LN2); }

#endif /* DA_CUDA_NUMERICS_CUH */
