/*
 * tp.c — tensor parallelism: several daemons (one per GPU) used as one (detattn.h,
 * detattn_tp_*). Rank r's daemon serves a contiguous shard of the layer's heads; a
 * whole-layer Forward is cut into shards (q, k, v gathered per rank), started on every
 * rank, then waited for on every rank, and o and lse are scattered back into the caller's
 * full-layer buffers. Sequences exist on every rank under one TP id.
 *
 * Nothing here does arithmetic on the outputs: each head is computed by exactly one daemon
 * with the same kernels, so a head's bits are those of a single daemon holding every head
 * (the fingerprint does not depend on the head count; test_tp checks it bitwise).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_impl.h"

typedef struct tp_slot {
  uint32_t gen;
  uint8_t used;
  uint8_t broken; /* a Forward failed on some ranks only: lengths differ between ranks */
} tp_slot;

struct detattn_tp {
  size_t n;
  detattn_client **c;
  uint32_t *q0, *hq, *kv0, *hkv; /* each rank's head shard */
  detattn_server_info info;      /* the whole layer */
  pthread_mutex_t mu;
  tp_slot *slots; /* under mu */
  uint64_t *ids;  /* [cap][n]: each rank's sequence id */
  uint32_t *free_stack;
  size_t cap, n_free;
  detattn_tp_call *live; /* under mu: calls started and not yet waited for (tp_close orphans them) */
};

typedef struct tp_rank_call {
  detattn_call *call;
  void *block; /* the shard's q, k, v, o, lse */
  int in_arena;
  detattn_seq_io *ios;
  int status;
  char msg[240];
} tp_rank_call;

struct detattn_tp_call {
  detattn_tp *tp; /* NULL once orphaned: the group was closed before the call was waited for */
  size_t n_ranks;
  int linked, orphaned;
  detattn_tp_call *lprev, *lnext; /* tp->live, under tp->mu */
  size_t n_items;
  detattn_seq_io *user; /* the caller's items (outputs, token counts) */
  uint64_t *tp_ids;
  tp_rank_call *rank;
  size_t n_started;
};

#define ALIGN_UP(x) (((x) + 63) & ~(size_t)63)

/* ---- connect, hello, close ---- */

static int same_numerics(const detattn_server_info *a, const detattn_server_info *b, char *why, size_t len) {
  const detattn_model *x = &a->model, *y = &b->model;
#define DIFF(cond, what)                      \
  if (cond) {                                 \
    snprintf(why, len, "%s", what);           \
    return 0;                                 \
  }
  DIFF(x->n_layers != y->n_layers, "n_layers");
  DIFF(x->head_dim != y->head_dim, "head_dim");
  DIFF(x->dtype != y->dtype, "dtype");
  DIFF(memcmp(&x->scale, &y->scale, sizeof x->scale) != 0, "scale");
  DIFF(memcmp(&x->softcap, &y->softcap, sizeof x->softcap) != 0, "softcap");
  DIFF(x->window != y->window, "window");
  DIFF(x->page_tokens != y->page_tokens, "page_tokens");
  DIFF(a->split_tokens != b->split_tokens, "split_tokens");
  DIFF(a->tile_tokens != b->tile_tokens, "tile_tokens");
  DIFF(strcmp(a->backend, b->backend) != 0, "backend");
  DIFF(strcmp(a->arch, b->arch) != 0, "arch");
  DIFF(a->kernel_version != b->kernel_version, "kernel_version");
  DIFF(a->fingerprint != b->fingerprint, "fingerprint");
  DIFF(x->n_q_heads * y->n_kv_heads != y->n_q_heads * x->n_kv_heads, "q heads per kv head");
#undef DIFF
  return 1;
}

DETATTN_API void detattn_tp_close(detattn_tp *tp) {
  if (!tp) return;
  /* Calls not yet waited for outlive the group: detattn_tp_call_wait then returns CANCELLED
   * and touches neither the group nor the ranks' arenas (unmapped with their clients). */
  pthread_mutex_lock(&tp->mu);
  for (detattn_tp_call *k = tp->live, *next; k; k = next) {
    next = k->lnext;
    k->lprev = k->lnext = NULL;
    k->linked = 0;
    k->orphaned = 1;
    k->tp = NULL;
  }
  tp->live = NULL;
  pthread_mutex_unlock(&tp->mu);
  for (size_t r = 0; r < tp->n; r++) detattn_close(tp->c[r]);
  pthread_mutex_destroy(&tp->mu);
  free(tp->c);
  free(tp->q0);
  free(tp->slots);
  free(tp->ids);
  free(tp->free_stack);
  free(tp);
}

DETATTN_API int detattn_tp_connect(detattn_tp **out, const char *const *urls, size_t n_ranks,
                                   const detattn_connect_opts *opts) {
  if (!out) return da_err(DETATTN_INVALID_ARGUMENT, "tp_connect: out is NULL");
  *out = NULL;
  if (!urls || n_ranks == 0 || n_ranks > 64)
    return da_err(DETATTN_INVALID_ARGUMENT, "tp_connect: %zu ranks (1 to 64)", n_ranks);
  detattn_tp *tp = calloc(1, sizeof *tp);
  if (!tp) return da_err(DETATTN_RESOURCE_EXHAUSTED, "tp_connect: out of memory");
  pthread_mutex_init(&tp->mu, NULL);
  tp->c = calloc(n_ranks, sizeof *tp->c);
  tp->q0 = calloc(4 * n_ranks, sizeof *tp->q0);
  if (!tp->c || !tp->q0) {
    detattn_tp_close(tp);
    return da_err(DETATTN_RESOURCE_EXHAUSTED, "tp_connect: out of memory");
  }
  tp->hq = tp->q0 + n_ranks;
  tp->kv0 = tp->hq + n_ranks;
  tp->hkv = tp->kv0 + n_ranks;
  int st;
  for (size_t r = 0; r < n_ranks; r++) {
    if (!urls[r]) {
      detattn_tp_close(tp);
      return da_err(DETATTN_INVALID_ARGUMENT, "tp_connect: url of rank %zu is NULL", r);
    }
    if ((st = detattn_connect_ex(&tp->c[r], urls[r], opts)) != DETATTN_OK) {
      char m[200];
      snprintf(m, sizeof m, "%s", detattn_errmsg());
      detattn_tp_close(tp);
      return da_err(st, "tp_connect: rank %zu (%s): %s", r, urls[r], m);
    }
    tp->n = r + 1;
  }
  uint32_t q = 0, kv = 0;
  for (size_t r = 0; r < n_ranks; r++) {
    detattn_server_info in;
    if ((st = detattn_hello(tp->c[r], &in)) != DETATTN_OK) {
      char m[200];
      snprintf(m, sizeof m, "%s", detattn_errmsg());
      detattn_tp_close(tp);
      return da_err(st, "tp_connect: hello to rank %zu (%s): %s", r, urls[r], m);
    }
    char why[32];
    if (r == 0) tp->info = in;
    else if (!same_numerics(&tp->info, &in, why, sizeof why)) {
      detattn_tp_close(tp);
      return da_err(DETATTN_FAILED_PRECONDITION,
                    "tp_connect: rank %zu (%s) differs from rank 0 in %s; every rank must run the same model "
                    "(but for its heads), numerics and backend build",
                    r, urls[r], why);
    }
    tp->q0[r] = q;
    tp->hq[r] = in.model.n_q_heads;
    tp->kv0[r] = kv;
    tp->hkv[r] = in.model.n_kv_heads;
    q += in.model.n_q_heads;
    kv += in.model.n_kv_heads;
    if (in.kv_capacity_tokens < tp->info.kv_capacity_tokens) tp->info.kv_capacity_tokens = in.kv_capacity_tokens;
    if (in.kv_pages < tp->info.kv_pages) tp->info.kv_pages = in.kv_pages;
    if (in.max_tokens_per_request < tp->info.max_tokens_per_request)
      tp->info.max_tokens_per_request = in.max_tokens_per_request;
    if (in.max_message_bytes < tp->info.max_message_bytes) tp->info.max_message_bytes = in.max_message_bytes;
    tp->info.data_planes &= in.data_planes;
  }
  tp->info.model.n_q_heads = q;
  tp->info.model.n_kv_heads = kv;
  *out = tp;
  return DETATTN_OK;
}

DETATTN_API int detattn_tp_hello(detattn_tp *tp, detattn_server_info *out) {
  if (!tp || !out) return da_err(DETATTN_INVALID_ARGUMENT, "tp_hello: NULL argument");
  *out = tp->info;
  return DETATTN_OK;
}

DETATTN_API size_t detattn_tp_ranks(const detattn_tp *tp) { return tp ? tp->n : 0; }

DETATTN_API detattn_client *detattn_tp_rank(detattn_tp *tp, size_t rank) {
  return tp && rank < tp->n ? tp->c[rank] : NULL;
}

DETATTN_API int detattn_tp_shard(const detattn_tp *tp, size_t rank, uint32_t *q_head0, uint32_t *n_q_heads,
                                 uint32_t *kv_head0, uint32_t *n_kv_heads) {
  if (!tp || rank >= tp->n) return da_err(DETATTN_INVALID_ARGUMENT, "tp_shard: no rank %zu", rank);
  if (q_head0) *q_head0 = tp->q0[rank];
  if (n_q_heads) *n_q_heads = tp->hq[rank];
  if (kv_head0) *kv_head0 = tp->kv0[rank];
  if (n_kv_heads) *n_kv_heads = tp->hkv[rank];
  return DETATTN_OK;
}

/* ---- the sequence table ---- */

static uint64_t make_id(uint32_t gen, size_t idx) { return ((uint64_t)gen << 32) | (uint64_t)idx; }

/* Under mu: the slot of id, or NULL. */
static tp_slot *find(detattn_tp *tp, uint64_t id, size_t *idx) {
  size_t i = (size_t)(id & 0xffffffffu);
  if (i >= tp->cap || !tp->slots[i].used || tp->slots[i].gen != (uint32_t)(id >> 32)) return NULL;
  *idx = i;
  return &tp->slots[i];
}

/* Under mu: a free slot, growing the table. */
static int slot_new(detattn_tp *tp, size_t *idx) {
  if (tp->n_free == 0) {
    size_t cap = tp->cap ? 2 * tp->cap : 64;
    if (cap > 0xffffffffu) return -1;
    tp_slot *s = realloc(tp->slots, cap * sizeof *s);
    if (!s) return -1;
    tp->slots = s;
    uint64_t *ids = realloc(tp->ids, cap * tp->n * sizeof *ids);
    if (!ids) return -1;
    tp->ids = ids;
    uint32_t *fs = realloc(tp->free_stack, cap * sizeof *fs);
    if (!fs) return -1;
    tp->free_stack = fs;
    for (size_t i = cap; i > tp->cap; i--) {
      tp->slots[i - 1] = (tp_slot){0};
      tp->free_stack[tp->n_free++] = (uint32_t)(i - 1);
    }
    tp->cap = cap;
  }
  *idx = tp->free_stack[--tp->n_free];
  tp_slot *s = &tp->slots[*idx];
  s->gen++;
  if (s->gen == 0) s->gen = 1;
  s->used = 1;
  s->broken = 0;
  return 0;
}

static void slot_free(detattn_tp *tp, size_t idx) {
  tp->slots[idx].used = 0;
  tp->free_stack[tp->n_free++] = (uint32_t)idx;
}

/* Stores the ranks' ids as a new TP sequence; on failure closes them. */
static int publish(detattn_tp *tp, const uint64_t *rank_ids, uint64_t *out) {
  size_t idx;
  pthread_mutex_lock(&tp->mu);
  int rv = slot_new(tp, &idx);
  if (rv == 0) {
    memcpy(&tp->ids[idx * tp->n], rank_ids, tp->n * sizeof *rank_ids);
    *out = make_id(tp->slots[idx].gen, idx);
  }
  pthread_mutex_unlock(&tp->mu);
  if (rv != 0) {
    for (size_t r = 0; r < tp->n; r++) detattn_seq_close(tp->c[r], rank_ids[r]);
    return da_err(DETATTN_RESOURCE_EXHAUSTED, "tp: out of memory for the sequence table");
  }
  return DETATTN_OK;
}

/* Copies the ranks' ids of TP sequence id (and whether it is broken) under mu. */
static int lookup(detattn_tp *tp, uint64_t id, uint64_t *rank_ids, int *broken, const char *what) {
  size_t idx;
  pthread_mutex_lock(&tp->mu);
  tp_slot *s = find(tp, id, &idx);
  if (s) {
    memcpy(rank_ids, &tp->ids[idx * tp->n], tp->n * sizeof *rank_ids);
    if (broken) *broken = s->broken;
  }
  pthread_mutex_unlock(&tp->mu);
  if (!s) return da_err(DETATTN_NOT_FOUND, "%s: TP sequence %llu is not open", what, (unsigned long long)id);
  return DETATTN_OK;
}

static void set_broken(detattn_tp *tp, uint64_t id, int broken) {
  size_t idx;
  pthread_mutex_lock(&tp->mu);
  tp_slot *s = find(tp, id, &idx);
  if (s) s->broken = (uint8_t)broken;
  pthread_mutex_unlock(&tp->mu);
}

static int broken_err(uint64_t id, const char *what) {
  return da_err(DETATTN_ABORTED,
                "%s: TP sequence %llu failed a Forward on some ranks only, so its ranks hold different lengths; "
                "truncate it (detattn_tp_seq_truncate to the length before that Forward) or close it",
                what, (unsigned long long)id);
}

#define RANK_IDS_MAX 64

DETATTN_API int detattn_tp_seq_open(detattn_tp *tp, uint64_t *seq_out) {
  if (!tp || !seq_out) return da_err(DETATTN_INVALID_ARGUMENT, "tp_seq_open: NULL argument");
  uint64_t ids[RANK_IDS_MAX];
  for (size_t r = 0; r < tp->n; r++) {
    int st = detattn_seq_open(tp->c[r], &ids[r]);
    if (st != DETATTN_OK) {
      char m[200];
      snprintf(m, sizeof m, "%s", detattn_errmsg());
      for (size_t j = 0; j < r; j++) detattn_seq_close(tp->c[j], ids[j]);
      return da_err(st, "tp_seq_open: rank %zu: %s", r, m);
    }
  }
  return publish(tp, ids, seq_out);
}

DETATTN_API int detattn_tp_seq_fork(detattn_tp *tp, uint64_t src, uint64_t *seq_out) {
  if (!tp || !seq_out) return da_err(DETATTN_INVALID_ARGUMENT, "tp_seq_fork: NULL argument");
  uint64_t srcs[RANK_IDS_MAX], ids[RANK_IDS_MAX];
  int broken = 0, st;
  if ((st = lookup(tp, src, srcs, &broken, "tp_seq_fork")) != DETATTN_OK) return st;
  if (broken) return broken_err(src, "tp_seq_fork");
  for (size_t r = 0; r < tp->n; r++) {
    if ((st = detattn_seq_fork(tp->c[r], srcs[r], &ids[r])) != DETATTN_OK) {
      char m[200];
      snprintf(m, sizeof m, "%s", detattn_errmsg());
      for (size_t j = 0; j < r; j++) detattn_seq_close(tp->c[j], ids[j]);
      return da_err(st, "tp_seq_fork: rank %zu: %s", r, m);
    }
  }
  return publish(tp, ids, seq_out);
}

DETATTN_API int detattn_tp_seq_truncate(detattn_tp *tp, uint64_t seq, uint32_t length) {
  if (!tp) return da_err(DETATTN_INVALID_ARGUMENT, "tp_seq_truncate: NULL argument");
  uint64_t ids[RANK_IDS_MAX];
  int st, first = DETATTN_OK;
  char m[240] = "";
  if ((st = lookup(tp, seq, ids, NULL, "tp_seq_truncate")) != DETATTN_OK) return st;
  for (size_t r = 0; r < tp->n; r++)
    if ((st = detattn_seq_truncate(tp->c[r], ids[r], length)) != DETATTN_OK && first == DETATTN_OK) {
      first = st;
      snprintf(m, sizeof m, "tp_seq_truncate: rank %zu: %s", r, detattn_errmsg());
    }
  /* Truncating every rank to one length makes them agree again; a partial failure does not. */
  set_broken(tp, seq, first != DETATTN_OK);
  return first == DETATTN_OK ? DETATTN_OK : da_err(first, "%s", m);
}

DETATTN_API int detattn_tp_seq_close(detattn_tp *tp, uint64_t seq) {
  if (!tp) return da_err(DETATTN_INVALID_ARGUMENT, "tp_seq_close: NULL argument");
  uint64_t ids[RANK_IDS_MAX];
  int st, first = DETATTN_OK;
  char m[240] = "";
  size_t idx;
  pthread_mutex_lock(&tp->mu);
  tp_slot *s = find(tp, seq, &idx);
  if (s) {
    memcpy(ids, &tp->ids[idx * tp->n], tp->n * sizeof *ids);
    slot_free(tp, idx);
  }
  pthread_mutex_unlock(&tp->mu);
  if (!s) return da_err(DETATTN_NOT_FOUND, "tp_seq_close: TP sequence %llu is not open", (unsigned long long)seq);
  for (size_t r = 0; r < tp->n; r++)
    if ((st = detattn_seq_close(tp->c[r], ids[r])) != DETATTN_OK && first == DETATTN_OK) {
      first = st;
      snprintf(m, sizeof m, "tp_seq_close: rank %zu: %s", r, detattn_errmsg());
    }
  return first == DETATTN_OK ? DETATTN_OK : da_err(first, "%s", m);
}

/* ---- Forward: scatter, fan out, gather ---- */

static void call_free(detattn_tp_call *k) {
  if (!k) return;
  if (k->tp && k->linked) {
    pthread_mutex_lock(&k->tp->mu);
    if (k->lprev) k->lprev->lnext = k->lnext;
    else k->tp->live = k->lnext;
    if (k->lnext) k->lnext->lprev = k->lprev;
    pthread_mutex_unlock(&k->tp->mu);
  }
  for (size_t r = 0; k->rank && r < k->n_ranks; r++) {
    tp_rank_call *rc = &k->rank[r];
    if (!rc->in_arena) free(rc->block);
    else if (k->tp) detattn_arena_free(k->tp->c[r], rc->block); /* orphaned: went with the arena */
    free(rc->ios);
  }
  free(k->rank);
  free(k->user);
  free(k->tp_ids);
  free(k);
}

/* Rank r's shard of every item in one block (in r's arena when it has one, so the shard
 * travels by reference): q, k and v gathered from the caller's full-layer tensors, and room
 * for o and lse. */
static int shard(detattn_tp_call *k, size_t r, const uint64_t *rank_ids, int want_lse) {
  detattn_tp *tp = k->tp;
  tp_rank_call *rc = &k->rank[r];
  const size_t d = tp->info.model.head_dim, hq = tp->hq[r], hkv = tp->hkv[r];
  const size_t HQ = tp->info.model.n_q_heads, HKV = tp->info.model.n_kv_heads;
  const size_t qrow = hq * d * 2, kvrow = hkv * d * 2, lrow = hq * 4;
  rc->ios = calloc(k->n_items, sizeof *rc->ios);
  if (!rc->ios) return da_err(DETATTN_RESOURCE_EXHAUSTED, "tp_forward: out of memory");
  size_t bytes = 0;
  for (size_t i = 0; i < k->n_items; i++) {
    size_t n = k->user[i].n_tokens;
    bytes += ALIGN_UP(n * qrow) * 2 + ALIGN_UP(n * kvrow) * 2 + (want_lse ? ALIGN_UP(n * lrow) : 0);
  }
  if (bytes == 0) bytes = 64;
  rc->block = detattn_arena_alloc(tp->c[r], bytes);
  rc->in_arena = rc->block != NULL;
  if (!rc->block) rc->block = malloc(bytes);
  if (!rc->block) return da_err(DETATTN_RESOURCE_EXHAUSTED, "tp_forward: out of memory for rank %zu's shard", r);
  unsigned char *p = rc->block;
  for (size_t i = 0; i < k->n_items; i++) {
    const detattn_seq_io *u = &k->user[i];
    detattn_seq_io *io = &rc->ios[i];
    size_t n = u->n_tokens;
    *io = (detattn_seq_io){.seq = rank_ids[i * tp->n + r], .pos = u->pos, .n_tokens = u->n_tokens};
    unsigned char *q = p, *kk = q + ALIGN_UP(n * qrow), *v = kk + ALIGN_UP(n * kvrow), *o = v + ALIGN_UP(n * kvrow);
    p = o + ALIGN_UP(n * qrow);
    if (want_lse) {
      io->lse = (float *)p;
      p += ALIGN_UP(n * lrow);
    }
    for (size_t t = 0; t < n; t++) {
      memcpy(q + t * qrow, (const unsigned char *)u->q + (t * HQ + tp->q0[r]) * d * 2, qrow);
      memcpy(kk + t * kvrow, (const unsigned char *)u->k + (t * HKV + tp->kv0[r]) * d * 2, kvrow);
      memcpy(v + t * kvrow, (const unsigned char *)u->v + (t * HKV + tp->kv0[r]) * d * 2, kvrow);
    }
    io->q = q;
    io->k = kk;
    io->v = v;
    io->o = o;
  }
  return DETATTN_OK;
}

static void gather(detattn_tp_call *k, size_t r) {
  detattn_tp *tp = k->tp;
  const size_t d = tp->info.model.head_dim, hq = tp->hq[r], HQ = tp->info.model.n_q_heads;
  for (size_t i = 0; i < k->n_items; i++) {
    const detattn_seq_io *u = &k->user[i], *io = &k->rank[r].ios[i];
    for (size_t t = 0; t < u->n_tokens; t++) {
      memcpy((unsigned char *)u->o + (t * HQ + tp->q0[r]) * d * 2, (const unsigned char *)io->o + t * hq * d * 2,
             hq * d * 2);
      if (u->lse) memcpy(u->lse + t * HQ + tp->q0[r], io->lse + t * hq, hq * 4);
    }
  }
}

/* Waits for every started rank; returns the first failure. When some ranks appended and
 * others did not, the sequences are marked broken. */
static int finish(detattn_tp_call *k) {
  detattn_tp *tp = k->tp;
  if (k->orphaned) {
    /* Every rank's call was orphaned by its client's close too: each ends CANCELLED. */
    for (size_t r = 0; r < k->n_started; r++) {
      detattn_call_wait(k->rank[r].call);
      k->rank[r].call = NULL;
    }
    return da_err(DETATTN_CANCELLED, "tp_forward: cancelled: the group was closed before the call was waited for");
  }
  size_t ok = 0, failed = 0, first = 0;
  for (size_t r = 0; r < k->n_started; r++) {
    tp_rank_call *rc = &k->rank[r];
    rc->status = detattn_call_wait(rc->call);
    rc->call = NULL;
    if (rc->status == DETATTN_OK) {
      ok++;
      if (tp->n > 1) gather(k, r);
    } else {
      snprintf(rc->msg, sizeof rc->msg, "%s", detattn_errmsg());
      if (failed++ == 0) first = r;
    }
  }
  if (failed == 0 && k->n_started == tp->n) return DETATTN_OK;
  if (ok > 0)
    for (size_t i = 0; i < k->n_items; i++) set_broken(tp, k->tp_ids[i], 1);
  if (failed == 0) return DETATTN_OK; /* the caller reports why the rest did not start */
  return da_err(k->rank[first].status, "tp_forward: rank %zu: %s%s", first, k->rank[first].msg,
                ok > 0 ? " (other ranks appended: the sequences must be truncated or closed)" : "");
}

DETATTN_API int detattn_tp_forward_start(detattn_tp *tp, uint32_t layer, detattn_seq_io *items, size_t n,
                                         detattn_tp_call **out) {
  if (!out) return da_err(DETATTN_INVALID_ARGUMENT, "tp_forward: out is NULL");
  *out = NULL;
  if (!tp) return da_err(DETATTN_INVALID_ARGUMENT, "tp_forward: tp is NULL");
  if (!items || n == 0) return da_err(DETATTN_INVALID_ARGUMENT, "tp_forward: no sequences");
  int want_lse = 0, st;
  for (size_t i = 0; i < n; i++) {
    if (items[i].n_tokens > 0 && (!items[i].q || !items[i].k || !items[i].v || !items[i].o))
      return da_err(DETATTN_INVALID_ARGUMENT, "tp_forward: item %zu has %u tokens but a NULL q, k, v or o", i,
                    items[i].n_tokens);
    if (items[i].lse) want_lse = 1;
  }
  detattn_tp_call *k = calloc(1, sizeof *k);
  uint64_t *rank_ids = calloc(n * tp->n, sizeof *rank_ids);
  if (!k || !rank_ids || !(k->user = malloc(n * sizeof *items)) || !(k->tp_ids = malloc(n * sizeof *k->tp_ids)) ||
      !(k->rank = calloc(tp->n, sizeof *k->rank))) {
    free(rank_ids);
    if (k) k->tp = tp, k->n_ranks = k->rank ? tp->n : 0;
    call_free(k);
    return da_err(DETATTN_RESOURCE_EXHAUSTED, "tp_forward: out of memory for %zu items", n);
  }
  k->tp = tp;
  k->n_ranks = tp->n;
  k->n_items = n;
  memcpy(k->user, items, n * sizeof *items);
  for (size_t i = 0; i < n; i++) {
    int broken = 0;
    k->tp_ids[i] = items[i].seq;
    if ((st = lookup(tp, items[i].seq, &rank_ids[i * tp->n], &broken, "tp_forward")) != DETATTN_OK) goto fail;
    if (broken) {
      st = broken_err(items[i].seq, "tp_forward");
      goto fail;
    }
  }
  for (size_t r = 0; r < tp->n; r++) {
    tp_rank_call *rc = &k->rank[r];
    if (tp->n == 1) {
      /* One rank holds every head: the caller's buffers as they are. */
      if (!(rc->ios = malloc(n * sizeof *items))) {
        st = da_err(DETATTN_RESOURCE_EXHAUSTED, "tp_forward: out of memory");
        goto stop;
      }
      memcpy(rc->ios, items, n * sizeof *items);
      for (size_t i = 0; i < n; i++) rc->ios[i].seq = rank_ids[i];
    } else if ((st = shard(k, r, rank_ids, want_lse)) != DETATTN_OK) {
      goto stop;
    }
    if ((st = detattn_forward_start(tp->c[r], layer, rc->ios, n, &rc->call)) != DETATTN_OK) {
      char m[200];
      snprintf(m, sizeof m, "%s", detattn_errmsg());
      st = da_err(st, "tp_forward: rank %zu: %s", r, m);
      goto stop;
    }
    k->n_started = r + 1;
  }
  free(rank_ids);
  pthread_mutex_lock(&tp->mu);
  k->linked = 1;
  k->lnext = tp->live;
  if (tp->live) tp->live->lprev = k;
  tp->live = k;
  pthread_mutex_unlock(&tp->mu);
  *out = k;
  return DETATTN_OK;

stop: {
  /* Ranks already started must finish before their buffers go. */
  char m[240];
  snprintf(m, sizeof m, "%s", detattn_errmsg());
  finish(k);
  da_err(st, "%s", m);
}
fail:
  free(rank_ids);
  call_free(k);
  return st;
}

DETATTN_API int detattn_tp_call_wait(detattn_tp_call *k) {
  if (!k) return da_err(DETATTN_INVALID_ARGUMENT, "tp_call_wait: call is NULL");
  int st = finish(k);
  call_free(k);
  return st;
}

DETATTN_API int detattn_tp_forward(detattn_tp *tp, uint32_t layer, detattn_seq_io *items, size_t n) {
  detattn_tp_call *k;
  int st;
  if ((st = detattn_tp_forward_start(tp, layer, items, n, &k)) != DETATTN_OK) return st;
  return detattn_tp_call_wait(k);
}
