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

/* The row's l at a split end: the quad's parts, (l0 + l1) + (l2 + l3) in every lane (a + b ==
 * b + a exactly). Every lane of the warp calls it. */
__device__ __forceinline__ float da_l_row(const da_row_state &st, int r) {
  float l = __fadd_rn(st.l[r], __shfl_xor_sync(0xffffffffu, st.l[r], 1));
  return __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, 2));
}

/*
 * Division by a row's divisor: the IEEE quotient RN(a / b), the bits of __fdiv_rn, in five
 * dependent FMA-pipe instructions once the row's y = RN(1/b) is known. q0 = a y is within
 * two ulps of a / b; one Markstein step (r = a - q b exact by FMA, q + r y) makes it faithful,
 * a second one correctly rounded (Markstein's theorem: y = RN(1/b), q faithful, no underflow
 * or overflow => RN(q + r y) = RN(a / b); a quotient is never a tie). That needs b and a in
 * the ranges da_div_by / da_div_fast_ok check (|a / b| and every remainder stay normal);
 * outside them (zeros, subnormals, inf, NaN, huge values) callers redo the row with
 * __fdiv_rn. Both give the same bits wherever both apply, so which one ran never shows:
 * tests/cuda/test_div.cu compares them on 2^28 quotients. Why: __fdiv_rn is a MUFU.RCP,
 * a range check and a branch per element, and the split finalize divides every output
 * element twice (acc / l, then the merge's / s).
 */
struct da_div {
  float b, y; /* divisor, RN(1/b) */
  bool ok;    /* b in [2^-32, 2^33) */
};

/* The divisor b with its y = RN(1/b) computed elsewhere (staged in shared memory). */
__device__ __forceinline__ da_div da_div_of(float b, float y) {
  da_div d;
  d.b = b;
  d.y = y;
  d.ok = ((__float_as_uint(b) >> 23) & 0xffu) - (127u - 32u) <= 64u;
  return d;
}

__device__ __forceinline__ da_div da_div_by(float b) { return da_div_of(b, __frcp_rn(b)); }

/*
 * The numerators of a group of fast quotients, for one range check per group instead of one
 * per element: the smallest and largest magnitude (hi turns NaN with any NaN) and whether
 * some divisor was outside its range. da_range_ok: every quotient of the group was in the
 * fast range (|a| in [2^-90, 2^91), b in range), so each is RN(a / b).
 */
struct da_range {
  float lo, hi;
  bool div_bad;
};

__device__ __forceinline__ da_range da_range_init() { return da_range{INFINITY, 0.0f, false}; }

__device__ __forceinline__ float da_max_nan(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

__device__ __forceinline__ void da_range_add(da_range &g, const da_div &d, float a) {
  g.lo = fminf(g.lo, fabsf(a));
  g.hi = da_max_nan(g.hi, fabsf(a));
  g.div_bad |= !d.ok;
}

__device__ __forceinline__ bool da_range_ok(const da_range &g) {
  return !g.div_bad && g.lo >= 0x1p-90f && g.hi < 0x1p91f;
}

/* One quotient's check (tests). */
__device__ __forceinline__ bool da_div_fast_ok(const da_div &d, float a) {
  da_range g = da_range_init();
  da_range_add(g, d, a);
  return da_range_ok(g);
}

__device__ __forceinline__ float da_div_fast(const da_div &d, float a) {
  const float q0 = __fmul_rn(a, d.y);
  const float r0 = __fmaf_rn(-q0, d.b, a);
  const float q1 = __fmaf_rn(r0, d.y, q0);
  const float r1 = __fmaf_rn(-q1, d.b, a);
  return __fmaf_rn(r1, d.y, q1);
}

/* Split finalize: o_j = acc / l, lse_j = m + log2(l). Only for rows with l > 0.
 * da_finalize_o is the fast quotient; when its group's da_range is not da_range_ok the
 * group is redone with da_finalize_o_exact (same bits where both apply). */
__device__ __forceinline__ float da_finalize_o(const da_div &l, float acc, da_range &g) {
  da_range_add(g, l, acc);
  return da_div_fast(l, acc);
}
__device__ __forceinline__ float da_finalize_o_exact(const da_div &l, float acc) { return __fdiv_rn(acc, l.b); }
__device__ __forceinline__ float da_finalize_lse(float m, float l) { return __fadd_rn(m, da_lg2(l)); }

/* Left-fold merge (o, lse) <- merge((o, lse), (o_j, lse_j)): weights once per row, then
 * one da_merge_o per element (fast quotient, redo as for da_finalize_o). */
struct da_merge_w {
  float a, b, lse;
  da_div s; /* a + b */
};

/* The weights without s's reciprocal (w.s.y unset: da_div_by(w.s.b) or da_div_of later),
 * for a serial lse chain that leaves the reciprocals to other threads. */
__device__ __forceinline__ da_merge_w da_merge_weights_chain(float lse, float lse_j) {
  da_merge_w w;
  const float mx = fmaxf(lse, lse_j);
  w.a = da_ex2(__fsub_rn(lse, mx));
  w.b = da_ex2(__fsub_rn(lse_j, mx));
  w.s.b = __fadd_rn(w.a, w.b);
  w.lse = __fadd_rn(mx, da_lg2(w.s.b));
  return w;
}

__device__ __forceinline__ da_merge_w da_merge_weights(float lse, float lse_j) {
  da_merge_w w = da_merge_weights_chain(lse, lse_j);
  w.s = da_div_by(w.s.b);
  return w;
}

__device__ __forceinline__ float da_merge_num(const da_merge_w &w, float o, float o_j) {
  return __fmaf_rn(w.a, o, __fmul_rn(w.b, o_j));
}
__device__ __forceinline__ float da_merge_o(const da_merge_w &w, float o, float o_j, da_range &g) {
  const float n = da_merge_num(w, o, o_j);
  da_range_add(g, w.s, n);
  return da_div_fast(w.s, n);
}
__device__ __forceinline__ float da_merge_o_exact(const da_merge_w &w, float o, float o_j) {
  return __fdiv_rn(da_merge_num(w, o, o_j), w.s.b);
}

/*
 * The split end of one row r of a thread's m16n8 accumulator fragments acc[NV][4] (the
 * thread's elements of that row: acc[n][2 r], acc[n][2 r + 1]), split state (m, l):
 *   DA_END_WRITE  o_j to the accumulator pool: part + n * 8 gets the pair of fragment n
 *   DA_END_FIRST  o_j into the in-row fold: fold[(n * 4 + e) * 32] (the row's first split)
 *   DA_END_MERGE  fold = merge(fold, o_j) with fold_lse (a later split)
 * Returns lse_j (WRITE, FIRST) or the merged lse (MERGE). CHUNK fragments at a time (4:
 * head_dim 256 on mma.sync does not spill; the wgmma consumers have room for more); a chunk whose da_range is not da_range_ok is redone with
 * __fdiv_rn (the same bits). A merge numerator computed from a wrong fast o_j only marks
 * the chunk for the redo, which recomputes both.
 */
enum { DA_END_WRITE, DA_END_FIRST, DA_END_MERGE };

template <int NV, int CHUNK = 4>
__device__ __forceinline__ float da_split_end(const float (&acc)[NV][4], int r, float m, float l, int how, float *part,
                                              float *fold, float fold_lse) {
  constexpr int NC = NV < CHUNK ? NV : CHUNK;
  const float lse_j = da_finalize_lse(m, l);
  const da_div dl = da_div_by(l);
  da_merge_w mw{};
  if (how == DA_END_MERGE) mw = da_merge_weights(fold_lse, lse_j);
#pragma unroll
  for (int n0 = 0; n0 < NV; n0 += NC) {
    da_range g = da_range_init();
    float v[NC][2], f[NC][2];
#pragma unroll
    for (int n = 0; n < NC; n++) {
      v[n][0] = da_finalize_o(dl, acc[n0 + n][2 * r], g);
      v[n][1] = da_finalize_o(dl, acc[n0 + n][2 * r + 1], g);
    }
    if (how == DA_END_MERGE) {
#pragma unroll
      for (int n = 0; n < NC; n++) {
        f[n][0] = fold[((n0 + n) * 4 + 2 * r) * 32];
        f[n][1] = fold[((n0 + n) * 4 + 2 * r + 1) * 32];
      }
#pragma unroll
      for (int n = 0; n < NC; n++) {
        v[n][0] = da_merge_o(mw, f[n][0], v[n][0], g);
        v[n][1] = da_merge_o(mw, f[n][1], v[n][1], g);
      }
    }
    if (!da_range_ok(g)) {
#pragma unroll
      for (int n = 0; n < NC; n++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
          v[n][e] = da_finalize_o_exact(dl, acc[n0 + n][2 * r + e]);
          if (how == DA_END_MERGE) v[n][e] = da_merge_o_exact(mw, f[n][e], v[n][e]);
        }
      }
    }
    if (how == DA_END_WRITE) {
#pragma unroll
      for (int n = 0; n < NC; n++) *reinterpret_cast<float2 *>(part + (n0 + n) * 8) = make_float2(v[n][0], v[n][1]);
    } else {
#pragma unroll
      for (int n = 0; n < NC; n++) {
        fold[((n0 + n) * 4 + 2 * r) * 32] = v[n][0];
        fold[((n0 + n) * 4 + 2 * r + 1) * 32] = v[n][1];
      }
    }
  }
  return how == DA_END_MERGE ? mw.lse : lse_j;
}

/* Output lse in natural log from the log2-domain value. */
__device__ __forceinline__ float da_lse_out(float lse2) { return __fmul_rn(lse2, DA_LN2); }

#endif /* DA_CUDA_NUMERICS_CUH */
