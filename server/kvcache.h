/*
 * kvcache.h — the paged KV cache's bookkeeping: the page allocator, per-sequence page
 * tables and per-layer lengths, refcounts for copy-on-write after fork. It holds no K/V
 * data: the backend owns the pages' memory (kernels/backend.h) and performs the page
 * copies and writes this module plans.
 *
 * One page holds page_tokens tokens of every layer (K and V). A sequence has one page
 * table shared by all layers and one length per layer; page i of the table holds positions
 * [i * page_tokens, (i + 1) * page_tokens). Pages are refcounted: fork shares them; a
 * write to a page with refcount > 1 first copies it (all layers) to a fresh page.
 *
 * Thread: not thread-safe; the daemon's loop thread owns it.
 * Errors: every function is atomic: on error nothing changes and no page leaks.
 */
#ifndef DA_KVCACHE_H
#define DA_KVCACHE_H

#include <stdint.h>

#include "backend.h"

typedef struct da_kvcache da_kvcache;

typedef struct da_kvcache_cfg {
  int n_layers;
  int page_tokens; /* a power of two */
  int n_pages;     /* pool size */
  int max_seqs;    /* most sequences open at once */
  int max_seq_tokens; /* longest sequence (bounds a page table) */
} da_kvcache_cfg;

int da_kvcache_alloc(da_kvcache **out, const da_kvcache_cfg *cfg);
/* Frees the cache (all sequences with it). NULL is a no-op. */
void da_kvcache_free(da_kvcache *kv);

/* Sequence handles are small integers; a closed handle may be reused by a later open. */
int da_kvcache_open(da_kvcache *kv, uint32_t *seq_out);
/* A new sequence with src's page table and lengths; the pages' refcounts go up. */
int da_kvcache_fork(da_kvcache *kv, uint32_t src, uint32_t *seq_out);
/* Every layer's length becomes min(its length, len); pages past the longest layer's
 * length are released. */
int da_kvcache_truncate(da_kvcache *kv, uint32_t seq, int len);
/* Releases the sequence's pages and its handle. */
int da_kvcache_close(da_kvcache *kv, uint32_t seq);

/* Pages an append of n tokens at pos to `layer` would take from the pool (new pages plus
 * copy-on-write copies), or a negative status if the append is invalid. */
int da_kvcache_append_cost(const da_kvcache *kv, uint32_t seq, int layer, int pos, int n);
/*
 * Reserves an append of n tokens at pos (which must equal the layer's length) to layer:
 * allocates the pages it needs and plans copy-on-write copies, then sets the layer's
 * length to pos + n. The caller must have the backend perform copies[0 .. *n_copies), in
 * order, before writing the tokens. max_copies >= da_kvcache_max_copies(n).
 * Errors: INVALID_ARGUMENT (bad layer, n, pos past max_seq_tokens), FAILED_PRECONDITION
 * (pos != length), NOT_FOUND (seq), RESOURCE_EXHAUSTED (not enough free pages; the message
 * from da_kvcache_errmsg says needed and free).
 */
int da_kvcache_append(da_kvcache *kv, uint32_t seq, int layer, int pos, int n,
                      da_page_copy *copies, int max_copies, int *n_copies);
static inline int da_kvcache_max_copies(int n_tokens, int page_tokens) {
  return n_tokens / page_tokens + 2;
}

/* The layer's length, or a negative status. */
int da_kvcache_length(const da_kvcache *kv, uint32_t seq, int layer);
/* The sequence's page table (valid until the next call that changes this sequence) and
 * its length in pages. NULL if seq is not open. */
const int32_t *da_kvcache_pages(const da_kvcache *kv, uint32_t seq, int *n_pages);
/* A refcount, for tests. */
int da_kvcache_page_refs(const da_kvcache *kv, int32_t page);

int da_kvcache_pages_total(const da_kvcache *kv);
int da_kvcache_pages_free(const da_kvcache *kv);
int da_kvcache_seqs_open(const da_kvcache *kv);
/* A message for the last error (for RESOURCE_EXHAUSTED: needed and free pages). */
const char *da_kvcache_errmsg(const da_kvcache *kv);

#endif /* DA_KVCACHE_H */
