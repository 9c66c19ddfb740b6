/*
 * plane_shm.c — libdetattn's shared-memory arena: a sealed memfd mapped here and in the
 * daemon, the hand-over of its descriptor on the daemon's ipc side socket, and a first-fit
 * allocator over it (64-byte aligned blocks with a 64-byte header).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "client_impl.h"

#define HDR 64
#define MAGIC 0x4441524541424c4bull /* "DAREABLK" */
#define SIDE_MAGIC 0x52414144u      /* "DAAR" */

typedef struct extent {
  size_t off, len;
  struct extent *next;
} extent;

int da_arena_create(da_arena *a, size_t size) {
  memset(a, 0, sizeof *a);
  a->fd = -1;
  size = (size + 4095) & ~(size_t)4095;
  int fd = memfd_create("detattn-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return da_err(DETATTN_UNAVAILABLE, "memfd_create: %s", strerror(errno));
  if (ftruncate(fd, (off_t)size) != 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    close(fd);
    return da_err(DETATTN_UNAVAILABLE, "arena memfd of %zu bytes: %s", size, strerror(errno));
  }
  void *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    close(fd);
    return da_err(DETATTN_RESOURCE_EXHAUSTED, "mmap of a %zu-byte arena: %s", size, strerror(errno));
  }
  extent *e = malloc(sizeof *e);
  if (!e) {
    munmap(base, size);
    close(fd);
    return da_err(DETATTN_RESOURCE_EXHAUSTED, "out of memory");
  }
  *e = (extent){0, size, NULL};
  pthread_mutex_init(&a->mu, NULL);
  a->fd = fd;
  a->base = base;
  a->size = size;
  a->free_list = e;
  return DETATTN_OK;
}

void da_arena_destroy(da_arena *a) {
  if (!a->base) return;
  munmap(a->base, a->size);
  close(a->fd);
  for (extent *e = a->free_list, *n; e; e = n) {
    n = e->next;
    free(e);
  }
  pthread_mutex_destroy(&a->mu);
  memset(a, 0, sizeof *a);
  a->fd = -1;
}

void *da_arena_alloc(da_arena *a, size_t bytes) {
  if (!a->base || bytes == 0 || bytes > a->size) return NULL;
  size_t need = ((bytes + 63) & ~(size_t)63) + HDR;
  void *out = NULL;
  pthread_mutex_lock(&a->mu);
  for (extent **pp = (extent **)&a->free_list; *pp; pp = &(*pp)->next) {
    extent *e = *pp;
    if (e->len < need) continue;
    uint8_t *blk = a->base + e->off;
    uint64_t hdr[2] = {need, MAGIC};
    memcpy(blk, hdr, sizeof hdr);
    out = blk + HDR;
    e->off += need;
    e->len -= need;
    if (e->len == 0) {
      *pp = e->next;
      free(e);
    }
    break;
  }
  pthread_mutex_unlock(&a->mu);
  return out;
}

void da_arena_free(da_arena *a, void *p) {
  if (!p || !a->base) return;
  uint8_t *blk = (uint8_t *)p - HDR;
  if (blk < a->base || blk >= a->base + a->size) return;
  uint64_t hdr[2];
  memcpy(hdr, blk, sizeof hdr);
  if (hdr[1] != MAGIC) return;
  size_t off = (size_t)(blk - a->base), len = (size_t)hdr[0];
  hdr[1] = 0;
  memcpy(blk, hdr, sizeof hdr);
  pthread_mutex_lock(&a->mu);
  extent **pp = (extent **)&a->free_list;
  while (*pp && (*pp)->off < off) pp = &(*pp)->next;
  extent *next = *pp, *prev = NULL;
  for (extent *e = a->free_list; e && e != next; e = e->next) prev = e;
  if (prev && prev->off + prev->len == off) {
    prev->len += len;
    if (next && prev->off + prev->len == next->off) {
      prev->len += next->len;
      prev->next = next->next;
      free(next);
    }
  } else if (next && off + len == next->off) {
    next->off = off;
    next->len += len;
  } else {
    extent *e = malloc(sizeof *e);
    if (e) {
      *e = (extent){off, len, next};
      *pp = e;
    }
  }
  pthread_mutex_unlock(&a->mu);
}

int da_arena_offset(const da_arena *a, const void *p, size_t len, uint64_t *off) {
  if (!a->base || !p) return 0;
  const uint8_t *x = p;
  if (x < a->base || x >= a->base + a->size || len > (size_t)(a->base + a->size - x)) return 0;
  *off = (uint64_t)(x - a->base);
  return 1;
}

int da_side_handover(const char *path, uint32_t magic, uint32_t id, uint64_t token, const int *fds, int n_fds,
                     int timeout_ms, const char *what) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  if (n_fds < 1 || n_fds > 4) return da_err(DETATTN_INTERNAL, "handing %s over: %d descriptors", what, n_fds);
  if (strlen(path) >= sizeof sa.sun_path) return da_err(DETATTN_INTERNAL, "side socket path too long: %s", path);
  memcpy(sa.sun_path, path, strlen(path) + 1);
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0 || connect(s, (struct sockaddr *)&sa, sizeof sa) != 0) {
    int e = errno;
    if (s >= 0) close(s);
    return da_err(DETATTN_UNAVAILABLE, "side socket %s: %s", path, strerror(e));
  }
  uint8_t msg[16];
  memcpy(msg, &magic, 4);
  memcpy(msg + 4, &id, 4);
  memcpy(msg + 8, &token, 8);
  union {
    struct cmsghdr h;
    char b[CMSG_SPACE(4 * sizeof(int))];
  } ctl;
  memset(&ctl, 0, sizeof ctl);
  struct iovec iov = {.iov_base = msg, .iov_len = sizeof msg};
  struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b,
                     .msg_controllen = CMSG_SPACE((size_t)n_fds * sizeof(int))};
  struct cmsghdr *c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN((size_t)n_fds * sizeof(int));
  memcpy(CMSG_DATA(c), fds, (size_t)n_fds * sizeof(int));
  if (sendmsg(s, &m, MSG_NOSIGNAL) != (ssize_t)sizeof msg) {
    int e = errno;
    close(s);
    return da_err(DETATTN_UNAVAILABLE, "handing %s over: %s", what, strerror(e));
  }
  struct pollfd pf = {.fd = s, .events = POLLIN};
  uint8_t code = 0xff;
  int got = poll(&pf, 1, timeout_ms > 0 ? timeout_ms : 5000) == 1 && read(s, &code, 1) == 1;
  close(s);
  if (!got) return da_err(DETATTN_UNAVAILABLE, "no answer from the side socket %s", path);
  if (code != 0) return da_err(code, "the daemon refused %s (%s; see its log)", what, detattn_status_name(code));
  return DETATTN_OK;
}

int da_arena_handover(const da_arena *a, const char *path, uint32_t id, uint64_t token, int timeout_ms) {
  return da_side_handover(path, SIDE_MAGIC, id, token, &a->fd, 1, timeout_ms, "the arena");
}
