/*
 * A fixed pool of worker threads for the CPU backend: one parallel-for at a time, items
 * handed out from a shared counter. Created once in create(); run() only signals it.
 */
#include <stdlib.h>

#include "cpu_internal.h"

static void drain(da_cpu_pool *p, int tid) {
  for (;;) {
    const int64_t i = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
    if (i >= p->n_items) return;
    p->fn(p->arg, i, tid);
  }
}

typedef struct worker_arg {
  da_cpu_pool *p;
  int tid;
} worker_arg;

static void *worker(void *arg) {
  da_cpu_pool *p = ((worker_arg *)arg)->p;
  const int tid = ((worker_arg *)arg)->tid;
  free(arg);
  uint64_t seen = 0;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (!p->stop && p->gen == seen) pthread_cond_wait(&p->cv_work, &p->mu);
    if (p->stop) break;
    seen = p->gen;
    pthread_mutex_unlock(&p->mu);
    drain(p, tid);
    pthread_mutex_lock(&p->mu);
    if (--p->busy == 0) pthread_cond_signal(&p->cv_done);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

int da_cpu_pool_init(da_cpu_pool *p, int n_threads) {
  memset(p, 0, sizeof(*p));
  p->n_threads = n_threads;
  atomic_init(&p->next, 0);
  if (pthread_mutex_init(&p->mu, NULL) != 0) return DETATTN_INTERNAL;
  if (pthread_cond_init(&p->cv_work, NULL) != 0) goto fail_cv_work;
  if (pthread_cond_init(&p->cv_done, NULL) != 0) goto fail_cv_done;
  p->threads = calloc((size_t)n_threads, sizeof(pthread_t));
  if (p->threads == NULL) goto fail_threads;
  for (int t = 1; t < n_threads; t++) {
    worker_arg *wa = malloc(sizeof(*wa));
    if (wa == NULL) goto fail_start;
    wa->p = p;
    wa->tid = t;
    if (pthread_create(&p->threads[t], NULL, worker, wa) != 0) {
      free(wa);
      goto fail_start;
    }
    p->n_started++;
  }
  return 0;

fail_start:
  da_cpu_pool_fini(p);
  return DETATTN_RESOURCE_EXHAUSTED;
fail_threads:
  pthread_cond_destroy(&p->cv_done);
fail_cv_done:
  pthread_cond_destroy(&p->cv_work);
fail_cv_work:
  pthread_mutex_destroy(&p->mu);
  return DETATTN_RESOURCE_EXHAUSTED;
}

void da_cpu_pool_run(da_cpu_pool *p, da_cpu_task_fn fn, void *arg, int64_t n_items) {
  if (n_items <= 0) return;
  pthread_mutex_lock(&p->mu);
  p->fn = fn;
  p->arg = arg;
  p->n_items = n_items;
  atomic_store_explicit(&p->next, 0, memory_order_relaxed);
  p->busy = p->n_started;
  p->gen++;
  pthread_cond_broadcast(&p->cv_work);
  pthread_mutex_unlock(&p->mu);
  drain(p, 0);
  pthread_mutex_lock(&p->mu);
  while (p->busy > 0) pthread_cond_wait(&p->cv_done, &p->mu);
  pthread_mutex_unlock(&p->mu);
}

void da_cpu_pool_fini(da_cpu_pool *p) {
  if (p->threads == NULL) return;
  pthread_mutex_lock(&p->mu);
  p->stop = 1;
  pthread_cond_broadcast(&p->cv_work);
  pthread_mutex_unlock(&p->mu);
  for (int t = 1; t <= p->n_started; t++) pthread_join(p->threads[t], NULL);
  free(p->threads);
  p->threads = NULL;
  pthread_cond_destroy(&p->cv_done);
  pthread_cond_destroy(&p->cv_work);
  pthread_mutex_destroy(&p->mu);
}
