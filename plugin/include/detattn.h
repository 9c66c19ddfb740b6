/*
 * detattn.h — the public C API of libdetattn, the detattn client library.
 *
 * A serving stack links libdetattn to run attention in a detattnd daemon: one call per
 * layer per forward step. The daemon batches calls from all its clients freely, and every
 * output is bit-identical to running that call alone (see DESIGN.md §1).
 *
 * Threads: a detattn_client may be used from any number of threads at once; each call
 * uses its own nng request context. Calls block unless named _start.
 * Errors: every function returns a detattn_status (DETATTN_OK == 0). The message of the
 * last failed call on the calling thread is available from detattn_errmsg().
 * Tensors: little-endian, in the model's dtype (2 bytes per element), row-major with the
 * shapes given at each field.
 */
#ifndef DETATTN_H
#define DETATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define DETATTN_API __declspec(dllexport)
#else
#define DETATTN_API __attribute__((visibility("default")))
#endif

#define DETATTN_PROTOCOL_VERSION 1

/*
 * Status codes: the gRPC canonical set, with the same numbers. These numbers go on the
 * wire; they are append-only. XX(name, number, default message).
 */
#define DETATTN_STATUS_MAP(XX)                                                  \
  XX(OK, 0, "ok")                                                               \
  XX(CANCELLED, 1, "cancelled")                                                 \
  XX(UNKNOWN, 2, "unknown error")                                               \
  XX(INVALID_ARGUMENT, 3, "invalid argument")                                   \
  XX(DEADLINE_EXCEEDED, 4, "deadline exceeded")                                 \
  XX(NOT_FOUND, 5, "not found")                                                 \
  XX(ALREADY_EXISTS, 6, "already exists")                                       \
  XX(PERMISSION_DENIED, 7, "permission denied")                                 \
  XX(RESOURCE_EXHAUSTED, 8, "resource exhausted")                               \
  XX(FAILED_PRECONDITION, 9, "failed precondition")                             \
  XX(ABORTED, 10, "aborted")                                                    \
  XX(OUT_OF_RANGE, 11, "out of range")                                          \
  XX(UNIMPLEMENTED, 12, "unimplemented")                                        \
  XX(INTERNAL, 13, "internal error")                                            \
  XX(UNAVAILABLE, 14, "unavailable")                                            \
  XX(DATA_LOSS, 15, "data loss")

typedef enum detattn_status {
#define DETATTN_XX_(name, num, msg) DETATTN_##name = num,
  DETATTN_STATUS_MAP(DETATTN_XX_)
#undef DETATTN_XX_
} detattn_status;

/* "INVALID_ARGUMENT" for DETATTN_INVALID_ARGUMENT; "UNKNOWN_STATUS" for other numbers. */
DETATTN_API const char *detattn_status_name(int status);
/* The default message for a status ("invalid argument"). */
DETATTN_API const char *detattn_status_str(int status);
/* The message of the last failed call on this thread ("" if none). Valid until the next
 * call on this thread. */
DETATTN_API const char *detattn_errmsg(void);

typedef enum detattn_dtype { DETATTN_BF16 = 0, DETATTN_FP16 = 1 } detattn_dtype;

typedef struct detattn_model {
  uint32_t n_layers;
  uint32_t n_q_heads;   /* a multiple of n_kv_heads (GQA/MQA) */
  uint32_t n_kv_heads;
  uint32_t head_dim;
  detattn_dtype dtype;
  float scale;          /* softmax scale applied to q·k */
  float softcap;        /* 0: off; else score = softcap * tanh(score / softcap) */
  uint32_t window;      /* 0: full causal; else a query at p sees [p - window + 1, p] */
  uint32_t page_tokens; /* tokens per KV page */
} detattn_model;

typedef struct detattn_server_info {
  char server_version[32];
  uint32_t protocol_version;
  detattn_model model;
  char backend[16];         /* "cpu", "cuda" */
  char arch[32];            /* "x86_64", "sm_90", ... */
  uint32_t kernel_version;
  uint32_t split_tokens;    /* S */
  uint32_t tile_tokens;     /* T */
  uint64_t fingerprint;     /* numerics fingerprint: equal fingerprints + equal inputs => equal bits */
  uint64_t max_message_bytes;
  uint32_t max_tokens_per_request;
  uint64_t kv_capacity_tokens;
  uint32_t kv_pages;
  uint32_t data_planes;     /* planes the daemon offers: bit (1 << DETATTN_PLANE_*) */
} detattn_server_info;

typedef struct detattn_stats {
  uint64_t uptime_ms;
  uint64_t requests;        /* all requests answered */
  uint64_t errors;          /* answered with a status other than OK */
  uint64_t forwards;        /* Forward requests answered OK */
  uint64_t forward_tokens;  /* query tokens computed */
  uint64_t batches;
  double batch_tokens_mean, batch_tokens_p50, batch_tokens_p99, batch_tokens_max;
  double batch_requests_mean, batch_requests_max;
  double queue_us_mean, queue_us_p50, queue_us_p99, queue_us_max;
  uint64_t inrow_items, partial_items; /* split execution chosen per work item */
  uint32_t kv_pages_total, kv_pages_used, kv_pages_free;
  uint32_t sequences;
  uint32_t clients;
  uint32_t arenas;          /* shared-memory arenas mapped by the daemon */
  uint64_t arena_bytes;
} detattn_stats;

typedef struct detattn_client detattn_client;

/* Connects to url (ipc://..., tcp://127.0.0.1:port, tls+tcp://...) with the default
 * options (detattn_connect_opts_init). Does not block for long: nng dials in the
 * background; the first call waits for the connection up to its timeout. */
DETATTN_API int detattn_connect(detattn_client **out, const char *url);

/*
 * Data planes: how tensors travel. All give the same bits.
 *  COPY  bytes inside the request and reply messages (any transport; remote clients).
 *  SHM   a shared-memory arena (a sealed memfd of arena_bytes, handed to the daemon over
 *        its ipc side socket): the daemon reads q/k/v and writes o/lse in place. Tensors
 *        allocated with detattn_arena_alloc are not copied at all; other pointers are
 *        copied into the arena (one memcpy each) and outputs copied back.
 *  CUDA  device memory of this process on the daemon's GPU (a CUDA daemon on ipc://, same
 *        host): the daemon opens each allocation once by its CUDA IPC memory handle and its
 *        kernels read q/k/v and write o/lse there, with no host copy at all. Used by
 *        detattn_forward_cuda; host tensors of the same client go by SHM.
 *  AUTO  SHM when the daemon offers it (ipc://, same host), else COPY; detattn_forward_cuda
 *        uses CUDA when the daemon offers it.
 * The arena is set up with the first call that needs the daemon's Hello, and again after a
 * reconnect (the daemon forgets a closed connection's arenas; the memory stays valid here).
 * With data_plane CUDA a call fails with FAILED_PRECONDITION when the daemon offers no
 * cuda plane.
 */
typedef enum detattn_data_plane {
  DETATTN_PLANE_AUTO = 0,
  DETATTN_PLANE_COPY = 1,
  DETATTN_PLANE_SHM = 2,
  DETATTN_PLANE_CUDA = 3,
} detattn_data_plane;

/*
 * The same-host doorbell: on an ipc:// daemon that offers it, calls whose request and reply
 * fit a slot of a shared-memory ring (a sealed memfd handed over with an eventfd, like the
 * arena) skip nng: Forwards whose outputs travel by reference (SHM or CUDA tensors),
 * sequence ops and stats. A call claims a slot, publishes its request, wakes the daemon
 * only when it sleeps, and waits for its reply spinning doorbell_spin_us, then on a futex.
 * Same bits, same errors and limits as over nng; other calls (Hello, registration, copy
 * tensors, a full ring) go over nng as before. The ring is set up with the plane and again
 * after a reconnect.
 */
typedef enum detattn_doorbell {
  DETATTN_DOORBELL_AUTO = 0, /* used when the daemon offers it and the data plane is SHM or CUDA */
  DETATTN_DOORBELL_OFF = 1,  /* every call over nng */
  DETATTN_DOORBELL_ON = 2,   /* used whatever the plane; the Hello fails with FAILED_PRECONDITION
                              * when the daemon offers none or it cannot be set up */
} detattn_doorbell;

typedef struct detattn_connect_opts {
  uint32_t struct_size;          /* sizeof(detattn_connect_opts); set by _init */
  detattn_data_plane data_plane; /* default AUTO */
  uint64_t arena_bytes;          /* SHM arena size; default 256 MiB */
  int timeout_ms;                /* per-call timeout; default 60000; <= 0 waits forever */
  /* tls+tcp:// only (PEM files). tls_ca verifies the daemon's certificate (required);
   * tls_cert and tls_key are this client's for a daemon that requires them (mutual TLS);
   * tls_server_name is the name the daemon's certificate must carry (default: the URL's
   * host; Debian's mbedTLS 2.28 matches DNS names only, so connecting by IP address needs a
   * DNS name of the certificate here). */
  const char *tls_ca, *tls_cert, *tls_key, *tls_server_name;
  /* Fields below were added later: a struct_size that ends before one leaves it at its
   * default. */
  detattn_doorbell doorbell;     /* default AUTO */
  int doorbell_spin_us;          /* a doorbell call spins at least this long for its reply
                                  * before it sleeps on a futex; default 50; 0: sleep at once.
                                  * On a machine of 8 or more CPUs a call alone on its
                                  * connection spins up to 1.5x the connection's last call's
                                  * wait (at most 2 ms), so a loop of similar calls does not
                                  * pay a futex wake-up each */
} detattn_connect_opts;

DETATTN_API void detattn_connect_opts_init(detattn_connect_opts *opts);
/* Connects with opts (NULL: defaults). For tls+tcp:// the first connection is made before
 * returning, so a certificate problem fails here (UNAUTHENTICATED is not in the status set:
 * PERMISSION_DENIED, with nng's reason); a daemon not running yet is retried in the
 * background as for other URLs. With data_plane SHM, a call fails with
 * FAILED_PRECONDITION (and the reason) when the arena cannot be set up; with AUTO it falls
 * back to COPY (detattn_data_plane_get says which). */
DETATTN_API int detattn_connect_ex(detattn_client **out, const char *url, const detattn_connect_opts *opts);
/* The plane calls use now (after the first Hello; before it: the one asked for). */
DETATTN_API detattn_data_plane detattn_data_plane_get(detattn_client *c);
/* DETATTN_DOORBELL_ON while calls that fit go through a doorbell ring (set up with the
 * first Hello), else DETATTN_DOORBELL_OFF. */
DETATTN_API detattn_doorbell detattn_doorbell_get(detattn_client *c);
DETATTN_API const char *detattn_data_plane_name(detattn_data_plane p);
/* Memory in the client's arena (64-byte aligned), or NULL when there is no arena (not SHM,
 * not set up yet: call detattn_hello first) or it is full. Tensors here travel by
 * reference. Any thread. */
DETATTN_API void *detattn_arena_alloc(detattn_client *c, size_t bytes);
DETATTN_API void detattn_arena_free(detattn_client *c, void *p);
/* Closes the connection: the daemon closes every sequence this client opened.
 * Outstanding calls finish with DETATTN_CANCELLED or DETATTN_UNAVAILABLE: every call started
 * and not yet passed to detattn_call_wait, answered or not, ends DETATTN_CANCELLED with its
 * outputs unwritten (detattn_call_wait still frees it, after close as well; not at the same
 * time as close). NULL is a no-op. */
DETATTN_API void detattn_close(detattn_client *c);
/* Per-call timeout in milliseconds (default 60000; <= 0 waits forever). */
DETATTN_API void detattn_set_timeout(detattn_client *c, int ms);

DETATTN_API int detattn_hello(detattn_client *c, detattn_server_info *out);
DETATTN_API int detattn_stats_get(detattn_client *c, detattn_stats *out);

/* Sequences: ids are chosen by the daemon and belong to the connection that opened them. */
DETATTN_API int detattn_seq_open(detattn_client *c, uint64_t *seq_out);
/* A new sequence sharing src's tokens (copy-on-write pages). */
DETATTN_API int detattn_seq_fork(detattn_client *c, uint64_t src, uint64_t *seq_out);
/* Every layer's length becomes min(its length, length). */
DETATTN_API int detattn_seq_truncate(detattn_client *c, uint64_t seq, uint32_t length);
DETATTN_API int detattn_seq_close(detattn_client *c, uint64_t seq);

/* One sequence's part of a Forward call for one layer: n_tokens new tokens at absolute
 * positions [pos, pos + n_tokens); pos must equal the layer's current length. The daemon
 * appends k and v, then computes causal attention for the n_tokens queries. */
typedef struct detattn_seq_io {
  uint64_t seq;
  uint32_t pos;
  uint32_t n_tokens;
  const void *q;  /* [n_tokens][n_q_heads][head_dim] */
  const void *k;  /* [n_tokens][n_kv_heads][head_dim] */
  const void *v;  /* [n_tokens][n_kv_heads][head_dim] */
  void *o;        /* out: [n_tokens][n_q_heads][head_dim] */
  float *lse;     /* out, optional: [n_tokens][n_q_heads] natural-log sum-exp, or NULL */
} detattn_seq_io;

/* Blocking Forward for `layer` over n sequences (atomic: on error nothing is appended to
 * any of them). Requests with lse if any item's lse is non-NULL. */
DETATTN_API int detattn_forward(detattn_client *c, uint32_t layer, detattn_seq_io *items,
                                size_t n);

/* Asynchronous Forward: the inputs are copied before _start returns; items[].o and .lse
 * must stay valid until detattn_call_wait returns. Any number may be in flight. */
typedef struct detattn_call detattn_call;
DETATTN_API int detattn_forward_start(detattn_client *c, uint32_t layer, detattn_seq_io *items,
                                      size_t n, detattn_call **out);
/* Waits for the call, writes its outputs, frees it, and returns its status. */
DETATTN_API int detattn_call_wait(detattn_call *call);

/*
 * Forward with device tensors (the CUDA plane). Every q, k, v, o and lse of items is a
 * device pointer of this process (host and device pointers do not mix in one call) into
 * memory from cudaMalloc/cuMemAlloc (torch's caching allocator uses it; memory from the
 * virtual memory API, e.g. torch's expandable segments, cannot be shared this way and is
 * refused with INVALID_ARGUMENT), on the daemon's GPU.
 *
 * stream (a cudaStream_t or CUstream; NULL: the legacy default stream) orders the call:
 * the daemon reads the inputs once the work queued on stream before the call has run (an
 * interprocess event recorded here; the daemon never makes its own stream wait on it), and
 * work queued on stream after detattn_forward_cuda returns (or after detattn_call_wait)
 * runs after the outputs are written. The calling thread needs a current CUDA context on
 * that device, as any CUDA call does; libdetattn loads libcuda.so.1 when first needed.
 *
 * Each allocation is registered with the daemon once and cached for the connection (an
 * allocation freed and another made at the same address is noticed by its buffer id and
 * registered anew); interprocess events come from a per-client pool. Bits equal those of
 * detattn_forward on the same values. FAILED_PRECONDITION when the daemon offers no cuda
 * plane (a CPU daemon, tcp://) or CUDA cannot be loaded here. The _start form returns once
 * the request is sent; o and lse are written by the daemon's GPU, in place.
 */
DETATTN_API int detattn_forward_cuda(detattn_client *c, uint32_t layer, detattn_seq_io *items, size_t n,
                                     void *stream);
DETATTN_API int detattn_forward_cuda_start(detattn_client *c, uint32_t layer, detattn_seq_io *items,
                                           size_t n, void *stream, detattn_call **out);

/*
 * Tensor parallelism: several daemons, typically one per GPU (detattnd --device N), used as
 * one. Rank r's daemon runs the model with a contiguous shard of the heads: q heads
 * [q0_r, q0_r + Hq_r) and kv heads [kv0_r, kv0_r + Hkv_r), shards in rank order, whole GQA
 * groups (Hq_r / Hkv_r equal on every rank). Every other setting (layers, head_dim, dtype,
 * scale, softcap, window, page size, S, T, backend build) must be the same on every rank;
 * their fingerprints are then equal to that of one daemon holding every head, and so are
 * the bits of each head: a head is computed by one daemon with the same kernels.
 *
 * A TP Forward takes whole-layer tensors (q [n][Hq][d], k and v [n][Hkv][d], o, lse with
 * Hq = sum of Hq_r), gathers each rank's heads (into its shared-memory arena when it has
 * one), starts the call on every rank, then waits for every rank and scatters o and lse
 * back. Sequences are opened, forked, truncated and closed on every rank under one TP id.
 * A Forward that fails on every rank leaves nothing appended; one that fails on some ranks
 * only marks its sequences: later calls on them get DETATTN_ABORTED until
 * detattn_tp_seq_truncate (to the length before that Forward) or detattn_tp_seq_close.
 * Threads and errors: as for detattn_client.
 */
typedef struct detattn_tp detattn_tp;
typedef struct detattn_tp_call detattn_tp_call;

/* Connects to n_ranks daemons (urls[r] is rank r) with opts (NULL: defaults) and asks each
 * for Hello; blocks until all answered. FAILED_PRECONDITION (naming the rank and the
 * setting) when the ranks do not form one model. */
DETATTN_API int detattn_tp_connect(detattn_tp **out, const char *const *urls, size_t n_ranks,
                                   const detattn_connect_opts *opts);
/* Closes every rank's connection (each daemon closes this client's sequences). Calls not yet
 * passed to detattn_tp_call_wait end DETATTN_CANCELLED with their outputs unwritten, as with
 * detattn_close. NULL: no-op. */
DETATTN_API void detattn_tp_close(detattn_tp *tp);
/* The whole layer: rank 0's info with the heads summed over ranks, and the smallest
 * capacity and limits of any rank. */
DETATTN_API int detattn_tp_hello(detattn_tp *tp, detattn_server_info *out);
DETATTN_API size_t detattn_tp_ranks(const detattn_tp *tp);
/* Rank r's own client (for detattn_stats_get), or NULL. Owned by tp. */
DETATTN_API detattn_client *detattn_tp_rank(detattn_tp *tp, size_t rank);
/* Rank r's heads: first q head, q heads, first kv head, kv heads (NULL outputs skipped). */
DETATTN_API int detattn_tp_shard(const detattn_tp *tp, size_t rank, uint32_t *q_head0, uint32_t *n_q_heads,
                                 uint32_t *kv_head0, uint32_t *n_kv_heads);
DETATTN_API int detattn_tp_seq_open(detattn_tp *tp, uint64_t *seq_out);
DETATTN_API int detattn_tp_seq_fork(detattn_tp *tp, uint64_t src, uint64_t *seq_out);
DETATTN_API int detattn_tp_seq_truncate(detattn_tp *tp, uint64_t seq, uint32_t length);
DETATTN_API int detattn_tp_seq_close(detattn_tp *tp, uint64_t seq);
/* Whole-layer Forward over n sequences (items[].seq are TP ids; shapes use the summed
 * heads). _start returns once every rank's call is started (inputs copied); items[].o and
 * .lse must stay valid until detattn_tp_call_wait, which waits for every rank. */
DETATTN_API int detattn_tp_forward(detattn_tp *tp, uint32_t layer, detattn_seq_io *items, size_t n);
DETATTN_API int detattn_tp_forward_start(detattn_tp *tp, uint32_t layer, detattn_seq_io *items, size_t n,
                                         detattn_tp_call **out);
DETATTN_API int detattn_tp_call_wait(detattn_tp_call *call);

#ifdef __cplusplus
}
#endif
#endif /* DETATTN_H */
