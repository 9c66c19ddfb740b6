/*
 * nng_fd.c — the socket descriptor behind an nng pipe (libnng 1.5.2 offers no option for it),
 * so that the daemon can drop a connection the way a peer hanging up does.
 *
 * Why: nng_pipe_close() on a connection whose reads are in flight can stop libnng 1.5.2's
 * reaper thread for good. The ipc and tcp transports resubmit the rest of a partly read
 * message from the read's callback; when close has stopped that aio in between, the
 * resubmission is dropped without a callback, and the pipe's stop (on the reaper) waits for
 * it forever. From then on no connection's departure is reported (REM_POST runs on that
 * thread): every later client's sequences, pages and connection slot leak. A peer that
 * hangs up never hits this, because its end of file arrives through the read path, which
 * then closes the pipe itself. So transport.c drops a connection with shutdown(SHUT_RD) on
 * its descriptor: the pending or next read sees end of file and libnng closes the pipe from
 * there (a reply being written is cancelled cleanly: its aio is queued, not in a callback).
 *
 * How: asking libnng for a pipe's peer credentials (ipc) or peer address (tcp, tls) makes it
 * call getsockopt or getpeername on the pipe's descriptor, on the calling thread. These two
 * wrappers note that descriptor while da_nng_pipe_fd asks; every other call passes through.
 */
#include <dlfcn.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/socket.h>

#include <nng/nng.h>

#include "transport.h"

static _Thread_local int capturing, captured = -1;

typedef int (*getsockopt_fn)(int, int, int, void *restrict, socklen_t *restrict);
typedef int (*getpeername_fn)(int, __SOCKADDR_ARG, socklen_t *restrict);

/* The next definition of name (libc's, or a sanitizer's interceptor). */
static void *next_fn(_Atomic(void *) *cache, const char *name) {
  void *f = atomic_load_explicit(cache, memory_order_acquire);
  if (f == NULL && (f = dlsym(RTLD_NEXT, name)) != NULL) atomic_store_explicit(cache, f, memory_order_release);
  return f;
}

int getsockopt(int fd, int level, int name, void *restrict val, socklen_t *restrict len) {
  static _Atomic(void *) real;
  getsockopt_fn f = (getsockopt_fn)next_fn(&real, "getsockopt");
  if (f == NULL) {
    errno = ENOSYS;
    return -1;
  }
  if (capturing) captured = fd;
  return f(fd, level, name, val, len);
}

int getpeername(int fd, __SOCKADDR_ARG addr, socklen_t *restrict len) {
  static _Atomic(void *) real;
  getpeername_fn f = (getpeername_fn)next_fn(&real, "getpeername");
  if (f == NULL) {
    errno = ENOSYS;
    return -1;
  }
  if (capturing) captured = fd;
  return f(fd, addr, len);
}

int da_nng_pipe_fd(uint32_t pipe) {
  nng_pipe p = NNG_PIPE_INITIALIZER;
  p.id = pipe;
  uint64_t pid;
  nng_sockaddr sa;
  capturing = 1;
  captured = -1;
  int ok = nng_pipe_get_uint64(p, NNG_OPT_IPC_PEER_PID, &pid) == 0 && captured >= 0; /* ipc: SO_PEERCRED */
  if (!ok) {
    captured = -1;
    ok = nng_pipe_get_addr(p, NNG_OPT_REMADDR, &sa) == 0 && captured >= 0; /* tcp, tls: getpeername */
  }
  capturing = 0;
  return ok ? captured : -1;
}
