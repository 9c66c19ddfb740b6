#include "wire.h"

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "detattn.pb-c.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the wire format is little-endian; this module assumes a little-endian host"
#endif

/* Forward replies with at most this many sequences are encoded from tables on the stack. */
#define OUTS_LOCAL 16

static const char *const op_names[DA_OP_COUNT] = {
    [DA_OP_INVALID] = "invalid", [DA_OP_HELLO] = "hello", [DA_OP_SEQ_OPEN] = "seq_open",
    [DA_OP_SEQ_FORK] = "seq_fork", [DA_OP_SEQ_TRUNCATE] = "seq_truncate",
    [DA_OP_SEQ_CLOSE] = "seq_close", [DA_OP_FORWARD] = "forward", [DA_OP_STATS] = "stats",
    [DA_OP_REGISTER_ARENA] = "register_arena", [DA_OP_UNREGISTER_ARENA] = "unregister_arena",
    [DA_OP_REGISTER_CUDA] = "register_cuda",
};

const char *da_op_name(da_op op) { return (unsigned)op < DA_OP_COUNT ? op_names[op] : "invalid"; }

/* protobuf-c allocator that refuses to go past a byte budget. A request's message is one
 * tree freed all at once, so its allocations are bumped out of chunks (the first inside the
 * holder) and free is a no-op: a Forward of 64 sequences made ~400 mallocs and as many frees
 * (NOTES.md v5.31). */
#define CHUNK0 4096
typedef struct chunk {
  struct chunk *next;
  size_t cap, used;
  unsigned char *data; /* 16-byte aligned */
} chunk;

typedef struct holder {
  ProtobufCAllocator a;
  size_t used, cap; /* bytes asked for, the budget */
  int over;
  Detattn__V1__Request *msg;
  chunk *cur; /* the chunk being bumped; older ones follow it */
  chunk first;
  _Alignas(16) unsigned char first_data[CHUNK0];
} holder;

static void *bounded_alloc(void *data, size_t n) {
  holder *h = data;
  if (n > h->cap - h->used) {
    h->over = 1;
    return NULL;
  }
  const size_t need = (n + 15) & ~(size_t)15;
  chunk *c = h->cur;
  if (need > c->cap - c->used) {
    const size_t cap = need > 2 * c->cap ? need : 2 * c->cap;
    _Static_assert(sizeof(chunk) % 16 == 0, "a chunk's data follows it, 16-byte aligned");
    chunk *nc = malloc(sizeof(*nc) + cap);
    if (nc == NULL) {
      h->over = 1;
      return NULL;
    }
    *nc = (chunk){.next = c, .cap = cap, .used = 0, .data = (unsigned char *)(nc + 1)};
    h->cur = c = nc;
  }
  void *p = c->data + c->used;
  c->used += need;
  h->used += n;
  return p;
}

static void bounded_free(void *data, void *p) {
  (void)data;
  (void)p; /* the chunks go at once in da_wire_request_fini */
}

static int fail(da_wire_request *r, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(da_wire_request *r, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->err, sizeof(r->err), fmt, ap);
  va_end(ap);
  r->status = code;
  return code;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* An input tensor: bytes, or a reference, exactly one, of exactly want bytes. */
static int get_input(da_wire_request *r, int i, const char *field, const ProtobufCBinaryData *b,
                     const Detattn__V1__TensorRef *ref, size_t want, da_wire_tensor *out) {
  if (ref && b->len)
    return fail(r, DETATTN_INVALID_ARGUMENT, "forward.seqs[%d]: %s given both as bytes and as %s_ref", i, field,
                field);
  if (ref && ref->arena == 0)
    return fail(r, DETATTN_INVALID_ARGUMENT, "forward.seqs[%d].%s_ref: arena 0 is not an arena", i, field);
  size_t got = ref ? (size_t)ref->length : b->len;
  if (ref && ref->length != (uint64_t)got) got = SIZE_MAX;
  if (got != want)
    return fail(r, DETATTN_INVALID_ARGUMENT,
                "forward.seqs[%d].%s%s: expected %zu bytes (n_tokens x heads x head_dim x 2), got %llu", i, field,
                ref ? "_ref.length" : "", want, ref ? (unsigned long long)ref->length : (unsigned long long)b->len);
  *out = (da_wire_tensor){.data = ref ? NULL : b->data, .len = want, .arena = ref ? ref->arena : 0,
                          .offset = ref ? ref->offset : 0};
  return 0;
}

/* An output reference, if given, of exactly want bytes. */
static int get_output(da_wire_request *r, int i, const char *field, const Detattn__V1__TensorRef *ref, size_t want,
                      da_wire_tensor *out) {
  *out = (da_wire_tensor){.len = want};
  if (ref == NULL) return 0;
  if (ref->arena == 0)
    return fail(r, DETATTN_INVALID_ARGUMENT, "forward.seqs[%d].%s: arena 0 is not an arena", i, field);
  if (ref->length != (uint64_t)want)
    return fail(r, DETATTN_INVALID_ARGUMENT, "forward.seqs[%d].%s.length: expected %zu bytes, got %llu", i, field,
                want, (unsigned long long)ref->length);
  out->arena = ref->arena;
  out->offset = ref->offset;
  return 0;
}

static int decode_forward(const da_wire_limits *lim, const Detattn__V1__Forward *f,
                          da_wire_request *r) {
  const da_model *m = &lim->model;
  r->layer = (int)(f->layer > INT_MAX ? INT_MAX : f->layer);
  r->want_lse = f->want_lse != 0;
  r->wait_event = f->wait_event;
  r->signal_event = f->signal_event;
  if (f->layer >= (uint32_t)m->n_layers)
    return fail(r, DETATTN_INVALID_ARGUMENT, "forward.layer %u out of range [0, %d)", f->layer,
                m->n_layers);
  if (f->n_seqs == 0) return fail(r, DETATTN_INVALID_ARGUMENT, "forward.seqs is empty");
  if (f->n_seqs > (size_t)lim->max_request_tokens)
    return fail(r, DETATTN_INVALID_ARGUMENT, "forward has %zu sequences, more than max tokens per request %d",
                f->n_seqs, lim->max_request_tokens);
  uint64_t total = 0;
  for (size_t i = 0; i < f->n_seqs; i++) {
    const Detattn__V1__ForwardSeq *s = f->seqs[i];
    if (s->n_tokens == 0)
      return fail(r, DETATTN_INVALID_ARGUMENT, "forward.seqs[%zu].n_tokens is 0", i);
    total += s->n_tokens;
    if (total > (uint64_t)lim->max_request_tokens)
      return fail(r, DETATTN_INVALID_ARGUMENT,
                  "forward carries more than %d tokens (max tokens per request)", lim->max_request_tokens);
    if ((uint64_t)s->pos + s->n_tokens > (uint64_t)INT_MAX)
      return fail(r, DETATTN_INVALID_ARGUMENT, "forward.seqs[%zu]: pos %u + n_tokens %u is past 2^31",
                  i, s->pos, s->n_tokens);
  }
  r->n_tokens = (int)total;
  uint64_t *ids = malloc(f->n_seqs * sizeof(*ids));
  r->seqs = calloc(f->n_seqs, sizeof(*r->seqs));
  if (ids == NULL || r->seqs == NULL) {
    free(ids);
    return fail(r, DETATTN_RESOURCE_EXHAUSTED, "out of memory decoding forward");
  }
  for (size_t i = 0; i < f->n_seqs; i++) ids[i] = f->seqs[i]->seq;
  qsort(ids, f->n_seqs, sizeof(*ids), cmp_u64);
  for (size_t i = 1; i < f->n_seqs; i++)
    if (ids[i] == ids[i - 1]) {
      uint64_t dup = ids[i];
      free(ids);
      return fail(r, DETATTN_INVALID_ARGUMENT, "forward names sequence %llu more than once",
                  (unsigned long long)dup);
    }
  free(ids);
  size_t es = da_dtype_size(m->dtype);
  for (size_t i = 0; i < f->n_seqs; i++) {
    const Detattn__V1__ForwardSeq *s = f->seqs[i];
    size_t qb = (size_t)s->n_tokens * (size_t)m->n_q_heads * (size_t)m->head_dim * es;
    size_t kb = (size_t)s->n_tokens * (size_t)m->n_kv_heads * (size_t)m->head_dim * es;
    size_t lb = (size_t)s->n_tokens * (size_t)m->n_q_heads * sizeof(float);
    da_wire_fwd_seq *o = &r->seqs[i];
    *o = (da_wire_fwd_seq){.seq = s->seq, .pos = (int)s->pos, .n_tokens = (int)s->n_tokens};
    int rv;
    if ((rv = get_input(r, (int)i, "q", &s->q, s->q_ref, qb, &o->q)) ||
        (rv = get_input(r, (int)i, "k", &s->k, s->k_ref, kb, &o->k)) ||
        (rv = get_input(r, (int)i, "v", &s->v, s->v_ref, kb, &o->v)) ||
        (rv = get_output(r, (int)i, "o_ref", s->o_ref, qb, &o->o)) ||
        (rv = get_output(r, (int)i, "lse_ref", s->lse_ref, lb, &o->lse)))
      return rv;
    if (s->lse_ref && !f->want_lse)
      return fail(r, DETATTN_INVALID_ARGUMENT, "forward.seqs[%zu].lse_ref given without want_lse", i);
  }
  r->n_seqs = (int)f->n_seqs;
  return 0;
}

/* The request id of a message too large to decode, when it comes first (as protobuf-c and
 * most encoders write it): field 1, varint. 0 otherwise. */
static uint64_t peek_id(const uint8_t *p, size_t len) {
  if (len < 2 || p[0] != 0x08) return 0;
  uint64_t v = 0;
  for (size_t i = 1; i < len && i < 11; i++) {
    v |= (uint64_t)(p[i] & 0x7f) << (7 * (i - 1));
    if (!(p[i] & 0x80)) return v;
  }
  return 0;
}

int da_wire_decode(const da_wire_limits *lim, const void *buf, size_t len, da_wire_request *r) {
  memset(r, 0, sizeof(*r));
  if (len > lim->max_message_bytes) {
    r->id = peek_id(buf, len);
    return fail(r, DETATTN_RESOURCE_EXHAUSTED, "request of %zu bytes exceeds max-message-bytes %zu", len,
                lim->max_message_bytes);
  }
  holder *h = malloc(sizeof(*h));
  if (h == NULL) return fail(r, DETATTN_RESOURCE_EXHAUSTED, "out of memory");
  h->a = (ProtobufCAllocator){.alloc = bounded_alloc, .free = bounded_free, .allocator_data = h};
  h->used = 0, h->over = 0, h->msg = NULL;
  h->first = (chunk){.next = NULL, .cap = CHUNK0, .used = 0, .data = h->first_data};
  h->cur = &h->first;
  h->cap = lim->decode_bytes;
  r->pb = h;
  h->msg = detattn__v1__request__unpack(&h->a, len, buf);
  if (h->msg == NULL) {
    if (h->over)
      return fail(r, DETATTN_RESOURCE_EXHAUSTED, "request needs more than %zu bytes to decode",
                  lim->decode_bytes);
    return fail(r, DETATTN_INVALID_ARGUMENT, "malformed request: not a detattn.v1.Request message");
  }
  const Detattn__V1__Request *m = h->msg;
  r->id = m->id;
  switch (m->op_case) {
  case DETATTN__V1__REQUEST__OP_HELLO:
    r->op = DA_OP_HELLO;
    r->protocol_version = m->hello->protocol_version;
    snprintf(r->client_name, sizeof(r->client_name), "%s", m->hello->client_name ? m->hello->client_name : "");
    return 0;
  case DETATTN__V1__REQUEST__OP_SEQ_OPEN: r->op = DA_OP_SEQ_OPEN; return 0;
  case DETATTN__V1__REQUEST__OP_SEQ_FORK:
    r->op = DA_OP_SEQ_FORK;
    r->seq = m->seq_fork->src;
    return 0;
  case DETATTN__V1__REQUEST__OP_SEQ_TRUNCATE:
    r->op = DA_OP_SEQ_TRUNCATE;
    r->seq = m->seq_truncate->seq;
    r->length = m->seq_truncate->length;
    if (r->length > (uint32_t)INT_MAX)
      return fail(r, DETATTN_INVALID_ARGUMENT, "seq_truncate.length %u is past 2^31", r->length);
    return 0;
  case DETATTN__V1__REQUEST__OP_SEQ_CLOSE:
    r->op = DA_OP_SEQ_CLOSE;
    r->seq = m->seq_close->seq;
    return 0;
  case DETATTN__V1__REQUEST__OP_FORWARD: r->op = DA_OP_FORWARD; return decode_forward(lim, m->forward, r);
  case DETATTN__V1__REQUEST__OP_STATS: r->op = DA_OP_STATS; return 0;
  case DETATTN__V1__REQUEST__OP_REGISTER_ARENA:
    r->op = DA_OP_REGISTER_ARENA;
    r->arena_size = m->register_arena->size;
    if (m->register_arena->doorbell) {
      const Detattn__V1__DoorbellRing *g = m->register_arena->doorbell;
      r->ring = 1;
      r->ring_slots = g->slots;
      r->ring_request_bytes = g->request_bytes;
      r->ring_reply_bytes = g->reply_bytes;
    }
    return 0;
  case DETATTN__V1__REQUEST__OP_UNREGISTER_ARENA:
    r->op = DA_OP_UNREGISTER_ARENA;
    r->arena = m->unregister_arena->arena;
    return 0;
  case DETATTN__V1__REQUEST__OP_REGISTER_CUDA:
    r->op = DA_OP_REGISTER_CUDA;
    r->cuda_handle = m->register_cuda->handle.data;
    r->cuda_handle_len = m->register_cuda->handle.len;
    r->arena_size = m->register_cuda->size;
    r->cuda_event = m->register_cuda->event != 0;
    if (r->cuda_handle_len == 0) return fail(r, DETATTN_INVALID_ARGUMENT, "register_cuda.handle is empty");
    return 0;
  default:
    return fail(r, DETATTN_INVALID_ARGUMENT, "request has no op set (or an op this server does not know)");
  }
}

void da_wire_request_fini(da_wire_request *r) {
  holder *h = r->pb;
  if (h) {
    for (chunk *c = h->cur, *next; c != &h->first; c = next) {
      next = c->next;
      free(c);
    }
    free(h);
  }
  free(r->seqs);
  memset(r, 0, sizeof(*r));
}

static void summary(Detattn__V1__Summary *out, const da_wire_summary *s) {
  out->count = s->count;
  out->mean = s->mean;
  out->p50 = s->p50;
  out->p99 = s->p99;
  out->max = s->max;
}

int da_wire_encode(const da_wire_response *r, void *(*alloc)(void *arg, size_t size), void *arg,
                   void **out_buf, size_t *out_len) {
  Detattn__V1__Response resp = DETATTN__V1__RESPONSE__INIT;
  Detattn__V1__Status st = DETATTN__V1__STATUS__INIT;
  Detattn__V1__HelloReply hr = DETATTN__V1__HELLO_REPLY__INIT;
  Detattn__V1__ModelConfig mc = DETATTN__V1__MODEL_CONFIG__INIT;
  Detattn__V1__Numerics nu = DETATTN__V1__NUMERICS__INIT;
  Detattn__V1__Limits li = DETATTN__V1__LIMITS__INIT;
  Detattn__V1__SeqOpenReply so = DETATTN__V1__SEQ_OPEN_REPLY__INIT;
  Detattn__V1__SeqForkReply sf = DETATTN__V1__SEQ_FORK_REPLY__INIT;
  Detattn__V1__SeqTruncateReply stt = DETATTN__V1__SEQ_TRUNCATE_REPLY__INIT;
  Detattn__V1__SeqCloseReply sc = DETATTN__V1__SEQ_CLOSE_REPLY__INIT;
  Detattn__V1__ForwardReply fr = DETATTN__V1__FORWARD_REPLY__INIT;
  Detattn__V1__StatsReply sr = DETATTN__V1__STATS_REPLY__INIT;
  Detattn__V1__RegisterArenaReply ra = DETATTN__V1__REGISTER_ARENA_REPLY__INIT;
  Detattn__V1__UnregisterArenaReply ua = DETATTN__V1__UNREGISTER_ARENA_REPLY__INIT;
  Detattn__V1__RegisterCudaReply rc = DETATTN__V1__REGISTER_CUDA_REPLY__INIT;
  Detattn__V1__Summary sum[3] = {DETATTN__V1__SUMMARY__INIT, DETATTN__V1__SUMMARY__INIT,
                                 DETATTN__V1__SUMMARY__INIT};
  Detattn__V1__OpCount opc[DA_OP_COUNT];
  Detattn__V1__OpCount *opp[DA_OP_COUNT];
  Detattn__V1__ForwardSeqOut *outs = NULL;
  Detattn__V1__ForwardSeqOut **outp = NULL;
  Detattn__V1__ForwardSeqOut outs_local[OUTS_LOCAL];
  Detattn__V1__ForwardSeqOut *outp_local[OUTS_LOCAL];
  int rv = 0;

  resp.id = r->id;
  st.code = (uint32_t)r->code;
  st.message = (char *)(r->message ? r->message : "");
  resp.status = &st;
  if (r->code == 0) {
    switch (r->op) {
    case DA_OP_HELLO: {
      const da_wire_hello_reply *h = r->hello;
      hr.server_version = (char *)h->server_version;
      hr.protocol_version = h->protocol_version;
      mc.n_layers = (uint32_t)h->model.n_layers;
      mc.n_q_heads = (uint32_t)h->model.n_q_heads;
      mc.n_kv_heads = (uint32_t)h->model.n_kv_heads;
      mc.head_dim = (uint32_t)h->model.head_dim;
      mc.dtype = h->model.dtype == DA_FP16 ? DETATTN__V1__DTYPE__DTYPE_FP16 : DETATTN__V1__DTYPE__DTYPE_BF16;
      mc.scale = h->model.scale;
      mc.softcap = h->model.softcap;
      mc.window = (uint32_t)h->model.window;
      mc.page_tokens = (uint32_t)h->page_tokens;
      nu.backend = (char *)h->backend;
      nu.kernel_version = h->kernel_version;
      nu.arch = (char *)h->arch;
      nu.split_tokens = (uint32_t)h->num.split_tokens;
      nu.tile_tokens = (uint32_t)h->num.tile_tokens;
      nu.fingerprint = h->fingerprint;
      li.max_message_bytes = h->max_message_bytes;
      li.max_tokens_per_request = h->max_tokens_per_request;
      li.kv_capacity_tokens = h->kv_capacity_tokens;
      li.kv_pages = h->kv_pages;
      li.max_sequences = h->max_sequences;
      hr.model = &mc;
      hr.numerics = &nu;
      hr.limits = &li;
      for (const char *const *p = h->data_planes; p && *p; p++) hr.n_data_planes++;
      hr.data_planes = (char **)h->data_planes;
      hr.arena_path = (char *)(h->arena_path ? h->arena_path : "");
      hr.doorbell = h->doorbell != 0;
      resp.result_case = DETATTN__V1__RESPONSE__RESULT_HELLO;
      resp.hello = &hr;
      break;
    }
    case DA_OP_SEQ_OPEN:
      so.seq = r->seq;
      resp.result_case = DETATTN__V1__RESPONSE__RESULT_SEQ_OPEN;
      resp.seq_open = &so;
      break;
    case DA_OP_SEQ_FORK:
      sf.seq = r->seq;
      resp.result_case = DETATTN__V1__RESPONSE__RESULT_SEQ_FORK;
      resp.seq_fork = &sf;
      break;
    case DA_OP_SEQ_TRUNCATE:
      resp.result_case = DETATTN__V1__RESPONSE__RESULT_SEQ_TRUNCATE;
      resp.seq_truncate = &stt;
      break;
    case DA_OP_SEQ_CLOSE:
      resp.result_case = DETATTN__V1__RESPONSE__RESULT_SEQ_CLOSE;
      resp.seq_close = &sc;
      break;
    case DA_OP_FORWARD:
      if (r->n_outs <= OUTS_LOCAL) {
        outs = outs_local;
        outp = outp_local;
      } else {
        outs = calloc((size_t)r->n_outs + 1, sizeof(*outs));
        outp = calloc((size_t)r->n_outs + 1, sizeof(*outp));
      }
      if (outs == NULL || outp == NULL) {
        rv = DETATTN_RESOURCE_EXHAUSTED;
        goto done;
      }
      for (int i = 0; i < r->n_outs; i++) {
        Detattn__V1__ForwardSeqOut init = DETATTN__V1__FORWARD_SEQ_OUT__INIT;
        outs[i] = init;
        if (r->outs[i].o) {
          outs[i].o.data = (uint8_t *)r->outs[i].o;
          outs[i].o.len = r->outs[i].o_len;
        }
        if (r->outs[i].lse) {
          outs[i].lse.data = (uint8_t *)r->outs[i].lse;
          outs[i].lse.len = r->outs[i].lse_len;
        }
        outp[i] = &outs[i];
      }
      fr.n_seqs = (size_t)r->n_outs;
      fr.seqs = outp;
      resp.result_case = DETATTN__V1__RESPONSE__RESULT_FORWARD;
      resp.forward = &fr;
      break;
    case DA_OP_STATS: {
      const da_wire_stats_reply *s = r->stats;
      sr.uptime_ms = s->uptime_ms;
      sr.requests = s->requests;
      sr.errors = s->errors;
      size_t n = 0;
      for (int op = 0; op < DA_OP_COUNT; op++) {
        Detattn__V1__OpCount init = DETATTN__V1__OP_COUNT__INIT;
        opc[n] = init;
        opc[n].op = (char *)da_op_name((da_op)op);
        opc[n].ok = s->op_ok[op];
        opc[n].errors = s->op_errors[op];
        opp[n] = &opc[n];
        n++;
      }
      sr.n_ops = n;
      sr.ops = opp;
      sr.forward_tokens = s->forward_tokens;
      sr.batches = s->batches;
      summary(&sum[0], &s->batch_tokens);
      summary(&sum[1], &s->batch_requests);
      summary(&sum[2], &s->queue_us);
      sr.batch_tokens = &sum[0];
      sr.batch_requests = &sum[1];
      sr.queue_us = &sum[2];
      sr.inrow_rows = s->inrow_rows;
      sr.partial_rows = s->partial_rows;
      sr.kv_pages_total = s->kv_pages_total;
      sr.kv_pages_used = s->kv_pages_used;
      sr.kv_pages_free = s->kv_pages_free;
      sr.sequences = s->sequences;
      sr.clients = s->clients;
      sr.arenas = s->arenas;
      sr.arena_bytes = s->arena_bytes;
      resp.result_case = DETATTN__V1__RESPONSE__RESULT_STATS;
      resp.stats = &sr;
      break;
    }
    case DA_OP_REGISTER_ARENA:
      ra.arena = r->arena;
      ra.token = r->token;
      resp.result_case = DETATTN__V1__RESPONSE__RESULT_REGISTER_ARENA;
      resp.register_arena = &ra;
      break;
    case DA_OP_UNREGISTER_ARENA:
      resp.result_case = DETATTN__V1__RESPONSE__RESULT_UNREGISTER_ARENA;
      resp.unregister_arena = &ua;
      break;
    case DA_OP_REGISTER_CUDA:
      rc.id = r->arena;
      resp.result_case = DETATTN__V1__RESPONSE__RESULT_REGISTER_CUDA;
      resp.register_cuda = &rc;
      break;
    default:
      break;
    }
  }
  size_t n = detattn__v1__response__get_packed_size(&resp);
  void *buf = alloc(arg, n);
  if (buf == NULL) {
    rv = DETATTN_RESOURCE_EXHAUSTED;
    goto done;
  }
  detattn__v1__response__pack(&resp, buf);
  *out_buf = buf;
  *out_len = n;
done:
  if (outs != outs_local) free(outs);
  if (outp != outp_local) free(outp);
  return rv;
}
