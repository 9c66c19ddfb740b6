/*
 * client_impl.h — libdetattn's internals, shared by its two modules:
 *   client.c  the transport: the nng req0 socket (resend disabled), one context and one
 *             aio per call, the per-call deadline, status mapping of transport failures,
 *             the thread-local error message;
 *   ops.c     the operations: protobuf encode, decode and response checks (protobuf
 *             types never leave ops.c).
 *
 *   doorbell.c the same-host doorbell: a shared-memory request ring (proto/doorbell_ring.h);
 *   plane_shm.c the shared-memory arena and the side socket hand-over.
 *
 * A call's life: da_call_start (takes a packed request) -> the aio sends it on the call's
 * own context, then receives the reply; or, when the client has a doorbell ring and the
 * request and its largest reply fit a slot, the request goes into a slot instead -> da_call_wait
 * returns the reply bytes, or the transport status with a message. Calls are independent:
 * any number may be in flight from any threads.
 */
#ifndef DA_CLIENT_IMPL_H
#define DA_CLIENT_IMPL_H

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>

#include <nng/nng.h>

#include "detattn.h"

#define DA_CLIENT_DEFAULT_TIMEOUT_MS 60000
/* The largest reply message the client accepts from any daemon (NNG_OPT_RECVMAXSZ); each
 * call also checks its reply against the most its request can produce. */
#define DA_CLIENT_MAX_REPLY_BYTES ((size_t)256 << 20)
/* A doorbell call spins this long for its reply before it sleeps (detattn_connect_opts). */
#define DA_CLIENT_DEFAULT_DOORBELL_SPIN_US 50
/* Replies other than Forward's (hello, stats, sequence ops) are small. */
#define DA_CLIENT_SMALL_REPLY_BYTES ((size_t)1 << 20)

/* The shared-memory arena (plane_shm.c): a sealed memfd mapped at base. */
typedef struct da_arena {
  pthread_mutex_t mu;
  int fd;
  uint8_t *base;
  size_t size;
  void *free_list; /* free extents, by offset */
} da_arena;

int da_arena_create(da_arena *a, size_t size);
void da_arena_destroy(da_arena *a);
void *da_arena_alloc(da_arena *a, size_t bytes);
void da_arena_free(da_arena *a, void *p);
/* 1 and the offset when [p, p + len) lies in the arena. */
int da_arena_offset(const da_arena *a, const void *p, size_t len, uint64_t *off);
/* Sends the arena's descriptor for arena id with token over the side socket at path and
 * waits for the daemon's status byte. */
int da_arena_handover(const da_arena *a, const char *path, uint32_t id, uint64_t token, int timeout_ms);

/* The CUDA plane (plane_cuda.c), under client->plane_mu: allocations of this process
 * registered with the daemon (a region id each), and free interprocess events. */
typedef struct da_cuda_buf {
  uint64_t base, size, buffer_id; /* the allocation: base address, bytes, the driver's id */
  uint64_t gen;                   /* the connection generation it was registered on */
  uint64_t last_use;
  uint32_t id;                    /* the daemon's region id */
  int busy;                       /* calls being built or in flight that reference it */
  int dead;                       /* unregistered; dropped at the next da_cuda_begin */
} da_cuda_buf;

typedef struct da_cuda_ev {
  void *ready;               /* a CUevent (interprocess, no timing): the call's inputs are ready */
  void *ctx;                 /* the CUcontext it was made in */
  uint32_t ready_id;
  uint64_t gen;
  struct da_cuda_ev *next;
} da_cuda_ev;

typedef struct da_cuda_state {
  da_cuda_buf *bufs;
  size_t n_bufs, cap_bufs;
  da_cuda_ev *free_evs;
  uint64_t tick;
} da_cuda_state;

/* The allocations one call being built references (indices into bufs). */
typedef struct da_cuda_use {
  uint64_t gen;
  void *ctx;  /* the first tensor's CUcontext; made current here if the thread had none */
  int pushed;
  size_t *at;
  size_t n, cap;
} da_cuda_use;

/* Loads libcuda.so.1 once; FAILED_PRECONDITION (message set) when it cannot. */
int da_cuda_load(void);
/* Building one call, with plane_mu held throughout: da_cuda_begin, then da_cuda_ref for
 * each device tensor (its region id and offset; registers the allocation on first use and
 * pins it against eviction), then da_cuda_use_ids (the ids the call keeps) or
 * da_cuda_use_release (the call was not sent), then da_cuda_use_fini. */
void da_cuda_begin(detattn_client *c, da_cuda_use *use);
int da_cuda_ref(detattn_client *c, const void *p, size_t len, const char *what, size_t item, da_cuda_use *use,
                uint32_t *id, uint64_t *off);
int da_cuda_use_ids(detattn_client *c, const da_cuda_use *use, uint32_t **ids, size_t *n);
void da_cuda_use_release(detattn_client *c, da_cuda_use *use);
void da_cuda_use_fini(da_cuda_use *use);
/* An event for one call (plane_mu held, between da_cuda_begin and da_cuda_use_fini),
 * recorded on stream ("inputs ready"); new events are made in ctx. */
int da_cuda_events_take(detattn_client *c, void *stream, void *ctx, da_cuda_ev **out);
/* A CUDA call ended with status (takes plane_mu): its allocations are unpinned and its
 * event pooled or retired. */
void da_cuda_call_end(detattn_client *c, detattn_call *k, int status);
/* Frees the plane's state at detattn_close. */
void da_cuda_client_fini(detattn_client *c);
/* Protobuf round trips for the plane (ops.c): RegisterCuda of a memory (event 0, size
 * bytes) or event handle, and UnregisterArena of any region id. */
int da_ops_register_cuda(detattn_client *c, int event, const void *handle, size_t len, uint64_t size,
                         uint32_t *id);
int da_ops_unregister(detattn_client *c, uint32_t id);

/* Sends fds (n_fds, at most 4) with {magic, id, token} over the side socket at path and
 * waits for the daemon's status byte; what names the thing handed over in messages. */
int da_side_handover(const char *path, uint32_t magic, uint32_t id, uint64_t token, const int *fds, int n_fds,
                     int timeout_ms, const char *what);

/* The doorbell ring (doorbell.c): a sealed memfd of slots, mapped here and in the daemon,
 * and the eventfd that wakes the daemon. Reference-counted: the client holds one while the
 * ring is its connection's, each call in a slot one more. Any thread. */
typedef struct da_ring da_ring;
/* A ring of slots slots with request_bytes / reply_bytes areas (proto/doorbell_ring.h
 * bounds); a call spins for its reply (da_ring_spin_budget, from spin_us) before it sleeps.
 * One reference. */
int da_ring_create(da_ring **out, uint32_t slots, uint32_t request_bytes, uint32_t reply_bytes, int spin_us);
/* The ring's geometry and size, for RegisterArena. */
void da_ring_geometry(const da_ring *r, uint32_t *slots, uint32_t *request_bytes, uint32_t *reply_bytes,
                      uint64_t *size);
/* Hands the memfd and the eventfd to the daemon for ring id with token (da_side_handover). */
int da_ring_handover(const da_ring *r, const char *path, uint32_t id, uint64_t token, int timeout_ms);
void da_ring_ref(da_ring *r);
/* Drops a reference; the last one unmaps the ring and closes its descriptors. NULL: no-op. */
void da_ring_unref(da_ring *r);
/* The connection dropped (status UNAVAILABLE) or the client is closing (CANCELLED): no slot
 * in flight will be answered. Calls waiting or starting on the ring fail with status. */
void da_ring_lost(da_ring *r, int status);
/* Claims a slot for a request of len bytes whose reply is at most reply_max bytes, copies the
 * request in, publishes it and wakes the daemon if it sleeps. DETATTN_OK and *slot, or
 * DETATTN_RESOURCE_EXHAUSTED when it does not fit or no slot is free (send it over nng). */
int da_ring_start(da_ring *r, const void *req, size_t len, size_t reply_max, uint32_t *slot);
/* Waits for slot's reply until deadline_ns (da_now_ns; 0: none). DETATTN_OK and *reply (a
 * copy, owned by the caller), or DEADLINE_EXCEEDED (the slot is reclaimed once the daemon
 * answers), UNAVAILABLE / CANCELLED after da_ring_lost, INTERNAL for a reply past the slot;
 * the message in msg. The slot is the ring's again afterwards. */
int da_ring_wait(da_ring *r, uint32_t slot, uint64_t deadline_ns, nng_msg **reply, char *msg, size_t msglen);
/* A started call that will not be waited for: its slot is reclaimed once answered. */
void da_ring_abandon(da_ring *r, uint32_t slot);
/* How long a call spins for its reply before it sleeps on the slot's futex (a futex wake-up
 * costs ~20-30 us, as much as a B 1 decode layer call's GPU work): spin_ns (0: never); where
 * adaptive (a machine of DA_RING_ADAPTIVE_CPUS or more online CPUs) and no other call of the
 * ring is waiting, half again as long as the ring's last answered call waited (last_ns), if
 * that is longer, at most DA_RING_SPIN_MAX_NS. A serving loop's layer calls take about the
 * same time one after another, so each finds its reply while it spins. */
#define DA_RING_ADAPTIVE_CPUS 8
#define DA_RING_SPIN_MAX_NS 2000000ull
uint64_t da_ring_spin_budget(uint64_t spin_ns, int adaptive, int others, uint64_t last_ns);

/* What a call does once its reply is in: the request kind, and for Forward the caller's
 * output buffers (copied from detattn_seq_io at start). With the shm plane, outputs the
 * daemon wrote by reference (o_ref, lse_ref) are copied from the arena scratch blocks o_tmp,
 * lse_tmp (unless the caller's buffer was in the arena: then no copy). */
typedef struct da_call_out {
  uint32_t n_tokens;
  void *o;
  float *lse;
  int o_ref, lse_ref;
  void *o_tmp, *lse_tmp;
} da_call_out;

struct detattn_call {
  detattn_client *client;
  nng_ctx ctx;
  nng_aio *aio;
  uint64_t id;
  int op;             /* Detattn__V1__Request__OpCase of the request */
  uint64_t deadline;  /* da_now_ns() deadline, 0: none */
  int phase;          /* CALL_SEND, CALL_RECV: touched only by the aio callback once started */
  int done;           /* under mu: the transport finished; status, msg and reply are set */
  int status;         /* transport status once done */
  char msg[200];      /* transport message once done with an error */
  nng_msg *reply;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  detattn_call *prev, *next; /* the client's in-flight list, under client->mu */
  detattn_call *lprev, *lnext; /* the client's live calls (started, not yet freed), under client->mu */
  int orphaned; /* under mu: the client was closed first; the call ends CANCELLED, client NULL */
  /* Forward only: the model the request was checked against and where outputs go. */
  detattn_model model;
  int want_lse;
  size_t n_out;
  da_call_out *out;
  void **scratch;  /* arena blocks holding copied inputs and outputs, freed when the call
                   * ends if the daemon answered it (answered) */
  int answered;    /* a reply came back: the daemon is done with the call's memory */
  size_t n_scratch;
  /* CUDA plane calls: the caller's stream, the call's ready event, the region ids it uses. */
  void *cu_stream;
  da_cuda_ev *cu_ev;
  uint32_t *cu_bufs;
  size_t n_cu_bufs;
  /* A doorbell call (no nng context or aio then): the ring (a reference) and the slot. */
  da_ring *ring;
  uint32_t ring_slot;
  int ring_waited; /* da_ring_wait returned: the slot is no longer the call's */
};

struct detattn_client {
  nng_socket sock;
  nng_dialer dialer;
  char url[256];
  int timeout_ms;           /* <= 0: none */
  uint64_t next_id;         /* under mu */
  pthread_mutex_t mu;
  pthread_cond_t idle;      /* signalled when the in-flight list becomes empty */
  detattn_call *inflight;   /* calls between start and completion */
  detattn_call *live;       /* calls between start and free (wait): detattn_close orphans them */
  int closing;
  int have_info;            /* the cached Hello, dropped with the connection */
  detattn_server_info info;
  int pinned;               /* the first Hello's model and numerics, kept for the client's life */
  detattn_server_info pin;
  /* data planes, under plane_mu (held across the arena's set-up) */
  detattn_connect_opts opts;
  pthread_mutex_t plane_mu;
  int plane;                /* DETATTN_PLANE_* calls use now */
  uint32_t arena_id;        /* the daemon's id for the arena on this connection; 0: none */
  char arena_path[256];     /* from the Hello */
  da_arena arena;
  int cuda_plane;           /* under mu: the daemon of this connection offers the cuda plane */
  da_cuda_state cuda;       /* under plane_mu */
  /* the doorbell, under mu (set up under plane_mu) */
  int doorbell_offered;     /* the last Hello offered one */
  da_ring *ring;            /* this connection's ring (a reference), NULL: none */
  unsigned conn_gen;        /* connections dropped so far: a ring set up across a drop, or a CUDA
                             * registration, is stale */
};

/* Sets this thread's error message (printf-style) and returns status, for one-line
 * `return da_err(DETATTN_X, "...")`. */
int da_err(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Starts a call: takes ownership of msg (a packed Request whose id is `id`, from
 * da_client_next_id) in every case. reply_max: the largest reply the request can get when
 * that is small enough for a doorbell slot (then the call goes through the client's ring
 * when it has one and a slot is free), 0: over nng. On success *out is the call, owned by
 * the caller until da_call_wait. */
int da_call_start(detattn_client *c, nng_msg *msg, uint64_t id, int op, size_t reply_max, detattn_call **out);
/* Waits for the transport to finish. On DETATTN_OK *reply is the reply message, owned by
 * the caller. Does not free the call. */
int da_call_transport_wait(detattn_call *k, nng_msg **reply);
/* Frees a finished call (its context, aio and outputs table). NULL is a no-op. */
void da_call_free(detattn_call *k);
uint64_t da_client_next_id(detattn_client *c);
/* Decodes reply bytes for Forward call k and writes its outputs, checking everything a
 * hostile daemon could get wrong (length, id, status, kind, sizes). The body of
 * detattn_call_wait after the transport; the client fuzzer calls it directly. */
int da_call_deliver(detattn_call *k, const void *buf, size_t len);
/* Stores a Hello reply as the client's cached server info (until the connection drops).
 * The first one is pinned: a later Hello (after a reconnect) whose model or numerics differ
 * from it is refused with DETATTN_FAILED_PRECONDITION (message set) and nothing changes, so
 * buffers sized from the first Hello are never read or written past their end. */
int da_client_set_info(detattn_client *c, const detattn_server_info *info);
/* Copies the cached server info; 0 if there is none. */
int da_client_get_info(detattn_client *c, detattn_server_info *out);

#endif /* DA_CLIENT_IMPL_H */
