/* Placeholder until the CPU backend lands. */
#include "backend.h"
static int create(void **ctx, const da_backend_cfg *cfg, da_backend_info *info, char *err, size_t errlen) { (void)ctx; (void)cfg; (void)info; (void)err; (void)errlen; return DETATTN_UNIMPLEMENTED; }
static void destroy(void *ctx) { (void)ctx; }
static int run(void *ctx, const da_batch *b, da_batch_result *res) { (void)ctx; (void)b; (void)res; return DETATTN_UNIMPLEMENTED; }
const da_backend_ops da_cpu_backend_ops = { .name = "cpu", .create = create, .destroy = destroy, .run = run };
