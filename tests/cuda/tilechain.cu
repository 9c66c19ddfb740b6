/* tilechain.cu — a timing probe (not a test; `bash tests/cuda/run_gpu.sh chain`): the cycles
 * one warpgroup's serial chain takes a 64-key tile at head_dim 128, with Q, K and V already in
 * shared memory (no loads, no barriers with a producer), in these forms:
 *   A  as prefill_sm90.cu: S = Q K^T (m64n64k16 x 8, SS), tile update of 64 rows, acc *= alpha,
 *      P V (m64n128k16 x 4, P from registers)
 *   B  keys on M: S^T = K Q^T (m64n8k16 x 8), a 2 x 2 tile update a thread with the row's
 *      max and sums across the warpgroup (shuffles + shared memory), P^T to shared memory,
 *      O^T = V^T P^T (2 x 4 m64n8k16, V as a transposed A), acc *= alpha
 *   and A's parts alone: S only, S + the tile update, P V only; and A with a decode split end
 *   every 8 tiles that writes its partial and releases a ready flag (st.release.gpu), and
 *   the same without the flag. Forms 0, 2 and 4 also run as 2 and 3 warpgroups side by side
 *   (independent chains), and kernels of their own time S over 128 keys as m64n128k16 (what
 *   a 128-key contract tile would issue) with 1-3 warpgroups, and a 128-key tile's whole
 *   chain with 1-2. Last, one warpgroup's chain in the kernel's pipelined form against S
 *   issued two tiles ahead (chain_lookahead; NOTES.md v5.7). First (chain_ksplit, v5.15): S
 *   as one 8-step chain against two independent 4-step chains over the head_dim halves, alone,
 *   in the serial tile and in the pipelined tile, one and two warpgroups; and (chain_oneahead)
 *   S issued one tile ahead so that P V(t) runs under softmax(t + 1).
 * The numbers B computes are not the contract's (its sums are not da_row_tree's); the
 * instruction mix and the barriers are what such a form would run. NOTES.md v5.5 has the
 * results: the chain is the latency of the dependent wgmma k-steps, not their MMA work. */
#include <cuda_bf16.h>
#include <cstdio>

#include "numerics.cuh"
#include "sm90.cuh"

using namespace da_sm90;

template <int TA>
__device__ __forceinline__ void n8(float (&d)[4], uint64_t da, uint64_t db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, %6, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "l"(da), "l"(db), "n"(TA));
}

/* A probe's end: every wgmma retired, the cycles since t0 to out[0], and a sum of the results
 * into sink, so that no work is optimized away. */
__device__ __forceinline__ void probe_end(long long t0, long long *out, float *sink, const da_row_state &st,
                                          float (&acc)[16][4]) {
  wg_wait<0>();
  reg_fence(acc);
  const long long t1 = clock64();
  if (threadIdx.x == 0) out[0] = t1 - t0;
  float z = st.l[0] + st.l[1];
  for (int n = 0; n < 16; n++) z += acc[n][0] + acc[n][3];
  sink[threadIdx.x] = z;
}

__global__ void __launch_bounds__(384, 1) chain(int form, int tiles, long long *out, float *sink, float *part,
                                                 int *flag) {
  extern __shared__ __align__(1024) unsigned char raw[];
  unsigned char *sm = raw + ((1024 - (smem_addr(raw) & 1023)) & 1023);
  const uint32_t qa = smem_addr(sm), ka = qa + 16384, va = ka + 16384, pa = va + 16384;
  __shared__ float red[2][4][8];
  for (int i = threadIdx.x; i < 4 * 16384 / 4; i += blockDim.x) reinterpret_cast<uint32_t *>(sm)[i] = 0x3c003c00u ^ (i * 2654435761u & 0x00ff00ffu);
  fence_async_smem();
  __syncthreads();
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  da_row_state st;
  da_state_reset(st);
  float acc[16][4] = {};
  float o2[2][4] = {};
  float m2[2] = {-INFINITY, -INFINITY}, l2[2] = {0.f, 0.f};
  const long long t0 = clock64();
  for (int t = 0; t < tiles; t++) {
    if (form != 1) {
      const bool do_s = form != 4, do_u = form != 2 && form != 4, do_pv = form == 0 || form >= 4;
      /* forms 5 and 6: A with a split end every 8 tiles, with and without the released flag */
      float s[8][4];
      uint64_t da[8], db[8];
#pragma unroll
      for (int kk = 0; kk < 8; kk++) {
        const uint32_t off = (kk >> 2) * 8192 + (kk & 3) * 32;
        da[kk] = desc_kmajor(qa + off), db[kk] = desc_kmajor(ka + off);
      }
      if (do_s) {
        wg_chain_s_ss8_z<true>(s, da, db);
        wg_wait<0>();
        reg_fence(s);
      } else {
#pragma unroll
        for (int n = 0; n < 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.5f + t;
      }
      float alpha[2] = {1.0f, 1.0f};
      if (do_u) da_tile_update<8>(st, s, 0.125f, alpha);
#pragma unroll
      for (int n = 0; n < 16; n++) {
        acc[n][0] *= alpha[0], acc[n][1] *= alpha[0], acc[n][2] *= alpha[1], acc[n][3] *= alpha[1];
      }
      uint32_t p[4][4];
#pragma unroll
      for (int kc = 0; kc < 4; kc++) {
        p[kc][0] = da_pack2<true>(s[2 * kc][0], s[2 * kc][1]);
        p[kc][1] = da_pack2<true>(s[2 * kc][2], s[2 * kc][3]);
        p[kc][2] = da_pack2<true>(s[2 * kc + 1][0], s[2 * kc + 1][1]);
        p[kc][3] = da_pack2<true>(s[2 * kc + 1][2], s[2 * kc + 1][3]);
      }
      uint64_t dv[4];
#pragma unroll
      for (int kc = 0; kc < 4; kc++) dv[kc] = desc_mnmajor(va + kc * 2048, 8192);
      if (do_pv) {
        reg_fence(acc);
        wg_chain_pv_n128<true>(acc, p, dv);
        wg_wait<0>();
        reg_fence(acc);
      } else {
        acc[t & 15][0] += __uint_as_float(p[t & 3][0]);
      }
      if (form >= 5 && t % 8 == 7) {
        /* A split end of a decode block as a partial with a ready flag: warp 0's first 16
         * lanes (4 rows x 4 quads) write their row's 128 floats, then a release of the flag. */
        if (warp == 0 && g < 4) {
#pragma unroll
          for (int n = 0; n < 16; n++)
            *reinterpret_cast<float2 *>(part + (t / 8 % 64) * 512 + g * 128 + n * 8 + q * 2) = make_float2(acc[n][0], acc[n][1]);
        }
        __syncwarp();
        if (form == 5 && threadIdx.x == 0)
          asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(flag + t / 8 % 64), "r"(t) : "memory");
      }
    } else {
      float s[4] = {0.f, 0.f, 0.f, 0.f};
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 8; kk++) {
        const uint32_t off = (kk >> 2) * 8192 + (kk & 3) * 32;
        n8<0>(s, desc_kmajor(ka + off), desc_kmajor(qa + off));
      }
      wg_commit();
      wg_wait<0>();
      for (int e = 0; e < 4; e++) asm volatile("" : "+f"(s[e])::"memory");
      /* Row r = 2 q + (e & 1); keys 16 warp + g (e < 2) and + 8. Max over the row's 64 keys. */
      float mx[2], sm2[2], alpha[2];
#pragma unroll
      for (int r = 0; r < 2; r++) {
        float m = fmaxf(s[r], s[r + 2]);
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
        if (g == 0) red[0][warp][2 * q + r] = m;
      }
      bar_sync(1, 128);
#pragma unroll
      for (int r = 0; r < 2; r++) {
        const int row = 2 * q + r;
        mx[r] = fmaxf(fmaxf(red[0][0][row], red[0][1][row]), fmaxf(red[0][2][row], red[0][3][row])) * 0.125f;
        const float mn = mx[r] - m2[r] > 8.f ? mx[r] : m2[r];
        alpha[r] = da_ex2(m2[r] - mn);
        m2[r] = mn;
        s[r] = da_ex2(__fmaf_rn(s[r], 0.125f, -mn));
        s[r + 2] = da_ex2(__fmaf_rn(s[r + 2], 0.125f, -mn));
        float v = s[r] + __shfl_xor_sync(0xffffffffu, s[r], 4);
        float w = s[r + 2] + __shfl_xor_sync(0xffffffffu, s[r + 2], 4);
        v = v + w;
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        if (g == 0) red[1][warp][row] = v;
      }
      /* P^T to shared memory: element (row, key) of a [64][64] swizzled block (rows 0-7). */
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int row = 2 * q + (e & 1), key = 16 * warp + g + 8 * (e >> 1);
        const uint32_t a = pa + swz128(row, key >> 3, 64) + (key & 7) * 2;
        const __nv_bfloat16 h = __float2bfloat16_rn(s[e]);
        asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(a), "h"(*reinterpret_cast<const unsigned short *>(&h)));
      }
      fence_async_smem();
      bar_sync(1, 128);
#pragma unroll
      for (int r = 0; r < 2; r++) {
        const int row = 2 * q + r;
        sm2[r] = (red[1][0][row] + red[1][1][row]) + (red[1][2][row] + red[1][3][row]);
        l2[r] = alpha[r] * l2[r] + sm2[r];
      }
#pragma unroll
      for (int h = 0; h < 2; h++) {
        o2[h][0] *= alpha[0], o2[h][1] *= alpha[1], o2[h][2] *= alpha[0], o2[h][3] *= alpha[1];
      }
      wg_fence();
#pragma unroll
      for (int h = 0; h < 2; h++)
#pragma unroll
        for (int kc = 0; kc < 4; kc++) n8<1>(o2[h], desc_mnmajor(va + h * 8192 + kc * 2048, 8192), desc_kmajor(pa + kc * 32));
      wg_commit();
      wg_wait<0>();
      for (int h = 0; h < 2; h++)
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(o2[h][e])::"memory");
      bar_sync(1, 128); /* P^T and red are rewritten next tile */
    }
  }
  const long long t1 = clock64();
  if (threadIdx.x == 0) out[0] = t1 - t0;
  float z = st.l[0] + st.l[1] + l2[0] + l2[1];
  for (int n = 0; n < 16; n++) z += acc[n][0] + acc[n][3];
  z += o2[0][0] + o2[1][3];
  sink[threadIdx.x] = z;
}

/* S of 128 keys as m64n128k16 SS x 8 (what a 128-key contract tile would issue), on its own
 * kernel so that its 64 accumulator registers do not change chain()'s allocation. K's 128
 * rows read past K into V and P: timing only. */
/* Q's address in the 1024-aligned dynamic shared memory (K, V and P follow at 16 KiB
 * steps), all 64 KiB filled with bf16 1.0 for the MMAs to read. */
__device__ uint32_t probe_smem(unsigned char *raw) {
  unsigned char *sm = raw + ((1024 - (smem_addr(raw) & 1023)) & 1023);
  for (int i = threadIdx.x; i < 4 * 16384 / 4; i += blockDim.x) reinterpret_cast<uint32_t *>(sm)[i] = 0x3f803f80u;
  fence_async_smem();
  __syncthreads();
  return smem_addr(sm);
}

/* d = S of 128 keys: 8 m64n128k16 SS k-steps, waited for (K's 128 rows read past K). */
__device__ __forceinline__ void s128(float (&d)[16][4], uint32_t qa, uint32_t ka) {
#pragma unroll
  for (int n = 0; n < 16; n++) d[n][0] = d[n][1] = d[n][2] = d[n][3] = 0.0f;
  reg_fence(d);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < 8; kk++)
    wg_ss<128, true, 0>(d, desc_kmajor(qa + (kk >> 2) * 8192 + (kk & 3) * 32),
                        desc_kmajor(ka + (kk >> 2) * 16384 + (kk & 3) * 32), 1);
  wg_commit();
  wg_wait<0>();
  reg_fence(d);
}

__global__ void __launch_bounds__(384, 1) chain_s128(int tiles, long long *out, float *sink) {
  extern __shared__ __align__(1024) unsigned char raw[];
  const uint32_t qa = probe_smem(raw), ka = qa + 16384;
  float z = 0.0f;
  const long long t0 = clock64();
  for (int t = 0; t < tiles; t += 2) {
    float d[16][4];
    s128(d, qa, ka);
    z += d[t & 15][t & 3];
  }
  const long long t1 = clock64();
  if (threadIdx.x == 0) out[0] = t1 - t0;
  sink[threadIdx.x] = z;
}

/* The whole chain of a 128-key tile (S n128, the tile update over 128 keys, acc *= alpha,
 * P V over 128 keys as two 4-step n128 chains), per 64 keys: what T = 128 would run. K's and
 * V's second 64 rows read past their regions: timing only. */
__global__ void __launch_bounds__(256, 1) chain_t128(int tiles, long long *out, float *sink) {
  extern __shared__ __align__(1024) unsigned char raw[];
  const uint32_t qa = probe_smem(raw), ka = qa + 16384, va = ka + 16384;
  da_row_state st;
  da_state_reset(st);
  float acc[16][4] = {};
  const long long t0 = clock64();
  for (int t = 0; t < tiles; t += 2) {
    float x[16][4];
    s128(x, qa, ka);
    float alpha[2];
    da_tile_update<16>(st, x, 0.125f, alpha);
#pragma unroll
    for (int n = 0; n < 16; n++) {
      acc[n][0] *= alpha[0], acc[n][1] *= alpha[0], acc[n][2] *= alpha[1], acc[n][3] *= alpha[1];
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
      uint32_t p[4][4];
#pragma unroll
      for (int kc = 0; kc < 4; kc++) {
        const int f = 8 * h + 2 * kc;
        p[kc][0] = da_pack2<true>(x[f][0], x[f][1]);
        p[kc][1] = da_pack2<true>(x[f][2], x[f][3]);
        p[kc][2] = da_pack2<true>(x[f + 1][0], x[f + 1][1]);
        p[kc][3] = da_pack2<true>(x[f + 1][2], x[f + 1][3]);
      }
      uint64_t dv[4];
#pragma unroll
      for (int kc = 0; kc < 4; kc++) dv[kc] = desc_mnmajor(va + h * 8192 + kc * 2048, 8192);
      reg_fence(acc);
      wg_chain_pv_n128<true>(acc, p, dv);
    }
    wg_wait<0>();
    reg_fence(acc);
  }
  probe_end(t0, out, sink, st, acc);
}

/* What the one-warpgroup probes of a 64-key tile at head_dim 128 share (chain_lookahead,
 * chain_oneahead, chain_p2, chain_ksplit): Q, K and V (16 KiB each) in the 1024-aligned
 * dynamic shared memory, filled with bf16 values; the wgmma descriptors of S's eight k-steps
 * and P V's four; the rows' state, acc and alpha; acc *= alpha and the packing of P. */
struct tile64 {
  uint64_t da[8], db[8], dv[4];
  da_row_state st;
  float acc[16][4], alpha[2];
  __device__ __forceinline__ explicit tile64(unsigned char *raw) {
    unsigned char *sm = raw + ((1024 - (smem_addr(raw) & 1023)) & 1023);
    const uint32_t qa = smem_addr(sm), ka = qa + 16384, va = ka + 16384;
    for (int i = threadIdx.x; i < 3 * 16384 / 4; i += blockDim.x) reinterpret_cast<uint32_t *>(sm)[i] = 0x3c003c00u ^ (i * 2654435761u & 0x00ff00ffu);
    fence_async_smem();
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < 8; kk++) {
      const uint32_t off = (kk >> 2) * 8192 + (kk & 3) * 32;
      da[kk] = desc_kmajor(qa + off), db[kk] = desc_kmajor(ka + off);
    }
#pragma unroll
    for (int kc = 0; kc < 4; kc++) dv[kc] = desc_mnmajor(va + kc * 2048, 8192);
    da_state_reset(st);
#pragma unroll
    for (int n = 0; n < 16; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  }
  __device__ __forceinline__ void issue_s(float (&s)[8][4]) { wg_chain_s_ss8_z<true>(s, da, db); }
  __device__ __forceinline__ void issue_pv(const uint32_t (&p)[4][4]) { wg_chain_pv_n128<true>(acc, p, dv); }
  __device__ __forceinline__ void update(float (&s)[8][4]) { da_tile_update<8>(st, s, 0.125f, alpha); }
  __device__ __forceinline__ void rescale() {
#pragma unroll
    for (int n = 0; n < 16; n++) {
      acc[n][0] = __fmul_rn(acc[n][0], alpha[0]), acc[n][1] = __fmul_rn(acc[n][1], alpha[0]);
      acc[n][2] = __fmul_rn(acc[n][2], alpha[1]), acc[n][3] = __fmul_rn(acc[n][3], alpha[1]);
    }
  }
  __device__ __forceinline__ static void pack(const float (&x)[8][4], uint32_t (&p)[4][4]) {
#pragma unroll
    for (int kc = 0; kc < 4; kc++) {
      p[kc][0] = da_pack2<true>(x[2 * kc][0], x[2 * kc][1]);
      p[kc][1] = da_pack2<true>(x[2 * kc][2], x[2 * kc][3]);
      p[kc][2] = da_pack2<true>(x[2 * kc + 1][0], x[2 * kc + 1][1]);
      p[kc][3] = da_pack2<true>(x[2 * kc + 1][2], x[2 * kc + 1][3]);
    }
  }
  /* P V of the tile whose P is in x, once acc's last P V is waited for: acc *= alpha, P packed
   * into p, the chain issued. */
  __device__ __forceinline__ void pv(const float (&x)[8][4], uint32_t (&p)[4][4]) {
    reg_fence(acc);
    rescale();
    pack(x, p);
    issue_pv(p);
  }
  __device__ __forceinline__ void end(long long t0, long long *out, float *sink) { probe_end(t0, out, sink, st, acc); }
};

/* One warpgroup's tile chain with S two tiles ahead (two S buffers; tile t waits S(t), runs
 * softmax(t) under P V(t - 1) and S(t + 1), waits P V(t - 1), issues P V(t) and S(t + 2);
 * commit order S0, E, S1, then P V(t), S(t + 2), E an empty group, so every wait's N is a
 * constant), against the kernel's pipelined form (chain_ksplit<false, 2>: slot t issues S(t)
 * and P V(t - 1), softmax(t) runs under that P V, everything retired by the slot's end). As
 * a loop, this form keeps wgmmas in flight across the back edge and ptxas serializes every wgmma
 * (C7514: the loop's entry copies the in-flight S registers), so it runs as straight-line
 * blocks of 8 tiles, drained at block ends. Same operands every tile (shared memory as
 * chain()'s); cycles a tile. (H100: pipelined 952, AHEAD 1,110: the tensor pipe takes the
 * groups in order, so S(t + 2) queued between P V(t) and P V(t + 1) delays the P V chain.) */
__global__ void __launch_bounds__(128, 1) chain_lookahead(int tiles, long long *out, float *sink) {
  extern __shared__ __align__(1024) unsigned char raw[];
  tile64 w(raw);
  float s0[8][4], s1[8][4];
  uint32_t p[4][4];
  const long long t0 = clock64();
  /* Blocks of 8 tiles as straight-line code (fully unrolled: a wgmma in flight across a
   * loop's back edge makes ptxas copy its registers and serialize, C7514), each drained at
   * its end. */
  for (int b = 0; b < tiles; b += 8) {
    w.issue_s(s0);
    wg_commit();
    w.issue_s(s1);
    auto tile = [&](float (&sc)[8][4], int i) {
      wg_wait<2>();
      reg_fence(sc);
      w.update(sc);
      wg_wait<1>();
      w.pv(sc, p);
      if (i + 2 < 8) w.issue_s(sc);
      else wg_commit();
    };
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      tile(s0, i);
      tile(s1, i + 1);
    }
    wg_wait<0>();
    reg_fence(w.acc);
  }
  w.end(t0, out, sink);
}

/* One warpgroup's chain with S one tile ahead (v5.15): tile t waits S(t), issues S(t + 1)
 * into the other buffer, runs softmax(t) under it, waits P V(t - 1), scales acc and issues
 * P V(t), so P V(t) runs under the next tile's softmax (commit order S(t), P V(t - 1),
 * S(t + 1), P V(t): every wait is wait_group 1). BLOCK 8: straight-line blocks of 8 tiles
 * (a split at S 512), drained at their ends; BLOCK 2: a loop of two tiles with the wgmmas in
 * flight across its back edge. Cycles a tile. */
template <int BLOCK>
__global__ void __launch_bounds__(128, 1) chain_oneahead(int tiles, long long *out, float *sink) {
  extern __shared__ __align__(1024) unsigned char raw[];
  tile64 w(raw);
  float s0[8][4], s1[8][4];
  uint32_t p[4][4];
  /* A tile: sc holds S(i) (in flight), sn takes S(i + 1) unless last. */
  auto tile = [&](float (&sc)[8][4], float (&sn)[8][4], bool last) {
    wg_wait<1>();
    reg_fence(sc);
    if (!last) w.issue_s(sn);
    else wg_commit();
    w.update(sc);
    wg_wait<1>();
    w.pv(sc, p);
  };
  const long long t0 = clock64();
  if constexpr (BLOCK == 8) {
    for (int b = 0; b < tiles; b += 8) {
      w.issue_s(s0);
      wg_commit();
#pragma unroll
      for (int i = 0; i < 8; i += 2) {
        tile(s0, s1, false);
        tile(s1, s0, i + 1 == 7);
      }
      wg_wait<0>();
      reg_fence(w.acc);
    }
  } else {
    w.issue_s(s0);
    wg_commit();
    for (int t = 0; t < tiles; t += 2) {
      tile(s0, s1, false);
      tile(s1, s0, t + 2 >= tiles);
    }
    wg_wait<0>();
    reg_fence(w.acc);
  }
  w.end(t0, out, sink);
}

/* The kernel's pipelined form with P(t) packed into a second buffer (p2, p in turn: a loop of
 * two tiles) so that no instruction of the softmax writes the registers P V(t - 1) reads in
 * flight (v5.15: packing into them let ptxas pull P V(t - 1)'s wait up to the softmax's
 * start). Cycles a tile. */
__global__ void __launch_bounds__(128, 1) chain_p2(int tiles, long long *out, float *sink) {
  extern __shared__ __align__(1024) unsigned char raw[];
  tile64 w(raw);
  float s0[8][4];
  uint32_t p[4][4], p2[4][4];
  auto slot = [&](const uint32_t (&pc)[4][4], uint32_t (&pn)[4][4]) {
    w.issue_s(s0);
    w.rescale();
    w.issue_pv(pc);
    wg_wait<1>();
    reg_fence(s0);
    w.update(s0);
    w.pack(s0, pn);
    wg_wait<0>();
    reg_fence(w.acc);
  };
  const long long t0 = clock64();
  w.issue_s(s0);
  wg_wait<0>();
  reg_fence(s0);
  w.update(s0);
  w.pack(s0, p);
  for (int t = 1; t + 1 < tiles; t += 2) {
    slot(p, p2);
    slot(p2, p);
  }
  w.rescale();
  w.issue_pv(p);
  w.end(t0, out, sink);
}

/* The pipelined form with P V(t - 1)'s wait moved to the top of the next slot (v5.15): slot t
 * waits P V(t - 2), packs P(t - 1) from s (its fp32 values, kept since softmax(t - 1)), issues
 * S(t) into s, scales acc, issues P V(t - 1), waits S(t) and runs softmax(t) under P V(t - 1),
 * which stays in
 * flight across the loop's back edge. No second P buffer, and no wait after the softmax for
 * ptxas to pull up into it. Cycles a tile. */
__global__ void __launch_bounds__(128, 1) chain_defer(int tiles, long long *out, float *sink) {
  extern __shared__ __align__(1024) unsigned char raw[];
  tile64 w(raw);
  float s0[8][4];
  uint32_t p[4][4];
  const long long t0 = clock64();
  w.issue_s(s0);
  wg_wait<0>();
  reg_fence(s0);
  w.update(s0);
  for (int t = 1; t < tiles; t++) {
    wg_wait<0>();
    reg_fence(w.acc);
    w.pack(s0, p);
    w.issue_s(s0);
    w.rescale();
    w.issue_pv(p);
    wg_wait<1>();
    reg_fence(s0);
    w.update(s0);
  }
  wg_wait<0>();
  w.pv(s0, p);
  w.end(t0, out, sink);
}

/* The cycles the last launch's first thread counted, or -1 after an error (printed). */
static long long cycles(const long long *out) {
  long long c = -1;
  cudaError_t e = cudaDeviceSynchronize();
  if (e == cudaSuccess) e = cudaMemcpy(&c, out, 8, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) {
    printf("error: %s\n", cudaGetErrorString(e));
    return -1;
  }
  return c;
}

/* A 128-key kernel with 1 .. max_wgs warpgroups, cycles a 64 keys of each; 1 after an error. */
static int probe128(void (*k)(int, long long *, float *), int max_wgs, const char *what, long long *out, float *sink) {
  cudaFuncSetAttribute(reinterpret_cast<const void *>(k), cudaFuncAttributeMaxDynamicSharedMemorySize, 70 * 1024);
  for (int wgs = 1; wgs <= max_wgs; wgs++) {
    k<<<1, 128 * wgs, 70 * 1024>>>(256, out, sink);
    const long long c = cycles(out);
    if (c < 0) return 1;
    printf("form %s, %d warpgroup(s): %.0f cycles a 64 keys of each\n", what, wgs, c / 256.0);
  }
  return 0;
}

/* S over head_dim 128 as two independent 4-step chains (columns 0-63 into d, 64-127 into e,
 * issued interleaved in one asm statement), summed after the wait: the dependent k-steps a
 * tile halve. A different sum order from the contract's one chain (new bits): timing only. */
__device__ __forceinline__ void s_chain44(float (&d)[8][4], float (&e)[8][4], const uint64_t (&da)[8], const uint64_t (&db)[8]) {
  asm volatile(
      "{\n.reg .pred pz, po;\nsetp.ne.b32 pz, 0, 0;\nsetp.eq.b32 po, 0, 0;\n"
      "wgmma.fence.sync.aligned;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %64, %72, pz, 1, 1, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %68, %76, pz, 1, 1, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %65, %73, po, 1, 1, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %69, %77, po, 1, 1, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %66, %74, po, 1, 1, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %70, %78, po, 1, 1, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %67, %75, po, 1, 1, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %71, %79, po, 1, 1, 0, 0;\n"
      "wgmma.commit_group.sync.aligned;\n"
      "}\n"
      : "=f"(d[0][0]), "=f"(d[0][1]), "=f"(d[0][2]), "=f"(d[0][3]), "=f"(d[1][0]), "=f"(d[1][1]), "=f"(d[1][2]), "=f"(d[1][3]), "=f"(d[2][0]), "=f"(d[2][1]), "=f"(d[2][2]), "=f"(d[2][3]), "=f"(d[3][0]), "=f"(d[3][1]), "=f"(d[3][2]), "=f"(d[3][3]), "=f"(d[4][0]), "=f"(d[4][1]), "=f"(d[4][2]), "=f"(d[4][3]), "=f"(d[5][0]), "=f"(d[5][1]), "=f"(d[5][2]), "=f"(d[5][3]), "=f"(d[6][0]), "=f"(d[6][1]), "=f"(d[6][2]), "=f"(d[6][3]), "=f"(d[7][0]), "=f"(d[7][1]), "=f"(d[7][2]), "=f"(d[7][3]), "=f"(e[0][0]), "=f"(e[0][1]), "=f"(e[0][2]), "=f"(e[0][3]), "=f"(e[1][0]), "=f"(e[1][1]), "=f"(e[1][2]), "=f"(e[1][3]), "=f"(e[2][0]), "=f"(e[2][1]), "=f"(e[2][2]), "=f"(e[2][3]), "=f"(e[3][0]), "=f"(e[3][1]), "=f"(e[3][2]), "=f"(e[3][3]), "=f"(e[4][0]), "=f"(e[4][1]), "=f"(e[4][2]), "=f"(e[4][3]), "=f"(e[5][0]), "=f"(e[5][1]), "=f"(e[5][2]), "=f"(e[5][3]), "=f"(e[6][0]), "=f"(e[6][1]), "=f"(e[6][2]), "=f"(e[6][3]), "=f"(e[7][0]), "=f"(e[7][1]), "=f"(e[7][2]), "=f"(e[7][3])
      : "l"(da[0]), "l"(da[1]), "l"(da[2]), "l"(da[3]), "l"(da[4]), "l"(da[5]), "l"(da[6]), "l"(da[7]), "l"(db[0]), "l"(db[1]), "l"(db[2]), "l"(db[3]), "l"(db[4]), "l"(db[5]), "l"(db[6]), "l"(db[7])
      : "memory");
}


/* One warpgroup's tile chain (each of 1-2 warpgroups its own), S as one 8-step chain (SPLIT
 * false) or two 4-step chains (true). FORM 0: S alone; 1: serial (S, update, acc *= alpha,
 * P V, each waited for); 2: the kernel's pipelined form (slot t issues S(t) and P V(t - 1),
 * the update of t under that P V). Cycles a tile. */
template <bool SPLIT, int FORM>
__global__ void __launch_bounds__(256, 1) chain_ksplit(int tiles, long long *out, float *sink) {
  extern __shared__ __align__(1024) unsigned char raw[];
  tile64 w(raw);
  float s0[8][4], s2[8][4];
  uint32_t p[4][4];
  auto issue_s = [&]() {
    if constexpr (SPLIT) s_chain44(s0, s2, w.da, w.db);
    else w.issue_s(s0);
  };
  auto sum_s = [&]() { /* after the wait */
    reg_fence(s0);
    if constexpr (SPLIT) {
      reg_fence(s2);
#pragma unroll
      for (int n = 0; n < 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) s0[n][e] = __fadd_rn(s0[n][e], s2[n][e]);
    }
  };
  const long long t0 = clock64();
  if constexpr (FORM == 0) {
    float z = 0.0f;
    for (int t = 0; t < tiles; t++) {
      issue_s();
      wg_wait<0>();
      sum_s();
      z += s0[t & 7][t & 3];
    }
    w.acc[0][0] = z;
  } else if constexpr (FORM == 1) {
    for (int t = 0; t < tiles; t++) {
      issue_s();
      wg_wait<0>();
      sum_s();
      w.update(s0);
      w.rescale();
      w.pack(s0, p);
      reg_fence(w.acc);
      w.issue_pv(p);
      wg_wait<0>();
      reg_fence(w.acc);
    }
  } else {
    issue_s();
    wg_wait<0>();
    sum_s();
    w.update(s0);
    w.pack(s0, p);
    for (int t = 1; t < tiles; t++) {
      issue_s();
      w.rescale();
      w.issue_pv(p);
      wg_wait<1>();
      sum_s();
      w.update(s0);
      wg_wait<0>();
      reg_fence(w.acc);
      w.pack(s0, p);
    }
    w.rescale();
    w.issue_pv(p);
  }
  w.end(t0, out, sink);
}

/* chain_ksplit's forms, one chain against two, 1-2 warpgroups side by side; 1 after an error. */
static int probe_ksplit(long long *out, float *sink) {
  static const char *forms[] = {"S alone", "serial tile", "pipelined tile"};
  void (*ks[3][2])(int, long long *, float *) = {{chain_ksplit<false, 0>, chain_ksplit<true, 0>},
                                                 {chain_ksplit<false, 1>, chain_ksplit<true, 1>},
                                                 {chain_ksplit<false, 2>, chain_ksplit<true, 2>}};
  for (int f = 0; f < 3; f++)
    for (int wgs = 1; wgs <= 2; wgs++) {
      long long c[2];
      for (int s = 0; s < 2; s++) {
        cudaFuncSetAttribute(reinterpret_cast<const void *>(ks[f][s]), cudaFuncAttributeMaxDynamicSharedMemorySize, 70 * 1024);
        ks[f][s]<<<1, 128 * wgs, 70 * 1024>>>(256, out, sink);
        c[s] = cycles(out);
        if (c[s] < 0) return 1;
      }
      printf("ksplit %s, %d warpgroup(s): one 8-step S chain %.0f, two 4-step chains %.0f cycles a tile of each\n",
             forms[f], wgs, c[0] / 256.0, c[1] / 256.0);
    }
  return 0;
}

int main() {
  long long *out;
  float *sink;
  cudaMalloc(&out, 8);
  cudaMalloc(&sink, 128 * 4);
  cudaFuncSetAttribute(chain, cudaFuncAttributeMaxDynamicSharedMemorySize, 70 * 1024);
  if (probe_ksplit(out, sink)) return 1;
  static const char *names[] = {"A (64-row tiles)", "B (keys on M)", "A, S only", "A, S + tile update", "A, P V only",
                                "A + a partial write and a released flag every 8 tiles",
                                "A + the partial write alone every 8 tiles"};
  float *part;
  int *flag;
  cudaMalloc(&part, 64 * 512 * 4);
  cudaMalloc(&flag, 64 * 4);
  cudaFree(sink);
  cudaMalloc(&sink, 384 * 4);
  for (int form = 0; form < 7; form++) {
    for (int rep = 0; rep < 2; rep++) {
      chain<<<1, 128, 70 * 1024>>>(form, 256, out, sink, part, flag);
      const long long c = cycles(out);
      if (c < 0) return 1;
      printf("form %s: %.0f cycles a tile\n", names[form], c / 256.0);
    }
  }
  /* Independent chains side by side: 2 and 3 warpgroups of one CTA, each its own tiles (the
   * same operands): does the tensor pipe interleave them, or do they queue? */
  static const int forms[] = {0, 2, 4};
  for (int f : forms) {
    for (int wgs = 2; wgs <= 3; wgs++) {
      chain<<<1, 128 * wgs, 70 * 1024>>>(f, 256, out, sink, part, flag);
      const long long c = cycles(out);
      if (c < 0) return 1;
      printf("form %s, %d warpgroups side by side: %.0f cycles a tile of each\n", names[f], wgs, c / 256.0);
    }
  }
  if (probe128(chain_s128, 3, "S of 128 keys (n128)", out, sink) || probe128(chain_t128, 2, "128-key tile, all steps", out, sink))
    return 1;
  /* One warpgroup's orders of the same tile chain (v5.7, v5.15), two runs each. */
  const struct {
    void (*k)(int, long long *, float *);
    int tiles;
    const char *what;
  } orders[] = {{chain_ksplit<false, 2>, 256, "pipelined (the kernel's)"},
                {chain_lookahead, 256, "S two tiles ahead (two S buffers)"},
                {chain_p2, 257, "pipelined, P into a second buffer"},
                {chain_defer, 256, "pipelined, P V's wait at the next slot's top"},
                {chain_oneahead<2>, 256, "S one tile ahead, a loop of 2"},
                {chain_oneahead<8>, 256, "S one tile ahead, blocks of 8 drained"}};
  for (const auto &o : orders) {
    cudaFuncSetAttribute(reinterpret_cast<const void *>(o.k), cudaFuncAttributeMaxDynamicSharedMemorySize, 70 * 1024);
    for (int rep = 0; rep < 2; rep++) {
      o.k<<<1, 128, 70 * 1024>>>(o.tiles, out, sink);
      const long long c = cycles(out);
      if (c < 0) return 1;
      printf("form %s: %.0f cycles a tile\n", o.what, c / 256.0);
    }
  }
  return 0;
}
