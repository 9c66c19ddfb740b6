#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_impl.h"
#include "da.h"

#include <nng/protocol/reqrep0/req.h>
#include <nng/supplemental/tls/tls.h>

enum { CALL_SEND = 0, CALL_RECV = 1 };

static _Thread_local char errmsg[512];

DETATTN_API const char *detattn_errmsg(void) { return errmsg; }

int da_err(int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(errmsg, sizeof errmsg, fmt, ap);
  va_end(ap);
  return status;
}

/* The connection dropped: the daemon may restart with another model, so Hello is asked
 * again. The calls in flight need nothing here: with resend disabled, req0 itself fails
 * them with NNG_ECONNRESET (nng 1.5.2 req0_pipe_close, also between send and receive)
 * instead of resending them on the next connection; requests are not idempotent. */
static void pipe_removed(nng_pipe p, nng_pipe_ev ev, void *arg) {
  detattn_client *c = arg;
  (void)p;
  (void)ev;
  pthread_mutex_lock(&c->mu);
  c->have_info = 0;
  c->arena_id = 0; /* the daemon dropped it with the connection, and its CUDA regions */
  da_ring *r = c->ring; /* and the doorbell ring: its calls in flight will not be answered */
  c->ring = NULL;
  c->conn_gen++;
  c->cuda_plane = 0;
  pthread_mutex_unlock(&c->mu);
  if (r) {
    da_ring_lost(r, DETATTN_UNAVAILABLE);
    da_ring_unref(r);
  }
}

DETATTN_API void detattn_connect_opts_init(detattn_connect_opts *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->data_plane = DETATTN_PLANE_AUTO;
  o->arena_bytes = (uint64_t)256 << 20;
  o->timeout_ms = DA_CLIENT_DEFAULT_TIMEOUT_MS;
  o->doorbell = DETATTN_DOORBELL_AUTO;
  o->doorbell_spin_us = DA_CLIENT_DEFAULT_DOORBELL_SPIN_US;
}

DETATTN_API const char *detattn_data_plane_name(detattn_data_plane p) {
  switch (p) {
  case DETATTN_PLANE_AUTO: return "auto";
  case DETATTN_PLANE_COPY: return "copy";
  case DETATTN_PLANE_SHM: return "shm";
  case DETATTN_PLANE_CUDA: return "cuda";
  }
  return "?";
}

DETATTN_API detattn_data_plane detattn_data_plane_get(detattn_client *c) {
  if (!c) return DETATTN_PLANE_COPY;
  pthread_mutex_lock(&c->mu);
  int p = c->plane;
  pthread_mutex_unlock(&c->mu);
  return (detattn_data_plane)p;
}

DETATTN_API detattn_doorbell detattn_doorbell_get(detattn_client *c) {
  if (!c) return DETATTN_DOORBELL_OFF;
  pthread_mutex_lock(&c->mu);
  int on = c->ring != NULL;
  pthread_mutex_unlock(&c->mu);
  return on ? DETATTN_DOORBELL_ON : DETATTN_DOORBELL_OFF;
}

DETATTN_API void *detattn_arena_alloc(detattn_client *c, size_t bytes) {
  return c ? da_arena_alloc(&c->arena, bytes) : NULL;
}

DETATTN_API void detattn_arena_free(detattn_client *c, void *p) {
  if (c) da_arena_free(&c->arena, p);
}

DETATTN_API int detattn_connect(detattn_client **out, const char *url) { return detattn_connect_ex(out, url, NULL); }

/* Reads a PEM file into a NUL-terminated string (NULL on error). */
static char *read_pem(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  char *buf = malloc(1 << 20);
  size_t n = buf ? fread(buf, 1, (1 << 20) - 1, f) : 0;
  fclose(f);
  if (!buf) return NULL;
  buf[n] = '\0';
  return buf;
}

/* tls+tcp: a dialer with a client TLS configuration. The first dial is synchronous so that a
 * certificate problem is reported now; a refused connection (no daemon yet) is retried in
 * the background. */
static int dial_tls(detattn_client *c, const char *url, const detattn_connect_opts *o) {
  nng_tls_config *tc = NULL;
  int rv, st = DETATTN_OK;
  if (!o->tls_ca || !o->tls_ca[0])
    return da_err(DETATTN_INVALID_ARGUMENT, "connect: %s needs tls_ca to verify the daemon's certificate", url);
  if ((rv = nng_dialer_create(&c->dialer, c->sock, url)) != 0)
    return da_err(DETATTN_INVALID_ARGUMENT, "connect: dialer for %s: %s", url, nng_strerror(rv));
  if ((rv = nng_tls_config_alloc(&tc, NNG_TLS_MODE_CLIENT)) != 0)
    return da_err(DETATTN_UNAVAILABLE, "connect: TLS: %s", nng_strerror(rv));
  char host[256] = "";
  const char *h = url + 10, *colon = strrchr(h, ':');
  size_t hn = colon ? (size_t)(colon - h) : strlen(h);
  if (hn < sizeof host) {
    memcpy(host, h, hn);
    host[hn] = '\0';
  }
  const char *name = o->tls_server_name && o->tls_server_name[0] ? o->tls_server_name : host;
  if ((rv = nng_tls_config_ca_file(tc, o->tls_ca)) != 0 ||
      (rv = nng_tls_config_auth_mode(tc, NNG_TLS_AUTH_MODE_REQUIRED)) != 0 ||
      (name[0] && (rv = nng_tls_config_server_name(tc, name)) != 0)) {
    st = da_err(DETATTN_INVALID_ARGUMENT, "connect: TLS CA %s: %s", o->tls_ca, nng_strerror(rv));
    goto done;
  }
  if ((o->tls_cert && o->tls_cert[0]) || (o->tls_key && o->tls_key[0])) {
    char *cert = o->tls_cert ? read_pem(o->tls_cert) : NULL, *key = o->tls_key ? read_pem(o->tls_key) : NULL;
    rv = cert && key ? nng_tls_config_own_cert(tc, cert, key, NULL) : NNG_ENOENT;
    if (key) memset(key, 0, strlen(key));
    free(cert);
    free(key);
    if (rv != 0) {
      st = da_err(DETATTN_INVALID_ARGUMENT, "connect: TLS client certificate %s / key %s: %s",
                  o->tls_cert ? o->tls_cert : "(none)", o->tls_key ? o->tls_key : "(none)", nng_strerror(rv));
      goto done;
    }
  }
  if ((rv = nng_dialer_set_ptr(c->dialer, NNG_OPT_TLS_CONFIG, tc)) != 0) {
    st = da_err(DETATTN_INTERNAL, "connect: TLS: %s", nng_strerror(rv));
    goto done;
  }
  rv = nng_dialer_start(c->dialer, 0);
  if (rv == NNG_ECONNREFUSED || rv == NNG_ETIMEDOUT || rv == NNG_EADDRINVAL || rv == NNG_EUNREACHABLE)
    rv = nng_dialer_start(c->dialer, NNG_FLAG_NONBLOCK);
  if (rv != 0 && rv != NNG_ESTATE)
    st = da_err(rv == NNG_EPEERAUTH || rv == NNG_ECRYPTO || rv == NNG_ECONNRESET || rv == NNG_ECONNSHUT
                    ? DETATTN_PERMISSION_DENIED : DETATTN_UNAVAILABLE,
                "connect: TLS handshake with %s failed: %s", url, nng_strerror(rv));
done:
  nng_tls_config_free(tc);
  return st;
}

DETATTN_API int detattn_connect_ex(detattn_client **out, const char *url, const detattn_connect_opts *opts) {
  detattn_client *c;
  detattn_connect_opts o;
  int rv, st;

  detattn_connect_opts_init(&o);
  if (opts) {
    if (opts->struct_size < sizeof(uint32_t) || opts->struct_size > sizeof o)
      return da_err(DETATTN_INVALID_ARGUMENT, "connect: opts.struct_size %u is not sizeof(detattn_connect_opts)",
                    opts->struct_size);
    memcpy(&o, opts, opts->struct_size);
    o.struct_size = sizeof o;
    if (o.data_plane < DETATTN_PLANE_AUTO || o.data_plane > DETATTN_PLANE_CUDA)
      return da_err(DETATTN_INVALID_ARGUMENT, "connect: unknown data plane %d", (int)o.data_plane);
    if (o.arena_bytes == 0) o.arena_bytes = (uint64_t)256 << 20;
    if (o.doorbell < DETATTN_DOORBELL_AUTO || o.doorbell > DETATTN_DOORBELL_ON)
      return da_err(DETATTN_INVALID_ARGUMENT, "connect: unknown doorbell mode %d", (int)o.doorbell);
    if (o.doorbell_spin_us < 0 || o.doorbell_spin_us > 1000000)
      return da_err(DETATTN_INVALID_ARGUMENT, "connect: doorbell_spin_us %d is not in [0, 1000000]",
                    o.doorbell_spin_us);
  }
  if (!out || !url) return da_err(DETATTN_INVALID_ARGUMENT, "connect: out and url must not be NULL");
  *out = NULL;
  if (strlen(url) >= sizeof c->url)
    return da_err(DETATTN_INVALID_ARGUMENT, "connect: url longer than %zu bytes", sizeof c->url - 1);
  if (!(c = calloc(1, sizeof *c))) return da_err(DETATTN_RESOURCE_EXHAUSTED, "connect: out of memory");
  snprintf(c->url, sizeof c->url, "%s", url);
  c->opts = o;
  c->timeout_ms = o.timeout_ms;
  c->plane = o.data_plane == DETATTN_PLANE_SHM ? DETATTN_PLANE_SHM : DETATTN_PLANE_COPY;
  c->arena.fd = -1;
  c->next_id = 1;
  pthread_mutex_init(&c->plane_mu, NULL);
  if (pthread_mutex_init(&c->mu, NULL) != 0) {
    st = da_err(DETATTN_INTERNAL, "connect: pthread_mutex_init failed");
    goto fail_mu;
  }
  if (pthread_cond_init(&c->idle, NULL) != 0) {
    st = da_err(DETATTN_INTERNAL, "connect: pthread_cond_init failed");
    goto fail_cv;
  }
  if ((rv = nng_req0_open(&c->sock)) != 0) {
    st = da_err(DETATTN_INTERNAL, "connect: nng_req0_open: %s", nng_strerror(rv));
    goto fail_sock;
  }
  /* Before any context exists: contexts copy the socket's resend time when opened. */
  if ((rv = nng_socket_set_ms(c->sock, NNG_OPT_REQ_RESENDTIME, NNG_DURATION_INFINITE)) != 0 ||
      (rv = nng_socket_set_size(c->sock, NNG_OPT_RECVMAXSZ, DA_CLIENT_MAX_REPLY_BYTES)) != 0 ||
      (rv = nng_socket_set_ms(c->sock, NNG_OPT_RECONNMINT, 20)) != 0 ||
      (rv = nng_socket_set_ms(c->sock, NNG_OPT_RECONNMAXT, 500)) != 0 ||
      (rv = nng_pipe_notify(c->sock, NNG_PIPE_EV_REM_POST, pipe_removed, c)) != 0) {
    st = da_err(DETATTN_INTERNAL, "connect: socket options: %s", nng_strerror(rv));
    goto fail_opt;
  }
  if (strncmp(url, "tls+tcp://", 10) == 0) {
    if ((st = dial_tls(c, url, &o)) != DETATTN_OK) goto fail_opt;
  } else if ((rv = nng_dial(c->sock, url, &c->dialer, NNG_FLAG_NONBLOCK)) != 0) {
    /* Non-blocking: the daemon may start later; calls wait for the connection. */
    st = da_err(rv == NNG_EADDRINVAL || rv == NNG_ENOTSUP || rv == NNG_EINVAL ? DETATTN_INVALID_ARGUMENT
                                                                            : DETATTN_UNAVAILABLE,
                "connect: dial %s: %s", url, nng_strerror(rv));
    goto fail_opt;
  }
  *out = c;
  return DETATTN_OK;

fail_opt:
  nng_close(c->sock);
fail_sock:
  pthread_cond_destroy(&c->idle);
fail_cv:
  pthread_mutex_destroy(&c->mu);
fail_mu:
  pthread_mutex_destroy(&c->plane_mu);
  free(c);
  return st;
}

DETATTN_API void detattn_close(detattn_client *c) {
  if (!c) return;
  pthread_mutex_lock(&c->mu);
  c->closing = 1;
  da_ring *r = c->ring;
  c->ring = NULL;
  pthread_mutex_unlock(&c->mu);
  /* Doorbell calls waiting hold their own reference to the ring: they fail CANCELLED. */
  if (r) {
    da_ring_lost(r, DETATTN_CANCELLED);
    da_ring_unref(r);
  }
  /* Closing the socket completes every outstanding aio (NNG_ECLOSED); wait until their
   * callbacks have left the in-flight list, so no callback touches the client after. */
  nng_close(c->sock);
  pthread_mutex_lock(&c->mu);
  while (c->inflight) pthread_cond_wait(&c->idle, &c->mu);
  detattn_call *live = c->live;
  c->live = NULL;
  pthread_mutex_unlock(&c->mu);
  /* Calls started and not waited for outlive the client: each ends CANCELLED when waited
   * for, its outputs not delivered (a reply that came in may point into the arena, which
   * is unmapped below) and nothing of the client touched. */
  for (detattn_call *k = live, *next; k; k = next) {
    next = k->lnext;
    k->lprev = k->lnext = NULL;
    if (k->cu_ev || k->cu_bufs) da_cuda_call_end(c, k, DETATTN_CANCELLED);
    pthread_mutex_lock(&k->mu);
    k->orphaned = 1;
    k->client = NULL;
    pthread_mutex_unlock(&k->mu);
  }
  pthread_cond_destroy(&c->idle);
  pthread_mutex_destroy(&c->mu);
  pthread_mutex_destroy(&c->plane_mu);
  da_cuda_client_fini(c);
  da_arena_destroy(&c->arena);
  free(c);
}

DETATTN_API void detattn_set_timeout(detattn_client *c, int ms) {
  if (!c) return;
  pthread_mutex_lock(&c->mu);
  c->timeout_ms = ms;
  pthread_mutex_unlock(&c->mu);
}

uint64_t da_client_next_id(detattn_client *c) {
  pthread_mutex_lock(&c->mu);
  uint64_t id = c->next_id++;
  pthread_mutex_unlock(&c->mu);
  return id;
}

/* Writes what differs between the pinned Hello a and b into msg; 0 when nothing does. */
static int pin_diff(const detattn_server_info *a, const detattn_server_info *b, char *msg, size_t len) {
  const detattn_model *x = &a->model, *y = &b->model;
#define DIFF(what, u, v)                                                                        \
  if ((u) != (v)) {                                                                            \
    snprintf(msg, len, what " %llu, now %llu", (unsigned long long)(u), (unsigned long long)(v)); \
    return 1;                                                                                  \
  }
  DIFF("n_layers was", x->n_layers, y->n_layers)
  DIFF("n_q_heads was", x->n_q_heads, y->n_q_heads)
  DIFF("n_kv_heads was", x->n_kv_heads, y->n_kv_heads)
  DIFF("head_dim was", x->head_dim, y->head_dim)
  DIFF("dtype was", x->dtype, y->dtype)
  DIFF("window was", x->window, y->window)
  DIFF("page_tokens was", x->page_tokens, y->page_tokens)
  DIFF("split_tokens was", a->split_tokens, b->split_tokens)
  DIFF("tile_tokens was", a->tile_tokens, b->tile_tokens)
  DIFF("kernel_version was", a->kernel_version, b->kernel_version)
  DIFF("max_tokens_per_request was", a->max_tokens_per_request, b->max_tokens_per_request)
#undef DIFF
  if (a->fingerprint != b->fingerprint) {
    snprintf(msg, len, "fingerprint was %016llx, now %016llx", (unsigned long long)a->fingerprint,
             (unsigned long long)b->fingerprint);
    return 1;
  }
  if (memcmp(&x->scale, &y->scale, sizeof x->scale) != 0 || memcmp(&x->softcap, &y->softcap, sizeof x->softcap) != 0) {
    snprintf(msg, len, "scale/softcap were %g/%g, now %g/%g", (double)x->scale, (double)x->softcap,
             (double)y->scale, (double)y->softcap);
    return 1;
  }
  return 0;
}

int da_client_set_info(detattn_client *c, const detattn_server_info *info) {
  char why[160];
  pthread_mutex_lock(&c->mu);
  if (c->pinned && pin_diff(&c->pin, info, why, sizeof why)) {
    pthread_mutex_unlock(&c->mu);
    return da_err(DETATTN_FAILED_PRECONDITION,
                  "the daemon at %s changed since this client's first hello (%s); open a new client for it",
                  c->url, why);
  }
  if (!c->pinned) {
    c->pin = *info;
    c->pinned = 1;
  }
  c->info = *info;
  c->have_info = 1;
  pthread_mutex_unlock(&c->mu);
  return DETATTN_OK;
}

int da_client_get_info(detattn_client *c, detattn_server_info *out) {
  pthread_mutex_lock(&c->mu);
  int have = c->have_info;
  if (have) *out = c->info;
  pthread_mutex_unlock(&c->mu);
  return have;
}

static void unlink_call(detattn_client *c, detattn_call *k) {
  if (k->prev) k->prev->next = k->next;
  else c->inflight = k->next;
  if (k->next) k->next->prev = k->prev;
  k->prev = k->next = NULL;
  if (!c->inflight) pthread_cond_broadcast(&c->idle);
}

/* The live list (under c->mu): every call from a successful start until da_call_free. */
static void link_live(detattn_client *c, detattn_call *k) {
  k->lprev = NULL;
  k->lnext = c->live;
  if (c->live) c->live->lprev = k;
  c->live = k;
}

static void unlink_live(detattn_client *c, detattn_call *k) {
  if (k->lprev) k->lprev->lnext = k->lnext;
  else c->live = k->lnext;
  if (k->lnext) k->lnext->lprev = k->lprev;
  k->lprev = k->lnext = NULL;
}

/* Runs on an nng thread. Unlinks the call before signalling the waiter: once the waiter
 * runs it may free the call. */
static void finish(detattn_call *k, int status, nng_msg *reply, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void finish(detattn_call *k, int status, nng_msg *reply, const char *fmt, ...) {
  detattn_client *c = k->client;
  pthread_mutex_lock(&c->mu);
  unlink_call(c, k);
  pthread_mutex_unlock(&c->mu);
  pthread_mutex_lock(&k->mu);
  k->status = status;
  k->reply = reply;
  if (fmt) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(k->msg, sizeof k->msg, fmt, ap);
    va_end(ap);
  }
  k->done = 1;
  pthread_cond_broadcast(&k->cv);
  pthread_mutex_unlock(&k->mu);
}

/* Milliseconds left before the call's deadline (at least 1), or NNG_DURATION_INFINITE. */
static nng_duration remaining_ms(const detattn_call *k) {
  if (!k->deadline) return NNG_DURATION_INFINITE;
  uint64_t now = da_now_ns();
  if (now >= k->deadline) return 1;
  uint64_t ms = (k->deadline - now + 999999) / 1000000;
  return ms > INT32_MAX ? INT32_MAX : (nng_duration)ms;
}

static void fail_rv(detattn_call *k, int rv, int sending) {
  const char *url = k->client->url;
  int closing;
  switch (rv) {
  case NNG_ETIMEDOUT:
    if (sending)
      finish(k, DETATTN_UNAVAILABLE, NULL, "no connection to the daemon at %s before the deadline", url);
    else
      finish(k, DETATTN_DEADLINE_EXCEEDED, NULL, "no reply from the daemon at %s before the deadline", url);
    break;
  case NNG_ECONNRESET:
    pthread_mutex_lock(&k->client->mu);
    closing = k->client->closing;
    pthread_mutex_unlock(&k->client->mu);
    if (closing)
      finish(k, DETATTN_CANCELLED, NULL, "call cancelled: the client was closed");
    else
      finish(k, DETATTN_UNAVAILABLE, NULL, "connection to the daemon at %s lost with the request in flight", url);
    break;
  case NNG_ECLOSED:
  case NNG_ECANCELED:
    finish(k, DETATTN_CANCELLED, NULL, "call cancelled: the client was closed");
    break;
  default:
    finish(k, DETATTN_UNAVAILABLE, NULL, "transport error talking to %s: %s", url, nng_strerror(rv));
  }
}

static void call_cb(void *arg) {
  detattn_call *k = arg;
  int rv = nng_aio_result(k->aio);

  if (k->phase == CALL_SEND) {
    if (rv != 0) {
      nng_msg *m = nng_aio_get_msg(k->aio);
      if (m) nng_msg_free(m);
      nng_aio_set_msg(k->aio, NULL);
      fail_rv(k, rv, 1);
      return;
    }
    k->phase = CALL_RECV;
    nng_aio_set_timeout(k->aio, remaining_ms(k));
    nng_ctx_recv(k->ctx, k->aio);
    return;
  }
  if (rv != 0) {
    fail_rv(k, rv, 0);
    return;
  }
  nng_msg *m = nng_aio_get_msg(k->aio);
  nng_aio_set_msg(k->aio, NULL);
  finish(k, DETATTN_OK, m, NULL);
}

/* Puts call k's request into a slot of the client's doorbell ring. 1 when it went there. */
static int ring_start(detattn_client *c, detattn_call *k, nng_msg *msg, size_t reply_max) {
  pthread_mutex_lock(&c->mu);
  da_ring *r = c->closing ? NULL : c->ring;
  if (r) da_ring_ref(r);
  k->deadline = c->timeout_ms > 0 ? da_now_ns() + (uint64_t)c->timeout_ms * 1000000u : 0;
  pthread_mutex_unlock(&c->mu);
  if (!r) return 0;
  if (da_ring_start(r, nng_msg_body(msg), nng_msg_len(msg), reply_max, &k->ring_slot) != DETATTN_OK) {
    da_ring_unref(r);
    return 0;
  }
  k->ring = r;
  return 1;
}

int da_call_start(detattn_client *c, nng_msg *msg, uint64_t id, int op, size_t reply_max, detattn_call **out) {
  detattn_call *k;
  int rv, st;

  *out = NULL;
  if (!(k = calloc(1, sizeof *k))) {
    nng_msg_free(msg);
    return da_err(DETATTN_RESOURCE_EXHAUSTED, "out of memory starting a call");
  }
  k->client = c;
  k->id = id;
  k->op = op;
  if (pthread_mutex_init(&k->mu, NULL) != 0) goto fail_mu;
  if (pthread_cond_init(&k->cv, NULL) != 0) goto fail_cv;
  if (reply_max > 0 && ring_start(c, k, msg, reply_max)) {
    nng_msg_free(msg);
    pthread_mutex_lock(&c->mu);
    link_live(c, k);
    pthread_mutex_unlock(&c->mu);
    *out = k;
    return DETATTN_OK;
  }
  if ((rv = nng_ctx_open(&k->ctx, c->sock)) != 0) {
    st = da_err(rv == NNG_ECLOSED ? DETATTN_CANCELLED : DETATTN_INTERNAL, "nng_ctx_open: %s", nng_strerror(rv));
    goto fail_ctx;
  }
  if ((rv = nng_aio_alloc(&k->aio, call_cb, k)) != 0) {
    st = da_err(DETATTN_RESOURCE_EXHAUSTED, "nng_aio_alloc: %s", nng_strerror(rv));
    goto fail_aio;
  }

  pthread_mutex_lock(&c->mu);
  if (c->closing) {
    pthread_mutex_unlock(&c->mu);
    st = da_err(DETATTN_CANCELLED, "the client is closing");
    goto fail_closing;
  }
  k->deadline = c->timeout_ms > 0 ? da_now_ns() + (uint64_t)c->timeout_ms * 1000000u : 0;
  k->phase = CALL_SEND;
  k->next = c->inflight;
  if (c->inflight) c->inflight->prev = k;
  c->inflight = k;
  link_live(c, k);
  nng_aio_set_timeout(k->aio, remaining_ms(k));
  nng_aio_set_msg(k->aio, msg);
  nng_ctx_send(k->ctx, k->aio);
  pthread_mutex_unlock(&c->mu);
  *out = k;
  return DETATTN_OK;

fail_closing:
  nng_aio_free(k->aio);
fail_aio:
  nng_ctx_close(k->ctx);
fail_ctx:
  pthread_cond_destroy(&k->cv);
  if (0) {
  fail_cv:
    st = da_err(DETATTN_INTERNAL, "pthread_cond_init failed");
  }
  pthread_mutex_destroy(&k->mu);
  if (0) {
  fail_mu:
    st = da_err(DETATTN_INTERNAL, "pthread_mutex_init failed");
  }
  free(k);
  nng_msg_free(msg);
  return st;
}

int da_call_transport_wait(detattn_call *k, nng_msg **reply) {
  if (k->ring) {
    char msg[200];
    int st = da_ring_wait(k->ring, k->ring_slot, k->deadline, reply, msg, sizeof msg);
    k->ring_waited = 1;
    k->answered = st == DETATTN_OK;
    return st == DETATTN_OK ? DETATTN_OK : da_err(st, "%s", msg);
  }
  pthread_mutex_lock(&k->mu);
  while (!k->done) pthread_cond_wait(&k->cv, &k->mu);
  int st = k->status;
  *reply = k->reply;
  k->reply = NULL;
  pthread_mutex_unlock(&k->mu);
  if (st != DETATTN_OK) return da_err(st, "%s", k->msg);
  k->answered = 1;
  return DETATTN_OK;
}

void da_call_free(detattn_call *k) {
  if (!k) return;
  if (k->client) {
    pthread_mutex_lock(&k->client->mu);
    unlink_live(k->client, k);
    pthread_mutex_unlock(&k->client->mu);
  }
  if (k->client && (k->cu_ev || k->cu_bufs)) da_cuda_call_end(k->client, k, DETATTN_CANCELLED);
  if (k->ring) {
    if (!k->ring_waited) da_ring_abandon(k->ring, k->ring_slot);
    da_ring_unref(k->ring);
  } else {
    /* nng_aio_free waits for a callback still returning from finish(). */
    nng_aio_free(k->aio);
    nng_ctx_close(k->ctx);
  }
  if (k->reply) nng_msg_free(k->reply);
  pthread_cond_destroy(&k->cv);
  pthread_mutex_destroy(&k->mu);
  /* Arena blocks of a call the daemon did not answer (a timeout, a lost connection) stay
   * out of the allocator for good: the daemon may still run the call and write its outputs
   * there, over whatever a later call would have put in a reused block. */
  if (k->client && k->answered)
    for (size_t i = 0; i < k->n_scratch; i++) da_arena_free(&k->client->arena, k->scratch[i]);
  free(k->scratch);
  free(k->out);
  free(k);
}
