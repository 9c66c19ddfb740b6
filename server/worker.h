/*
 * worker.h — the backend worker: one thread that runs batches through da_backend_run, one
 * at a time, and tells the loop when one is done.
 *
 * Thread: da_worker_submit and da_worker_take are called from the loop thread only. The
 * done callback runs on the worker thread; it must only wake the loop (uv_async_send).
 */
#ifndef DA_WORKER_H
#define DA_WORKER_H

#include "backend.h"

typedef struct da_worker da_worker;

/* Starts the thread. done(arg) is called after each batch finishes. */
int da_worker_start(da_worker **out, da_backend *be, void (*done)(void *arg), void *arg);
/* Stops and joins the thread after the running batch (if any) finishes. NULL is a no-op. */
void da_worker_stop(da_worker *w);

/* Non-zero while a batch is submitted and not yet taken back. */
int da_worker_busy(const da_worker *w);
/* Hands b to the worker. Requires !da_worker_busy. b and everything it points to must stay
 * valid until da_worker_take returns it. */
void da_worker_submit(da_worker *w, const da_batch *b, void *tag);
/* If the submitted batch finished, returns 1 and its tag, da_backend_run's status, its
 * result and the run time; the worker is then idle. Returns 0 if it is still running or
 * nothing was submitted. */
int da_worker_take(da_worker *w, void **tag, int *status, da_batch_result *res, uint64_t *run_ns);

#endif /* DA_WORKER_H */
