/*
 * test_nng_fd.c — server/nng_fd.c: da_nng_pipe_fd finds the socket behind an nng pipe (ipc
 * and tcp), and ending that socket's reading half makes libnng remove the pipe, which is how
 * detattnd drops a connection (transport.c). Real nng sockets on a temporary ipc path and on
 * loopback tcp; nothing else.
 */
#include <check.h>
#include <netinet/in.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <nng/protocol/reqrep0/req.h>

#include "testutil.h"
#include "transport.h"

static atomic_uint added, removed; /* the server's pipe: its id once added, then removed */

static void on_pipe(nng_pipe p, nng_pipe_ev ev, void *arg) {
  (void)arg;
  if (ev == NNG_PIPE_EV_ADD_POST) atomic_store(&added, (unsigned)nng_pipe_id(p));
  else if (ev == NNG_PIPE_EV_REM_POST) atomic_store(&removed, (unsigned)nng_pipe_id(p));
}

/* Waits up to ms for *v to become non-zero. */
static unsigned wait_for(atomic_uint *v, int ms) {
  for (int i = 0; i < ms && atomic_load(v) == 0; i++) da_test_sleep_ms(1);
  return atomic_load(v);
}

/* Listens on url (rep0), dials it (req0), checks the fd of the server's pipe with check(),
 * then drops the pipe by shutdown(SHUT_RD) and expects libnng to remove it. */
static void run(const char *url, void (*check)(int fd, nng_listener l)) {
  nng_socket srv, cli;
  nng_listener l;
  atomic_store(&added, 0);
  atomic_store(&removed, 0);
  ck_assert_int_eq(nng_rep0_open(&srv), 0);
  ck_assert_int_eq(nng_pipe_notify(srv, NNG_PIPE_EV_ADD_POST, on_pipe, NULL), 0);
  ck_assert_int_eq(nng_pipe_notify(srv, NNG_PIPE_EV_REM_POST, on_pipe, NULL), 0);
  ck_assert_int_eq(nng_listen(srv, url, &l, 0), 0);
  char dial_url[256];
  snprintf(dial_url, sizeof dial_url, "%s", url);
  if (strncmp(url, "tcp://", 6) == 0) {
    int port = 0;
    ck_assert_int_eq(nng_listener_get_int(l, NNG_OPT_TCP_BOUND_PORT, &port), 0);
    snprintf(dial_url, sizeof dial_url, "tcp://127.0.0.1:%d", port);
  }
  ck_assert_int_eq(nng_req0_open(&cli), 0);
  ck_assert_int_eq(nng_dial(cli, dial_url, NULL, 0), 0);
  const unsigned id = wait_for(&added, 5000);
  ck_assert_msg(id != 0, "the server never saw the connection");

  const int fd = da_nng_pipe_fd(id);
  ck_assert_msg(fd >= 0, "no descriptor for pipe %u", id);
  struct stat st;
  ck_assert_int_eq(fstat(fd, &st), 0);
  ck_assert_msg(S_ISSOCK(st.st_mode), "descriptor %d is not a socket", fd);
  check(fd, l);
  ck_assert_int_eq(da_nng_pipe_fd(0x7fffffffu), -1); /* no such pipe */

  /* The drop: libnng's read sees end of file and removes the pipe itself. */
  ck_assert_uint_eq(atomic_load(&removed), 0);
  ck_assert_int_eq(shutdown(fd, SHUT_RD), 0);
  ck_assert_msg(wait_for(&removed, 5000) == id, "libnng did not remove the pipe after shutdown(SHUT_RD)");
  nng_close(cli);
  nng_close(srv);
}

static void check_ipc(int fd, nng_listener l) {
  (void)l;
  struct ucred cr;
  socklen_t len = sizeof cr;
  ck_assert_int_eq(getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len), 0);
  ck_assert_int_eq(cr.pid, getpid()); /* the dialer is this process */
}

static void check_tcp(int fd, nng_listener l) {
  int port = 0;
  ck_assert_int_eq(nng_listener_get_int(l, NNG_OPT_TCP_BOUND_PORT, &port), 0);
  struct sockaddr_in sa;
  socklen_t len = sizeof sa;
  ck_assert_int_eq(getsockname(fd, (struct sockaddr *)&sa, &len), 0);
  ck_assert_int_eq(sa.sin_family, AF_INET);
  ck_assert_int_eq(ntohs(sa.sin_port), port); /* the accepted side of the listener's port */
}

START_TEST(ipc_pipe_fd_and_drop) {
  char dir[] = "/tmp/detattn-nngfd-XXXXXX", url[128];
  ck_assert_ptr_nonnull(mkdtemp(dir));
  snprintf(url, sizeof url, "ipc://%s/s.sock", dir);
  run(url, check_ipc);
  char path[96];
  snprintf(path, sizeof path, "%s/s.sock", dir);
  unlink(path);
  rmdir(dir);
}
END_TEST

START_TEST(tcp_pipe_fd_and_drop) { run("tcp://127.0.0.1:0", check_tcp); }
END_TEST

int main(void) {
  Suite *s = suite_create("nng_fd");
  TCase *tc = tcase_create("nng_fd");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, ipc_pipe_fd_and_drop);
  tcase_add_test(tc, tcp_pipe_fd_and_drop);
  suite_add_tcase(s, tc);
  return da_test_run(s);
}
