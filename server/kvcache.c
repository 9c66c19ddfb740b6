#include "kvcache.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

/*
 * Memory is taken once in da_kvcache_alloc: the page refcounts, a stack of free pages, a
 * stack of free sequence slots, and for every slot its page table (table_cap entries) and
 * its per-layer lengths. Nothing allocates afterwards.
 *
 * Invariants (checked by tests/kvcache):
 *  - a page is on the free stack iff its refcount is 0;
 *  - a page's refcount equals the number of open sequences whose table holds it (a table
 *    holds a page at most once);
 *  - an open sequence's table has exactly ceil(max over layers of length / page_tokens)
 *    entries.
 */

typedef struct seq {
  int open;
  int n_pages;    /* entries used in table */
  int32_t *table; /* [table_cap] */
  int *len;       /* [n_layers] */
} seq;

struct da_kvcache {
  da_kvcache_cfg cfg;
  int table_cap; /* ceil(max_seq_tokens / page_tokens) */
  int32_t *refs; /* [n_pages] */
  int32_t *free_pages; /* stack [n_pages], top at n_free - 1 */
  int n_free;
  seq *seqs;          /* [max_seqs] */
  uint32_t *free_seqs; /* stack [max_seqs] */
  int n_free_seqs;
  int32_t *tables; /* [max_seqs][table_cap] */
  int *lens;       /* [max_seqs][n_layers] */
  char err[256];
};

static int fail(da_kvcache *kv, int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(kv->err, sizeof(kv->err), fmt, ap);
  va_end(ap);
  return status;
}

static int cfg_ok(const da_kvcache_cfg *c) {
  return c->n_layers >= 1 && c->n_layers <= 4096 && c->page_tokens >= 1 &&
         c->page_tokens <= (1 << 16) && (c->page_tokens & (c->page_tokens - 1)) == 0 &&
         c->n_pages >= 1 && c->max_seqs >= 1 && c->max_seq_tokens >= 1;
}

int da_kvcache_alloc(da_kvcache **out, const da_kvcache_cfg *cfg) {
  if (out == NULL || cfg == NULL || !cfg_ok(cfg)) return DETATTN_INVALID_ARGUMENT;
  da_kvcache *kv = calloc(1, sizeof(*kv));
  if (kv == NULL) goto fail_kv;
  kv->cfg = *cfg;
  kv->table_cap = (int)(((int64_t)cfg->max_seq_tokens + cfg->page_tokens - 1) / cfg->page_tokens);
  kv->refs = calloc((size_t)cfg->n_pages, sizeof(*kv->refs));
  if (kv->refs == NULL) goto fail_refs;
  kv->free_pages = malloc((size_t)cfg->n_pages * sizeof(*kv->free_pages));
  if (kv->free_pages == NULL) goto fail_free_pages;
  kv->seqs = calloc((size_t)cfg->max_seqs, sizeof(*kv->seqs));
  if (kv->seqs == NULL) goto fail_seqs;
  kv->free_seqs = malloc((size_t)cfg->max_seqs * sizeof(*kv->free_seqs));
  if (kv->free_seqs == NULL) goto fail_free_seqs;
  kv->tables = malloc((size_t)cfg->max_seqs * (size_t)kv->table_cap * sizeof(*kv->tables));
  if (kv->tables == NULL) goto fail_tables;
  kv->lens = calloc((size_t)cfg->max_seqs * (size_t)cfg->n_layers, sizeof(*kv->lens));
  if (kv->lens == NULL) goto fail_lens;

  /* Stacks are filled so that the lowest ids come out first. */
  for (int i = 0; i < cfg->n_pages; i++) kv->free_pages[i] = cfg->n_pages - 1 - i;
  kv->n_free = cfg->n_pages;
  for (int i = 0; i < cfg->max_seqs; i++) {
    kv->free_seqs[i] = (uint32_t)(cfg->max_seqs - 1 - i);
    kv->seqs[i].table = kv->tables + (size_t)i * (size_t)kv->table_cap;
    kv->seqs[i].len = kv->lens + (size_t)i * (size_t)cfg->n_layers;
  }
  kv->n_free_seqs = cfg->max_seqs;
  *out = kv;
  return 0;

fail_lens:
  free(kv->tables);
fail_tables:
  free(kv->free_seqs);
fail_free_seqs:
  free(kv->seqs);
fail_seqs:
  free(kv->free_pages);
fail_free_pages:
  free(kv->refs);
fail_refs:
  free(kv);
fail_kv:
  return DETATTN_RESOURCE_EXHAUSTED;
}

void da_kvcache_free(da_kvcache *kv) {
  if (kv == NULL) return;
  free(kv->lens);
  free(kv->tables);
  free(kv->free_seqs);
  free(kv->seqs);
  free(kv->free_pages);
  free(kv->refs);
  free(kv);
}

static seq *find_seq(const da_kvcache *kv, uint32_t id) {
  if (id >= (uint32_t)kv->cfg.max_seqs || !kv->seqs[id].open) return NULL;
  return &kv->seqs[id];
}

static int32_t page_get(da_kvcache *kv) {
  int32_t p = kv->free_pages[--kv->n_free];
  kv->refs[p] = 1;
  return p;
}

static void page_put(da_kvcache *kv, int32_t p) {
  if (--kv->refs[p] == 0) kv->free_pages[kv->n_free++] = p;
}

static int slot_get(da_kvcache *kv, uint32_t *id_out) {
  if (kv->n_free_seqs == 0)
    return fail(kv, DETATTN_RESOURCE_EXHAUSTED, "no free sequence slot (%d open, max_seqs %d)",
                kv->cfg.max_seqs, kv->cfg.max_seqs);
  uint32_t id = kv->free_seqs[--kv->n_free_seqs];
  seq *s = &kv->seqs[id];
  s->open = 1;
  s->n_pages = 0;
  for (int l = 0; l < kv->cfg.n_layers; l++) s->len[l] = 0;
  *id_out = id;
  return 0;
}

int da_kvcache_open(da_kvcache *kv, uint32_t *seq_out) {
  if (seq_out == NULL) return fail(kv, DETATTN_INVALID_ARGUMENT, "open: seq_out is NULL");
  return slot_get(kv, seq_out);
}

int da_kvcache_fork(da_kvcache *kv, uint32_t src, uint32_t *seq_out) {
  if (seq_out == NULL) return fail(kv, DETATTN_INVALID_ARGUMENT, "fork: seq_out is NULL");
  const seq *from = find_seq(kv, src);
  if (from == NULL) return fail(kv, DETATTN_NOT_FOUND, "fork: sequence %u is not open", src);
  uint32_t id = 0;
  int rv = slot_get(kv, &id);
  if (rv != 0) return rv;
  seq *to = &kv->seqs[id];
  to->n_pages = from->n_pages;
  for (int i = 0; i < from->n_pages; i++) {
    to->table[i] = from->table[i];
    kv->refs[from->table[i]]++;
  }
  for (int l = 0; l < kv->cfg.n_layers; l++) to->len[l] = from->len[l];
  *seq_out = id;
  return 0;
}

static void release_from(da_kvcache *kv, seq *s, int keep) {
  while (s->n_pages > keep) page_put(kv, s->table[--s->n_pages]);
}

int da_kvcache_truncate(da_kvcache *kv, uint32_t id, int len) {
  seq *s = find_seq(kv, id);
  if (s == NULL) return fail(kv, DETATTN_NOT_FOUND, "truncate: sequence %u is not open", id);
  if (len < 0) return fail(kv, DETATTN_INVALID_ARGUMENT, "truncate: length %d < 0", len);
  int longest = 0;
  for (int l = 0; l < kv->cfg.n_layers; l++) {
    if (s->len[l] > len) s->len[l] = len;
    if (s->len[l] > longest) longest = s->len[l];
  }
  release_from(kv, s, (longest + kv->cfg.page_tokens - 1) / kv->cfg.page_tokens);
  return 0;
}

int da_kvcache_close(da_kvcache *kv, uint32_t id) {
  seq *s = find_seq(kv, id);
  if (s == NULL) return fail(kv, DETATTN_NOT_FOUND, "close: sequence %u is not open", id);
  release_from(kv, s, 0);
  for (int l = 0; l < kv->cfg.n_layers; l++) s->len[l] = 0;
  s->open = 0;
  kv->free_seqs[kv->n_free_seqs++] = id;
  return 0;
}

/*
 * Validates an append and counts what it takes: pages past the end of the table and
 * copies of shared pages it writes into. The pages written are [pos / pt, (pos+n-1) / pt];
 * since pos equals a layer's length, pos / pt <= n_pages, so the table has no gaps.
 * On error writes a message to msg (if not NULL) and returns the status.
 */
static int plan(const da_kvcache *kv, uint32_t id, int layer, int pos, int n, int *n_new,
                int *n_cow, char *msg, size_t msglen) {
#define BAD(status, ...)                           \
  do {                                             \
    if (msg != NULL) snprintf(msg, msglen, __VA_ARGS__); \
    return status;                                 \
  } while (0)
  const seq *s = find_seq(kv, id);
  if (s == NULL) BAD(DETATTN_NOT_FOUND, "append: sequence %u is not open", id);
  if (layer < 0 || layer >= kv->cfg.n_layers)
    BAD(DETATTN_INVALID_ARGUMENT, "append: layer %d out of range [0, %d)", layer, kv->cfg.n_layers);
  if (n <= 0) BAD(DETATTN_INVALID_ARGUMENT, "append: token count %d must be > 0", n);
  if (pos < 0) BAD(DETATTN_INVALID_ARGUMENT, "append: position %d < 0", pos);
  if (n > kv->cfg.max_seq_tokens || pos > kv->cfg.max_seq_tokens - n)
    BAD(DETATTN_INVALID_ARGUMENT, "append: positions [%d, %lld) exceed max_seq_tokens %d", pos,
        (long long)pos + n, kv->cfg.max_seq_tokens);
  if (pos != s->len[layer])
    BAD(DETATTN_FAILED_PRECONDITION, "append: layer %d has length %d, expected pos %d, got %d",
        layer, s->len[layer], s->len[layer], pos);
#undef BAD
  int pt = kv->cfg.page_tokens;
  int first = pos / pt, last = (pos + n - 1) / pt;
  int nn = 0, nc = 0;
  for (int i = first; i <= last; i++) {
    if (i >= s->n_pages) nn++;
    else if (kv->refs[s->table[i]] > 1) nc++;
  }
  *n_new = nn;
  *n_cow = nc;
  return 0;
}

int da_kvcache_append_cost(const da_kvcache *kv, uint32_t id, int layer, int pos, int n) {
  int nn, nc;
  int rv = plan(kv, id, layer, pos, n, &nn, &nc, NULL, 0);
  return rv != 0 ? -rv : nn + nc;
}

int da_kvcache_append(da_kvcache *kv, uint32_t id, int layer, int pos, int n,
                      da_page_copy *copies, int max_copies, int *n_copies) {
  if (n_copies == NULL)
    return fail(kv, DETATTN_INVALID_ARGUMENT, "append: n_copies is NULL");
  int nn, nc;
  int rv = plan(kv, id, layer, pos, n, &nn, &nc, kv->err, sizeof(kv->err));
  if (rv != 0) return rv;
  int need_copies = da_kvcache_max_copies(n, kv->cfg.page_tokens);
  if (copies == NULL || max_copies < need_copies)
    return fail(kv, DETATTN_INVALID_ARGUMENT,
                "append: copy plan buffer holds %d, an append of %d tokens needs %d", copies ? max_copies : 0,
                n, need_copies);
  if (nn + nc > kv->n_free)
    return fail(kv, DETATTN_RESOURCE_EXHAUSTED,
                "KV cache: append of %d tokens to sequence %u needed %d pages, %d free", n, id,
                nn + nc, kv->n_free);

  seq *s = &kv->seqs[id];
  int pt = kv->cfg.page_tokens;
  int first = pos / pt, last = (pos + n - 1) / pt;
  int k = 0;
  for (int i = first; i <= last; i++) {
    if (i >= s->n_pages) {
      s->table[s->n_pages++] = page_get(kv);
    } else if (kv->refs[s->table[i]] > 1) {
      int32_t src = s->table[i], dst = page_get(kv);
      copies[k].src = src;
      copies[k].dst = dst;
      k++;
      kv->refs[src]--; /* > 1 before, so it stays referenced by another sequence */
      s->table[i] = dst;
    }
  }
  s->len[layer] = pos + n;
  *n_copies = k;
  return 0;
}

int da_kvcache_length(const da_kvcache *kv, uint32_t id, int layer) {
  const seq *s = find_seq(kv, id);
  if (s == NULL) return -DETATTN_NOT_FOUND;
  if (layer < 0 || layer >= kv->cfg.n_layers) return -DETATTN_INVALID_ARGUMENT;
  return s->len[layer];
}

const int32_t *da_kvcache_pages(const da_kvcache *kv, uint32_t id, int *n_pages) {
  const seq *s = find_seq(kv, id);
  if (s == NULL) {
    if (n_pages != NULL) *n_pages = 0;
    return NULL;
  }
  if (n_pages != NULL) *n_pages = s->n_pages;
  return s->table;
}

int da_kvcache_page_refs(const da_kvcache *kv, int32_t page) {
  if (page < 0 || page >= kv->cfg.n_pages) return -DETATTN_INVALID_ARGUMENT;
  return kv->refs[page];
}

int da_kvcache_pages_total(const da_kvcache *kv) { return kv->cfg.n_pages; }
int da_kvcache_pages_free(const da_kvcache *kv) { return kv->n_free; }
int da_kvcache_seqs_open(const da_kvcache *kv) { return kv->cfg.max_seqs - kv->n_free_seqs; }
const char *da_kvcache_errmsg(const da_kvcache *kv) { return kv->err; }
