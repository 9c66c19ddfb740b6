/* Placeholder until the KV cache lands. */
#include "kvcache.h"
int da_kvcache_alloc(da_kvcache **out, const da_kvcache_cfg *cfg) { (void)out; (void)cfg; return DETATTN_UNIMPLEMENTED; }
void da_kvcache_free(da_kvcache *kv) { (void)kv; }
