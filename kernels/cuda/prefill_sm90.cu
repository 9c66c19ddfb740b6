/*
 * prefill_sm90.cu — attention for blocks of more than 16 rows on Hopper (sm_90a): warpgroup
 * MMA (wgmma) fed by TMA, one producer warp and two consumer warpgroups per CTA, a K/V
 * pipeline of NST stages over mbarriers. Same work items and per-row arithmetic as attn.cu:
 *
 *   per tile of T = 64 keys (absolute, ascending; splits of S tokens at absolute positions):
 *     S = Q K^T       wgmma m64n64k16, k-order over head_dim ascending in steps of 16, one
 *                     fp32 accumulator zeroed first (attn.cu: mma.sync m16n8k16, same order)
 *     mask, score, da_quad_max, da_rescale, da_exp_row, da_ntile_sum, da_l_update
 *     acc = alpha * acc; P rounded to the input dtype (registers)
 *     acc += P V      wgmma m64nDk16 (P from registers), k-order over keys ascending in 16s
 *   split end: da_finalize_o / da_finalize_lse, then the in-row left fold (da_merge_*) in
 *   registers, or the partial write to the accumulator pool.
 *
 * An output element of an MMA depends only on its own row of A and column of B, so which
 * rows or columns share an instruction does not change it; whether wgmma and mma.sync give
 * the same fp32 bits for the same k-chain is what tests/cuda/test_mma_bits.cu checks.
 *
 * CTA: warpgroup 0 is the producer (one warp issues TMA; registers given back), warpgroups
 * 1 and 2 own rows [row0, row0 + 64) and [row0 + 64, row0 + 128) of the item
 * (DA_CU_SM90_BLOCK_ROWS). Both consumers see every tile of the CTA's key range and compute
 * only the tiles of their own rows' range. K/V tiles arrive by TMA in 128-byte-swizzled
 * [64][64] boxes (one per page chunk and 64 columns); tiles at the edge of the key range get
 * the rows outside it zeroed by the producer before they are published, so poison (unwritten
 * pages, NaN in tests) never reaches an MMA.
 */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda_kernels.h"
#include "numerics.cuh"
#include "sm90.cuh"

using namespace da_sm90;

namespace {

constexpr int BN = DA_CU_TILE;  /* keys per tile */
constexpr int NCW = 2;          /* consumer warpgroups */
constexpr int BM = NCW * 64;    /* rows per CTA */
constexpr int NTHREADS = 128 * (NCW + 1);
constexpr int NTS = BN / 8;     /* n8 fragments of a score tile */
static_assert(BM == DA_CU_SM90_BLOCK_ROWS, "rows per CTA");

/* Shared memory, from a 1024-byte aligned base: Q of each consumer, K and V stages, the
 * in-row fold (fp32 o of every row; touched only at split ends), barriers. */
template <int D>
struct layout {
  static constexpr int NST = D == 128 ? 3 : 4; /* K/V stages */
  static constexpr int CB = D / 64;         /* 64-column blocks of a row */
  static constexpr int Q_B = 64 * D * 2;    /* one consumer's Q */
  static constexpr int TILE_B = BN * D * 2; /* one K or V tile */
  static constexpr int OFF_K = NCW * Q_B;
  static constexpr int OFF_V = OFF_K + NST * TILE_B;
  static constexpr int OFF_FOLD = OFF_V + NST * TILE_B;  /* [NCW][4 warps][D / 8][4][32 lanes] fp32 */
  static constexpr int OFF_BAR = OFF_FOLD + BM * D * 4; /* full[NST], empty[NST], aux */
  static constexpr int BYTES = OFF_BAR + (2 * NST + 1) * 8 + 1024;
};

template <bool BF16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (BF16) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&h);
  } else {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&h);
  }
}

/* A row of the block: valid, its position p and window start w0 (the rest is recomputed at
 * split ends, to keep registers for the tiles). */
struct row_info {
  int valid, p, w0;
};

__device__ __forceinline__ row_info make_row(const da_cu_args &a, const da_cu_attn &at, int r) {
  const int G = a.n_q_heads / a.n_kv_heads;
  row_info ri;
  ri.valid = r < at.n_q * G;
  ri.p = at.q_pos + r / G;
  ri.w0 = a.window > 0 ? max(0, ri.p - a.window + 1) : 0;
  return ri;
}

/* Output row (token * n_q_heads + q head) of block row r. */
__device__ __forceinline__ int64_t out_row(const da_cu_args &a, int kvh, int r) {
  const int G = a.n_q_heads / a.n_kv_heads;
  return (int64_t)(r / G) * a.n_q_heads + kvh * G + r % G;
}

/*
 * The producer warp: for every tile of [kt_begin, kt_end], wait until the stage is free,
 * then TMA K and V (one box per page chunk of min(page_tokens, 64) rows and per 64 columns)
 * onto full[stage]. A tile not wholly inside [w0_min, p_max] loads only the chunks that
 * meet the range, onto the aux barrier, waits for them, zeroes the rows outside the range
 * and then arrives on full[stage].
 */
template <int D>
__device__ __forceinline__ void produce(const da_cu_args &a, const da_cu_attn &at, const da_cu_item &it, const CUtensorMap *tm,
                        uint32_t base, int kt_begin, int kt_end, int w0_min, int p_max) {
  using L = layout<D>;
  const int lane = threadIdx.x & 31;
  const uint32_t bar_full = base + L::OFF_BAR, bar_empty = bar_full + 8 * L::NST, bar_aux = bar_empty + 8 * L::NST;
  const int R = a.page_tokens < BN ? a.page_tokens : BN; /* rows per box */
  const int nchunk = BN / R;
  const int64_t page_rows = (int64_t)a.n_layers * 2 * a.n_kv_heads * a.page_tokens;
  const int64_t k_rows = ((int64_t)at.layer * 2 * a.n_kv_heads + it.kv_head) * a.page_tokens;
  const int64_t v_rows = (int64_t)a.n_kv_heads * a.page_tokens;
  const int32_t *pt = a.pages + at.pt_off;
  const uint32_t chunk_bytes = (uint32_t)R * D * 2 * 2; /* K and V */
  int st = 0;
  uint32_t round = 0, aux_ph = 0;
  for (int kt = kt_begin; kt <= kt_end; kt++) {
    const int k0 = kt * BN;
    const int c0 = k0 + lane * R; /* this lane's chunk */
    int32_t pg = -1;
    if (lane < nchunk && c0 + R - 1 >= w0_min && c0 <= p_max) pg = pt[c0 >> a.page_shift];
    const bool clean = k0 >= w0_min && k0 + BN - 1 <= p_max;
    const int n_load = __popc(__ballot_sync(0xffffffffu, pg >= 0));
    mbar_wait(bar_empty + 8 * st, (round & 1) ^ 1);
    const uint32_t kd = base + L::OFF_K + st * L::TILE_B, vd = base + L::OFF_V + st * L::TILE_B;
    const uint32_t bar = clean ? bar_full + 8 * st : bar_aux;
    if (lane == 0 && n_load > 0) mbar_arrive_tx(bar, (uint32_t)n_load * chunk_bytes);
    __syncwarp();
    if (pg >= 0) {
      const int row = (int)((int64_t)pg * page_rows + k_rows + (c0 & (a.page_tokens - 1)));
#pragma unroll
      for (int cb = 0; cb < L::CB; cb++) {
        tma_load_2d(kd + cb * 64 * 128 + lane * R * 128, tm, cb * 64, row, bar);
        tma_load_2d(vd + cb * 64 * 128 + lane * R * 128, tm, cb * 64, row + (int)v_rows, bar);
      }
    }
    if (!clean) {
      if (n_load > 0) {
        mbar_wait(bar_aux, aux_ph);
        aux_ph ^= 1;
      }
      /* Whole 128-byte rows of every column block: the swizzle only permutes inside a row. */
      for (int i = lane; i < BN * L::CB * 8; i += 32) {
        const int r = i / (L::CB * 8), c = i % (L::CB * 8), kp = k0 + r;
        if (kp < w0_min || kp > p_max) {
          const uint32_t off = (c >> 3) * 64 * 128 + r * 128 + (c & 7) * 16;
          st_shared_zero16(kd + off);
          st_shared_zero16(vd + off);
        }
      }
      fence_async_smem();
      __syncwarp();
      if (lane == 0) mbar_arrive(bar_full + 8 * st);
    }
    if (++st == L::NST) st = 0, round++;
  }
}

/* One consumer warpgroup: 64 rows of the item (cw = 0 or 1). OVL: the next tile's S overlaps
 * this tile's softmax (same arithmetic, same bits; only the issue order differs). */
template <int D, bool BF16, bool OVL>
__device__ __forceinline__ void consume(const da_cu_args &a, const da_cu_attn &at, const da_cu_item &it, uint32_t base,
                                        unsigned char *smem_base, int cw, int kt_begin, int kt_end) {
  using L = layout<D>;
  constexpr int NV = D / 8; /* n8 fragments of an output row */
  const int ctid = threadIdx.x - 128 * (cw + 1);
  const int warp = ctid >> 5, lane = ctid & 31, g = lane >> 2, qd = lane & 3;
  const uint32_t bar_full = base + L::OFF_BAR, bar_empty = bar_full + 8 * L::NST;
  const uint32_t qs = base + cw * L::Q_B;
  const int G = a.n_q_heads / a.n_kv_heads;
  const int n_rows = at.n_q * G;
  const int wr0 = it.row0 + cw * 64; /* first row of this warpgroup */

  /* Q rows of the warpgroup, zero-filled past the last row. */
  {
    const uint16_t *q = static_cast<const uint16_t *>(a.q) + at.q_off;
    for (int i = ctid; i < 64 * (D / 8); i += 128) {
      const int r = i / (D / 8), c = i % (D / 8), gr = wr0 + r;
      const bool ok = gr < n_rows;
      const uint16_t *src = ok ? q + ((int64_t)(gr / G) * a.n_q_heads + it.kv_head * G + gr % G) * D + c * 8 : q;
      cp_async16(qs + (c >> 3) * 64 * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4), src, ok);
    }
    cp_async_wait_all();
    fence_async_smem();
    bar_sync(1 + cw, 128);
  }

  /* This warpgroup's rows and key range (a sub-range of the CTA's). */
  const bool active = wr0 < n_rows;
  const int wrl = min(wr0 + 64, n_rows) - 1;
  const int p_min = at.q_pos + wr0 / G, p_max = at.q_pos + wrl / G;
  const int w0_min = a.window > 0 ? max(0, p_min - a.window + 1) : 0;
  const int w0_max = a.window > 0 ? max(0, p_max - a.window + 1) : 0;
  const int tps = a.split_tokens / BN;
  const int my_begin = active ? max(w0_min / BN, it.j0 * tps) : kt_end + 1;
  const int my_end = active ? min(p_max / BN, it.j1 * tps - 1) : kt_begin - 1;

  const int r0 = wr0 + warp * 16 + g; /* this thread's rows: r0 and r0 + 8 */
  row_info ri[2];
  ri[0] = make_row(a, at, r0);
  ri[1] = make_row(a, at, r0 + 8);
  const bool partial = at.slot_base >= 0;

  float acc[NV][4];
  float fold_lse[2] = {0.0f, 0.0f};
  /* This thread's fold values: element (n, e) at fold[(n * 4 + e) * 32]. */
  float *fold = reinterpret_cast<float *>(smem_base + L::OFF_FOLD) + (cw * 4 + warp) * NV * 4 * 32 + lane;
  da_row_state st;
  da_state_reset(st);
#pragma unroll
  for (int n = 0; n < NV; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

  /* S of the tile in stage stg into s: issued, committed, not waited for. */
  auto issue_s = [&](float (&s)[NTS][4], int stg) {
    const uint32_t kb = base + L::OFF_K + stg * L::TILE_B;
#pragma unroll
    for (int n = 0; n < NTS; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
      const uint32_t off = (kk >> 2) * 64 * 128 + (kk & 3) * 32;
      wg_ss<64, BF16, 0>(s, desc_kmajor(qs + off), desc_kmajor(kb + off), 1);
    }
    wg_commit();
  };
  /* Scores, mask, the online-softmax update of tile kt from s, acc scaled, P V issued and
   * committed (not waited for). */
  auto softmax_pv = [&](float (&s)[NTS][4], int kt, int stg) {
    /* A tile inside every row's key range needs no mask. */
    const bool full = kt * BN >= w0_max && kt * BN + BN - 1 <= p_min;
    if (full) {
#pragma unroll
      for (int n = 0; n < NTS; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[n][e] = da_score(s[n][e], a.softcap, a.scale_log2, a.cap_in, a.cap_out_log2);
    } else {
#pragma unroll
      for (int n = 0; n < NTS; n++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const row_info &r = ri[e >> 1];
          const int kp = kt * BN + n * 8 + qd * 2 + (e & 1);
          const bool ok = r.valid && kp >= r.w0 && kp <= r.p;
          s[n][e] = ok ? da_score(s[n][e], a.softcap, a.scale_log2, a.cap_in, a.cap_out_log2) : -INFINITY;
        }
      }
    }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
      float m_use;
      alpha[r] = da_rescale(st, r, da_quad_max<NTS>(s, r), m_use);
      da_exp_row<NTS>(s, r, m_use);
      float parts[NTS];
#pragma unroll
      for (int n = 0; n < NTS; n++) parts[n] = da_ntile_sum<NTS>(s, n, r);
      da_l_update(st, r, alpha[r], parts);
    }
#pragma unroll
    for (int n = 0; n < NV; n++) {
      acc[n][0] = __fmul_rn(acc[n][0], alpha[0]);
      acc[n][1] = __fmul_rn(acc[n][1], alpha[0]);
      acc[n][2] = __fmul_rn(acc[n][2], alpha[1]);
      acc[n][3] = __fmul_rn(acc[n][3], alpha[1]);
    }
    uint32_t pa[BN / 16][4];
#pragma unroll
    for (int kc = 0; kc < BN / 16; kc++) {
      pa[kc][0] = pack2<BF16>(s[2 * kc][0], s[2 * kc][1]);
      pa[kc][1] = pack2<BF16>(s[2 * kc][2], s[2 * kc][3]);
      pa[kc][2] = pack2<BF16>(s[2 * kc + 1][0], s[2 * kc + 1][1]);
      pa[kc][3] = pack2<BF16>(s[2 * kc + 1][2], s[2 * kc + 1][3]);
    }
    const uint32_t vb = base + L::OFF_V + stg * L::TILE_B;
    wg_fence();
#pragma unroll
    for (int kc = 0; kc < BN / 16; kc++) wg_rs<D, BF16, 1>(acc, pa[kc], desc_mnmajor(vb + kc * 16 * 128, 64 * 128), 1);
    wg_commit();
  };
  /* Split j is complete for the warpgroup's rows: finalize and fold or write. */
  auto finalize = [&](int j) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const row_info &w = ri[r];
      const int jf = w.w0 / a.split_tokens, jl = w.p / a.split_tokens;
      if (!w.valid || j < jf || j > jl) continue;
      const float lse_j = da_finalize_lse(st.m[r], st.l[r]);
      if (partial) {
        const int64_t slot = at.slot_base + out_row(a, it.kv_head, r0 + 8 * r) * at.n_splits + j;
        float *dst = a.acc_o + slot * D + qd * 2;
#pragma unroll
        for (int n = 0; n < NV; n++) {
          float2 v;
          v.x = da_finalize_o(acc[n][2 * r], st.l[r]);
          v.y = da_finalize_o(acc[n][2 * r + 1], st.l[r]);
          *reinterpret_cast<float2 *>(dst + n * 8) = v;
        }
        if (qd == 0) a.acc_lse[slot] = lse_j;
      } else if (j == jf) {
#pragma unroll
        for (int n = 0; n < NV; n++) {
          fold[(n * 4 + 2 * r) * 32] = da_finalize_o(acc[n][2 * r], st.l[r]);
          fold[(n * 4 + 2 * r + 1) * 32] = da_finalize_o(acc[n][2 * r + 1], st.l[r]);
        }
        fold_lse[r] = lse_j;
      } else {
        const da_merge_w mw = da_merge_weights(fold_lse[r], lse_j);
#pragma unroll
        for (int n = 0; n < NV; n++) {
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; e++) {
            float *f = &fold[(n * 4 + e) * 32];
            *f = da_merge_o(mw, *f, da_finalize_o(acc[n][e], st.l[r]));
          }
        }
        fold_lse[r] = mw.lse;
      }
    }
  };
  auto reset = [&]() {
    da_state_reset(st);
#pragma unroll
    for (int n = 0; n < NV; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  };

  /* Tile kt's position: its stage and phase, its split j and its index inside the split. */
  int kt = kt_begin, stage = 0, j = kt_begin / tps, in_split = kt_begin - j * tps;
  uint32_t round = 0;
  auto release = [&]() { /* this warp is done with tile kt's stage; on to tile kt + 1 */
    __syncwarp();
    if (lane == 0) mbar_arrive(bar_empty + 8 * stage);
    if (++stage == L::NST) stage = 0, round++;
    if (++in_split == tps) in_split = 0, j++;
    kt++;
  };
  float sa[NTS][4], sb[NTS][4];
  if constexpr (!OVL) {
    for (; kt <= kt_end;) {
      mbar_wait(bar_full + 8 * stage, round & 1);
      if (kt >= my_begin && kt <= my_end) {
        if (kt == my_begin || in_split == 0) reset();
        issue_s(sa, stage);
        wg_wait<0>();
        reg_fence(sa);
        softmax_pv(sa, kt, stage);
        wg_wait<0>();
        reg_fence(acc);
        if (kt == my_end || in_split == tps - 1) finalize(j);
      }
      release();
    }
  } else {
    /* The next tile's S is issued before this tile's softmax, so the tensor cores work on
     * it while this warpgroup runs the softmax; sa and sb take turns. */
    for (; kt < my_begin && kt <= kt_end;) {
      mbar_wait(bar_full + 8 * stage, round & 1);
      release();
    }
    if (kt <= my_end) {
      mbar_wait(bar_full + 8 * stage, round & 1);
      issue_s(sa, stage);
      wg_wait<0>();
      reg_fence(sa);
      /* sc holds S of tile kt; returns true after the last tile of the range. */
      auto step = [&](float (&sc)[NTS][4], float (&sn)[NTS][4]) -> bool {
        const bool next = kt < my_end;
        if (next) {
          const int ns = stage + 1 == L::NST ? 0 : stage + 1;
          mbar_wait(bar_full + 8 * ns, (ns == 0 ? round + 1 : round) & 1);
          issue_s(sn, ns);
        }
        if (kt == my_begin || in_split == 0) reset();
        softmax_pv(sc, kt, stage);
        wg_wait<0>();
        reg_fence(acc);
        reg_fence(sn);
        if (kt == my_end || in_split == tps - 1) finalize(j);
        release();
        return !next;
      };
      for (;;) {
        if (step(sa, sb)) break;
        if (step(sb, sa)) break;
      }
    }
    for (; kt <= kt_end;) {
      mbar_wait(bar_full + 8 * stage, round & 1);
      release();
    }
  }

  if (partial || !active) return;
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const row_info &w = ri[r];
    if (!w.valid) continue;
    const int64_t row = out_row(a, it.kv_head, r0 + 8 * r);
    uint32_t *dst = reinterpret_cast<uint32_t *>(static_cast<uint16_t *>(a.o) + at.o_off + row * D + qd * 2);
#pragma unroll
    for (int n = 0; n < NV; n++) dst[n * 4] = pack2<BF16>(fold[(n * 4 + 2 * r) * 32], fold[(n * 4 + 2 * r + 1) * 32]);
    if (at.lse_off >= 0 && qd == 0) a.lse[at.lse_off + row] = da_lse_out(fold_lse[r]);
  }
}

template <int D, bool BF16, bool OVL>
__global__ void __launch_bounds__(NTHREADS, 1) prefill_kernel(const da_cu_args a, const __grid_constant__ CUtensorMap tm) {
  using L = layout<D>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023) & ~1023u;
  unsigned char *smem_base = smem_raw + (base - smem_addr(smem_raw)); /* the same, generic */
  const uint32_t bar_full = base + L::OFF_BAR, bar_empty = bar_full + 8 * L::NST, bar_aux = bar_empty + 8 * L::NST;

  const da_cu_item it = a.items[blockIdx.x];
  const da_cu_attn at = a.attns[it.attn];
  const int G = a.n_q_heads / a.n_kv_heads;
  const int n_rows = at.n_q * G;
  const int rlast = min(it.row0 + BM, n_rows) - 1;
  /* The CTA's key range: [w0 of its first row, p of its last row], within splits [j0, j1). */
  const int p_min = at.q_pos + it.row0 / G, p_max = at.q_pos + rlast / G;
  const int w0_min = a.window > 0 ? max(0, p_min - a.window + 1) : 0;
  const int tps = a.split_tokens / BN;
  const int kt_begin = max(w0_min / BN, it.j0 * tps);
  const int kt_end = min(p_max / BN, it.j1 * tps - 1);

  if (threadIdx.x == 0) {
    for (int s = 0; s < L::NST; s++) {
      mbar_init(bar_full + 8 * s, 1);
      mbar_init(bar_empty + 8 * s, NCW * 4); /* one arrival per consumer warp */
    }
    mbar_init(bar_aux, 1);
    mbar_init_fence();
  }
  if (threadIdx.x == 32) tma_prefetch_desc(&tm);
  __syncthreads();

  if (threadIdx.x < 128) {
    regs_dec<40>();
    if (threadIdx.x < 32) produce<D>(a, at, it, &tm, base, kt_begin, kt_end, w0_min, p_max);
  } else {
    regs_inc<232>();
    consume<D, BF16, OVL>(a, at, it, base, smem_base, threadIdx.x / 128 - 1, kt_begin, kt_end);
  }
}

typedef PFN_cuTensorMapEncodeTiled_v12000 encode_fn;

encode_fn get_encode() {
  static encode_fn fn = [] {
    void *p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return (encode_fn) nullptr;
    }
    return (encode_fn)p;
  }();
  return fn;
}

template <int D, bool BF16, bool OVL>
cudaError_t launch(const da_cu_args *a, int n, cudaStream_t stream) {
  using L = layout<D>;
  /* The KV pool as a [rows][D] matrix: a row is one token of one (page, layer, K|V, kv head)
   * slab; a box is min(page_tokens, 64) rows x 64 columns, 128-byte swizzled. */
  const uint64_t rows = (uint64_t)a->n_pool_pages * a->n_layers * 2 * a->n_kv_heads * a->page_tokens;
  if (rows >= (1ull << 31)) return cudaErrorInvalidValue; /* TMA coordinates are int32 */
  encode_fn encode = get_encode();
  if (encode == nullptr) return cudaErrorNotSupported;
  CUtensorMap tm;
  const cuuint64_t dims[2] = {(cuuint64_t)D, (cuuint64_t)rows};
  const cuuint64_t strides[1] = {(cuuint64_t)D * 2};
  const cuuint32_t box[2] = {64, (cuuint32_t)(a->page_tokens < BN ? a->page_tokens : BN)};
  const cuuint32_t estr[2] = {1, 1};
  CUresult r = encode(&tm, BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, a->kv, dims,
                      strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return cudaErrorInvalidValue;
  /* The shared-memory limit is a per-device function attribute: set once per device. */
  static unsigned long long configured = 0;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev >= 64 || !(configured & (1ull << dev))) {
    e = cudaFuncSetAttribute(prefill_kernel<D, BF16, OVL>, cudaFuncAttributeMaxDynamicSharedMemorySize, L::BYTES);
    if (e != cudaSuccess) return e;
    if (dev < 64) configured |= 1ull << dev;
  }
  prefill_kernel<D, BF16, OVL><<<n, NTHREADS, L::BYTES, stream>>>(*a, tm);
  return cudaGetLastError();
}

} // namespace

extern "C" int da_cuda_prefill_sm90(const da_cu_args *a, int overlap, cudaStream_t stream) {
  const int n = a->n_items - a->n_split_items;
  if (n <= 0) return 0;
  switch (a->head_dim * 4 + (a->bf16 ? 2 : 0) + (overlap ? 1 : 0)) {
  case 64 * 4 + 3: return (int)launch<64, true, true>(a, n, stream);
  case 64 * 4 + 2: return (int)launch<64, true, false>(a, n, stream);
  case 64 * 4 + 1: return (int)launch<64, false, true>(a, n, stream);
  case 64 * 4: return (int)launch<64, false, false>(a, n, stream);
  case 128 * 4 + 3: return (int)launch<128, true, true>(a, n, stream);
  case 128 * 4 + 2: return (int)launch<128, true, false>(a, n, stream);
  case 128 * 4 + 1: return (int)launch<128, false, true>(a, n, stream);
  case 128 * 4: return (int)launch<128, false, false>(a, n, stream);
  }
  return (int)cudaErrorInvalidValue;
}
