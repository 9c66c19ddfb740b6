/*
 * daemon.c — detattnd's loop (see daemon.h): state, loop callbacks, event intake, batch
 * formation and completion, stats, start and stop. The op handlers are in ops.c.
 */
#include "daemon.h"
#include "fault.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <systemd/sd-daemon.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "daemon_impl.h"
#include "doorbell_ring.h"
#include "log.h"

static void kick(da_daemon *d);
static void maybe_stop(da_daemon *d);
static void item_done(void *arg, da_sched_item *it);
static void item_cancelled(void *arg, da_sched_item *it);

/* ---- stats ---- */

void da_daemon_summary_get(const da_hist *h, double scale, da_wire_summary *out) {
  memset(out, 0, sizeof(*out));
  out->count = h->count;
  if (h->count == 0) return;
  out->mean = da_hist_mean(h) * scale;
  out->max = (double)h->max * scale;
  out->p50 = (double)da_hist_quantile(h, 0.5) * scale;
  out->p99 = (double)da_hist_quantile(h, 0.99) * scale;
}

#ifndef DA_SERVER_VERSION
#define DA_SERVER_VERSION "0.0.0"
#endif

/* The metrics snapshot (http.h): called on the loop thread when /metrics, /healthz or
 * /readyz is asked for. */
static void metrics_fill(void *arg, da_metrics_snapshot *s) {
  da_daemon *d = arg;
  const da_backend_info *in = d->info;
  uint64_t now = da_now_ns();
  struct timespec wall;
  clock_gettime(CLOCK_REALTIME, &wall);
  memset(s, 0, sizeof(*s));
  snprintf(s->version, sizeof s->version, "%s", DA_SERVER_VERSION);
  snprintf(s->backend, sizeof s->backend, "%s", in->name);
  snprintf(s->arch, sizeof s->arch, "%s", in->arch);
  s->kernel_version = in->kernel_version;
  s->fingerprint = in->fingerprint;
  s->device = d->cfg->device;
  s->split_tokens = d->num.split_tokens;
  s->page_tokens = d->cfg->page_tokens;
  s->start_time_s = (double)wall.tv_sec + (double)wall.tv_nsec * 1e-9 - (double)(now - d->start_ns) * 1e-9;
  s->backend_up = !d->fatal;
  s->draining = d->draining;
  memcpy(s->requests, d->op_codes, sizeof(s->requests));
  for (int op = 0; op < DA_OP_COUNT; op++) da_metrics_hist_fill(&s->op_seconds[op], &d->op_ns[op], DA_METRICS_TIME);
  da_metrics_hist_fill(&s->queue_seconds, &d->queue_ns, DA_METRICS_TIME);
  da_metrics_hist_fill(&s->batch_run_seconds, &d->batch_run_ns, DA_METRICS_TIME);
  da_metrics_hist_fill(&s->batch_submit_seconds, &d->batch_submit_ns, DA_METRICS_TIME);
  da_metrics_hist_fill(&s->cuda_event_wait_seconds, &d->cuda_wait_ns, DA_METRICS_TIME);
  da_metrics_hist_fill(&s->batch_tokens, &d->batch_tokens, DA_METRICS_SIZE);
  da_metrics_hist_fill(&s->batch_requests, &d->batch_requests, DA_METRICS_SIZE);
  s->batches = d->batches;
  s->forward_tokens = d->forward_tokens;
  s->inrow_rows = d->inrow_rows;
  s->partial_rows = d->partial_rows;
  s->kv_pages_total = da_kvcache_pages_total(d->kv);
  s->kv_pages_free = da_kvcache_pages_free(d->kv);
  s->sequences = da_kvcache_seqs_open(d->kv);
  s->clients = d->n_clients;
  if (d->planes) {
    int arenas = 0;
    da_planes_usage(d->planes, 0, &arenas, &s->arena_bytes);
    s->arenas = arenas;
  }
  if (d->tr) da_transport_counts_get(d->tr, &s->conn);
  memcpy(s->tensor_bytes, d->tensor_bytes, sizeof(s->tensor_bytes));
  s->requests_nng = d->via[DA_VIA_NNG];
  s->requests_doorbell = d->via[DA_VIA_DOORBELL];
  if (d->doorbell) {
    da_doorbell_counts dc;
    da_doorbell_counts_get(d->doorbell, &dc);
    s->doorbell_rings = dc.rings;
    s->doorbell_wakeups = dc.wakeups;
    s->late_yields[0] = dc.late;
  }
  s->worker_idle_sleeps = da_worker_idle_sleeps(d->worker);
  s->worker_wait_sleeps = da_worker_wait_sleeps(d->worker);
  s->cuda_event_queries = d->ev_queries;
  s->cuda_event_query_ns = d->ev_query_ns;
  s->late_yields[1] = da_worker_late_yields(d->worker);
  s->busy_ns = d->busy_ns + (d->n_running > 0 ? now - d->busy_since : 0);
  s->now_ns = now;
  s->start_ns = d->start_ns;
  s->mem_kv = in->kv_bytes;
  s->mem_acc = in->acc_bytes;
  s->mem_staging = in->staging_bytes;
  s->mem_total = in->mem_total;
  s->mem_free = in->mem_free;
}

/* ---- clients and sequences ---- */

static client *client_find(da_daemon *d, uint32_t id) {
  for (client *c = d->buckets[id % N_BUCKETS]; c; c = c->hnext)
    if (c->id == id) return c;
  return NULL;
}

static tenant *tenant_get(da_daemon *d, uint64_t principal) {
  tenant **pp = &d->tenants[principal % N_BUCKETS];
  for (tenant *t = *pp; t; t = t->next)
    if (t->principal == principal) return t;
  tenant *t = calloc(1, sizeof(*t));
  if (t == NULL) return NULL;
  t->principal = principal;
  t->next = *pp;
  *pp = t;
  return t;
}

static void tenant_put(da_daemon *d, tenant *t) {
  if (t == NULL || --t->n_conns > 0) return;
  tenant **pp = &d->tenants[t->principal % N_BUCKETS];
  while (*pp != t) pp = &(*pp)->next;
  *pp = t->next;
  free(t);
}

void da_daemon_client_maybe_free(da_daemon *d, client *c) {
  if (!c->dead || c->n_seqs > 0 || c->n_reqs > 0 || c->q.linked || c->q.head) return;
  if (c->ev_waiting) {
    client **pe = &d->ev_list;
    while (*pe != c) pe = &(*pe)->ev_next;
    *pe = c->ev_next;
  }
  client **pp = &d->buckets[c->id % N_BUCKETS];
  while (*pp != c) pp = &(*pp)->hnext;
  *pp = c->hnext;
  d->n_clients--;
  tenant_put(d, c->t);
  free(c);
}

seq_slot *da_daemon_seq_find(da_daemon *d, client *c, uint64_t wire) {
  uint32_t h = (uint32_t)(wire & 0xffffffffu);
  if (wire == 0 || h >= (uint32_t)d->max_seqs) return NULL;
  seq_slot *s = &d->seqs[h];
  if (s->wire != wire || s->owner != c || s->closing) return NULL;
  return s;
}

void da_daemon_seq_release(da_daemon *d, seq_slot *s) {
  uint32_t h = (uint32_t)(s - d->seqs);
  int rv = da_kvcache_close(d->kv, h);
  if (rv != 0) da_log_error("closing KV sequence %u: %s", h, da_kvcache_errmsg(d->kv));
  client *c = s->owner;
  c->t->n_seqs--;
  if (s->oprev) s->oprev->onext = s->onext;
  else c->seqs = s->onext;
  if (s->onext) s->onext->oprev = s->oprev;
  s->onext = s->oprev = NULL;
  s->wire = 0;
  s->owner = NULL;
  s->closing = 0;
  c->n_seqs--;
  da_daemon_client_maybe_free(d, c);
}

int da_daemon_seq_new(da_daemon *d, client *c, uint32_t h, uint64_t *wire) {
  if (h >= (uint32_t)d->max_seqs) {
    da_kvcache_close(d->kv, h);
    return DETATTN_INTERNAL;
  }
  seq_slot *s = &d->seqs[h];
  s->generation++;
  if (s->generation == 0) s->generation = 1;
  s->wire = ((uint64_t)s->generation << 32) | h;
  s->owner = c;
  s->pending = 0;
  s->closing = 0;
  s->oprev = NULL;
  s->onext = c->seqs;
  if (c->seqs) c->seqs->oprev = s;
  c->seqs = s;
  c->n_seqs++;
  c->t->n_seqs++;
  *wire = s->wire;
  return 0;
}

/* peer: as the CONNECT event read it, or NULL when a request came first (read it now). */
static client *client_add(da_daemon *d, uint32_t id, const da_peer *peer) {
  client *c = calloc(1, sizeof(*c));
  if (c == NULL) {
    da_log_error("out of memory for client %u", id);
    return NULL;
  }
  c->id = id;
  if (peer) c->peer = *peer;
  else if (da_transport_peer(d->tr, id, &c->peer) != 0) {
    c->peer.principal = id;
    snprintf(c->peer.name, sizeof(c->peer.name), "pipe %u", id);
  }
  c->last_ns = da_now_ns();
  if ((c->t = tenant_get(d, c->peer.principal)) == NULL) {
    da_log_error("out of memory for client %u", id);
    free(c);
    return NULL;
  }
  c->t->n_conns++;
  if (c->peer.has_creds) {
    uint32_t u = c->peer.uid;
    c->stats_all = u == 0 || u == d->self_uid;
    for (int i = 0; i < d->n_stats_uids && !c->stats_all; i++) c->stats_all = u == d->stats_uids[i];
  }
  da_sched_queue_init(&c->q);
  c->q.tenant = c->peer.principal; /* fairness per client process (ipc) or address (tcp) */
  c->hnext = d->buckets[id % N_BUCKETS];
  d->buckets[id % N_BUCKETS] = c;
  d->n_clients++;
  da_log_debug("client %u connected from %s (%d clients)", id, c->peer.name, d->n_clients);
  return c;
}

static int is_gone(const da_daemon *d, uint32_t id) {
  uint64_t n = d->n_gone < N_GONE ? d->n_gone : N_GONE;
  for (uint64_t i = 0; i < n; i++)
    if (d->gone[i] == id) return 1;
  return 0;
}

/* ---- event intake ---- */

/* A decoded request of connection id, answered by route. nng reports a connection's arrival
 * and departure on other threads than its requests, so a request may be seen before its
 * connection's CONNECT event (the client is created then; create says so) or after its
 * DISCONNECT (it is answered UNAVAILABLE: nobody will read it). Moves w out. */
static void intake(da_daemon *d, uint32_t id, int create, const da_route *route, uint64_t recv_ns,
                   da_wire_request *w) {
  client *c = client_find(d, id);
  if (c == NULL && create && !is_gone(d, id)) c = client_add(d, id, NULL);
  if (c) c->last_ns = recv_ns;
  if (w->status != 0) {
    da_wire_response resp = {.id = w->id, .code = w->status, .message = w->err};
    da_ops_send_reply(d, c, route, w->op, recv_ns, &resp);
    return;
  }
  const char *why = c == NULL || c->dead ? "connection closed"
                    : d->fatal           ? "device failed; the daemon is exiting"
                    : d->draining        ? "draining"
                                         : NULL;
  if (why) {
    da_wire_response resp = {.id = w->id, .code = DETATTN_UNAVAILABLE, .message = why};
    da_ops_send_reply(d, c, route, w->op, recv_ns, &resp);
    return;
  }
  if (c->n_reqs >= d->cfg->max_inflight_per_conn) {
    char msg[160];
    snprintf(msg, sizeof msg, "%d requests of this connection are in the daemon (--max-inflight-per-conn %d)",
             c->n_reqs, d->cfg->max_inflight_per_conn);
    da_wire_response resp = {.id = w->id, .code = DETATTN_RESOURCE_EXHAUSTED, .message = msg};
    da_ops_send_reply(d, c, route, w->op, recv_ns, &resp);
    return;
  }
  request *r = calloc(1, sizeof(*r));
  if (r == NULL) {
    da_wire_response resp = {.id = w->id, .code = DETATTN_RESOURCE_EXHAUSTED, .message = "out of memory"};
    da_ops_send_reply(d, c, route, w->op, recv_ns, &resp);
    return;
  }
  r->route = *route;
  r->cl = c;
  r->recv_ns = recv_ns;
  r->w = *w;
  memset(w, 0, sizeof(*w));
  c->n_reqs++;
  da_ops_dispatch(d, r);
}

static void on_request(da_daemon *d, da_event *ev) {
  da_route route = {.ctx = ev->ctx};
  intake(d, ev->client, 1, &route, ev->recv_ns, &ev->req);
}

/* A request taken from a doorbell ring (doorbell.h). The ring was registered through the
 * connection, so its client exists unless the connection is gone. */
static void on_ring_request(void *arg, uint32_t client, da_ring *ring, uint32_t slot, uint64_t recv_ns,
                            size_t bytes, da_wire_request *w) {
  (void)bytes;
  da_route route = {.ring = ring, .slot = slot};
  intake(arg, client, 0, &route, recv_ns, w);
}

static void on_ring_scanned(void *arg) { kick(arg); }

static int on_side_handover(void *arg, uint32_t magic, uint32_t id, uint64_t token, int32_t pid, uint32_t uid,
                            int *fds, int n_fds, char *why, size_t whylen) {
  da_daemon *d = arg;
  if (magic != DA_RING_MAGIC || d->doorbell == NULL) {
    for (int i = 0; i < n_fds; i++) close(fds[i]);
    snprintf(why, whylen, "unknown hand-over (magic %08x)", magic);
    return DETATTN_INVALID_ARGUMENT;
  }
  return da_doorbell_handover(d->doorbell, id, token, pid, uid, fds, n_fds, why, whylen);
}

static void on_connect(da_daemon *d, uint32_t id, const da_peer *peer) {
  if (client_find(d, id) || is_gone(d, id)) return;
  client_add(d, id, peer);
}

static void on_disconnect(da_daemon *d, uint32_t id) {
  if (!is_gone(d, id)) d->gone[d->n_gone++ % N_GONE] = id;
  client *c = client_find(d, id);
  if (c == NULL || c->dead) return;
  c->dead = 1;
  c->n_reqs++; /* keep c alive while we tear it down */
  while (c->held_head) {
    request *r = c->held_head;
    c->held_head = r->next;
    d->n_held--;
    da_ops_reply_error(d, r, DETATTN_UNAVAILABLE, "connection closed");
  }
  c->held_tail = NULL;
  int closed = 0, deferred = 0;
  for (seq_slot *s = c->seqs, *next; s; s = next) {
    next = s->onext;
    if (s->pending == 0) {
      da_daemon_seq_release(d, s);
      closed++;
    } else if (!s->closing) {
      s->closing = 1;
      deferred++;
    }
  }
  int cancelled = da_sched_cancel(d->sched, &c->q, item_cancelled, d);
  da_planes_client_gone(d->planes, c->id);
  if (d->doorbell) da_doorbell_client_gone(d->doorbell, c->id);
  da_log_debug("client %u disconnected: %d sequences closed, %d closing after their work, %d queued "
               "items cancelled", id, closed, deferred, cancelled);
  c->n_reqs--;
  da_daemon_client_maybe_free(d, c);
  maybe_stop(d);
}

static void item_cancelled(void *arg, da_sched_item *it) {
  request *r = it->user;
  if (r->status == 0) {
    r->status = DETATTN_UNAVAILABLE;
    snprintf(r->err, sizeof(r->err), "connection closed");
  }
  item_done(arg, it);
}

static void on_events(uv_async_t *h) {
  da_daemon *d = h->data;
  if (d->tr == NULL) return;
  for (int i = 0; i < EVENTS_PER_TICK; i++) {
    da_event *ev = da_transport_poll(d->tr);
    if (ev == NULL) break;
    switch (ev->kind) {
    case DA_EV_REQUEST: on_request(d, ev); break;
    case DA_EV_CONNECT: on_connect(d, ev->client, &ev->peer); break;
    case DA_EV_DISCONNECT: on_disconnect(d, ev->client); break;
    }
    da_transport_event_free(ev);
    if (i == EVENTS_PER_TICK - 1) uv_async_send(&d->ev_async);
  }
  kick(d);
}

/* ---- CUDA events (cuda plane) ---- */

#define EV_SPIN_NS 2000000ull /* poll at every loop turn for this long, then every ms */

static void ev_poll(da_daemon *d);
static void on_ev_timer(uv_timer_t *t) { ev_poll(t->data); }

/* Runs the held requests of the clients whose first one waits for an event: each either
 * goes on, or calls da_daemon_event_wait again. */
static void ev_poll(da_daemon *d) {
  int n = 0;
  for (client *c = d->ev_list; c; c = c->ev_next) n++;
  client **cs = malloc((size_t)(n > 0 ? n : 1) * sizeof(*cs));
  if (cs == NULL) { /* out of memory: try again in a millisecond */
    uv_idle_stop(&d->ev_idle);
    uv_timer_start(&d->ev_timer, on_ev_timer, 1, 0);
    return;
  }
  n = 0;
  for (client *c = d->ev_list; c; c = c->ev_next) cs[n++] = c;
  d->ev_list = NULL;
  uv_idle_stop(&d->ev_idle);
  uv_timer_stop(&d->ev_timer);
  for (int i = 0; i < n; i++) cs[i]->ev_waiting = 0, cs[i]->n_reqs++; /* none is freed meanwhile */
  for (int i = 0; i < n; i++)
    if (!cs[i]->dead) da_ops_drain_held(d, cs[i]);
  for (int i = 0; i < n; i++) {
    cs[i]->n_reqs--;
    da_daemon_client_maybe_free(d, cs[i]);
  }
  free(cs);
  kick(d);
}

static void on_ev_idle(uv_idle_t *h) { ev_poll(h->data); }

void da_daemon_event_wait(da_daemon *d, client *c, uint64_t since_ns) {
  if (!c->ev_waiting) {
    c->ev_waiting = 1;
    c->ev_next = d->ev_list;
    d->ev_list = c;
  }
  if (da_now_ns() - since_ns < EV_SPIN_NS) {
    if (!uv_is_active((uv_handle_t *)&d->ev_idle)) uv_idle_start(&d->ev_idle, on_ev_idle);
  } else if (!uv_is_active((uv_handle_t *)&d->ev_timer) && !uv_is_active((uv_handle_t *)&d->ev_idle)) {
    uv_timer_start(&d->ev_timer, on_ev_timer, 1, 0);
  }
}

/* ---- batches ---- */

static void mark_drain(da_daemon *d, client *c) {
  if (c->drain_marked || c->held_head == NULL) return;
  c->drain_marked = 1;
  c->drain_next = d->drain_list;
  d->drain_list = c;
}

static void item_done(void *arg, da_sched_item *it) {
  da_daemon *d = arg;
  request *r = it->user;
  seq_slot *s = &d->seqs[it->kv_seq];
  if (--s->pending == 0) {
    if (s->closing) da_daemon_seq_release(d, s);
    else mark_drain(d, s->owner);
  }
  if (--r->items_left > 0) return;
  da_ops_forward_done(d, r);
}

static void submit(da_daemon *d, da_sched_batch *b) {
  uint64_t now = da_now_ns();
  uint64_t stamp = ++d->batch_counter;
  int n_reqs = 0;
  for (int i = 0; i < b->n_entries; i++) {
    da_sched_entry *e = &b->entries[i];
    request *r = e->item->user;
    if (r->batch_stamp != stamp) {
      r->batch_stamp = stamp;
      n_reqs++;
    }
    if (e->appends) da_hist_record(&d->queue_ns, now - r->recv_ns);
  }
  da_hist_record(&d->batch_tokens, (uint64_t)b->tokens);
  da_hist_record(&d->batch_requests, (uint64_t)n_reqs);
  d->batches++;
  d->buf_busy[b - d->bufs] = 1;
  if (d->phases) d->hand_ns[b - d->bufs] = now;
  if (d->n_running == 0) d->busy_since = now;
  d->n_running++;
  da_log_debug("batch %llu: %d tokens, %d requests; %d in the worker", (unsigned long long)d->batches,
               (int)b->tokens, n_reqs, d->n_running);
  da_worker_submit(d->worker, &b->b, b);
}

static da_sched_batch *free_buf(da_daemon *d) {
  for (int i = 0; i < DA_WORKER_MAX; i++)
    if (!d->buf_busy[i]) return &d->bufs[i];
  return NULL;
}

static void on_wait_timer(uv_timer_t *t) { kick(t->data); }

/* A batch that cannot be formed (out of memory) leaves its requests queued, whole: the loop
 * tries again in FORM_RETRY_MS, logging once per run of failures. */
#define FORM_RETRY_MS 10

static int form(da_daemon *d, da_sched_batch *b) {
  int rv = da_sched_form(d->sched, b, da_now_ns());
  if (rv != 0) {
    if (!d->form_failing) da_log_error("forming a batch: %s; retrying every %d ms", detattn_status_name(rv), FORM_RETRY_MS);
    d->form_failing = 1;
    if (!uv_is_active((uv_handle_t *)&d->wait_timer)) uv_timer_start(&d->wait_timer, on_wait_timer, FORM_RETRY_MS, 0);
    return 0;
  }
  if (d->form_failing) da_log_info("forming batches again");
  d->form_failing = 0;
  return b->n_entries > 0 || b->b.n_copies > 0;
}

/* Keeps the worker busy: when it is idle, form a batch as soon as the wait window allows;
 * while one batch runs, form the next one from whatever work is waiting and hand it over
 * at once, so that its staging overlaps the running batch's kernels (worker.h) and the
 * worker starts it without a round trip through the loop. (Waiting for a full batch
 * instead measured 12-14 % fewer Forward/s on light decode traffic.) */
static void kick(da_daemon *d) {
  if (d->worker == NULL) return;
  if (d->n_running == 0) {
    if (da_sched_pending_tokens(d->sched) > 0) {
      uint64_t wait_ns = (uint64_t)d->cfg->wait_us * 1000u;
      uint64_t oldest = wait_ns > 0 ? da_sched_oldest_ns(d->sched) : 0, now = wait_ns > 0 ? da_now_ns() : 0;
      if (wait_ns > 0 && da_sched_pending_tokens(d->sched) < d->cfg->max_batch_tokens && !d->draining &&
          now < oldest + wait_ns) {
        uint64_t left_ms = (oldest + wait_ns - now + 999999u) / 1000000u;
        if (!uv_is_active((uv_handle_t *)&d->wait_timer))
          uv_timer_start(&d->wait_timer, on_wait_timer, left_ms, 0);
        return;
      }
      da_sched_batch *b = free_buf(d);
      if (b && form(d, b)) submit(d, b);
    }
  }
  /* Forming ahead pays off when its staging overlaps the running batch (device backends),
   * or for decode work; otherwise prefill waits, so that decode arriving meanwhile is not
   * queued behind two prefill batches. */
  if (d->n_running == 1 && da_sched_pending_tokens(d->sched) > 0 &&
      (da_backend_overlaps(d->be) || da_sched_pending_decode(d->sched) > 0)) {
    da_sched_batch *b = free_buf(d);
    if (b && form(d, b)) submit(d, b);
  }
}

static void fail_batch(da_daemon *d, da_sched_batch *b, int code, const char *why) {
  for (int i = 0; i < b->n_entries; i++) {
    request *r = b->entries[i].item->user;
    if (r->status == 0) {
      r->status = code;
      snprintf(r->err, sizeof(r->err), "backend failed: %.200s", why);
    }
  }
}

/* One finished batch back from the worker: count it or fail its requests, and answer the
 * requests it completes. */
static void batch_done(da_daemon *d, da_sched_batch *b, int status, const da_batch_result *res) {
  d->buf_busy[b - d->bufs] = 0;
  if (--d->n_running == 0) d->busy_ns += da_now_ns() - d->busy_since;
  if (status == 0) {
    d->inrow_rows += (uint64_t)res->inrow_rows;
    d->partial_rows += (uint64_t)res->partial_rows;
  } else if (status == DETATTN_UNAVAILABLE) {
    if (!d->fatal) da_log_error("backend device failed for good: %s; finishing and exiting", res->err);
    d->fatal = 1;
    d->draining = 1;
    d->exit_code = DA_EXIT_DEVICE;
    fail_batch(d, b, DETATTN_UNAVAILABLE, res->err);
  } else {
    da_log_error("backend run failed (%s): %s", detattn_status_name(status), res->err);
    fail_batch(d, b, DETATTN_INTERNAL, res->err);
  }
  da_sched_complete(d->sched, b, item_done, d);
}

static void on_batch_done(uv_async_t *h) {
  da_daemon *d = h->data;
  void *tag;
  int status, n = 0;
  da_batch_result res;
  da_worker_times t;
  while (da_worker_take(d->worker, &tag, &status, &res, &t)) {
    da_hist_record(&d->batch_run_ns, t.run_ns);
    da_hist_record(&d->batch_submit_ns, t.submit_ns);
    if (d->phases) { /* the Forwards this batch completes take its times (ops.c) */
      const da_sched_batch *b = tag;
      d->done_at[0] = d->hand_ns[b - d->bufs];
      d->done_at[1] = t.t0_ns;
      d->done_at[2] = t.t0_ns + t.run_ns;
      d->done_at[3] = da_now_ns();
    }
    batch_done(d, tag, status, &res);
    n++;
  }
  if (n == 0) return;
  while (d->drain_list) {
    client *c = d->drain_list;
    d->drain_list = c->drain_next;
    c->drain_marked = 0;
    c->n_reqs++;
    da_ops_drain_held(d, c);
    c->n_reqs--;
    da_daemon_client_maybe_free(d, c);
  }
  kick(d);
  maybe_stop(d);
}

static void on_worker_done(void *arg) {
  da_daemon *d = arg;
  uv_async_send(&d->done_async);
}

/* ---- the shutdown watchdog ----
 *
 * Once SIGTERM arrives the daemon must be gone within drain-timeout-ms + CLOSE_GRACE_MS,
 * whatever nng does: nng_close has been seen never to return under load (libnng 1.5.2's
 * reaper can hang for good on a pipe closed in the middle of a read: nng_fd.c). A thread waits for
 * the deadline and, if the process is still there, removes the ipc socket, releases the
 * lock (so a new daemon can take the path at once) and _exit()s. */

static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  pthread_t thr;
  int started, done;
  uint64_t deadline_ns;
  int code; /* exit status if the deadline passes */
  int lock_fd;
  char sock_path[600];
} wd = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .lock_fd = -1};

static void exit_now(int code, const char *why) {
  da_log_error("%s; exiting now (status %d)", why, code);
  if (wd.sock_path[0]) unlink(wd.sock_path);
  if (wd.lock_fd >= 0) close(wd.lock_fd);
  _exit(code);
}

static void *watchdog_main(void *arg) {
  (void)arg;
  pthread_mutex_lock(&wd.mu);
  while (!wd.done) {
    uint64_t now = da_now_ns();
    if (now >= wd.deadline_ns) break;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t left = wd.deadline_ns - now;
    ts.tv_sec += (time_t)(left / 1000000000u);
    ts.tv_nsec += (long)(left % 1000000000u);
    if (ts.tv_nsec >= 1000000000L) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&wd.cv, &wd.mu, &ts);
  }
  int done = wd.done, code = wd.code;
  pthread_mutex_unlock(&wd.mu);
  if (!done) exit_now(code, "shutdown did not finish before its deadline");
  return NULL;
}

/* Arms (or brings forward) the deadline; code is the exit status if it passes. */
static void watchdog_arm(da_daemon *d, uint64_t deadline_ns, int code) {
  pthread_mutex_lock(&wd.mu);
  if (!wd.started || deadline_ns < wd.deadline_ns) wd.deadline_ns = deadline_ns;
  wd.code = code;
  if (!wd.started) {
    wd.lock_fd = da_transport_lock_fd(d->tr);
    if (strncmp(d->cfg->listen, "ipc://", 6) == 0) snprintf(wd.sock_path, sizeof wd.sock_path, "%s", d->cfg->listen + 6);
    wd.started = pthread_create(&wd.thr, NULL, watchdog_main, NULL) == 0;
    if (!wd.started) da_log_error("cannot start the shutdown watchdog thread");
  }
  pthread_cond_broadcast(&wd.cv);
  pthread_mutex_unlock(&wd.mu);
}

static void watchdog_stop(void) {
  pthread_mutex_lock(&wd.mu);
  wd.done = 1;
  int started = wd.started;
  pthread_cond_broadcast(&wd.cv);
  pthread_mutex_unlock(&wd.mu);
  if (started) pthread_join(wd.thr, NULL);
}

/* ---- start, drain, stop ---- */

static void on_close(uv_handle_t *h) {
  da_daemon *d = h->data;
  d->n_handles--;
}

static void close_handles(da_daemon *d) {
  uv_handle_t *hs[] = {(uv_handle_t *)&d->ev_async,   (uv_handle_t *)&d->done_async,
                       (uv_handle_t *)&d->sigterm,    (uv_handle_t *)&d->sigint,
                       (uv_handle_t *)&d->wait_timer, (uv_handle_t *)&d->linger_timer,
                       (uv_handle_t *)&d->drain_timer, (uv_handle_t *)&d->idle_timer,
                       (uv_handle_t *)&d->watchdog_timer, (uv_handle_t *)&d->listen_timer,
                       (uv_handle_t *)&d->ev_timer, (uv_handle_t *)&d->ev_idle};
  for (size_t i = 0; i < sizeof(hs) / sizeof(hs[0]); i++)
    if (!uv_is_closing(hs[i])) uv_close(hs[i], on_close);
}

/* Connections that own nothing and sent nothing for idle-timeout-ms are closed: idle
 * connections must not hold the daemon's file descriptors and connection slots. */
static void on_idle_timer(uv_timer_t *t) {
  da_daemon *d = t->data;
  if (d->tr == NULL) return;
  uint64_t now = da_now_ns(), idle = (uint64_t)d->cfg->idle_timeout_ms * 1000000u;
  for (int b = 0; b < N_BUCKETS; b++)
    for (client *c = d->buckets[b]; c; c = c->hnext)
      if (!c->dead && c->n_seqs == 0 && c->n_reqs == 0 && now - c->last_ns > idle) {
        c->last_ns = now; /* one drop per period; its DISCONNECT follows */
        da_transport_drop(d->tr, c->id, "idle with no sequence (--idle-timeout-ms)");
      }
}

static void on_listen_timer(uv_timer_t *t) {
  da_daemon *d = t->data;
  da_transport_check_listener(d->tr);
}

static void on_watchdog_timer(uv_timer_t *t) {
  (void)t;
  sd_notify(0, "WATCHDOG=1");
}

static void on_linger(uv_timer_t *t) {
  da_daemon *d = t->data;
  d->lingered = 1;
  maybe_stop(d);
}

/* Once drained, the daemon lingers DRAIN_LINGER_MS answering UNAVAILABLE "draining", so
 * requests already on their way get an answer rather than a reset connection. */
static void maybe_stop(da_daemon *d) {
  if (!d->draining || d->stopping) return;
  if (d->n_running > 0 || d->n_held > 0 || da_sched_items_in_flight(d->sched) > 0) return;
  if (!d->lingered) {
    if (!uv_is_active((uv_handle_t *)&d->linger_timer))
      uv_timer_start(&d->linger_timer, on_linger, DRAIN_LINGER_MS, 0);
    return;
  }
  d->stopping = 1;
  da_log_info("drained; closing the socket");
  /* Everything was answered: from here on only nng can hold us up. */
  watchdog_arm(d, da_now_ns() + (uint64_t)CLOSE_GRACE_MS * 2000000u, d->exit_code);
  da_transport_close(d->tr, CLOSE_GRACE_MS);
  d->tr = NULL;
  da_doorbell_close(d->doorbell);
  d->doorbell = NULL;
  da_planes_close(d->planes);
  d->planes = NULL;
  close_handles(d);
}

static void on_drain_deadline(uv_timer_t *t) {
  da_daemon *d = t->data;
  if (d->stopping) return;
  char why[160];
  snprintf(why, sizeof why, "drain deadline (--drain-timeout-ms %d) passed with %lld items and %d held requests unanswered",
           d->cfg->drain_timeout_ms, (long long)da_sched_items_in_flight(d->sched), d->n_held);
  exit_now(DA_EXIT_TIMEOUT, why);
}

static void on_signal(uv_signal_t *h, int signum) {
  da_daemon *d = h->data;
  if (!d->draining) {
    da_log_info("%s: draining (new requests get UNAVAILABLE; no new connections); exit within %d ms",
                signum == SIGINT ? "SIGINT" : "SIGTERM", d->cfg->drain_timeout_ms + CLOSE_GRACE_MS);
    sd_notify(0, "STOPPING=1");
    da_transport_stop_listening(d->tr);
    uv_timer_start(&d->drain_timer, on_drain_deadline, (uint64_t)d->cfg->drain_timeout_ms, 0);
    watchdog_arm(d, da_now_ns() + (uint64_t)(d->cfg->drain_timeout_ms + CLOSE_GRACE_MS) * 1000000u,
                 DA_EXIT_TIMEOUT);
  }
  d->draining = 1;
  kick(d);
  maybe_stop(d);
}

static int open_backend(da_daemon *d) {
  const da_config *c = d->cfg;
  int64_t n_pages = (c->kv_tokens + c->page_tokens - 1) / c->page_tokens;
  if (n_pages > INT32_MAX) {
    da_log_error("kv-tokens %lld is too many pages", (long long)c->kv_tokens);
    return DETATTN_INVALID_ARGUMENT;
  }
  da_backend_cfg bc = {.model = d->model, .num = d->num, .page_tokens = c->page_tokens,
                       .n_pages = (int)n_pages, .acc_slots = c->acc_slots,
                       .staging_bytes = (size_t)c->staging_mib << 20, .n_threads = c->threads,
                       .device = c->device, .max_batch_tokens = c->max_batch_tokens};
  char err[512] = "";
  int rv = da_backend_open(&d->be, da_config_backend_name(c), &bc, err, sizeof(err));
  if (rv != 0) {
    da_log_field f[] = {DA_LF_STR("backend", da_config_backend_name(c)), DA_LF_STR("error", err),
                        DA_LF_STR("status", detattn_status_name(rv))};
    da_log_event(DA_LOG_ERROR, "backend_failed", f, 3, "backend %s: %s (%s)%s", da_config_backend_name(c), err,
                 detattn_status_name(rv),
                 rv == DETATTN_RESOURCE_EXHAUSTED ? "; lower --kv-tokens (or --acc-slots, --staging-mib)" : "");
    return rv;
  }
  d->info = da_backend_get_info(d->be);
  const da_backend_info *in = d->info;
  char fp[20];
  snprintf(fp, sizeof fp, "%016llx", (unsigned long long)in->fingerprint);
  da_log_field fb[] = {DA_LF_STR("backend", in->name), DA_LF_STR("arch", in->arch),
                       DA_LF_INT("kernel_version", in->kernel_version), DA_LF_INT("split_tokens", d->num.split_tokens),
                       DA_LF_INT("tile_tokens", d->num.tile_tokens), DA_LF_STR("fingerprint", fp),
                       DA_LF_INT("device", c->device)};
  da_log_event(DA_LOG_INFO, "backend", fb, 7, "backend %s (%s), kernel version %u, S=%d T=%d, fingerprint %s",
               in->name, in->arch, in->kernel_version, d->num.split_tokens, d->num.tile_tokens, fp);
  char staging_src[96] = "";
  if (in->staging_bytes > 0)
    snprintf(staging_src, sizeof staging_src, c->staging_mib > 0 ? " (--staging-mib %d)" : " (sized from --max-batch-tokens %d)",
             c->staging_mib > 0 ? c->staging_mib : c->max_batch_tokens);
  da_log_field fp_[] = {DA_LF_INT("kv_tokens", (int64_t)in->n_pages * c->page_tokens), DA_LF_INT("kv_pages", in->n_pages),
                        DA_LF_INT("kv_bytes", in->kv_bytes), DA_LF_INT("acc_slots", in->acc_slots),
                        DA_LF_INT("acc_bytes", in->acc_bytes), DA_LF_INT("staging_bytes", in->staging_bytes),
                        DA_LF_INT("max_batch_tokens", in->max_batch_tokens),
                        DA_LF_INT("device_mem_total", in->mem_total), DA_LF_INT("device_mem_free", in->mem_free)};
  da_log_event(DA_LOG_INFO, "pools", fp_, 9,
               "KV cache: %lld tokens in %d pages (%.1f MiB); accumulators: %d slots; staging: %.1f MiB%s",
               (long long)in->n_pages * c->page_tokens, in->n_pages, (double)in->kv_bytes / 1048576.0, in->acc_slots,
               (double)in->staging_bytes / 1048576.0, staging_src);
  if (in->mem_total > 0)
    da_log_info("device memory: %.1f GiB, %.1f GiB free after the pools", (double)in->mem_total / 1073741824.0,
                (double)in->mem_free / 1073741824.0);
  return 0;
}

static void wake_loop(void *arg) { uv_async_send(arg); }

/* Each connection takes a file descriptor; the rest of the daemon needs about FD_RESERVE.
 * Like redis' maxclients: raise the soft limit toward the hard one, and if that is still
 * too low, serve fewer connections and say so. */
#define FD_RESERVE 64
static int check_fd_limit(da_daemon *d) {
  d->max_connections = d->cfg->max_connections;
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return 0;
  rlim_t need = (rlim_t)d->max_connections + FD_RESERVE;
  if (rl.rlim_cur >= need) return 0;
  rlim_t was = rl.rlim_cur;
  rl.rlim_cur = rl.rlim_max == RLIM_INFINITY || rl.rlim_max >= need ? need : rl.rlim_max;
  if (rl.rlim_cur > was && setrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur >= need) {
    da_log_info("raised the open-file limit from %llu to %llu for --max-connections %d", (unsigned long long)was,
                (unsigned long long)rl.rlim_cur, d->max_connections);
    return 0;
  }
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return 0;
  if (rl.rlim_cur <= FD_RESERVE + 1) {
    da_log_error("the open-file limit is %llu: too low for any connection (raise it: ulimit -n, LimitNOFILE)",
                 (unsigned long long)rl.rlim_cur);
    return DETATTN_INVALID_ARGUMENT;
  }
  d->max_connections = (int)(rl.rlim_cur - FD_RESERVE);
  da_log_warn("the open-file limit is %llu (hard %llu): serving at most %d connections instead of --max-connections %d "
              "(raise the limit: ulimit -n, LimitNOFILE)",
              (unsigned long long)rl.rlim_cur, (unsigned long long)rl.rlim_max, d->max_connections,
              d->cfg->max_connections);
  return 0;
}

static int start(da_daemon *d) {
  const da_config *c = d->cfg;
  int rv;
  if ((rv = open_backend(d)) != 0) return rv;
  da_kvcache_cfg kc = {.n_layers = c->layers, .page_tokens = c->page_tokens, .n_pages = d->info->n_pages,
                       .max_seqs = c->max_seqs, .max_seq_tokens = c->max_seq_tokens};
  if ((rv = da_kvcache_alloc(&d->kv, &kc)) != 0) {
    da_log_error("KV cache bookkeeping: %s", rv == DETATTN_RESOURCE_EXHAUSTED ? "out of memory" : detattn_status_name(rv));
    return rv;
  }
  if ((int64_t)d->info->n_pages * c->page_tokens < c->max_request_tokens)
    da_log_warn("the KV cache holds %lld tokens, fewer than --max-request-tokens %d: the largest requests will get "
                "RESOURCE_EXHAUSTED; raise --kv-tokens to at least %d or lower --max-request-tokens",
                (long long)d->info->n_pages * c->page_tokens, c->max_request_tokens, c->max_request_tokens);
  d->max_seqs = c->max_seqs;
  int64_t kv_cap = (int64_t)d->info->n_pages * c->page_tokens;
  d->quota_seqs = c->client_max_seqs > 0 ? c->client_max_seqs : c->max_seqs - c->max_seqs / 8;
  d->quota_kv_tokens = c->client_max_kv_tokens > 0 ? c->client_max_kv_tokens : kv_cap - kv_cap / 8;
  d->quota_inflight_tokens =
      c->client_max_inflight_tokens > 0 ? c->client_max_inflight_tokens : 4 * (int64_t)c->max_batch_tokens;
  if (d->quota_seqs < 1) d->quota_seqs = 1;
  da_log_info("quotas per client: %lld sequences, %lld KV tokens, %lld tokens in flight", (long long)d->quota_seqs,
              (long long)d->quota_kv_tokens, (long long)d->quota_inflight_tokens);
  d->seqs = calloc((size_t)d->max_seqs, sizeof(*d->seqs));
  if (d->seqs == NULL) {
    da_log_error("out of memory for the sequence table (%d sequences)", d->max_seqs);
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  int budget = c->max_batch_tokens;
  if (d->info->max_batch_tokens > 0 && d->info->max_batch_tokens < budget) {
    if (d->info->max_batch_tokens < c->max_request_tokens + c->split_tokens) {
      int need = c->max_request_tokens + c->split_tokens;
      size_t mib = (d->info->staging_bytes / 4 * (size_t)need / (size_t)d->info->max_batch_tokens + (1u << 20) - 1) >> 20;
      da_log_error("--staging-mib %d carries at most %d tokens per batch; --max-request-tokens + --split-tokens "
                   "is %d: set --staging-mib %zu or more (or 0: sized from --max-batch-tokens), or lower "
                   "--max-request-tokens to %d", c->staging_mib, d->info->max_batch_tokens, need, mib,
                   d->info->max_batch_tokens - c->split_tokens);
      return DETATTN_INVALID_ARGUMENT;
    }
    budget = d->info->max_batch_tokens;
  }
  da_sched_cfg sc = {.model = d->model, .split_tokens = c->split_tokens, .page_tokens = c->page_tokens,
                     .max_batch_tokens = budget, .max_request_tokens = c->max_request_tokens,
                     .acc_slots = d->info->acc_slots, .partial_rows = c->partial_rows,
                     .decode_tokens = c->decode_tokens, .max_prefill_tokens = c->max_prefill_tokens};
  if ((rv = da_sched_alloc(&d->sched, &sc, d->kv)) != 0) {
    da_log_error("scheduler: %s", rv == DETATTN_RESOURCE_EXHAUSTED ? "out of memory" : detattn_status_name(rv));
    return rv;
  }
  for (int i = 0; i < DA_WORKER_MAX; i++) da_sched_batch_init(&d->bufs[i]);

  if ((rv = uv_loop_init(&d->loop)) != 0) {
    da_log_error("uv_loop_init: %s", uv_strerror(rv));
    return DETATTN_INTERNAL;
  }
  d->loop_inited = 1;
  uv_handle_t *hs[] = {(uv_handle_t *)&d->ev_async,   (uv_handle_t *)&d->done_async,
                       (uv_handle_t *)&d->sigterm,    (uv_handle_t *)&d->sigint,
                       (uv_handle_t *)&d->wait_timer, (uv_handle_t *)&d->linger_timer,
                       (uv_handle_t *)&d->drain_timer, (uv_handle_t *)&d->idle_timer,
                       (uv_handle_t *)&d->watchdog_timer, (uv_handle_t *)&d->listen_timer,
                       (uv_handle_t *)&d->ev_timer, (uv_handle_t *)&d->ev_idle};
  uv_async_init(&d->loop, &d->ev_async, on_events);
  uv_async_init(&d->loop, &d->done_async, on_batch_done);
  uv_signal_init(&d->loop, &d->sigterm);
  uv_signal_init(&d->loop, &d->sigint);
  uv_timer_init(&d->loop, &d->wait_timer);
  uv_timer_init(&d->loop, &d->linger_timer);
  uv_timer_init(&d->loop, &d->drain_timer);
  uv_timer_init(&d->loop, &d->idle_timer);
  uv_timer_init(&d->loop, &d->watchdog_timer);
  uv_timer_init(&d->loop, &d->listen_timer);
  uv_timer_init(&d->loop, &d->ev_timer);
  uv_idle_init(&d->loop, &d->ev_idle);
  for (size_t i = 0; i < sizeof(hs) / sizeof(hs[0]); i++) hs[i]->data = d;
  d->n_handles = (int)(sizeof(hs) / sizeof(hs[0]));
  uv_signal_start(&d->sigterm, on_signal, SIGTERM);
  uv_signal_start(&d->sigint, on_signal, SIGINT);

  if (c->phase_timing && (d->phases = da_phases_new()) == NULL) da_log_warn("--phase-timing: out of memory; off");
  if ((rv = da_worker_start(&d->worker, d->be, on_worker_done, d)) != 0) {
    da_log_error("cannot start the backend worker thread: %s",
                 rv == DETATTN_RESOURCE_EXHAUSTED ? "out of memory" : detattn_status_name(rv));
    return rv;
  }
  /* A spinning worker saves a futex wake-up per batch where cores are idle, and costs the
   * other threads their turn where they are not (2 cores: a victim's p99 rose from 0.3 to
   * 16 ms next to a Stats flood, abuse_stats_flood). */
  const int many_cpus = sysconf(_SC_NPROCESSORS_ONLN) >= 8;
  int worker_spin = c->worker_spin_us, worker_spin_max = c->worker_spin_max_us;
  if (worker_spin < 0) worker_spin = many_cpus ? 20 : 0;
  /* Following the gap between batches (the client's turn-around and compute) saves the
   * worker's wake-up per layer call: NOTES.md v5.28. */
  if (worker_spin_max < 0) worker_spin_max = many_cpus ? 2000 : 0;
  da_worker_set_spin(d->worker, worker_spin, worker_spin_max, c->spin_late_us);
  if (c->fail_after_batches > 0) {
    da_worker_fail_from(d->worker, (uint64_t)c->fail_after_batches);
    da_log_warn("test setting: batch %d and every later one fail as an injected device failure",
                c->fail_after_batches);
  }
  if ((rv = check_fd_limit(d)) != 0) return rv;
  uint32_t uids[64], gids[64];
  da_peer_policy pol = {.self_uid = (uint32_t)geteuid(), .self_gid = (uint32_t)getegid(), .uids = uids, .gids = gids};
  pol.n_uids = da_config_id_list(c->allow_uids, uids, 64);
  pol.n_gids = da_config_id_list(c->allow_gids, gids, 64);
  d->self_uid = pol.self_uid;
  d->n_stats_uids = da_config_id_list(c->stats_uids, d->stats_uids, 64);
  size_t decode = (size_t)c->max_message_bytes * 2 + ((size_t)1 << 20);
  da_transport_cfg tc = {.url = c->listen, .n_contexts = c->contexts,
                         .limits = {.model = d->model, .max_request_tokens = c->max_request_tokens,
                                    .max_message_bytes = (size_t)c->max_message_bytes,
                                    .decode_bytes = decode},
                         .notify = wake_loop, .arg = &d->ev_async,
                         .max_connections = d->max_connections, .max_conn_per_peer = c->max_conn_per_peer,
                         .send_timeout_ms = c->send_timeout_ms, .max_reply_bytes = (size_t)c->max_reply_bytes,
                         .ipc_mode = da_config_ipc_mode(c), .policy = &pol,
                         .tls_cert = c->tls_cert, .tls_key = c->tls_key, .tls_ca = c->tls_ca};
  char err[700] = "";
  if ((rv = da_transport_open(&d->tr, &tc, err, sizeof(err))) != 0) {
    da_log_error("%s", err);
    return rv;
  }
  da_planes_cfg pc = {.loop = &d->loop, .ipc_path = NULL, .ipc_mode = da_config_ipc_mode(c),
                      .max_arena_bytes = (uint64_t)c->max_arena_bytes, .max_arenas = c->max_arenas, .be = d->be,
                      .handover = on_side_handover, .handover_arg = d};
  if (strncmp(c->listen, "ipc://", 6) == 0 && c->max_arenas > 0) pc.ipc_path = c->listen + 6;
  if ((rv = da_planes_open(&d->planes, &pc, err, sizeof(err))) != 0) {
    da_log_error("%s", err);
    return rv;
  }
  if (c->doorbell && da_planes_arena_path(d->planes)[0]) {
    /* Scanning through a client's compute between its calls saves the eventfd's wake-up of the
     * loop (on an H200 with 400 us of busy time between layer calls, B 1 L 1k 99-102 -> 70 us,
     * B 32 L 4k 336-356 -> 266-274 us; NOTES.md v5.27); on 2 cores the spinning loop would
     * take the clients' turns, as the worker's spin did. */
    int spin_max = c->doorbell_spin_max_us;
    if (spin_max < 0) spin_max = many_cpus ? 2000 : 0;
    da_doorbell_cfg dc = {.loop = &d->loop, .limits = tc.limits, .spin_us = c->doorbell_spin_us,
                          .spin_max_us = spin_max, .spin_late_us = c->spin_late_us,
                          .max_ring_bytes = (uint64_t)c->max_arena_bytes, .request = on_ring_request,
                          .scanned = on_ring_scanned, .arg = d};
    if ((rv = da_doorbell_open(&d->doorbell, &dc, err, sizeof(err))) != 0) {
      da_log_error("%s", err);
      return rv;
    }
  }
  if (c->idle_timeout_ms > 0) {
    uint64_t every = (uint64_t)c->idle_timeout_ms / 4 + 1;
    uv_timer_start(&d->idle_timer, on_idle_timer, every, every);
  }
  if (strncmp(c->listen, "ipc://", 6) == 0) uv_timer_start(&d->listen_timer, on_listen_timer, 1000, 1000);
  uint64_t wd_us = 0;
  if (sd_watchdog_enabled(0, &wd_us) > 0 && wd_us > 0)
    uv_timer_start(&d->watchdog_timer, on_watchdog_timer, wd_us / 2000 + 1, wd_us / 2000 + 1);
  if (c->http_listen[0]) {
    da_http_cfg hc = {.url = c->http_listen, .loop = &d->loop, .fill = metrics_fill, .arg = d};
    if ((rv = da_http_open(&d->http, &hc, err, sizeof(err))) != 0) {
      da_log_error("%s", err);
      return rv;
    }
    da_log_field f = DA_LF_STR("url", da_http_url(d->http));
    da_log_event(DA_LOG_INFO, "http_listening", &f, 1, "metrics and probes on %s (/metrics, /healthz, /readyz)",
                 da_http_url(d->http));
  }
  da_log_listening(da_transport_url(d->tr));
  da_fault_ready();
  sd_notify(0, "READY=1");
  return 0;
}

static void cleanup(da_daemon *d) {
  if (d->tr) da_transport_close(d->tr, 0);
  d->tr = NULL;
  da_doorbell_close(d->doorbell);
  d->doorbell = NULL;
  da_planes_close(d->planes);
  d->planes = NULL;
  da_http_close(d->http);
  d->http = NULL;
  if (d->loop_inited) {
    if (d->n_handles > 0) close_handles(d);
    uv_run(&d->loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&d->loop) != 0) da_log_warn("the loop closed with handles still open");
  }
  da_worker_stop(d->worker);
  for (int i = 0; i < DA_WORKER_MAX; i++) da_sched_batch_fini(&d->bufs[i]);
  da_sched_free(d->sched);
  da_phases_log(d->phases);
  da_phases_free(d->phases);
  d->phases = NULL;
  for (int i = 0; i < N_BUCKETS; i++)
    while (d->buckets[i]) {
      client *c = d->buckets[i];
      d->buckets[i] = c->hnext;
      while (c->held_head) {
        request *r = c->held_head;
        c->held_head = r->next;
        r->cl = NULL;
        da_ops_request_free(d, r);
      }
      free(c);
    }
  for (int i = 0; i < N_BUCKETS; i++)
    while (d->tenants[i]) {
      tenant *t = d->tenants[i];
      d->tenants[i] = t->next;
      free(t);
    }
  free(d->seqs);
  da_kvcache_free(d->kv);
  da_backend_close(d->be);
}

int da_daemon_main(const da_config *cfg) {
  static da_daemon dd; /* large (stats histograms); one per process */
  da_daemon *d = &dd;
  memset(d, 0, sizeof(*d));
  d->cfg = cfg;
  d->start_ns = da_now_ns();
  d->model = (da_model){.n_layers = cfg->layers, .n_q_heads = cfg->q_heads, .n_kv_heads = cfg->kv_heads,
                        .head_dim = cfg->head_dim, .dtype = (da_dtype)cfg->dtype,
                        .scale = (float)cfg->scale, .softcap = (float)cfg->softcap, .window = cfg->window};
  da_model_defaults(&d->model);
  d->num = (da_numerics){.split_tokens = cfg->split_tokens, .tile_tokens = cfg->tile_tokens};
  signal(SIGPIPE, SIG_IGN);
  if (start(d) != 0) {
    cleanup(d);
    watchdog_stop();
    return DA_EXIT_START;
  }
  uv_run(&d->loop, UV_RUN_DEFAULT);
  int code = d->exit_code;
  cleanup(d);
  watchdog_stop();
  da_log_info("exit %d", code);
  return code;
}
