/*
 * plane_cuda.c — libdetattn's CUDA plane: the CUDA driver API loaded at run time
 * (libcuda.so.1; libdetattn links no CUDA library), this process's device allocations
 * registered with the daemon once per connection by their CUDA IPC memory handles, and a
 * pool of interprocess events ("inputs ready", recorded on the caller's stream; the daemon
 * polls it before it admits the call, and answers once the outputs are written, so the
 * caller's later work needs no event of the daemon's).
 *
 * A registration covers a whole allocation (cuMemAlloc/cudaMalloc; a tensor never spans
 * two), keyed by its base address and the driver's buffer id, so an allocation freed and
 * another made at the same address is registered anew. Cache entries and events carry
 * the connection generation they were registered on (client.c bumps it when the connection
 * drops; the daemon forgets a closed connection's regions): stale ones are dropped or
 * registered again. State is under c->plane_mu.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_impl.h"

/* The few driver API types and constants used (cuda.h, stable ABI). */
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
enum {
  CU_POINTER_ATTRIBUTE_CONTEXT = 1,
  CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
  CU_POINTER_ATTRIBUTE_BUFFER_ID = 7,
  CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10,
  CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11,
  CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12,
  CU_MEMORYTYPE_DEVICE = 2,
  CU_EVENT_DISABLE_TIMING = 2,
  CU_EVENT_INTERPROCESS = 4,
};
#define CU_IPC_HANDLE_SIZE 64

static struct {
  pthread_once_t once;
  int ok;
  char why[200];
  CUresult (*get_error_string)(CUresult, const char **);
  CUresult (*pointer_get_attribute)(void *data, int attr, CUdeviceptr p);
  CUresult (*pointer_get_attributes)(unsigned n, int *attrs, void **data, CUdeviceptr p);
  CUresult (*ipc_get_mem_handle)(void *handle, CUdeviceptr p);
  CUresult (*ipc_get_event_handle)(void *handle, void *ev);
  CUresult (*event_create)(void **ev, unsigned flags);
  CUresult (*event_destroy)(void *ev);
  CUresult (*event_record)(void *ev, void *stream);
  CUresult (*ctx_get_current)(void **ctx);
  CUresult (*ctx_push)(void *ctx);
  CUresult (*ctx_pop)(void **ctx);
} cu = {.once = PTHREAD_ONCE_INIT};

static void load(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    snprintf(cu.why, sizeof cu.why, "cannot load the CUDA driver (libcuda.so.1): %s", dlerror());
    return;
  }
  struct {
    const char *name;
    void **fn;
  } syms[] = {
      {"cuGetErrorString", (void **)&cu.get_error_string},
      {"cuPointerGetAttribute", (void **)&cu.pointer_get_attribute},
      {"cuPointerGetAttributes", (void **)&cu.pointer_get_attributes},
      {"cuIpcGetMemHandle", (void **)&cu.ipc_get_mem_handle},
      {"cuIpcGetEventHandle", (void **)&cu.ipc_get_event_handle},
      {"cuEventCreate", (void **)&cu.event_create},
      {"cuEventDestroy_v2", (void **)&cu.event_destroy},
      {"cuEventRecord", (void **)&cu.event_record},
      {"cuCtxGetCurrent", (void **)&cu.ctx_get_current},
      {"cuCtxPushCurrent_v2", (void **)&cu.ctx_push},
      {"cuCtxPopCurrent_v2", (void **)&cu.ctx_pop},
  };
  for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
    *syms[i].fn = dlsym(h, syms[i].name);
    if (!*syms[i].fn) {
      snprintf(cu.why, sizeof cu.why, "the CUDA driver lacks %s", syms[i].name);
      return; /* the handle stays open: libcuda is never unloaded */
    }
  }
  cu.ok = 1;
}

int da_cuda_load(void) {
  pthread_once(&cu.once, load);
  return cu.ok ? DETATTN_OK : da_err(DETATTN_FAILED_PRECONDITION, "cuda plane: %s", cu.why);
}

static const char *cu_str(CUresult r) {
  const char *s = NULL;
  if (cu.get_error_string && cu.get_error_string(r, &s) == 0 && s) return s;
  return "unknown CUDA error";
}

/* Makes ctx current on this thread when the thread has none (a thread that never called
 * the CUDA runtime, say); 1 when it pushed (pop with ctx_leave). */
static int ctx_enter(void *ctx) {
  void *cur = NULL;
  if (!ctx || (cu.ctx_get_current(&cur) == 0 && cur != NULL)) return 0;
  return cu.ctx_push(ctx) == 0;
}

static void ctx_leave(int pushed) {
  void *x;
  if (pushed) (void)cu.ctx_pop(&x);
}

static uint64_t conn_gen(detattn_client *c) {
  pthread_mutex_lock(&c->mu);
  uint64_t g = c->conn_gen;
  pthread_mutex_unlock(&c->mu);
  return g;
}

/* ---- allocations ---- */

/* Unregisters idle allocations, least recently used first, until at most keep are live.
 * Entries are only marked dead here: a call being built holds indices into the table. */
static void evict(detattn_client *c, size_t keep) {
  da_cuda_state *s = &c->cuda;
  size_t live = 0;
  for (size_t i = 0; i < s->n_bufs; i++) live += !s->bufs[i].dead;
  while (live > keep) {
    size_t lru = SIZE_MAX;
    for (size_t i = 0; i < s->n_bufs; i++)
      if (!s->bufs[i].dead && s->bufs[i].busy == 0 && (lru == SIZE_MAX || s->bufs[i].last_use < s->bufs[lru].last_use))
        lru = i;
    if (lru == SIZE_MAX) return;
    (void)da_ops_unregister(c, s->bufs[lru].id);
    s->bufs[lru].dead = 1;
    live--;
  }
}

static int buf_register(detattn_client *c, CUdeviceptr base, uint64_t size, uint64_t buffer_id, uint64_t gen,
                        size_t *at) {
  da_cuda_state *s = &c->cuda;
  unsigned char h[CU_IPC_HANDLE_SIZE];
  CUresult r = cu.ipc_get_mem_handle(h, base);
  if (r != 0)
    return da_err(DETATTN_INVALID_ARGUMENT, "cuda plane: cuIpcGetMemHandle of the allocation at 0x%llx: %s",
                  (unsigned long long)base, cu_str(r));
  uint32_t id = 0;
  int st = da_ops_register_cuda(c, 0, h, sizeof h, size, &id);
  if (st == DETATTN_RESOURCE_EXHAUSTED && s->n_bufs > 0) {
    evict(c, s->n_bufs / 2); /* the daemon's region limit (--max-arenas): make room, once */
    st = da_ops_register_cuda(c, 0, h, sizeof h, size, &id);
  }
  if (st != DETATTN_OK) return st;
  if (s->n_bufs == s->cap_bufs) {
    size_t cap = s->cap_bufs ? 2 * s->cap_bufs : 16;
    da_cuda_buf *nb = realloc(s->bufs, cap * sizeof *nb);
    if (!nb) {
      (void)da_ops_unregister(c, id);
      return da_err(DETATTN_RESOURCE_EXHAUSTED, "cuda plane: out of memory");
    }
    s->bufs = nb;
    s->cap_bufs = cap;
  }
  s->bufs[s->n_bufs] = (da_cuda_buf){.base = base, .size = size, .buffer_id = buffer_id, .gen = gen, .id = id};
  *at = s->n_bufs++;
  return DETATTN_OK;
}

void da_cuda_begin(detattn_client *c, da_cuda_use *use) {
  da_cuda_state *s = &c->cuda;
  memset(use, 0, sizeof *use);
  use->gen = conn_gen(c);
  size_t n = 0;
  for (size_t i = 0; i < s->n_bufs; i++) /* the daemon forgot other generations' regions */
    if (!s->bufs[i].dead && s->bufs[i].gen == use->gen) s->bufs[n++] = s->bufs[i];
  s->n_bufs = n;
}

int da_cuda_ref(detattn_client *c, const void *p, size_t len, const char *what, size_t item, da_cuda_use *use,
                uint32_t *id, uint64_t *off) {
  da_cuda_state *s = &c->cuda;
  const CUdeviceptr x = (CUdeviceptr)(uintptr_t)p;

  /* An allocation this call has checked already. */
  for (size_t i = 0; i < use->n; i++) {
    da_cuda_buf *b = &s->bufs[use->at[i]];
    if (x >= b->base && x - b->base <= b->size && len <= b->size - (x - b->base)) {
      *id = b->id;
      *off = x - b->base;
      return DETATTN_OK;
    }
  }
  unsigned mem_type = 0;
  int ipc_ok = 0;
  CUdeviceptr base = 0;
  size_t size = 0;
  unsigned long long buffer_id = 0;
  void *ctx = NULL;
  int attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                 CU_POINTER_ATTRIBUTE_RANGE_SIZE, CU_POINTER_ATTRIBUTE_BUFFER_ID,
                 CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, CU_POINTER_ATTRIBUTE_CONTEXT};
  void *data[] = {&mem_type, &base, &size, &buffer_id, &ipc_ok, &ctx};
  CUresult r = cu.pointer_get_attributes(6, attrs, data, x);
  if (r != 0 || mem_type != CU_MEMORYTYPE_DEVICE)
    return da_err(DETATTN_INVALID_ARGUMENT, "forward_cuda: item %zu: %s is not device memory%s%s", item, what,
                  r ? ": " : "", r ? cu_str(r) : "");
  if (x < base || len > size - (x - base))
    return da_err(DETATTN_INVALID_ARGUMENT,
                  "forward_cuda: item %zu: %s (%zu bytes at 0x%llx) runs past the end of its allocation", item, what,
                  len, (unsigned long long)x);
  if (!ipc_ok)
    return da_err(DETATTN_INVALID_ARGUMENT,
                  "forward_cuda: item %zu: %s is in memory that cannot be shared by CUDA IPC (allocations of the "
                  "virtual memory API, e.g. torch's expandable segments, are not supported)",
                  item, what);
  if (!use->ctx) { /* the first tensor's context: registration and events run in it */
    use->ctx = ctx;
    use->pushed = ctx_enter(ctx);
  }
  size_t at = SIZE_MAX;
  for (size_t i = 0; i < s->n_bufs && at == SIZE_MAX; i++) {
    da_cuda_buf *b = &s->bufs[i];
    if (b->dead || b->base != base) continue;
    if (b->buffer_id == buffer_id && b->size == size) at = i;
    else if (b->busy == 0) { /* freed, and another allocation made at the same address */
      (void)da_ops_unregister(c, b->id);
      b->dead = 1;
    }
  }
  if (at == SIZE_MAX) {
    int st = buf_register(c, base, size, buffer_id, use->gen, &at);
    if (st != DETATTN_OK) return st;
  }
  if (use->n == use->cap) {
    size_t cap = use->cap ? 2 * use->cap : 8;
    size_t *na = realloc(use->at, cap * sizeof *na);
    if (!na) return da_err(DETATTN_RESOURCE_EXHAUSTED, "forward_cuda: out of memory");
    use->at = na;
    use->cap = cap;
  }
  da_cuda_buf *b = &s->bufs[at];
  b->last_use = ++s->tick;
  b->busy++; /* not evicted while this call is built or in flight */
  use->at[use->n++] = at;
  *id = b->id;
  *off = x - b->base;
  return DETATTN_OK;
}

int da_cuda_use_ids(detattn_client *c, const da_cuda_use *use, uint32_t **ids, size_t *n) {
  *ids = NULL;
  *n = 0;
  if (use->n == 0) return DETATTN_OK;
  uint32_t *v = malloc(use->n * sizeof *v);
  if (!v) return da_err(DETATTN_RESOURCE_EXHAUSTED, "forward_cuda: out of memory");
  for (size_t i = 0; i < use->n; i++) v[i] = c->cuda.bufs[use->at[i]].id;
  *ids = v;
  *n = use->n;
  return DETATTN_OK;
}

void da_cuda_use_release(detattn_client *c, da_cuda_use *use) {
  for (size_t i = 0; i < use->n; i++)
    if (c->cuda.bufs[use->at[i]].busy > 0) c->cuda.bufs[use->at[i]].busy--;
  use->n = 0;
}

void da_cuda_use_fini(da_cuda_use *use) {
  ctx_leave(use->pushed);
  free(use->at);
  memset(use, 0, sizeof *use);
}

/* ---- events ---- */

static void ev_destroy(da_cuda_ev *e) {
  int pushed = ctx_enter(e->ctx);
  if (e->ready) cu.event_destroy(e->ready);
  ctx_leave(pushed);
  free(e);
}

static int event_register(detattn_client *c, void *ev, uint32_t *id) {
  unsigned char h[CU_IPC_HANDLE_SIZE];
  CUresult r = cu.ipc_get_event_handle(h, ev);
  if (r != 0) return da_err(DETATTN_INTERNAL, "cuda plane: cuIpcGetEventHandle: %s", cu_str(r));
  int st = da_ops_register_cuda(c, 1, h, sizeof h, 0, id);
  if (st == DETATTN_RESOURCE_EXHAUSTED && c->cuda.n_bufs > 0) {
    evict(c, c->cuda.n_bufs / 2); /* the daemon's region limit: make room, once */
    st = da_ops_register_cuda(c, 1, h, sizeof h, 0, id);
  }
  return st;
}

int da_cuda_events_take(detattn_client *c, void *stream, void *ctx, da_cuda_ev **out) {
  da_cuda_state *s = &c->cuda;
  const uint64_t gen = conn_gen(c);
  da_cuda_ev *e = s->free_evs;
  int st;
  if (e) {
    s->free_evs = e->next;
  } else {
    e = calloc(1, sizeof *e);
    if (!e) return da_err(DETATTN_RESOURCE_EXHAUSTED, "forward_cuda: out of memory");
    e->ctx = ctx;
    CUresult r = cu.event_create(&e->ready, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS);
    if (r != 0) {
      ev_destroy(e);
      return da_err(DETATTN_FAILED_PRECONDITION,
                    "forward_cuda: cuEventCreate: %s (the calling thread needs a current CUDA context)", cu_str(r));
    }
    e->gen = gen + 1; /* registered below */
  }
  if (e->gen != gen) {
    if ((st = event_register(c, e->ready, &e->ready_id)) != DETATTN_OK) {
      ev_destroy(e);
      return st;
    }
    e->gen = gen;
  }
  CUresult r = cu.event_record(e->ready, stream);
  if (r != 0) {
    e->next = s->free_evs;
    s->free_evs = e;
    return da_err(DETATTN_INVALID_ARGUMENT, "forward_cuda: recording the inputs-ready event on the stream: %s",
                  cu_str(r));
  }
  *out = e;
  return DETATTN_OK;
}

void da_cuda_call_end(detattn_client *c, detattn_call *k, int status) {
  pthread_mutex_lock(&c->plane_mu);
  da_cuda_state *s = &c->cuda;
  for (size_t j = 0; j < k->n_cu_bufs; j++)
    for (size_t i = 0; i < s->n_bufs; i++)
      if (!s->bufs[i].dead && s->bufs[i].id == k->cu_bufs[j] && s->bufs[i].busy > 0) {
        s->bufs[i].busy--;
        break;
      }
  da_cuda_ev *e = k->cu_ev;
  if (e) {
    if (status == DETATTN_OK || status == DETATTN_INVALID_ARGUMENT || status == DETATTN_NOT_FOUND ||
        status == DETATTN_FAILED_PRECONDITION || status == DETATTN_RESOURCE_EXHAUSTED) {
      e->next = s->free_evs;
      s->free_evs = e;
    } else {
      /* The daemon may still be polling this call's event (a timeout here, say): it is
       * never reused. */
      (void)da_ops_unregister(c, e->ready_id);
      ev_destroy(e);
    }
  }
  pthread_mutex_unlock(&c->plane_mu);
  free(k->cu_bufs);
  k->cu_bufs = NULL;
  k->n_cu_bufs = 0;
  k->cu_ev = NULL;
}

void da_cuda_client_fini(detattn_client *c) {
  da_cuda_state *s = &c->cuda;
  for (da_cuda_ev *e = s->free_evs, *n; e; e = n) {
    n = e->next;
    ev_destroy(e);
  }
  free(s->bufs);
  memset(s, 0, sizeof *s);
}
