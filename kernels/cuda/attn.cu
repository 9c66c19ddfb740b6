/*
 * attn.cu — paged split-KV attention on tensor cores (mma.sync m16n8k16, bf16/fp16 in,
 * fp32 accumulate) for mixed batches: every CTA takes one work item (attention request,
 * kv head, 64 packed rows, split range) from the list the backend built, so decode rows and
 * prefill rows run in the same launch through the same per-row arithmetic.
 *
 * Per warp: 16 rows. Per tile of T = 64 or 128 keys (BN): S = Q K^T (k-order over head_dim ascending,
 * in steps of 16), mask, da_tile_update, acc = alpha * acc + P V (k-order over keys
 * ascending, in steps of 16). A row's keys are never split across warps. K/V tiles are
 * shared by the CTA's four warps, double-buffered with cp.async; keys outside the block's
 * key range are zero-filled so padding never reaches the arithmetic.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda_kernels.h"
#include "numerics.cuh"
#include "pdl.cuh"

namespace {

constexpr int BM = DA_CU_BLOCK_ROWS;

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

/* Byte offset of 16-byte chunk c of row r in a [rows][D] tile, XOR-swizzled over 8 rows. */
template <int D>
__device__ __forceinline__ uint32_t swz(int r, int c) {
  return (uint32_t)(r * D * 2 + ((c ^ (r & 7)) << 4));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2_t(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

template <bool BF16>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

struct row_info {
  int valid, t, h, p, w0, jf, jl;
};

__device__ __forceinline__ row_info make_row(const da_cu_args &a, const da_cu_attn &at, int kvh,
                                             int r) {
  const int G = a.n_q_heads / a.n_kv_heads;
  row_info ri;
  ri.valid = r < at.n_q * G;
  ri.t = r / G;
  ri.h = kvh * G + r % G;
  ri.p = at.q_pos + ri.t;
  ri.w0 = a.window > 0 ? max(0, ri.p - a.window + 1) : 0;
  ri.jf = ri.w0 / a.split_tokens;
  ri.jl = ri.p / a.split_tokens;
  return ri;
}

/*
 * SPLIT = false: 4 warps, each owns 16 rows of the 64-row block and every key and column.
 * SPLIT = true (blocks of at most 16 rows: decode): NW = 8 warps share the 16 rows; warp w
 * computes S for keys [NF 8w, NF 8(w + 1)) of each tile (NF = BN / 64 n8 fragments) and P.V
 * for columns [w D/8, (w+1) D/8);
 * the scores go through shared memory so that every warp holds the whole tile and runs the
 * tile update itself. Both run the same per-row arithmetic (numerics.cuh) on the same
 * fragment layout, so a row gives the same bits either way.
 */
template <int D, int BN, bool BF16, bool SPLIT>
__global__ void __launch_bounds__(SPLIT ? 256 : 128,
                                  SPLIT ? (BN == 64 ? 2 : 1) : (D == 64 ? (BN == 64 ? 3 : 2) : (D == 128 ? 2 : 1)))
attn_kernel(const da_cu_args a) {
  constexpr int NTS = BN / 8; /* n8 fragments per score tile */
  constexpr int NW = SPLIT ? 8 : 4;
  constexpr int NF = SPLIT ? NTS / NW : NTS; /* score n8 fragments a warp computes */
  constexpr int NT = NW * 32;
  constexpr int NTD = D / 8;            /* n8 fragments over head_dim */
  constexpr int NV = SPLIT ? NTD / NW : NTD; /* output n8 fragments per warp */
  constexpr int CH = D / 8;             /* 16-byte chunks per row */
  constexpr int TILE_B = BN * D * 2;
  constexpr int QROWS = SPLIT ? 16 : BM;
  constexpr int XCH_B = SPLIT ? NTS * 32 * 16 : 0; /* the score exchange: a tile's scores */
  constexpr bool QREG = D <= 128;       /* Q fragments stay in registers */
  const int nst = a.stages;             /* 2 or 3 K/V stages */
  /* The combine, launched next as a programmatic dependent, may be scheduled once every CTA
   * of this grid has started; it reads the partials only after this grid has completed
   * (da_pdl_wait), so triggering early is safe. */
  da_pdl_trigger();
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char *qs = smem;
  float4 *x_s = reinterpret_cast<float4 *>(qs + QROWS * D * 2); /* SPLIT: [NW][32 lanes] scores */
  unsigned char *ks = qs + QROWS * D * 2 + XCH_B; /* [nst][BN][D] */
  unsigned char *vs = ks + nst * TILE_B;          /* [nst][BN][D] */
  float *fold = reinterpret_cast<float *>(vs + nst * TILE_B); /* [NW][NV][4][32], in-row only */

  const da_cu_item it = a.items[blockIdx.x];
  const da_cu_attn at = a.attns[it.attn];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int G = a.n_q_heads / a.n_kv_heads;
  const int n_rows = at.n_q * G;
  const int rlast = min(it.row0 + QROWS, n_rows) - 1;

  /* The block's key range: [w0 of its first row, p of its last row]. */
  const int p_min = at.q_pos + it.row0 / G, p_max = at.q_pos + rlast / G;
  const int w0_min = a.window > 0 ? max(0, p_min - a.window + 1) : 0;
  const int w0_max = a.window > 0 ? max(0, p_max - a.window + 1) : 0;
  const int tps = a.split_tokens / BN;
  const int kt_begin = max(w0_min / BN, it.j0 * tps);
  const int kt_end = min(p_max / BN, it.j1 * tps - 1);

  const int64_t slab = (int64_t)a.page_tokens * D;
  const int64_t page_elems = (int64_t)a.n_layers * 2 * a.n_kv_heads * slab;
  const int64_t kv_base = ((int64_t)at.layer * 2 * a.n_kv_heads + it.kv_head) * slab;
  const int32_t *pt = a.pages + at.pt_off;
  const uint16_t *kv = static_cast<const uint16_t *>(a.kv);

  /* Q rows of the block, zero-filled past the last row. */
  {
    const uint16_t *q = static_cast<const uint16_t *>(a.q) + at.q_off;
    for (int i = tid; i < QROWS * CH; i += NT) {
      const int r = i / CH, c = i % CH, gr = it.row0 + r;
      const bool ok = gr < n_rows;
      const int t = gr / G, h = it.kv_head * G + gr % G;
      const uint16_t *src = ok ? q + ((int64_t)t * a.n_q_heads + h) * D + c * 8 : q;
      cp_async16(smem_u32(qs) + swz<D>(r, c), src, ok);
    }
  }
  /* Page ids of the key rows of a tile, fetched one iteration before the tile's copies
   * are issued (so the page-table latency hides behind compute); -1: row not loaded. */
  __shared__ int32_t s_pg[3][BN];
  auto page_of = [&](int kt) -> int32_t {
    const int kp = kt * BN + tid;
    if (tid >= BN || kt > kt_end || kp < w0_min || kp > p_max) return -1;
    return pt[kp >> a.page_shift];
  };
  /* Thread tid copies chunk ld_c of rows ld_r0 + k * LD_RSTEP (k < LD_ITERS) of a tile. */
  constexpr int LD_RSTEP = NT / CH, LD_ITERS = BN / LD_RSTEP;
  static_assert(NT % CH == 0 && BN % LD_RSTEP == 0, "tile copy layout");
  const int ld_r0 = tid / CH, ld_c = tid % CH;
  const uint16_t *kv_k = kv + kv_base + ld_c * 8;  /* K of this head, this thread's chunk */
  const int64_t v_delta = (int64_t)a.n_kv_heads * slab; /* V slab after the K slab */
  auto load_tile = [&](int kt, int stage) {
    const uint32_t kd = smem_u32(ks + stage * TILE_B), vd = smem_u32(vs + stage * TILE_B);
#pragma unroll
    for (int k = 0; k < LD_ITERS; k++) {
      const int r = ld_r0 + k * LD_RSTEP;
      const int32_t pg = s_pg[stage][r];
      const uint16_t *ksrc = kv, *vsrc = kv;
      if (pg >= 0) {
        ksrc = kv_k + (int64_t)pg * page_elems + ((kt * BN + r) & (a.page_tokens - 1)) * D;
        vsrc = ksrc + v_delta;
      }
      cp_async16(kd + swz<D>(r, ld_c), ksrc, pg >= 0);
      cp_async16(vd + swz<D>(r, ld_c), vsrc, pg >= 0);
    }
  };
  for (int k = 0; k < nst; k++)
    if (tid < BN) s_pg[k][tid] = page_of(kt_begin + k);
  __syncthreads();
  for (int k = 0; k < nst - 1; k++) {
    if (kt_begin + k <= kt_end) load_tile(kt_begin + k, k);
    cp_commit();
  }

  const int g = lane >> 2, qd = lane & 3;
  const int rbase = SPLIT ? 0 : warp * 16;
  row_info ri[2];
  ri[0] = make_row(a, at, it.kv_head, it.row0 + rbase + g);
  ri[1] = make_row(a, at, it.kv_head, it.row0 + rbase + g + 8);
  const bool warp_active = SPLIT || it.row0 + warp * 16 < n_rows;
  /* A prefix item (item.h) folds as an in-row item does: partial only for the others. */
  const bool partial = at.slot_base >= 0 && !(it.flags & DA_CU_ITEM_PREFIX);
  const bool lse_writer = !SPLIT || warp == 0;
  const int dcol0 = SPLIT ? warp * NV : 0; /* first output n8 fragment of this warp */

  uint32_t qreg[QREG ? D / 16 : 1][4];
  float acc[NV][4];
  float fold_lse[2] = {0.0f, 0.0f};
  da_row_state st;
  float *myfold = fold + warp * NV * 4 * 32 + lane;

  /* The tile update of both forms below, on the whole tile's scores x in the prefill rows'
   * layout: the online-softmax update of (m, l), x becomes p, acc is scaled by alpha. */
  auto update = [&](float (&x)[NTS][4]) {
    float alpha[2];
    da_tile_update<NTS>(st, x, a.exp_c, alpha);
#pragma unroll
    for (int n = 0; n < NV; n++) {
      acc[n][0] = __fmul_rn(acc[n][0], alpha[0]);
      acc[n][1] = __fmul_rn(acc[n][1], alpha[0]);
      acc[n][2] = __fmul_rn(acc[n][2], alpha[1]);
      acc[n][3] = __fmul_rn(acc[n][3], alpha[1]);
    }
  };
  /* P's A fragment of key step kc (16 keys), rounded to the input dtype. */
  auto pack_p = [&](const float (&x)[NTS][4], int kc, uint32_t (&pa)[4]) {
    pa[0] = da_pack2<BF16>(x[2 * kc][0], x[2 * kc][1]);
    pa[1] = da_pack2<BF16>(x[2 * kc][2], x[2 * kc][3]);
    pa[2] = da_pack2<BF16>(x[2 * kc + 1][0], x[2 * kc + 1][1]);
    pa[3] = da_pack2<BF16>(x[2 * kc + 1][2], x[2 * kc + 1][3]);
  };

  /* Counters instead of divisions: stage of tile kt, stage the next copy goes to, split j
   * of tile kt and kt's index inside it. */
  int st_cur = 0, st_load = nst - 1, j = kt_begin / tps, in_split = kt_begin - j * tps;
  for (int kt = kt_begin; kt <= kt_end; kt++) {
    const int stage = st_cur;
    const int32_t pg_next = page_of(kt + nst);
    /* Tile kt has landed; after the barrier every warp is done with iteration kt - 1, so
     * its stage and the exchange buffers are free: the barrier also ends that iteration. */
    if (nst == 3) cp_wait<1>();
    else cp_wait<0>();
    __syncthreads();
    if (kt + nst - 1 <= kt_end) load_tile(kt + nst - 1, st_load);
    cp_commit();
    if constexpr (QREG) {
      if (kt == kt_begin && warp_active) {
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
          ldsm_x4(qreg[kk], smem_u32(qs) + swz<D>(rbase + (lane & 15), kk * 2 + (lane >> 4)));
      }
    }
    if (kt == kt_begin || in_split == 0) {
      da_state_reset(st);
#pragma unroll
      for (int n = 0; n < NV; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    }
    const uint32_t kb = smem_u32(ks + stage * TILE_B), vb = smem_u32(vs + stage * TILE_B);
    const uint32_t qb = smem_u32(qs);
    /* A tile inside every row's key range needs no mask (the block is uniform). */
    const bool full = kt * BN >= w0_max && kt * BN + BN - 1 <= p_min;
    if constexpr (SPLIT) {
      float s[NF][4];
#pragma unroll
      for (int f = 0; f < NF; f++) s[f][0] = s[f][1] = s[f][2] = s[f][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; kk += 2) {
#pragma unroll
        for (int f = 0; f < NF; f++) {
          uint32_t kf[4];
          ldsm_x4(kf, kb + swz<D>((warp * NF + f) * 8 + (lane & 7), kk * 2 + (lane >> 3)));
#pragma unroll
          for (int h = 0; h < 2; h++) {
            uint32_t qa[4];
            if constexpr (QREG) {
              qa[0] = qreg[kk + h][0], qa[1] = qreg[kk + h][1], qa[2] = qreg[kk + h][2], qa[3] = qreg[kk + h][3];
            } else {
              ldsm_x4(qa, qb + swz<D>(lane & 15, (kk + h) * 2 + (lane >> 4)));
            }
            mma16816<BF16>(s[f], qa, kf[2 * h], kf[2 * h + 1]);
          }
        }
      }
      /* This warp's keys of the tile to every warp: each then holds the whole tile's scores
       * in the prefill rows' layout and runs the same tile update on them (the update is
       * redundant across the 8 warps, the memory-bound decode's spare issue slots). */
#pragma unroll
      for (int f = 0; f < NF; f++) {
        const int n = warp * NF + f;
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const row_info &r = ri[e >> 1];
          const int kp = kt * BN + n * 8 + qd * 2 + (e & 1);
          const bool ok = full || (r.valid && kp >= r.w0 && kp <= r.p);
          s[f][e] = ok ? da_score_y(s[f][e], a.softcap, a.cap_in, a.cap_out_log2) : -INFINITY;
        }
        x_s[n * 32 + lane] = make_float4(s[f][0], s[f][1], s[f][2], s[f][3]);
      }
      __syncthreads();
      float t[NTS][4];
#pragma unroll
      for (int n = 0; n < NTS; n++) {
        const float4 v = x_s[n * 32 + lane];
        t[n][0] = v.x, t[n][1] = v.y, t[n][2] = v.z, t[n][3] = v.w;
      }
      update(t);
#pragma unroll
      for (int kc = 0; kc < BN / 16; kc++) {
        uint32_t pa[4];
        pack_p(t, kc, pa);
        if constexpr (NV == 1) {
          uint32_t vf[2];
          ldsm_x2_t(vf, vb + swz<D>(kc * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), dcol0));
          mma16816<BF16>(acc[0], pa, vf[0], vf[1]);
        } else {
#pragma unroll
          for (int dp = 0; dp < NV / 2; dp++) {
            uint32_t vf[4];
            ldsm_x4_t(vf, vb + swz<D>(kc * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), dcol0 + dp * 2 + (lane >> 4)));
            mma16816<BF16>(acc[2 * dp], pa, vf[0], vf[1]);
            mma16816<BF16>(acc[2 * dp + 1], pa, vf[2], vf[3]);
          }
        }
      }
    } else if (warp_active) {
      float s[NTS][4];
#pragma unroll
      for (int n = 0; n < NTS; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; kk++) {
        uint32_t qa[4];
        if constexpr (QREG) {
          qa[0] = qreg[kk][0], qa[1] = qreg[kk][1], qa[2] = qreg[kk][2], qa[3] = qreg[kk][3];
        } else {
          ldsm_x4(qa, qb + swz<D>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
        }
#pragma unroll
        for (int np = 0; np < NTS / 2; np++) {
          uint32_t kf[4];
          ldsm_x4(kf, kb + swz<D>(np * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
          mma16816<BF16>(s[2 * np], qa, kf[0], kf[1]);
          mma16816<BF16>(s[2 * np + 1], qa, kf[2], kf[3]);
        }
      }
      if (full && a.softcap) {
#pragma unroll
        for (int n = 0; n < NTS; n++)
#pragma unroll
          for (int e = 0; e < 4; e++) s[n][e] = da_score_y(s[n][e], 1, a.cap_in, a.cap_out_log2);
      } else if (!full) {
#pragma unroll
        for (int n = 0; n < NTS; n++) {
#pragma unroll
          for (int e = 0; e < 4; e++) {
            const row_info &r = ri[e >> 1];
            const int kp = kt * BN + n * 8 + qd * 2 + (e & 1);
            const bool ok = r.valid && kp >= r.w0 && kp <= r.p;
            s[n][e] = ok ? da_score_y(s[n][e], a.softcap, a.cap_in, a.cap_out_log2) : -INFINITY;
          }
        }
      }
      update(s);
#pragma unroll
      for (int kc = 0; kc < BN / 16; kc++) {
        uint32_t pa[4];
        pack_p(s, kc, pa);
#pragma unroll
        for (int dp = 0; dp < D / 16; dp++) {
          uint32_t vf[4];
          ldsm_x4_t(vf, vb + swz<D>(kc * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), dp * 2 + (lane >> 4)));
          mma16816<BF16>(acc[2 * dp], pa, vf[0], vf[1]);
          mma16816<BF16>(acc[2 * dp + 1], pa, vf[2], vf[3]);
        }
      }
    }
    if (warp_active && (kt == kt_end || in_split == tps - 1)) {
      /* Split j is complete for every row of the block: finalize and fold or write. */
#pragma unroll
      for (int r = 0; r < 2; r++) {
        const float l_row = da_l_row(st, r); /* every lane: a quad sum */
        const row_info &w = ri[r];
        if (!w.valid || j < w.jf || j > w.jl) continue;
        const int how = partial ? DA_END_WRITE : j == w.jf ? DA_END_FIRST : DA_END_MERGE;
        float *part = nullptr;
        int64_t slot = 0;
        if (partial) {
          slot = at.slot_base + ((int64_t)w.t * a.n_q_heads + w.h) * at.n_splits + j;
          part = a.acc_o + slot * D + dcol0 * 8 + qd * 2;
        }
        const float lse = da_split_end<NV>(
            acc, r, st.m[r], l_row, how, part, [&](int n, int e) -> float & { return myfold[(n * 4 + e) * 32]; },
            fold_lse[r]);
        if (partial) {
          if (qd == 0 && lse_writer) da_st_partial(a.acc_lse + slot, lse, da_l2_evict_last());
        } else {
          fold_lse[r] = lse;
        }
      }
    }
    /* Tile kt's page ids (this stage's slot) were consumed when its copies were issued;
     * the slot is next read after the following iteration's barrier. */
    if (tid < BN) s_pg[stage][tid] = pg_next;
    st_cur = st_cur + 1 == nst ? 0 : st_cur + 1;
    st_load = st_load + 1 == nst ? 0 : st_load + 1;
    if (++in_split == tps) in_split = 0, j++;
  }

  if (partial || !warp_active) return;
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const row_info &w = ri[r];
    if (!w.valid) continue;
    const int64_t row = (int64_t)w.t * a.n_q_heads + w.h;
    if (at.slot_base >= 0) { /* a prefix item (the planner's: each row's first split is the item's j0) */
      const int64_t slot = at.slot_base + row * at.n_splits + w.jf;
      da_store_fold<NV>(r, a.acc_o + slot * D + dcol0 * 8 + qd * 2,
                        [&](int n, int e) -> float & { return myfold[(n * 4 + e) * 32]; },
                        qd == 0 && lse_writer ? a.acc_lse + slot : nullptr, fold_lse[r]);
      continue;
    }
    uint32_t *dst = reinterpret_cast<uint32_t *>(static_cast<uint16_t *>(at.o) + row * D + dcol0 * 8 + qd * 2);
#pragma unroll
    for (int n = 0; n < NV; n++)
      dst[n * 4] = da_pack2<BF16>(myfold[(n * 4 + 2 * r) * 32], myfold[(n * 4 + 2 * r + 1) * 32]);
    if (at.lse != nullptr && qd == 0 && lse_writer) at.lse[row] = da_lse_out(fold_lse[r]);
  }
}

/* Dynamic shared memory of one launch; the stage count and buffers only move data, never
 * the arithmetic. Three K/V stages where they fit at two CTAs per SM. */
template <int D, int BN, bool SPLIT>
size_t smem_bytes(int stages, int inrow) {
  const size_t q = (size_t)(SPLIT ? 16 : BM) * D * 2 + (SPLIT ? BN / 8 * 32 * 16 : 0);
  const size_t fold = inrow ? (size_t)(D / 8) * 4 * 32 * 4 * (SPLIT ? 1 : 4) : 0;
  return q + 2 * (size_t)stages * BN * D * 2 + fold;
}

template <int D, int BN, bool BF16, bool SPLIT>
cudaError_t launch(const da_cu_args *a, int first, int n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  da_cu_args g = *a;
  g.items = a->items + first;
  g.stages = D == 256 || (!SPLIT && D == 128 && a->has_inrow) ? 2 : 3;
  const size_t smem = smem_bytes<D, BN, SPLIT>(g.stages, a->has_inrow);
  /* The shared-memory limit is a per-device function attribute: set once per device. */
  static unsigned long long configured = 0;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev >= 64 || !(configured & (1ull << dev))) {
    size_t mx = smem_bytes<D, BN, SPLIT>(3, 1);
    const size_t cap = 227 * 1024 - 3 * BN * sizeof(int32_t); /* the opt-in limit less the static s_pg */
    if (mx > cap) mx = cap;
    e = cudaFuncSetAttribute(attn_kernel<D, BN, BF16, SPLIT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)mx);
    if (e != cudaSuccess) return e;
    if (dev < 64) configured |= 1ull << dev;
  }
  attn_kernel<D, BN, BF16, SPLIT><<<n, SPLIT ? 256 : 128, smem, stream>>>(g);
  return cudaGetLastError();
}

template <int D, int BN, bool BF16>
cudaError_t launch_both(const da_cu_args *a, cudaStream_t stream) {
  cudaError_t e = launch<D, BN, BF16, false>(a, 0, a->n_items - a->n_split_items, stream);
  if (e != cudaSuccess) return e;
  return launch<D, BN, BF16, true>(a, a->n_items - a->n_split_items, a->n_split_items, stream);
}

} // namespace

extern "C" int da_cuda_attn(const da_cu_args *a, cudaStream_t stream) {
  if (a->n_items == 0) return 0;
  /* T = 128 at head_dim <= 128 only: a tile's K and V of head_dim 256 would not fit twice. */
  switch (a->head_dim * 4 + (a->tile_tokens == 128 ? 2 : 0) + (a->bf16 ? 1 : 0)) {
  case 64 * 4 + 1: return (int)launch_both<64, 64, true>(a, stream);
  case 64 * 4: return (int)launch_both<64, 64, false>(a, stream);
  case 64 * 4 + 3: return (int)launch_both<64, 128, true>(a, stream);
  case 64 * 4 + 2: return (int)launch_both<64, 128, false>(a, stream);
  case 128 * 4 + 1: return (int)launch_both<128, 64, true>(a, stream);
  case 128 * 4: return (int)launch_both<128, 64, false>(a, stream);
  case 128 * 4 + 3: return (int)launch_both<128, 128, true>(a, stream);
  case 128 * 4 + 2: return (int)launch_both<128, 128, false>(a, stream);
  case 256 * 4 + 1: return (int)launch_both<256, 64, true>(a, stream);
  case 256 * 4: return (int)launch_both<256, 64, false>(a, stream);
  }
  return (int)cudaErrorInvalidValue;
}
