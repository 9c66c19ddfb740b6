/*
 * daemon_impl.h — detattnd's internal state, shared by the loop (daemon.c: state, loop
 * callbacks, event intake, batch formation and completion, stats, lifecycle) and the op
 * handlers (ops.c: the dispatch table, one handler per op, replies). Not a public header:
 * only server/daemon.c and server/ops.c include it.
 *
 * Thread: everything here is owned by the daemon's loop thread; every function below runs
 * on it.
 */
#ifndef DA_DAEMON_IMPL_H
#define DA_DAEMON_IMPL_H

#include <stdint.h>
#include <uv.h>

#include "backend.h"
#include "hist.h"
#include "config.h"
#include "doorbell.h"
#include "http.h"
#include "kvcache.h"
#include "metrics.h"
#include "phases.h"
#include "plane.h"
#include "scheduler.h"
#include "transport.h"
#include "wire.h"
#include "worker.h"

#define N_BUCKETS 256
#define EVENTS_PER_TICK 256
#define N_GONE 1024
#define DRAIN_LINGER_MS 200
#define CLOSE_GRACE_MS 2000 /* after the drain deadline, for closing the socket */

typedef struct request request;
typedef struct seq_slot seq_slot;

/* Where a request's reply goes: an nng context (ctx), or the slot of a doorbell ring it was
 * taken from (ring). Consumed by the one da_ops_send_reply that answers it. */
typedef struct da_route {
  da_tctx *ctx;
  da_ring *ring;
  uint32_t slot;
} da_route;

/* Requests by transport, for metrics. */
enum { DA_VIA_NNG = 0, DA_VIA_DOORBELL = 1, DA_VIAS };

/* A client in the quota sense: every connection of one peer process (ipc) or address (tcp)
 * (da_peer.principal). Quotas count here, so opening more connections buys nothing. */
typedef struct tenant {
  uint64_t principal;
  int n_conns;             /* connections (client structs) that refer to it */
  int n_seqs;              /* sequences open */
  int64_t inflight_tokens; /* Forward tokens admitted and not yet answered */
  struct tenant *next;     /* hash chain */
} tenant;

typedef struct client {
  uint32_t id;
  da_peer peer; /* who connected: credentials and the principal (transport.h) */
  tenant *t;    /* quotas */
  int dead;
  int stats_all; /* may see every client's numbers in Stats */
  int n_seqs;    /* sequences it owns, listed from seqs */
  seq_slot *seqs;
  int n_reqs;    /* requests alive that point at it */
  uint64_t last_ns; /* connect, or its latest request */
  uint64_t requests, errors, forward_tokens;
  uint64_t op_ok[DA_OP_COUNT], op_errors[DA_OP_COUNT];
  da_sched_queue q;
  request *held_head, *held_tail; /* waiting for a sequence to go idle */
  int drain_marked;
  int ev_waiting;            /* its first held request waits for a CUDA event: on ev_list */
  struct client *ev_next;
  struct client *hnext;      /* hash chain */
  struct client *drain_next; /* clients whose held requests may now run */
} client;

struct seq_slot {
  uint64_t wire; /* 0: free */
  uint32_t generation;
  client *owner;
  seq_slot *onext, *oprev; /* the owner's list */
  int pending; /* admitted items not yet completed */
  int closing; /* owner gone: close when pending reaches 0 */
};

struct request {
  da_route route;
  client *cl;
  da_wire_request w;
  uint64_t recv_ns;
  uint64_t admit_ns; /* --phase-timing: admitted (0: not yet, or not a decode Forward) */
  int status;
  char err[256];
  int n_items, items_left;
  int64_t quota_tokens; /* counted in its tenant's inflight_tokens until freed */
  da_sched_item *items;
  uint32_t *holds; /* arenas held for this request's tensors (plane.h), one entry a hold */
  int n_holds;
  void *out; /* o and lse buffers of all items */
  void *wait_ev, *signal_ev; /* cuda plane events, held (plane.h) while set */
  int wait_done;             /* wait_ev has completed */
  uint64_t batch_stamp;
  request *next; /* held queue */
};


typedef struct da_daemon {
  const da_config *cfg;
  da_model model;
  da_numerics num;
  uv_loop_t loop;
  uv_async_t ev_async, done_async;
  uv_signal_t sigterm, sigint;
  uv_timer_t wait_timer, linger_timer, drain_timer, idle_timer, watchdog_timer, listen_timer, ev_timer;
  uv_idle_t ev_idle;  /* polls the CUDA events requests wait for (ev_list) */
  client *ev_list;
  int form_failing; /* the last batch could not be formed (out of memory): retrying */
  int n_handles; /* open uv handles */
  da_backend *be;
  const da_backend_info *info;
  da_kvcache *kv;
  da_sched *sched;
  da_worker *worker;
  da_transport *tr;
  da_planes *planes;
  da_doorbell *doorbell; /* NULL: not offered (not ipc, no side socket, or --doorbell 0) */
  da_sched_batch bufs[DA_WORKER_MAX];
  int buf_busy[DA_WORKER_MAX]; /* handed to the worker, not yet taken back */
  int n_running;               /* batches in the worker */
  uint64_t batch_counter;
  client *buckets[N_BUCKETS];
  tenant *tenants[N_BUCKETS];
  int n_clients;
  int64_t quota_seqs, quota_kv_tokens, quota_inflight_tokens; /* per tenant, resolved at start */
  uint32_t gone[N_GONE]; /* recently disconnected pipe ids; see on_request */
  uint64_t n_gone;
  client *drain_list;
  seq_slot *seqs;
  int max_seqs;
  int n_held;
  int loop_inited;
  int draining, fatal, stopping, lingered;
  int exit_code;
  uint64_t start_ns;
  int max_connections; /* after the open-file limit check */
  uint32_t self_uid;
  uint32_t stats_uids[64];
  int n_stats_uids;
  /* stats (histograms: kernels/hist.h; times in ns) */
  uint64_t requests, errors, forward_tokens, batches, inrow_rows, partial_rows;
  uint64_t op_ok[DA_OP_COUNT], op_errors[DA_OP_COUNT];
  da_hist batch_tokens, batch_requests, queue_ns, batch_run_ns, batch_submit_ns, cuda_wait_ns;
  da_hist op_ns[DA_OP_COUNT]; /* receipt to reply, per op */
  /* metrics (metrics.h, served by http.h) */
  da_http *http;
  uint64_t op_codes[DA_OP_COUNT][DA_METRICS_CODES]; /* replies by op and status code */
  uint64_t tensor_bytes[DA_METRICS_PLANES][2];      /* admitted Forwards: [plane][in, out] */
  uint64_t via[DA_VIAS];                            /* replies by the transport of their request */
  uint64_t ev_queries, ev_query_ns;                 /* cuda plane: ready-event queries, time in them */
  struct da_phases *phases;                         /* --phase-timing, else NULL */
  uint64_t hand_ns[DA_WORKER_MAX];                  /* with it: when each batch buffer went to the worker */
  uint64_t done_at[4];                              /* and the batch being completed: handed, its submit,
                                                     * its finish's end, taken back by the loop */
  uint64_t busy_ns, busy_since;                     /* time with a batch in the worker */
} da_daemon;

/* ---- daemon.c ---- */

/* The sequence c owns under the wire id, or NULL when it is not open on c (or is closing). */
seq_slot *da_daemon_seq_find(da_daemon *d, client *c, uint64_t wire);
/* Binds KV cache handle h, just opened or forked, to a fresh wire id owned by c and stores
 * it in *wire. Returns 0, or DETATTN_INTERNAL (h closed again) if h is out of the table. */
int da_daemon_seq_new(da_daemon *d, client *c, uint32_t h, uint64_t *wire);
/* Closes the sequence's KV cache handle and frees its slot; may free its owner. */
void da_daemon_seq_release(da_daemon *d, seq_slot *s);
/* Frees c once it is disconnected and nothing refers to it any more. */
void da_daemon_client_maybe_free(da_daemon *d, client *c);
/* c's first held request waits for a CUDA event (cuda plane): poll it, at once while the
 * request is young (since_ns within 2 ms), else every millisecond, and run c's held requests
 * again when it may have completed. */
void da_daemon_event_wait(da_daemon *d, client *c, uint64_t since_ns);
/* Count, mean, max, p50 and p99 of h, each multiplied by scale (1e-3: ns to us). */
void da_daemon_summary_get(const da_hist *h, double scale, da_wire_summary *out);

/* ---- ops.c ---- */

/* Counts the reply in the stats (the daemon's and, when not NULL, client c's, with the time
 * since recv_ns) and sends it by route: on its nng context, or into its doorbell slot
 * (nothing is sent once the transport or the doorbell is closed). Consumes the route; does
 * not take resp. */
void da_ops_send_reply(da_daemon *d, client *c, const da_route *route, da_op op, uint64_t recv_ns,
                       const da_wire_response *resp);
/* Answers r with code and msg and frees r. */
void da_ops_reply_error(da_daemon *d, request *r, int code, const char *msg);
/* Frees r and drops its reference to its client (which may free the client). */
void da_ops_request_free(da_daemon *d, request *r);
/* Runs a new request through the op table: answered, admitted, or held behind the client's
 * waiting requests (ordered ops) or until its sequence goes idle. Takes r. */
void da_ops_dispatch(da_daemon *d, request *r);
/* Runs the client's waiting requests in order until one must wait again. */
void da_ops_drain_held(da_daemon *d, client *c);
/* Answers a Forward whose items have all completed (its outputs, or r->status) and frees r. */
void da_ops_forward_done(da_daemon *d, request *r);

#endif /* DA_DAEMON_IMPL_H */
