/*
 * workload.h — the seeded workload of detattn-load: which sequences exist, how long their
 * prompts and outputs are, what their q/k/v inputs are, and when they arrive.
 *
 * Everything about sequence i (its lengths and every input bit) is a pure function of
 * (seed, i) and, for inputs, (layer, position): two runs with the same seed feed the daemon
 * identical bits whatever the timing, the concurrency or the order of the calls. Arrival
 * times come from a separate stream of the same seed and change only the timing.
 */
#ifndef DA_WORKLOAD_H
#define DA_WORKLOAD_H

#include <stddef.h>
#include <stdint.h>

#include "da.h"

typedef enum da_len_kind { DA_LEN_FIXED = 0, DA_LEN_UNIFORM = 1 } da_len_kind;

/* A length distribution: fixed lo, or uniform in [lo, hi]. */
typedef struct da_len_dist {
  da_len_kind kind;
  uint32_t lo, hi;
} da_len_dist;

/* Parses "N" (fixed) or "LO:HI" (uniform, LO <= HI), N, LO >= 1. On error returns
 * DETATTN_INVALID_ARGUMENT with a message in msg. */
int da_len_parse(const char *s, da_len_dist *out, char *msg, size_t msglen);

typedef struct da_trace_entry {
  uint32_t prompt, output;
} da_trace_entry;

typedef struct da_workload {
  uint64_t seed;
  da_len_dist prompt, output;   /* used when n_trace == 0 */
  da_trace_entry *trace;        /* owned; sequence i uses trace[i % n_trace] */
  size_t n_trace;
  /* Model shape, from the daemon's hello. */
  uint32_t n_layers, n_q_heads, n_kv_heads, head_dim;
  da_dtype dtype;
} da_workload;

/* Loads a trace CSV: one "prompt,output" pair of positive integers per line; blank lines,
 * lines starting with '#', and a first line that is not numeric (a header) are skipped.
 * On success *out (malloc'd, caller frees) holds *n >= 1 entries. Errors: NOT_FOUND (cannot
 * open), INVALID_ARGUMENT (names the line), with a message in msg. */
int da_trace_load(const char *path, da_trace_entry **out, size_t *n, char *msg, size_t msglen);

/* Sequence i's prompt length (>= 1) and output length (>= 1). Prefill computes the prompt
 * and yields the first output token; then output - 1 decode steps follow, so the sequence
 * has prompt + output - 1 positions with an output row. */
void da_workload_lengths(const da_workload *w, uint64_t i, uint32_t *prompt, uint32_t *output);

/* The inputs of sequence i, layer `layer`, positions [pos, pos + n):
 * q: [n][n_q_heads][head_dim], k, v: [n][n_kv_heads][head_dim], unit-variance uniform
 * values in the model dtype, each token's rows drawn from a generator seeded by (seed, i, layer, pos). */
void da_workload_inputs(const da_workload *w, uint64_t i, uint32_t layer, uint32_t pos,
                        uint32_t n, void *q, void *k, void *v);

/* A short text that identifies the workload's content (seed, lengths or trace hash, model
 * shape); two runs with equal descriptions feed equal bits. */
void da_workload_describe(const da_workload *w, char *buf, size_t len);

/* Arrivals for open-loop runs: inter-arrival gaps from a gamma distribution with shape
 * `burstiness` (1: Poisson) and mean 1 / rate seconds. */
typedef struct da_arrivals {
  da_rng rng;
  double rate, burstiness;
  double t; /* seconds since start of the next arrival */
} da_arrivals;

void da_arrivals_init(da_arrivals *a, uint64_t seed, double rate, double burstiness);
/* Returns the time (seconds since start) of the next arrival and advances. */
double da_arrivals_next(da_arrivals *a);
/* A gamma(shape, 1) variate (Marsaglia-Tsang); exposed for tests. */
double da_gamma_sample(da_rng *r, double shape);

#endif /* DA_WORKLOAD_H */
