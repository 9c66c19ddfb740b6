/*
 * backend.h — the attention backend interface: a const ops table per backend (CPU, CUDA)
 * and the one module that calls through it (kernels/backend.c).
 *
 * A backend owns the memory pools of DESIGN.md §3: the KV pool (n_pages pages, each
 * holding page_tokens tokens of K and V for every layer and kv head), the accumulator
 * pool (acc_slots slots of (o fp32[head_dim], lse fp32) for splits run as partials), and
 * for device backends, staging buffers. All of it is allocated in create(); run() never
 * allocates.
 *
 * Page ids are chosen by the caller (server/kvcache.c); the backend only reads and writes
 * the pages it is told to. Every backend implements the determinism contract of
 * DESIGN.md §1 exactly: write before attend, fixed splits of S tokens at absolute
 * positions, fixed tiles of T, online softmax, split finalize, left-fold merge.
 */
#ifndef DA_BACKEND_H
#define DA_BACKEND_H

#include "da.h"

typedef struct da_backend_cfg {
  da_model model;
  da_numerics num;
  int page_tokens;      /* tokens per page, a power of two in [8, 256] */
  int n_pages;          /* KV pool size in pages */
  int acc_slots;        /* accumulator pool slots; 0: backend default */
  size_t staging_bytes; /* device backends: bytes per staging buffer; 0: sized for max_batch_tokens */
  int max_batch_tokens; /* the most query + appended tokens one batch will carry (0: unknown) */
  int n_threads;        /* CPU backend: worker threads, 0: number of online CPUs */
  int device;           /* CUDA backend: device ordinal */
  int poison;           /* tests: fill pools with NaN at create and accumulators per batch */
} da_backend_cfg;

typedef struct da_backend_info {
  char name[16];           /* "cpu", "cuda" */
  char arch[32];           /* "x86_64", "sm_90", ... */
  uint32_t kernel_version; /* bumped whenever a kernel's arithmetic changes */
  uint64_t fingerprint;    /* da_fingerprint of the above with the model and numerics */
  int n_pages;
  int acc_slots;
  size_t kv_bytes, acc_bytes, staging_bytes;
  int max_batch_tokens;    /* most query + appended tokens one batch may carry (staging) */
  size_t mem_total;        /* device backends: the device's memory, and what was free once the */
  size_t mem_free;         /* pools were taken; 0 when unknown (the CPU backend) */
} da_backend_info;

/* Copy a whole page (every layer, K and V) from src to dst: copy-on-write after fork. */
typedef struct da_page_copy {
  int32_t src, dst;
} da_page_copy;

/* Write K/V of n_tokens tokens at absolute positions [pos, pos + n_tokens) of one layer.
 * Token t goes to page pages[t / page_tokens], slot t % page_tokens. */
typedef struct da_append {
  int layer;
  int pos;
  int n_tokens;
  const int32_t *pages; /* page table, covering at least [0, pos + n_tokens) */
  int n_pages;
  const void *k; /* [n_tokens][n_kv_heads][head_dim], model dtype */
  const void *v; /* [n_tokens][n_kv_heads][head_dim] */
  int dev;       /* k and v are device addresses (da_backend_map_*): the backend reads them
                    with a kernel instead of staging them on the host */
} da_append;

/* Causal attention for n_q query tokens at absolute positions [q_pos, q_pos + n_q) of one
 * layer of one sequence. Query at p attends to keys [w0, p] (w0 from the window), read
 * through the page table; those keys must be written (by this batch's appends or before). */
typedef struct da_attn {
  int layer;
  int q_pos;
  int n_q;
  const int32_t *pages; /* page table, covering at least [0, q_pos + n_q) */
  int n_pages;
  const void *q; /* [n_q][n_q_heads][head_dim], model dtype */
  void *o;       /* out: [n_q][n_q_heads][head_dim], model dtype */
  float *lse;    /* out, optional: [n_q][n_q_heads], natural log, or NULL */
  int dev;       /* q, o and lse are device addresses (da_backend_map_*): read and written by
                    kernels, never staged or unpacked on the host */
} da_attn;

/* How the splits of a row run. Both ways give the same bits; AUTO lets the backend pick
 * per work item from load and free accumulator slots. */
typedef enum da_split_mode {
  DA_SPLIT_AUTO = 0,
  DA_SPLIT_INROW = 1,   /* every split of a row folded in one thread / CTA */
  DA_SPLIT_PARTIAL = 2, /* splits as partials in the accumulator pool, then combine */
} da_split_mode;

/* One batch. The backend performs, in this order: all copies, all appends, all attns.
 * Pointers are host memory (or device addresses where an item says dev) and stay valid
 * until run() returns. */
typedef struct da_batch {
  const da_page_copy *copies;
  int n_copies;
  const da_append *appends;
  int n_appends;
  const da_attn *attns;
  int n_attns;
  da_split_mode split_mode;
  void *const *signals; /* device backends: events (da_backend_event_open) recorded once the */
  int n_signals;        /* batch's outputs are written */
} da_batch;

typedef struct da_batch_result {
  int64_t inrow_rows;   /* (query token, q head) rows whose splits ran in-row */
  int64_t partial_rows; /* rows whose splits ran as partials + combine */
  char err[256];        /* message when run() fails */
} da_batch_result;

typedef struct da_backend_ops {
  const char *name;
  /* Optional. Non-zero if the backend can run on this machine (a device is present). */
  int (*available)(void);
  /* Required. Validates cfg, allocates all pools, fills info. Any thread. On failure
   * writes a message to err and allocates nothing. */
  int (*create)(void **ctx, const da_backend_cfg *cfg, da_backend_info *info, char *err,
                size_t errlen);
  /* Required. Frees everything create() allocated. */
  void (*destroy)(void *ctx);
  /* Required. Runs one batch to completion; blocks. Called from one thread at a time.
   * Returns DETATTN_INTERNAL (message in res->err) on a device failure; a sticky device
   * error returns DETATTN_UNAVAILABLE and every later call fails the same way. */
  int (*run)(void *ctx, const da_batch *b, da_batch_result *res);
  /* Optional, present together with finish (device backends). Starts batch b and returns
   * without waiting for the device: validates it, stages it into a free staging buffer set,
   * and enqueues its copies, appends, attention and the copy-back of its outputs. At most
   * DA_BACKEND_MAX_INFLIGHT batches are submitted and not yet finished; a further submit
   * fails with DETATTN_FAILED_PRECONDITION. b, everything it points to and the da_attn
   * output buffers must stay valid until finish() returns this batch's result. The device
   * runs submitted batches in submission order, with the same kernels as run(), so the
   * results are those of run() called in the same order. ready(arg), when not NULL, is
   * called once the batch's device work has ended (finish() will then not wait for the
   * device); it may run on a driver thread, before submit returns, and must only wake
   * someone. On failure (res->err says why) nothing of b is in flight, ready is not
   * called, and there is nothing to finish for it; a sticky device error returns
   * DETATTN_UNAVAILABLE. Same thread rules as run(); run() must not be called while
   * batches are in flight. */
  int (*submit)(void *ctx, const da_batch *b, void (*ready)(void *arg), void *arg,
                da_batch_result *res);
  /* Optional, with submit. Waits for the oldest submitted batch, writes its outputs to the
   * o and lse host pointers of its da_attn items and fills res; returns its status, as
   * run() would have (DETATTN_INTERNAL or DETATTN_UNAVAILABLE with res->err on a device
   * failure). DETATTN_FAILED_PRECONDITION when nothing is in flight. */
  int (*finish)(void *ctx, da_batch_result *res);
  /* Optional, with submit: 1 when the oldest submitted batch has completed on the device (or
   * failed: finish then says how), so finish will not wait; 0 not yet. Never blocks; the
   * thread that submits. With poll a caller may submit with ready NULL and poll instead of
   * waiting for the notification (which costs the device a host callback per batch). */
  int (*poll)(void *ctx);
  /* Optional (device backends): memory and events of other processes for the data planes,
   * any thread. map_host pins n bytes of host memory at p (page-aligned) for the device and
   * gives its device address; map_ipc opens a CUDA IPC memory handle of at least size
   * bytes. event_open opens an IPC event handle; event_query: 1 when the event's work is
   * done, 0 not yet, a negative status on error. Errors write err. */
  int (*map_host)(void *ctx, void *p, size_t n, void **dev, char *err, size_t errlen);
  void (*unmap_host)(void *ctx, void *p);
  int (*map_ipc)(void *ctx, const void *handle, size_t handle_len, uint64_t size, void **dev, char *err,
                 size_t errlen);
  void (*unmap_ipc)(void *ctx, void *dev);
  int (*event_open)(void *ctx, const void *handle, size_t handle_len, void **ev, char *err, size_t errlen);
  void (*event_close)(void *ctx, void *ev);
  int (*event_query)(void *ctx, void *ev);
} da_backend_ops;

/* Most batches submitted and not yet finished (staging buffer sets of a device backend). */
#define DA_BACKEND_MAX_INFLIGHT 2

extern const da_backend_ops da_cpu_backend_ops;
#ifdef DETATTN_HAVE_CUDA
extern const da_backend_ops da_cuda_backend_ops;
#endif

typedef struct da_backend da_backend;

/* name: "cpu", "cuda", or "auto" (cuda when built and a device is present, else cpu). */
int da_backend_open(da_backend **out, const char *name, const da_backend_cfg *cfg, char *err,
                    size_t errlen);
/* The same for a backend not built in, from its table (tests: a stand-in device). */
int da_backend_open_ops(da_backend **out, const da_backend_ops *ops, const da_backend_cfg *cfg, char *err,
                        size_t errlen);
void da_backend_close(da_backend *be);
int da_backend_run(da_backend *be, const da_batch *b, da_batch_result *res);
/* Asynchronous pair with the contracts of ops.submit / ops.finish above, for every backend:
 * where the backend has no submit, submit only queues b (and calls ready at once) and
 * finish runs the oldest queued batch with run(). Either way results come back from
 * finish in submission order. Not to be mixed with da_backend_run while batches are in
 * flight. */
int da_backend_submit(da_backend *be, const da_batch *b, void (*ready)(void *arg), void *arg,
                      da_batch_result *res);
int da_backend_finish(da_backend *be, da_batch_result *res);
/* Batches submitted and not yet finished. */
int da_backend_inflight(const da_backend *be);
/* Non-zero when a submitted batch's staging overlaps the running one's device work (the
 * backend has submit/finish); otherwise submitting ahead only queues it. */
int da_backend_overlaps(const da_backend *be);
const da_backend_info *da_backend_get_info(const da_backend *be);
/* The backend's poll op: 1 (also with nothing in flight), 0 not yet; -1 when it has none. */
int da_backend_poll(da_backend *be);
/* The optional ops above; DETATTN_UNIMPLEMENTED (err set) where the backend has none. */
int da_backend_has_device_memory(const da_backend *be);
int da_backend_map_host(da_backend *be, void *p, size_t n, void **dev, char *err, size_t errlen);
void da_backend_unmap_host(da_backend *be, void *p);
int da_backend_map_ipc(da_backend *be, const void *handle, size_t handle_len, uint64_t size, void **dev, char *err,
                       size_t errlen);
void da_backend_unmap_ipc(da_backend *be, void *dev);
int da_backend_event_open(da_backend *be, const void *handle, size_t handle_len, void **ev, char *err, size_t errlen);
void da_backend_event_close(da_backend *be, void *ev);
int da_backend_event_query(da_backend *be, void *ev);
const da_backend_cfg *da_backend_get_cfg(const da_backend *be);

#endif /* DA_BACKEND_H */
