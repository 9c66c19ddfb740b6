#include "transport.h"

#include <errno.h>
#include <fcntl.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <nng/supplemental/tls/tls.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "fault.h"
#include "log.h"

enum { RECV, HELD, SEND };

#define PIPE_BUCKETS 256
/* Refusals are logged at most once a second each kind, with the count since the last line. */
#define REFUSE_LOG_NS 1000000000ull

struct da_tctx {
  da_transport *t;
  nng_ctx ctx;
  nng_aio *aio;
  int state;
  uint32_t pipe;    /* the connection the held request came from */
  size_t sent_len;  /* SEND: bytes counted against that connection */
  uint64_t ticket; /* order of this context's pending receive among all contexts' */
};

/* An admitted connection. Its CONNECT and DISCONNECT events are allocated at admission. */
typedef struct tpipe {
  uint32_t id;
  uint32_t listener; /* nng listener id: a retired listener closes with its last connection */
  uint64_t principal;
  size_t queued; /* reply bytes handed to nng and not yet sent */
  int fd;        /* its socket (open until after REM_POST), or -1: da_transport_drop */
  int dropping;
  da_event *ev_connect, *ev_disconnect;
  struct tpipe *next;
} tpipe;

/* A receive that completed without a request: its ticket is skipped. */
static da_event no_event;

struct da_transport {
  nng_socket sock;
  nng_listener listener;
  int listening;
  char ipc_path[600]; /* the socket's path for ipc, else "" */
  da_tctx *ctxs;
  int n_ctxs;
  da_wire_limits limits;
  void (*notify)(void *arg);
  void *arg;
  char url[600];
  int max_connections, max_conn_per_peer, send_timeout_ms;
  size_t max_reply_bytes;
  da_peer_policy policy;
  int have_policy;
  uint32_t policy_ids[2 * DA_POLICY_IDS_MAX]; /* the policy's uids, then gids (copied) */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  da_event *head, *tail;
  tpipe *pipes[PIPE_BUCKETS]; /* under mu */
  da_transport_counts counts; /* under mu */
  uint64_t refuse_log_ns;
  uint64_t refused_since_log;
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
  int refusing; /* new connections are refused (draining) */
  /* The listener check (ipc): see da_transport_check_listener. */
  int ipc_mode;
  int probe_fd, probe_ticks;
  int probing, probe_seen; /* under mu: a check is under way (from before its connect), and came through */
  int generation;
  nng_listener retired[64]; /* replaced listeners, open while they have connections */
  int n_retired;
};

static void append(da_transport *t, da_event *ev) {
  if (t->tail) t->tail->next = ev;
  else t->head = ev;
  t->tail = ev;
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
  nng_aio_set_timeout(c->aio, NNG_DURATION_INFINITE);
  nng_ctx_recv(c->ctx, c->aio);
  pthread_mutex_unlock(&t->arm_mu);
}

/* ---- connections ---- */

static tpipe **pipe_slot(da_transport *t, uint32_t id) {
  tpipe **pp = &t->pipes[id % PIPE_BUCKETS];
  while (*pp && (*pp)->id != id) pp = &(*pp)->next;
  return pp;
}

static nng_pipe pipe_of(uint32_t id) {
  nng_pipe p = NNG_PIPE_INITIALIZER;
  p.id = id;
  return p;
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
  if (rv == 0 && nng_pipe_get_uint64(p, NNG_OPT_IPC_PEER_GID, &gid) == 0 &&
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
  return peer_of(pipe_of(client), out) == NNG_ENOENT ? DETATTN_NOT_FOUND : 0;
}

static int id_in(uint32_t id, const uint32_t *ids, int n) {
  for (int i = 0; i < n; i++)
    if (ids[i] == id) return 1;
  return 0;
}

static int peer_allowed(const da_peer_policy *pol, const da_peer *p) {
  if (!p->has_creds) return 1;
  if (p->uid == 0 || p->uid == pol->self_uid) return 1;
  if (id_in(p->uid, pol->uids, pol->n_uids) || id_in(p->gid, pol->gids, pol->n_gids)) return 1;
  return pol->n_uids == 0 && p->gid == pol->self_gid;
}

/* Called with mu held; logs a refusal unless one was logged less than a second ago. */
static void refuse_log(da_transport *t, const da_peer *p, const char *why) {
  uint64_t now = da_now_ns();
  t->refused_since_log++;
  if (now - t->refuse_log_ns < REFUSE_LOG_NS) return;
  da_log_warn("refused a connection from %s: %s (%llu refused since the last such line)", p->name, why,
              (unsigned long long)t->refused_since_log);
  t->refuse_log_ns = now;
  t->refused_since_log = 0;
}

/* ADD_PRE: nothing has been read from the connection yet. Admit it or close it. */
static void on_add_pre(da_transport *t, nng_pipe p) {
  da_peer peer;
  peer_of(p, &peer);
  int fd = da_nng_pipe_fd((uint32_t)nng_pipe_id(p));
  const char *why = NULL;
  char buf[160];
  pthread_mutex_lock(&t->mu);
  if (t->probing && peer.has_creds && peer.pid == (int32_t)getpid()) {
    /* Our own listener check came through: the listener takes connections. */
    t->probe_seen = 1;
    pthread_mutex_unlock(&t->mu);
    nng_pipe_close(p);
    return;
  }
  if (t->closing || t->refusing) {
    why = "the daemon is shutting down";
  } else if (t->max_connections > 0 && t->counts.open >= t->max_connections) {
    snprintf(buf, sizeof buf, "%d connections open (--max-connections)", t->counts.open);
    why = buf;
    t->counts.refused_cap++;
  } else if (t->have_policy && !peer_allowed(&t->policy, &peer)) {
    snprintf(buf, sizeof buf, "uid %u gid %u is not allowed (--allow-uids, --allow-gids)", peer.uid, peer.gid);
    why = buf;
    t->counts.refused_creds++;
  } else if (t->max_conn_per_peer > 0) {
    int n = 0;
    for (int b = 0; b < PIPE_BUCKETS; b++)
      for (tpipe *x = t->pipes[b]; x; x = x->next) n += x->principal == peer.principal;
    if (n >= t->max_conn_per_peer) {
      snprintf(buf, sizeof buf, "%d connections from this peer (--max-conn-per-peer)", n);
      why = buf;
      t->counts.refused_peer++;
    }
  }
  tpipe *x = NULL;
  if (why == NULL) {
    x = calloc(1, sizeof(*x));
    da_event *a = calloc(1, sizeof(*a)), *d = calloc(1, sizeof(*d));
    if (x == NULL || a == NULL || d == NULL) {
      free(x);
      free(a);
      free(d);
      x = NULL;
      why = "out of memory";
    } else {
      x->id = (uint32_t)nng_pipe_id(p);
      x->listener = (uint32_t)nng_listener_id(nng_pipe_listener(p));
      x->principal = peer.principal;
      x->fd = fd;
      a->kind = DA_EV_CONNECT;
      a->client = x->id;
      a->peer = peer;
      d->kind = DA_EV_DISCONNECT;
      d->client = x->id;
      x->ev_connect = a;
      x->ev_disconnect = d;
      tpipe **pp = pipe_slot(t, x->id);
      x->next = *pp;
      *pp = x;
      t->counts.open++;
      t->counts.accepted++;
    }
  }
  if (why) refuse_log(t, &peer, why);
  pthread_mutex_unlock(&t->mu);
  if (why) nng_pipe_close(p);
}

static void on_pipe(nng_pipe p, nng_pipe_ev ev, void *arg) {
  da_transport *t = arg;
  if (ev == NNG_PIPE_EV_ADD_PRE) {
    on_add_pre(t, p);
    return;
  }
  if (ev == NNG_PIPE_EV_ADD_POST) da_fault_connect_delay();
  uint32_t id = (uint32_t)nng_pipe_id(p);
  da_event *e = NULL;
  pthread_mutex_lock(&t->mu);
  tpipe **pp = pipe_slot(t, id), *x = *pp;
  if (x && ev == NNG_PIPE_EV_ADD_POST) {
    e = x->ev_connect;
    x->ev_connect = NULL;
  } else if (x && ev == NNG_PIPE_EV_REM_POST) {
    /* Reported even before ADD_POST (which then finds nothing): libnng 1.5.2 starts
     * receiving before ADD_POST and runs REM_POST on its reaper without waiting for it, so
     * the loop may have taken requests of this connection and made its client. */
    *pp = x->next;
    t->counts.open--;
    e = x->ev_disconnect;
    free(x->ev_connect);
    free(x);
  }
  if (e) {
    e->recv_ns = da_now_ns();
    append(t, e);
  }
  pthread_mutex_unlock(&t->mu);
  if (e) t->notify(t->arg);
}

/* Ends the reading half of the connection's socket rather than calling nng_pipe_close,
 * which can hang libnng 1.5.2's reaper when a read is in flight (nng_fd.c): the read sees
 * end of file and libnng closes the pipe as if the peer had hung up. The descriptor stays
 * the pipe's while x is listed: libnng closes it after REM_POST, which unlists x under mu. */
void da_transport_drop(da_transport *t, uint32_t client, const char *why) {
  pthread_mutex_lock(&t->mu);
  tpipe *x = *pipe_slot(t, client);
  int drop = x && !x->dropping, shut = 0;
  if (drop) {
    x->dropping = 1;
    shut = x->fd >= 0 && shutdown(x->fd, SHUT_RD) == 0;
  }
  pthread_mutex_unlock(&t->mu);
  if (!drop) return;
  da_log_warn("client %u: %s; connection closed", client, why);
  if (!shut) nng_pipe_close(pipe_of(client));
}

void da_transport_counts_get(da_transport *t, da_transport_counts *out) {
  pthread_mutex_lock(&t->mu);
  *out = t->counts;
  pthread_mutex_unlock(&t->mu);
}

/* ---- requests and replies ---- */

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
    /* No reply can be promised: close the connection, so its client learns at once
     * (UNAVAILABLE) instead of waiting for a reply that will not come. */
    da_transport_drop(t, (uint32_t)nng_pipe_id(nng_msg_get_pipe(msg)), "out of memory receiving a request");
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
  /* Decoding may allocate a multiple of what arrived, never the whole budget for a small
   * message (a Forward of a million empty sequences is 2 MB on the wire). */
  da_wire_limits lim = t->limits;
  size_t budget = 4 * ev->bytes + ((size_t)64 << 10);
  if (budget < lim.decode_bytes) lim.decode_bytes = budget;
  da_wire_decode(&lim, nng_msg_body(msg), nng_msg_len(msg), &ev->req);
  nng_msg_free(msg);
  c->pipe = ev->client;
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
    if (rv == NNG_ETIMEDOUT) {
      char why[96];
      snprintf(why, sizeof why, "a reply was not taken within %d ms (--send-timeout-ms)", t->send_timeout_ms);
      pthread_mutex_lock(&t->mu);
      t->counts.dropped_slow++;
      pthread_mutex_unlock(&t->mu);
      da_transport_drop(t, c->pipe, why);
    } else if (rv != NNG_ECLOSED) {
      da_log_debug("reply not sent: %s", nng_strerror(rv));
    }
  }
  pthread_mutex_lock(&t->mu);
  tpipe *x = *pipe_slot(t, c->pipe);
  if (x) x->queued -= c->sent_len;
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

static void *msg_alloc(void *arg, size_t n) {
  nng_msg **m = arg;
  if (nng_msg_alloc(m, n) != 0) return NULL;
  return nng_msg_body(*m);
}

/* The context goes back to receiving without sending anything. */
static void discard(da_transport *t, da_tctx *c, nng_msg *m) {
  nng_msg_free(m);
  pthread_mutex_lock(&t->mu);
  int closing = t->closing;
  pthread_mutex_unlock(&t->mu);
  if (!closing) recv_again(c);
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
    discard(t, c, NULL);
    return rv;
  }
  pthread_mutex_lock(&t->mu);
  tpipe *x = *pipe_slot(t, c->pipe);
  int gone = x == NULL || x->dropping, over = 0;
  if (!gone && t->max_reply_bytes > 0 && x->queued + len > t->max_reply_bytes) over = 1;
  if (!gone && !over) {
    x->queued += len;
    c->sent_len = len;
    t->sending++;
  }
  size_t queued = x ? x->queued : 0;
  pthread_mutex_unlock(&t->mu);
  if (gone || over) {
    if (over) {
      char why[128];
      snprintf(why, sizeof why, "%zu reply bytes not taken, %zu more would pass --max-reply-bytes", queued, len);
      pthread_mutex_lock(&t->mu);
      t->counts.dropped_slow++;
      pthread_mutex_unlock(&t->mu);
      da_transport_drop(t, c->pipe, why);
    }
    discard(t, c, m);
    return DETATTN_UNAVAILABLE;
  }
  c->state = SEND;
  nng_aio_set_msg(c->aio, m);
  nng_aio_set_timeout(c->aio, t->send_timeout_ms > 0 ? t->send_timeout_ms : NNG_DURATION_INFINITE);
  nng_ctx_send(c->ctx, c->aio);
  return 0;
}

/* ---- the ipc path ---- */

/* The directory of an ipc socket must not let another user replace or squat the socket:
 * owned by us (or root), not a link, not writable by others unless sticky. */
static int check_dir(const char *path, char *err, size_t errlen) {
  struct stat st;
  if (lstat(path, &st) != 0) {
    snprintf(err, errlen, "ipc directory %s: %s", path, strerror(errno));
    return DETATTN_UNAVAILABLE;
  }
  if (!S_ISDIR(st.st_mode)) {
    snprintf(err, errlen, "ipc directory %s is not a directory (a link or a file)", path);
    return DETATTN_PERMISSION_DENIED;
  }
  if (st.st_uid != geteuid() && st.st_uid != 0) {
    snprintf(err, errlen, "ipc directory %s belongs to uid %u, not to this daemon's user (%u): refusing it",
             path, (unsigned)st.st_uid, (unsigned)geteuid());
    return DETATTN_PERMISSION_DENIED;
  }
  if ((st.st_mode & 022) && !(st.st_mode & S_ISVTX)) {
    snprintf(err, errlen, "ipc directory %s is writable by group or others (mode %04o) and not sticky: refusing it",
             path, (unsigned)(st.st_mode & 07777));
    return DETATTN_PERMISSION_DENIED;
  }
  return 0;
}

static int make_ipc_dir(const char *url, char *err, size_t errlen) {
  if (strncmp(url, "ipc://", 6) != 0) return 0;
  char path[600];
  snprintf(path, sizeof(path), "%s", url + 6);
  char *slash = strrchr(path, '/');
  if (slash == NULL) return 0;
  if (slash == path) return check_dir("/", err, errlen);
  *slash = '\0';
  for (char *p = path + 1; *p; p++) {
    if (*p != '/') continue;
    *p = '\0';
    if (mkdir(path, 0700) != 0 && errno != EEXIST) goto fail;
    *p = '/';
  }
  if (mkdir(path, 0700) != 0 && errno != EEXIST) goto fail;
  return check_dir(path, err, errlen);
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
  int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    snprintf(err, errlen, "cannot open lock file %s: %s", path,
             errno == ELOOP ? "it is a symbolic link" : strerror(errno));
    return errno == ELOOP ? DETATTN_PERMISSION_DENIED : DETATTN_UNAVAILABLE;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
    snprintf(err, errlen, "lock file %s is not a regular file of this daemon's user: refusing it", path);
    close(fd);
    return DETATTN_PERMISSION_DENIED;
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    snprintf(err, errlen, "cannot listen on %s: another detattnd holds %s", url, path);
    close(fd);
    return DETATTN_UNAVAILABLE;
  }
  *fd_out = fd;
  return 0;
}

/* Reads a whole (small) file into a NUL-terminated string; NULL on error. */
static char *slurp(const char *path) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) return NULL;
  char *buf = NULL;
  size_t len = 0, cap = 0;
  for (;;) {
    if (len + 4096 + 1 > cap) {
      cap = (len + 4096 + 1) * 2;
      if (cap > (1u << 20)) break; /* no PEM file is this large */
      char *nb = realloc(buf, cap);
      if (nb == NULL) break;
      buf = nb;
    }
    size_t n = fread(buf + len, 1, 4096, f);
    len += n;
    if (n < 4096) {
      fclose(f);
      buf[len] = '\0';
      return buf;
    }
  }
  fclose(f);
  free(buf);
  return NULL;
}

/* The TLS server configuration for the listener: the daemon's certificate and key, and with
 * a CA, client certificates required (mutual TLS). */
static int setup_tls(nng_listener l, const da_transport_cfg *cfg, char *err, size_t errlen) {
  nng_tls_config *tc;
  int rv = nng_tls_config_alloc(&tc, NNG_TLS_MODE_SERVER);
  if (rv != 0) {
    snprintf(err, errlen, "TLS: %s (engine %s)", nng_strerror(rv), nng_tls_engine_name());
    return DETATTN_UNAVAILABLE;
  }
  char *cert = slurp(cfg->tls_cert), *key = slurp(cfg->tls_key);
  const char *what = cert == NULL ? cfg->tls_cert : cfg->tls_key;
  if (cert == NULL || key == NULL) {
    snprintf(err, errlen, "TLS: cannot read %s: %s", what, strerror(errno));
    rv = DETATTN_INVALID_ARGUMENT;
  } else if ((rv = nng_tls_config_own_cert(tc, cert, key, NULL)) != 0) {
    snprintf(err, errlen, "TLS: --tls-cert %s / --tls-key %s: %s", cfg->tls_cert, cfg->tls_key, nng_strerror(rv));
    rv = DETATTN_INVALID_ARGUMENT;
  } else if (cfg->tls_ca && cfg->tls_ca[0] &&
             ((rv = nng_tls_config_ca_file(tc, cfg->tls_ca)) != 0 ||
              (rv = nng_tls_config_auth_mode(tc, NNG_TLS_AUTH_MODE_REQUIRED)) != 0)) {
    snprintf(err, errlen, "TLS: --tls-ca %s: %s", cfg->tls_ca, nng_strerror(rv));
    rv = DETATTN_INVALID_ARGUMENT;
  } else if ((rv = nng_listener_set_ptr(l, NNG_OPT_TLS_CONFIG, tc)) != 0) {
    snprintf(err, errlen, "TLS: %s", nng_strerror(rv));
    rv = DETATTN_UNAVAILABLE;
  }
  if (key) memset(key, 0, strlen(key));
  free(cert);
  free(key);
  nng_tls_config_free(tc);
  return rv;
}

/* For a tcp port 0 (tcp:// or tls+tcp://), the port the listener bound. */
static void resolve_url(da_transport *t, nng_listener l, const char *url) {
  snprintf(t->url, sizeof(t->url), "%s", url);
  size_t n = strlen(url);
  if (strstr(url, "tcp://") == NULL || n < 2 || strcmp(url + n - 2, ":0") != 0) return;
  int port = 0;
  if (nng_listener_get_int(l, NNG_OPT_TCP_BOUND_PORT, &port) != 0 || port <= 0) return;
  snprintf(t->url, sizeof(t->url), "%.*s:%d", (int)(n - 2), url, port);
}

/* ---- the listener check (ipc) ----
 *
 * A second line of defence behind nng_epipe.c. libnng 1.5.2 (Debian 12) ends an ipc
 * listener's accept loop for good when the daemon's half
 * of the SP handshake fails with EPIPE: one client that connects and hangs up before the
 * daemon has written its 8 bytes, and from then on every new connection is accepted by the
 * kernel and never served (upstream fixed it in 1.6.0: the error is no longer NNG_ECLOSED).
 * Connections already open keep working. So every listener binds <path>.r<N> and is renamed
 * over <path>, and every second the loop calls da_transport_check_listener: it connects to
 * the path, sends the handshake, and expects its own connection at ADD_PRE (refused there)
 * by the next call; when it has not come after two, a fresh listener is renamed over the
 * path. The old one keeps its connections and is closed with the last of them. */

static int listen_at(da_transport *t, nng_listener *l, const char *url, char *err, size_t errlen) {
  int rv = nng_listener_create(l, t->sock, url);
  if (rv == 0 && t->ipc_path[0] && t->ipc_mode > 0) rv = nng_listener_set_int(*l, NNG_OPT_IPC_PERMISSIONS, t->ipc_mode);
  if (rv == 0) rv = nng_listener_start(*l, 0);
  if (rv != 0) {
    snprintf(err, errlen, "cannot listen on %.200s: %s", url, nng_strerror(rv));
    nng_listener_close(*l);
  }
  return rv;
}

/* Binds a listener at <path>.r<N> and renames it over <path>. */
static int listen_ipc(da_transport *t, nng_listener *l, char *err, size_t errlen) {
  char tmp[640], url[660];
  snprintf(tmp, sizeof tmp, "%s.r%d", t->ipc_path, t->generation++);
  snprintf(url, sizeof url, "ipc://%s", tmp);
  unlink(tmp);
  int rv = listen_at(t, l, url, err, errlen);
  if (rv != 0) return rv;
  if (rename(tmp, t->ipc_path) != 0) {
    snprintf(err, errlen, "cannot listen on %.200s: rename from %.200s: %s", t->ipc_path, tmp, strerror(errno));
    nng_listener_close(*l);
    return NNG_EINVAL;
  }
  return 0;
}

static void replace_listener(da_transport *t) {
  char err[512];
  if (t->n_retired == (int)(sizeof t->retired / sizeof t->retired[0])) {
    da_log_error("the ipc listener stopped taking new connections; %d replaced ones still have connections: "
                 "not replacing it", t->n_retired);
    return;
  }
  nng_listener l;
  if (listen_ipc(t, &l, err, sizeof err) != 0) {
    da_log_error("the ipc listener stopped taking new connections and a new one failed: %s", err);
    return;
  }
  pthread_mutex_lock(&t->mu);
  t->retired[t->n_retired++] = t->listener;
  t->listener = l;
  t->counts.listener_replaced++;
  pthread_mutex_unlock(&t->mu);
  da_log_warn("the ipc listener stopped taking new connections (a client hung up in the handshake: libnng 1.5.2); "
              "listening again on a fresh socket at %s, open connections unaffected", t->ipc_path);
}

/* Closes the replaced listeners whose connections have all gone. */
static void close_retired(da_transport *t) {
  for (int i = 0; i < t->n_retired;) {
    uint32_t id = (uint32_t)nng_listener_id(t->retired[i]);
    int n = 0;
    pthread_mutex_lock(&t->mu);
    for (int b = 0; b < PIPE_BUCKETS; b++)
      for (tpipe *x = t->pipes[b]; x; x = x->next) n += x->listener == id;
    pthread_mutex_unlock(&t->mu);
    if (n > 0) {
      i++;
      continue;
    }
    nng_listener_close(t->retired[i]); /* unlinks only its own <path>.r<N>, long renamed */
    t->retired[i] = t->retired[--t->n_retired];
  }
}

void da_transport_check_listener(da_transport *t) {
  if (t == NULL || !t->ipc_path[0] || !t->listening) return;
  close_retired(t);
  pthread_mutex_lock(&t->mu);
  int stop = t->refusing || t->closing, seen = t->probe_seen;
  pthread_mutex_unlock(&t->mu);
  if (t->probe_fd >= 0) {
    if (!seen && !stop && ++t->probe_ticks < 2) return;
    if (!seen && !stop) replace_listener(t);
    /* After ADD_PRE both handshake halves are done, so this close cannot hit the bug. */
    pthread_mutex_lock(&t->mu);
    close(t->probe_fd);
    t->probe_fd = -1;
    t->probing = 0;
    pthread_mutex_unlock(&t->mu);
    return;
  }
  if (stop) return;
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  if (strlen(t->ipc_path) >= sizeof sa.sun_path) return;
  memcpy(sa.sun_path, t->ipc_path, strlen(t->ipc_path) + 1);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  const uint8_t hs[8] = {0, 'S', 'P', 0, 0, 0x30, 0, 0}; /* a req0 peer */
  /* Marked before connecting: the daemon's half of the handshake, and so ADD_PRE, may come
   * before write returns here. */
  pthread_mutex_lock(&t->mu);
  t->probing = 1;
  t->probe_seen = 0;
  pthread_mutex_unlock(&t->mu);
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || write(fd, hs, sizeof hs) != (ssize_t)sizeof hs) {
    close(fd); /* connected or not, nothing was negotiated with a half-written handshake */
    pthread_mutex_lock(&t->mu);
    t->probing = 0;
    pthread_mutex_unlock(&t->mu);
    return;
  }
  t->probe_fd = fd;
  t->probe_ticks = 0;
}

int da_transport_open(da_transport **out, const da_transport_cfg *cfg, char *err, size_t errlen) {
  int rv;
  da_transport *t = calloc(1, sizeof(*t));
  if (t == NULL) {
    snprintf(err, errlen, "transport: out of memory");
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  t->limits = cfg->limits;
  t->notify = cfg->notify;
  t->arg = cfg->arg;
  t->max_connections = cfg->max_connections;
  t->max_conn_per_peer = cfg->max_conn_per_peer;
  t->send_timeout_ms = cfg->send_timeout_ms;
  t->max_reply_bytes = cfg->max_reply_bytes;
  if (cfg->policy) {
    /* The caller's id arrays need not outlive this call: keep copies. */
    t->policy = *cfg->policy;
    if (t->policy.n_uids > DA_POLICY_IDS_MAX) t->policy.n_uids = DA_POLICY_IDS_MAX;
    if (t->policy.n_gids > DA_POLICY_IDS_MAX) t->policy.n_gids = DA_POLICY_IDS_MAX;
    if (t->policy.n_uids > 0) memcpy(t->policy_ids, cfg->policy->uids, (size_t)t->policy.n_uids * sizeof(uint32_t));
    if (t->policy.n_gids > 0)
      memcpy(t->policy_ids + DA_POLICY_IDS_MAX, cfg->policy->gids, (size_t)t->policy.n_gids * sizeof(uint32_t));
    t->policy.uids = t->policy_ids;
    t->policy.gids = t->policy_ids + DA_POLICY_IDS_MAX;
    t->have_policy = 1;
  }
  pthread_mutex_init(&t->mu, NULL);
  pthread_cond_init(&t->cv, NULL);
  pthread_mutexattr_t ma;
  pthread_mutexattr_init(&ma);
  pthread_mutexattr_settype(&ma, PTHREAD_MUTEX_RECURSIVE);
  pthread_mutex_init(&t->arm_mu, &ma);
  pthread_mutexattr_destroy(&ma);
  t->lock_fd = -1;
  t->probe_fd = -1;
  t->ipc_mode = cfg->ipc_mode;
  if (strncmp(cfg->url, "ipc://", 6) == 0) snprintf(t->ipc_path, sizeof(t->ipc_path), "%s", cfg->url + 6);
  if ((rv = make_ipc_dir(cfg->url, err, errlen)) != 0) goto fail_sock;
  if ((rv = lock_ipc(cfg->url, &t->lock_fd, err, errlen)) != 0) goto fail_sock;
  if ((rv = nng_rep0_open(&t->sock)) != 0) {
    snprintf(err, errlen, "nng_rep0_open: %s", nng_strerror(rv));
    rv = DETATTN_INTERNAL;
    goto fail_sock;
  }
  nng_socket_set_size(t->sock, NNG_OPT_RECVMAXSZ, cfg->limits.max_message_bytes + ((size_t)64 << 10));
  nng_pipe_notify(t->sock, NNG_PIPE_EV_ADD_PRE, on_pipe, t);
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
  if (t->ipc_path[0]) {
    if (listen_ipc(t, &t->listener, err, errlen) != 0) {
      rv = DETATTN_UNAVAILABLE;
      goto fail_listen;
    }
  } else if ((rv = nng_listener_create(&t->listener, t->sock, cfg->url)) != 0) {
    snprintf(err, errlen, "cannot listen on %s: %s", cfg->url, nng_strerror(rv));
    rv = DETATTN_UNAVAILABLE;
    goto fail_listen;
  }
  if (strncmp(cfg->url, "tls+tcp://", 10) == 0 && (rv = setup_tls(t->listener, cfg, err, errlen)) != 0)
    goto fail_listen;
  if (!t->ipc_path[0] && (rv = nng_listener_start(t->listener, 0)) != 0) {
    snprintf(err, errlen, "cannot listen on %s: %s", cfg->url, nng_strerror(rv));
    rv = DETATTN_UNAVAILABLE;
    goto fail_listen;
  }
  t->listening = 1;
  resolve_url(t, t->listener, cfg->url);
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
  goto fail_pipes;
fail_ctxs:
  nng_close(t->sock);
fail_pipes:
  for (int b = 0; b < PIPE_BUCKETS; b++)
    while (t->pipes[b]) {
      tpipe *x = t->pipes[b];
      t->pipes[b] = x->next;
      free(x->ev_connect);
      free(x->ev_disconnect);
      free(x);
    }
fail_sock:
  if (t->lock_fd >= 0) close(t->lock_fd);
  pthread_mutex_destroy(&t->arm_mu);
  pthread_cond_destroy(&t->cv);
  pthread_mutex_destroy(&t->mu);
  free(t);
  return rv;
}

const char *da_transport_url(const da_transport *t) { return t->url; }

int da_transport_lock_fd(const da_transport *t) { return t ? t->lock_fd : -1; }

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

/* nng_listener_close would also close the connections it accepted: keep the listener and
 * refuse new connections at ADD_PRE instead. */
void da_transport_stop_listening(da_transport *t) {
  if (t == NULL) return;
  pthread_mutex_lock(&t->mu);
  t->refusing = 1;
  pthread_mutex_unlock(&t->mu);
}

void da_transport_close(da_transport *t, int wait_ms) {
  if (t == NULL) return;
  da_transport_stop_listening(t);
  if (t->listening) nng_listener_close(t->listener);
  t->listening = 0;
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
  nng_close(t->sock); /* and the retired listeners */
  if (t->probe_fd >= 0) close(t->probe_fd);
  if (t->ipc_path[0]) unlink(t->ipc_path); /* the listeners unlink only their <path>.r<N> */
  for (int i = 0; i < t->n_ctxs; i++) nng_aio_free(t->ctxs[i].aio);
  free(t->ctxs);
  da_event *ev;
  while ((ev = da_transport_poll(t)) != NULL) da_transport_event_free(ev);
  for (int i = 0; i < t->n_ctxs; i++)
    if (t->slots[i] != NULL && t->slots[i] != &no_event) da_transport_event_free(t->slots[i]);
  free(t->slots);
  for (int b = 0; b < PIPE_BUCKETS; b++)
    while (t->pipes[b]) {
      tpipe *x = t->pipes[b];
      t->pipes[b] = x->next;
      free(x->ev_connect);
      free(x->ev_disconnect);
      free(x);
    }
  if (t->lock_fd >= 0) close(t->lock_fd);
  pthread_mutex_destroy(&t->arm_mu);
  pthread_cond_destroy(&t->cv);
  pthread_mutex_destroy(&t->mu);
  free(t);
}
