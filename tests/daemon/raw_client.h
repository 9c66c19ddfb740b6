/*
 * raw_client.h — protobuf requests sent by hand over nng, for tests that must say what
 * libdetattn never would (hostile references, events, handles), and a child's calls left in
 * flight. Check assertions inside: call from a test body.
 */
#ifndef DA_RAW_CLIENT_H
#define DA_RAW_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include <nng/nng.h>

#include "detattn.h"
#include "detattn.pb-c.h"

typedef struct da_raw {
  nng_socket sock;
  uint64_t next_id;
} da_raw;

/* A req0 socket (no resend, 10 s receive timeout) dialled to url. */
void da_raw_open(da_raw *r, const char *url);
void da_raw_close(da_raw *r);
/* Sends rq and returns the reply's status code, its message in msg; the decoded reply in
 * *out (free with detattn__v1__response__free_unpacked(*out, NULL)) when out is not NULL. */
int da_raw_call(da_raw *r, Detattn__V1__Request *rq, char *msg, size_t len, Detattn__V1__Response **out);
/* Asserts a status (and, for an error, a non-empty message). */
void da_raw_expect(int got, const char *msg, int want, const char *what);
/* SeqOpen: the new sequence. */
uint64_t da_raw_seq_open(da_raw *r);
/* RegisterArena of size bytes, a doorbell ring's when ring is not NULL: the reply's status
 * code and message (da_raw_call); on success the arena's id and token in *id and *token. */
int da_raw_register(da_raw *r, uint64_t size, Detattn__V1__DoorbellRing *ring, uint32_t *id, uint64_t *token,
                    char *msg, size_t len);

/* A one-sequence Forward of n tokens at pos 0 with every tensor (q, k, v, o, lse) by
 * reference into region, packed from offset base on. */
typedef struct da_raw_fwd {
  Detattn__V1__TensorRef ref[5];
  Detattn__V1__ForwardSeq fs;
  Detattn__V1__ForwardSeq *fsp;
  Detattn__V1__Forward f;
  Detattn__V1__Request rq;
} da_raw_fwd;

/* Hands n_fds descriptors (at most 4) over on the daemon's side socket <ipc path>.arena (url
 * is the daemon's ipc:// url) with {magic, id, token}, by libdetattn's da_side_handover with
 * any magic: the daemon's status byte, or DETATTN_UNAVAILABLE when it did not answer in 5 s. */
int da_raw_side_send(const char *url, uint32_t magic, const int *fds, int n_fds, uint32_t id, uint64_t token);

void da_raw_fwd_init(da_raw_fwd *x, uint64_t seq, uint32_t region, int n, uint64_t base, uint64_t q_row,
                     uint64_t kv_row, uint64_t lse_row);

/* For a child process that is killed with calls in flight, through libdetattn: four Forwards
 * of 2000 tokens at pos 0 on fresh sequences of c (layer 0, no lse), every tensor in c's
 * arena (q_row, kv_row: bytes a token; they take 2000 x (5 q_row + kv_row) bytes of it);
 * never waited for. Returns 0, or the step that failed: 1 an arena allocation, 2 a
 * seq_open, 3 a forward_start. *q (when q is not NULL): the arena block of q. */
int da_raw_calls_in_flight(detattn_client *c, uint64_t q_row, uint64_t kv_row, void **q);

#endif /* DA_RAW_CLIENT_H */
