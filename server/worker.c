#include "worker.h"

#include <errno.h>
#include <pthread.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "doorbell_ring.h" /* da_ring_spin_follow, da_spin_guard */

/* How long the worker waits for a submitted batch's ready notification before it calls
 * finish anyway (finish then waits on the device itself): a backend whose notification
 * never comes (a failed device) costs this much, never a hang. */
#define READY_WAIT_MS 1000

enum { FREE, QUEUED, SUBMITTED, DONE };

typedef struct slot {
  const da_batch *batch;
  void *tag;
  int state;
  int status;
  da_batch_result res;
  uint64_t t0, run_ns;
  uint64_t submit_ns; /* of run_ns, the time in da_backend_submit */
} slot;

struct da_worker {
  da_backend *be;
  void (*done)(void *arg);
  void *arg;
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int stop;
  int polls; /* the backend has poll: no ready notification, the worker polls instead */
  slot slots[DA_WORKER_MAX]; /* a ring in hand-over order */
  int head, n;
  int n_ready; /* ready notifications not yet used by a finish */
  int owed;    /* finishes done without their notification: absorb it when it comes */
  uint64_t fail_from, n_submitted;
  uint64_t spin_ns;     /* idle: spin at least this long for the next batch before sleeping */
  uint64_t spin_max_ns; /* or half again the last idle gap, up to this (0: spin_ns only) */
  uint64_t idle_gap_ns; /* worker thread: the last idle period, its start to the next batch */
  uint64_t idle_sleeps; /* idle periods that ended asleep: written by the worker, read atomically */
  uint64_t last_run_ns; /* worker thread: the last polled batch, submit's start to its completion seen */
  uint64_t wait_sleeps; /* polled batches whose completion was seen after a sleep (read atomically) */
  da_spin_guard guard;  /* the spin's late yields */
  unsigned handed;  /* batches handed over, ever: written under mu, read atomically by the spin */
};

static slot *at(da_worker *w, int i) { return &w->slots[(w->head + i) % DA_WORKER_MAX]; }

static void on_ready(void *p) {
  da_worker *w = p;
  pthread_mutex_lock(&w->mu);
  if (w->owed > 0) w->owed--;
  else w->n_ready++;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

static slot *first(da_worker *w, int state) {
  for (int i = 0; i < w->n; i++)
    if (at(w, i)->state == state) return at(w, i);
  return NULL;
}

/* Called and returns with w->mu held. */
static void do_submit(da_worker *w, slot *s) {
  const da_batch *b = s->batch;
  uint64_t seq = ++w->n_submitted;
  int inject = w->fail_from > 0 && seq >= w->fail_from;
  s->state = SUBMITTED; /* not QUEUED any more while the lock is dropped */
  pthread_mutex_unlock(&w->mu);
  da_batch_result res;
  uint64_t t0 = da_now_ns();
  int status;
  if (inject) {
    res.inrow_rows = res.partial_rows = 0;
    snprintf(res.err, sizeof(res.err), "injected device failure (batch %llu)", (unsigned long long)seq);
    status = DETATTN_UNAVAILABLE;
  } else {
    status = da_backend_submit(w->be, b, w->polls ? NULL : on_ready, w, &res);
  }
  const uint64_t t1 = da_now_ns();
  pthread_mutex_lock(&w->mu);
  s->t0 = t0;
  s->submit_ns = t1 - t0;
  if (status != 0) {
    s->status = status;
    s->res = res;
    s->run_ns = t1 - t0;
    s->state = DONE;
    pthread_mutex_unlock(&w->mu);
    w->done(w->arg);
    pthread_mutex_lock(&w->mu);
  }
}

/* Called and returns with w->mu held; s is the oldest SUBMITTED slot. */
static void do_finish(da_worker *w, slot *s) {
  pthread_mutex_unlock(&w->mu);
  da_batch_result res;
  int status = da_backend_finish(w->be, &res);
  uint64_t t1 = da_now_ns();
  pthread_mutex_lock(&w->mu);
  s->status = status;
  s->res = res;
  s->run_ns = t1 - s->t0;
  s->state = DONE;
  pthread_mutex_unlock(&w->mu);
  w->done(w->arg);
  pthread_mutex_lock(&w->mu);
}

static void deadline(struct timespec *ts, int ms) {
  clock_gettime(CLOCK_MONOTONIC, ts);
  ts->tv_sec += ms / 1000;
  ts->tv_nsec += (long)(ms % 1000) * 1000000L;
  if (ts->tv_nsec >= 1000000000L) ts->tv_sec++, ts->tv_nsec -= 1000000000L;
}

/* Called and returns with w->mu held, which it drops meanwhile: waits up to spin_ns for a
 * batch to be handed over (or stop) without sleeping, so that the next layer's batch, handed
 * over microseconds after this one finished (or after the client's compute between layers),
 * costs no futex wake-up. Bounded. */
static void spin_for_work(da_worker *w, uint64_t spin_ns) {
  unsigned seen = w->handed;
  uint64_t until = da_now_ns() + spin_ns;
  pthread_mutex_unlock(&w->mu);
  while (__atomic_load_n(&w->handed, __ATOMIC_ACQUIRE) == seen && !__atomic_load_n(&w->stop, __ATOMIC_ACQUIRE)) {
    const uint64_t t0 = da_now_ns();
    sched_yield(); /* whoever has work runs first */
    const uint64_t t1 = da_now_ns();
    if (t1 >= until || da_spin_guard_late(&w->guard, t0, t1)) break;
  }
  pthread_mutex_lock(&w->mu);
}

/* Called and returns with w->mu held, which it drops meanwhile: polls the backend until
 * the oldest submitted batch (s) has completed (1), a batch was handed over (0: submit it
 * first), or READY_WAIT_MS passed (1: finish waits on the device itself). Yields between
 * polls for POLL_SPIN_NS, or as long as the last polled batch took and half again (up to
 * spin_max_ns, the rule of the idle spin: a serving loop's layers are batches of one size),
 * then sleeps POLL_SLEEP_NS between them, so that a long prefill batch does not hold a core.
 * A late yield (no idle core) ends the spin. With a fixed 200 us spin every decode batch of a
 * longer layer call was seen asleep, up to a sleep and the timer's slack late (NOTES.md
 * v5.31). A device backend's ready notification costs the stream a host callback that
 * blocks its next batch; this costs a core for the batch's time. */
#define POLL_SPIN_NS 200000ull
#define POLL_SLEEP_NS 20000L
static int poll_done(da_worker *w, const slot *s) {
  unsigned seen = w->handed;
  uint64_t t0 = da_now_ns();
  const uint64_t max = da_spin_guard_calm(&w->guard, t0) ? w->spin_max_ns : 0;
  const uint64_t spin = da_ring_spin_follow(POLL_SPIN_NS, max, w->last_run_ns);
  int done = 0, slept = 0, spinning = 1;
  pthread_mutex_unlock(&w->mu);
  for (;;) {
    if (da_backend_poll(w->be) != 0) {
      done = 1;
      w->last_run_ns = da_now_ns() - s->t0;
      if (slept) __atomic_add_fetch(&w->wait_sleeps, 1, __ATOMIC_RELAXED);
      break;
    }
    if (__atomic_load_n(&w->handed, __ATOMIC_ACQUIRE) != seen) break;
    const uint64_t t1 = da_now_ns();
    if (t1 - t0 >= (uint64_t)READY_WAIT_MS * 1000000u) {
      done = 1;
      break;
    }
    if (spinning && t1 - t0 < spin) {
      sched_yield();
      if (da_spin_guard_late(&w->guard, t1, da_now_ns())) spinning = 0;
    } else {
      struct timespec ts = {0, POLL_SLEEP_NS};
      nanosleep(&ts, NULL);
      slept = 1;
    }
  }
  pthread_mutex_lock(&w->mu);
  return done;
}

/* Submits every queued batch as soon as it arrives (so its staging overlaps the running
 * batch), and finishes the oldest submitted one once the backend says it is ready. */
static void *run(void *p) {
  da_worker *w = p;
#ifdef __linux__
  /* The poll's sleeps are short; the default timer slack (50 us) would more than double
   * them. */
  (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
#endif
  int spun = 0;        /* spun since the last batch: the next idle wait sleeps */
  int slept = 0;       /* slept since the last batch */
  uint64_t idle_t = 0; /* when the worker last ran out of work (0: it has work) */
  pthread_mutex_lock(&w->mu);
  for (;;) {
    slot *q = first(w, QUEUED);
    if (q != NULL) {
      if (idle_t != 0) {
        w->idle_gap_ns = da_now_ns() - idle_t;
        if (slept) __atomic_add_fetch(&w->idle_sleeps, 1, __ATOMIC_RELAXED);
        idle_t = 0;
      }
      spun = slept = 0;
      do_submit(w, q);
      continue;
    }
    slot *s = first(w, SUBMITTED);
    if (s != NULL && w->polls) {
      if (poll_done(w, s)) do_finish(w, s);
      continue;
    }
    if (s != NULL) {
      if (w->n_ready == 0) {
        struct timespec ts;
        deadline(&ts, READY_WAIT_MS);
        int rc = 0;
        while (w->n_ready == 0 && first(w, QUEUED) == NULL && rc != ETIMEDOUT)
          rc = pthread_cond_timedwait(&w->cv, &w->mu, &ts);
        if (w->n_ready == 0 && rc != ETIMEDOUT) continue; /* a new batch to submit first */
        if (w->n_ready == 0) w->owed++;
        else w->n_ready--;
      } else {
        w->n_ready--;
      }
      do_finish(w, s);
      continue;
    }
    if (w->stop) break;
    if (idle_t == 0) idle_t = da_now_ns();
    if (w->spin_ns > 0 && !spun) {
      /* A serving loop hands over its layers at a steady rhythm: spin through the last gap
       * (and half again), the same rule as the doorbell's ends, unless a yield came back
       * late (doorbell_ring.h: no idle core). */
      spun = 1;
      const uint64_t max = da_spin_guard_calm(&w->guard, da_now_ns()) ? w->spin_max_ns : 0;
      spin_for_work(w, da_ring_spin_follow(w->spin_ns, max, w->idle_gap_ns));
      continue;
    }
    slept = 1;
    pthread_cond_wait(&w->cv, &w->mu);
  }
  pthread_mutex_unlock(&w->mu);
  return NULL;
}

int da_worker_start(da_worker **out, da_backend *be, void (*done)(void *arg), void *arg) {
  da_worker *w = calloc(1, sizeof(*w));
  if (w == NULL) return DETATTN_RESOURCE_EXHAUSTED;
  w->be = be;
  w->done = done;
  w->arg = arg;
  w->polls = da_backend_poll(be) >= 0;
  pthread_condattr_t ca;
  if (pthread_mutex_init(&w->mu, NULL) != 0) goto fail_mu;
  if (pthread_condattr_init(&ca) != 0) goto fail_ca;
  if (pthread_condattr_setclock(&ca, CLOCK_MONOTONIC) != 0 || pthread_cond_init(&w->cv, &ca) != 0)
    goto fail_cv;
  pthread_condattr_destroy(&ca);
  if (pthread_create(&w->thread, NULL, run, w) != 0) goto fail_thread;
  *out = w;
  return 0;
fail_thread:
  pthread_cond_destroy(&w->cv);
  goto fail_ca;
fail_cv:
  pthread_condattr_destroy(&ca);
fail_ca:
  pthread_mutex_destroy(&w->mu);
fail_mu:
  free(w);
  return DETATTN_INTERNAL;
}

void da_worker_stop(da_worker *w) {
  if (w == NULL) return;
  pthread_mutex_lock(&w->mu);
  __atomic_store_n(&w->stop, 1, __ATOMIC_RELEASE);
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
  pthread_join(w->thread, NULL);
  pthread_cond_destroy(&w->cv);
  pthread_mutex_destroy(&w->mu);
  free(w);
}

void da_worker_set_spin(da_worker *w, int spin_us, int spin_max_us, int late_us) {
  pthread_mutex_lock(&w->mu);
  w->spin_ns = spin_us > 0 ? (uint64_t)spin_us * 1000u : 0;
  w->spin_max_ns = spin_max_us > 0 ? (uint64_t)spin_max_us * 1000u : 0;
  w->guard.late_ns = late_us > 0 ? (uint64_t)late_us * 1000u : 0;
  pthread_mutex_unlock(&w->mu);
}

uint64_t da_worker_idle_sleeps(const da_worker *w) { return __atomic_load_n(&w->idle_sleeps, __ATOMIC_RELAXED); }

uint64_t da_worker_wait_sleeps(const da_worker *w) { return __atomic_load_n(&w->wait_sleeps, __ATOMIC_RELAXED); }

uint64_t da_worker_late_yields(const da_worker *w) { return __atomic_load_n(&w->guard.late, __ATOMIC_RELAXED); }

void da_worker_fail_from(da_worker *w, uint64_t n) {
  pthread_mutex_lock(&w->mu);
  w->fail_from = n;
  pthread_mutex_unlock(&w->mu);
}

int da_worker_count(const da_worker *w) {
  da_worker *m = (da_worker *)w;
  pthread_mutex_lock(&m->mu);
  int n = m->n;
  pthread_mutex_unlock(&m->mu);
  return n;
}

int da_worker_busy(const da_worker *w) { return da_worker_count(w) > 0; }

void da_worker_submit(da_worker *w, const da_batch *b, void *tag) {
  pthread_mutex_lock(&w->mu);
  if (w->n < DA_WORKER_MAX) {
    slot *s = at(w, w->n++);
    s->batch = b;
    s->tag = tag;
    s->state = QUEUED;
    __atomic_store_n(&w->handed, w->handed + 1, __ATOMIC_RELEASE);
    pthread_cond_signal(&w->cv);
  }
  pthread_mutex_unlock(&w->mu);
}

int da_worker_take(da_worker *w, void **tag, int *status, da_batch_result *res, da_worker_times *t) {
  pthread_mutex_lock(&w->mu);
  slot *s = at(w, 0);
  int done = w->n > 0 && s->state == DONE;
  if (done) {
    *tag = s->tag;
    *status = s->status;
    *res = s->res;
    *t = (da_worker_times){.t0_ns = s->t0, .run_ns = s->run_ns, .submit_ns = s->submit_ns};
    s->state = FREE;
    s->batch = NULL;
    w->head = (w->head + 1) % DA_WORKER_MAX;
    w->n--;
  }
  pthread_mutex_unlock(&w->mu);
  return done;
}
