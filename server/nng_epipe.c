/*
 * nng_epipe.c — linked into detattnd only: its sendmsg interposes libnng's.
 *
 * libnng 1.5.2 (Debian 12) maps EPIPE to NNG_ECLOSED. When a client connects and hangs up
 * before the daemon has written its half of the SP handshake, the ipc transport hands that
 * NNG_ECLOSED to the listener, which reads it as "the listener was closed" and never accepts
 * again: one hung-up handshake and no new client is ever served (fixed upstream in 1.6.0,
 * which reports such a failure as NNG_ECONNSHUT). A peer that has gone is a connection
 * reset, so this reports EPIPE from sendmsg as ECONNRESET, which the listener treats as a
 * remote condition and keeps accepting. Every other outcome passes through unchanged; the
 * daemon's own code never calls sendmsg. The transport's listener check (transport.c) is
 * the second line of defence.
 */
#include <stddef.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdatomic.h>
#include <sys/socket.h>

typedef ssize_t (*sendmsg_fn)(int, const struct msghdr *, int);

ssize_t sendmsg(int fd, const struct msghdr *msg, int flags) {
  static _Atomic(sendmsg_fn) real;
  sendmsg_fn f = atomic_load_explicit(&real, memory_order_acquire);
  if (f == NULL) {
    f = (sendmsg_fn)dlsym(RTLD_NEXT, "sendmsg");
    if (f == NULL) {
      errno = ENOSYS;
      return -1;
    }
    atomic_store_explicit(&real, f, memory_order_release);
  }
  ssize_t n = f(fd, msg, flags);
  if (n < 0 && errno == EPIPE) errno = ECONNRESET;
  return n;
}
