/*
 * readbw.cu — the device's memory ceilings for the kernel notes (not a test, not in the
 * build): read-only bandwidth from n SMs (one 1024-thread CTA an SM, forced by its shared
 * memory; four 16-byte non-caching loads in flight a thread over 2 GiB) for n = all SMs down
 * to a quarter of them, contiguous slabs a CTA with 2-8 small CTAs an SM and 4 or 8 loads in
 * flight a thread, a plain copy, and reads in chunks the size of KV pages (16 tokens of
 * one kv head at head_dim 128 is 4 KB; 64 tokens 16 KB) at shuffled places, each CTA a run
 * of chunks as a decode item walks its page table: whether scattered pages, not the kernel,
 * cap the decode read rate; those pages by bulk (TMA) copies into a ring of 32 KB stages; and
 * the decode kernel's own K/V stream (tensor-map boxes over the pool's layout, no attention);
 * the same tiles by cuDNN's load path (cp.async from every thread of two CTAs an SM).
 * Best of five timed launches after a warm-up.
 * Run: `bash tests/cuda/run_gpu.sh ceiling` (nvcc -O3 for sm_90, then the binary);
 * `READBW=big bash tests/cuda/run_gpu.sh ceiling`: the stream forms only, over 8 GiB, each with
 * how far apart its CTAs finished (one wave, equal work a CTA); `READBW=release`: only the
 * decode stream over 8 GiB under the consumer's release rules (tma_kernel's rel); `READBW=pages`:
 * that stream over pages of 8 to 256 tokens.
 */
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include <cudaTypedefs.h>

#include "numerics.cuh" /* the L2 policies */
#include "sm90.cuh"     /* mbarriers and TMA: the attention kernels' own */

using namespace da_sm90;

#define SMEM (150 * 1024) /* more than half an SM's shared memory: one CTA an SM */

/* Each stream CTA's start and end (%globaltimer, ns) in the last launch of tma_kernel or
 * cp_kernel: how far apart the CTAs of a one-wave grid with equal work finish (print_ends). */
#define MAX_CTAS 1024
__device__ unsigned long long cta_time[MAX_CTAS][2];
__device__ __forceinline__ void stamp_cta(int k) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  if (threadIdx.x == 0 && blockIdx.x < MAX_CTAS) cta_time[blockIdx.x][k] = t;
}

__device__ __forceinline__ uint32_t ld_xor(const uint4 *p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v.x ^ v.y ^ v.z ^ v.w;
}

__global__ void __launch_bounds__(1024, 1) read_kernel(const uint4 *p, size_t n, uint32_t *sink) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  uint32_t x = 0;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i + 3 * stride < n; i += 4 * stride)
    x ^= ld_xor(p + i) ^ ld_xor(p + i + stride) ^ ld_xor(p + i + 2 * stride) ^ ld_xor(p + i + 3 * stride);
  if (x == 0x9e3779b9u) *sink = x; /* keeps the loads; never true for the memset pattern */
}

/* Slabs: CTA b reads its own contiguous slab [b len, (b + 1) len) of 16-byte words, DEPTH loads
 * in flight a thread (as a decode CTA reads one kv head's pages), with no shared memory, so as
 * many CTAs an SM as registers and threads allow: whether more bytes in flight an SM than
 * read_kernel's 64 KB reach what cuDNN's decode reads on the H200 (4.6 TB/s, NOTES v5.13). */
template <int DEPTH>
__global__ void __launch_bounds__(256) slab_kernel(const uint4 *p, size_t len, uint32_t *sink) {
  const uint4 *s = p + (size_t)blockIdx.x * len;
  uint32_t x = 0;
  for (size_t i = threadIdx.x; i + (DEPTH - 1) * 256 < len; i += DEPTH * 256) {
#pragma unroll
    for (int k = 0; k < DEPTH; k++) x ^= ld_xor(s + i + k * 256);
  }
  if (x == 0x9e3779b9u) *sink = x;
}

/* CTA b reads chunks [b per, (b + 1) per) of the list, chunk k at perm[k]; a chunk is
 * 2^shift uint4. Four loads in flight a thread, as read_kernel. */
__global__ void __launch_bounds__(1024, 1) chunk_kernel(const uint4 *p, const uint32_t *perm, int per, int shift,
                                                      uint32_t *sink) {
  const size_t len = (size_t)per << shift, mask = ((size_t)1 << shift) - 1;
  const uint32_t *pl = perm + (size_t)blockIdx.x * per;
  auto at = [&](size_t j) { return p + ((size_t)pl[j >> shift] << shift) + (j & mask); };
  uint32_t x = 0;
  for (size_t j = threadIdx.x; j + 3 * 1024 < len; j += 4 * 1024)
    x ^= ld_xor(at(j)) ^ ld_xor(at(j + 1024)) ^ ld_xor(at(j + 2048)) ^ ld_xor(at(j + 3072));
  if (x == 0x9e3779b9u) *sink = x;
}

/* The way the attention kernels read: bulk (TMA) copies into a ring of nst 32 KB stages,
 * one producer thread, one consumer thread that takes each stage as it lands and frees it
 * (no arithmetic: the ring's own ceiling). CTA b reads tiles [b per, (b + 1) per); tile g is
 * eight 4 KB pages, page k at perm[8 g + k] (shuffled) or 8 g + k, in copies of `copy`
 * bytes (at most 4 KB where shuffled; a larger copy spans pages in order). */
#define TILE_B 32768
__global__ void __launch_bounds__(64, 1) bulk_kernel(const char *p, const uint32_t *perm, int per, int copy, int nst,
                                                   uint32_t *sink) {
  extern __shared__ __align__(1024) char smem[];
  const uint32_t bars = (uint32_t)__cvta_generic_to_shared(smem), stages = bars + 1024;
  auto full = [&](int s) { return bars + 16 * s; };
  auto empty = [&](int s) { return bars + 16 * s + 8; };
  if (threadIdx.x == 0) {
    for (int s = 0; s < nst; s++) mbar_init(full(s), 1), mbar_init(empty(s), 1);
    mbar_init_fence();
  }
  __syncthreads();
  const size_t g0 = (size_t)blockIdx.x * per;
  if (threadIdx.x == 0) {
    for (int t = 0; t < per; t++) {
      const int s = t % nst;
      if (t >= nst) mbar_wait(empty(s), (t / nst - 1) & 1);
      mbar_arrive_tx(full(s), TILE_B);
      for (int c = 0; c < TILE_B / copy; c++) {
        const size_t off = (size_t)c * copy, page = 8 * (g0 + t) + off / 4096;
        const char *src = p + (perm ? (size_t)perm[page] * 4096 + off % 4096 : (g0 + t) * TILE_B + off);
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                         stages + s * TILE_B + (uint32_t)off),
                     "l"(src), "r"(copy), "r"(full(s))
                     : "memory");
      }
    }
  } else if (threadIdx.x == 32) {
    uint32_t x = 0;
    for (int t = 0; t < per; t++) {
      const int s = t % nst;
      mbar_wait(full(s), (t / nst) & 1);
      x ^= *reinterpret_cast<volatile uint32_t *>(smem + 1024 + s * TILE_B + (t & 63) * 4);
      mbar_arrive(empty(s));
    }
    if (x == 0x9e3779b9u) *sink = x;
  }
}

/* The decode kernel's own K/V stream (prefill_sm90.cu's produce, without the attention):
 * the pool as [rows][128] bf16 in pages of 2 (K, V) x 8 kv heads x 16 tokens (64 KB), boxes
 * of 16 rows x 64 columns, 128-byte swizzled, L2 promotion 256 B. A tile is 64 tokens of one
 * kv head: 4 pages, lane c < 4 of the producer warp issuing its page's four boxes (K and V,
 * two column blocks), 32 KB on the stage's barrier. pipes independent rings a CTA (producer
 * warp 2w, consumer warp 2w + 1) of nst stages each; stream s = b pipes + w reads kv head
 * s % 8 of pages perm[(s / 8) per 4 + 4 i + c] (mod n_pages) for its tiles i < per.
 * box3 (tm a 3D map over (column, row, column block)): each lane issues two 4 KB boxes (K, V:
 * 16 rows x both column blocks) instead of four 2 KB ones; the bytes land [block][row] per
 * page, not [block][64 rows] per tile (a layout the wgmma descriptors would have to follow):
 * whether the box size caps the stream.
 * contig (tm a map of 64-row boxes): stream s reads its own contiguous run instead, tile i's K
 * at rows 64 (s per + i) of the pool's first half and its V at the same rows of the second
 * (8 KB boxes, one lane): the layout of a contiguous [sequence, kv head, token] K/V as the
 * peers read it, the same bytes a stream as the paged forms: whether pages cost the stream.
 * hold: the consumer keeps each stage that many SM cycles before releasing it, as the
 * attention's tile update does (~0.75 us at 1.98 GHz, v5.7): what that costs the stream.
 * rel: when a stage is released. 0: hold cycles after its tile landed (above). 1: the decode
 * kernel's pipelined rule: stage i - 1 once tile i has landed and hold cycles more (P V(i - 1)
 * runs after S(i) is issued). 2: K and V of a stage released apart (two empty barriers, the
 * producer waits for each before its boxes): K(i) hold_k cycles after tile i landed (S(i)
 * done), V(i - 1) hold cycles after it (P V(i - 1) done): the two-barrier stage of v5.18. */
__global__ void __launch_bounds__(320, 1) tma_kernel(const __grid_constant__ CUtensorMap tm, const uint32_t *perm,
                                                    int n_pages, int per, int nst, int box3, int contig, int hold,
                                                    int ef, uint32_t *sink, int rel = 0, int hold_k = 0,
                                                    int ptok = 16, int cwarps = 1) {
  extern __shared__ __align__(1024) char smem[];
  /* A pipe: a producer warp and cwarps consumer warps (4: a consumer warpgroup, every warp
   * waiting on the stage and arriving on its release, as the decode kernel's do). */
  const int wpp = 1 + cwarps, w = threadIdx.x / 32 / wpp, role = threadIdx.x / 32 % wpp == 0 ? 0 : 1,
            lane = threadIdx.x & 31;
  const uint32_t bars = (uint32_t)__cvta_generic_to_shared(smem) + 24 * nst * w, stages = bars - 24 * nst * w + 1024;
  stamp_cta(0);
  auto full = [&](int st) { return bars + 24 * st; };
  auto empty = [&](int st) { return bars + 24 * st + 8; };   /* the stage, or its K (rel 2) */
  auto vempty = [&](int st) { return bars + 24 * st + 16; }; /* its V (rel 2) */
  if (role == 0 && lane == 0) {
    for (int st = 0; st < nst; st++) mbar_init(full(st), 1), mbar_init(empty(st), cwarps), mbar_init(vempty(st), cwarps);
    mbar_init_fence();
  }
  __syncthreads();
  const int s = blockIdx.x * (blockDim.x / 32 / wpp) + w;
  const int kvh = s % 8;
  if (role == 0) {
    if (lane == 0) tma_prefetch_desc(&tm);
    for (int i = 0; i < per; i++) {
      const int st = i % nst;
      if (i >= nst) mbar_wait(empty(st), (i / nst - 1) & 1);
      const uint32_t kd = stages + (uint32_t)(w * nst + st) * TILE_B, vd = kd + TILE_B / 2;
      if (lane == 0) mbar_arrive_tx(full(st), TILE_B);
      __syncwarp();
      if (contig) {
        if (lane == 0) {
          const int krow = (int)(((size_t)s * per + i) * 64), vrow = krow + n_pages * 128;
          for (int cb = 0; cb < 2; cb++) {
            tma_load_2d(kd + cb * 64 * 128, &tm, cb * 64, krow, full(st));
            tma_load_2d(vd + cb * 64 * 128, &tm, cb * 64, vrow, full(st));
          }
        }
      } else {
        /* Pages of ptok tokens ([K|V][8 heads][ptok][128] each, n_pages of them); lane c < nch
         * loads chunk c of the tile: R = min(ptok, 64) rows from its page (tm's boxes are R
         * rows). box3 and rel 2 run at ptok 16 only. */
        const int R = ptok < 64 ? ptok : 64, nch = 64 / R;
        const int64_t tok = ((int64_t)(s / 8) * per + i) * 64 + (int64_t)(lane % nch) * R, page = tok / ptok;
        const int pg = (int)(perm ? perm[page % n_pages] : page % n_pages);
        const int row = pg * 16 * ptok + kvh * ptok + (int)(tok % ptok);
        if (box3) {
          if (lane < 4) {
            tma_load_3d(kd + lane * 2 * 16 * 128, &tm, 0, row, 0, full(st));
            tma_load_3d(vd + lane * 2 * 16 * 128, &tm, 0, row + 128, 0, full(st));
          }
        } else if (rel == 2) { /* K once its half is free, then V once its half is */
          for (int cb = 0; cb < 2 && lane < 4; cb++)
            tma_load_2d(kd + cb * 64 * 128 + lane * 16 * 128, &tm, cb * 64, row, full(st));
          if (i >= nst) mbar_wait(vempty(st), (i / nst - 1) & 1);
          for (int cb = 0; cb < 2 && lane < 4; cb++)
            tma_load_2d(vd + cb * 64 * 128 + lane * 16 * 128, &tm, cb * 64, row + 128, full(st));
        } else if (lane < nch) {
          /* ef: evict_first, as the decode kernel loads K/V that exceed the L2 (KVF) */
          auto load = [&](uint32_t dst, int c0, int r) {
            if (ef) tma_load_2d(dst, &tm, c0, r, full(st), da_l2_evict_first());
            else tma_load_2d(dst, &tm, c0, r, full(st));
          };
          for (int cb = 0; cb < 2; cb++) {
            load(kd + cb * 64 * 128 + lane * R * 128, cb * 64, row);
            load(vd + cb * 64 * 128 + lane * R * 128, cb * 64, row + 8 * ptok);
          }
        }
      }
    }
  } else if (lane == 0 || cwarps > 1) {
    uint32_t x = 0;
    for (int i = 0; i < per; i++) {
      const int st = i % nst;
      mbar_wait(full(st), (i / nst) & 1);
      x ^= *reinterpret_cast<volatile uint32_t *>(smem + 1024 + (size_t)(w * nst + st) * TILE_B + (i & 63) * 4);
      const long long t0 = clock64();
      const int sp = (i + nst - 1) % nst; /* the stage of tile i - 1 */
      if (rel == 2) {
        while (clock64() - t0 < hold_k) {
        }
        __syncwarp(__activemask());
        if (lane == 0) mbar_arrive(empty(st));
      }
      while (clock64() - t0 < hold) {
      }
      __syncwarp(__activemask());
      if (lane == 0) {
        if (rel == 0) mbar_arrive(empty(st));
        else if (i > 0) mbar_arrive(rel == 2 ? vempty(sp) : empty(sp));
      }
    }
    if (x == 0x9e3779b9u) *sink = x;
  }
  __syncthreads();
  stamp_cta(1);
}

/* cuDNN's way (its decode kernel on the H200 is an sm_80 one, NOTES v5.10: two 128-thread CTAs
 * an SM, cp.async, no TMA): every thread of the CTA issues 16-byte cp.async copies of its
 * share of a 32 KB tile (the tile of tma_kernel: 64 tokens of K and of V, 4 pages of one kv
 * head, or a contiguous run), nst stages, wait_group then a barrier; no arithmetic. Stream s =
 * CTA s. pf: the L2 prefetch size on each copy (0 none, 1 128 B, 2 256 B). Whether the load
 * path, not the access pattern, is what cuDNN's decode has over ours (4.70 against 4.54 TB/s
 * at B 32 L 64k, v5.18). */
__global__ void __launch_bounds__(128) cp_kernel(const char *p, const uint32_t *perm, int n_pages, int per, int nst,
                                                int contig, int pf, uint32_t *sink) {
  extern __shared__ __align__(1024) char smem[];
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
  const int s = blockIdx.x, kvh = s % 8;
  stamp_cta(0);
  auto issue = [&](int i) {
    const uint32_t st = base + (uint32_t)(i % nst) * TILE_B;
#pragma unroll /* m constant: the page of each copy folds to a shift (n_pages is a power of 2) */
    for (int m = 0; m < TILE_B / 16 / 128; m++) {
      const int off = (threadIdx.x + 128 * m) * 16, half = off / (TILE_B / 2), o = off % (TILE_B / 2);
      const char *src;
      if (contig) {
        src = p + (size_t)half * n_pages * 32768 + ((size_t)s * per + i) * (TILE_B / 2) + o;
      } else {
        const uint32_t k = ((uint32_t)(s / 8) * per + i) * 4 + o / 4096 & (n_pages - 1);
        const size_t pg = perm ? perm[k] : k;
        src = p + (pg * 256 + kvh * 16 + half * 128) * 256 + o % 4096;
      }
      if (pf == 0)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(st + off), "l"(src) : "memory");
      else if (pf == 1)
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(st + off), "l"(src) : "memory");
      else
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(st + off), "l"(src) : "memory");
    }
  };
  for (int i = 0; i < nst - 1 && i < per; i++) {
    issue(i);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  uint32_t x = 0;
  for (int i = 0; i < per; i++) {
    if (i + nst - 1 < per) issue(i + nst - 1);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    if (nst == 2) /* wait_group takes an immediate: tile i landed, nst - 1 younger groups in flight */
      asm volatile("cp.async.wait_group 1;\n" ::: "memory");
    else if (nst == 3)
      asm volatile("cp.async.wait_group 2;\n" ::: "memory");
    else
      asm volatile("cp.async.wait_group 3;\n" ::: "memory");
    __syncthreads();
    x ^= *reinterpret_cast<volatile uint32_t *>(smem + (size_t)(i % nst) * TILE_B + threadIdx.x * 4);
    __syncthreads();
  }
  if (x == 0x9e3779b9u) *sink = x;
  stamp_cta(1);
}

__global__ void copy_kernel(const uint4 *p, uint4 *q, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) q[i] = p[i];
}

#define CHECK(x)                                                           \
  do {                                                                     \
    cudaError_t e_ = (x);                                                  \
    if (e_ != cudaSuccess) {                                               \
      fprintf(stderr, "readbw: %s: %s\n", #x, cudaGetErrorString(e_));     \
      return 1;                                                            \
    }                                                                      \
  } while (0)

/* The best of five timed runs of launch() after one warm-up, ms; -1 (the error printed) if
 * a launch or an event failed. */
/* h[0, n) = 0 .. n - 1, shuffled by a fixed xorshift Fisher-Yates when shuffled. */
static void fill_order(uint32_t *h, size_t n, bool shuffled) {
  for (size_t i = 0; i < n; i++) h[i] = (uint32_t)i;
  uint64_t r = 0x9e3779b97f4a7c15ull;
  for (size_t i = n - 1; shuffled && i > 0; i--) {
    r ^= r << 13, r ^= r >> 7, r ^= r << 17;
    const size_t k = r % (i + 1);
    const uint32_t t = h[i];
    h[i] = h[k], h[k] = t;
  }
}

template <class F> float best_ms(cudaEvent_t e0, cudaEvent_t e1, F launch) {
  float best = 1e30f;
  for (int r = 0; r < 6; r++) {
    float ms = 0;
    cudaError_t e = cudaEventRecord(e0);
    if (e == cudaSuccess) launch(), e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaEventRecord(e1);
    if (e == cudaSuccess) e = cudaEventSynchronize(e1);
    if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, e0, e1);
    if (e != cudaSuccess) {
      fprintf(stderr, "readbw: a timed launch: %s\n", cudaGetErrorString(e));
      return -1;
    }
    if (r > 0 && ms < best) best = ms;
  }
  return best;
}

/* The CTAs' ends in the last launch of a stream kernel on `grid` CTAs, us from the first
 * start: first, median, last, and the last's lead over the first as a share of the step. */
static void print_ends(int grid) {
  static unsigned long long h[MAX_CTAS][2];
  if (grid > MAX_CTAS || cudaMemcpyFromSymbol(h, cta_time, sizeof(h)) != cudaSuccess) return;
  unsigned long long t0 = ~0ull;
  for (int i = 0; i < grid; i++) t0 = h[i][0] < t0 ? h[i][0] : t0;
  static double e[MAX_CTAS];
  for (int i = 0; i < grid; i++) e[i] = (h[i][1] - t0) / 1e3;
  std::sort(e, e + grid);
  printf("  CTA ends: first %.1f, median %.1f, last %.1f us (first at %.1f %% of the last)\n", e[0], e[grid / 2],
         e[grid - 1], 100 * e[0] / e[grid - 1]);
}

int main(int argc, char **argv) {
  /* `readbw big`: the stream forms only, over 8 GiB (a decode step of B 32 L 64k reads 8.6 GB
   * in ~1.9 ms; 2 GiB in ~0.48 ms leaves the launch's ramp and tail in the rate). */
  const bool release = argc > 1 && strcmp(argv[1], "release") == 0;
  const bool pages_mode = argc > 1 && strcmp(argv[1], "pages") == 0;
  const bool big = release || pages_mode || (argc > 1 && strcmp(argv[1], "big") == 0);
  const size_t bytes = (big ? 8ull : 2ull) << 30, n = bytes / 16;
  const int n_tiles = (int)(bytes / TILE_B);
  uint4 *p = nullptr, *q = nullptr;
  uint32_t *sink = nullptr;
  CHECK(cudaMalloc(&p, bytes));
  CHECK(cudaMalloc(&q, bytes / 2));
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMemset(p, 1, bytes));
  CHECK(cudaFuncSetAttribute(read_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
  CHECK(cudaFuncSetAttribute(chunk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  int nsm = 0;
  CHECK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("%s, %d SMs\n", prop.name, nsm);
  const int grids[] = {nsm, nsm - 4, 3 * nsm / 4, nsm / 2, nsm / 3, nsm / 4};
  for (int g : grids) {
    if (big && g < nsm - 4) break;
    const float best = best_ms(e0, e1, [&] { read_kernel<<<g, 1024, SMEM>>>(p, n, sink); });
    if (best < 0) return 1;
    printf("read, %3d SMs: %.3f ms, %.3f TB/s, %.1f GB/s an SM\n", g, best, bytes / best / 1e9, bytes / best / 1e6 / g);
  }
  for (int per_sm : {2, 4, 8}) {
    if (big) break;
    const int g = nsm * per_sm;
    const size_t len = n / (size_t)g;
    const float b4 = best_ms(e0, e1, [&] { slab_kernel<4><<<g, 256>>>(p, len, sink); });
    const float b8 = best_ms(e0, e1, [&] { slab_kernel<8><<<g, 256>>>(p, len, sink); });
    if (b4 < 0 || b8 < 0) return 1;
    const double moved = (double)len * g * 16;
    printf("slabs, %d x 256-thread CTAs a SM, 4 / 8 loads in flight a thread: %.3f / %.3f TB/s\n", per_sm,
           moved / b4 / 1e9, moved / b8 / 1e9);
  }
  if (!big) {
    const float best = best_ms(e0, e1, [&] { copy_kernel<<<nsm * 8, 256>>>(p, q, n / 2); });
    if (best < 0) return 1;
    printf("copy, 1 GiB read + 1 GiB written: %.3f ms, %.3f TB/s moved\n", best, bytes / best / 1e9);
  }
  /* Chunked reads: 4 KB (16-token pages), 16 KB (64-token pages), 64 KB; in order and at
   * shuffled places (a fixed xorshift Fisher-Yates), all SMs and the decode grid's 128. */
  for (int kb : {4, 16, 64}) {
    if (big) break;
    const int shift = __builtin_ctz((unsigned)kb * 1024 / 16);
    const size_t nchunk = bytes / ((size_t)kb * 1024);
    uint32_t *h = new uint32_t[nchunk];
    uint32_t *dperm = nullptr;
    CHECK(cudaMalloc(&dperm, nchunk * 4));
    for (int shuffled = 0; shuffled < 2; shuffled++) {
      fill_order(h, nchunk, shuffled);
      CHECK(cudaMemcpy(dperm, h, nchunk * 4, cudaMemcpyHostToDevice));
      for (int g : {nsm, 128}) {
        const int q = shift < 12 ? 1 << (12 - shift) : 1; /* whole rounds of the four loads */
        const int per = (int)(nchunk / g) / q * q;
        const float bestc = best_ms(e0, e1, [&] { chunk_kernel<<<g, 1024, SMEM>>>(p, dperm, per, shift, sink); });
        if (bestc < 0) return 1;
        const double moved = (double)per * g * kb * 1024;
        printf("chunks of %2d KB, %s, %3d SMs: %.3f ms, %.3f TB/s\n", kb, shuffled ? "shuffled" : "in order", g, bestc,
               moved / bestc / 1e9);
      }
    }
    if (kb == 4) { /* the same pages, by bulk copies into a ring (bulk_kernel) */
      CHECK(cudaFuncSetAttribute(bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 1024 + 6 * TILE_B));
      const int per = (int)(bytes / TILE_B / nsm);
      const double moved = (double)per * nsm * TILE_B;
      struct { int copy, shuffled, nst; } bv[] = {{2048, 1, 4}, {4096, 1, 4}, {4096, 0, 4}, {8192, 0, 4},
                                                  {32768, 0, 4}, {2048, 1, 6}, {4096, 1, 6}, {32768, 0, 6}};
      for (auto v : bv) {
        const uint32_t *pp = v.shuffled ? dperm : nullptr; /* dperm holds the shuffled 4 KB order */
        const float bb = best_ms(e0, e1, [&] {
          bulk_kernel<<<nsm, 64, 1024 + v.nst * TILE_B>>>(reinterpret_cast<const char *>(p), pp, per, v.copy, v.nst, sink);
        });
        if (bb < 0) return 1;
        printf("bulk copies of %2d KB, %s, %d x 32 KB stages, %d SMs: %.3f ms, %.3f TB/s\n", v.copy / 1024,
               v.shuffled ? "4 KB pages shuffled" : "in order", v.nst, nsm, bb, moved / bb / 1e9);
      }
    }
    CHECK(cudaFree(dperm));
    delete[] h;
  }
  /* The decode kernel's stream (tma_kernel): grids of 128 (the B 8 step's) and all SMs, one
   * ring of 4 stages or two pipes of 3 (the in-row decode form), pages in order and shuffled. */
  {
    void *fn = nullptr;
    cudaDriverEntryPointQueryResult qr;
    CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &qr));
    const int n_pages = (int)(bytes / 65536);
    CUtensorMap tm, tmn, tm3, tmc, tm8, tm32;
    const cuuint64_t dims[2] = {128, (cuuint64_t)n_pages * 256}, strides[1] = {256};
    const cuuint32_t box[2] = {64, 16}, estr[2] = {1, 1}, boxc[2] = {64, 64}, box8[2] = {64, 8}, box32[2] = {64, 32};
    /* The same pool as (64 columns, rows, 2 column blocks): a box of 16 rows takes both blocks. */
    const cuuint64_t dims3[3] = {64, (cuuint64_t)n_pages * 256, 2}, strides3[2] = {256, 128};
    const cuuint32_t box3[3] = {64, 16, 2}, estr3[3] = {1, 1, 1};
    auto encode = [&](CUtensorMap *m, int rank, const cuuint64_t *d, const cuuint64_t *st, const cuuint32_t *bx,
                      const cuuint32_t *es, CUtensorMapL2promotion promo) {
      return ((PFN_cuTensorMapEncodeTiled_v12000)fn)(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, p, d, st, bx, es,
                                                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promo,
                                                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
    };
    if (qr != cudaDriverEntryPointSuccess ||
        !encode(&tm, 2, dims, strides, box, estr, CU_TENSOR_MAP_L2_PROMOTION_L2_256B) ||
        !encode(&tmn, 2, dims, strides, box, estr, CU_TENSOR_MAP_L2_PROMOTION_NONE) ||
        !encode(&tm3, 3, dims3, strides3, box3, estr3, CU_TENSOR_MAP_L2_PROMOTION_L2_256B) ||
        !encode(&tmc, 2, dims, strides, boxc, estr, CU_TENSOR_MAP_L2_PROMOTION_NONE) ||
        !encode(&tm8, 2, dims, strides, box8, estr, CU_TENSOR_MAP_L2_PROMOTION_NONE) ||
        !encode(&tm32, 2, dims, strides, box32, estr, CU_TENSOR_MAP_L2_PROMOTION_NONE)) {
      fprintf(stderr, "readbw: no tensor map\n");
      return 1;
    }
    uint32_t *h = new uint32_t[n_pages], *dperm = nullptr;
    fill_order(h, (size_t)n_pages, true);
    CHECK(cudaMalloc(&dperm, (size_t)n_pages * 4));
    CHECK(cudaMemcpy(dperm, h, (size_t)n_pages * 4, cudaMemcpyHostToDevice));
    CHECK(cudaFuncSetAttribute(tma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 1024 + 6 * TILE_B));
    /* The in-row decode form's stream (128 CTAs x 2 rings of 3; a pipe cw consumer warps) over
     * the whole buffer: its best ms (-1: a failed launch, printed) and TB/s. */
    const int per2 = n_tiles / 256;
    const double moved2 = (double)per2 * 256 * TILE_B;
    auto pipes_ms = [&](const CUtensorMap &m, const uint32_t *pp, int np, int contig, int hold, int ef, int rel,
                        int hold_k, int ptok, int cw) {
      return best_ms(e0, e1, [&] {
        tma_kernel<<<128, 64 * (1 + cw), 1024 + 2 * 3 * TILE_B>>>(m, pp, np, per2, 3, 0, contig, hold, ef, sink, rel,
                                                                 hold_k, ptok, cw);
      });
    };
    /* release: the in-row decode form's stream (128 CTAs x 2 rings of 3, 2 KB boxes, no
     * promotion) under each release rule; hold ~1,700 cycles is the traced B 32 L 64k step's
     * busy time a tile slot (tile t's data to P V(t - 1) done, v5.20), hold_k ~400 its S. */
    struct { int rel, hold_k, hold; const char *what; } rv[] = {
        {0, 0, 0, "each stage at once"},
        {0, 0, 1700, "each stage 1700 cycles after it landed"},
        {1, 0, 0, "stage t - 1 once tile t landed (the kernel's rule, no work)"},
        {1, 0, 850, "stage t - 1 850 cycles after tile t landed"},
        {1, 0, 1700, "stage t - 1 1700 cycles after tile t landed (the kernel's rule, its busy time)"},
        {2, 400, 1700, "K(t) 400, V(t - 1) 1700 cycles after tile t landed (two barriers)"},
        {2, 0, 1700, "K(t) at once, V(t - 1) 1700 cycles after tile t landed (two barriers)"}};
    for (int shuffled = 0; release && shuffled < 2; shuffled++) {
      for (auto r : rv) {
        const float bt = pipes_ms(tmn, shuffled ? dperm : nullptr, n_pages, 0, r.hold, 0, r.rel, r.hold_k, 16, 1);
        if (bt < 0) return 1;
        printf("decode stream, %s, release %s: %.3f ms, %.3f TB/s\n", shuffled ? "pages shuffled" : "pages in order",
               r.what, bt, moved2 / bt / 1e9);
        print_ends(128);
      }
    }
    /* pages: the same stream over pages of 8 to 256 tokens (boxes of min(P, 64) rows: 32 to 4
     * a tile), as `detattn-bench --page P` lays out the pool, pages in order and shuffled,
     * each stage released at once and by the kernel's rule: whether the page size the kernel
     * pays for (NOTES v5.20: 8 -> 16 -> 64 -> 256 tokens faster) is the memory's. */
    for (int ptok : {8, 16, 32, 64, 256}) {
      if (!pages_mode) break;
      const int np = (int)(bytes / (4096ull * ptok));
      const CUtensorMap *m = ptok == 8 ? &tm8 : ptok == 16 ? &tmn : ptok == 32 ? &tm32 : &tmc;
      uint32_t *hp = new uint32_t[np], *dp = nullptr;
      fill_order(hp, (size_t)np, true);
      CHECK(cudaMalloc(&dp, (size_t)np * 4));
      CHECK(cudaMemcpy(dp, hp, (size_t)np * 4, cudaMemcpyHostToDevice));
      for (int shuffled = 0; shuffled < 2; shuffled++) {
        for (int rel = 0; rel < 2; rel++) {
          const float bt = pipes_ms(*m, shuffled ? dp : nullptr, np, 0, rel ? 1700 : 0, 0, rel, 0, ptok, 1);
          if (bt < 0) return 1;
          printf("decode stream, pages of %3d tokens (%2d boxes a tile), %s, release %s: %.3f ms, %.3f TB/s\n", ptok,
                 4 * 64 / (ptok < 64 ? ptok : 64), shuffled ? "shuffled" : "in order",
                 rel ? "by the kernel's rule (t - 1, 1700 cycles after t)" : "at once", bt, moved2 / bt / 1e9);
          print_ends(128);
        }
      }
      CHECK(cudaFree(dp));
      delete[] hp;
    }
    /* The same at 16 and 64 tokens in order with a consumer warpgroup a pipe (4 warps waiting
     * on each stage and arriving on its release, as the kernel's): whether small boxes cost
     * more when more warps poll the barrier their bytes complete on. */
    for (int ptok : {16, 64}) {
      if (!pages_mode) break;
      const int np = (int)(bytes / (4096ull * ptok));
      for (int cw : {1, 4}) {
        const float bt = pipes_ms(ptok == 16 ? tmn : tmc, nullptr, np, 0, 1700, 0, 1, 0, ptok, cw);
        if (bt < 0) return 1;
        printf("decode stream, pages of %3d tokens, in order, kernel's rule, %d consumer warp%s a pipe: %.3f ms, %.3f TB/s\n",
               ptok, cw, cw > 1 ? "s" : "", bt, moved2 / bt / 1e9);
      }
    }
    if (release || pages_mode) return 0;
    struct { int grid, pipes, nst; } tv[] = {{128, 1, 4}, {nsm, 1, 4}, {128, 1, 6}, {128, 2, 3}, {nsm, 2, 3}};
    /* Forms: 2 KB boxes with 256-byte L2 promotion, the same with none (the kernel's choice
     * per card, cuda_backend.c's l2_promo_env), 4 KB 3D boxes with 256, contiguous streams
     * (8 KB boxes, no promotion; no page order). */
    for (int form = 0; form < 4; form++) {
      if (big && (form == 0 || form == 2)) continue; /* big: no promotion, 2 KB boxes and contiguous */
      const int b3 = form == 2, contig = form == 3;
      for (int shuffled = 0; shuffled < 2 - contig; shuffled++) {
        for (auto v : tv) {
          if (big && v.pipes == 1) continue;
          const int per = n_tiles / (v.grid * v.pipes); /* contig: 64 per grid pipes <= half the rows */
          const double moved = (double)per * v.grid * v.pipes * TILE_B;
          const float bt = best_ms(e0, e1, [&] {
            tma_kernel<<<v.grid, 64 * v.pipes, 1024 + v.pipes * v.nst * TILE_B>>>(
                contig ? tmc : b3 ? tm3 : form == 1 ? tmn : tm, shuffled ? dperm : nullptr, n_pages, per, v.nst, b3, contig, 0, 0, sink);
          });
          if (bt < 0) return 1;
          printf("decode stream (TMA boxes of %s, L2 promotion %s), %s, %3d CTAs x %d ring%s of %d: %.3f ms, %.3f TB/s\n",
                 contig ? "8 KB" : b3 ? "4 KB" : "2 KB", form == 1 || contig ? "none" : "256",
                 contig ? "contiguous streams" : shuffled ? "pages shuffled" : "pages in order", v.grid, v.pipes,
                 v.pipes > 1 ? "s" : " ", v.nst, bt, moved / bt / 1e9);
          if (big) print_ends(v.grid);
        }
      }
    }
    /* The decode form's stream with evict_first loads, as the kernel loads K/V that exceed the
     * L2 (KVF): pages in order and shuffled, 128 CTAs x 2 rings of 3. */
    for (int shuffled = 0; shuffled < 2; shuffled++) {
      const float bt = pipes_ms(tmn, shuffled ? dperm : nullptr, n_pages, 0, 0, 1, 0, 0, 16, 1);
      if (bt < 0) return 1;
      printf("decode stream, evict_first loads, %s, 128 CTAs x 2 rings of 3: %.3f ms, %.3f TB/s\n",
             shuffled ? "pages shuffled" : "pages in order", bt, moved2 / bt / 1e9);
    }
    /* The decode form's stream (2 KB boxes, no promotion, 128 CTAs x 2 rings of 3) with the
     * consumer holding each stage, pages in order and shuffled, and contiguous streams. */
    for (int hold : {0, 750, 1500, 3000}) {
      if (big) break;
      for (int form = 0; form < 3; form++) { /* in order, shuffled, contiguous */
        const float bt = pipes_ms(form == 2 ? tmc : tmn, form == 1 ? dperm : nullptr, n_pages, form == 2, hold, 0, 0, 0,
                                  16, 1);
        if (bt < 0) return 1;
        printf("decode stream, consumer holding a stage %4d cycles, %s, 128 CTAs x 2 rings of 3: %.3f ms, %.3f TB/s\n", hold,
               form == 2 ? "contiguous streams" : form == 1 ? "pages shuffled" : "pages in order", bt, moved2 / bt / 1e9);
      }
    }
    /* cuDNN's load path (cp_kernel): two CTAs an SM (256 on 128 SMs: B 32's streams, and 2 an
     * SM on every SM), 2-4 stages (nst 4 is one CTA an SM's worth of shared memory: 128 KB). */
    for (int pf = 0; pf < (big ? 1 : 3); pf++) {
      for (int form = 0; form < 3; form++) { /* contiguous, in order, shuffled */
        for (int g : {256, 2 * nsm}) {
          for (int nst : {2, 3, 4}) {
            if (g != 256 && nst != 3) continue;
            const int per = n_tiles / g;
            const double moved = (double)per * g * TILE_B;
            CHECK(cudaFuncSetAttribute(cp_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * TILE_B));
            const float bt = best_ms(e0, e1, [&] {
              cp_kernel<<<g, 128, nst * TILE_B>>>(reinterpret_cast<const char *>(p), form == 2 ? dperm : nullptr, n_pages,
                                                  per, nst, form == 0, pf, sink);
            });
            if (bt < 0) return 1;
            printf("cp.async stream (L2 prefetch %s), %s, %3d CTAs of 128 x %d stages: %.3f ms, %.3f TB/s\n",
                   pf == 0 ? "none" : pf == 1 ? "128" : "256",
                   form == 0 ? "contiguous streams" : form == 2 ? "pages shuffled" : "pages in order", g, nst, bt,
                   moved / bt / 1e9);
            if (big && nst == 3) print_ends(g);
          }
        }
      }
    }
    CHECK(cudaFree(dperm));
    delete[] h;
  }
  CHECK(cudaGetLastError());
  return 0;
}
