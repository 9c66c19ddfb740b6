/*
 * record.h — output hashes of a detattn-load run, their file format, and their comparison.
 *
 * Every output row (one token of one layer of one sequence: [n_q_heads][head_dim] in the
 * model dtype) is hashed with XXH3_64bits. A record holds those hashes for every completed
 * sequence, the daemon's numerics fingerprint and a description of the workload.
 *
 * File format (text, version 1; lines end in '\n'):
 *   detattn-load-record 1
 *   fingerprint <16 hex digits>
 *   numerics <backend> <arch> kernel=<v> split=<S> tile=<T>
 *   workload <description without spaces>
 *   layers <L>
 *   sequences <N>
 *   then per sequence, in increasing index:
 *   seq <index> <prompt> <output>
 *   and L lines, one per layer 0..L-1, each with prompt + output - 1 hashes (16 hex
 *   digits, space separated), the hash of the output row at positions 0, 1, ...
 */
#ifndef DA_RECORD_H
#define DA_RECORD_H

#include <stddef.h>
#include <stdint.h>

typedef struct da_seq_hashes {
  uint64_t index;
  uint32_t prompt, output;
  uint32_t n_tokens;  /* prompt + output - 1 */
  uint64_t *h;        /* owned: [n_layers][n_tokens] */
} da_seq_hashes;

typedef struct da_record {
  uint64_t fingerprint;
  char numerics[160];
  char workload[256];
  uint32_t n_layers;
  da_seq_hashes *seqs;  /* owned, sorted by index after da_record_sort */
  size_t n_seqs, cap;
} da_record;

void da_record_init(da_record *r, uint32_t n_layers);
void da_record_fini(da_record *r);
/* Appends a sequence with zeroed hashes; *out points into r until the next add. */
int da_record_add(da_record *r, uint64_t index, uint32_t prompt, uint32_t output,
                  da_seq_hashes **out);
/* Moves a sequence in: takes ownership of s->h. */
int da_record_take(da_record *r, da_seq_hashes *s);
void da_record_sort(da_record *r);
const da_seq_hashes *da_record_find(const da_record *r, uint64_t index);

/* Writes r (sorted first) to path. Errors: UNAVAILABLE on I/O failure, message in msg. */
int da_record_save(da_record *r, const char *path, char *msg, size_t msglen);
/* Reads path into r (initialised here). Errors: NOT_FOUND (cannot open), DATA_LOSS
 * (malformed: names the line), with a message in msg; r is left empty on error. */
int da_record_load(da_record *r, const char *path, char *msg, size_t msglen);

typedef struct da_record_diff {
  int fingerprints_differ;
  int workloads_differ;
  uint64_t sequences_compared;  /* present in both with equal lengths */
  uint64_t sequences_missing;   /* present in one only, or lengths differ */
  uint64_t outputs_compared;
  uint64_t mismatches;
  int have_first;               /* first differing output in (sequence, layer, token) order */
  uint64_t first_seq;
  uint32_t first_layer, first_token;
} da_record_diff;

/* Compares two sorted records output by output, over the sequences present in both. */
void da_record_compare(const da_record *a, const da_record *b, da_record_diff *out);
/* Identical: something was compared and nothing differed. Sequences present in one record
 * only (a --duration run completes a timing-dependent set) are reported, not a difference. */
static inline int da_record_identical(const da_record_diff *d) {
  return d->sequences_compared > 0 && d->mismatches == 0;
}

#endif /* DA_RECORD_H */
