/*
 * scheduler.h — the batch scheduler (prefix da_sched_; the file is not sched.h so that it
 * cannot shadow the system <sched.h>): pure logic over the KV cache bookkeeping, no nng, no uv.
 *
 * Work arrives as items: one sequence's part of one Forward request (n tokens at positions
 * [pos, pos + n) of one layer). Admission (da_sched_admit) is atomic over all items of a
 * request: every item is checked, the page costs are summed, and the K/V appends are
 * reserved in the KV cache all together or not at all. Admitted items wait in their
 * client's queue (da_sched_queue, FIFO in arrival order).
 *
 * Batch formation (da_sched_form) is the chunked-prefill policy of serving engines, made
 * fair per tenant. A unit is one S-aligned query chunk of a queue's head item: the queries
 * from the item's next position up to the next multiple of S (split_tokens) or the item's
 * end. An item's K/V append goes into the batch of its first chunk (write before attend);
 * later chunks only attend. Chunks of one item in one batch merge into one attention entry.
 * Batch cost = appended tokens + query tokens, at most max_batch_tokens.
 *  1. Decode first: every queue whose head item is a decode item (at most decode_tokens
 *     tokens: a decode step or a short speculative verify) gives its unit, round-robin over
 *     tenants, until the budget is spent.
 *  2. Prefill fills the rest, one unit per tenant per round, with at most
 *     max_prefill_tokens query tokens of prefill items per batch (a unit is cut shorter to
 *     fit: chunking never changes a bit): a batch's run time, and with it how long a decode
 *     step can wait behind a running batch, stays bounded however much prefill is queued.
 *     Decode leaves room for the first chunk of the largest request, so prefill always
 *     progresses.
 * Tenants: queues (connections) with the same tenant key (the daemon uses the peer process
 * or address) share one turn per round, so opening more connections buys no more share.
 * Within a tenant its queues take turns. A queue's next item starts only once its head
 * item is fully dispatched, so each queue's work (and with it each (sequence, layer)) is
 * dispatched in arrival order.
 *
 * Copy-on-write page copies planned at admission go into the next batch formed, whatever
 * work it carries; a batch performs its copies before its appends, so a copy always reads
 * its source page before any later-admitted work can reuse or overwrite it.
 *
 * Each batch snapshots the page tables it uses into memory it owns, so the KV cache may
 * change while the batch runs. The split mode: with partial_rows < 0 (the daemon's default)
 * AUTO, the backend's choice per batch and row from what its device runs fastest (the CUDA
 * backend: partials where the in-row blocks cannot fill the SMs, and one-split tails for long
 * decode rows of launches that fill them; the CPU backend: partials where the in-row items
 * cannot keep its threads busy), within the accumulator slots it has free. With
 * partial_rows >= 0, chosen here from the batch's shape: PARTIAL when it has fewer than
 * partial_rows (token, q-head) rows, some row spans two or more splits, and its partials fit
 * the accumulator slots; INROW otherwise. Results never depend on the choice.
 *
 * Thread: not thread-safe; the daemon's loop thread owns it. A formed batch may be handed
 * to another thread to run and given back to da_sched_complete.
 */
#ifndef DA_SCHEDULER_H
#define DA_SCHEDULER_H

#include <stdint.h>

#include "backend.h"
#include "kvcache.h"

typedef struct da_sched da_sched;
typedef struct da_sched_item da_sched_item;
typedef struct da_sched_tenant da_sched_tenant;

/* A client's FIFO of admitted items; embedded in the caller's client object. Zero it (or
 * da_sched_queue_init) and set tenant before first use. It must stay alive while it holds
 * items. */
typedef struct da_sched_queue {
  uint64_t tenant; /* fairness key, set by the caller: queues with equal keys share a turn */
  da_sched_item *head, *tail;
  struct da_sched_queue *next, *prev; /* the tenant's ring of queues with work */
  da_sched_tenant *t;                 /* set while linked */
  int linked;
} da_sched_queue;

struct da_sched_item {
  /* Set by the caller before da_sched_admit. */
  uint32_t kv_seq;  /* KV cache sequence handle */
  uint64_t wire_seq; /* for messages */
  int layer, pos, n;
  const void *q, *k, *v; /* q: [n][n_q_heads][head_dim]; k, v: [n][n_kv_heads][head_dim] */
  void *o;               /* out: [n][n_q_heads][head_dim] */
  float *lse;            /* out, optional: [n][n_q_heads] */
  int dev_q, dev_kv;     /* q/o/lse, k/v are device addresses (da_attn.dev, da_append.dev) */
  void *signal;          /* a backend event to record once a batch with this item ran, or NULL */
  void *user;            /* the caller's request */
  uint64_t admitted_ns;  /* set by da_sched_admit */
  /* Scheduler state. */
  int appended; /* the append is in a formed batch */
  int q_next;   /* queries [0, q_next) are in formed batches */
  int q_done;   /* queries completed */
  int in_batch; /* index of this item's entry in the batch being formed, or -1 */
  da_sched_item *next;
};

typedef struct da_sched_cfg {
  da_model model;
  int split_tokens;
  int page_tokens;
  int max_batch_tokens;   /* appended + query tokens per batch */
  int max_request_tokens; /* most tokens one admission carries */
  int acc_slots;          /* accumulator slots the backend has */
  int partial_rows;       /* < 0: the backend chooses (AUTO); else below this many rows a batch may run partials */
  int decode_tokens;      /* items of at most this many tokens are decode work (0: 16) */
  int max_prefill_tokens; /* query tokens of prefill items per batch (0: no limit) */
} da_sched_cfg;

/* One attention entry of a batch: queries [q0, q0 + nq) of item (offsets within it). */
typedef struct da_sched_entry {
  da_sched_item *item;
  int q0, nq;
  int appends; /* this batch carries the item's K/V append */
} da_sched_entry;

typedef struct da_sched_batch {
  da_batch b; /* what the backend runs; points into the arrays below */
  da_sched_entry *entries; /* parallel to b.attns */
  int n_entries;
  int tokens;       /* appended + query tokens */
  int query_tokens;
  int64_t rows;     /* query tokens x q heads */
  uint64_t formed_ns;
  /* owned storage */
  da_page_copy *copies;
  int cap_copies;
  da_append *appends;
  da_attn *attns;
  void **signals;
  int cap_entries;
  int32_t *pages;
  size_t n_pages, cap_pages;
} da_sched_batch;

int da_sched_alloc(da_sched **out, const da_sched_cfg *cfg, da_kvcache *kv);
void da_sched_free(da_sched *s);

void da_sched_queue_init(da_sched_queue *q);

/*
 * Admits the n items of one request into queue q, atomically. Items must name distinct
 * sequences. Errors (message in err, nothing changed):
 *  FAILED_PRECONDITION: an item's pos is not its layer's current length (expected, got);
 *  NOT_FOUND / INVALID_ARGUMENT: as da_kvcache_append_cost reports;
 *  RESOURCE_EXHAUSTED: the items need more pages than are free (needed, free).
 */
int da_sched_admit(da_sched *s, da_sched_queue *q, da_sched_item *items, int n, uint64_t now_ns,
                   char *err, size_t errlen);

/* Removes q's items whose K/V append is not in any batch yet (a client went away) and calls
 * done(arg, item) for each, in queue order; nothing of them reaches the backend. Their
 * pages stay reserved in the KV cache until the caller closes the sequence. Items already
 * started keep running. Returns the number cancelled. */
int da_sched_cancel(da_sched *s, da_sched_queue *q, void (*done)(void *arg, da_sched_item *it), void *arg);

/* Work waiting to be formed: cost in tokens (unappended K/V + undispatched queries), and
 * the admission time of the oldest waiting item (0 if none). */
int64_t da_sched_pending_tokens(const da_sched *s);
/* Decode items admitted and not yet in a formed batch. */
int64_t da_sched_pending_decode(const da_sched *s);
uint64_t da_sched_oldest_ns(const da_sched *s);
/* Items admitted and not yet completed. */
int64_t da_sched_items_in_flight(const da_sched *s);

void da_sched_batch_init(da_sched_batch *b);
void da_sched_batch_fini(da_sched_batch *b);

/*
 * Forms the next batch into b (reusing its storage). Returns 0 with b->n_entries == 0 and
 * b->b.n_copies == 0 when there is nothing to do; RESOURCE_EXHAUSTED if storage for the
 * page-table snapshots cannot be allocated (nothing is taken from the queues then).
 */
int da_sched_form(da_sched *s, da_sched_batch *b, uint64_t now_ns);

/* Records that batch b ran; calls done(arg, item) for every item whose last query chunk
 * was in b (in entry order). */
void da_sched_complete(da_sched *s, da_sched_batch *b, void (*done)(void *arg, da_sched_item *it),
                       void *arg);

#endif /* DA_SCHEDULER_H */
