#include "scheduler.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TENANT_BUCKETS 256

struct da_sched_tenant {
  uint64_t key;
  da_sched_queue *ring;             /* its queues with work; the next to take a turn */
  da_sched_tenant *next, *prev;     /* ring of tenants with work */
  da_sched_tenant *hnext;           /* hash chain */
};

struct da_sched {
  da_sched_cfg cfg;
  int oom; /* a unit could not be taken for lack of memory while forming this batch */
  da_kvcache *kv;
  da_sched_tenant *ring; /* the tenant the next batch starts from; NULL when no work */
  da_sched_tenant *buckets[TENANT_BUCKETS];
  int64_t pending_decode;
  da_page_copy *copies; /* planned at admission, not yet in a batch */
  int n_copies, cap_copies;
  da_page_copy *tmp; /* da_kvcache_append's copy plan for one item */
  int cap_tmp;
  int64_t pending_tokens;
  int64_t in_flight;
};

int da_sched_alloc(da_sched **out, const da_sched_cfg *cfg, da_kvcache *kv) {
  if (cfg->split_tokens <= 0 || cfg->page_tokens <= 0 || cfg->max_batch_tokens < 2 ||
      cfg->max_request_tokens <= 0)
    return DETATTN_INVALID_ARGUMENT;
  da_sched *s = calloc(1, sizeof(*s));
  if (s == NULL) return DETATTN_RESOURCE_EXHAUSTED;
  s->cfg = *cfg;
  if (s->cfg.decode_tokens <= 0) s->cfg.decode_tokens = 16;
  s->kv = kv;
  s->cap_tmp = da_kvcache_max_copies(cfg->max_request_tokens, cfg->page_tokens);
  s->tmp = malloc((size_t)s->cap_tmp * sizeof(*s->tmp));
  if (s->tmp == NULL) {
    free(s);
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  *out = s;
  return 0;
}

void da_sched_free(da_sched *s) {
  if (s == NULL) return;
  for (int i = 0; i < TENANT_BUCKETS; i++)
    while (s->buckets[i]) {
      da_sched_tenant *t = s->buckets[i];
      s->buckets[i] = t->hnext;
      free(t);
    }
  free(s->copies);
  free(s->tmp);
  free(s);
}

void da_sched_queue_init(da_sched_queue *q) { memset(q, 0, sizeof(*q)); }

/* Tenants live while they have linked queues; a queue links when it gets work. */
static int ring_link(da_sched *s, da_sched_queue *q) {
  if (q->linked) return 0;
  da_sched_tenant **pp = &s->buckets[q->tenant % TENANT_BUCKETS], *t = *pp;
  while (t && t->key != q->tenant) t = t->hnext;
  if (t == NULL) {
    t = calloc(1, sizeof(*t));
    if (t == NULL) return DETATTN_RESOURCE_EXHAUSTED;
    t->key = q->tenant;
    t->hnext = *pp;
    *pp = t;
  }
  q->linked = 1;
  q->t = t;
  if (t->ring == NULL) {
    q->next = q->prev = q;
    t->ring = q;
    /* Newcomers join at the end of the rotation. */
    if (s->ring == NULL) {
      t->next = t->prev = t;
      s->ring = t;
    } else {
      t->next = s->ring;
      t->prev = s->ring->prev;
      t->prev->next = t;
      s->ring->prev = t;
    }
    return 0;
  }
  q->next = t->ring;
  q->prev = t->ring->prev;
  q->prev->next = q;
  t->ring->prev = q;
  return 0;
}

static void ring_unlink(da_sched *s, da_sched_queue *q) {
  if (!q->linked) return;
  da_sched_tenant *t = q->t;
  q->linked = 0;
  q->t = NULL;
  if (q->next != q) {
    q->prev->next = q->next;
    q->next->prev = q->prev;
    if (t->ring == q) t->ring = q->next;
    q->next = q->prev = NULL;
    return;
  }
  q->next = q->prev = NULL;
  t->ring = NULL;
  if (t->next == t) {
    s->ring = NULL;
  } else {
    t->prev->next = t->next;
    t->next->prev = t->prev;
    if (s->ring == t) s->ring = t->next;
  }
  da_sched_tenant **pp = &s->buckets[t->key % TENANT_BUCKETS];
  while (*pp != t) pp = &(*pp)->hnext;
  *pp = t->hnext;
  free(t);
}

static int is_decode(const da_sched *s, const da_sched_item *it) { return it->n <= s->cfg.decode_tokens; }

static int grow(void **p, int *cap, int need, size_t elem) {
  if (need <= *cap) return 0;
  int n = *cap ? *cap : 16;
  while (n < need) n *= 2;
  void *np = realloc(*p, (size_t)n * elem);
  if (np == NULL) return DETATTN_RESOURCE_EXHAUSTED;
  *p = np;
  *cap = n;
  return 0;
}

int da_sched_admit(da_sched *s, da_sched_queue *q, da_sched_item *items, int n, uint64_t now_ns,
                   char *err, size_t errlen) {
  int64_t need = 0, tokens = 0;
  int max_copies = 0;
  for (int i = 0; i < n; i++) {
    da_sched_item *it = &items[i];
    tokens += it->n;
    if (tokens > s->cfg.max_request_tokens) {
      snprintf(err, errlen, "forward carries more than %d tokens", s->cfg.max_request_tokens);
      return DETATTN_INVALID_ARGUMENT;
    }
    int len = da_kvcache_length(s->kv, it->kv_seq, it->layer);
    if (len < 0) {
      snprintf(err, errlen, "sequence %llu, layer %d: %s", (unsigned long long)it->wire_seq, it->layer,
               da_kvcache_errmsg(s->kv));
      return -len;
    }
    if (it->pos != len) {
      snprintf(err, errlen,
               "sequence %llu, layer %d: pos does not match the layer's length (expected %d, got %d)",
               (unsigned long long)it->wire_seq, it->layer, len, it->pos);
      return DETATTN_FAILED_PRECONDITION;
    }
    int c = da_kvcache_append_cost(s->kv, it->kv_seq, it->layer, it->pos, it->n);
    if (c < 0) {
      snprintf(err, errlen, "sequence %llu, layer %d: %s", (unsigned long long)it->wire_seq, it->layer,
               da_kvcache_errmsg(s->kv));
      return -c;
    }
    need += c;
    max_copies += da_kvcache_max_copies(it->n, s->cfg.page_tokens);
  }
  int free_pages = da_kvcache_pages_free(s->kv);
  if (need > free_pages) {
    snprintf(err, errlen, "KV cache exhausted: this forward needs %lld pages, %d free of %d",
             (long long)need, free_pages, da_kvcache_pages_total(s->kv));
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  if (grow((void **)&s->copies, &s->cap_copies, s->n_copies + max_copies, sizeof(*s->copies)) ||
      ring_link(s, q) != 0) {
    snprintf(err, errlen, "out of memory planning page copies");
    if (q->head == NULL) ring_unlink(s, q);
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  for (int i = 0; i < n; i++) {
    da_sched_item *it = &items[i];
    int nc = 0;
    int rv = da_kvcache_append(s->kv, it->kv_seq, it->layer, it->pos, it->n, s->tmp, s->cap_tmp, &nc);
    if (rv != 0) {
      /* Every check above passed, so this is a bug; items before i stay reserved. */
      snprintf(err, errlen, "sequence %llu: append failed after admission checks: %s",
               (unsigned long long)it->wire_seq, da_kvcache_errmsg(s->kv));
      return DETATTN_INTERNAL;
    }
    if (nc > 0) {
      memcpy(s->copies + s->n_copies, s->tmp, (size_t)nc * sizeof(*s->tmp));
      s->n_copies += nc;
    }
    it->admitted_ns = now_ns;
    it->appended = 0;
    it->q_next = it->q_done = 0;
    it->in_batch = -1;
    it->next = NULL;
    if (q->tail) q->tail->next = it;
    else q->head = it;
    q->tail = it;
    s->pending_tokens += 2 * (int64_t)it->n;
    if (is_decode(s, it)) s->pending_decode++;
    s->in_flight++;
  }
  return 0;
}

int da_sched_cancel(da_sched *s, da_sched_queue *q, void (*done)(void *arg, da_sched_item *it), void *arg) {
  da_sched_item *keep = NULL, *cancelled = NULL, **ct = &cancelled;
  int n = 0;
  /* Only the head can have started; everything behind it is untouched. */
  if (q->head && q->head->appended) {
    keep = q->head;
    q->head = keep->next;
  }
  while (q->head) {
    da_sched_item *it = q->head;
    q->head = it->next;
    it->next = NULL;
    s->pending_tokens -= 2 * (int64_t)it->n;
    if (is_decode(s, it)) s->pending_decode--;
    s->in_flight--;
    *ct = it;
    ct = &it->next;
    n++;
  }
  q->head = q->tail = keep;
  if (keep) keep->next = NULL;
  else ring_unlink(s, q);
  while (cancelled) {
    da_sched_item *it = cancelled;
    cancelled = it->next;
    it->next = NULL;
    done(arg, it);
  }
  return n;
}

int64_t da_sched_pending_tokens(const da_sched *s) { return s->pending_tokens; }
int64_t da_sched_pending_decode(const da_sched *s) { return s->pending_decode; }
int64_t da_sched_items_in_flight(const da_sched *s) { return s->in_flight; }

uint64_t da_sched_oldest_ns(const da_sched *s) {
  uint64_t oldest = 0;
  const da_sched_tenant *t = s->ring;
  if (t == NULL) return 0;
  do {
    const da_sched_queue *q = t->ring;
    do {
      if (q->head && (oldest == 0 || q->head->admitted_ns < oldest)) oldest = q->head->admitted_ns;
      q = q->next;
    } while (q != t->ring);
    t = t->next;
  } while (t != s->ring);
  return oldest;
}

void da_sched_batch_init(da_sched_batch *b) { memset(b, 0, sizeof(*b)); }

void da_sched_batch_fini(da_sched_batch *b) {
  free(b->entries);
  free(b->copies);
  free(b->appends);
  free(b->attns);
  free(b->signals);
  free(b->pages);
  memset(b, 0, sizeof(*b));
}

static int snapshot(da_sched *s, da_sched_batch *b, const da_sched_item *it, size_t *off, int *np) {
  int n_pages = 0;
  const int32_t *pages = da_kvcache_pages(s->kv, it->kv_seq, &n_pages);
  int need = (it->pos + it->n + s->cfg.page_tokens - 1) / s->cfg.page_tokens;
  if (pages == NULL || n_pages < need) return DETATTN_INTERNAL;
  if (b->n_pages + (size_t)need > b->cap_pages) {
    size_t cap = b->cap_pages ? b->cap_pages : 1024;
    while (cap < b->n_pages + (size_t)need) cap *= 2;
    int32_t *p = realloc(b->pages, cap * sizeof(*p));
    if (p == NULL) return DETATTN_RESOURCE_EXHAUSTED;
    b->pages = p;
    b->cap_pages = cap;
  }
  memcpy(b->pages + b->n_pages, pages, (size_t)need * sizeof(*pages));
  *off = b->n_pages;
  *np = need;
  b->n_pages += (size_t)need;
  return 0;
}

/* Room left in the batch being formed: total tokens, and prefill query tokens. */
typedef struct room {
  int tokens;
  int prefill;
} room;

/* Takes one S-aligned query chunk of q's head item into b, if it fits the room. */
static int take_unit(da_sched *s, da_sched_batch *b, da_sched_queue *q, room *rm) {
  da_sched_item *it = q->head;
  if (it == NULL) return 0;
  const int S = s->cfg.split_tokens;
  int qa = it->pos + it->q_next, end = it->pos + it->n;
  int boundary = (qa / S + 1) * S;
  int nq = (end < boundary ? end : boundary) - qa;
  int decode = is_decode(s, it);
  if (!decode && s->cfg.max_prefill_tokens > 0) {
    /* A prefill chunk may end anywhere (chunking never changes a bit): cut it to fit. */
    if (rm->prefill <= 0) return 0;
    if (nq > rm->prefill) nq = rm->prefill;
  }
  int cost = nq + (it->appended ? 0 : it->n);
  if (cost > rm->tokens) return 0;
  if (it->in_batch >= 0) {
    b->entries[it->in_batch].nq += nq;
  } else {
    if (b->n_entries == b->cap_entries) return 0;
    size_t off;
    int np;
    int rv = snapshot(s, b, it, &off, &np);
    if (rv != 0) {
      s->oom |= rv == DETATTN_RESOURCE_EXHAUSTED; /* the unit stays queued, whole */
      return 0;
    }
    int e = b->n_entries++;
    b->entries[e] = (da_sched_entry){.item = it, .q0 = it->q_next, .nq = nq, .appends = !it->appended};
    /* The pointer is fixed up once every snapshot is in place. */
    b->attns[e].pages = (const int32_t *)(uintptr_t)off;
    b->attns[e].n_pages = np;
    it->in_batch = e;
    it->appended = 1;
  }
  if (it->q_next == 0 && decode) s->pending_decode--;
  it->q_next += nq;
  rm->tokens -= cost;
  if (!decode) rm->prefill -= nq;
  s->pending_tokens -= cost;
  b->tokens += cost;
  b->query_tokens += nq;
  if (it->q_next == it->n) {
    q->head = it->next;
    if (q->head == NULL) q->tail = NULL;
  }
  return 1;
}

/* Rounds over the tenants until one takes nothing or the room is spent: in a round each
 * tenant gives one unit, from the first of its queues (taking turns) that has one to give;
 * decode_only: only queues whose head is a decode item. */
static void take_rounds(da_sched *s, da_sched_batch *b, room *rm, int decode_only) {
  int progress = 1;
  while (progress && rm->tokens > 0) {
    progress = 0;
    da_sched_tenant *t = s->ring;
    do {
      da_sched_queue *q = t->ring;
      do {
        if ((!decode_only || (q->head != NULL && is_decode(s, q->head))) && take_unit(s, b, q, rm)) {
          progress = 1;
          t->ring = q->next;
          break;
        }
        q = q->next;
      } while (q != t->ring);
      t = t->next;
    } while (t != s->ring && rm->tokens > 0);
  }
}

static int ensure_storage(da_sched *s, da_sched_batch *b) {
  int cap = s->cfg.max_batch_tokens;
  if (b->cap_entries >= cap) return 0;
  da_sched_entry *e = realloc(b->entries, (size_t)cap * sizeof(*e));
  if (e) b->entries = e;
  da_append *a = realloc(b->appends, (size_t)cap * sizeof(*a));
  if (a) b->appends = a;
  da_attn *t = realloc(b->attns, (size_t)cap * sizeof(*t));
  if (t) b->attns = t;
  void **g = realloc(b->signals, (size_t)cap * sizeof(*g));
  if (g) b->signals = g;
  if (!e || !a || !t || !g) return DETATTN_RESOURCE_EXHAUSTED;
  b->cap_entries = cap;
  return 0;
}

static da_split_mode choose_mode(const da_sched *s, const da_sched_batch *b) {
  if (s->cfg.partial_rows < 0) return DA_SPLIT_AUTO;
  const int S = s->cfg.split_tokens, W = s->cfg.model.window;
  int64_t slots = 0;
  int max_splits = 0;
  for (int i = 0; i < b->n_entries; i++) {
    const da_sched_entry *e = &b->entries[i];
    int p = e->item->pos + e->q0 + e->nq - 1;
    int w0 = W > 0 && p - W + 1 > 0 ? p - W + 1 : 0;
    int splits = p / S - w0 / S + 1;
    if (splits > max_splits) max_splits = splits;
    slots += (int64_t)e->nq * s->cfg.model.n_q_heads * splits;
  }
  if (b->rows < s->cfg.partial_rows && max_splits >= 2 && slots <= s->cfg.acc_slots)
    return DA_SPLIT_PARTIAL;
  return DA_SPLIT_INROW;
}

int da_sched_form(da_sched *s, da_sched_batch *b, uint64_t now_ns) {
  b->n_entries = 0;
  b->tokens = b->query_tokens = 0;
  b->rows = 0;
  b->n_pages = 0;
  b->formed_ns = now_ns;
  b->b = (da_batch){0};
  s->oom = 0;
  if (ensure_storage(s, b) != 0) return DETATTN_RESOURCE_EXHAUSTED;
  if (grow((void **)&b->copies, &b->cap_copies, s->n_copies, sizeof(*b->copies)))
    return DETATTN_RESOURCE_EXHAUSTED;
  if (s->n_copies > 0) memcpy(b->copies, s->copies, (size_t)s->n_copies * sizeof(*s->copies));
  int n_copies = s->n_copies;
  s->n_copies = 0;

  room rm = {.tokens = s->cfg.max_batch_tokens, .prefill = s->cfg.max_prefill_tokens};
  if (s->ring != NULL) {
    /* 1. Decode heads, one per tenant per round. They leave room for the first chunk of
     * the largest request (max_request_tokens + S fits a batch by configuration), so
     * prefill is never starved by decode. */
    int reserve = s->cfg.max_request_tokens + s->cfg.split_tokens;
    room drm = rm;
    drm.tokens = rm.tokens - reserve;
    if (drm.tokens > 0) {
      take_rounds(s, b, &drm, 1);
      rm.tokens = drm.tokens + reserve;
    }
    /* 2. Prefill chunks (and decode heads that surfaced), one unit per tenant per round,
     * each tenant's queues taking turns. */
    take_rounds(s, b, &rm, 0);
    /* The next batch starts from the next tenant; queues that ran dry leave the rings. */
    da_sched_tenant *t0 = s->ring;
    s->ring = t0->next;
    int n_tenants = 1;
    for (da_sched_tenant *t = t0->next; t != t0; t = t->next) n_tenants++;
    da_sched_tenant *t = t0;
    for (int i = 0; i < n_tenants; i++) {
      da_sched_tenant *tnext = t->next;
      da_sched_queue *q = t->ring;
      int n_queues = 1;
      for (da_sched_queue *p = q->next; p != q; p = p->next) n_queues++;
      for (int j = 0; j < n_queues; j++) {
        da_sched_queue *qnext = q->next;
        if (q->head == NULL) ring_unlink(s, q); /* may free t when it was its last queue */
        q = qnext;
      }
      t = tnext;
    }
  }

  int n_appends = 0, n_signals = 0;
  for (int i = 0; i < b->n_entries; i++) {
    da_sched_entry *e = &b->entries[i];
    da_sched_item *it = e->item;
    da_attn *a = &b->attns[i];
    const int32_t *pages = b->pages + (size_t)(uintptr_t)a->pages;
    size_t qoff = (size_t)e->q0 * (size_t)s->cfg.model.n_q_heads * (size_t)s->cfg.model.head_dim *
                  da_dtype_size(s->cfg.model.dtype);
    *a = (da_attn){.layer = it->layer, .q_pos = it->pos + e->q0, .n_q = e->nq, .pages = pages,
                   .n_pages = a->n_pages, .q = (const char *)it->q + qoff, .o = (char *)it->o + qoff,
                   .lse = it->lse ? it->lse + (size_t)e->q0 * (size_t)s->cfg.model.n_q_heads : NULL,
                   .dev = it->dev_q};
    if (e->appends)
      b->appends[n_appends++] = (da_append){.layer = it->layer, .pos = it->pos, .n_tokens = it->n,
                                            .pages = pages, .n_pages = a->n_pages, .k = it->k, .v = it->v,
                                            .dev = it->dev_kv};
    if (it->signal) {
      int seen = 0;
      for (int k = n_signals - 1; k >= 0 && !seen; k--) seen = b->signals[k] == it->signal;
      if (!seen) b->signals[n_signals++] = it->signal;
    }
    it->in_batch = -1;
    b->rows += (int64_t)e->nq * s->cfg.model.n_q_heads;
  }
  b->b.copies = b->copies;
  b->b.n_copies = n_copies;
  b->b.appends = b->appends;
  b->b.n_appends = n_appends;
  b->b.attns = b->attns;
  b->b.n_attns = b->n_entries;
  b->b.split_mode = choose_mode(s, b);
  b->b.signals = b->signals;
  b->b.n_signals = n_signals;
  /* Work waits but nothing could be taken: the caller retries (an empty batch would not). */
  if (s->oom && b->n_entries == 0 && n_copies == 0) return DETATTN_RESOURCE_EXHAUSTED;
  return 0;
}

void da_sched_complete(da_sched *s, da_sched_batch *b, void (*done)(void *arg, da_sched_item *it),
                       void *arg) {
  for (int i = 0; i < b->n_entries; i++) {
    da_sched_item *it = b->entries[i].item;
    it->q_done += b->entries[i].nq;
    if (it->q_done == it->n) {
      s->in_flight--;
      done(arg, it);
    }
  }
  b->n_entries = 0;
  b->b = (da_batch){0};
}
