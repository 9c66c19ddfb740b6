#include "worker.h"

#include <pthread.h>
#include <stdlib.h>

enum { IDLE, QUEUED, RUNNING, DONE };

struct da_worker {
  da_backend *be;
  void (*done)(void *arg);
  void *arg;
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int state;
  int stop;
  const da_batch *batch;
  void *tag;
  int status;
  da_batch_result res;
  uint64_t run_ns;
};

static void *run(void *p) {
  da_worker *w = p;
  pthread_mutex_lock(&w->mu);
  for (;;) {
    while (w->state != QUEUED && !w->stop) pthread_cond_wait(&w->cv, &w->mu);
    if (w->state != QUEUED) break;
    w->state = RUNNING;
    const da_batch *b = w->batch;
    pthread_mutex_unlock(&w->mu);

    da_batch_result res;
    uint64_t t0 = da_now_ns();
    int status = da_backend_run(w->be, b, &res);
    uint64_t t1 = da_now_ns();

    pthread_mutex_lock(&w->mu);
    w->status = status;
    w->res = res;
    w->run_ns = t1 - t0;
    w->state = DONE;
    pthread_mutex_unlock(&w->mu);
    w->done(w->arg);
    pthread_mutex_lock(&w->mu);
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
  if (pthread_mutex_init(&w->mu, NULL) != 0) goto fail_mu;
  if (pthread_cond_init(&w->cv, NULL) != 0) goto fail_cv;
  if (pthread_create(&w->thread, NULL, run, w) != 0) goto fail_thread;
  *out = w;
  return 0;
fail_thread:
  pthread_cond_destroy(&w->cv);
fail_cv:
  pthread_mutex_destroy(&w->mu);
fail_mu:
  free(w);
  return DETATTN_INTERNAL;
}

void da_worker_stop(da_worker *w) {
  if (w == NULL) return;
  pthread_mutex_lock(&w->mu);
  w->stop = 1;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
  pthread_join(w->thread, NULL);
  pthread_cond_destroy(&w->cv);
  pthread_mutex_destroy(&w->mu);
  free(w);
}

int da_worker_busy(const da_worker *w) {
  da_worker *m = (da_worker *)w;
  pthread_mutex_lock(&m->mu);
  int busy = m->state != IDLE;
  pthread_mutex_unlock(&m->mu);
  return busy;
}

void da_worker_submit(da_worker *w, const da_batch *b, void *tag) {
  pthread_mutex_lock(&w->mu);
  w->batch = b;
  w->tag = tag;
  w->state = QUEUED;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

int da_worker_take(da_worker *w, void **tag, int *status, da_batch_result *res, uint64_t *run_ns) {
  pthread_mutex_lock(&w->mu);
  int done = w->state == DONE;
  if (done) {
    *tag = w->tag;
    *status = w->status;
    *res = w->res;
    *run_ns = w->run_ns;
    w->state = IDLE;
    w->batch = NULL;
  }
  pthread_mutex_unlock(&w->mu);
  return done;
}
