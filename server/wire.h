/*
 * wire.h — the wire protocol (proto/detattn.proto) as plain C structs. Decoding,
 * validation against the model and limits, and encoding live here; protobuf-c types never
 * leave wire.c.
 *
 * Tensors are little-endian bytes in the model dtype (2 bytes per element); this module
 * assumes a little-endian host.
 * Thread: any thread; no shared state.
 */
#ifndef DA_WIRE_H
#define DA_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "da.h"

typedef enum da_op {
  DA_OP_INVALID = 0, /* undecodable, or no op set */
  DA_OP_HELLO,
  DA_OP_SEQ_OPEN,
  DA_OP_SEQ_FORK,
  DA_OP_SEQ_TRUNCATE,
  DA_OP_SEQ_CLOSE,
  DA_OP_FORWARD,
  DA_OP_STATS,
  DA_OP_REGISTER_ARENA,
  DA_OP_UNREGISTER_ARENA,
  DA_OP_REGISTER_CUDA,
  DA_OP_COUNT
} da_op;

/* "hello", "seq_open", ..., "invalid". */
const char *da_op_name(da_op op);

/* What a request is checked against. */
typedef struct da_wire_limits {
  da_model model;
  int max_request_tokens;   /* most tokens in one Forward, all sequences together */
  size_t max_message_bytes; /* requests longer than this are rejected (RESOURCE_EXHAUSTED) */
  size_t decode_bytes;      /* most bytes protobuf-c may allocate decoding one request */
} da_wire_limits;

/* A tensor of a Forward, however it travels: bytes in the message (data, len; arena 0), or
 * a reference into a shared-memory arena of the connection (arena != 0, offset; len is the
 * length the reference declared, already checked against the model). An output (o, lse)
 * with arena 0 and no data is returned in the reply. Resolved to a pointer by plane.h. */
typedef struct da_wire_tensor {
  const void *data;
  size_t len;
  uint32_t arena;
  uint64_t offset;
} da_wire_tensor;

/* One sequence of a Forward: positions [pos, pos + n_tokens) of the request's layer.
 * q: [n_tokens][n_q_heads][head_dim]; k, v: [n_tokens][n_kv_heads][head_dim]; model dtype.
 * o: [n_tokens][n_q_heads][head_dim], lse: [n_tokens][n_q_heads] fp32 (references only).
 * Data pointers are into the decoded request and live until da_wire_request_fini. */
typedef struct da_wire_fwd_seq {
  uint64_t seq;
  int pos;
  int n_tokens;
  da_wire_tensor q, k, v, o, lse;
} da_wire_fwd_seq;

typedef struct da_wire_request {
  uint64_t id;
  da_op op;
  int status;    /* 0, or why decoding or validation failed (message in err) */
  char err[256];
  /* hello */
  uint32_t protocol_version;
  char client_name[64];
  /* seq_fork (source), seq_truncate, seq_close */
  uint64_t seq;
  uint32_t length; /* seq_truncate */
  /* register_arena (size), unregister_arena (arena) */
  uint64_t arena_size;
  uint32_t arena;
  /* register_arena.doorbell: a doorbell ring of this geometry instead of an arena
   * (proto/doorbell_ring.h; checked by the doorbell module, not here) */
  int ring;
  uint32_t ring_slots, ring_request_bytes, ring_reply_bytes;
  /* register_cuda: the handle (in the decoded message), buffer size (arena_size), event */
  const void *cuda_handle;
  size_t cuda_handle_len;
  int cuda_event;
  /* forward */
  int layer;
  int want_lse;
  uint32_t wait_event, signal_event; /* cuda plane events, 0: none */
  int n_seqs;
  int n_tokens; /* over all seqs */
  da_wire_fwd_seq *seqs;
  void *pb; /* the decoded message and its allocator; owned */
} da_wire_request;

/*
 * Decodes and validates one request. Always fills out (id is 0 when the message does not
 * parse; for a message over max_message_bytes, the id if it is the first field) and
 * returns out->status:
 *  RESOURCE_EXHAUSTED: len > max_message_bytes, or decoding needs more than decode_bytes;
 *  INVALID_ARGUMENT: malformed protobuf; no op set; Forward with no sequences, a sequence
 *    with zero tokens, more than max_request_tokens tokens in all, a layer out of range, a
 *    position past 2^31, the same sequence twice, a q/k/v given both as bytes and by
 *    reference, or a tensor length (bytes or a reference's) that does not match n_tokens
 *    and the model (the message names the field, expected and got bytes); lse_ref without
 *    want_lse.
 * The caller owns out afterwards and must call da_wire_request_fini, whatever the status.
 */
int da_wire_decode(const da_wire_limits *lim, const void *buf, size_t len, da_wire_request *out);
/* Frees what decoding allocated; leaves out zeroed. A zeroed request is a no-op. */
void da_wire_request_fini(da_wire_request *r);

typedef struct da_wire_summary {
  uint64_t count;
  double mean, p50, p99, max;
} da_wire_summary;

typedef struct da_wire_hello_reply {
  const char *server_version;
  uint32_t protocol_version;
  da_model model;
  int page_tokens;
  const char *backend, *arch;
  uint32_t kernel_version;
  da_numerics num;
  uint64_t fingerprint;
  uint64_t max_message_bytes;
  uint32_t max_tokens_per_request;
  uint64_t kv_capacity_tokens;
  uint32_t kv_pages;
  uint32_t max_sequences;
  const char *const *data_planes; /* NULL-terminated */
  const char *arena_path;
  int doorbell; /* a doorbell ring may be registered (proto/doorbell_ring.h) */
} da_wire_hello_reply;

typedef struct da_wire_stats_reply {
  uint64_t uptime_ms, requests, errors;
  uint64_t op_ok[DA_OP_COUNT], op_errors[DA_OP_COUNT]; /* indexed by da_op */
  uint64_t forward_tokens, batches;
  da_wire_summary batch_tokens, batch_requests, queue_us;
  uint64_t inrow_rows, partial_rows;
  uint32_t kv_pages_total, kv_pages_used, kv_pages_free, sequences, clients;
  uint32_t arenas;
  uint64_t arena_bytes;
} da_wire_stats_reply;

/* One sequence's Forward output. o: [n_tokens][n_q_heads][head_dim] (o_len bytes);
 * lse: [n_tokens][n_q_heads] fp32 or NULL. Outputs written by reference are NULL here. */
typedef struct da_wire_fwd_out {
  const void *o;
  size_t o_len;
  const float *lse;
  size_t lse_len; /* bytes */
} da_wire_fwd_out;

typedef struct da_wire_response {
  uint64_t id;
  int code;            /* a DETATTN_* status */
  const char *message; /* may be NULL */
  da_op op;            /* which result to send when code == 0; ignored otherwise */
  const da_wire_hello_reply *hello;
  const da_wire_stats_reply *stats;
  uint64_t seq; /* seq_open, seq_fork */
  uint32_t arena; /* register_arena, register_cuda */
  uint64_t token; /* register_arena */
  int n_outs;   /* forward */
  const da_wire_fwd_out *outs;
} da_wire_response;

/*
 * Encodes r into a buffer obtained from alloc(arg, size) (which returns NULL on failure).
 * On success *out_buf is that buffer and *out_len its length. Returns RESOURCE_EXHAUSTED
 * if an allocation fails.
 */
int da_wire_encode(const da_wire_response *r, void *(*alloc)(void *arg, size_t size), void *arg,
                   void **out_buf, size_t *out_len);

#endif /* DA_WIRE_H */
