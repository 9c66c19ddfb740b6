#include "plane.h"

#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "log.h"

#define ARENA_BUCKETS 256
#define SIDE_MAX 64                       /* side connections at once */
#define SIDE_TIMEOUT_NS 2000000000ull     /* a side connection must deliver within this */
#define PENDING_TIMEOUT_NS 10000000000ull /* a registered arena must arrive within this */
#define SIDE_MAGIC 0x52414144u            /* "DAAR" little-endian */

enum { PENDING, READY, CLOSING };
enum { HOST_ARENA, CUDA_BUFFER, CUDA_EVENT }; /* kinds of region */

/* A region of a connection: a host arena, a CUDA buffer or a CUDA event. */
typedef struct arena {
  uint32_t client, id;
  int kind;
  int state;
  int holds; /* requests in flight that reference it */
  uint64_t size, token, created_ns;
  int32_t pid;
  uint32_t uid;
  void *base; /* host arena: its mapping here */
  void *dev;  /* host arena mapped for the device, or a CUDA buffer: its device address */
  void *ev;   /* CUDA event */
  struct arena *next;
} arena;

typedef struct side {
  uv_poll_t poll; /* first: the close callback gets the side from the handle */
  da_planes *p;
  int fd;
  uint64_t deadline_ns;
  int32_t pid;
  uint32_t uid;
  int closing;
  struct side *next;
} side;

struct da_planes {
  da_planes_cfg cfg;
  const char *names[4];
  char path[640];
  int listen_fd;
  uv_poll_t listen_poll;
  uv_timer_t sweep;
  int handles; /* uv handles not yet closed */
  int closed;  /* da_planes_close was called: free once handles reach 0 */
  side *sides;
  int n_sides;
  arena *buckets[ARENA_BUCKETS];
  uint32_t next_id;
  int n_mapped;
  uint64_t mapped_bytes;
};

static arena **slot(da_planes *p, uint32_t client, uint32_t id) {
  arena **pp = &p->buckets[(client * 2654435761u ^ id) % ARENA_BUCKETS];
  while (*pp && ((*pp)->client != client || (*pp)->id != id)) pp = &(*pp)->next;
  return pp;
}

static void arena_free(da_planes *p, arena **pp) {
  arena *a = *pp;
  *pp = a->next;
  if (a->kind == HOST_ARENA && a->base) {
    if (a->dev) da_backend_unmap_host(p->cfg.be, a->base);
    munmap(a->base, a->size);
    p->n_mapped--;
    p->mapped_bytes -= a->size;
  } else if (a->kind == CUDA_BUFFER) {
    da_backend_unmap_ipc(p->cfg.be, a->dev);
    p->n_mapped--;
    p->mapped_bytes -= a->size;
  } else if (a->kind == CUDA_EVENT) {
    da_backend_event_close(p->cfg.be, a->ev);
  }
  free(a);
}

static uint64_t random_u64(void) {
  uint64_t v = 0;
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    if (read(fd, &v, sizeof v) != (ssize_t)sizeof v) v = 0;
    close(fd);
  }
  return v ? v : da_now_ns() ^ ((uint64_t)getpid() << 32);
}

/* ---- the side socket ---- */

static void maybe_free(da_planes *p) {
  if (p->closed && p->handles == 0) free(p);
}

static void on_closed(uv_handle_t *h) {
  da_planes *p;
  if (h->type == UV_POLL && h->data != NULL) {
    side *s = (side *)h;
    p = s->p;
    free(s);
  } else {
    p = (da_planes *)((char *)h - (h->type == UV_TIMER ? offsetof(da_planes, sweep) : offsetof(da_planes, listen_poll)));
  }
  p->handles--;
  maybe_free(p);
}

static void side_close(side *s) {
  if (s->closing) return;
  s->closing = 1;
  da_planes *p = s->p;
  side **pp = &p->sides;
  while (*pp != s) pp = &(*pp)->next;
  *pp = s->next;
  p->n_sides--;
  uv_poll_stop(&s->poll);
  close(s->fd);
  uv_close((uv_handle_t *)&s->poll, on_closed);
}

static void side_answer(side *s, uint8_t code, const char *why) {
  if (why) da_log_warn("hand-over from pid %d uid %u refused: %s", s->pid, s->uid, why);
  ssize_t n = send(s->fd, &code, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
  (void)n;
  side_close(s);
}

/* Checks and maps the memfd for the pending arena the message names. */
static void side_deliver(side *s, uint32_t id, uint64_t token, int fd) {
  da_planes *p = s->p;
  arena *a = NULL;
  for (int b = 0; b < ARENA_BUCKETS && a == NULL; b++)
    for (arena *x = p->buckets[b]; x; x = x->next)
      if (x->id == id && x->kind == HOST_ARENA && x->state == PENDING && x->token == token) {
        a = x;
        break;
      }
  if (a == NULL) {
    close(fd);
    side_answer(s, DETATTN_NOT_FOUND, "no pending arena with that id and token");
    return;
  }
  if (a->pid != s->pid || a->uid != s->uid) {
    close(fd);
    side_answer(s, DETATTN_PERMISSION_DENIED, "the sender is not the process that registered the arena");
    return;
  }
  int seals = fcntl(fd, F_GET_SEALS);
  struct stat st;
  if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
    close(fd);
    side_answer(s, DETATTN_INVALID_ARGUMENT, "the arena is not a memfd sealed against shrinking (F_SEAL_SHRINK)");
    return;
  }
  if (fstat(fd, &st) != 0 || (uint64_t)st.st_size < a->size) {
    close(fd);
    side_answer(s, DETATTN_INVALID_ARGUMENT, "the memfd is smaller than the registered size");
    return;
  }
  void *base = mmap(NULL, a->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    side_answer(s, DETATTN_RESOURCE_EXHAUSTED, "mmap of the arena failed");
    return;
  }
  a->base = base;
  a->state = READY;
  p->n_mapped++;
  p->mapped_bytes += a->size;
  /* With a device backend, kernels read and write the arena directly (no staging copy).
   * Where pinning fails the arena still works, through the host. */
  char why[200];
  if (p->cfg.be && da_backend_has_device_memory(p->cfg.be) &&
      da_backend_map_host(p->cfg.be, base, a->size, &a->dev, why, sizeof why) != 0) {
    da_log_warn("arena %u of client %u is not pinned for the device (%s): tensors go through the host", a->id,
                a->client, why);
    a->dev = NULL;
  }
  da_log_debug("arena %u of client %u: %llu bytes mapped%s", a->id, a->client, (unsigned long long)a->size,
               a->dev ? ", pinned for the device" : "");
  side_answer(s, 0, NULL);
}

static void on_side(uv_poll_t *h, int status, int events) {
  side *s = (side *)h;
  if (status < 0 || !(events & UV_READABLE)) {
    side_close(s);
    return;
  }
  uint8_t buf[16];
  union {
    struct cmsghdr h;
    char b[CMSG_SPACE(DA_PLANES_SIDE_FDS * sizeof(int))];
  } ctl;
  struct iovec iov = {.iov_base = buf, .iov_len = sizeof buf};
  struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b, .msg_controllen = sizeof ctl.b};
  ssize_t n = recvmsg(s->fd, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  int fds[DA_PLANES_SIDE_FDS], n_fds = 0;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len >= CMSG_LEN(sizeof(int))) {
      int got[DA_PLANES_SIDE_FDS];
      size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      if (k > DA_PLANES_SIDE_FDS) k = DA_PLANES_SIDE_FDS;
      memcpy(got, CMSG_DATA(c), k * sizeof(int));
      for (size_t i = 0; i < k; i++) {
        if (n_fds < DA_PLANES_SIDE_FDS) fds[n_fds++] = got[i];
        else close(got[i]);
      }
    }
  uint32_t magic, id;
  uint64_t token;
  memcpy(&magic, buf, 4);
  memcpy(&id, buf + 4, 4);
  memcpy(&token, buf + 8, 8);
  int bad = n != (ssize_t)sizeof buf || n_fds == 0 || (m.msg_flags & MSG_CTRUNC);
  if (!bad && magic != SIDE_MAGIC && s->p->cfg.handover) {
    char why[300] = "";
    int code = s->p->cfg.handover(s->p->cfg.handover_arg, magic, id, token, s->pid, s->uid, fds, n_fds, why,
                                  sizeof why);
    side_answer(s, (uint8_t)code, code != 0 ? why : NULL);
    return;
  }
  if (bad || magic != SIDE_MAGIC) {
    for (int i = 0; i < n_fds; i++) close(fds[i]);
    side_answer(s, DETATTN_INVALID_ARGUMENT, "malformed hand-over message");
    return;
  }
  for (int i = 1; i < n_fds; i++) close(fds[i]);
  side_deliver(s, id, token, fds[0]);
}

static void on_accept(uv_poll_t *h, int status, int events) {
  da_planes *p = (da_planes *)((char *)h - offsetof(da_planes, listen_poll));
  if (status < 0 || !(events & UV_READABLE)) return;
  for (int i = 0; i < 16; i++) {
    int fd = accept4(p->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    struct ucred cr;
    socklen_t cl = sizeof cr;
    if (p->n_sides >= SIDE_MAX || getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) != 0) {
      close(fd);
      continue;
    }
    side *s = calloc(1, sizeof(*s));
    if (s == NULL || uv_poll_init(p->cfg.loop, &s->poll, fd) != 0) {
      free(s);
      close(fd);
      continue;
    }
    s->poll.data = s;
    s->p = p;
    s->fd = fd;
    s->pid = cr.pid;
    s->uid = cr.uid;
    s->deadline_ns = da_now_ns() + SIDE_TIMEOUT_NS;
    s->next = p->sides;
    p->sides = s;
    p->n_sides++;
    p->handles++;
    uv_poll_start(&s->poll, UV_READABLE, on_side);
  }
}

/* Expires stalled side connections and arenas registered but never handed over. */
static void on_sweep(uv_timer_t *t) {
  da_planes *p = (da_planes *)((char *)t - offsetof(da_planes, sweep));
  uint64_t now = da_now_ns();
  for (side *s = p->sides, *next; s; s = next) {
    next = s->next;
    if (now > s->deadline_ns) side_answer(s, DETATTN_DEADLINE_EXCEEDED, "nothing sent within 2 s");
  }
  for (int b = 0; b < ARENA_BUCKETS; b++)
    for (arena **pp = &p->buckets[b]; *pp;) {
      if ((*pp)->state == PENDING && now - (*pp)->created_ns > PENDING_TIMEOUT_NS) arena_free(p, pp);
      else pp = &(*pp)->next;
    }
}

static int open_side(da_planes *p, char *err, size_t errlen) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  if (snprintf(p->path, sizeof p->path, "%s.arena", p->cfg.ipc_path) >= (int)sizeof sa.sun_path) {
    snprintf(err, errlen, "arena side socket path %s is too long", p->path);
    return DETATTN_INVALID_ARGUMENT;
  }
  memcpy(sa.sun_path, p->path, strlen(p->path) + 1);
  /* The ipc lock (transport.c) is ours: a file left here is a dead daemon's. */
  struct stat st;
  if (lstat(p->path, &st) == 0) {
    if (!S_ISSOCK(st.st_mode) || st.st_uid != geteuid()) {
      snprintf(err, errlen, "%s exists and is not a socket of this daemon's user: refusing it", p->path);
      return DETATTN_PERMISSION_DENIED;
    }
    unlink(p->path);
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(fd, 64) != 0 ||
      (p->cfg.ipc_mode > 0 && chmod(p->path, (mode_t)p->cfg.ipc_mode) != 0)) {
    snprintf(err, errlen, "arena side socket %s: %s", p->path, strerror(errno));
    if (fd >= 0) close(fd);
    return DETATTN_UNAVAILABLE;
  }
  p->listen_fd = fd;
  uv_poll_init(p->cfg.loop, &p->listen_poll, fd);
  p->listen_poll.data = NULL; /* sides carry themselves in data; these two carry nothing */
  uv_poll_start(&p->listen_poll, UV_READABLE, on_accept);
  uv_timer_init(p->cfg.loop, &p->sweep);
  p->sweep.data = NULL;
  uv_timer_start(&p->sweep, on_sweep, 500, 500);
  uv_unref((uv_handle_t *)&p->sweep);
  p->handles += 2;
  p->names[1] = "shm";
  if (p->cfg.be && da_backend_has_device_memory(p->cfg.be)) p->names[2] = "cuda";
  return 0;
}

/* ---- the interface ---- */

int da_planes_open(da_planes **out, const da_planes_cfg *cfg, char *err, size_t errlen) {
  da_planes *p = calloc(1, sizeof(*p));
  if (p == NULL) {
    snprintf(err, errlen, "data planes: out of memory");
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  p->cfg = *cfg;
  p->listen_fd = -1;
  p->names[0] = "copy";
  p->next_id = 1;
  if (cfg->ipc_path && cfg->ipc_path[0]) {
    int rv = open_side(p, err, errlen);
    if (rv != 0) {
      free(p);
      return rv;
    }
  }
  *out = p;
  return 0;
}

void da_planes_close(da_planes *p) {
  if (p == NULL) return;
  for (int b = 0; b < ARENA_BUCKETS; b++)
    while (p->buckets[b]) arena_free(p, &p->buckets[b]);
  while (p->sides) side_close(p->sides);
  if (p->listen_fd >= 0) {
    uv_poll_stop(&p->listen_poll);
    uv_close((uv_handle_t *)&p->listen_poll, on_closed);
    uv_close((uv_handle_t *)&p->sweep, on_closed);
    close(p->listen_fd);
    unlink(p->path);
    p->listen_fd = -1;
  }
  p->closed = 1;
  maybe_free(p);
}

const char *const *da_planes_names(const da_planes *p) { return p->names; }
const char *da_planes_arena_path(const da_planes *p) { return p->listen_fd >= 0 ? p->path : ""; }

/* A new PENDING region of client (kind and size for the caller to set), within the limit. */
static int region_new(da_planes *p, uint32_t client, const da_peer *peer, arena **out, char *err, size_t errlen) {
  int mine = 0;
  for (int b = 0; b < ARENA_BUCKETS; b++)
    for (arena *x = p->buckets[b]; x; x = x->next) mine += x->client == client;
  if (mine >= p->cfg.max_arenas) {
    snprintf(err, errlen, "this connection has %d arenas, CUDA buffers and events (at most %d: --max-arenas)", mine,
             p->cfg.max_arenas);
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  arena *a = calloc(1, sizeof(*a));
  if (a == NULL) {
    snprintf(err, errlen, "out of memory");
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  a->client = client;
  a->id = p->next_id++;
  if (p->next_id == 0) p->next_id = 1;
  a->created_ns = da_now_ns();
  a->pid = peer->pid;
  a->uid = peer->uid;
  arena **pp = slot(p, client, a->id);
  a->next = *pp;
  *pp = a;
  *out = a;
  return 0;
}

int da_planes_register(da_planes *p, uint32_t client, const da_peer *peer, uint64_t size, uint32_t *id,
                       uint64_t *token, char *err, size_t errlen) {
  if (p->listen_fd < 0) {
    snprintf(err, errlen, "this daemon has no shared-memory plane (it listens on ipc:// only)");
    return DETATTN_FAILED_PRECONDITION;
  }
  if (!peer->has_creds) {
    snprintf(err, errlen, "arenas need an ipc connection (peer credentials)");
    return DETATTN_PERMISSION_DENIED;
  }
  if (size == 0 || size > p->cfg.max_arena_bytes) {
    snprintf(err, errlen, "register_arena.size %llu is not in [1, %llu] (--max-arena-bytes)",
             (unsigned long long)size, (unsigned long long)p->cfg.max_arena_bytes);
    return DETATTN_INVALID_ARGUMENT;
  }
  arena *a;
  int rv = region_new(p, client, peer, &a, err, errlen);
  if (rv != 0) return rv;
  a->kind = HOST_ARENA;
  a->size = size;
  a->token = random_u64();
  *id = a->id;
  *token = a->token;
  return 0;
}

int da_planes_register_cuda(da_planes *p, uint32_t client, const da_peer *peer, int event, const void *handle,
                            size_t handle_len, uint64_t size, uint32_t *id, char *err, size_t errlen) {
  if (p->names[2] == NULL) {
    snprintf(err, errlen, "this daemon has no cuda plane (it needs --backend cuda and an ipc:// listener)");
    return DETATTN_FAILED_PRECONDITION;
  }
  if (!peer->has_creds) {
    snprintf(err, errlen, "CUDA buffers and events need an ipc connection (peer credentials)");
    return DETATTN_PERMISSION_DENIED;
  }
  if (!event && (size == 0 || size > p->cfg.max_arena_bytes)) {
    snprintf(err, errlen, "register_cuda.size %llu is not in [1, %llu] (--max-arena-bytes)", (unsigned long long)size,
             (unsigned long long)p->cfg.max_arena_bytes);
    return DETATTN_INVALID_ARGUMENT;
  }
  arena *a;
  int rv = region_new(p, client, peer, &a, err, errlen);
  if (rv != 0) return rv;
  a->kind = event ? CUDA_EVENT : CUDA_BUFFER;
  a->size = event ? 0 : size;
  rv = event ? da_backend_event_open(p->cfg.be, handle, handle_len, &a->ev, err, errlen)
             : da_backend_map_ipc(p->cfg.be, handle, handle_len, size, &a->dev, err, errlen);
  if (rv != 0) {
    a->kind = -1; /* nothing to release */
    arena_free(p, slot(p, client, a->id));
    return rv;
  }
  a->state = READY;
  if (!event) {
    p->n_mapped++;
    p->mapped_bytes += a->size;
  }
  *id = a->id;
  return 0;
}

int da_planes_unregister(da_planes *p, uint32_t client, uint32_t id, char *err, size_t errlen) {
  arena **pp = slot(p, client, id);
  if (*pp == NULL || (*pp)->state == CLOSING) {
    snprintf(err, errlen, "unregister_arena.arena %u is not registered on this connection", id);
    return DETATTN_NOT_FOUND;
  }
  if ((*pp)->holds > 0) (*pp)->state = CLOSING;
  else arena_free(p, pp);
  return 0;
}

int da_planes_tensor(da_planes *p, uint32_t client, const da_wire_tensor *t, size_t align, da_plane_ptr *out,
                     char *err, size_t errlen) {
  out->host = out->dev = NULL;
  if (t->arena == 0) {
    out->host = (void *)t->data;
    return 0;
  }
  arena *a = *slot(p, client, t->arena);
  if (a == NULL || a->kind == CUDA_EVENT) {
    snprintf(err, errlen, "arena %u is not registered on this connection%s", t->arena,
             a ? " (it is an event)" : "");
    return DETATTN_NOT_FOUND;
  }
  if (a->state != READY) {
    snprintf(err, errlen, "arena %u is %s", t->arena, a->state == PENDING ? "not handed over yet" : "being released");
    return DETATTN_FAILED_PRECONDITION;
  }
  if (t->offset > a->size || t->len > a->size - t->offset) {
    snprintf(err, errlen, "[%llu, %llu + %zu) is outside arena %u of %llu bytes", (unsigned long long)t->offset,
             (unsigned long long)t->offset, t->len, t->arena, (unsigned long long)a->size);
    return DETATTN_INVALID_ARGUMENT;
  }
  if (align > 1 && t->offset % align != 0) {
    snprintf(err, errlen, "offset %llu in arena %u is not a multiple of %zu", (unsigned long long)t->offset,
             t->arena, align);
    return DETATTN_INVALID_ARGUMENT;
  }
  a->holds++;
  if (a->base) out->host = (char *)a->base + t->offset;
  if (a->dev) out->dev = (char *)a->dev + t->offset;
  return 0;
}

int da_planes_plane(const da_planes *p, uint32_t client, uint32_t id) {
  if (id == 0) return 0;
  const arena *a = *slot((da_planes *)p, client, id);
  return a == NULL ? 0 : a->kind == HOST_ARENA ? 1 : a->kind == CUDA_BUFFER ? 2 : 0;
}

int da_planes_event(da_planes *p, uint32_t client, uint32_t id, void **ev, char *err, size_t errlen) {
  arena *a = *slot(p, client, id);
  if (a == NULL || a->kind != CUDA_EVENT || a->state != READY) {
    snprintf(err, errlen, "event %u is not registered on this connection", id);
    return DETATTN_NOT_FOUND;
  }
  a->holds++;
  *ev = a->ev;
  return 0;
}

void da_planes_release(da_planes *p, uint32_t client, uint32_t id) {
  arena **pp = slot(p, client, id);
  if (*pp == NULL) return;
  if (--(*pp)->holds == 0 && (*pp)->state == CLOSING) arena_free(p, pp);
}

void da_planes_client_gone(da_planes *p, uint32_t client) {
  for (int b = 0; b < ARENA_BUCKETS; b++)
    for (arena **pp = &p->buckets[b]; *pp;) {
      if ((*pp)->client != client) {
        pp = &(*pp)->next;
      } else if ((*pp)->holds > 0) {
        (*pp)->state = CLOSING;
        pp = &(*pp)->next;
      } else {
        arena_free(p, pp);
      }
    }
}

void da_planes_usage(const da_planes *p, uint32_t client, int *arenas, uint64_t *bytes) {
  *arenas = 0;
  *bytes = 0;
  if (client == 0) {
    *arenas = p->n_mapped;
    *bytes = p->mapped_bytes;
    return;
  }
  for (int b = 0; b < ARENA_BUCKETS; b++)
    for (const arena *a = p->buckets[b]; a; a = a->next)
      if (a->client == client && (a->base || a->kind == CUDA_BUFFER)) {
        (*arenas)++;
        *bytes += a->size;
      }
}
