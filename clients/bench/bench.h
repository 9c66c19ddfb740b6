/*
 * bench.h — detattn-bench, the kernel benchmark: a table of attention shapes (decode and
 * prefill at a small default model) timed on a backend after warm-up.
 *
 * bench_backend_path (bench.c) drives any backend through kernels/backend.h, so it times
 * what the daemon's worker sees: appends, attention and, on device backends, staging
 * copies. In CUDA builds bench_cuda.c adds da_bench_cuda, the CUDA kernel benchmark
 * (kernels timed with CUDA events, inputs already on the device, its own shape table and
 * CSV output): `detattn-bench --backend cuda [its options]` runs it, and
 * `--backend cuda --generic` runs the CUDA backend through bench_backend_path instead.
 */
#ifndef DA_BENCH_H
#define DA_BENCH_H

#include "backend.h"

typedef struct bench_opts {
  const char *backend; /* "cpu", "cuda", "auto" */
  da_model model;
  da_numerics num;
  int page_tokens;
  int n_threads;    /* CPU: 0 = all online CPUs */
  da_split_mode split_mode;
  double min_seconds; /* time each shape at least this long after warm-up */
  int min_reps, max_reps;
  uint64_t seed;
} bench_opts;

/* decode: batch sequences with ctx tokens cached, one new token each (append + attend at
 * position ctx - 1). prefill: batch sequences of ctx tokens, appended and attended at once. */
typedef enum bench_kind { BENCH_DECODE = 0, BENCH_PREFILL = 1 } bench_kind;

typedef struct bench_shape {
  bench_kind kind;
  int batch;
  int ctx;
} bench_shape;

typedef struct bench_result {
  double ms;          /* median time per batch */
  double ms_min;
  int reps;
  double tokens_per_s; /* query tokens per second */
  double kv_gbps;     /* K/V bytes of the attended context (each counted once) per second */
  double gflops;      /* 4 * d * (q.k pairs) per second: q.k and p.v, 2 flops per MAC */
  int64_t inrow_rows, partial_rows; /* from the last timed batch */
  char err[256];
} bench_result;

/* Runs one shape on any backend through da_backend_open(o->backend); 0 or a DETATTN_*
 * status with a message in out->err. */
int bench_backend_path(const bench_opts *o, const bench_shape *s, bench_result *out);

#if defined(DETATTN_HAVE_CUDA) && defined(DETATTN_BENCH_CUDA)
/* The CUDA kernel benchmark (bench_cuda.c); takes its own options, returns an exit code. */
int da_bench_cuda(int argc, char **argv);
#endif

/* --split-mode's value (auto, inrow or partial) into *out; -1 for anything else. */
int bench_parse_split_mode(const char *s, da_split_mode *out);

/* Fills the derived rates of r from its ms and the shape. */
void bench_rates(const bench_opts *o, const bench_shape *s, bench_result *r);

#endif /* DA_BENCH_H */
