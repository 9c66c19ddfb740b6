#include "backend.h"

#include <stdio.h>
#include <stdlib.h>

struct da_backend {
  const da_backend_ops *ops;
  void *ctx;
  da_backend_cfg cfg;
  da_backend_info info;
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
  if (ops->available != NULL && !ops->available()) {
    snprintf(err, errlen, "backend '%s' has no usable device on this machine", name);
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
  return be->ops->run(be->ctx, b, res);
}

const da_backend_info *da_backend_get_info(const da_backend *be) { return &be->info; }
const da_backend_cfg *da_backend_get_cfg(const da_backend *be) { return &be->cfg; }
