/*
 * cuda_backend.h — benchmark hooks of the CUDA backend (clients/bench only). The backend
 * itself is reached through da_cuda_backend_ops (kernels/backend.h); these functions take
 * the ctx that da_cuda_backend_ops.create returned. Not thread-safe; one caller.
 */
#ifndef DA_CUDA_BACKEND_H
#define DA_CUDA_BACKEND_H

#include <stdint.h>

#include "backend.h"

/* Fills the whole KV pool on the device with values from seed (no host transfer). */
int da_cuda_bench_fill_kv(void *ctx, uint64_t seed);

/*
 * Stages batch b (attns only; an attn with q == NULL gets queries filled on the device from
 * q_seed; o and lse are not copied back) and builds its work list in b->split_mode, with
 * split size split_tokens (0: the configured S; another multiple of the tile gives the
 * occupancy-chosen comparison mode, bench only). Nothing runs yet.
 */
int da_cuda_bench_prepare(void *ctx, const da_batch *b, int split_tokens, uint64_t q_seed,
                          da_batch_result *res);

/* Times of a prepared batch (da_cuda_bench_time), ms. */
typedef struct da_cuda_times {
  double step_ms; /* a step (attention, then the combine as a programmatic dependent, as in a
                   * real step): iters steps captured in one CUDA graph and launched at once,
                   * so no host launch is inside (sdpa_peer.py times the peers the same way);
                   * without graph capture, iters steps launched back to back */
  double attn_ms; /* the attention alone, the same way */
  double lat_ms;  /* one step from an idle stream (events around each), host launch included */
  int graph;      /* 1: step_ms and attn_ms come from graphs */
  int n_sm;       /* the device's SM count */
} da_cuda_times;

/* Replays the prepared attention and combine kernels: steps for at least warm_ms of GPU time,
 * then the timings of da_cuda_times over iters steps each. */
int da_cuda_bench_time(void *ctx, int warm_ms, int iters, da_cuda_times *t);

/* Non-zero when blocks of more than 16 rows run on the sm_90a wgmma kernel (prefill_sm90.cu):
 * the DA_CU_SM90_* variant (1 serial, 2 pipelined, 3 pipelined + ping-pong), from
 * DA_CUDA_PREFILL at create or the backend's default; only when the build has sm_90a kernels,
 * the device is sm_90 and head_dim is 64 or 128. 0: every block runs on attn.cu. */
int da_cuda_prefill_path(void *ctx);

#endif /* DA_CUDA_BACKEND_H */
