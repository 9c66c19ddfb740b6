/*
 * verify.h — the reproducibility proof behind `detattn verify` (static library da_verify,
 * also linked by the daemon integration tests).
 *
 * A workload is drawn from a seed: `seqs` sequences with random prompt lengths in
 * [1, max_prompt] followed by `decode_steps` single-token steps, on `layers_used` layers
 * spread over the model. Every sequence/layer has its q, k, v for all its tokens drawn from
 * the seed, so every pass feeds identical inputs:
 *   reference pass   one connection; every Forward alone (one sequence, one layer, one
 *                    chunk), one at a time, with one random chunking of each prompt;
 *   concurrent pass  `clients` connections in threads, each owning a share of the
 *                    sequences, cutting each prompt DIFFERENTLY, grouping several sequences
 *                    into one Forward and keeping every layer's call in flight at once, so
 *                    the daemon's scheduler mixes them with the other clients' work.
 * Then every output row (sequence, layer, token) of the two passes is compared bitwise
 * (o and lse), and, with check_ref, against an fp64 reference computed here.
 * With url_b the concurrent pass runs against a second daemon (A/B): equal fingerprints
 * must give equal bits; different fingerprints are reported, and usually differ.
 *
 * Threads: da_verify_run starts and joins its own threads; the object is not shared.
 */
#ifndef DA_VERIFY_H
#define DA_VERIFY_H

#include <stddef.h>
#include <stdint.h>

#include "detattn.h"

typedef struct da_verify_cfg {
  const char *url;
  uint64_t seed;
  int seqs;         /* sequences (default 16) */
  int clients;      /* concurrent connections in the second pass (default 4) */
  int layers_used;  /* layers exercised, spread over the model (default 4) */
  int max_prompt;   /* longest prompt in tokens (default 384) */
  int decode_steps; /* single-token steps after the prompt (0 allowed; the CLI defaults to 16) */
  int check_ref;    /* also compare with the fp64 reference */
  int timeout_ms;   /* per call (default 60000) */
  const char *url_b; /* A/B: run the concurrent pass against this daemon instead (NULL: url) */
  int data_plane;    /* with data_plane_set: the concurrent pass's detattn_data_plane (the reference pass
                      * always copies); otherwise copy */
  int data_plane_set;
  const char *tls_ca, *tls_cert, *tls_key; /* tls+tcp:// (detattn_connect_opts) */
} da_verify_cfg;

/* Fills unset (zero) fields with the defaults above. */
void da_verify_cfg_defaults(da_verify_cfg *cfg);

typedef struct da_verify_result {
  uint64_t outputs_compared; /* output rows (sequence, layer, token) compared bitwise */
  uint64_t mismatches;       /* rows whose o or lse bits differ between the passes */
  uint64_t fingerprint;      /* the daemon's numerics fingerprint */
  uint64_t fingerprint_b;    /* the concurrent pass's daemon's (equal to fingerprint without url_b) */
  uint64_t tokens;           /* query tokens per pass */
  uint64_t forwards_ref, forwards_concurrent; /* Forward calls per pass */
  double ref_seconds, concurrent_seconds;
  double max_rel_err;        /* check_ref: max over rows of ||o - ref||2 / ||ref||2 */
  double max_lse_abs_err;    /* check_ref: max |lse - ref| */
  char first_mismatch[200];  /* where the first mismatch was, "" if none */
  int data_plane_used;       /* the plane the concurrent pass's clients used */
} da_verify_result;

typedef struct da_verify da_verify;

/* Connects, reads the model (Hello) and draws the workload. Fails with
 * RESOURCE_EXHAUSTED if one pass's sequences would not fit in the daemon's KV cache. */
int da_verify_alloc(da_verify **out, const da_verify_cfg *cfg, char *msg, size_t msglen);
/* Runs both passes and compares them. Returns the first failed call's status (msg says
 * which call); mismatches are a result, not an error. */
int da_verify_run(da_verify *v, da_verify_result *res, char *msg, size_t msglen);
void da_verify_free(da_verify *v);

/* Inspection (tests): the model, and one sequence/layer's inputs and concurrent-pass
 * outputs, all n_tokens of it at positions [0, n_tokens). */
const detattn_server_info *da_verify_info(const da_verify *v);
int da_verify_n_seqs(const da_verify *v);
int da_verify_n_layers(const da_verify *v);
typedef struct da_verify_tensors {
  uint32_t layer;    /* the model layer */
  uint32_t n_tokens;
  const void *q;     /* [n_tokens][n_q_heads][head_dim] */
  const void *k, *v; /* [n_tokens][n_kv_heads][head_dim] */
  const void *o;     /* [n_tokens][n_q_heads][head_dim] */
  const float *lse;  /* [n_tokens][n_q_heads] */
} da_verify_tensors;
void da_verify_get(const da_verify *v, int seq, int layer_index, da_verify_tensors *out);

/* fp64 reference for one sequence/layer (clients/cli/ref.c): causal attention of the
 * n tokens at positions [0, n) over themselves. o: [n][n_q_heads][head_dim],
 * lse: [n][n_q_heads]. */
void da_verify_reference(const detattn_model *m, uint32_t n, const void *q, const void *k, const void *v,
                         double *o, double *lse);

#endif /* DA_VERIFY_H */
