/*
 * bench_backend_async.c — what overlapping staging with kernels buys: the same stream of
 * batches through a backend one at a time with da_backend_run, and pipelined two in flight
 * with da_backend_submit / da_backend_finish (kernels/backend.h). Wall time per batch,
 * host to host (packing, copies, kernels, unpacking), median of rounds.
 *
 * Model: 4 layers, 32 q / 8 kv heads, head_dim 128, bf16, pages of 16, S 256, T 64.
 * Workloads: prefill chunks (appends + queries of 512 tokens on 8 sequences) and decode
 * (one token on each of 64 sequences with 4096 tokens of context). Inputs are seeded random;
 * the cache content does not change the kernels' time.
 *
 * Usage: bench_backend_async [cuda|cpu] [batches per round, default 40]
 * Prints a markdown table on stdout.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "testutil.h"

#define ROUNDS 5

typedef struct workload {
  const char *name;
  int n_seqs, n_tokens, ctx; /* tokens per sequence per batch; context before them */
} workload;

static const workload workloads[] = {
    {"prefill 8 x 512", 8, 512, 0},
    {"decode 64 x 1, ctx 4096", 64, 1, 4095},
};

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* ms per batch over n batches: pipelined through submit/finish, or one at a time. */
static int time_batches(da_backend *be, const da_batch *b, int n, int pipelined, double *ms) {
  da_batch_result res;
  uint64_t t0 = da_now_ns();
  for (int i = 0; i < n; i++) {
    int rv;
    if (!pipelined) {
      rv = da_backend_run(be, b, &res);
    } else {
      rv = da_backend_submit(be, b, NULL, NULL, &res);
      if (rv == 0 && da_backend_inflight(be) == DA_BACKEND_MAX_INFLIGHT) rv = da_backend_finish(be, &res);
    }
    if (rv != 0) {
      fprintf(stderr, "batch %d: %s (%s)\n", i, res.err, detattn_status_name(rv));
      return rv;
    }
  }
  while (da_backend_inflight(be) > 0) {
    int rv = da_backend_finish(be, &res);
    if (rv != 0) {
      fprintf(stderr, "finish: %s (%s)\n", res.err, detattn_status_name(rv));
      return rv;
    }
  }
  *ms = (double)(da_now_ns() - t0) / 1e6 / n;
  return 0;
}

static int bench(const char *backend, const workload *w, int n_batches) {
  const da_model m = {.n_layers = 4, .n_q_heads = 32, .n_kv_heads = 8, .head_dim = 128, .dtype = DA_BF16,
                      .scale = 0.08838834764831845f};
  const int P = 16, per_seq = (w->ctx + w->n_tokens + P - 1) / P;
  da_backend_cfg cfg = {.model = m, .num = {.split_tokens = 256, .tile_tokens = 64}, .page_tokens = P,
                        .n_pages = w->n_seqs * per_seq, .staging_bytes = (size_t)128 << 20};
  da_backend *be = NULL;
  char err[256];
  int rv = da_backend_open(&be, backend, &cfg, err, sizeof err);
  if (rv != 0) {
    fprintf(stderr, "open %s: %s\n", backend, err);
    return rv;
  }
  da_rng r;
  da_rng_seed(&r, 0xbe4c);
  const size_t qn = (size_t)w->n_tokens * m.n_q_heads * m.head_dim, kn = (size_t)w->n_tokens * m.n_kv_heads * m.head_dim;
  int32_t *pages = malloc(sizeof(int32_t) * cfg.n_pages);
  da_append *app = calloc(w->n_seqs, sizeof *app);
  da_attn *att = calloc(w->n_seqs, sizeof *att);
  void **bufs = calloc((size_t)w->n_seqs * 4, sizeof(void *));
  int ok = pages && app && att && bufs;
  for (int i = 0; ok && i < cfg.n_pages; i++) pages[i] = i;
  for (int s = 0; ok && s < w->n_seqs; s++) {
    void **x = bufs + 4 * s;
    x[0] = da_test_random_tensor(&r, DA_BF16, qn, 1.0);
    x[1] = da_test_random_tensor(&r, DA_BF16, kn, 1.0);
    x[2] = da_test_random_tensor(&r, DA_BF16, kn, 1.0);
    x[3] = malloc(qn * 2);
    ok = x[0] && x[1] && x[2] && x[3];
    if (!ok) break;
    app[s] = (da_append){.layer = s % m.n_layers, .pos = w->ctx, .n_tokens = w->n_tokens, .pages = pages + s * per_seq,
                         .n_pages = per_seq, .k = x[1], .v = x[2]};
    att[s] = (da_attn){.layer = s % m.n_layers, .q_pos = w->ctx, .n_q = w->n_tokens, .pages = pages + s * per_seq,
                       .n_pages = per_seq, .q = x[0], .o = x[3]};
  }
  if (!ok) {
    fprintf(stderr, "out of host memory\n");
    rv = DETATTN_RESOURCE_EXHAUSTED;
    goto done;
  }
  da_batch b = {.appends = app, .n_appends = w->n_seqs, .attns = att, .n_attns = w->n_seqs};
  double t_run[ROUNDS], t_pipe[ROUNDS], warm;
  if ((rv = time_batches(be, &b, 3, 0, &warm)) != 0 || (rv = time_batches(be, &b, 3, 1, &warm)) != 0) goto done;
  for (int k = 0; k < ROUNDS; k++) {
    if ((rv = time_batches(be, &b, n_batches, 0, &t_run[k])) != 0) goto done;
    if ((rv = time_batches(be, &b, n_batches, 1, &t_pipe[k])) != 0) goto done;
  }
  qsort(t_run, ROUNDS, sizeof(double), cmp_double);
  qsort(t_pipe, ROUNDS, sizeof(double), cmp_double);
  const double a = t_run[ROUNDS / 2], p = t_pipe[ROUNDS / 2];
  const int tok = w->n_seqs * w->n_tokens;
  printf("| %s | %s | %d | %.3f | %.3f | %.2fx | %.0f |\n", backend, w->name, tok, a, p, a / p, tok / p * 1e3);
done:
  for (int s = 0; bufs && s < w->n_seqs * 4; s++) free(bufs[s]);
  free(bufs), free(att), free(app), free(pages);
  da_backend_close(be);
  return rv;
}

int main(int argc, char **argv) {
  const char *backend = argc > 1 ? argv[1] : "cuda";
  int n = argc > 2 ? atoi(argv[2]) : 40;
  if (n < 1) {
    fprintf(stderr, "usage: %s [cuda|cpu] [batches per round >= 1]\n", argv[0]);
    return 2;
  }
  printf("| backend | workload | tokens/batch | run() ms/batch | submit/finish ms/batch | speedup | tokens/s pipelined |\n");
  printf("|---|---|---|---|---|---|---|\n");
  for (size_t i = 0; i < sizeof(workloads) / sizeof(workloads[0]); i++)
    if (bench(backend, &workloads[i], n) != 0) return 1;
  return 0;
}
