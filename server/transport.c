#include "transport.h"

#include <errno.h>
#include <fcntl.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "log.h"

enum { RECV, HELD, SEND };

struct da_tctx {
  da_transport *t;
  nng_ctx ctx;
  nng_aio *aio;
  int state;
  uint64_t ticket; /* order of this context's pending receive among all contexts' */
};

/* A receive that completed without a request: its ticket is skipped. */
static da_event no_event;

struct da_transport {
  nng_socket sock;
  da_tctx *ctxs;
  int n_ctxs;
  da_wire_limits limits;
  void (*notify)(void *arg);
  void *arg;
  char url[600];
  pthread_mutex_t mu;
  pthread_cond_t cv;
  da_event *head, *tail;
  /* Arrival order. rep0 hands messages to waiting contexts first-come first-served, so
   * the order in which contexts start receiving (ticket, taken under arm_mu together with
   * nng_ctx_recv) is the order in which they get messages. Their callbacks may run in any
   * order on nng's threads; completed receives wait in slots until every earlier ticket is
   * delivered. At most n_ctxs tickets are outstanding. */
  int lock_fd; /* ipc: flock on <path>.lock held while we serve the path, else -1 */
  pthread_mutex_t arm_mu; /* recursive: nng may complete a receive inside nng_ctx_recv */
  uint64_t arm_ticket, deliver_ticket;
  da_event **slots;
  int sending;
  int closing;
};

static void append(da_transport *t, da_event *ev) {
  if (t->tail) t->tail->next = ev;
  else t->head = ev;
  t->tail = ev;
}

/* Connection events go straight to the queue. */
static void push(da_transport *t, da_event *ev) {
  pthread_mutex_lock(&t->mu);
  append(t, ev);
  pthread_mutex_unlock(&t->mu);
  t->notify(t->arg);
}

/* Requests go to the queue in ticket order; ev may be &no_event. */
static void deliver(da_transport *t, uint64_t ticket, da_event *ev) {
  int n = 0;
  pthread_mutex_lock(&t->mu);
  t->slots[ticket % (uint64_t)t->n_ctxs] = ev;
  for (;;) {
    da_event **slot = &t->slots[t->deliver_ticket % (uint64_t)t->n_ctxs];
    if (*slot == NULL) break;
    if (*slot != &no_event) {
      append(t, *slot);
      n++;
    }
    *slot = NULL;
    t->deliver_ticket++;
  }
  pthread_mutex_unlock(&t->mu);
  if (n) t->notify(t->arg);
}

static void recv_again(da_tctx *c) {
  da_transport *t = c->t;
  pthread_mutex_lock(&t->arm_mu);
  c->state = RECV;
  c->ticket = t->arm_ticket++;
  nng_ctx_recv(c->ctx, c->aio);
  pthread_mutex_unlock(&t->arm_mu);
}

static void on_recv(da_tctx *c) {
  da_transport *t = c->t;
  int rv = nng_aio_result(c->aio);
  if (rv != 0) {
    deliver(t, c->ticket, &no_event);
    if (rv == NNG_ECLOSED || rv == NNG_ECANCELED) return;
    da_log_warn("receive failed: %s", nng_strerror(rv));
    recv_again(c);
    return;
  }
  nng_msg *msg = nng_aio_get_msg(c->aio);
  nng_aio_set_msg(c->aio, NULL);
  da_event *ev = calloc(1, sizeof(*ev));
  if (ev == NULL) {
    nng_msg_free(msg);
    deliver(t, c->ticket, &no_event);
    recv_again(c);
    return;
  }
  ev->kind = DA_EV_REQUEST;
  ev->client = (uint32_t)nng_pipe_id(nng_msg_get_pipe(msg));
  ev->ctx = c;
  ev->recv_ns = da_now_ns();
  ev->bytes = nng_msg_len(msg);
  da_wire_decode(&t->limits, nng_msg_body(msg), nng_msg_len(msg), &ev->req);
  nng_msg_free(msg);
  c->state = HELD;
  deliver(t, c->ticket, ev);
}

static void on_send(da_tctx *c) {
  da_transport *t = c->t;
  int rv = nng_aio_result(c->aio);
  if (rv != 0) {
    nng_msg *m = nng_aio_get_msg(c->aio);
    nng_aio_set_msg(c->aio, NULL);
    nng_msg_free(m);
    if (rv != NNG_ECLOSED) da_log_debug("reply not sent: %s", nng_strerror(rv));
  }
  pthread_mutex_lock(&t->mu);
  t->sending--;
  int closing = t->closing;
  if (closing) pthread_cond_broadcast(&t->cv);
  pthread_mutex_unlock(&t->mu);
  if (!closing && rv != NNG_ECLOSED) recv_again(c);
}

static void on_aio(void *arg) {
  da_tctx *c = arg;
  if (c->state == SEND) on_send(c);
  else on_recv(c);
}

/* Returns NNG_ENOENT when the pipe is gone (out then names only the pipe). */
static int peer_of(nng_pipe p, da_peer *out) {
  memset(out, 0, sizeof(*out));
  uint32_t id = (uint32_t)nng_pipe_id(p);
  out->principal = (uint64_t)id;
  snprintf(out->name, sizeof(out->name), "pipe %u", id);
  uint64_t uid, gid, pid;
  int rv = nng_pipe_get_uint64(p, NNG_OPT_IPC_PEER_UID, &uid);
  if (rv == NNG_ENOENT) return rv;
  if (rv == 0 &&
      nng_pipe_get_uint64(p, NNG_OPT_IPC_PEER_GID, &gid) == 0 &&
      nng_pipe_get_uint64(p, NNG_OPT_IPC_PEER_PID, &pid) == 0) {
    out->has_creds = 1;
    out->uid = (uint32_t)uid;
    out->gid = (uint32_t)gid;
    out->pid = (int32_t)pid;
    out->principal = (1ull << 62) | pid;
    snprintf(out->name, sizeof(out->name), "pid %d uid %u", out->pid, out->uid);
    return 0;
  }
  nng_sockaddr sa;
  if ((rv = nng_pipe_get_addr(p, NNG_OPT_REMADDR, &sa)) != 0) return rv == NNG_ENOENT ? rv : 0;
  if (sa.s_family == NNG_AF_INET) {
    const uint8_t *a = (const uint8_t *)&sa.s_in.sa_addr;
    unsigned port = ((sa.s_in.sa_port & 0xff) << 8) | (sa.s_in.sa_port >> 8);
    out->principal = (2ull << 62) | sa.s_in.sa_addr;
    snprintf(out->name, sizeof(out->name), "%u.%u.%u.%u:%u", a[0], a[1], a[2], a[3], port);
  } else if (sa.s_family == NNG_AF_INET6) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a of the address bytes */
    for (int i = 0; i < 16; i++) h = (h ^ sa.s_in6.sa_addr[i]) * 1099511628211ull;
    unsigned port = ((sa.s_in6.sa_port & 0xff) << 8) | (sa.s_in6.sa_port >> 8);
    out->principal = (3ull << 62) | (h >> 2);
    snprintf(out->name, sizeof(out->name), "[ipv6]:%u", port);
  }
  return 0;
}

int da_transport_peer(da_transport *t, uint32_t client, da_peer *out) {
  (void)t;
  nng_pipe p = NNG_PIPE_INITIALIZER;
  p.id = client;
  return peer_of(p, out) == NNG_ENOENT ? DETATTN_NOT_FOUND : 0;
}

static void on_pipe(nng_pipe p, nng_pipe_ev ev, void *arg) {
  da_transport *t = arg;
  da_event *e = calloc(1, sizeof(*e));
  if (e == NULL) return;
  e->kind = ev == NNG_PIPE_EV_ADD_POST ? DA_EV_CONNECT : DA_EV_DISCONNECT;
  e->client = (uint32_t)nng_pipe_id(p);
  e->recv_ns = da_now_ns();
  if (e->kind == DA_EV_CONNECT) peer_of(p, &e->peer);
  push(t, e);
}

static int make_ipc_dir(const char *url, char *err, size_t errlen) {
  if (strncmp(url, "ipc://", 6) != 0) return 0;
  char path[600];
  snprintf(path, sizeof(path), "%s", url + 6);
  char *slash = strrchr(path, '/');
  if (slash == NULL || slash == path) return 0;
  *slash = '\0';
  for (char *p = path + 1; *p; p++) {
    if (*p != '/') continue;
    *p = '\0';
    if (mkdir(path, 0700) != 0 && errno != EEXIST) goto fail;
    *p = '/';
  }
  if (mkdir(path, 0700) != 0 && errno != EEXIST) goto fail;
  return 0;
fail:
  snprintf(err, errlen, "cannot create ipc directory %s: %s", path, strerror(errno));
  return DETATTN_UNAVAILABLE;
}

/* An ipc path is served by one daemon at a time. A second listener on a live path would
 * connect to the first daemon while probing the path, and nng 1.5.2 then stops the first
 * one from accepting (nng issue #1518); so take an exclusive lock on <path>.lock first and
 * fail fast while another daemon holds it. */
static int lock_ipc(const char *url, int *fd_out, char *err, size_t errlen) {
  *fd_out = -1;
  if (strncmp(url, "ipc://", 6) != 0) return 0;
  char path[620];
  snprintf(path, sizeof(path), "%s.lock", url + 6);
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    snprintf(err, errlen, "cannot open lock file %s: %s", path, strerror(errno));
    return DETATTN_UNAVAILABLE;
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    snprintf(err, errlen, "cannot listen on %s: another detattnd holds %s", url, path);
    close(fd);
    return DETATTN_UNAVAILABLE;
  }
  *fd_out = fd;
  return 0;
}

/* For tcp://host:0, the port the listener bound. */
static void resolve_url(da_transport *t, nng_listener l, const char *url) {
  snprintf(t->url, sizeof(t->url), "%s", url);
  size_t n = strlen(url);
  if (strncmp(url, "tcp://", 6) != 0 || n < 2 || strcmp(url + n - 2, ":0") != 0) return;
  nng_sockaddr sa;
  if (nng_listener_get_addr(l, NNG_OPT_LOCADDR, &sa) != 0) return;
  unsigned port = 0;
  if (sa.s_family == NNG_AF_INET) port = sa.s_in.sa_port;
  else if (sa.s_family == NNG_AF_INET6) port = sa.s_in6.sa_port;
  else return;
  port = ((port & 0xff) << 8) | ((port >> 8) & 0xff);
  snprintf(t->url, sizeof(t->url), "%.*s:%u", (int)(n - 2), url, port);
}

int da_transport_open(da_transport **out, const da_transport_cfg *cfg, char *err, size_t errlen) {
  int rv;
  da_transport *t = calloc(1, sizeof(*t));
  if (t == NULL) return DETATTN_RESOURCE_EXHAUSTED;
  t->limits = cfg->limits;
  t->notify = cfg->notify;
  t->arg = cfg->arg;
  pthread_mutex_init(&t->mu, NULL);
  pthread_cond_init(&t->cv, NULL);
  pthread_mutexattr_t ma;
  pthread_mutexattr_init(&ma);
  pthread_mutexattr_settype(&ma, PTHREAD_MUTEX_RECURSIVE);
  pthread_mutex_init(&t->arm_mu, &ma);
  pthread_mutexattr_destroy(&ma);
  t->lock_fd = -1;
  if ((rv = make_ipc_dir(cfg->url, err, errlen)) != 0) goto fail_sock;
  if ((rv = lock_ipc(cfg->url, &t->lock_fd, err, errlen)) != 0) goto fail_sock;
  if ((rv = nng_rep0_open(&t->sock)) != 0) {
    snprintf(err, errlen, "nng_rep0_open: %s", nng_strerror(rv));
    rv = DETATTN_INTERNAL;
    goto fail_sock;
  }
  size_t hard = cfg->limits.max_message_bytes * 2;
  if (hard < cfg->limits.max_message_bytes + (1u << 20)) hard = cfg->limits.max_message_bytes + (1u << 20);
  nng_socket_set_size(t->sock, NNG_OPT_RECVMAXSZ, hard);
  nng_pipe_notify(t->sock, NNG_PIPE_EV_ADD_POST, on_pipe, t);
  nng_pipe_notify(t->sock, NNG_PIPE_EV_REM_POST, on_pipe, t);
  t->ctxs = calloc((size_t)cfg->n_contexts, sizeof(*t->ctxs));
  t->slots = calloc((size_t)cfg->n_contexts, sizeof(*t->slots));
  if (t->ctxs == NULL || t->slots == NULL) {
    free(t->ctxs);
    free(t->slots);
    snprintf(err, errlen, "out of memory");
    rv = DETATTN_RESOURCE_EXHAUSTED;
    goto fail_ctxs;
  }
  for (; t->n_ctxs < cfg->n_contexts; t->n_ctxs++) {
    da_tctx *c = &t->ctxs[t->n_ctxs];
    c->t = t;
    if ((rv = nng_aio_alloc(&c->aio, on_aio, c)) != 0) goto fail_nng;
    if ((rv = nng_ctx_open(&c->ctx, t->sock)) != 0) {
      nng_aio_free(c->aio);
      goto fail_nng;
    }
  }
  nng_listener l;
  if ((rv = nng_listener_create(&l, t->sock, cfg->url)) != 0 || (rv = nng_listener_start(l, 0)) != 0) {
    snprintf(err, errlen, "cannot listen on %s: %s", cfg->url, nng_strerror(rv));
    rv = DETATTN_UNAVAILABLE;
    goto fail_listen;
  }
  resolve_url(t, l, cfg->url);
  for (int i = 0; i < t->n_ctxs; i++) recv_again(&t->ctxs[i]);
  *out = t;
  return 0;

fail_nng:
  snprintf(err, errlen, "nng context setup: %s", nng_strerror(rv));
  rv = DETATTN_INTERNAL;
fail_listen:
  nng_close(t->sock);
  for (int i = 0; i < t->n_ctxs; i++) nng_aio_free(t->ctxs[i].aio);
  free(t->ctxs);
  free(t->slots);
  goto fail_sock;
fail_ctxs:
  nng_close(t->sock);
fail_sock:
  if (t->lock_fd >= 0) close(t->lock_fd);
  pthread_mutex_destroy(&t->arm_mu);
  pthread_cond_destroy(&t->cv);
  pthread_mutex_destroy(&t->mu);
  free(t);
  return rv;
}

const char *da_transport_url(const da_transport *t) { return t->url; }

da_event *da_transport_poll(da_transport *t) {
  pthread_mutex_lock(&t->mu);
  da_event *ev = t->head;
  if (ev) {
    t->head = ev->next;
    if (t->head == NULL) t->tail = NULL;
    ev->next = NULL;
  }
  pthread_mutex_unlock(&t->mu);
  return ev;
}

void da_transport_event_free(da_event *ev) {
  if (ev == NULL) return;
  da_wire_request_fini(&ev->req);
  free(ev);
}

static void *msg_alloc(void *arg, size_t n) {
  nng_msg **m = arg;
  if (nng_msg_alloc(m, n) != 0) return NULL;
  return nng_msg_body(*m);
}

int da_transport_reply(da_transport *t, da_tctx *c, const da_wire_response *r) {
  nng_msg *m = NULL;
  void *buf;
  size_t len;
  int rv = da_wire_encode(r, msg_alloc, &m, &buf, &len);
  if (rv != 0) {
    da_wire_response e = {.id = r->id, .code = DETATTN_RESOURCE_EXHAUSTED, .message = "reply too large to encode"};
    m = NULL;
    rv = da_wire_encode(&e, msg_alloc, &m, &buf, &len);
  }
  if (rv != 0) {
    da_log_warn("request %llu: cannot encode a reply", (unsigned long long)r->id);
    pthread_mutex_lock(&t->mu);
    int closing = t->closing;
    pthread_mutex_unlock(&t->mu);
    if (!closing) recv_again(c);
    return rv;
  }
  pthread_mutex_lock(&t->mu);
  t->sending++;
  pthread_mutex_unlock(&t->mu);
  c->state = SEND;
  nng_aio_set_msg(c->aio, m);
  nng_ctx_send(c->ctx, c->aio);
  return 0;
}

void da_transport_close(da_transport *t, int wait_ms) {
  if (t == NULL) return;
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += wait_ms / 1000;
  dl.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
  if (dl.tv_nsec >= 1000000000L) {
    dl.tv_sec++;
    dl.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&t->mu);
  t->closing = 1;
  while (t->sending > 0)
    if (pthread_cond_timedwait(&t->cv, &t->mu, &dl) == ETIMEDOUT) break;
  pthread_mutex_unlock(&t->mu);
  nng_close(t->sock);
  for (int i = 0; i < t->n_ctxs; i++) nng_aio_free(t->ctxs[i].aio);
  free(t->ctxs);
  da_event *ev;
  while ((ev = da_transport_poll(t)) != NULL) da_transport_event_free(ev);
  for (int i = 0; i < t->n_ctxs; i++)
    if (t->slots[i] != NULL && t->slots[i] != &no_event) da_transport_event_free(t->slots[i]);
  free(t->slots);
  if (t->lock_fd >= 0) close(t->lock_fd);
  pthread_mutex_destroy(&t->arm_mu);
  pthread_cond_destroy(&t->cv);
  pthread_mutex_destroy(&t->mu);
  free(t);
}
