#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_impl.h"
#include "da.h"
#include "detattn.pb-c.h"

typedef Detattn__V1__Request Request;
typedef Detattn__V1__Response Response;

/* The largest reply rq can get when it is small enough for a doorbell slot, else 0: sequence
 * ops and stats, and Forwards whose outputs all travel by reference (then a reply is a status
 * of at most a few hundred bytes and an empty output per sequence). */
static size_t doorbell_reply_max(const Request *rq) {
  switch (rq->op_case) {
  case DETATTN__V1__REQUEST__OP_SEQ_OPEN:
  case DETATTN__V1__REQUEST__OP_SEQ_FORK:
  case DETATTN__V1__REQUEST__OP_SEQ_TRUNCATE:
  case DETATTN__V1__REQUEST__OP_SEQ_CLOSE: return 1024;
  case DETATTN__V1__REQUEST__OP_STATS: return 4096;
  case DETATTN__V1__REQUEST__OP_FORWARD: {
    const Detattn__V1__Forward *f = rq->forward;
    for (size_t i = 0; i < f->n_seqs; i++)
      if (!f->seqs[i]->o_ref || (f->want_lse && !f->seqs[i]->lse_ref)) return 0;
    return 1024 + 8 * f->n_seqs;
  }
  default: return 0;
  }
}

/* Packs rq (its id is assigned here) into a message and starts the call. */
static int start_request(detattn_client *c, Request *rq, detattn_call **out) {
  nng_msg *m;
  int rv;

  rq->id = da_client_next_id(c);
  size_t len = detattn__v1__request__get_packed_size(rq);
  if ((rv = nng_msg_alloc(&m, len)) != 0)
    return da_err(DETATTN_RESOURCE_EXHAUSTED, "cannot allocate a %zu-byte request: %s", len, nng_strerror(rv));
  detattn__v1__request__pack(rq, nng_msg_body(m));
  return da_call_start(c, m, rq->id, (int)rq->op_case, doorbell_reply_max(rq), out);
}

/* The result case a request's op is answered with: Response's oneof numbers are the
 * Request's plus one. */
static int expected_result(int op) { return op + 1; }

/* A protobuf-c allocator with a byte budget: decoding a reply may allocate at most a fixed
 * multiple of its length, so a hostile daemon cannot make a small reply cost much memory. */
typedef struct budget {
  size_t left;
} budget;

static void *budget_alloc(void *arg, size_t size) {
  budget *b = arg;
  size_t need = size + 16;
  if (need < size || need > b->left) return NULL;
  size_t *p = malloc(need);
  if (!p) return NULL;
  b->left -= need;
  p[0] = need;
  return (char *)p + 16;
}

static void budget_free(void *arg, void *ptr) {
  budget *b = arg;
  if (!ptr) return;
  size_t *p = (size_t *)((char *)ptr - 16);
  b->left += p[0];
  free(p);
}

/* The most bytes the reply to call k may have: what its request can produce. */
static size_t reply_bound(const detattn_call *k) {
  if (k->n_out == 0) return DA_CLIENT_SMALL_REPLY_BYTES;
  const detattn_model *m = &k->model;
  uint64_t o_row = (uint64_t)m->n_q_heads * m->head_dim * 2, lse_row = k->want_lse ? (uint64_t)m->n_q_heads * 4 : 0;
  uint64_t n = 4096;
  for (size_t i = 0; i < k->n_out; i++) n += k->out[i].n_tokens * (o_row + lse_row) + 32;
  return n > SIZE_MAX ? SIZE_MAX : (size_t)n;
}

/* Decodes reply bytes for call k and checks their length, id, status and kind. On
 * DETATTN_OK *out is the decoded Response (its allocator draws on b). */
static int decode_response(detattn_call *k, const void *buf, size_t len, Response **out, budget *b) {
  int st;

  *out = NULL;
  size_t bound = reply_bound(k);
  if (len > bound)
    return da_err(DETATTN_INTERNAL, "reply of %zu bytes from the daemon; this call's reply is at most %zu", len,
                  bound);
  b->left = 2 * len + 64 * (k->n_out + 16) + 4096;
  ProtobufCAllocator a = {budget_alloc, budget_free, b};
  Response *r = detattn__v1__response__unpack(&a, len, buf);
  if (!r) return da_err(DETATTN_INTERNAL, "malformed response from the daemon (%zu bytes)", len);
  if (r->id != k->id) {
    st = da_err(DETATTN_INTERNAL, "response id %llu does not match request id %llu",
                (unsigned long long)r->id, (unsigned long long)k->id);
    goto fail;
  }
  if (r->status && r->status->code != DETATTN_OK) {
    st = r->status->code <= DETATTN_DATA_LOSS ? (int)r->status->code : DETATTN_UNKNOWN;
    da_err(st, "%s", r->status->message && r->status->message[0] ? r->status->message : detattn_status_str(st));
    goto fail;
  }
  if ((int)r->result_case != expected_result(k->op)) {
    st = da_err(DETATTN_INTERNAL, "response of kind %d to a request of kind %d", (int)r->result_case, k->op);
    goto fail;
  }
  *out = r;
  return DETATTN_OK;
fail:
  detattn__v1__response__free_unpacked(r, &a);
  return st;
}

/* Waits for the transport and decodes the Response (decode_response). */
static int finish_response(detattn_call *k, Response **out, budget *b) {
  nng_msg *m = NULL;
  int st;

  *out = NULL;
  if ((st = da_call_transport_wait(k, &m)) != DETATTN_OK) return st;
  st = decode_response(k, nng_msg_body(m), nng_msg_len(m), out, b);
  nng_msg_free(m);
  return st;
}

/* A decoded reply and the budget its allocator draws on. */
typedef struct reply {
  Response *r;
  budget b;
} reply;

static void reply_free(reply *x) {
  ProtobufCAllocator a = {budget_alloc, budget_free, &x->b};
  if (x->r) detattn__v1__response__free_unpacked(x->r, &a);
  x->r = NULL;
}

/* A blocking call: start, wait, check. */
static int roundtrip(detattn_client *c, Request *rq, reply *out) {
  detattn_call *k;
  int st;

  out->r = NULL;
  if (!c) return da_err(DETATTN_INVALID_ARGUMENT, "client is NULL");
  if ((st = start_request(c, rq, &k)) != DETATTN_OK) return st;
  st = finish_response(k, &out->r, &out->b);
  da_call_free(k);
  return st;
}

/* A blocking call whose reply carries nothing but its status. */
static int roundtrip_status(detattn_client *c, Request *rq) {
  reply x;
  int st = roundtrip(c, rq, &x);
  if (st == DETATTN_OK) reply_free(&x);
  return st;
}

static void copy_str(char *dst, size_t cap, const char *src) { snprintf(dst, cap, "%s", src ? src : ""); }

static int info_from_reply(const Detattn__V1__HelloReply *h, detattn_server_info *o) {
  memset(o, 0, sizeof *o);
  if (!h->model || !h->numerics || !h->limits)
    return da_err(DETATTN_INTERNAL, "hello reply without model, numerics or limits");
  const Detattn__V1__ModelConfig *m = h->model;
  if (h->protocol_version != DETATTN_PROTOCOL_VERSION)
    return da_err(DETATTN_FAILED_PRECONDITION, "daemon speaks protocol %u, this library protocol %d",
                  h->protocol_version, DETATTN_PROTOCOL_VERSION);
  if (m->n_layers == 0 || m->n_q_heads == 0 || m->n_kv_heads == 0 || m->head_dim == 0 ||
      m->n_q_heads % m->n_kv_heads != 0 || m->page_tokens == 0 ||
      (m->dtype != DETATTN__V1__DTYPE__DTYPE_BF16 && m->dtype != DETATTN__V1__DTYPE__DTYPE_FP16))
    return da_err(DETATTN_INTERNAL,
                  "hello reply with an invalid model (layers %u, q heads %u, kv heads %u, head_dim %u, dtype %d)",
                  m->n_layers, m->n_q_heads, m->n_kv_heads, m->head_dim, (int)m->dtype);
  copy_str(o->server_version, sizeof o->server_version, h->server_version);
  o->protocol_version = h->protocol_version;
  o->model.n_layers = m->n_layers;
  o->model.n_q_heads = m->n_q_heads;
  o->model.n_kv_heads = m->n_kv_heads;
  o->model.head_dim = m->head_dim;
  o->model.dtype = m->dtype == DETATTN__V1__DTYPE__DTYPE_FP16 ? DETATTN_FP16 : DETATTN_BF16;
  o->model.scale = m->scale;
  o->model.softcap = m->softcap;
  o->model.window = m->window;
  o->model.page_tokens = m->page_tokens;
  copy_str(o->backend, sizeof o->backend, h->numerics->backend);
  copy_str(o->arch, sizeof o->arch, h->numerics->arch);
  o->kernel_version = h->numerics->kernel_version;
  o->split_tokens = h->numerics->split_tokens;
  o->tile_tokens = h->numerics->tile_tokens;
  o->fingerprint = h->numerics->fingerprint;
  o->max_message_bytes = h->limits->max_message_bytes;
  o->max_tokens_per_request = h->limits->max_tokens_per_request;
  o->kv_capacity_tokens = h->limits->kv_capacity_tokens;
  o->kv_pages = h->limits->kv_pages;
  o->data_planes = 1u << DETATTN_PLANE_COPY;
  for (size_t i = 0; i < h->n_data_planes; i++) {
    if (strcmp(h->data_planes[i], "shm") == 0) o->data_planes |= 1u << DETATTN_PLANE_SHM;
    if (strcmp(h->data_planes[i], "cuda") == 0) o->data_planes |= 1u << DETATTN_PLANE_CUDA;
  }
  return DETATTN_OK;
}

/* RegisterArena: the id and token the memory is to be handed over with. */
static int roundtrip_register(detattn_client *c, Detattn__V1__RegisterArena *ra, uint32_t *id, uint64_t *token) {
  Request rq = DETATTN__V1__REQUEST__INIT;
  reply x;
  int st;

  rq.op_case = DETATTN__V1__REQUEST__OP_REGISTER_ARENA;
  rq.register_arena = ra;
  if ((st = roundtrip(c, &rq, &x)) != DETATTN_OK) return st;
  *id = x.r->register_arena->arena;
  *token = x.r->register_arena->token;
  reply_free(&x);
  return DETATTN_OK;
}

/* Registers the arena on this connection and hands it over (shm plane). */
static int arena_register(detattn_client *c) {
  Detattn__V1__RegisterArena ra = DETATTN__V1__REGISTER_ARENA__INIT;
  uint32_t id;
  uint64_t token;
  int st;

  if (!c->arena.base && (st = da_arena_create(&c->arena, (size_t)c->opts.arena_bytes)) != DETATTN_OK) return st;
  ra.size = c->arena.size;
  if ((st = roundtrip_register(c, &ra, &id, &token)) != DETATTN_OK) return st;
  char path[256];
  pthread_mutex_lock(&c->mu);
  snprintf(path, sizeof path, "%s", c->arena_path);
  int timeout = c->timeout_ms;
  pthread_mutex_unlock(&c->mu);
  if ((st = da_arena_handover(&c->arena, path, id, token, timeout)) != DETATTN_OK) return st;
  pthread_mutex_lock(&c->mu);
  c->arena_id = id;
  c->plane = DETATTN_PLANE_SHM;
  pthread_mutex_unlock(&c->mu);
  return DETATTN_OK;
}

/* The doorbell ring's geometry: 64 calls in flight, requests of up to 64 KiB (a Forward by
 * reference of several hundred sequences), replies of up to 8 KiB. The memfd is sparse:
 * only the pages calls touch take memory. */
#define RING_SLOTS 64
#define RING_REQUEST_BYTES (64u << 10)
#define RING_REPLY_BYTES (8u << 10)

/* Registers a doorbell ring on this connection and hands it over; it becomes the client's
 * unless the connection dropped meanwhile (gen changed: the daemon forgot it). */
static int ring_register(detattn_client *c, const char *path, int timeout, unsigned gen) {
  Detattn__V1__RegisterArena ra = DETATTN__V1__REGISTER_ARENA__INIT;
  Detattn__V1__DoorbellRing g = DETATTN__V1__DOORBELL_RING__INIT;
  da_ring *r;
  uint32_t id;
  uint64_t token;
  int st;

  if ((st = da_ring_create(&r, RING_SLOTS, RING_REQUEST_BYTES, RING_REPLY_BYTES, c->opts.doorbell_spin_us)) !=
      DETATTN_OK)
    return st;
  da_ring_geometry(r, &g.slots, &g.request_bytes, &g.reply_bytes, &ra.size);
  ra.doorbell = &g;
  if ((st = roundtrip_register(c, &ra, &id, &token)) == DETATTN_OK)
    st = da_ring_handover(r, path, id, token, timeout);
  if (st == DETATTN_OK) {
    pthread_mutex_lock(&c->mu);
    if (c->conn_gen == gen && !c->closing && !c->ring) {
      c->ring = r;
      r = NULL;
    }
    pthread_mutex_unlock(&c->mu);
  }
  da_ring_unref(r);
  return st;
}

/* After the plane: the doorbell ring, once per connection (doorbell.c). AUTO uses it when
 * the daemon offers one and the plane is not copy, and goes on over nng when it cannot be
 * set up; ON fails the call (FAILED_PRECONDITION) without it; OFF never sets one up. */
static int doorbell_setup(detattn_client *c) {
  detattn_doorbell want = c->opts.doorbell;
  if (want == DETATTN_DOORBELL_OFF) return DETATTN_OK;
  pthread_mutex_lock(&c->plane_mu);
  pthread_mutex_lock(&c->mu);
  int have = c->ring != NULL, offered = c->doorbell_offered && c->arena_path[0], plane = c->plane;
  unsigned gen = c->conn_gen;
  int timeout = c->timeout_ms;
  char path[256];
  snprintf(path, sizeof path, "%s", c->arena_path);
  pthread_mutex_unlock(&c->mu);
  int st = DETATTN_OK;
  if (!have && (want == DETATTN_DOORBELL_ON || plane != DETATTN_PLANE_COPY)) {
    if (!offered)
      st = da_err(DETATTN_FAILED_PRECONDITION, "the daemon at %s offers no doorbell (it needs ipc:// with the "
                  "shared-memory plane and --doorbell 1)", c->url);
    else
      st = ring_register(c, path, timeout, gen);
    if (st != DETATTN_OK && want == DETATTN_DOORBELL_AUTO) st = DETATTN_OK;
    else if (st != DETATTN_OK && st != DETATTN_FAILED_PRECONDITION)
      st = da_err(DETATTN_FAILED_PRECONDITION, "doorbell: %s", detattn_errmsg());
  }
  pthread_mutex_unlock(&c->plane_mu);
  return st;
}

/* After a Hello: sets up the plane asked for, once per connection. AUTO falls back to copy
 * (and says why in the error message of nothing: the call goes on); SHM fails the call. Then
 * the doorbell (doorbell_setup). */
static int plane_setup(detattn_client *c, const detattn_server_info *info) {
  detattn_data_plane want = c->opts.data_plane;
  int cuda = (info->data_planes & (1u << DETATTN_PLANE_CUDA)) != 0;
  pthread_mutex_lock(&c->mu);
  c->cuda_plane = cuda && want != DETATTN_PLANE_COPY;
  pthread_mutex_unlock(&c->mu);
  if (want == DETATTN_PLANE_CUDA && !cuda)
    return da_err(DETATTN_FAILED_PRECONDITION,
                  "the daemon at %s offers no cuda plane (it needs --backend cuda and an ipc:// listener)", c->url);
  if (want == DETATTN_PLANE_CUDA) want = DETATTN_PLANE_AUTO; /* host tensors: shm where offered */
  if (want == DETATTN_PLANE_COPY) return doorbell_setup(c);
  pthread_mutex_lock(&c->plane_mu);
  pthread_mutex_lock(&c->mu);
  int have = c->arena_id != 0;
  pthread_mutex_unlock(&c->mu);
  int st = DETATTN_OK;
  if (!have) {
    if (!(info->data_planes & (1u << DETATTN_PLANE_SHM)))
      st = da_err(DETATTN_FAILED_PRECONDITION, "the daemon at %s offers no shared-memory plane (it needs ipc://)",
                  c->url);
    else
      st = arena_register(c);
    if (st != DETATTN_OK) {
      pthread_mutex_lock(&c->mu);
      c->plane = DETATTN_PLANE_COPY;
      pthread_mutex_unlock(&c->mu);
      if (want == DETATTN_PLANE_AUTO) st = DETATTN_OK;
      else if (st != DETATTN_FAILED_PRECONDITION)
        st = da_err(DETATTN_FAILED_PRECONDITION, "shared-memory plane: %s", detattn_errmsg());
    }
  }
  pthread_mutex_unlock(&c->plane_mu);
  if (st == DETATTN_OK) st = doorbell_setup(c);
  return st;
}

int da_ops_register_cuda(detattn_client *c, int event, const void *handle, size_t len, uint64_t size,
                         uint32_t *id) {
  Request rq = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__RegisterCuda rc = DETATTN__V1__REGISTER_CUDA__INIT;
  reply x;
  int st;

  rc.handle = (ProtobufCBinaryData){len, (uint8_t *)(uintptr_t)handle};
  rc.size = size;
  rc.event = event != 0;
  rq.op_case = DETATTN__V1__REQUEST__OP_REGISTER_CUDA;
  rq.register_cuda = &rc;
  if ((st = roundtrip(c, &rq, &x)) != DETATTN_OK) return st;
  *id = x.r->register_cuda->id;
  reply_free(&x);
  if (*id == 0) return da_err(DETATTN_INTERNAL, "register_cuda reply with region id 0");
  return DETATTN_OK;
}

int da_ops_unregister(detattn_client *c, uint32_t id) {
  Request rq = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__UnregisterArena ua = DETATTN__V1__UNREGISTER_ARENA__INIT;

  ua.arena = id;
  rq.op_case = DETATTN__V1__REQUEST__OP_UNREGISTER_ARENA;
  rq.unregister_arena = &ua;
  return roundtrip_status(c, &rq);
}

DETATTN_API int detattn_hello(detattn_client *c, detattn_server_info *out) {
  Request rq = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__Hello h = DETATTN__V1__HELLO__INIT;
  reply x;
  detattn_server_info info;
  int st;

  if (!out) return da_err(DETATTN_INVALID_ARGUMENT, "hello: out is NULL");
  h.protocol_version = DETATTN_PROTOCOL_VERSION;
  h.client_name = "libdetattn";
  rq.op_case = DETATTN__V1__REQUEST__OP_HELLO;
  rq.hello = &h;
  if ((st = roundtrip(c, &rq, &x)) != DETATTN_OK) return st;
  st = info_from_reply(x.r->hello, &info);
  if (st == DETATTN_OK) {
    pthread_mutex_lock(&c->mu);
    snprintf(c->arena_path, sizeof c->arena_path, "%s", x.r->hello->arena_path ? x.r->hello->arena_path : "");
    c->doorbell_offered = x.r->hello->doorbell;
    pthread_mutex_unlock(&c->mu);
  }
  reply_free(&x);
  if (st != DETATTN_OK) return st;
  if ((st = da_client_set_info(c, &info)) != DETATTN_OK) return st;
  if ((st = plane_setup(c, &info)) != DETATTN_OK) return st;
  *out = info;
  return DETATTN_OK;
}

/* The model every Forward is checked against: Hello, once per connection. */
static int get_info(detattn_client *c, detattn_server_info *out) {
  if (da_client_get_info(c, out)) return DETATTN_OK;
  return detattn_hello(c, out);
}

static void summary(const Detattn__V1__Summary *s, double *mean, double *p50, double *p99, double *max) {
  if (!s) return;
  if (mean) *mean = s->mean;
  if (p50) *p50 = s->p50;
  if (p99) *p99 = s->p99;
  if (max) *max = s->max;
}

DETATTN_API int detattn_stats_get(detattn_client *c, detattn_stats *out) {
  Request rq = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__Stats s = DETATTN__V1__STATS__INIT;
  reply x;
  int st;

  if (!out) return da_err(DETATTN_INVALID_ARGUMENT, "stats: out is NULL");
  rq.op_case = DETATTN__V1__REQUEST__OP_STATS;
  rq.stats = &s;
  if ((st = roundtrip(c, &rq, &x)) != DETATTN_OK) return st;
  const Detattn__V1__StatsReply *s_ = x.r->stats;
  memset(out, 0, sizeof *out);
  out->uptime_ms = s_->uptime_ms;
  out->requests = s_->requests;
  out->errors = s_->errors;
  for (size_t i = 0; i < s_->n_ops; i++)
    if (s_->ops[i]->op && strcmp(s_->ops[i]->op, "forward") == 0) out->forwards = s_->ops[i]->ok;
  out->forward_tokens = s_->forward_tokens;
  out->batches = s_->batches;
  summary(s_->batch_tokens, &out->batch_tokens_mean, &out->batch_tokens_p50, &out->batch_tokens_p99,
          &out->batch_tokens_max);
  summary(s_->batch_requests, &out->batch_requests_mean, NULL, NULL, &out->batch_requests_max);
  summary(s_->queue_us, &out->queue_us_mean, &out->queue_us_p50, &out->queue_us_p99, &out->queue_us_max);
  out->inrow_items = s_->inrow_rows;
  out->partial_items = s_->partial_rows;
  out->kv_pages_total = s_->kv_pages_total;
  out->kv_pages_used = s_->kv_pages_used;
  out->kv_pages_free = s_->kv_pages_free;
  out->sequences = s_->sequences;
  out->clients = s_->clients;
  out->arenas = s_->arenas;
  out->arena_bytes = s_->arena_bytes;
  reply_free(&x);
  return DETATTN_OK;
}

DETATTN_API int detattn_seq_open(detattn_client *c, uint64_t *seq_out) {
  Request rq = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__SeqOpen o = DETATTN__V1__SEQ_OPEN__INIT;
  reply x;
  int st;

  if (!seq_out) return da_err(DETATTN_INVALID_ARGUMENT, "seq_open: seq_out is NULL");
  rq.op_case = DETATTN__V1__REQUEST__OP_SEQ_OPEN;
  rq.seq_open = &o;
  if ((st = roundtrip(c, &rq, &x)) != DETATTN_OK) return st;
  *seq_out = x.r->seq_open->seq;
  reply_free(&x);
  return DETATTN_OK;
}

DETATTN_API int detattn_seq_fork(detattn_client *c, uint64_t src, uint64_t *seq_out) {
  Request rq = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__SeqFork f = DETATTN__V1__SEQ_FORK__INIT;
  reply x;
  int st;

  if (!seq_out) return da_err(DETATTN_INVALID_ARGUMENT, "seq_fork: seq_out is NULL");
  f.src = src;
  rq.op_case = DETATTN__V1__REQUEST__OP_SEQ_FORK;
  rq.seq_fork = &f;
  if ((st = roundtrip(c, &rq, &x)) != DETATTN_OK) return st;
  *seq_out = x.r->seq_fork->seq;
  reply_free(&x);
  return DETATTN_OK;
}

DETATTN_API int detattn_seq_truncate(detattn_client *c, uint64_t seq, uint32_t length) {
  Request rq = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__SeqTruncate t = DETATTN__V1__SEQ_TRUNCATE__INIT;

  t.seq = seq;
  t.length = length;
  rq.op_case = DETATTN__V1__REQUEST__OP_SEQ_TRUNCATE;
  rq.seq_truncate = &t;
  return roundtrip_status(c, &rq);
}

DETATTN_API int detattn_seq_close(detattn_client *c, uint64_t seq) {
  Request rq = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__SeqClose sc = DETATTN__V1__SEQ_CLOSE__INIT;

  sc.seq = seq;
  rq.op_case = DETATTN__V1__REQUEST__OP_SEQ_CLOSE;
  rq.seq_close = &sc;
  return roundtrip_status(c, &rq);
}

/* The arguments every Forward checks before anything is built; *want_lse when any item has
 * an lse buffer. what names the call in messages. */
static int check_call(detattn_client *c, const detattn_seq_io *items, size_t n, detattn_call **out, const char *what,
                      int *want_lse) {
  if (!out) return da_err(DETATTN_INVALID_ARGUMENT, "%s: out is NULL", what);
  *out = NULL;
  if (!c) return da_err(DETATTN_INVALID_ARGUMENT, "%s: client is NULL", what);
  if (!items || n == 0) return da_err(DETATTN_INVALID_ARGUMENT, "%s: no sequences", what);
  *want_lse = 0;
  for (size_t i = 0; i < n; i++) {
    if (items[i].n_tokens > 0 && (!items[i].q || !items[i].k || !items[i].v || !items[i].o))
      return da_err(DETATTN_INVALID_ARGUMENT, "%s: item %zu has %u tokens but a NULL q, k, v or o", what, i,
                    items[i].n_tokens);
    if (items[i].lse) *want_lse = 1;
  }
  return DETATTN_OK;
}

/* A ForwardSeq naming its sequence, position and token count, without tensors. */
static void forward_seq_init(Detattn__V1__ForwardSeq *s, const detattn_seq_io *it) {
  *s = (Detattn__V1__ForwardSeq)DETATTN__V1__FORWARD_SEQ__INIT;
  s->seq = it->seq;
  s->pos = it->pos;
  s->n_tokens = it->n_tokens;
}

/* Makes rq the Forward f of layer over the n sequences seqs. */
static void forward_fill(Request *rq, Detattn__V1__Forward *f, uint32_t layer, Detattn__V1__ForwardSeq **seqs,
                         size_t n, int want_lse) {
  f->layer = layer;
  f->n_seqs = n;
  f->seqs = seqs;
  f->want_lse = want_lse;
  rq->op_case = DETATTN__V1__REQUEST__OP_FORWARD;
  rq->forward = f;
}

DETATTN_API int detattn_forward_start(detattn_client *c, uint32_t layer, detattn_seq_io *items, size_t n,
                                      detattn_call **out) {
  Request rq = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__Forward f = DETATTN__V1__FORWARD__INIT;
  Detattn__V1__ForwardSeq *seqs = NULL, **ptrs = NULL;
  Detattn__V1__TensorRef *refs = NULL;
  void **scratch = NULL;
  size_t n_refs = 0, n_scratch = 0;
  da_call_out *outs = NULL;
  detattn_server_info info;
  detattn_call *k;
  int st, want_lse = 0;

  if ((st = check_call(c, items, n, out, "forward", &want_lse)) != DETATTN_OK) return st;
  if ((st = get_info(c, &info)) != DETATTN_OK) return st;
  const detattn_model *m = &info.model;
  uint64_t q_row = (uint64_t)m->n_q_heads * m->head_dim * 2, kv_row = (uint64_t)m->n_kv_heads * m->head_dim * 2;
  uint64_t lse_row = (uint64_t)m->n_q_heads * 4;

  seqs = calloc(n, sizeof *seqs);
  ptrs = calloc(n, sizeof *ptrs);
  outs = calloc(n, sizeof *outs);
  refs = calloc(5 * n, sizeof *refs);
  scratch = calloc(5 * n, sizeof *scratch);
  if (!seqs || !ptrs || !outs || !refs || !scratch) {
    st = da_err(DETATTN_RESOURCE_EXHAUSTED, "forward: out of memory for %zu items", n);
    goto done;
  }
  pthread_mutex_lock(&c->mu);
  uint32_t arena = c->plane == DETATTN_PLANE_SHM ? c->arena_id : 0;
  pthread_mutex_unlock(&c->mu);
  for (size_t i = 0; i < n; i++) {
    const detattn_seq_io *it = &items[i];
    forward_seq_init(&seqs[i], it);
    size_t qb = (size_t)(it->n_tokens * q_row), kb = (size_t)(it->n_tokens * kv_row), lb = (size_t)it->n_tokens * lse_row;
    outs[i] = (da_call_out){.n_tokens = it->n_tokens, .o = it->o, .lse = it->lse};
    if (arena) {
      /* By reference: tensors in the arena as they are, others through a scratch block. */
      const void *in[3] = {it->q, it->k, it->v};
      size_t len[3] = {qb, kb, kb};
      Detattn__V1__TensorRef **dst[3] = {&seqs[i].q_ref, &seqs[i].k_ref, &seqs[i].v_ref};
      for (int t = 0; t < 3; t++) {
        Detattn__V1__TensorRef *r = &refs[n_refs++];
        *r = (Detattn__V1__TensorRef)DETATTN__V1__TENSOR_REF__INIT;
        r->arena = arena;
        r->length = len[t];
        if (!da_arena_offset(&c->arena, in[t], len[t], &r->offset)) {
          void *tmp = da_arena_alloc(&c->arena, len[t]);
          if (!tmp) goto no_room;
          scratch[n_scratch++] = tmp;
          memcpy(tmp, in[t], len[t]);
          da_arena_offset(&c->arena, tmp, len[t], &r->offset);
        }
        *dst[t] = r;
      }
      void *outp[2] = {it->o, it->lse};
      size_t olen[2] = {qb, lb};
      for (int t = 0; t < 2; t++) {
        if (t == 1 && !want_lse) break;
        Detattn__V1__TensorRef *r = &refs[n_refs++];
        *r = (Detattn__V1__TensorRef)DETATTN__V1__TENSOR_REF__INIT;
        r->arena = arena;
        r->length = olen[t];
        void *tmp = NULL;
        if (!outp[t] || !da_arena_offset(&c->arena, outp[t], olen[t], &r->offset)) {
          tmp = da_arena_alloc(&c->arena, olen[t]);
          if (!tmp) goto no_room;
          scratch[n_scratch++] = tmp;
          da_arena_offset(&c->arena, tmp, olen[t], &r->offset);
        }
        if (t == 0) {
          seqs[i].o_ref = r;
          outs[i].o_ref = 1;
          outs[i].o_tmp = tmp;
        } else {
          seqs[i].lse_ref = r;
          outs[i].lse_ref = 1;
          outs[i].lse_tmp = tmp;
        }
      }
    } else {
      /* The pointers are only read while packing, before start_request returns. */
      seqs[i].q = (ProtobufCBinaryData){qb, (uint8_t *)(uintptr_t)it->q};
      seqs[i].k = (ProtobufCBinaryData){kb, (uint8_t *)(uintptr_t)it->k};
      seqs[i].v = (ProtobufCBinaryData){kb, (uint8_t *)(uintptr_t)it->v};
    }
    ptrs[i] = &seqs[i];
    continue;
  no_room:
    /* The arena is full: this call goes by copy (same bits). */
    for (size_t j = 0; j < n_scratch; j++) da_arena_free(&c->arena, scratch[j]);
    n_scratch = 0;
    n_refs = 0;
    arena = 0;
    i = (size_t)-1;
  }
  forward_fill(&rq, &f, layer, ptrs, n, want_lse);
  if (info.max_message_bytes) {
    size_t len = detattn__v1__request__get_packed_size(&rq);
    if (len > info.max_message_bytes) {
      st = da_err(DETATTN_RESOURCE_EXHAUSTED, "forward: request of %zu bytes exceeds the daemon's limit of %llu bytes",
                  len, (unsigned long long)info.max_message_bytes);
      goto done;
    }
  }
  if ((st = start_request(c, &rq, &k)) != DETATTN_OK) goto done;
  k->model = *m;
  k->want_lse = want_lse;
  k->n_out = n;
  k->out = outs;
  k->scratch = scratch;
  k->n_scratch = n_scratch;
  outs = NULL;
  scratch = NULL;
  n_scratch = 0;
  *out = k;
done:
  for (size_t j = 0; j < n_scratch; j++) da_arena_free(&c->arena, scratch[j]);
  free(scratch);
  free(refs);
  free(outs);
  free(ptrs);
  free(seqs);
  return st;
}

/* The CUDA plane's Forward: every tensor a (region, offset) of this process's device
 * memory, inputs ordered after stream's work by the call's "ready" event. */
DETATTN_API int detattn_forward_cuda_start(detattn_client *c, uint32_t layer, detattn_seq_io *items, size_t n,
                                           void *stream, detattn_call **out) {
  Request rq = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__Forward f = DETATTN__V1__FORWARD__INIT;
  Detattn__V1__ForwardSeq *seqs = NULL, **ptrs = NULL;
  Detattn__V1__TensorRef *refs = NULL;
  da_call_out *outs = NULL;
  da_cuda_use use = {0};
  da_cuda_ev *ev = NULL;
  uint32_t *ids = NULL;
  size_t n_ids = 0;
  detattn_server_info info;
  detattn_call *k;
  int st, want_lse = 0;

  if ((st = check_call(c, items, n, out, "forward_cuda", &want_lse)) != DETATTN_OK) return st;
  if ((st = get_info(c, &info)) != DETATTN_OK) return st;
  pthread_mutex_lock(&c->mu);
  int offered = c->cuda_plane;
  pthread_mutex_unlock(&c->mu);
  if (!offered)
    return da_err(DETATTN_FAILED_PRECONDITION,
                  "forward_cuda: the daemon at %s offers no cuda plane (it needs --backend cuda and an ipc:// "
                  "listener; this client's data plane is %s)",
                  c->url, detattn_data_plane_name(c->opts.data_plane));
  if ((st = da_cuda_load()) != DETATTN_OK) return st;
  const detattn_model *m = &info.model;
  uint64_t q_row = (uint64_t)m->n_q_heads * m->head_dim * 2, kv_row = (uint64_t)m->n_kv_heads * m->head_dim * 2;
  uint64_t lse_row = (uint64_t)m->n_q_heads * 4;

  seqs = calloc(n, sizeof *seqs);
  ptrs = calloc(n, sizeof *ptrs);
  outs = calloc(n, sizeof *outs);
  refs = calloc(5 * n, sizeof *refs);
  if (!seqs || !ptrs || !outs || !refs) {
    st = da_err(DETATTN_RESOURCE_EXHAUSTED, "forward_cuda: out of memory for %zu items", n);
    goto done;
  }
  pthread_mutex_lock(&c->plane_mu);
  da_cuda_begin(c, &use);
  size_t n_refs = 0;
  for (size_t i = 0; i < n && st == DETATTN_OK; i++) {
    const detattn_seq_io *it = &items[i];
    forward_seq_init(&seqs[i], it);
    outs[i] = (da_call_out){.n_tokens = it->n_tokens, .o = it->o, .lse = it->lse, .o_ref = 1, .lse_ref = want_lse};
    ptrs[i] = &seqs[i];
    if (it->n_tokens == 0) continue;
    const void *p[5] = {it->q, it->k, it->v, it->o, it->lse};
    const uint64_t len[5] = {it->n_tokens * q_row, it->n_tokens * kv_row, it->n_tokens * kv_row, it->n_tokens * q_row,
                             it->n_tokens * lse_row};
    static const char *const what[5] = {"q", "k", "v", "o", "lse"};
    Detattn__V1__TensorRef **dst[5] = {&seqs[i].q_ref, &seqs[i].k_ref, &seqs[i].v_ref, &seqs[i].o_ref,
                                       &seqs[i].lse_ref};
    for (int t = 0; t < 5 && st == DETATTN_OK; t++) {
      if (t == 4 && !want_lse) break;
      if (t == 4 && !p[4]) {
        st = da_err(DETATTN_INVALID_ARGUMENT, "forward_cuda: item %zu has no lse while others have one", i);
        break;
      }
      Detattn__V1__TensorRef *r = &refs[n_refs++];
      *r = (Detattn__V1__TensorRef)DETATTN__V1__TENSOR_REF__INIT;
      r->length = len[t];
      st = da_cuda_ref(c, p[t], (size_t)len[t], what[t], i, &use, &r->arena, &r->offset);
      *dst[t] = r;
    }
  }
  if (st == DETATTN_OK) st = da_cuda_events_take(c, stream, use.ctx, &ev);
  if (st == DETATTN_OK) st = da_cuda_use_ids(c, &use, &ids, &n_ids);
  if (st != DETATTN_OK) {
    da_cuda_use_release(c, &use);
    if (ev) {
      ev->next = c->cuda.free_evs;
      c->cuda.free_evs = ev;
    }
  }
  da_cuda_use_fini(&use);
  pthread_mutex_unlock(&c->plane_mu);
  if (st != DETATTN_OK) goto done;
  forward_fill(&rq, &f, layer, ptrs, n, want_lse);
  /* No signal_event: the daemon answers once the outputs are written, so work the caller
   * queues after the call is already ordered after them, and an interprocess event
   * recorded on the daemon's stream cost ~0.26 ms per batch (H100, 2026-11-24). */
  f.wait_event = ev->ready_id;
  if ((st = start_request(c, &rq, &k)) != DETATTN_OK) {
    detattn_call tmp = {.client = c, .cu_stream = stream, .cu_ev = ev, .cu_bufs = ids, .n_cu_bufs = n_ids};
    da_cuda_call_end(c, &tmp, DETATTN_FAILED_PRECONDITION);
    goto done;
  }
  k->model = *m;
  k->want_lse = want_lse;
  k->n_out = n;
  k->out = outs;
  k->cu_stream = stream;
  k->cu_ev = ev;
  k->cu_bufs = ids;
  k->n_cu_bufs = n_ids;
  outs = NULL;
  *out = k;
done:
  free(refs);
  free(outs);
  free(ptrs);
  free(seqs);
  return st;
}

DETATTN_API int detattn_forward_cuda(detattn_client *c, uint32_t layer, detattn_seq_io *items, size_t n,
                                     void *stream) {
  detattn_call *k;
  int st;

  if ((st = detattn_forward_cuda_start(c, layer, items, n, stream, &k)) != DETATTN_OK) return st;
  return detattn_call_wait(k);
}

/* Checks every output length of a Forward reply against the model before writing any. */
static int check_forward_reply(const detattn_call *k, const Detattn__V1__ForwardReply *fr) {
  const detattn_model *m = &k->model;
  uint64_t o_row = (uint64_t)m->n_q_heads * m->head_dim * 2, lse_row = (uint64_t)m->n_q_heads * 4;

  if (fr->n_seqs != k->n_out)
    return da_err(DETATTN_INTERNAL, "forward reply has %zu sequences, the request %zu", fr->n_seqs, k->n_out);
  for (size_t i = 0; i < k->n_out; i++) {
    const Detattn__V1__ForwardSeqOut *so = fr->seqs[i];
    uint64_t want_o = k->out[i].o_ref ? 0 : k->out[i].n_tokens * o_row;
    uint64_t want_lse = k->want_lse && !k->out[i].lse_ref ? k->out[i].n_tokens * lse_row : 0;
    if (so->o.len != want_o)
      return da_err(DETATTN_INTERNAL, "forward reply item %zu: o has %zu bytes, expected %llu", i, so->o.len,
                    (unsigned long long)want_o);
    if (so->lse.len != want_lse)
      return da_err(DETATTN_INTERNAL, "forward reply item %zu: lse has %zu bytes, expected %llu", i, so->lse.len,
                    (unsigned long long)want_lse);
  }
  return DETATTN_OK;
}

/* Writes a checked Forward reply's outputs to the call's buffers. */
static int deliver_forward(detattn_call *k, const Response *r) {
  int st = check_forward_reply(k, r->forward);
  if (st != DETATTN_OK) return st;
  for (size_t i = 0; i < k->n_out; i++) {
    const Detattn__V1__ForwardSeqOut *so = r->forward->seqs[i];
    const da_call_out *w = &k->out[i];
    size_t ob = (size_t)w->n_tokens * k->model.n_q_heads * k->model.head_dim * 2;
    size_t lb = (size_t)w->n_tokens * k->model.n_q_heads * 4;
    if (so->o.len) memcpy(w->o, so->o.data, so->o.len);
    else if (w->o_tmp && w->o) memcpy(w->o, w->o_tmp, ob);
    if (w->lse && so->lse.len) memcpy(w->lse, so->lse.data, so->lse.len);
    else if (w->lse && w->lse_tmp) memcpy(w->lse, w->lse_tmp, lb);
  }
  return DETATTN_OK;
}

int da_call_deliver(detattn_call *k, const void *buf, size_t len) {
  reply x;
  int st = decode_response(k, buf, len, &x.r, &x.b);
  if (st != DETATTN_OK) return st;
  st = deliver_forward(k, x.r);
  reply_free(&x);
  return st;
}

DETATTN_API int detattn_call_wait(detattn_call *k) {
  reply x;
  int st;

  if (!k) return da_err(DETATTN_INVALID_ARGUMENT, "call_wait: call is NULL");
  pthread_mutex_lock(&k->mu);
  const int orphaned = k->orphaned;
  pthread_mutex_unlock(&k->mu);
  if (orphaned)
    st = da_err(DETATTN_CANCELLED, "call cancelled: the client was closed before the call was waited for");
  else if ((st = finish_response(k, &x.r, &x.b)) == DETATTN_OK) {
    st = deliver_forward(k, x.r);
    reply_free(&x);
  }
  if (k->cu_ev || k->cu_bufs) da_cuda_call_end(k->client, k, st);
  da_call_free(k);
  return st;
}

DETATTN_API int detattn_forward(detattn_client *c, uint32_t layer, detattn_seq_io *items, size_t n) {
  detattn_call *k;
  int st;

  if ((st = detattn_forward_start(c, layer, items, n, &k)) != DETATTN_OK) return st;
  return detattn_call_wait(k);
}
