/*
 * cuda_kernels.h — the C interface of the CUDA kernels (the .cu files in kernels/cuda): plain structs
 * that describe one batch on the device, and one extern "C" launcher per .cu file. The
 * launchers only enqueue work on the given stream and return the launch status
 * (cudaError_t as int, 0 on success); they never allocate or synchronise.
 *
 * KV pool layout (elements of the model dtype), page-major so that a page copy is one
 * contiguous block and a (page, layer, K|V, kv head) slab holds page_tokens rows of
 * head_dim contiguous elements:
 *   kv[page][layer][2 (K, V)][n_kv_heads][page_tokens][head_dim]
 * Accumulator pool: acc_o[slot][head_dim] fp32 and acc_lse[slot] fp32 (log2 domain).
 *
 * Rows: an attention item of n_q query tokens has n_q * n_q_heads rows. For one kv head,
 * its G = n_q_heads / n_kv_heads q heads and the tokens are packed as the linear row index
 * r = t * G + g (q head kvh * G + g); a CTA takes DA_CU_BLOCK_ROWS consecutive rows.
 */
#ifndef DA_CUDA_KERNELS_H
#define DA_CUDA_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "item.h"

#ifdef __cplusplus
extern "C" {
#endif

/* T: keys per tile, da_cu_args.tile_tokens: DA_CU_TILE or DA_CU_TILE_MAX (head_dim <= 128) */
#define DA_CU_TILE 64
#define DA_CU_TILE_MAX 128
#define DA_CU_BLOCK_ROWS 64 /* rows per CTA: 4 warps x 16 rows */
/* rows per CTA of prefill_sm90.cu: 3 consumer warpgroups x 64 rows at head_dim 64 and T 64,
 * else 2 */
#define DA_CU_SM90_BLOCK_ROWS(d, t) ((d) == 64 && (t) == 64 ? 192 : 128)
#define DA_CU_COMBINE_ROWS 1 /* rows per combine CTA */

/* One attention request of the batch. Offsets are in elements of their buffer. */
typedef struct da_cu_attn {
  int32_t layer, q_pos, n_q, n_pages;
  int64_t pt_off;    /* page k's id at da_cu_args.pages[pt_off + k]; only the window's pages,
                      * from (q_pos - window + 1) / page_tokens, are packed, so pt_off may be
                      * negative */
  int64_t q_off;     /* q: [n_q][n_q_heads][head_dim] at q + q_off */
  void *o;           /* o: same shape, in the output staging buffer or a device-address tensor
                      * of the client's (16-byte aligned) */
  float *lse;        /* lse: [n_q][n_q_heads] the same way, or NULL */
  int64_t slot_base; /* partial mode: slot of (t, h, j) = slot_base + (t*Hq + h)*n_splits + j; -1: in-row */
  int32_t n_splits;  /* splits covering [0, q_pos + n_q) */
  int32_t pad_;
} da_cu_attn;

/* One CTA of the combine kernel: row row0 of attn, linear over (t, q head). The row's first
 * split's slot holds the fold of its splits before jc (a prefix item's, da_cu_item) or of
 * that split alone (jc 0 or at most that split + 1); the combine merges splits from
 * max(jc, first + 1) on. */
typedef struct da_cu_citem {
  int32_t attn, row0, jc, pad_;
} da_cu_citem;

/* One append: n_tokens tokens at [pos, pos + n_tokens) of layer. */
typedef struct da_cu_append {
  int32_t layer, pos, n_tokens, pad_;
  int64_t pt_off; /* position pos's page id at da_cu_args.pages[pt_off + pos / page_tokens];
                   * only the appended pages are packed, so pt_off may be negative */
  const void *k;  /* k: [n_tokens][n_kv_heads][head_dim], 16-byte aligned: the staging buffer's
                   * (da_cu_args.kvin) or a device-address tensor of the client's; v the same */
  const void *v;
} da_cu_append;

typedef struct da_cu_args {
  void *kv;                 /* KV pool */
  float *acc_o, *acc_lse;   /* accumulator pool */
  const int32_t *pages;     /* all page tables of the batch */
  const da_cu_attn *attns;
  const da_cu_item *items;
  const da_cu_citem *citems;
  const da_cu_append *appends;
  const void *q;            /* staged queries */
  const void *kvin;         /* staged appended K/V */
  int n_items, n_citems, n_appends, max_append_tokens;
  int n_split_items; /* the last n_split_items items have blocks of <= 16 rows */
  int n_layers, n_q_heads, n_kv_heads, head_dim, page_tokens, page_shift;
  int split_tokens, window, bf16;
  float scale_log2;   /* scale * log2(e); used without softcap */
  float cap_in;       /* scale / softcap */
  float cap_out_log2; /* softcap * log2(e) */
  float exp_c;        /* the scores' factor in the exponent: scale_log2, or 1 with softcap */
  int softcap;        /* non-zero: score = softcap * tanh(scale * qk / softcap) */
  int has_inrow;      /* some items fold splits in-row (needs the fold buffer) */
  int stages;         /* set by the attention launcher: K/V pipeline depth */
  int n_pool_pages;   /* pages in the KV pool (prefill_sm90.cu's tensor map spans it) */
  int n_sm;           /* CTAs of prefill_sm90.cu's persistent grid: the device's SMs */
  int tile_tokens;    /* T: DA_CU_TILE, or DA_CU_TILE_MAX where head_dim <= 128 */
  int combine_splits; /* the most splits a partial row has (combine.cu spreads long rows' CTAs) */
  int combine_short;  /* every partial row is short: combine.cu folds a row a warp (combine_short_kernel) */
  int kv_stream;      /* the launch's K/V exceed the L2: prefill_sm90.cu loads a decode-only
                         launch's K/V (no other item reads them) as evict_first, so they leave
                         the L2 to the partials; combine.cu drops a row's o_j from the L2 once
                         folded */
  int l2_promo;       /* the L2 promotion of prefill_sm90.cu's K/V loads, bytes: 0 (none) or 256
                         (cuda_backend.c chooses it per card, DA_CUDA_L2_PROMO) */
  /* prefill_sm90.cu's dynamic dealing: {next ticket, pipes done}, 0 between launches (the
   * last pipe out resets them); NULL: items round-robin. The launcher ignores it where every
   * pipe has one item or fewer. */
  int *ticket;
  int64_t q_tokens; /* tokens of the staged queries (q: [q_tokens][n_q_heads][head_dim]); 0: prefill_sm90.cu's
                       consumers load Q themselves instead of its producer by TMA (DA_CUDA_SM90_QTMA=0) */
} da_cu_args;

/* attn.cu: the attention kernel over a->items (in-row items write o/lse, partial items
 * write accumulator slots). Dynamic shared memory is set up by the launcher. */
int da_cuda_attn(const da_cu_args *a, cudaStream_t stream);
/* prefill_sm90.cu (sm_90a builds only; head_dim 64 and 128): the same attention as
 * da_cuda_attn for the items before the last n_split_items, on wgmma fed by TMA, with items
 * of DA_CU_SM90_BLOCK_ROWS rows (the backend plans them so); the last n_split_items (decode
 * blocks of at most 16 rows) are left to da_cuda_attn, or the backend passes 0 and the
 * decode blocks run here too (only their rows' MMAs count). Same per-row arithmetic; equal
 * bits because wgmma and mma.sync give equal fp32 bits (tests/cuda/test_mma_bits.cu).
 * variant: how the consumer warpgroups schedule their MMAs (same bits in all):
 * DA_CU_SM90_SERIAL (S, softmax, P.V one after the other),
 * DA_CU_SM90_PIPELINED (the next tile's S and this tile's P.V run under the softmax),
 * DA_CU_SM90_PINGPONG (pipelined, and the warpgroups take turns issuing MMAs). A
 * persistent grid (one CTA per SM walking the items: round-robin, or by ticket with
 * a->ticket) unless DA_CU_SM90_PER_ITEM is or'ed in.
 * Launched as a programmatic dependent of the kernel before it in the stream (pdl.cuh): its
 * prologue runs while that kernel finishes; it reads K/V and Q and writes only after. */
#define DA_CU_SM90_HEAD_DIM_OK(d) ((d) == 64 || (d) == 128)
#define DA_CU_SM90_SERIAL 1
#define DA_CU_SM90_PIPELINED 2
#define DA_CU_SM90_PINGPONG 3
#define DA_CU_SM90_PER_ITEM 0x10 /* or'ed into variant: one CTA per item instead of a persistent grid */
/* or'ed into variant where every item has at most 64 rows (decode): each CTA runs
 * DA_CU_SM90_N_PIPES independent pipelines (a producer warp, a consumer warpgroup and a
 * share of the K/V stages each), taking items b * N + w, stepping gridDim.x * N; with
 * DA_CU_SM90_PER_ITEM, N items a CTA. On a persistent grid only where the items outnumber
 * the CTAs (else one item a CTA). Same bits. */
#define DA_CU_SM90_PIPES 0x20
#define DA_CU_SM90_N_PIPES 2
int da_cuda_prefill_sm90(const da_cu_args *a, int variant, cudaStream_t stream);
/* combine.cu: folds the partial slots of a->citems' rows into o/lse. */
int da_cuda_combine(const da_cu_args *a, cudaStream_t stream);
/* segcopy.cu: copies n segments (a device array) of at most max_bytes each, in one launch.
 * Segments must not overlap each other's destinations. */
#define DA_CU_SEG_CHUNK 32768 /* bytes per CTA */
typedef struct da_cu_seg {
  const void *src;
  void *dst;
  int64_t bytes;
} da_cu_seg;
int da_cuda_segcopy(const da_cu_seg *segs, int n, int64_t max_bytes, cudaStream_t stream);
/* append.cu: writes a->appends' K/V into the pool through their page tables and, in the same
 * launch, copies the n_segs segments of segs (at most seg_max bytes each; device memory): the
 * batch's query gathers. n_appends + n_segs at most 65535. */
int da_cuda_append(const da_cu_args *a, const da_cu_seg *segs, int n_segs, int64_t seg_max, cudaStream_t stream);
/* pagecopy.cu: copies n whole pages pool[dst[i]] = pool[src[i]] (i independent);
 * pairs: device array of (src, dst) int32. */
int da_cuda_page_copy(void *kv, int64_t page_bytes, const int32_t *pairs, int n,
                      cudaStream_t stream);
/* fill.cu: mode 0 writes NaN (all-ones bits) to n 32-bit words at dst; mode 1 writes n
 * 16-bit values of the dtype (bf16 if bf16 != 0, else fp16) drawn from a hash of
 * (seed, index), roughly N(0, 1) (benchmarks). */
int da_cuda_fill(void *dst, size_t n, int mode, int bf16, uint64_t seed, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* DA_CUDA_KERNELS_H */
