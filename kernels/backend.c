#include "backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct da_backend {
  const da_backend_ops *ops;
  void *ctx;
  da_backend_cfg cfg;
  da_backend_info info;
  /* Batches submitted and not yet finished, oldest first (for backends without submit,
   * the queued batches that finish() runs). */
  const da_batch *queued[DA_BACKEND_MAX_INFLIGHT];
  int head, n_inflight;
};

static const da_backend_ops *const backends[] = {
#ifdef DETATTN_HAVE_CUDA
    &da_cuda_backend_ops,
#endif
    &da_cpu_backend_ops,
};

static const da_backend_ops *find(const char *name) {
  for (size_t i = 0; i < sizeof(backends) / sizeof(backends[0]); i++) {
    const da_backend_ops *o = backends[i];
    if (strcmp(name, "auto") == 0 ? (o->available == NULL || o->available())
                                  : strcmp(name, o->name) == 0)
      return o;
  }
  return NULL;
}

int da_backend_open(da_backend **out, const char *name, const da_backend_cfg *cfg, char *err,
                    size_t errlen) {
  const da_backend_ops *ops = find(name);
  if (ops == NULL) {
    snprintf(err, errlen, "backend '%s' is not built in (have:%s cpu)", name,
#ifdef DETATTN_HAVE_CUDA
             " cuda"
#else
             ""
#endif
    );
    return DETATTN_INVALID_ARGUMENT;
  }
  return da_backend_open_ops(out, ops, cfg, err, errlen);
}

int da_backend_open_ops(da_backend **out, const da_backend_ops *ops, const da_backend_cfg *cfg, char *err,
                        size_t errlen) {
  if (ops->available != NULL && !ops->available()) {
    snprintf(err, errlen, "backend '%s' has no usable device on this machine", ops->name);
    return DETATTN_UNAVAILABLE;
  }
  da_backend *be = calloc(1, sizeof(*be));
  if (be == NULL) {
    snprintf(err, errlen, "out of memory");
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  be->ops = ops;
  be->cfg = *cfg;
  int rv = ops->create(&be->ctx, cfg, &be->info, err, errlen);
  if (rv != 0) {
    free(be);
    return rv;
  }
  *out = be;
  return 0;
}

void da_backend_close(da_backend *be) {
  if (be == NULL) return;
  be->ops->destroy(be->ctx);
  free(be);
}

int da_backend_run(da_backend *be, const da_batch *b, da_batch_result *res) {
  res->inrow_rows = res->partial_rows = 0;
  res->err[0] = '\0';
  if (be->n_inflight > 0) {
    snprintf(res->err, sizeof(res->err), "run() while %d submitted batches are in flight",
             be->n_inflight);
    return DETATTN_FAILED_PRECONDITION;
  }
  return be->ops->run(be->ctx, b, res);
}

const da_backend_info *da_backend_get_info(const da_backend *be) { return &be->info; }
const da_backend_cfg *da_backend_get_cfg(const da_backend *be) { return &be->cfg; }

int da_backend_poll(da_backend *be) {
  if (be->ops->poll == NULL || be->ops->submit == NULL) return -1;
  return be->n_inflight == 0 ? 1 : be->ops->poll(be->ctx);
}

int da_backend_has_device_memory(const da_backend *be) { return be->ops->map_host != NULL; }

static int no_device_memory(const da_backend *be, char *err, size_t errlen) {
  snprintf(err, errlen, "the %s backend has no device memory to map", be->ops->name);
  return DETATTN_UNIMPLEMENTED;
}

int da_backend_map_host(da_backend *be, void *p, size_t n, void **dev, char *err, size_t errlen) {
  if (be->ops->map_host == NULL) return no_device_memory(be, err, errlen);
  return be->ops->map_host(be->ctx, p, n, dev, err, errlen);
}

void da_backend_unmap_host(da_backend *be, void *p) {
  if (be->ops->unmap_host) be->ops->unmap_host(be->ctx, p);
}

int da_backend_map_ipc(da_backend *be, const void *handle, size_t handle_len, uint64_t size, void **dev, char *err,
                       size_t errlen) {
  if (be->ops->map_ipc == NULL) return no_device_memory(be, err, errlen);
  return be->ops->map_ipc(be->ctx, handle, handle_len, size, dev, err, errlen);
}

void da_backend_unmap_ipc(da_backend *be, void *dev) {
  if (be->ops->unmap_ipc) be->ops->unmap_ipc(be->ctx, dev);
}

int da_backend_event_open(da_backend *be, const void *handle, size_t handle_len, void **ev, char *err, size_t errlen) {
  if (be->ops->event_open == NULL) return no_device_memory(be, err, errlen);
  return be->ops->event_open(be->ctx, handle, handle_len, ev, err, errlen);
}

void da_backend_event_close(da_backend *be, void *ev) {
  if (be->ops->event_close) be->ops->event_close(be->ctx, ev);
}

int da_backend_event_query(da_backend *be, void *ev) {
  return be->ops->event_query ? be->ops->event_query(be->ctx, ev) : 1;
}

static void res_clear(da_batch_result *res) {
  res->inrow_rows = res->partial_rows = 0;
  res->err[0] = '\0';
}

int da_backend_submit(da_backend *be, const da_batch *b, void (*ready)(void *arg), void *arg,
                      da_batch_result *res) {
  res_clear(res);
  if (be->n_inflight >= DA_BACKEND_MAX_INFLIGHT) {
    snprintf(res->err, sizeof(res->err), "%d batches already in flight; finish one first",
             be->n_inflight);
    return DETATTN_FAILED_PRECONDITION;
  }
  if (be->ops->submit != NULL) {
    int rv = be->ops->submit(be->ctx, b, ready, arg, res);
    if (rv != 0) return rv;
  }
  be->queued[(be->head + be->n_inflight) % DA_BACKEND_MAX_INFLIGHT] = b;
  be->n_inflight++;
  if (be->ops->submit == NULL && ready != NULL) ready(arg);
  return 0;
}

int da_backend_finish(da_backend *be, da_batch_result *res) {
  res_clear(res);
  if (be->n_inflight == 0) {
    snprintf(res->err, sizeof(res->err), "no batch in flight");
    return DETATTN_FAILED_PRECONDITION;
  }
  const da_batch *b = be->queued[be->head];
  be->queued[be->head] = NULL;
  be->head = (be->head + 1) % DA_BACKEND_MAX_INFLIGHT;
  be->n_inflight--;
  if (be->ops->finish != NULL) return be->ops->finish(be->ctx, res);
  return be->ops->run(be->ctx, b, res);
}

int da_backend_inflight(const da_backend *be) { return be->n_inflight; }

int da_backend_overlaps(const da_backend *be) { return be->ops->submit != NULL; }
