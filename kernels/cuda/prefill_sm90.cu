/*
 * prefill_sm90.cu — attention on Hopper (sm_90a), prefill blocks and (since v3.4, unless
 * DA_CUDA_SM90_DECODE=0) decode blocks: warpgroup MMA (wgmma) fed by TMA, one producer warp
 * and two (head_dim 128) or three (64) consumer warpgroups per CTA, a K/V pipeline of NST
 * stages over mbarriers. Same work items and per-row arithmetic as attn.cu:
 *
 *   per tile of T = 64 keys (absolute, ascending; splits of S tokens at absolute positions):
 *     S = Q K^T       wgmma m64n64k16 (Q from registers at head_dim 64, from shared memory
 *                     at 128), k-order over head_dim ascending in steps of 16, one fp32
 *                     accumulator, the first step with scale-d = 0
 *                     (attn.cu: mma.sync m16n8k16 into a zeroed accumulator, same order)
 *     mask, score, da_quad_max, da_rescale, da_exp_row, da_l_update (numerics.cuh, v4)
 *     acc = alpha * acc; P rounded to the input dtype (registers)
 *     acc += P V      wgmma m64nDk16 (P from registers), k-order over keys ascending in 16s
 *   split end: da_finalize_o / da_finalize_lse, then the in-row left fold (da_merge_*) in
 *   registers, or the partial write to the accumulator pool.
 *
 * An output element of an MMA depends only on its own row of A and column of B, so which
 * rows or columns share an instruction does not change it; whether wgmma and mma.sync give
 * the same fp32 bits for the same k-chain is what tests/cuda/test_mma_bits.cu checks.
 *
 * CTA: warpgroup 0 is the producer (one warp issues TMA; registers given back), warpgroup
 * c + 1 owns rows [row0 + 64 c, row0 + 64 c + 64) of an item (DA_CU_SM90_BLOCK_ROWS(D)); a
 * persistent CTA walks several items. Every consumer sees every tile of the CTA's key range
 * and computes only the tiles of its own rows' range (none for rows past the item's). K/V
 * tiles arrive by TMA in 128-byte-swizzled [64][64] boxes (one per page chunk and 64
 * columns); tiles at the edge of the key range get the rows outside it zeroed by the
 * producer before they are published, so poison (unwritten pages, NaN in tests) never
 * reaches an MMA. In prefill launches at head_dim 128 on one ring (QT) the producer also
 * loads each item's Q by TMA (produce_q) into one of two Q buffers, an item ahead, so an
 * item's start waits for no Q load. A batch of decode rows only, all in-row, runs as pipes
 * (prefill_kernel): each consumer warpgroup with a producer warp and a share of the stages
 * of its own.
 */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
#include <type_traits>

#include "cuda_kernels.h"
#include "numerics.cuh"
#include "pdl.cuh"
#include "sm90.cuh"
#include "trace.cuh"

using namespace da_sm90;

namespace {

/* Named barrier of consumer warpgroup c's Q stores: Q_BAR0 + c (ids below 8 left free, as
 * CUTLASS does: NOTES v5.1 saw ids 1-2 fail with bar.arrive in this kernel). */
constexpr int Q_BAR0 = 8;

/* Consumer warpgroups per CTA: three at head_dim 64 and T = 64, where a tile's softmax is
 * long next to its MMAs (FA3's 192-row shape), two at 128 or T = 128 (S over 128 keys takes
 * 64 registers a thread). */
template <int D, int BN> struct cta {
  static constexpr int NCW = D == 64 && BN == 64 ? 3 : 2;
  static constexpr int BM = NCW * 64; /* rows per CTA */
  static constexpr int NTHREADS = 128 * (NCW + 1);
  /* setmaxnreg: the producer warpgroup gives registers back, the consumers take them (the
   * 64K register file: 128 PREGS + 128 NCW CREGS <= 65536). */
  static constexpr int PREGS = NCW == 3 ? 32 : 40;
  static constexpr int CREGS = NCW == 3 ? 160 : 232;
  static_assert(BM == DA_CU_SM90_BLOCK_ROWS(D, BN), "rows per CTA");
  static_assert(128 * PREGS + 128 * NCW * CREGS <= 65536, "register file");
};

/* Shared memory, from a 1024-byte aligned base: Q of every consumer warpgroup at head_dim 128
 * (QS), the barriers, then the K/V stages (stage s: K, then V). At head_dim 64 Q lives in
 * registers; the in-row fold (fp32 o of every row) always does. A launch allocates the stages
 * it uses (bytes(nst)): a smaller carve-out leaves more L1. */
template <int D, int BN, bool QT = false>
struct layout {
  /* K/V stages: NST_RING in one ring; a decode launch with pipes uses NST_MAX, split evenly.
   * A stage of head_dim 128 and T = 128 is 64 KB: three fit beside Q, and no pipes. */
  static constexpr int NST_RING = D == 128 ? (BN == 64 ? 4 : 3) : 6;
  static constexpr int NST_MAX = D == 128 && BN == 128 ? 3 : 6;
  static constexpr int CB = D / 64;            /* 64-column blocks of a row */
  static constexpr int TILE_B = BN * D * 2;    /* one K or V tile */
  static constexpr int STAGE_B = 2 * TILE_B;   /* K and V of a tile */
  static constexpr int NCW = cta<D, BN>::NCW;
  /* Q in shared memory (S by an SS wgmma chain) where registers are short: at head_dim 128
   * the fold's 64 registers a thread would not fit beside Q's 32. Same 128-byte swizzled
   * [64][64] blocks as K, 64 rows a warpgroup. */
  static constexpr bool QS = D == 128;
  static constexpr int Q_B = 64 * D * 2; /* one warpgroup's Q */
  static constexpr int OFF_Q = 0;
  /* full[NST_MAX], empty[NST_MAX], aux[NCW], turn[NCW], qfull[2], qempty[2] */
  static constexpr int OFF_BAR = OFF_Q + (QS ? NCW * Q_B : 0);
  static constexpr int BAR_FULL = OFF_BAR, BAR_EMPTY = OFF_BAR + 8 * NST_MAX, BAR_AUX = OFF_BAR + 16 * NST_MAX;
  static constexpr int BAR_TURN = BAR_AUX + 8 * NCW;
  static constexpr int BAR_QFULL = BAR_TURN + 8 * NCW, BAR_QEMPTY = BAR_QFULL + 16;
  /* QK[w]: consumer warp w's count of items begun (Q by TMA: its buffer and phase; in shared
   * memory, not a register, which the d 128 consumer does not have to spare) */
  static constexpr int OFF_QK = BAR_QEMPTY + 16;
  /* NEXT[s]: the item after the one whose first tile is in stage s (produce publishes it);
   * kernels without Q by TMA keep the layout from before it (no qfull, qempty, QK) */
  static constexpr int OFF_NEXT = QT ? OFF_QK + 4 * 4 * NCW : BAR_TURN + 8 * NCW;
  static constexpr int OFF_S = (OFF_NEXT + 4 * NST_MAX + 1023) / 1024 * 1024;
  static constexpr int OFF_K = OFF_S, OFF_V = OFF_S + TILE_B; /* of stage 0 */
  /* With Q by TMA (QS, one ring of NST_RING stages): Q's second buffer after the stages. */
  static constexpr int OFF_Q1 = OFF_S + NST_RING * STAGE_B;
  static constexpr int bytes(int nst) { return OFF_S + nst * STAGE_B + 1024; }
  static constexpr int bytes_qtma() { return OFF_Q1 + NCW * Q_B + 1024; } /* bytes(NST_RING) and Q's second buffer */
  /* Q by TMA (QT, a template flag: decode's pipes and the other forms keep their code as it
   * was, NOTES v5.17), where two Q buffers fit */
  static constexpr bool QTMA = QT && QS && bytes_qtma() <= bytes(NST_MAX);
};

/* A row of the block: valid, its position p and window start w0, and its first and last
 * splits jf, jl (divisions by the runtime split size, so once per item, not per split end;
 * the rest is recomputed at split ends, to keep registers for the tiles). */
struct row_info {
  int valid, p, w0, jf, jl;
};

__device__ __forceinline__ row_info make_row(const da_cu_args &a, const da_cu_attn &at, int r) {
  const int G = a.n_q_heads / a.n_kv_heads;
  row_info ri;
  ri.valid = r < at.n_q * G;
  ri.p = at.q_pos + r / G;
  ri.w0 = a.window > 0 ? max(0, ri.p - a.window + 1) : 0;
  ri.jf = ri.w0 / a.split_tokens;
  ri.jl = ri.p / a.split_tokens;
  return ri;
}

/* Output row (token * n_q_heads + q head) of block row r. */
__device__ __forceinline__ int64_t out_row(const da_cu_args &a, int kvh, int r) {
  const int G = a.n_q_heads / a.n_kv_heads;
  return (int64_t)(r / G) * a.n_q_heads + kvh * G + r % G;
}

/* One work item and the CTA's key tiles for it: [w0 of its first row, p of its last row],
 * within its splits [j0, j1). */
struct item_range {
  da_cu_item it;
  da_cu_attn at;
  int kt_begin, kt_end, w0_min, p_max;
};

template <int D, int BN>
__device__ __forceinline__ item_range cta_range(const da_cu_args &a, int idx) {
  constexpr int BM = cta<D, BN>::BM;
  item_range r;
  r.it = a.items[idx];
  r.at = a.attns[r.it.attn];
  const int G = a.n_q_heads / a.n_kv_heads;
  const int n_rows = r.at.n_q * G;
  const int rlast = min(r.it.row0 + BM, n_rows) - 1;
  const int p_min = r.at.q_pos + r.it.row0 / G;
  r.p_max = r.at.q_pos + rlast / G;
  r.w0_min = a.window > 0 ? max(0, p_min - a.window + 1) : 0;
  const int tps = a.split_tokens / BN;
  r.kt_begin = max(r.w0_min / BN, r.it.j0 * tps);
  r.kt_end = min(r.p_max / BN, r.it.j1 * tps - 1);
  return r;
}

/* Where a ring user is: the stage of the next tile and the count of completed rounds of its
 * ring, the stages [first, end) (all NST, or one pipe's share). It carries over from one
 * item to the next in a persistent CTA. */
struct ring_pos {
  int st;
  uint32_t round;
  int first, end;
};

/*
 * What the producer warp needs of an item: its key tiles [kt_begin, kt_end] and the range
 * [w0_min, p_max] inside them, the first row of its K slabs, its page table, and the page ids
 * of its first two batches (ids, ids_next; see produce). Loaded one item ahead (prod_load):
 * an item switch then issues its first TMA at once instead of after three dependent loads
 * (the item, its attention, its page ids: ~2.8 us a switch on an H100 with per-split items).
 */
struct prod_item {
  int kt_begin, kt_end, w0_min, p_max;
  int q_tok, q_head; /* Q by TMA: the item's first token and q head */
  int64_t k_rows;
  const int32_t *pt;
  int32_t ids, ids_next;
};

/* Boxes of one tile: chunks of R = min(page_tokens, BN) rows; tpb tiles a page-id batch. */
template <int BN>
__device__ __forceinline__ int box_rows(const da_cu_args &a) { return a.page_tokens < BN ? a.page_tokens : BN; }

/* The page id of lane's chunk in the batch of 32 chunks from tile t0, or -1 (outside the range). */
template <int BN>
__device__ __forceinline__ int32_t batch_id(const da_cu_args &a, const prod_item &pi, int t0, int lane) {
  const int c0 = t0 * BN + lane * box_rows<BN>(a);
  return c0 <= pi.p_max && c0 + box_rows<BN>(a) - 1 >= pi.w0_min ? pi.pt[c0 >> a.page_shift] : -1;
}

template <int D, int BN, bool QT>
__device__ __forceinline__ prod_item prod_load(const da_cu_args &a, int idx, int lane) {
  const item_range ir = cta_range<D, BN>(a, idx);
  prod_item pi;
  pi.kt_begin = ir.kt_begin, pi.kt_end = ir.kt_end, pi.w0_min = ir.w0_min, pi.p_max = ir.p_max;
  pi.k_rows = ((int64_t)ir.at.layer * 2 * a.n_kv_heads + ir.it.kv_head) * a.page_tokens;
  pi.pt = a.pages + ir.at.pt_off;
  if constexpr (QT) {
    const int G = a.n_q_heads / a.n_kv_heads;
    pi.q_tok = (int)(ir.at.q_off / ((int64_t)a.n_q_heads * D)) + ir.it.row0 / G;
    pi.q_head = ir.it.kv_head * G;
  }
  const int tpb = 32 / (BN / box_rows<BN>(a));
  pi.ids = batch_id<BN>(a, pi, pi.kt_begin, lane);
  pi.ids_next = batch_id<BN>(a, pi, pi.kt_begin + tpb, lane);
  return pi;
}

/*
 * The item a pipe runs after item idx, or -1: round-robin, idx + nv (nv pipes in the grid),
 * or with a ticket counter (a.ticket: dynamic dealing) the list's next unclaimed item. Items
 * [0, nv) are the pipes' first; ticket t is item nv + t. The lane 0 takes the ticket.
 */
__device__ __forceinline__ int next_item(const da_cu_args &a, int idx, int n, int nv, int lane) {
  int nx = idx + nv;
  if (a.ticket != nullptr) {
    int t = 0;
    if (lane == 0) t = atomicAdd(a.ticket, 1);
    nx = nv + __shfl_sync(0xffffffffu, t, 0);
  }
  return nx < n ? nx : -1;
}

/*
 * The producer warp: for every tile of [kt_begin, kt_end], wait until the stage is free,
 * then TMA K and V (one box per page chunk of min(page_tokens, 64) rows and per 64 columns)
 * onto full[stage]. Page ids come 32 chunks per warp-wide load, one batch ahead of use, so
 * no tile waits for the page table. A tile not wholly inside [w0_min, p_max] loads only the
 * chunks that meet the range, onto the aux barrier, waits for them, zeroes the rows outside
 * the range and then arrives on full[stage]. The item after this one (next; -1: none) goes
 * with the item's first tile: stored to NEXT[stage] before the arrival on the tile's
 * barrier, so every consumer warp reads it once it has the tile (an item with no tile sends
 * it on a null tile, an arrival without data). The next item (next >= 0) is loaded into
 * *nxt once the ring is full (after the item's NST-th tile, or its last), its descriptor
 * put into L2 at the start. KVF: every load is evict_first (see prefill_kernel).
 */
template <int D, int BN, bool KVF, bool QT>
__device__ __forceinline__ void produce(const da_cu_args &a, const prod_item &pi, int next, prod_item &nxt,
                                        const CUtensorMap *tm, uint32_t base, ring_pos &rp, uint32_t bar_aux,
                                        uint32_t &aux_ph) {
  using L = layout<D, BN, QT>;
  /* The item's range and first row in uniform registers (the same in every lane). */
  const int kt_begin = warp_uniform(pi.kt_begin), kt_end = warp_uniform(pi.kt_end);
  const int w0_min = warp_uniform(pi.w0_min), p_max = warp_uniform(pi.p_max);
  const int64_t k_rows = (int64_t)(((uint64_t)(uint32_t)warp_uniform((int)(pi.k_rows >> 32)) << 32) |
                                   (uint32_t)warp_uniform((int)pi.k_rows));
  const int lane = threadIdx.x & 31;
  const uint32_t bar_full = base + L::BAR_FULL, bar_empty = base + L::BAR_EMPTY;
  const int R = box_rows<BN>(a);  /* rows per box */
  const int nchunk = BN / R;      /* 1 to 16 (page_tokens >= 8) */
  const int tpb = 32 / nchunk;    /* tiles per page-id batch */
  const int64_t page_rows = (int64_t)a.n_layers * 2 * a.n_kv_heads * a.page_tokens;
  const int64_t v_rows = (int64_t)a.n_kv_heads * a.page_tokens;
  const uint32_t chunk_bytes = (uint32_t)R * D * 2 * 2; /* K and V */
  const int kt_next = min(kt_begin + (rp.end - rp.first) - 1, kt_end); /* where the ring is full */
  int bt0 = kt_begin;
  int32_t ids = pi.ids, ids_next = pi.ids_next;
  DA_TRACE_IF(lane == 0 && ids != 0x7fffffff, 3); /* the first page ids */
  if (next >= 0 && lane == 0) prefetch_l2(a.items + next);
  int st = rp.st;
  uint32_t round = rp.round;
  if (kt_end < kt_begin) { /* an item with no tile: a null tile */
    mbar_wait(bar_empty + 8 * st, (round & 1) ^ 1);
    if (lane == 0) {
      st_shared_u32(base + L::OFF_NEXT + 4 * st, (uint32_t)next);
      mbar_arrive(bar_full + 8 * st);
    }
    if (++st == rp.end) st = rp.first, round++;
    if (next >= 0) nxt = prod_load<D, BN, QT>(a, next, lane);
  }
  for (int kt = kt_begin; kt <= kt_end; kt++) {
    if (kt - bt0 == tpb) {
      bt0 += tpb;
      ids = ids_next;
      ids_next = batch_id<BN>(a, pi, bt0 + tpb, lane);
    }
    const int k0 = kt * BN;
    const int32_t pgl = __shfl_sync(0xffffffffu, ids, (kt - bt0) * nchunk + (lane & (nchunk - 1)));
    const int32_t pg = lane < nchunk ? pgl : -1;
    DA_TRACE_IF(lane == 0 && kt == kt_begin, 1); /* the item's first TMA */
    const bool clean = k0 >= w0_min && k0 + BN - 1 <= p_max;
    const int n_load = __popc(__ballot_sync(0xffffffffu, pg >= 0));
    mbar_wait(bar_empty + 8 * st, (round & 1) ^ 1);
    const uint32_t kd = base + L::OFF_K + st * L::STAGE_B, vd = kd + L::TILE_B;
    const uint32_t bar = clean ? bar_full + 8 * st : bar_aux;
    if (lane == 0 && kt == kt_begin) st_shared_u32(base + L::OFF_NEXT + 4 * st, (uint32_t)next);
    if (lane == 0 && n_load > 0) mbar_arrive_tx(bar, (uint32_t)n_load * chunk_bytes);
    __syncwarp();
    if constexpr (KVF) {
      /* Streaming decode: one elected lane issues every box of the tile, chunk c's page id
       * taken from lane c by a shuffle from a fixed lane, so ptxas holds each box's row and
       * destination in uniform registers and issues each TMA at once. With lane c issuing
       * chunk c (below) it loops over the lanes for each box (ELECT, R2UR, branch: ~50 ns a
       * box, 0.75 us a tile at page 16): decode steps 0.1-2.7 % shorter, while prefill (K/V
       * from the L2) ran ~1 % slower with it (NOTES v5.21). */
      const bool issuer = elect_one();
#pragma unroll
      for (int c = 0; c < BN / 8; c++) {
        if (c >= nchunk) break;
        const int32_t pgc = __shfl_sync(0xffffffffu, pg, c);
        if (pgc >= 0 && issuer) {
          const int row = (int)((int64_t)pgc * page_rows + k_rows + ((k0 + c * R) & (a.page_tokens - 1)));
#pragma unroll
          for (int cb = 0; cb < L::CB; cb++) {
            const uint32_t o = cb * BN * 128 + c * R * 128;
            tma_load_2d(kd + o, tm, cb * 64, row, bar, da_l2_evict_first());
            tma_load_2d(vd + o, tm, cb * 64, row + (int)v_rows, bar, da_l2_evict_first());
          }
        }
      }
    } else if (pg >= 0) {
      const int row = (int)((int64_t)pg * page_rows + k_rows + ((k0 + lane * R) & (a.page_tokens - 1)));
#pragma unroll
      for (int cb = 0; cb < L::CB; cb++) {
        const uint32_t o = cb * BN * 128 + lane * R * 128;
        tma_load_2d(kd + o, tm, cb * 64, row, bar);
        tma_load_2d(vd + o, tm, cb * 64, row + (int)v_rows, bar);
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
          const uint32_t off = (c >> 3) * BN * 128 + r * 128 + (c & 7) * 16;
          st_shared_zero16(kd + off);
          st_shared_zero16(vd + off);
        }
      }
      fence_async_smem();
      __syncwarp();
      if (lane == 0) mbar_arrive(bar_full + 8 * st);
    }
    if (++st == rp.end) st = rp.first, round++;
    if (kt == kt_next && next >= 0) nxt = prod_load<D, BN, QT>(a, next, lane);
  }
  rp.st = st, rp.round = round;
}

/*
 * Q of the CTA's k-th item by TMA (qtma: head_dim 128, one ring): into buffer k & 1 (OFF_Q,
 * OFF_Q1) once every consumer warp has released that buffer's item before (qempty), completing
 * on qfull[k & 1]. A box is 64 rows of the block (64 / G tokens x G q heads) x 64 columns,
 * 128-byte swizzled as the consumers' stores were; rows past the item's last come from the
 * next tokens of the staged queries (or zeros past them): their results are never written,
 * and no row's arithmetic reads another's.
 */
template <int D, int BN>
__device__ __forceinline__ void produce_q(const da_cu_args &a, const prod_item &pi, int k, const CUtensorMap *tmq,
                                          uint32_t base) {
  using L = layout<D, BN, true>;
  const int b = k & 1;
  mbar_wait(base + L::BAR_QEMPTY + 8 * b, ((k >> 1) & 1) ^ 1);
  if ((threadIdx.x & 31) == 0) {
    const uint32_t bar = base + L::BAR_QFULL + 8 * b, dst = base + (b ? L::OFF_Q1 : L::OFF_Q);
    const int tpw = 64 * a.n_kv_heads / a.n_q_heads; /* tokens of a warpgroup's 64 rows */
    mbar_arrive_tx(bar, L::NCW * L::Q_B);
#pragma unroll
    for (int c = 0; c < L::NCW; c++)
#pragma unroll
      for (int cb = 0; cb < D / 64; cb++)
        tma_load_3d(dst + c * L::Q_B + cb * 64 * 128, tmq, cb * 64, pi.q_head, pi.q_tok + c * tpw, bar);
  }
}

/*
 * One consumer warpgroup: 64 rows of the item (cw = 0, 1 or 2). At head_dim 64 the Q
 * fragments live in registers (the m16n8k16 A layout, wgmma's register-A layout); at 128 Q
 * is in shared memory and S is an SS chain, so the in-row fold (the accumulator's layout,
 * fp32) fits in registers beside acc (kernel v5.1: no shared-memory traffic at split ends).
 * Each wgmma chain (S over head_dim, P V over a tile's keys) is one asm statement
 * (sm90.cuh), so no register copy lands between its wgmmas.
 *
 * PIPE = false ("serial"): per tile, S, wait, softmax, P V, wait.
 * PIPE = true (FA3's intra-warpgroup overlap), per split segment of the warpgroup's tiles:
 *   S(a); wait; softmax(a); P(a)
 *   for t in (a, b]: issue S(t); acc *= alpha(t-1); issue P(t-1) V(t-1); wait S(t);
 *                    softmax(t) while P V(t-1) runs; wait P V(t-1); P(t)
 *   acc *= alpha(b); P(b) V(b); wait; finalize the split
 * Every row sees the same operations in the same order as in the serial form: softmax(t)
 * touches only (m, l) and its own scores, and acc is scaled by alpha(t) only after P V(t-1).
 * Split ends do not drain the pipeline (kernel v3.1): the next split's first S is issued
 * with the last P V, its softmax runs on a fresh state (the old one kept for the finalize),
 * and the finalize runs once that P V is done. The hand-over sits in the per-split outer
 * loop, not in the steady-state loop (there ptxas serializes every wgmma: C7511).
 * pingpong (PIPE only): the warpgroups take turns, in a ring, issuing their slot's wgmmas
 * (FA3's inter-warpgroup schedule, on turn[] mbarriers), so one's softmax runs under the
 * others' MMAs. All run the same number of slots (tiles they skip included), so the turns
 * pair up; this form keeps the per-segment schedule, drained at split ends.
 */
template <int D, int BN, bool BF16, bool PIPE, bool CAP, bool QT>
__device__ __forceinline__ int consume(const da_cu_args &a, const item_range &ir, uint32_t base, int cw, int wrow,
                                       int pingpong, ring_pos &rp, uint32_t &turn_ph, int qtma) {
  using L = layout<D, BN, QT>;
  constexpr int NTS = BN / 8; /* n8 fragments of a score tile */
  const da_cu_attn &at = ir.at;
  const da_cu_item &it = ir.it;
  const int kt_begin = warp_uniform(ir.kt_begin), kt_end = warp_uniform(ir.kt_end);
  constexpr int NV = D / 8; /* n8 fragments of an output row */
  constexpr int NK = D / 16; /* k16 steps of S */
  const int ctid = threadIdx.x - 128 * (cw + 1);
  const int warp = ctid >> 5, lane = ctid & 31, g = lane >> 2, qd = lane & 3;
  const uint32_t bar_full = base + L::BAR_FULL, bar_empty = base + L::BAR_EMPTY;
  const uint32_t bar_turn = base + L::BAR_TURN;
  const int G = a.n_q_heads / a.n_kv_heads;
  const int n_rows = at.n_q * G;
  const int wr0 = it.row0 + wrow; /* first row of this warpgroup */

  /* This warpgroup's rows and key range (a sub-range of the CTA's). */
  const bool active = wr0 < n_rows;
  const int wrl = min(wr0 + 64, n_rows) - 1;
  const int p_min = at.q_pos + wr0 / G, p_max = at.q_pos + wrl / G;
  const int w0_max = a.window > 0 ? max(0, p_max - a.window + 1) : 0;
  const int tps = a.split_tokens / BN;
  int my_begin = kt_end + 1, my_end = kt_begin - 1;
  if (active) {
    const int w0_min = a.window > 0 ? max(0, p_min - a.window + 1) : 0;
    my_begin = max(w0_min / BN, it.j0 * tps);
    my_end = min(p_max / BN, it.j1 * tps - 1);
  }
  /* Warp-uniform by construction; broadcast from lane 0 so the compiler knows, and keeps the
   * loop counters and the wgmma descriptors in uniform registers. */
  my_begin = warp_uniform(my_begin), my_end = warp_uniform(my_end);

  const int r0 = wr0 + warp * 16 + g; /* this thread's rows: r0 and r0 + 8 */
  row_info ri[2];
  ri[0] = make_row(a, at, r0);
  ri[1] = make_row(a, at, r0 + 8);
  /* A prefix item (item.h) folds as an in-row item does: partial only for the others. */
  const bool partial = at.slot_base >= 0 && !(it.flags & DA_CU_ITEM_PREFIX);

  /* Q: qf[kk] is the A fragment of k-step kk (rows r0, r0 + 8; columns 16 kk + 2 qd (+1),
   * + 8), zero past the last row. In registers, or (QS) stored to the warpgroup's swizzled
   * Q block, once the warpgroup's wgmmas of the previous item are done (every warp has
   * waited for them when it gets here; the named barrier makes it all four). With Q by TMA
   * (q_tma: produce_q loaded it an item ahead into buffer k & 1, so the item's start has no
   * Q round trip), the warp releases the previous item's buffer and waits for this one's
   * (after the item's first tile, below). */
  uint32_t qf[L::QS ? 1 : NK][4];
  const bool q_tma = L::QTMA && qtma; /* Q came by TMA (produce_q) into buffer k & 1 */
  int k = 0; /* this item's number in the CTA's sequence */
  if (q_tma) {
    const uint32_t qk = base + L::OFF_QK + 4 * (cw * 4 + warp);
    k = warp_uniform(ld_shared_s32(qk));
    __syncwarp();
    if (lane == 0) st_shared_u32(qk, (uint32_t)(k + 1));
  }
  /* warp_uniform: the buffer's offset in a uniform register, as the descriptors built on it */
  uint32_t q_o = L::OFF_Q;
  if constexpr (L::QTMA) q_o = warp_uniform(q_tma && (k & 1) ? L::OFF_Q1 : L::OFF_Q);
  const uint32_t q_s = base + q_o + cw * L::Q_B;
  da_pdl_wait(); /* pdl.cuh: Q (a gather kernel may have staged it) and every write after */
  if (q_tma && k > 0) { /* the previous item's Q: every wgmma of this warp's that read it is done */
    __syncwarp();
    if (lane == 0) mbar_arrive(base + L::BAR_QEMPTY + 8 * ((k - 1) & 1));
  }
  if (!q_tma) {
    if constexpr (L::QS) bar_sync(Q_BAR0 + cw, 128);
    {
      const uint32_t *q = reinterpret_cast<const uint32_t *>(static_cast<const uint16_t *>(a.q) + at.q_off);
      const uint32_t *src[2];
#pragma unroll
      for (int r = 0; r < 2; r++) {
        const int row = r0 + 8 * r;
        src[r] = ri[r].valid ? q + (((int64_t)(row / G) * a.n_q_heads + it.kv_head * G + row % G) * D) / 2 + qd : nullptr;
      }
#pragma unroll
      for (int kk = 0; kk < NK; kk++) {
        uint32_t f[4];
        f[0] = src[0] ? __ldg(src[0] + kk * 8) : 0u;
        f[1] = src[1] ? __ldg(src[1] + kk * 8) : 0u;
        f[2] = src[0] ? __ldg(src[0] + kk * 8 + 4) : 0u;
        f[3] = src[1] ? __ldg(src[1] + kk * 8 + 4) : 0u;
        if constexpr (L::QS) {
          /* Element (row, col) of the block: 16-byte chunk col / 8, 4-byte word col / 2 % 4. */
#pragma unroll
          for (int e = 0; e < 4; e++) {
            const int row = warp * 16 + g + 8 * (e & 1), col = kk * 16 + 8 * (e >> 1) + 2 * qd;
            st_shared_u32(q_s + swz128(row, col >> 3, 64) + (col & 7) * 2, f[e]);
          }
        } else {
#pragma unroll
          for (int e = 0; e < 4; e++) qf[kk][e] = f[e];
        }
      }
    }
    if constexpr (L::QS) {
      fence_async_smem(); /* the stores, to the async proxy that wgmma reads through */
      bar_sync(Q_BAR0 + cw, 128);
      DA_TRACE_IF(cw == 0 && ctid == 0, 41); /* timing builds: the warpgroup's Q stored */
    } else {
      DA_TRACE_IF(cw == 0 && ctid == 0 && qf[0][0] != 0x7fffffffu, 41); /* its Q in registers */
    }
  }
  float acc[NV][4];
  float fold_lse[2] = {0.0f, 0.0f};
  /* The in-row fold of this thread's elements (fp32, the accumulator's layout), in registers. */
  float fold[NV][4];
  da_row_state st;
  da_state_reset(st);
#pragma unroll
  for (int n = 0; n < NV; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

  /* Descriptors of stage 0's K (k-step 0) and V (key step 0); a stage is TILE_B further. */
  const uint64_t dk0 = desc_kmajor(base + L::OFF_K), dv0 = desc_mnmajor(base + L::OFF_V, BN * 128);
  const uint64_t dq = desc_kmajor(q_s); /* without Q by TMA */

  /* K-major operand (K: BN rows, or Q in shared memory: 64) of k-step kk: its 64-column
   * block, then 32 bytes a k16 step inside it. */
  auto kstep = [](uint64_t d, int kk, int rows) { return desc_add(d, (kk >> 2) * rows * 128 + (kk & 3) * 32); };
  /* S of the tile in stage stg into s: one wgmma chain, Q from registers (head_dim 64) or
   * shared memory (QS), K from shared memory; the first k-step with scale-d = 0 (d = Q K^T,
   * as from attn.cu's zeroed accumulator: at most the sign of an exact zero differs, which
   * no later step can see). Issued and committed, not waited for. */
  auto issue_s = [&](float (&s)[NTS][4], int stg) {
    const uint64_t dk = desc_add(dk0, (uint32_t)stg * L::STAGE_B);
    uint64_t db[NK];
#pragma unroll
    for (int kk = 0; kk < NK; kk++) db[kk] = kstep(dk, kk, BN);
    if constexpr (L::QS) {
      uint64_t da[NK];
      if constexpr (L::QTMA) {
        /* Q's descriptors made at each issue from an opaque copy of the buffer's offset:
         * hoisted out of the loops as invariants they would take eight registers (spilled). */
        uint32_t qo = q_o;
        asm volatile("" : "+r"(qo));
        const uint64_t dqb = desc_kmajor(base + qo + cw * L::Q_B);
#pragma unroll
        for (int kk = 0; kk < NK; kk++) da[kk] = kstep(dqb, kk, 64);
      } else {
#pragma unroll
        for (int kk = 0; kk < NK; kk++) da[kk] = kstep(dq, kk, 64);
      }
      wg_chain_s_ss8_z<BF16>(s, da, db);
    } else {
      wg_chain_s_rs4_z<BF16>(s, qf, db);
    }
  };
  /* acc += P V of the tile in stage stg: one wgmma chain, issued and committed, not waited for. */
  auto issue_pv = [&](const uint32_t (&p)[BN / 16][4], int stg) {
    const uint64_t dv = desc_add(dv0, (uint32_t)stg * L::STAGE_B);
    uint64_t db[BN / 16];
#pragma unroll
    for (int kc = 0; kc < BN / 16; kc++) db[kc] = desc_add(dv, kc * 16 * 128);
    if constexpr (D == 128) wg_chain_pv_n128<BF16>(acc, p, db);
    else wg_chain_pv_n64<BF16>(acc, p, db);
  };
  /* Scores and mask of tile kt in s, then the online-softmax update: s holds p = exp2(y c - m),
   * alpha the rescale factors of the two rows. Without a softcap (CAP, a template argument:
   * as a runtime test it cost 32 register moves a tile) y is the raw score, so a tile inside
   * every row's key range needs no pass over s before the max. Masked keys are -inf. */
  auto softmax = [&](float (&s)[NTS][4], int kt, float (&alpha)[2]) {
    if constexpr (CAP) {
#pragma unroll
      for (int n = 0; n < NTS; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[n][e] = da_score_y(s[n][e], 1, a.cap_in, a.cap_out_log2);
    }
    if (!(kt * BN >= w0_max && kt * BN + BN - 1 <= p_min)) {
#pragma unroll
      for (int n = 0; n < NTS; n++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const row_info &r = ri[e >> 1];
          const int kp = kt * BN + n * 8 + qd * 2 + (e & 1);
          s[n][e] = r.valid && kp >= r.w0 && kp <= r.p ? s[n][e] : -INFINITY;
        }
      }
    }
    da_tile_update<NTS>(st, s, a.exp_c, alpha);
  };
  /* acc *= alpha, per half of the warp's rows (g, then g + 8): skipped where every alpha of
   * that half is exactly 1 (x * 1 == x). */
  auto rescale = [&](const float (&alpha)[2]) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
      if (__any_sync(0xffffffffu, alpha[r] != 1.0f)) {
#pragma unroll
        for (int n = 0; n < NV; n++) {
          acc[n][2 * r] = __fmul_rn(acc[n][2 * r], alpha[r]);
          acc[n][2 * r + 1] = __fmul_rn(acc[n][2 * r + 1], alpha[r]);
        }
      }
    }
  };
  auto pack_p = [&](const float (&s)[NTS][4], uint32_t (&p)[BN / 16][4]) {
#pragma unroll
    for (int kc = 0; kc < BN / 16; kc++) {
      p[kc][0] = da_pack2<BF16>(s[2 * kc][0], s[2 * kc][1]);
      p[kc][1] = da_pack2<BF16>(s[2 * kc][2], s[2 * kc][3]);
      p[kc][2] = da_pack2<BF16>(s[2 * kc + 1][0], s[2 * kc + 1][1]);
      p[kc][3] = da_pack2<BF16>(s[2 * kc + 1][2], s[2 * kc + 1][3]);
    }
  };
  /* Split j is complete for the warpgroup's rows (state fs): finalize and fold or write. */
  auto finalize = [&](int j, const da_row_state &fs) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const float l_row = da_l_row(fs, r); /* every lane: a quad sum */
      const row_info &w = ri[r];
      if (!w.valid || j < w.jf || j > w.jl) continue;
      const int how = partial ? DA_END_WRITE : j == w.jf ? DA_END_FIRST : DA_END_MERGE;
      float *part = nullptr;
      int64_t slot = 0;
      if (partial) {
        slot = at.slot_base + out_row(a, it.kv_head, r0 + 8 * r) * at.n_splits + j;
        part = a.acc_o + slot * D + qd * 2;
      }
      const float lse = da_split_end<NV>(acc, r, fs.m[r], l_row, how, part, [&](int n, int e) -> float & { return fold[n][e]; }, fold_lse[r]);
      if (partial) {
        if (qd == 0) da_st_partial(a.acc_lse + slot, lse, da_l2_evict_last());
      } else {
        fold_lse[r] = lse;
      }
    }
  };
  auto zero_acc = [&]() {
#pragma unroll
    for (int n = 0; n < NV; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  };

  /* The item after this one, published with this item's first tile (produce); an item with
   * no tile came as a null tile, released here. Read after the setup above, which so runs
   * under the first tile's TMA. */
  mbar_wait(bar_full + 8 * rp.st, rp.round & 1);
  const int next = warp_uniform(ld_shared_s32(base + L::OFF_NEXT + 4 * rp.st));
  if (kt_end < kt_begin) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar_empty + 8 * rp.st);
    if (++rp.st == rp.end) rp.st = rp.first, rp.round++;
  }
  if (q_tma) {
    mbar_wait(base + L::BAR_QFULL + 8 * (k & 1), (k >> 1) & 1);
  } else if (next >= 0 && qd < D / 64) {
    /* The same rows of the next item: into L2 now, so its Q loads are short. */
    const da_cu_item nit = a.items[next];
    const da_cu_attn nat = a.attns[nit.attn];
    const uint16_t *q = static_cast<const uint16_t *>(a.q) + nat.q_off;
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const int row = nit.row0 + wrow + warp * 16 + g + 8 * r;
      if (row < nat.n_q * G) prefetch_l2(q + ((int64_t)(row / G) * a.n_q_heads + nit.kv_head * G + row % G) * D + qd * 64);
    }
  }

  float s[NTS][4];
  uint32_t p[BN / 16][4];
  float alpha[2];
  if constexpr (!PIPE) {
    /* Tile kt: its stage and phase, its split j and its index inside the split. */
    int stage = rp.st, j = kt_begin / tps, in_split = kt_begin - j * tps;
    uint32_t round = rp.round;
    for (int kt = kt_begin; kt <= kt_end; kt++) {
      mbar_wait(bar_full + 8 * stage, round & 1);
      DA_TRACE_IF(cw == 0 && ctid == 0 && kt - kt_begin < 16, 4 + kt - kt_begin); /* tile k's data */
      if (kt >= my_begin && kt <= my_end) {
        if (kt == my_begin || in_split == 0) {
          da_state_reset(st);
          zero_acc();
        }
        issue_s(s, stage);
        wg_wait<0>();
        reg_fence(s);
        softmax(s, kt, alpha);
        rescale(alpha);
        pack_p(s, p);
        issue_pv(p, stage);
        wg_wait<0>();
        reg_fence(acc);
        DA_TRACE_IF(cw == 0 && ctid == 0 && kt - kt_begin < 16, 20 + kt - kt_begin); /* tile k done */
        if (kt == my_end || in_split == tps - 1) {
          finalize(j, st);
          DA_TRACE_IF(cw == 0 && ctid == 0, 37); /* a split end done */
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(bar_empty + 8 * stage);
      if (++stage == rp.end) stage = rp.first, round++;
      if (++in_split == tps) in_split = 0, j++;
    }
    rp.st = stage, rp.round = round;
  } else {
    /* The CTA's range in split segments [A, B] (tiles of one split). Slot k = 0 .. B - A + 1
     * of a segment issues S of tile A + k and P V of tile A + k - 1, where they are this
     * warpgroup's (its tiles [a, b] of the segment); every warpgroup runs B - A + 2 slots per
     * segment, so the ping-pong turns pair up. The pipeline drains at split ends: finalize
     * runs with no wgmma in flight (inside the pipelined loop ptxas serializes it: C7511). */
    int st_n = rp.st, st_c = rp.first; /* stage of the tile being waited for, of the one before */
    uint32_t ph_n = rp.round;
    auto turn_wait = [&]() {
      if (pingpong) {
        mbar_wait(bar_turn + 8 * cw, turn_ph);
        turn_ph ^= 1;
      }
    };
    auto turn_pass = [&]() {
      if (pingpong) {
        __syncwarp();
        if (lane == 0) mbar_arrive(bar_turn + 8 * (cw + 1 == L::NCW ? 0 : cw + 1));
      }
    };
    auto wait_full = [&]() { mbar_wait(bar_full + 8 * st_n, ph_n & 1); };
    auto release_c = [&]() {
      __syncwarp();
      if (lane == 0) mbar_arrive(bar_empty + 8 * st_c);
    };
    auto advance = [&]() {
      st_c = st_n;
      if (++st_n == rp.end) st_n = rp.first, ph_n++;
    };
    /* A slot without work of this warpgroup: t is the tile waited for (none past B), t - 1
     * the one released (none at the segment's first slot). */
    auto idle_slot = [&](int t, int A, int B) {
      if (t <= B) wait_full();
      turn_wait();
      turn_pass();
      if (t > A) release_c();
      if (t <= B) advance();
    };
    /* One steady-state slot for tile t: S(t) and P V(t - 1) issued, softmax(t) under that
     * P V. NEW_SPLIT (t starts a split, t - 1 ended one; never in ping-pong form): t's
     * softmax starts from a fresh state and the finished split is finalized once its last
     * P V is done. A compile-time flag, so the steady-state loop has no finalize in it. */
    auto slot = [&](int t, auto new_split) {
      constexpr bool NEW_SPLIT = decltype(new_split)::value;
      wait_full();
      DA_TRACE_IF(cw == 0 && ctid == 0 && t - kt_begin < 16, 4 + t - kt_begin); /* slot k's data */
      turn_wait();
      issue_s(s, st_n);
      rescale(alpha);
      issue_pv(p, st_c);
      turn_pass();
      wg_wait<1>();
      reg_fence(s);
      da_row_state fs = st;
      if constexpr (NEW_SPLIT) da_state_reset(st);
      softmax(s, t, alpha);
      wg_wait<0>();
      reg_fence(acc);
      DA_TRACE_IF(cw == 0 && ctid == 0 && t - kt_begin < 16, 20 + t - kt_begin); /* slot k done */
      release_c();
      pack_p(s, p); /* before a finalize: p is half the registers of s */
      if constexpr (NEW_SPLIT) {
        finalize(t / tps - 1, fs);
        zero_acc();
      }
      advance();
    };
    if (!pingpong) {
      /* One pipeline over the warpgroup's tiles, not drained at split ends: slot t issues
       * S(t) and P V(t - 1); when t - 1 closed a split, its state moves to fs before
       * softmax(t) starts the next split, and the finalize runs on acc once P V(t - 1) is
       * done, with nothing in flight (S(t) is waited for already). Every row sees the
       * segment form's operations in the same order; only the schedule differs. */
      auto skip = [&]() {
        wait_full();
        advance();
        release_c();
      };
      int t = kt_begin;
      for (; t < my_begin && t <= kt_end; t++) skip();
      if (my_begin <= my_end) {
        wait_full();
        issue_s(s, st_n);
        wg_wait<0>();
        reg_fence(s);
        softmax(s, t, alpha);
        pack_p(s, p);
        advance();
        /* Per split: its tiles after the first in the steady state, then the hand-over to
         * the next split (its first S under this split's last P V) or the last P V. */
        for (;;) {
          const int b = min(my_end, (t / tps + 1) * tps - 1);
          for (t++; t <= b; t++) slot(t, std::false_type{});
          if (t > my_end) break;
          slot(t, std::true_type{});
        }
        rescale(alpha);
        issue_pv(p, st_c);
        wg_wait<0>();
        reg_fence(acc);
        release_c();
        finalize(my_end / tps, st);
      }
      for (; t <= kt_end; t++) skip();
    } else {
      for (int A = kt_begin; A <= kt_end;) {
        const int j = A / tps;
        const int B = min(kt_end, (j + 1) * tps - 1);
        const int a = max(A, my_begin), b = min(B, my_end);
        int t = A;
        if (a <= b) {
          for (; t < a; t++) idle_slot(t, A, B);
          /* First tile: S alone. */
          da_state_reset(st);
          zero_acc();
          wait_full();
          DA_TRACE_IF(cw == 0 && ctid == 0 && t - kt_begin < 16, 4 + t - kt_begin);
          turn_wait();
          issue_s(s, st_n);
          turn_pass();
          if (t > A) release_c();
          wg_wait<0>();
          reg_fence(s);
          softmax(s, t, alpha);
          pack_p(s, p);
          DA_TRACE_IF(cw == 0 && ctid == 0 && t - kt_begin < 16, 20 + t - kt_begin);
          advance();
          /* Steady state: S(t), P V(t - 1), softmax(t) under that P V. */
          for (t++; t <= b; t++) slot(t, std::false_type{});
          /* Last tile of the segment: P V alone, then the split's finalize. */
          if (t <= B) wait_full();
          turn_wait();
          rescale(alpha);
          issue_pv(p, st_c);
          turn_pass();
          wg_wait<0>();
          reg_fence(acc);
          DA_TRACE_IF(cw == 0 && ctid == 0, 36); /* the segment's last P V done */
          release_c();
          if (t <= B) advance();
          finalize(j, st);
          DA_TRACE_IF(cw == 0 && ctid == 0, 37);
          t++;
        }
        for (; t <= B + 1; t++) idle_slot(t, A, B);
        A = B + 1;
      }
    }
    rp.st = st_n, rp.round = ph_n;
  }
  DA_TRACE_IF(cw == 0 && ctid == 0, 40); /* the item done */
  if (partial || !active) return next;
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const row_info &w = ri[r];
    if (!w.valid) continue;
    const int64_t row = out_row(a, it.kv_head, r0 + 8 * r);
    if (at.slot_base >= 0) { /* a prefix item (the planner's: each row's first split is the item's j0) */
      const int64_t slot = at.slot_base + row * at.n_splits + w.jf;
      da_store_fold<NV>(r, a.acc_o + slot * D + qd * 2, [&](int n, int e) -> float & { return fold[n][e]; },
                        qd == 0 ? a.acc_lse + slot : nullptr, fold_lse[r]);
      continue;
    }
    uint32_t *dst = reinterpret_cast<uint32_t *>(static_cast<uint16_t *>(at.o) + row * D + qd * 2);
#pragma unroll
    for (int n = 0; n < NV; n++) dst[n * 4] = da_pack2<BF16>(fold[n][2 * r], fold[n][2 * r + 1]);
    if (at.lse != nullptr && qd == 0) at.lse[row] = da_lse_out(fold_lse[r]);
  }
  return next;
}

/* Items [0, n) of the list; CTA b takes items b, b + gridDim.x, ... (a persistent grid of
 * one CTA per SM, or one item per CTA when gridDim.x == n), or with a ticket counter
 * (a.ticket) item b first and then the list's next unclaimed one (next_item): the producer
 * decides it and sends it to the consumers with the item's first tile. The ring of K/V
 * stages, its barriers' phases and the ping-pong turns carry over from item to item, so the producer
 * loads the next item's first tiles while the consumers finish this one.
 * pipes > 1 (decode launches, every item at most 64 rows): the CTA runs `pipes` independent
 * pipelines, pipe w = producer warp w, consumer warpgroup w (its rows [row0, row0 + 64)) and
 * stages [w nst / pipes, (w + 1) nst / pipes), taking items v, v + V, ... with v = b pipes + w
 * and V = gridDim.x pipes; consumer warpgroups past the pipes stay idle. A decode tile's
 * update is one warpgroup's latency chain, so a CTA's K/V stream runs as fast as that chain
 * allows (~40 GB/s an SM on an H200); pipes run two such chains an SM (NOTES v5.3).
 * KVF (a decode-only launch whose K/V exceed the L2, da_cu_args.kv_stream): no other item
 * reads an item's K/V tiles, so they are loaded evict_first and the partials (numerics.cuh)
 * stay in the L2 for the combine. A template flag, not a branch: the untaken branch in the
 * producer cost short decode steps 2 % (NOTES v5.13); built for head_dim 128, T 64,
 * pipelined, no softcap (the decode shapes the benchmarks measure), the rest load as usual. */
template <int D, int BN, bool BF16, bool PIPE, bool CAP, bool KVF, bool QT>
__global__ void __launch_bounds__(cta<D, BN>::NTHREADS, 1)
    prefill_kernel(const da_cu_args a, const __grid_constant__ CUtensorMap tm, int n, int pingpong, int pipes, int nst,
                   const __grid_constant__ CUtensorMap tmq, int qtma) {
  /* qtma is 1 in every QT launch and 0 in the rest; kept a runtime argument so that the QT
   * kernels stay the instructions the GPU tests and the A/B ran (NOTES v5.17) */
  using L = layout<D, BN, QT>;
  /* The combine (combine.cu), launched next as a programmatic dependent, may be scheduled
   * once every CTA of this grid has started: its CTAs take an SM as this grid's CTAs leave
   * it, and read the partials only after this grid has completed (da_pdl_wait). */
  da_pdl_trigger();
  DA_TRACE_IF(threadIdx.x == 0, 0); /* timing builds (trace.cuh): the CTA's start */
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023) & ~1023u;

  if (threadIdx.x == 0) {
    for (int s = 0; s < nst; s++) {
      mbar_init(base + L::BAR_FULL + 8 * s, 1);
      mbar_init(base + L::BAR_EMPTY + 8 * s, (pipes > 1 ? 1 : L::NCW) * 4); /* one arrival per consumer warp */
    }
    for (int c = 0; c < L::NCW; c++) {
      mbar_init(base + L::BAR_AUX + 8 * c, 1);
      mbar_init(base + L::BAR_TURN + 8 * c, 4); /* the previous warpgroup's warps */
    }
    if constexpr (L::QTMA) {
      for (int w = 0; w < 4 * L::NCW; w++) st_shared_u32(base + L::OFF_QK + 4 * w, 0u);
      for (int b = 0; b < 2; b++) {
        mbar_init(base + L::BAR_QFULL + 8 * b, 1);
        mbar_init(base + L::BAR_QEMPTY + 8 * b, L::NCW * 4); /* every consumer warp */
      }
    }
    mbar_init_fence();
  }
  if (threadIdx.x == 32) tma_prefetch_desc(&tm);
  if (L::QTMA && threadIdx.x == 64 && qtma) tma_prefetch_desc(&tmq);
  __syncthreads();
  DA_TRACE_IF(threadIdx.x == 0, 38); /* the block barrier passed */

  /* This thread's pipe w (producer warp w, or consumer warpgroup w when pipes > 1). */
  const int nstp = nst / pipes;
  const int nv = (int)gridDim.x * pipes;
  if (threadIdx.x < 128) {
    regs_dec<cta<D, BN>::PREGS>();
    DA_TRACE_IF(threadIdx.x == 0, 42); /* timing builds: the producer past setmaxnreg */
    const int w = warp_uniform((int)threadIdx.x / 32);
    if (w < pipes) {
      ring_pos rp = {w * nstp, 0, w * nstp, (w + 1) * nstp};
      uint32_t aux_ph = 0;
      const int i0 = (int)blockIdx.x * pipes + w;
      prod_item cur = i0 < n ? prod_load<D, BN, QT>(a, i0, threadIdx.x & 31) : prod_item{};
      DA_TRACE_IF(threadIdx.x == 0 && cur.pt != nullptr, 39); /* timing builds: the first item, its attention */
      /* Launched as a programmatic dependent (pdl.cuh): the first item, its attention and
       * page ids were staged before the kernel ahead of this one ran; tickets and K/V only
       * once it is done. (The next item decided here, not in produce: there ptxas spilled.) */
      da_pdl_wait();
      for (int i = i0 < n ? i0 : -1, k = 0; i >= 0; k++) {
        const int next = next_item(a, i, n, nv, threadIdx.x & 31);
        if constexpr (L::QTMA) {
          if (qtma) produce_q<D, BN>(a, cur, k, &tmq, base);
        }
        prod_item nxt = cur;
        produce<D, BN, KVF, QT>(a, cur, next, nxt, &tm, base, rp, base + L::BAR_AUX + 8 * w, aux_ph);
        cur = nxt;
        i = next;
      }
      /* The last pipe out (every ticket taken) sets the counter back to 0 for the next launch,
       * which takes tickets only after this grid completes (da_pdl_wait). */
      if (a.ticket != nullptr && (threadIdx.x & 31) == 0) {
        __threadfence();
        if (atomicAdd(a.ticket + 1, 1) == nv - 1) {
          atomicExch(a.ticket, 0);
          atomicExch(a.ticket + 1, 0);
        }
      }
    }
  } else {
    regs_inc<cta<D, BN>::CREGS>();
    DA_TRACE_IF(threadIdx.x == 128, 43); /* the first consumer warpgroup past setmaxnreg */
    const int cw = warp_uniform((int)threadIdx.x / 128) - 1;
    const int w = pipes > 1 ? cw : 0;
    if (w >= pipes) return;
    ring_pos rp = {w * nstp, 0, w * nstp, (w + 1) * nstp};
    uint32_t turn_ph = 0;
    if (PIPE && pingpong && cw == L::NCW - 1 && (threadIdx.x & 31) == 0)
      mbar_arrive(base + L::BAR_TURN); /* warpgroup 0 first */
    const int i0 = (int)blockIdx.x * pipes + w;
    for (int i = i0 < n ? i0 : -1; i >= 0;)
      i = consume<D, BN, BF16, PIPE, CAP, QT>(a, cta_range<D, BN>(a, i), base, cw, pipes > 1 ? 0 : cw * 64, pingpong, rp,
                                          turn_ph, qtma);
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

/* Q by TMA can run (QT's kernels): one ring, the staged queries' size known (q_tokens, int32
 * coordinates) and G dividing 64 (a box is 64 / G tokens x G heads). */
bool q_tma_fits(const da_cu_args *a, int pipes) {
  const int G = a->n_q_heads / a->n_kv_heads;
  return pipes == 1 && a->q_tokens > 0 && a->q_tokens < (1ll << 31) && G <= 64 && 64 % G == 0;
}

template <int D, int BN, bool BF16, bool PIPE, bool CAP, bool KVF = false, bool QT = false>
cudaError_t launch(const da_cu_args *a, int n, int grid, int pingpong, int pipes, cudaStream_t stream) {
  using L = layout<D, BN, QT>;
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
                      a->l2_promo == 256 ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B : CU_TENSOR_MAP_L2_PROMOTION_NONE,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return cudaErrorInvalidValue;
  /* Q by TMA an item ahead (produce_q; QT's kernels where q_tma_fits): the staged queries as
   * [q_tokens][n_q_heads][D]. */
  const int G = a->n_q_heads / a->n_kv_heads;
  CUtensorMap tmq;
  memset(&tmq, 0, sizeof(tmq));
  const int qtma = L::QTMA && q_tma_fits(a, pipes);
  if (qtma) {
    const cuuint64_t qdims[3] = {(cuuint64_t)D, (cuuint64_t)a->n_q_heads, (cuuint64_t)a->q_tokens};
    const cuuint64_t qstrides[2] = {(cuuint64_t)D * 2, (cuuint64_t)a->n_q_heads * D * 2};
    const cuuint32_t qbox[3] = {64, (cuuint32_t)G, (cuuint32_t)(64 / G)};
    const cuuint32_t qestr[3] = {1, 1, 1};
    r = encode(&tmq, BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3, const_cast<void *>(a->q),
               qdims, qstrides, qbox, qestr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
               CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) return cudaErrorInvalidValue;
  }
  /* The shared-memory limit is a per-device function attribute: set once per device. */
  static unsigned long long configured = 0;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev >= 64 || !(configured & (1ull << dev))) {
    e = cudaFuncSetAttribute(prefill_kernel<D, BN, BF16, PIPE, CAP, KVF, QT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             L::bytes(L::NST_MAX));
    if (e != cudaSuccess) return e;
    if (dev < 64) configured |= 1ull << dev;
  }
  const int nst = pipes > 1 ? L::NST_MAX : L::NST_RING;
  /* A programmatic dependent of the kernel before it (pdl.cuh): the prologue up to the first
   * K/V load runs while that kernel finishes. */
  cudaLaunchAttribute attr;
  const size_t smem = qtma ? L::bytes_qtma() : L::bytes(nst);
  const cudaLaunchConfig_t lc = da_pdl_config((unsigned)grid, cta<D, BN>::NTHREADS, smem, stream, &attr, true);
  return cudaLaunchKernelEx(&lc, prefill_kernel<D, BN, BF16, PIPE, CAP, KVF, QT>, *a, tm, n, pingpong, pipes, nst, tmq,
                            qtma);
}

template <int BN, bool CAP>
int dispatch(const da_cu_args *a, int n, int grid, bool pipe, int pp, int pipes, bool kvf, bool decode,
             cudaStream_t stream) {
  constexpr bool KVF_BUILT = BN == 64 && !CAP; /* see prefill_kernel */
  /* Q by TMA (QT): built for head_dim 128, T 64, the pipelined forms (prefill's defaults), and
   * not for decode-only launches (decode: 64 rows of Q loaded for at most 16, ahead of the
   * first K/V tile; B 1 L 1k was 4 % slower with it, NOTES v5.17) */
  if constexpr (BN == 64) {
    if (a->head_dim == 128 && pipe && !decode && q_tma_fits(a, pipes))
      return a->bf16 ? (int)launch<128, BN, true, true, CAP, false, true>(a, n, grid, pp, pipes, stream)
                     : (int)launch<128, BN, false, true, CAP, false, true>(a, n, grid, pp, pipes, stream);
  }
  switch (a->head_dim * 4 + (a->bf16 ? 2 : 0) + (pipe ? 1 : 0)) {
  case 64 * 4 + 3: return (int)launch<64, BN, true, true, CAP>(a, n, grid, pp, pipes, stream);
  case 64 * 4 + 2: return (int)launch<64, BN, true, false, CAP>(a, n, grid, 0, pipes, stream);
  case 64 * 4 + 1: return (int)launch<64, BN, false, true, CAP>(a, n, grid, pp, pipes, stream);
  case 64 * 4: return (int)launch<64, BN, false, false, CAP>(a, n, grid, 0, pipes, stream);
  case 128 * 4 + 3:
    if (KVF_BUILT && kvf) return (int)launch<128, BN, true, true, CAP, KVF_BUILT>(a, n, grid, pp, pipes, stream);
    return (int)launch<128, BN, true, true, CAP>(a, n, grid, pp, pipes, stream);
  case 128 * 4 + 2: return (int)launch<128, BN, true, false, CAP>(a, n, grid, 0, pipes, stream);
  case 128 * 4 + 1:
    if (KVF_BUILT && kvf) return (int)launch<128, BN, false, true, CAP, KVF_BUILT>(a, n, grid, pp, pipes, stream);
    return (int)launch<128, BN, false, true, CAP>(a, n, grid, pp, pipes, stream);
  case 128 * 4: return (int)launch<128, BN, false, false, CAP>(a, n, grid, 0, pipes, stream);
  }
  return (int)cudaErrorInvalidValue;
}

} // namespace

extern "C" int da_cuda_prefill_sm90(const da_cu_args *a, int variant, cudaStream_t stream) {
  DA_TRACE_HOST("P");
  const int n = a->n_items - a->n_split_items;
  if (n <= 0) return 0;
  const int v = variant & ~(DA_CU_SM90_PER_ITEM | DA_CU_SM90_PIPES);
  if (v < DA_CU_SM90_SERIAL || v > DA_CU_SM90_PINGPONG) return (int)cudaErrorInvalidValue;
  const bool pipe = v != DA_CU_SM90_SERIAL;
  /* Pipes on a persistent grid where the items outnumber the SMs (else one item a CTA
   * spreads them wider); no ping-pong in a pipe (one consumer warpgroup). */
  const bool per_item = (variant & DA_CU_SM90_PER_ITEM) || a->n_sm <= 0;
  /* No pipes where a pipe would get a single stage (head_dim 128 at T = 128). */
  const bool pipes_fit = !(a->head_dim == 128 && a->tile_tokens == 128);
  const int pipes =
      (variant & DA_CU_SM90_PIPES) && pipes_fit && (per_item || n > a->n_sm) ? DA_CU_SM90_N_PIPES : 1;
  const int pp = v == DA_CU_SM90_PINGPONG && pipes == 1;
  int grid = per_item ? (n + pipes - 1) / pipes : a->n_sm;
  if (grid > (n + pipes - 1) / pipes) grid = (n + pipes - 1) / pipes;
  da_cu_args d = *a;
  if (per_item || n <= grid * pipes) d.ticket = nullptr; /* nothing left to deal */
  a = &d;
  const bool decode = variant & DA_CU_SM90_PIPES; /* a decode-only launch (pipes where they fit) */
  const bool kvf = a->kv_stream && decode;        /* prefill_kernel's KVF */
  switch (a->tile_tokens * 2 + (a->softcap ? 1 : 0)) {
  case 64 * 2 + 1: return dispatch<64, true>(a, n, grid, pipe, pp, pipes, kvf, decode, stream);
  case 64 * 2: return dispatch<64, false>(a, n, grid, pipe, pp, pipes, kvf, decode, stream);
  case 128 * 2 + 1: return dispatch<128, true>(a, n, grid, pipe, pp, pipes, kvf, decode, stream);
  case 128 * 2: return dispatch<128, false>(a, n, grid, pipe, pp, pipes, kvf, decode, stream);
  }
  return (int)cudaErrorInvalidValue;
}
