/*
 * load.h — the detattn-load engine: drives a daemon with a seeded workload like a serving
 * stack (open sequences, chunked prefill, decode steps of one Forward per layer, close),
 * measures latency and throughput, hashes every output, and replays for verification.
 *
 * Threads: da_load_run starts worker threads (one per sequence in flight) and returns when
 * they are done; the calling thread draws the progress bar. Each worker runs one sequence
 * at a time with blocking calls; the daemon batches across workers and connections.
 * Latency of a Forward is measured from its scheduled time: the sequence's arrival for its
 * first call (open loop: a late start counts against the server, no coordinated omission),
 * the completion of its previous call otherwise.
 */
#ifndef DA_LOAD_H
#define DA_LOAD_H

#include <stdbool.h>
#include <stdint.h>

#include "detattn.h"
#include "hist.h"
#include "record.h"
#include "workload.h"

typedef enum da_load_mode { DA_LOAD_CLOSED = 0, DA_LOAD_OPEN = 1 } da_load_mode;

typedef struct da_load_cfg {
  const char *url;
  da_load_mode mode;
  uint32_t concurrency;   /* closed loop: sequences in flight */
  double rate;            /* open loop: arrivals per second */
  double burstiness;      /* open loop: gamma shape, 1 = Poisson */
  uint32_t max_inflight;  /* open loop: worker threads; later arrivals wait (and it counts) */
  double duration_s;      /* 0: unbounded; no new sequence starts after it */
  uint64_t requests;      /* 0: unbounded; sequences 0 .. requests-1 */
  double warmup_s;        /* calls scheduled before it are not in the statistics */
  uint32_t prefill_chunk; /* 0: whole prompt (capped by the daemon's max tokens) */
  uint32_t connections;   /* sequence i uses connection i % connections */
  int data_plane;         /* detattn_data_plane of the measured connections (0: auto) */
  const char *tls_ca, *tls_cert, *tls_key; /* tls+tcp:// */
  int timeout_ms;
  bool keep_hashes;       /* keep every output hash in the result's record (for --verify,
                             --record, --compare); else only the digest */
  bool progress;
} da_load_cfg;

/* The options of a connection of this run: cfg's TLS files and the given data plane. */
void da_load_connect_opts(const da_load_cfg *cfg, int data_plane, detattn_connect_opts *out);

typedef struct da_load_result {
  /* Counted in the measured window (after warmup). */
  uint64_t sequences, forward_calls, tokens, prompt_tokens, output_tokens;
  double elapsed_s;
  double tokens_per_s, output_tokens_per_s, forwards_per_s, sequences_per_s;
  da_hist fwd, fwd_prefill, fwd_decode, ttft, tpot; /* nanoseconds */
  da_hist start_lag; /* open loop: how late a sequence started after its arrival time; a
                        large lag means the generator (--max-inflight) could not keep up */
  /* Counted over the whole run. */
  uint64_t sequences_total, sequences_failed, forward_errors;
  uint32_t connect_retries; /* hellos answered UNAVAILABLE on new connections, retried */
  int data_plane_used;      /* the plane the measured connections used (-1: mixed) */
  int first_error_status;
  char first_error[160];
  detattn_server_info info;
  bool have_stats;
  detattn_stats stats_before, stats_after;
  /* Sum over completed sequences of XXH3(sequence's output hashes, seed = index): equal
   * for two runs that computed the same sequences with the same bits, in any order. */
  uint64_t digest;
  da_record record; /* hashes of every completed sequence, when cfg->keep_hashes */
} da_load_result;

/* Connects, reads hello (the model comes from the daemon), and fills w's model fields.
 * Errors: the connect/hello status, message in msg. */
int da_load_hello(const da_load_cfg *cfg, da_workload *w, detattn_server_info *info,
                  char *msg, size_t msglen);

/* Runs the workload. res is initialised here; da_load_result_fini frees it. Returns OK
 * when the run happened (individual call errors are counted in res); else the status of
 * what stopped it (connect, threads), message in msg. */
int da_load_run(const da_load_cfg *cfg, const da_workload *w, da_load_result *res, char *msg,
                size_t msglen);
void da_load_result_fini(da_load_result *res);

/* Replays every sequence of `ran` alone on one new connection, one call at a time, and
 * fills `replay` (initialised here) with its hashes; adds handshake retries to *retries. */
int da_load_replay(const da_load_cfg *cfg, const da_workload *w, const da_record *ran,
                   da_record *replay, uint32_t *retries, char *msg, size_t msglen);

#endif /* DA_LOAD_H */
