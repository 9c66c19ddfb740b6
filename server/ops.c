/*
 * ops.c — detattnd's op handlers and their dispatch table (see daemon.h for the ordering
 * rules and daemon_impl.h for the state they work on), and the replies.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon_impl.h"
#include "log.h"

/* Forward replies with at most this many sequences build their output table on the stack. */
#define FWD_OUTS_LOCAL 16

#ifndef DA_SERVER_VERSION
#define DA_SERVER_VERSION "0.0.0"
#endif

/* ---- requests and replies ---- */

void da_ops_request_free(da_daemon *d, request *r) {
  client *c = r->cl;
  if (c && r->quota_tokens) c->t->inflight_tokens -= r->quota_tokens;
  for (int i = 0; i < r->n_holds; i++) da_planes_release(d->planes, c ? c->id : 0, r->holds[i]);
  if (r->wait_ev) da_planes_release(d->planes, c ? c->id : 0, r->w.wait_event);
  if (r->signal_ev) da_planes_release(d->planes, c ? c->id : 0, r->w.signal_event);
  free(r->holds);
  da_wire_request_fini(&r->w);
  free(r->items);
  free(r->out);
  free(r);
  if (c) {
    c->n_reqs--;
    da_daemon_client_maybe_free(d, c);
  }
}

void da_ops_send_reply(da_daemon *d, client *c, const da_route *route, da_op op, uint64_t recv_ns,
                       const da_wire_response *resp) {
  d->requests++;
  d->via[route->ring ? DA_VIA_DOORBELL : DA_VIA_NNG]++;
  if (recv_ns) da_hist_record(&d->op_ns[op], da_now_ns() - recv_ns);
  if (c) {
    c->requests++;
    if (resp->code == 0) c->op_ok[op]++;
    else {
      c->errors++;
      c->op_errors[op]++;
    }
  }
  if ((unsigned)resp->code < DA_METRICS_CODES) d->op_codes[op][resp->code]++;
  if (resp->code == 0) d->op_ok[op]++;
  else {
    d->errors++;
    d->op_errors[op]++;
    da_log_debug("request %llu (%s): %s: %s", (unsigned long long)resp->id, da_op_name(op),
                 detattn_status_name(resp->code), resp->message ? resp->message : "");
  }
  if (route->ring) {
    if (d->doorbell) da_doorbell_reply(d->doorbell, route->ring, route->slot, resp);
  } else if (d->tr) {
    da_transport_reply(d->tr, route->ctx, resp);
  }
}

void da_ops_reply_error(da_daemon *d, request *r, int code, const char *msg) {
  da_wire_response resp = {.id = r->w.id, .code = code, .message = msg};
  da_ops_send_reply(d, r->cl, &r->route, r->w.op, r->recv_ns, &resp);
  da_ops_request_free(d, r);
}

static void reply_ok(da_daemon *d, request *r, da_wire_response *resp) {
  resp->id = r->w.id;
  resp->code = 0;
  resp->op = r->w.op;
  da_ops_send_reply(d, r->cl, &r->route, r->w.op, r->recv_ns, resp);
  da_ops_request_free(d, r);
}

/* ---- op handlers: return 1 when r was answered or admitted, 0 when it must wait ---- */

static int op_hello(da_daemon *d, request *r) {
  const da_backend_info *in = d->info;
  int pages = da_kvcache_pages_total(d->kv);
  da_wire_hello_reply h = {
      .server_version = DA_SERVER_VERSION,
      .protocol_version = DETATTN_PROTOCOL_VERSION,
      .model = d->model,
      .page_tokens = d->cfg->page_tokens,
      .backend = in->name,
      .arch = in->arch,
      .kernel_version = in->kernel_version,
      .num = d->num,
      .fingerprint = in->fingerprint,
      .max_message_bytes = (uint64_t)d->cfg->max_message_bytes,
      .max_tokens_per_request = (uint32_t)d->cfg->max_request_tokens,
      .kv_capacity_tokens = (uint64_t)pages * (uint64_t)d->cfg->page_tokens,
      .kv_pages = (uint32_t)pages,
      .max_sequences = (uint32_t)d->max_seqs,
      .data_planes = da_planes_names(d->planes),
      .arena_path = da_planes_arena_path(d->planes),
      .doorbell = d->doorbell != NULL,
  };
  da_log_debug("hello from client %u (%s), protocol %u", r->cl->id, r->w.client_name, r->w.protocol_version);
  da_wire_response resp = {.hello = &h};
  reply_ok(d, r, &resp);
  return 1;
}

/* Stats: O(1) in the daemon's history (histograms, no sorting). A caller allowed to
 * (stats_all) sees every client's counts; any other sees its own requests, sequences and
 * pages, the pool's capacity, and the batch statistics. */
static int op_stats(da_daemon *d, request *r) {
  da_wire_stats_reply s = {
      .uptime_ms = (da_now_ns() - d->start_ns) / 1000000u,
      .batches = d->batches,
      .inrow_rows = d->inrow_rows,
      .partial_rows = d->partial_rows,
      .kv_pages_total = (uint32_t)da_kvcache_pages_total(d->kv),
      .kv_pages_free = (uint32_t)da_kvcache_pages_free(d->kv),
  };
  const client *c = r->cl;
  if (c->stats_all) {
    s.requests = d->requests;
    s.errors = d->errors;
    s.forward_tokens = d->forward_tokens;
    s.sequences = (uint32_t)da_kvcache_seqs_open(d->kv);
    s.clients = (uint32_t)d->n_clients;
    s.kv_pages_used = s.kv_pages_total - s.kv_pages_free;
    memcpy(s.op_ok, d->op_ok, sizeof(s.op_ok));
    memcpy(s.op_errors, d->op_errors, sizeof(s.op_errors));
  } else {
    s.requests = c->requests;
    s.errors = c->errors;
    s.forward_tokens = c->forward_tokens;
    s.sequences = (uint32_t)c->n_seqs;
    s.clients = 1;
    for (const seq_slot *q = c->seqs; q; q = q->onext) {
      int n = 0;
      da_kvcache_pages(d->kv, (uint32_t)(q - d->seqs), &n);
      s.kv_pages_used += (uint32_t)n;
    }
    memcpy(s.op_ok, c->op_ok, sizeof(s.op_ok));
    memcpy(s.op_errors, c->op_errors, sizeof(s.op_errors));
  }
  int arenas = 0;
  da_planes_usage(d->planes, c->stats_all ? 0 : c->id, &arenas, &s.arena_bytes);
  s.arenas = (uint32_t)arenas;
  da_daemon_summary_get(&d->batch_tokens, 1.0, &s.batch_tokens);
  da_daemon_summary_get(&d->batch_requests, 1.0, &s.batch_requests);
  da_daemon_summary_get(&d->queue_ns, 1e-3, &s.queue_us);
  da_wire_response resp = {.stats = &s};
  reply_ok(d, r, &resp);
  return 1;
}

/* Answers r with a fresh wire id for KV cache handle h, just opened or forked. */
static int reply_new_seq(da_daemon *d, request *r, uint32_t h) {
  da_wire_response resp = {0};
  int rv = da_daemon_seq_new(d, r->cl, h, &resp.seq);
  if (rv != 0) {
    da_ops_reply_error(d, r, rv, "KV cache handle out of the sequence table's range");
    return 1;
  }
  reply_ok(d, r, &resp);
  return 1;
}

/* Quota: the sequences of r's client (all connections of its peer). 1 when refused. */
static int over_seq_quota(da_daemon *d, request *r) {
  if (r->cl->t->n_seqs < d->quota_seqs) return 0;
  char msg[200];
  snprintf(msg, sizeof msg, "this client holds %d sequences, its quota (--client-max-seqs %lld)", r->cl->t->n_seqs,
           (long long)d->quota_seqs);
  da_ops_reply_error(d, r, DETATTN_RESOURCE_EXHAUSTED, msg);
  return 1;
}

/* KV pages held by the sequences of every connection of tenant t (pages shared by forks
 * count once per sequence). */
static int64_t tenant_pages(da_daemon *d, const tenant *t) {
  int64_t n = 0;
  for (int b = 0; b < N_BUCKETS; b++)
    for (const client *c = d->buckets[b]; c; c = c->hnext)
      if (c->t == t)
        for (const seq_slot *q = c->seqs; q; q = q->onext) {
          int np = 0;
          da_kvcache_pages(d->kv, (uint32_t)(q - d->seqs), &np);
          n += np;
        }
  return n;
}

/* Quotas of a Forward: KV tokens its client would hold, tokens it would have in flight. */
static int over_forward_quota(da_daemon *d, request *r) {
  tenant *t = r->cl->t;
  char msg[240];
  const da_wire_request *w = &r->w;
  if (t->inflight_tokens + w->n_tokens > d->quota_inflight_tokens) {
    snprintf(msg, sizeof msg, "this client has %lld tokens in flight and this forward adds %d, over its quota "
             "(--client-max-inflight-tokens %lld)", (long long)t->inflight_tokens, w->n_tokens,
             (long long)d->quota_inflight_tokens);
    da_ops_reply_error(d, r, DETATTN_RESOURCE_EXHAUSTED, msg);
    return 1;
  }
  /* A quota of the whole cache is the pool's own check, with its own message. */
  if (d->quota_kv_tokens >= (int64_t)da_kvcache_pages_total(d->kv) * d->cfg->page_tokens) return 0;
  int64_t need = 0;
  for (int i = 0; i < w->n_seqs; i++) {
    seq_slot *slot = da_daemon_seq_find(d, r->cl, w->seqs[i].seq);
    if (slot == NULL) continue; /* answered NOT_FOUND by admission */
    int c = da_kvcache_append_cost(d->kv, (uint32_t)(slot - d->seqs), w->layer, w->seqs[i].pos, w->seqs[i].n_tokens);
    if (c > 0) need += c;
  }
  if (need == 0) return 0;
  int64_t held = tenant_pages(d, t) * d->cfg->page_tokens, add = need * d->cfg->page_tokens;
  if (held + add <= d->quota_kv_tokens) return 0;
  snprintf(msg, sizeof msg, "this client holds %lld KV tokens and this forward needs %lld more, over its quota "
           "(--client-max-kv-tokens %lld)", (long long)held, (long long)add, (long long)d->quota_kv_tokens);
  da_ops_reply_error(d, r, DETATTN_RESOURCE_EXHAUSTED, msg);
  return 1;
}

static int op_seq_open(da_daemon *d, request *r) {
  if (over_seq_quota(d, r)) return 1;
  uint32_t h;
  int rv = da_kvcache_open(d->kv, &h);
  if (rv != 0) {
    da_ops_reply_error(d, r, rv, da_kvcache_errmsg(d->kv));
    return 1;
  }
  return reply_new_seq(d, r, h);
}

static int not_found(da_daemon *d, request *r, uint64_t wire, const char *field) {
  char msg[160];
  snprintf(msg, sizeof(msg), "%s: sequence %llu is not open on this connection", field,
           (unsigned long long)wire);
  da_ops_reply_error(d, r, DETATTN_NOT_FOUND, msg);
  return 1;
}

static int op_seq_fork(da_daemon *d, request *r) {
  seq_slot *src = da_daemon_seq_find(d, r->cl, r->w.seq);
  if (src == NULL) return not_found(d, r, r->w.seq, "seq_fork.src");
  if (src->pending > 0) return 0;
  if (over_seq_quota(d, r)) return 1;
  uint32_t h;
  int rv = da_kvcache_fork(d->kv, (uint32_t)(src - d->seqs), &h);
  if (rv != 0) {
    da_ops_reply_error(d, r, rv, da_kvcache_errmsg(d->kv));
    return 1;
  }
  return reply_new_seq(d, r, h);
}

static int op_seq_truncate(da_daemon *d, request *r) {
  seq_slot *s = da_daemon_seq_find(d, r->cl, r->w.seq);
  if (s == NULL) return not_found(d, r, r->w.seq, "seq_truncate.seq");
  if (s->pending > 0) return 0;
  int rv = da_kvcache_truncate(d->kv, (uint32_t)(s - d->seqs), (int)r->w.length);
  if (rv != 0) {
    da_ops_reply_error(d, r, rv, da_kvcache_errmsg(d->kv));
    return 1;
  }
  da_wire_response resp = {0};
  reply_ok(d, r, &resp);
  return 1;
}

static int op_seq_close(da_daemon *d, request *r) {
  seq_slot *s = da_daemon_seq_find(d, r->cl, r->w.seq);
  if (s == NULL) return not_found(d, r, r->w.seq, "seq_close.seq");
  if (s->pending > 0) return 0;
  da_daemon_seq_release(d, s);
  da_wire_response resp = {0};
  reply_ok(d, r, &resp);
  return 1;
}

/* Resolves one tensor through the planes; a reference is held until r is freed. */
static int tensor(da_daemon *d, request *r, int i, const char *field, const da_wire_tensor *t, size_t align,
                  da_plane_ptr *out) {
  char msg[200], full[256];
  int rv = da_planes_tensor(d->planes, r->cl->id, t, align, out, msg, sizeof msg);
  if (rv != 0) {
    snprintf(full, sizeof full, "forward.seqs[%d].%s: %s", i, field, msg);
    da_ops_reply_error(d, r, rv, full);
    return rv;
  }
  if (t->arena) r->holds[r->n_holds++] = t->arena;
  return 0;
}

/* Tensor bytes of an admitted Forward, by the plane each tensor travels on (metrics). */
static void count_plane_bytes(da_daemon *d, const request *r, size_t qrow, size_t lrow) {
  const da_wire_request *w = &r->w;
  const uint32_t c = r->cl->id;
  for (int i = 0; i < w->n_seqs; i++) {
    const da_wire_fwd_seq *fs = &w->seqs[i];
    const da_wire_tensor *in[3] = {&fs->q, &fs->k, &fs->v};
    for (int j = 0; j < 3; j++) d->tensor_bytes[da_planes_plane(d->planes, c, in[j]->arena)][0] += in[j]->len;
    d->tensor_bytes[da_planes_plane(d->planes, c, fs->o.arena)][1] += (size_t)fs->n_tokens * qrow;
    if (w->want_lse) d->tensor_bytes[da_planes_plane(d->planes, c, fs->lse.arena)][1] += (size_t)fs->n_tokens * lrow;
  }
}

/* A Forward with a wait_event runs once the event has completed: until then it is held (0),
 * polled by the loop (da_daemon_event_wait), and answered DEADLINE_EXCEEDED after
 * --cuda-event-timeout-ms. The daemon's stream never waits on a client's work. 1 when r was
 * answered. */
static int wait_event(da_daemon *d, request *r, int *ready) {
  char msg[200], full[256];
  *ready = 0;
  if (r->wait_ev == NULL) {
    int rv = da_planes_event(d->planes, r->cl->id, r->w.wait_event, &r->wait_ev, msg, sizeof msg);
    if (rv != 0) {
      snprintf(full, sizeof full, "forward.wait_event: %s", msg);
      da_ops_reply_error(d, r, rv, full);
      return 1;
    }
  }
  const uint64_t t0 = da_now_ns();
  int q = da_backend_event_query(d->be, r->wait_ev);
  d->ev_queries++;
  d->ev_query_ns += da_now_ns() - t0;
  if (q < 0) {
    da_ops_reply_error(d, r, DETATTN_INVALID_ARGUMENT, "forward.wait_event: querying the event failed");
    return 1;
  }
  if (q == 0) {
    if (da_now_ns() - r->recv_ns > (uint64_t)d->cfg->cuda_event_timeout_ms * 1000000u) {
      snprintf(full, sizeof full, "forward.wait_event %u has not completed after %d ms (--cuda-event-timeout-ms)",
               r->w.wait_event, d->cfg->cuda_event_timeout_ms);
      da_ops_reply_error(d, r, DETATTN_DEADLINE_EXCEEDED, full);
      return 1;
    }
    da_daemon_event_wait(d, r->cl, r->recv_ns);
    return 0;
  }
  r->wait_done = 1;
  da_hist_record(&d->cuda_wait_ns, da_now_ns() - r->recv_ns);
  *ready = 1;
  return 0;
}

/* One group of tensors the backend reads or writes together (q, o, lse; or k, v) goes to it
 * either as device addresses (every one pinned or on the device) or as host addresses.
 * 1 when r was answered: a CUDA buffer mixed with tensors the device cannot reach. */
static int pick_addresses(da_daemon *d, request *r, int i, da_plane_ptr *t[], int n, int *dev) {
  int all_dev = 1, all_host = 1;
  for (int j = 0; j < n; j++) {
    if (t[j] == NULL) continue;
    all_dev &= t[j]->dev != NULL;
    all_host &= t[j]->host != NULL;
  }
  if (!all_dev && !all_host) {
    char msg[200];
    snprintf(msg, sizeof msg, "forward.seqs[%d]: %s mix CUDA buffers with memory the daemon's device cannot reach "
             "(give all of them as CUDA buffers)", i, n == 2 ? "k and v" : "q, o and lse");
    da_ops_reply_error(d, r, DETATTN_INVALID_ARGUMENT, msg);
    return 1;
  }
  *dev = all_dev && da_backend_has_device_memory(d->be);
  return 0;
}

static int op_forward(da_daemon *d, request *r) {
  const da_wire_request *w = &r->w;
  if (w->wait_event && !r->wait_done) {
    int ready;
    if (wait_event(d, r, &ready)) return 1;
    if (!ready) return 0;
  }
  if (w->signal_event && r->signal_ev == NULL) {
    char msg[200], full[256];
    int rv = da_planes_event(d->planes, r->cl->id, w->signal_event, &r->signal_ev, msg, sizeof msg);
    if (rv != 0) {
      snprintf(full, sizeof full, "forward.signal_event: %s", msg);
      da_ops_reply_error(d, r, rv, full);
      return 1;
    }
  }
  const size_t qrow = (size_t)d->model.n_q_heads * (size_t)d->model.head_dim * da_dtype_size(d->model.dtype);
  const size_t lrow = (size_t)d->model.n_q_heads * sizeof(float);
  /* Outputs not written by reference go to one buffer returned in the reply. */
  size_t out_bytes = 0;
  for (int i = 0; i < w->n_seqs; i++) {
    const da_wire_fwd_seq *fs = &w->seqs[i];
    if (!fs->o.arena) out_bytes += (size_t)fs->n_tokens * qrow;
    if (w->want_lse && !fs->lse.arena) out_bytes += (size_t)fs->n_tokens * lrow;
  }
  size_t n_seqs = w->n_seqs > 0 ? (size_t)w->n_seqs : 1;
  r->items = calloc(n_seqs, sizeof(*r->items));
  r->holds = malloc(n_seqs * 5 * sizeof(*r->holds));
  r->out = malloc(out_bytes ? out_bytes : 1);
  if (r->items == NULL || r->holds == NULL || r->out == NULL) {
    da_ops_reply_error(d, r, DETATTN_RESOURCE_EXHAUSTED, "out of memory for the forward's outputs");
    return 1;
  }
  char *next = r->out;
  for (int i = 0; i < w->n_seqs; i++) {
    const da_wire_fwd_seq *fs = &w->seqs[i];
    char field[48];
    seq_slot *slot = da_daemon_seq_find(d, r->cl, fs->seq);
    if (slot == NULL) {
      snprintf(field, sizeof(field), "forward.seqs[%d].seq", i);
      return not_found(d, r, fs->seq, field);
    }
    da_sched_item *it = &r->items[i];
    da_plane_ptr q, k, v, o, lse = {0};
    if (tensor(d, r, i, "q", &fs->q, 2, &q) || tensor(d, r, i, "k", &fs->k, 2, &k) ||
        tensor(d, r, i, "v", &fs->v, 2, &v) || tensor(d, r, i, "o_ref", &fs->o, 2, &o) ||
        (w->want_lse && tensor(d, r, i, "lse_ref", &fs->lse, 4, &lse)))
      return 1;
    /* Outputs the reply carries go to r->out (host memory). */
    if (fs->o.arena == 0) {
      o.host = next;
      next += (size_t)fs->n_tokens * qrow;
    }
    if (w->want_lse && fs->lse.arena == 0) {
      lse.host = next;
      next += (size_t)fs->n_tokens * lrow;
    }
    da_plane_ptr *qol[3] = {&q, &o, w->want_lse ? &lse : NULL}, *kv[2] = {&k, &v};
    if (pick_addresses(d, r, i, qol, 3, &it->dev_q) || pick_addresses(d, r, i, kv, 2, &it->dev_kv)) return 1;
    it->kv_seq = (uint32_t)(slot - d->seqs);
    it->wire_seq = fs->seq;
    it->layer = w->layer;
    it->pos = fs->pos;
    it->n = fs->n_tokens;
    it->q = it->dev_q ? q.dev : q.host;
    it->o = it->dev_q ? o.dev : o.host;
    it->lse = w->want_lse ? (float *)(it->dev_q ? lse.dev : lse.host) : NULL;
    it->k = it->dev_kv ? k.dev : k.host;
    it->v = it->dev_kv ? v.dev : v.host;
    it->signal = r->signal_ev;
    it->user = r;
  }
  if (over_forward_quota(d, r)) return 1;
  char err[256];
  int rv = da_sched_admit(d->sched, &r->cl->q, r->items, w->n_seqs, da_now_ns(), err, sizeof(err));
  if (rv != 0) {
    da_ops_reply_error(d, r, rv, err);
    return 1;
  }
  if (d->phases) { /* --phase-timing: decode Forwards only */
    int decode = 1;
    for (int i = 0; i < w->n_seqs; i++) decode &= w->seqs[i].n_tokens <= d->cfg->decode_tokens;
    r->admit_ns = decode ? da_now_ns() : 0;
  }
  r->quota_tokens = w->n_tokens;
  r->cl->t->inflight_tokens += w->n_tokens;
  for (int i = 0; i < w->n_seqs; i++) d->seqs[r->items[i].kv_seq].pending++;
  r->n_items = r->items_left = w->n_seqs;
  count_plane_bytes(d, r, qrow, lrow);
  return 1;
}

static int op_register_arena(da_daemon *d, request *r) {
  char err[240];
  da_wire_response resp = {0};
  const da_wire_request *w = &r->w;
  int rv;
  if (w->ring && d->doorbell == NULL) {
    snprintf(err, sizeof err, "this daemon offers no doorbell (it needs an ipc:// listener with the shared-memory "
             "plane, and --doorbell 1)");
    rv = DETATTN_FAILED_PRECONDITION;
  } else if (w->ring) {
    rv = da_doorbell_register(d->doorbell, r->cl->id, &r->cl->peer, w->arena_size, w->ring_slots,
                              w->ring_request_bytes, w->ring_reply_bytes, &resp.arena, &resp.token, err, sizeof err);
  } else {
    rv = da_planes_register(d->planes, r->cl->id, &r->cl->peer, w->arena_size, &resp.arena, &resp.token, err,
                            sizeof err);
  }
  if (rv != 0) {
    da_ops_reply_error(d, r, rv, err);
    return 1;
  }
  reply_ok(d, r, &resp);
  return 1;
}

static int op_register_cuda(da_daemon *d, request *r) {
  char err[300];
  da_wire_response resp = {0};
  int rv = da_planes_register_cuda(d->planes, r->cl->id, &r->cl->peer, r->w.cuda_event, r->w.cuda_handle,
                                   r->w.cuda_handle_len, r->w.arena_size, &resp.arena, err, sizeof err);
  if (rv != 0) {
    da_ops_reply_error(d, r, rv, err);
    return 1;
  }
  reply_ok(d, r, &resp);
  return 1;
}

static int op_unregister_arena(da_daemon *d, request *r) {
  char err[200];
  int rv = da_planes_unregister(d->planes, r->cl->id, r->w.arena, err, sizeof err);
  if (rv != 0) {
    da_ops_reply_error(d, r, rv, err);
    return 1;
  }
  da_wire_response resp = {0};
  reply_ok(d, r, &resp);
  return 1;
}

typedef struct op_entry {
  int (*fn)(da_daemon *d, request *r);
  int ordered; /* names sequences: runs in the client's arrival order */
} op_entry;

static const op_entry ops[DA_OP_COUNT] = {
    [DA_OP_HELLO] = {op_hello, 0},          [DA_OP_STATS] = {op_stats, 0},
    [DA_OP_SEQ_OPEN] = {op_seq_open, 0},    [DA_OP_SEQ_FORK] = {op_seq_fork, 1},
    [DA_OP_SEQ_TRUNCATE] = {op_seq_truncate, 1}, [DA_OP_SEQ_CLOSE] = {op_seq_close, 1},
    [DA_OP_FORWARD] = {op_forward, 1},
    [DA_OP_REGISTER_ARENA] = {op_register_arena, 0}, [DA_OP_UNREGISTER_ARENA] = {op_unregister_arena, 1},
    [DA_OP_REGISTER_CUDA] = {op_register_cuda, 0},
};

static void hold(da_daemon *d, client *c, request *r) {
  r->next = NULL;
  if (c->held_tail) c->held_tail->next = r;
  else c->held_head = r;
  c->held_tail = r;
  d->n_held++;
}

void da_ops_drain_held(da_daemon *d, client *c) {
  while (c->held_head) {
    request *r = c->held_head;
    c->held_head = r->next;
    if (c->held_head == NULL) c->held_tail = NULL;
    d->n_held--;
    if (!ops[r->w.op].fn(d, r)) {
      r->next = c->held_head;
      c->held_head = r;
      if (c->held_tail == NULL) c->held_tail = r;
      d->n_held++;
      return;
    }
  }
}

void da_ops_dispatch(da_daemon *d, request *r) {
  client *c = r->cl;
  const op_entry *op = &ops[r->w.op];
  if (op->fn == NULL) {
    da_ops_reply_error(d, r, DETATTN_UNIMPLEMENTED, "op not implemented");
    return;
  }
  if (op->ordered && c->held_head) hold(d, c, r);
  else if (!op->fn(d, r)) hold(d, c, r);
}

void da_ops_forward_done(da_daemon *d, request *r) {
  if (r->status != 0) {
    da_ops_reply_error(d, r, r->status, r->err);
    return;
  }
  const size_t qrow = (size_t)d->model.n_q_heads * (size_t)d->model.head_dim * da_dtype_size(d->model.dtype);
  /* Decode steps name a few sequences: their outputs' table lives on the stack. */
  da_wire_fwd_out local[FWD_OUTS_LOCAL];
  da_wire_fwd_out *outs = r->n_items <= FWD_OUTS_LOCAL ? local : calloc((size_t)r->n_items, sizeof(*outs));
  if (outs == NULL) {
    da_ops_reply_error(d, r, DETATTN_RESOURCE_EXHAUSTED, "out of memory for the reply");
    return;
  }
  for (int i = 0; i < r->n_items; i++) {
    da_sched_item *x = &r->items[i];
    const da_wire_fwd_seq *fs = &r->w.seqs[i];
    outs[i] = (da_wire_fwd_out){0};
    if (!fs->o.arena) {
      outs[i].o = x->o;
      outs[i].o_len = (size_t)x->n * qrow;
    }
    if (x->lse && !fs->lse.arena) {
      outs[i].lse = x->lse;
      outs[i].lse_len = (size_t)x->n * (size_t)d->model.n_q_heads * sizeof(float);
    }
  }
  d->forward_tokens += (uint64_t)r->w.n_tokens;
  r->cl->forward_tokens += (uint64_t)r->w.n_tokens;
  da_wire_response resp = {.n_outs = r->n_items, .outs = outs};
  /* --phase-timing: r's times are read before reply_ok frees it */
  uint64_t t[DA_PH_N] = {r->recv_ns, r->admit_ns, d->done_at[0], d->done_at[1], d->done_at[2], d->done_at[3], 0};
  reply_ok(d, r, &resp);
  if (d->phases && t[1] != 0) {
    t[DA_PH_N - 1] = da_now_ns();
    da_phases_add(d->phases, t);
  }
  if (outs != local) free(outs);
}
