/*
 * worker.h — the backend worker: one thread that drives the backend through
 * da_backend_submit / da_backend_finish with up to DA_WORKER_MAX batches, and tells the
 * loop when one is done.
 *
 * A batch handed over is submitted to the backend at once, even while the previous one is
 * still on the device, so its staging (host packing, H2D) overlaps that batch's kernels
 * (backend.h). The worker finishes batches in the order they were handed over, and
 * da_worker_take returns them in that order. On a backend without submit/finish the
 * fallback runs each batch in finish(), one at a time, as before.
 *
 * Thread: da_worker_submit, da_worker_take, da_worker_count, da_worker_set_spin,
 * da_worker_idle_sleeps, da_worker_wait_sleeps, da_worker_late_yields and da_worker_fail_from
 * are called from the
 * loop thread only. The done callback runs on the
 * worker thread; it must only wake the loop (uv_async_send).
 */
#ifndef DA_WORKER_H
#define DA_WORKER_H

#include "backend.h"

/* Most batches handed over and not yet taken back. */
#define DA_WORKER_MAX DA_BACKEND_MAX_INFLIGHT

typedef struct da_worker da_worker;

/* Starts the thread. done(arg) is called after each batch finishes. */
int da_worker_start(da_worker **out, da_backend *be, void (*done)(void *arg), void *arg);
/* Stops and joins the thread after the batches handed over (if any) finish. NULL is a
 * no-op. */
void da_worker_stop(da_worker *w);

/* Idle, the worker spins for the next batch before it sleeps on its condition variable (once
 * per idle period): spin_us (0: never spin), or half again the last idle period (from running
 * out of work to the next batch) if longer, at most spin_max_us (0: spin_us only). A yield
 * of the spin that comes back late_us or more late ends it and stops the following for a
 * while (doorbell_ring.h, da_spin_guard; 0: never). On a backend with poll, the worker
 * waits for a submitted batch by polling: yielding between polls for 200 us, or as long as
 * the last polled batch took and half again, up to spin_max_us (the same guard), then
 * sleeping 20 us between polls. Call before the first submit. */
void da_worker_set_spin(da_worker *w, int spin_us, int spin_max_us, int late_us);
/* Idle periods that ended with the worker asleep (a batch handed over while it spun needs no
 * wake-up). */
uint64_t da_worker_idle_sleeps(const da_worker *w);
/* Polled batches whose completion the worker saw only after sleeping (the batch outlasted
 * the poll's spin). */
uint64_t da_worker_wait_sleeps(const da_worker *w);
/* The worker's spin yields that came back late (no idle core). */
uint64_t da_worker_late_yields(const da_worker *w);
/* Tests only: batch n (counting from 1 in hand-over order) and every later one are not
 * given to the backend; they come back with DETATTN_UNAVAILABLE "injected device failure",
 * as a sticky device error would. 0: off. Call before the first submit. */
void da_worker_fail_from(da_worker *w, uint64_t n);

/* Batches handed over and not yet taken back, 0 to DA_WORKER_MAX. */
int da_worker_count(const da_worker *w);
/* Non-zero while any batch is handed over and not yet taken back. */
int da_worker_busy(const da_worker *w);
/* Hands b to the worker. Requires da_worker_count < DA_WORKER_MAX. b and everything it
 * points to must stay valid until da_worker_take returns it. */
void da_worker_submit(da_worker *w, const da_batch *b, void *tag);
/* A finished batch's times (da_now_ns clock). */
typedef struct da_worker_times {
  uint64_t t0_ns;     /* its da_backend_submit began */
  uint64_t run_ns;    /* from then to the end of its finish */
  uint64_t submit_ns; /* of run_ns, da_backend_submit (a device backend's host staging and
                       * launches; next to nothing where the backend runs batches in finish) */
} da_worker_times;

/* If the oldest batch handed over has finished, returns 1 and its tag, its status (that of
 * da_backend_submit if it failed, else of da_backend_finish), its result and its times.
 * Returns 0 if it is still running or nothing was handed over. */
int da_worker_take(da_worker *w, void **tag, int *status, da_batch_result *res, da_worker_times *t);

#endif /* DA_WORKER_H */
