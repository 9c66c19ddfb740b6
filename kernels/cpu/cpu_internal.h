/*
 * cpu_internal.h — shared between the files of the CPU backend (kernels/cpu/): the context
 * with its pools, the thread pool and the attention work items. Not used outside
 * kernels/cpu/.
 */
#ifndef DA_CPU_INTERNAL_H
#define DA_CPU_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "backend.h"

/* A fixed pool of worker threads running one parallel-for at a time. The caller of
 * da_cpu_pool_run takes part as thread 0; workers are threads 1 .. n_threads - 1. Items
 * are handed out in index order from a shared counter, to whichever thread asks first:
 * callers must make results independent of which thread runs an item. */
typedef void (*da_cpu_task_fn)(void *arg, int64_t item, int tid);

typedef struct da_cpu_pool {
  int n_threads;
  pthread_t *threads;
  int n_started;
  pthread_mutex_t mu;
  pthread_cond_t cv_work, cv_done;
  uint64_t gen;  /* incremented per job, under mu */
  int busy;      /* workers still in the current job, under mu */
  int stop;
  da_cpu_task_fn fn;
  void *arg;
  int64_t n_items;
  atomic_llong next; /* next item to hand out; work distribution only */
} da_cpu_pool;

int da_cpu_pool_init(da_cpu_pool *p, int n_threads);
/* Runs fn(arg, i, tid) for every i in [0, n_items) across the pool; returns when all are
 * done. One caller at a time. */
void da_cpu_pool_run(da_cpu_pool *p, da_cpu_task_fn fn, void *arg, int64_t n_items);
void da_cpu_pool_fini(da_cpu_pool *p);

/* Per-thread scratch for the attention kernels, sized at create for rows_max rows. */
typedef struct da_cpu_scratch {
  float *s;   /* [4][T] scores of up to 4 rows */
  float *p;   /* [4][T] probabilities */
  float *q;   /* [rows_max][head_dim] the block's queries */
  float *acc; /* [rows_max][head_dim] split state */
  float *m, *l;   /* [rows_max] */
  float *fo;  /* [rows_max][head_dim] in-row fold of split results */
  float *flse;    /* [rows_max] */
  float *oj;  /* [head_dim] one split result */
} da_cpu_scratch;

/* How an attention item runs in this batch. */
typedef struct da_cpu_plan {
  int partial;     /* 0: in-row, 1: partials + combine */
  int n_blocks;    /* query-token blocks of qb tokens */
  int jlo, n_splits; /* splits touched by any of its rows: [jlo, jlo + n_splits) */
  int64_t slot_base; /* partial: first accumulator slot */
  int64_t off_main;  /* first item in the main phase */
  int64_t off_comb;  /* first item in the combine phase */
} da_cpu_plan;

typedef struct da_cpu {
  da_backend_cfg cfg;
  int hq, hk, g, d, tile, split, ptok;
  int qb;         /* query tokens per block */
  int rows_max;   /* g * qb */
  size_t page_elems;  /* elements of one (layer, K|V, page): n_kv_heads * page_tokens * d */
  size_t layer_elems; /* elements of one (layer, K|V): n_pages * page_elems */
  uint16_t *kv;   /* K: [layer][page][kv_head][d][page_tokens]; V: [..][page_tokens][d] */
  float *acc;     /* [acc_slots][acc_stride]: o_j fp32[d], lse_j at [d] */
  size_t acc_stride;
  int acc_slots;
  int max_batch_tokens;
  da_cpu_plan *plans;   /* [max_batch_tokens] */
  int64_t *main_offs;   /* [max_batch_tokens + 1] */
  int64_t *comb_offs;   /* [max_batch_tokens + 1] */
  da_cpu_scratch *scr;  /* [n_threads] */
  void *scratch_mem;
  da_cpu_pool pool;
  /* The batch being run. */
  const da_batch *b;
} da_cpu;

/* Attention work items (cpu_attn.c). item indexes the main or the combine phase. */
void da_cpu_main_item(void *arg, int64_t item, int tid);
void da_cpu_comb_item(void *arg, int64_t item, int tid);

/* Window start of a query at position p. */
static inline int da_cpu_w0(int window, int p) {
  return window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

#endif /* DA_CPU_INTERNAL_H */
