/*
 * bench_kvcache.c — the cost of the KV cache's bookkeeping per call (host only, no K/V
 * data): decode appends, prefill appends, fork + close, copy-on-write after fork, truncate.
 * Config: 32 layers, 16-token pages, 65536 pages, 256 sequences of up to 32768 tokens.
 * Prints a markdown table. Usage: bench_kvcache [repeats]   (default 5; the best is shown)
 */
#include <stdio.h>
#include <stdlib.h>

#include "kvcache.h"

enum { LAYERS = 32, PT = 16, SEQS = 128, PREFIX = 1024, DECODE_STEPS = 256, FORK_TOKENS = 4096 };

static da_page_copy copies[4096 / PT + 2];

static void must(int rv, const da_kvcache *kv, const char *what) {
  if (rv != 0) {
    fprintf(stderr, "bench_kvcache: %s: %s: %s\n", what, detattn_status_name(rv), da_kvcache_errmsg(kv));
    exit(1);
  }
}

static void append_layers(da_kvcache *kv, uint32_t s, int pos, int n) {
  int nc;
  for (int l = 0; l < LAYERS; l++) must(da_kvcache_append(kv, s, l, pos, n, copies, n / PT + 2, &nc), kv, "append");
}

typedef struct result {
  double decode_ns, prefill_ns, fork_ns, cow_ns, trunc_ns;
} result;

static void run_once(result *r) {
  da_kvcache_cfg cfg = {.n_layers = LAYERS, .page_tokens = PT, .n_pages = 65536, .max_seqs = 256, .max_seq_tokens = 32768};
  da_kvcache *kv;
  must(da_kvcache_alloc(&kv, &cfg), NULL, "alloc");
  uint32_t seq[SEQS];

  /* Prefill: 512-token chunks, every layer. */
  uint64_t t0 = da_now_ns();
  for (int i = 0; i < SEQS; i++) {
    must(da_kvcache_open(kv, &seq[i]), kv, "open");
    for (int pos = 0; pos < PREFIX; pos += 512) append_layers(kv, seq[i], pos, 512);
  }
  r->prefill_ns = (double)(da_now_ns() - t0) / (SEQS * (PREFIX / 512) * LAYERS);

  /* Decode: one token per sequence per layer per step. */
  t0 = da_now_ns();
  for (int step = 0; step < DECODE_STEPS; step++)
    for (int i = 0; i < SEQS; i++) append_layers(kv, seq[i], PREFIX + step, 1);
  r->decode_ns = (double)(da_now_ns() - t0) / ((double)DECODE_STEPS * SEQS * LAYERS);
  for (int i = 0; i < SEQS; i++) must(da_kvcache_close(kv, seq[i]), kv, "close");

  /* Fork of a 4096-token sequence (256 pages) and close of the fork. */
  uint32_t src, f;
  must(da_kvcache_open(kv, &src), kv, "open");
  for (int pos = 0; pos < FORK_TOKENS - 8; pos += 512)
    append_layers(kv, src, pos, pos + 512 <= FORK_TOKENS - 8 ? 512 : FORK_TOKENS - 8 - pos);
  const int forks = 2000;
  t0 = da_now_ns();
  for (int i = 0; i < forks; i++) {
    must(da_kvcache_fork(kv, src, &f), kv, "fork");
    must(da_kvcache_close(kv, f), kv, "close");
  }
  r->fork_ns = (double)(da_now_ns() - t0) / forks;

  /* First decode append after a fork (copies the shared partial page), all layers. */
  t0 = da_now_ns();
  for (int i = 0; i < forks; i++) {
    must(da_kvcache_fork(kv, src, &f), kv, "fork");
    append_layers(kv, f, FORK_TOKENS - 8, 1);
    must(da_kvcache_close(kv, f), kv, "close");
  }
  r->cow_ns = (double)(da_now_ns() - t0) / forks - r->fork_ns;

  /* Truncate by 64 tokens and re-append them (speculative-decoding rollback). */
  t0 = da_now_ns();
  for (int i = 0; i < forks; i++) {
    must(da_kvcache_truncate(kv, src, FORK_TOKENS - 72), kv, "truncate");
    append_layers(kv, src, FORK_TOKENS - 72, 64);
  }
  r->trunc_ns = (double)(da_now_ns() - t0) / forks;
  must(da_kvcache_close(kv, src), kv, "close");
  if (da_kvcache_pages_free(kv) != da_kvcache_pages_total(kv)) {
    fprintf(stderr, "bench_kvcache: pages leaked\n");
    exit(1);
  }
  da_kvcache_free(kv);
}

int main(int argc, char **argv) {
  int repeats = argc > 1 ? atoi(argv[1]) : 5;
  if (repeats < 1) repeats = 1;
  result best = {1e30, 1e30, 1e30, 1e30, 1e30}, r;
  for (int i = 0; i < repeats; i++) {
    run_once(&r);
    if (r.decode_ns < best.decode_ns) best.decode_ns = r.decode_ns;
    if (r.prefill_ns < best.prefill_ns) best.prefill_ns = r.prefill_ns;
    if (r.fork_ns < best.fork_ns) best.fork_ns = r.fork_ns;
    if (r.cow_ns < best.cow_ns) best.cow_ns = r.cow_ns;
    if (r.trunc_ns < best.trunc_ns) best.trunc_ns = r.trunc_ns;
  }
  printf("| operation (32 layers, 16-token pages) | ns (best of %d) |\n|---|---:|\n", repeats);
  printf("| append 1 token, one layer (decode) | %.1f |\n", best.decode_ns);
  printf("| append 512 tokens, one layer (prefill chunk) | %.1f |\n", best.prefill_ns);
  printf("| fork + close of a 4088-token sequence (256 pages) | %.1f |\n", best.fork_ns);
  printf("| first decode step after fork, 32 layers (1 page copy) | %.1f |\n", best.cow_ns);
  printf("| truncate 64 tokens + re-append them, 32 layers | %.1f |\n", best.trunc_ns);
  return 0;
}
