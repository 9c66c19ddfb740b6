/*
 * test_abuse.c — the daemon and the client library under abuse (issue 12): each tcase is
 * one defect found by an abuse campaign and its own ctest (CK_RUN_CASE), against the real
 * detattnd (CPU backend, small model) on an ipc:// socket in a temporary directory.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "da.h"
#include "daemon_proc.h"
#include "detattn.h"
#include "testutil.h"
#include "detattn.pb-c.h"

#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>

static da_daemon_proc D;
static uint64_t seed;

#define MODEL_ARGS(hd)                                                                                      \
  "--layers", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", hd, "--dtype", "bf16", "--page-tokens", \
      "16", "--kv-tokens", "65536", "--split-tokens", "64", "--tile-tokens", "16", "--threads", "1"

static void start_daemon(const char *const *args) {
  seed = da_test_seed(0xab05e5ull);
  if (da_daemon_start(&D, DETATTND_PATH, args) != 0) ck_abort_msg("detattnd did not start");
}

static void teardown(void) {
  da_daemon_stop(&D);
  nng_fini();
}

static detattn_client *connect_ok(const char *url) {
  detattn_client *c;
  ck_assert_int_eq(detattn_connect(&c, url), DETATTN_OK);
  detattn_set_timeout(c, 20000);
  return c;
}

/* ---- defect 3: a daemon restarted with another model on the same URL ---- */

static void setup_restart(void) {
  static const char *const args[] = {MODEL_ARGS("64"), NULL};
  start_daemon(args);
}

START_TEST(client_refuses_a_restarted_daemon_with_another_model) {
  enum { N = 4, GUARD = 4096 };
  detattn_client *c = connect_ok(D.url);
  detattn_server_info info;
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_OK);
  ck_assert_uint_eq(info.model.head_dim, 64);
  size_t qn = (size_t)N * info.model.n_q_heads * 64, kvn = (size_t)N * info.model.n_kv_heads * 64;
  /* Buffers sized for head_dim 64 with guard bytes after o. */
  uint16_t *q = malloc(qn * 2), *k = malloc(kvn * 2), *v = malloc(kvn * 2);
  uint8_t *o = malloc(qn * 2 + GUARD);
  da_rng r;
  da_rng_seed(&r, seed);
  da_rng_fill(&r, DA_BF16, q, qn, 1.0);
  da_rng_fill(&r, DA_BF16, k, kvn, 1.0);
  da_rng_fill(&r, DA_BF16, v, kvn, 1.0);
  memset(o, 0xa5, qn * 2 + GUARD);
  uint64_t seq;
  ck_assert_int_eq(detattn_seq_open(c, &seq), DETATTN_OK);
  detattn_seq_io io = {.seq = seq, .pos = 0, .n_tokens = N, .q = q, .k = k, .v = v, .o = o};
  ck_assert_int_eq(detattn_forward(c, 0, &io, 1), DETATTN_OK);

  static const char *const args128[] = {MODEL_ARGS("128"), NULL};
  ck_assert_int_eq(da_daemon_restart(&D, DETATTND_PATH, args128), 0);
  memset(o, 0xa5, qn * 2 + GUARD);
  /* The connection comes back to a daemon with head_dim 128: every call that would size a
   * tensor from it fails, and nothing past o is written. */
  int st = DETATTN_UNAVAILABLE;
  for (int i = 0; i < 200 && st == DETATTN_UNAVAILABLE; i++) {
    uint64_t s2;
    st = detattn_seq_open(c, &s2);
    if (st == DETATTN_OK) {
      io.seq = s2;
      st = detattn_forward(c, 0, &io, 1);
    }
    if (st == DETATTN_UNAVAILABLE) da_test_sleep_ms(20);
  }
  ck_assert_msg(st == DETATTN_FAILED_PRECONDITION, "forward after the restart: %s: %s", detattn_status_name(st),
                detattn_errmsg());
  ck_assert_msg(strstr(detattn_errmsg(), "head_dim") != NULL, "message does not name head_dim: %s", detattn_errmsg());
  for (size_t i = 0; i < qn * 2 + GUARD; i++) ck_assert_msg(o[i] == 0xa5, "byte %zu of o written", i);
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_FAILED_PRECONDITION);

  /* A new client talks to the new daemon. */
  detattn_client *c2 = connect_ok(D.url);
  ck_assert_int_eq(detattn_hello(c2, &info), DETATTN_OK);
  ck_assert_uint_eq(info.model.head_dim, 128);
  detattn_close(c2);
  detattn_close(c);
  free(q);
  free(k);
  free(v);
  free(o);
}
END_TEST


/* ---- a raw SP client over the ipc socket: what a hostile peer does with the bytes ----
 * nng's ipc wire: an 8-byte handshake {0,'S','P',0, proto hi, proto lo, 0, 0} each way,
 * then messages as {0x01, u64 big-endian length, payload}; a req0 payload starts with the
 * 4-byte request id (high bit set). */

static int raw_connect(const char *url) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%.100s", url + 6);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    close(fd);
    return -1;
  }
  const uint8_t hs[8] = {0, 'S', 'P', 0, 0, 0x30, 0, 0}; /* req0 = 48 */
  if (write(fd, hs, 8) != 8) {
    close(fd);
    return -1;
  }
  return fd;
}

/* Writes all of buf or fails (a bounded poll on a blocked socket: -1 after timeout_ms). */
static int write_all(int fd, const void *buf, size_t len, int timeout_ms) {
  const uint8_t *p = buf;
  uint64_t deadline = da_now_ns() + (uint64_t)timeout_ms * 1000000u;
  while (len) {
    struct pollfd pf = {.fd = fd, .events = POLLOUT};
    int left = (int)((deadline - da_now_ns()) / 1000000u);
    if (da_now_ns() >= deadline || poll(&pf, 1, left > 0 ? left : 1) <= 0) return -1;
    ssize_t n = send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

static int read_all(int fd, void *buf, size_t len, int timeout_ms) {
  uint8_t *p = buf;
  uint64_t deadline = da_now_ns() + (uint64_t)timeout_ms * 1000000u;
  while (len) {
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    int left = (int)((deadline - da_now_ns()) / 1000000u);
    if (da_now_ns() >= deadline || poll(&pf, 1, left > 0 ? left : 1) <= 0) return -1;
    ssize_t n = recv(fd, p, len, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

/* Sends one request (header of length `declared`, then `send` bytes of rq's packing padded
 * with zeros). Returns 0 when written. */
static int raw_send_req(int fd, uint32_t id, const Detattn__V1__Request *rq, uint64_t declared, size_t send,
                        int timeout_ms) {
  size_t body = rq ? detattn__v1__request__get_packed_size(rq) : 0;
  if (declared == 0) declared = 4 + body;
  if (send == 0) send = (size_t)declared;
  uint8_t *buf = calloc(1, 9 + send);
  buf[0] = 1;
  for (int i = 0; i < 8; i++) buf[1 + i] = (uint8_t)(declared >> (56 - 8 * i));
  uint32_t rid = id | 0x80000000u;
  buf[9] = (uint8_t)(rid >> 24);
  buf[10] = (uint8_t)(rid >> 16);
  buf[11] = (uint8_t)(rid >> 8);
  buf[12] = (uint8_t)rid;
  if (rq && send >= 4 + body) detattn__v1__request__pack(rq, buf + 13);
  int rv = write_all(fd, buf, 9 + send, timeout_ms);
  free(buf);
  return rv;
}

/* Reads the handshake once, then one reply; returns it decoded or NULL. */
static Detattn__V1__Response *raw_recv(int fd, int *handshaken, int timeout_ms) {
  uint8_t hs[8], h[9];
  if (!*handshaken) {
    if (read_all(fd, hs, 8, timeout_ms) != 0) return NULL;
    *handshaken = 1;
  }
  if (read_all(fd, h, 9, timeout_ms) != 0) return NULL;
  uint64_t len = 0;
  for (int i = 0; i < 8; i++) len = (len << 8) | h[1 + i];
  if (len < 4 || len > (64u << 20)) return NULL;
  uint8_t *b = malloc(len);
  if (read_all(fd, b, len, timeout_ms) != 0) {
    free(b);
    return NULL;
  }
  Detattn__V1__Response *r = detattn__v1__response__unpack(NULL, len - 4, b + 4);
  free(b);
  return r;
}

/* A raw client opens a sequence (reading the reply). 0 on failure. */
static uint64_t raw_seq_open(int fd, int *handshaken, uint32_t id) {
  Detattn__V1__Request rq = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__SeqOpen o = DETATTN__V1__SEQ_OPEN__INIT;
  rq.id = id;
  rq.op_case = DETATTN__V1__REQUEST__OP_SEQ_OPEN;
  rq.seq_open = &o;
  if (raw_send_req(fd, id, &rq, 0, 0, 5000) != 0) return 0;
  Detattn__V1__Response *r = raw_recv(fd, handshaken, 5000);
  uint64_t seq = r && r->result_case == DETATTN__V1__RESPONSE__RESULT_SEQ_OPEN ? r->seq_open->seq : 0;
  if (r) detattn__v1__response__free_unpacked(r, NULL);
  return seq;
}

/* 1 when the daemon closed fd (EOF or reset) within timeout_ms, reading and dropping data. */
static int closed_by_peer(int fd, int timeout_ms) {
  uint8_t junk[65536];
  uint64_t deadline = da_now_ns() + (uint64_t)timeout_ms * 1000000u;
  while (da_now_ns() < deadline) {
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    if (poll(&pf, 1, 50) <= 0) continue;
    ssize_t n = recv(fd, junk, sizeof junk, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return 1;
  }
  return 0;
}

static long proc_kb(pid_t pid, const char *field) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  long v = -1;
  if (!f) return -1;
  while (fgets(line, sizeof line, f))
    if (strncmp(line, field, strlen(field)) == 0) v = strtol(line + strlen(field), NULL, 10);
  fclose(f);
  return v;
}

/* A Forward of n random tokens on seq at pos (tensors sized for the test model). */
typedef struct fwd_buf {
  size_t qn, kvn;
  uint16_t *q, *k, *v;
  Detattn__V1__ForwardSeq fs;
  Detattn__V1__ForwardSeq *fsp;
  Detattn__V1__Forward f;
  Detattn__V1__Request rq;
} fwd_buf;

static void fwd_init(fwd_buf *b, int hq, int hkv, int d, int n) {
  da_rng r;
  da_rng_seed(&r, seed);
  b->qn = (size_t)n * hq * d;
  b->kvn = (size_t)n * hkv * d;
  b->q = malloc(b->qn * 2);
  b->k = malloc(b->kvn * 2);
  b->v = malloc(b->kvn * 2);
  da_rng_fill(&r, DA_BF16, b->q, b->qn, 1.0);
  da_rng_fill(&r, DA_BF16, b->k, b->kvn, 1.0);
  da_rng_fill(&r, DA_BF16, b->v, b->kvn, 1.0);
  Detattn__V1__ForwardSeq fs = DETATTN__V1__FORWARD_SEQ__INIT;
  Detattn__V1__Forward f = DETATTN__V1__FORWARD__INIT;
  Detattn__V1__Request rq = DETATTN__V1__REQUEST__INIT;
  b->fs = fs;
  b->f = f;
  b->rq = rq;
  b->fs.n_tokens = (uint32_t)n;
  b->fs.q = (ProtobufCBinaryData){b->qn * 2, (uint8_t *)b->q};
  b->fs.k = (ProtobufCBinaryData){b->kvn * 2, (uint8_t *)b->k};
  b->fs.v = (ProtobufCBinaryData){b->kvn * 2, (uint8_t *)b->v};
  b->fsp = &b->fs;
  b->f.n_seqs = 1;
  b->f.seqs = &b->fsp;
  b->rq.op_case = DETATTN__V1__REQUEST__OP_FORWARD;
  b->rq.forward = &b->f;
}

static void fwd_free(fwd_buf *b) {
  free(b->q);
  free(b->k);
  free(b->v);
}

/* Honest decode steps on their own connection (steps of them, and for at least min_ms):
 * returns the slowest call in ms, or -1 with msg set when a call fails. */
static double honest_run(const char *url, int steps, int min_ms, int timeout_ms, char *msg, size_t len) {
  detattn_client *c;
  detattn_server_info info;
  if (detattn_connect(&c, url) != DETATTN_OK) return -1;
  detattn_set_timeout(c, timeout_ms);
  double worst = 0;
  uint64_t seq = 0;
  /* Getting in may take a reconnect or two (a full daemon refuses connections). */
  int st;
  uint64_t in_by = da_now_ns() + (uint64_t)timeout_ms * 1000000u;
  do {
    st = detattn_hello(c, &info);
    if (st == DETATTN_OK) st = detattn_seq_open(c, &seq);
    if (st == DETATTN_UNAVAILABLE) da_test_sleep_ms(50);
  } while (st == DETATTN_UNAVAILABLE && da_now_ns() < in_by);
  size_t qn = (size_t)info.model.n_q_heads * info.model.head_dim, kvn = (size_t)info.model.n_kv_heads * info.model.head_dim;
  uint16_t q[4096], kv[2048], o[4096];
  da_rng r;
  da_rng_seed(&r, seed + 1);
  da_rng_fill(&r, DA_BF16, q, qn, 1.0);
  da_rng_fill(&r, DA_BF16, kv, kvn, 1.0);
  uint64_t until = da_now_ns() + (uint64_t)min_ms * 1000000u;
  for (int i = 0; st == DETATTN_OK && (i < steps || da_now_ns() < until) && i < 4000; i++) {
    uint64_t t0 = da_now_ns();
    detattn_seq_io io = {.seq = seq, .pos = (uint32_t)i, .n_tokens = 1, .q = q, .k = kv, .v = kv, .o = o};
    st = detattn_forward(c, 0, &io, 1);
    double ms = (double)(da_now_ns() - t0) / 1e6;
    if (ms > worst) worst = ms;
  }
  if (st != DETATTN_OK) {
    snprintf(msg, len, "%s: %s", detattn_status_name(st), detattn_errmsg());
    worst = -1;
  }
  detattn_close(c);
  return worst;
}

/* ---- defect 1: a client that never reads its replies ---- */

static void setup_slow_reader(void) {
  static const char *const args[] = {MODEL_ARGS("64"), "--send-timeout-ms", "1000", "--max-seqs", "512", NULL};
  start_daemon(args);
}

typedef struct attacker {
  const char *url;
  int fd, handshaken, n_sent, ok;
} attacker;

/* Opens 120 sequences, then sends 256-token Forwards on every one on both layers and
 * never reads another byte. */
static void *attack(void *arg) {
  attacker *a = arg;
  enum { SEQS = 120, TOKENS = 256 };
  static uint64_t seqs[SEQS];
  a->fd = raw_connect(a->url);
  if (a->fd < 0) return NULL;
  for (int i = 0; i < SEQS; i++)
    if ((seqs[i] = raw_seq_open(a->fd, &a->handshaken, (uint32_t)i + 1)) == 0) return NULL;
  a->ok = 1;
  fwd_buf b;
  fwd_init(&b, 4, 2, 64, TOKENS);
  for (int layer = 0; layer < 2; layer++)
    for (int i = 0; i < SEQS; i++) {
      b.f.layer = (uint32_t)layer;
      b.fs.seq = seqs[i];
      b.rq.id = (uint64_t)(1000 + layer * SEQS + i);
      if (raw_send_req(a->fd, (uint32_t)b.rq.id, &b.rq, 0, 0, 3000) != 0) goto done;
      a->n_sent++;
    }
done:
  fwd_free(&b);
  return NULL;
}

START_TEST(a_client_that_never_reads_does_not_stall_the_others) {
  attacker a = {.url = D.url, .fd = -1};
  pthread_t thr;
  pthread_create(&thr, NULL, attack, &a);
  da_test_sleep_ms(300);
  char msg[256] = "";
  /* Each honest call must finish well inside the send deadline plus the time to drop the
   * attacker: 6 s with --send-timeout-ms 1000. */
  double worst = honest_run(D.url, 40, 4000, 6000, msg, sizeof msg);
  pthread_join(thr, NULL);
  ck_assert_msg(a.ok, "the attacker could not open its sequences");
  ck_assert_msg(worst >= 0, "an honest call failed next to a client that does not read: %s", msg);
  fprintf(stderr, "slow reader: attacker sent %d forwards; slowest honest call %.1f ms\n", a.n_sent, worst);
  /* The honest calls may all be done before the send deadline passes (over the doorbell
   * 4000 calls take well under a second): the drop comes within the deadline plus a bit. */
  int limited = 0;
  for (int i = 0; i < 80 && !limited; i++) {
    limited = da_daemon_log_has(&D, "was not taken within") || da_daemon_log_has(&D, "--max-reply-bytes") ||
              da_daemon_log_has(&D, "--max-inflight-per-conn");
    if (!limited) da_test_sleep_ms(100);
  }
  ck_assert_msg(limited, "the daemon did not log dropping or limiting the slow reader");
  /* The attacker's connection is gone or going: its sequences are released. */
  ck_assert_msg(closed_by_peer(a.fd, 8000), "the daemon kept the connection of a client that reads nothing");
  close(a.fd);
  /* Departures are still seen after the drop (closing the pipe could hang libnng 1.5.2's
   * reaper, which reports them: server/nng_fd.c): this client's sequence is released too. */
  detattn_client *late = connect_ok(D.url);
  detattn_server_info info;
  uint64_t late_seq;
  ck_assert_int_eq(detattn_hello(late, &info), DETATTN_OK);
  ck_assert_int_eq(detattn_seq_open(late, &late_seq), DETATTN_OK);
  detattn_close(late);
  detattn_client *c = connect_ok(D.url);
  detattn_stats s;
  for (int i = 0; i < 200; i++) {
    ck_assert_int_eq(detattn_stats_get(c, &s), DETATTN_OK);
    if (s.sequences == 0) break;
    da_test_sleep_ms(20);
  }
  if (s.sequences != 0) da_daemon_dump_log(&D);
  ck_assert_uint_eq(s.sequences, 0);
  ck_assert_uint_eq(s.kv_pages_used, 0);
  detattn_close(c);
  /* The listener check saw its own connections through all this (no false alarm). */
  ck_assert_msg(!da_daemon_log_has(&D, "the ipc listener stopped taking new connections"),
                "the listener check mistook its own connection for a client");
}
END_TEST

/* ---- defect 2: SIGTERM under load always ends, within its deadline ---- */

#define TERM_ARGS MODEL_ARGS("64"), "--drain-timeout-ms", "2000"

static void setup_sigterm(void) {
  static const char *const args[] = {TERM_ARGS, NULL};
  start_daemon(args);
}

typedef struct loader {
  const char *url;
  atomic_int *stop;
  int calls;
} loader;

/* A loaded client: 4 sequences, a 128-token forward in flight on each, over and over. */
static void *load_loop(void *arg) {
  loader *l = arg;
  enum { SEQS = 4, N = 128 };
  detattn_client *c;
  detattn_server_info info;
  if (detattn_connect(&c, l->url) != DETATTN_OK) return NULL;
  detattn_set_timeout(c, 8000);
  uint64_t seq[SEQS];
  int st = detattn_hello(c, &info);
  for (int i = 0; i < SEQS && st == DETATTN_OK; i++) st = detattn_seq_open(c, &seq[i]);
  if (st != DETATTN_OK) {
    detattn_close(c);
    return NULL;
  }
  uint16_t *q = malloc((size_t)N * 4 * 64 * 2), *kv = malloc((size_t)N * 2 * 64 * 2);
  uint16_t *o = malloc((size_t)SEQS * N * 4 * 64 * 2);
  for (size_t i = 0; i < (size_t)N * 4 * 64; i++) q[i] = (uint16_t)(0x3c00 + (i * 2654435761u >> 24) % 200);
  for (size_t i = 0; i < (size_t)N * 2 * 64; i++) kv[i] = (uint16_t)(0x3c00 + (i * 40503u >> 8) % 200);
  for (uint32_t pos = 0; !*l->stop && pos + N < 4000; pos += N) {
    detattn_call *calls[SEQS];
    int n = 0;
    for (int i = 0; i < SEQS; i++) {
      detattn_seq_io io = {.seq = seq[i], .pos = pos, .n_tokens = N, .q = q, .k = kv, .v = kv,
                           .o = o + (size_t)i * N * 4 * 64};
      if (detattn_forward_start(c, 0, &io, 1, &calls[n]) == DETATTN_OK) n++;
    }
    int ok = n == SEQS;
    for (int i = 0; i < n; i++) ok &= detattn_call_wait(calls[i]) == DETATTN_OK;
    if (!ok) break;
    l->calls += n;
  }
  free(q);
  free(kv);
  free(o);
  detattn_close(c);
  return NULL;
}

START_TEST(sigterm_under_load_exits_within_its_deadline_every_time) {
  enum { ITER = 12, CLIENTS = 8 };
  static const char *const args[] = {TERM_ARGS, NULL};
  double worst = 0;
  int clean = 0;
  for (int it = 0; it < ITER; it++) {
    if (it > 0) ck_assert_msg(da_daemon_restart(&D, DETATTND_PATH, args) == 0, "iteration %d: no restart on the same path", it);
    atomic_int stop = 0;
    pthread_t thr[CLIENTS];
    loader ls[CLIENTS];
    for (int i = 0; i < CLIENTS; i++) {
      ls[i] = (loader){.url = D.url, .stop = &stop};
      pthread_create(&thr[i], NULL, load_loop, &ls[i]);
    }
    da_test_sleep_ms(300);
    uint64_t t0 = da_now_ns();
    ck_assert_int_eq(kill(D.pid, SIGTERM), 0);
    int exited = da_daemon_wait(&D, 2000 + 2000 + 1500) == 0;
    double ms = (double)(da_now_ns() - t0) / 1e6;
    stop = 1;
    for (int i = 0; i < CLIENTS; i++) pthread_join(thr[i], NULL);
    if (!exited) da_daemon_dump_log(&D);
    ck_assert_msg(exited, "iteration %d: detattnd still running %.0f ms after SIGTERM", it, ms);
    ck_assert_msg(WIFEXITED(D.exit_status) && (WEXITSTATUS(D.exit_status) == 0 || WEXITSTATUS(D.exit_status) == 4),
                  "iteration %d: exit status 0x%x", it, D.exit_status);
    clean += WEXITSTATUS(D.exit_status) == 0;
    if (ms > worst) worst = ms;
  }
  fprintf(stderr, "sigterm loop: %d shutdowns, %d drained cleanly, slowest %.0f ms\n", ITER, clean, worst);
}
END_TEST

/* ---- defect 4: partial messages and decode budgets do not pin memory ---- */

static void setup_memory(void) {
  static const char *const args[] = {MODEL_ARGS("64"), "--idle-timeout-ms", "1000", NULL};
  start_daemon(args);
}

START_TEST(partial_messages_are_dropped_and_their_memory_returned) {
  enum { CONNS = 16 };
  int fds[CONNS];
  long base = proc_kb(D.pid, "VmRSS:");
  for (int i = 0; i < CONNS; i++) {
    fds[i] = raw_connect(D.url);
    ck_assert_int_ge(fds[i], 0);
    /* Declares a 60 MiB message (under --max-message-bytes 64 MiB) and sends 16 MiB of it. */
    ck_assert_int_eq(raw_send_req(fds[i], 1, NULL, 60u << 20, 16u << 20, 10000), 0);
  }
  long peak = proc_kb(D.pid, "VmRSS:");
  int dropped = 0;
  for (int i = 0; i < CONNS; i++) dropped += closed_by_peer(fds[i], 6000);
  for (int i = 0; i < CONNS; i++) close(fds[i]);
  da_test_sleep_ms(200);
  long after = proc_kb(D.pid, "VmRSS:");
  fprintf(stderr, "partial messages: RSS %ld kB before, %ld kB with %d x 16 MiB pending, %ld kB after; %d dropped\n",
          base, peak, CONNS, after, dropped);
  ck_assert_msg(dropped == CONNS, "only %d of %d stalled partial senders were dropped", dropped, CONNS);
#ifndef __SANITIZE_ADDRESS__ /* ASan keeps freed memory in its quarantine */
  ck_assert_msg(after < base + 64 * 1024, "RSS stayed at %ld kB (was %ld kB)", after, base);
#endif
}
END_TEST

START_TEST(a_forward_of_a_million_empty_sequences_is_refused_cheaply) {
  int hs = 0, fd = raw_connect(D.url);
  ck_assert_int_ge(fd, 0);
  /* Forward { seqs: 1,000,000 x empty } is 2 bytes a sequence on the wire. */
  enum { N = 1000000 };
  uint8_t *b = calloc(1, 32 + (size_t)N * 2);
  size_t inner = (size_t)N * 2, o = 13;
  b[9] = 0x80, b[12] = 7;
  b[o++] = 0x3a; /* Request.forward = 7, length-delimited */
  for (size_t v = inner; ; v >>= 7) {
    b[o++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
    if (v <= 0x7f) break;
  }
  for (int i = 0; i < N; i++) {
    b[o++] = 0x12; /* Forward.seqs = 2 */
    b[o++] = 0;
  }
  b[0] = 1;
  for (int i = 0; i < 8; i++) b[1 + i] = (uint8_t)((uint64_t)(o - 9) >> (56 - 8 * i));
  long hwm0 = proc_kb(D.pid, "VmHWM:");
  ck_assert_int_eq(write_all(fd, b, o, 10000), 0);
  Detattn__V1__Response *r = raw_recv(fd, &hs, 10000);
  long hwm1 = proc_kb(D.pid, "VmHWM:");
  ck_assert_msg(r != NULL, "no reply to the million-sequence forward");
  ck_assert_int_eq(r->status ? (int)r->status->code : 0, DETATTN_RESOURCE_EXHAUSTED);
  fprintf(stderr, "million empty sequences: %s; peak RSS grew %ld kB\n", r->status->message, hwm1 - hwm0);
  ck_assert_msg(hwm1 - hwm0 < 40 * 1024, "decoding a 2 MB message raised peak RSS by %ld kB", hwm1 - hwm0);
  detattn__v1__response__free_unpacked(r, NULL);
  free(b);
  close(fd);
}
END_TEST

/* ---- defect 5: file descriptors ---- */

static char wrapper[64];

static void setup_fds(void) {
  static const char *const args[] = {MODEL_ARGS("64"), "--max-connections", "1000", "--max-conn-per-peer", "1000",
                                     "--idle-timeout-ms", "1500", NULL};
  /* The daemon runs under an open-file limit of 256 (soft and hard) set by a wrapper. */
  snprintf(wrapper, sizeof wrapper, "/tmp/detattn-ulimit-%d.sh", (int)getpid());
  FILE *f = fopen(wrapper, "w");
  ck_assert_ptr_nonnull(f);
  fprintf(f, "#!/bin/sh\nulimit -n 256 || exit 99\nexec %s \"$@\"\n", DETATTND_PATH);
  fclose(f);
  chmod(wrapper, 0700);
  seed = da_test_seed(0xab05e5ull);
  int rv = da_daemon_start(&D, wrapper, args);
  unlink(wrapper);
  if (rv != 0) ck_abort_msg("detattnd did not start");
}

START_TEST(idle_connections_cannot_lock_out_honest_clients) {
  enum { IDLE = 250 };
  static int fds[IDLE];
  ck_assert_msg(da_daemon_log_has(&D, "serving at most 192 connections"),
                "the daemon did not lower --max-connections to its open-file limit");
  for (int i = 0; i < IDLE; i++) fds[i] = raw_connect(D.url);
  for (int i = 0; i < 250 && !da_daemon_log_has(&D, "refused a connection"); i++) da_test_sleep_ms(20);

  ck_assert_msg(da_daemon_log_has(&D, "refused a connection"), "refusals past the cap were not logged");
  char msg[256] = "";
  double worst = honest_run(D.url, 3, 0, 8000, msg, sizeof msg);
  ck_assert_msg(worst >= 0, "an honest client could not get in next to %d idle connections: %s", IDLE, msg);
  int closed = 0;
  for (int i = 0; i < IDLE; i++)
    if (fds[i] >= 0) {
      closed += closed_by_peer(fds[i], 10);
      close(fds[i]);
    }
  fprintf(stderr, "fds: honest client in after %.0f ms at most; %d idle connections closed by the daemon\n", worst,
          closed);
}
END_TEST

/* ---- defect 6: the ipc path and who may connect ---- */

static void setup_none(void) { seed = da_test_seed(0xab05e5ull); }

static int start_at(da_daemon_proc *d, const char *dir, const char *const *extra) {
  /* da_daemon_start makes its own directory; reuse its machinery with --listen overriding. */
  static char listen[100];
  snprintf(listen, sizeof listen, "ipc://%.80s/d.sock", dir);
  const char *args[32] = {MODEL_ARGS("64"), "--listen", listen};
  int n = 0;
  while (args[n]) n++;
  for (int i = 0; extra && extra[i]; i++) args[n++] = extra[i];
  args[n] = NULL;
  int rv = da_daemon_start(d, DETATTND_PATH, args);
  snprintf(d->url, sizeof d->url, "%s", listen);
  return rv;
}

START_TEST(the_ipc_path_cannot_be_squatted_and_peers_are_checked) {
  if (geteuid() != 0) {
    fprintf(stderr, "ipc_path: not root; skipped\n");
    return;
  }
  char dir[64] = "/tmp/detattn-squat-XXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(dir));
  ck_assert_int_eq(chmod(dir, 0755), 0); /* uid 65534 must reach the sockets below */
  char sub[128], target[160], lock[160];
  /* A directory that belongs to somebody else is refused. */
  snprintf(sub, sizeof sub, "%s/owned-by-nobody", dir);
  ck_assert_int_eq(mkdir(sub, 0777), 0);
  ck_assert_int_eq(chown(sub, 65534, 65534), 0);
  ck_assert_int_ne(start_at(&D, sub, NULL), 0);
  ck_assert_msg(da_daemon_log_has(&D, "belongs to uid 65534"), "no reason given for refusing the squatted directory");
  da_daemon_stop(&D);
  /* A lock file that is a symbolic link is refused and its target is not created. */
  snprintf(sub, sizeof sub, "%s/linked", dir);
  ck_assert_int_eq(mkdir(sub, 0700), 0);
  snprintf(target, sizeof target, "%s/created-through-the-link", dir);
  snprintf(lock, sizeof lock, "%s/d.sock.lock", sub);
  ck_assert_int_eq(symlink(target, lock), 0);
  ck_assert_int_ne(start_at(&D, sub, NULL), 0);
  ck_assert_msg(da_daemon_log_has(&D, "symbolic link"), "no reason given for refusing the linked lock file");
  ck_assert_int_ne(access(target, F_OK), 0);
  da_daemon_stop(&D);
  unlink(lock);
  /* The socket's mode is set explicitly, whatever the umask. */
  mode_t old = umask(0);
  snprintf(sub, sizeof sub, "%s/mode", dir);
  ck_assert_int_eq(mkdir(sub, 0755), 0);
  int rv = start_at(&D, sub, NULL);
  umask(old);
  ck_assert_int_eq(rv, 0);
  struct stat st;
  char sock[160];
  snprintf(sock, sizeof sock, "%s/d.sock", sub);
  ck_assert_int_eq(stat(sock, &st), 0);
  ck_assert_msg((st.st_mode & 0777) == 0660, "socket mode %04o under umask 000", (unsigned)(st.st_mode & 0777));
  da_daemon_stop(&D);
  /* A peer of another user is refused before any request is read, unless allowed. */
  for (int allow = 0; allow < 2; allow++) {
    const char *const extra[] = {"--ipc-mode", "0666", allow ? "--allow-uids" : NULL, "65534", NULL};
    snprintf(sub, sizeof sub, "%s/peer%d", dir, allow);
    ck_assert_int_eq(mkdir(sub, 0755), 0);
    ck_assert_int_eq(start_at(&D, sub, extra), 0);
    pid_t pid = fork();
    if (pid == 0) {
      if (setgid(65534) != 0 || setuid(65534) != 0) _exit(20);
      detattn_client *c;
      detattn_server_info info;
      if (detattn_connect(&c, D.url) != DETATTN_OK) _exit(21);
      detattn_set_timeout(c, 1500);
      _exit(detattn_hello(c, &info) == DETATTN_OK ? 0 : 1);
    }
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == (allow ? 0 : 1),
                  "uid 65534 %s: child status 0x%x", allow ? "allowed" : "not allowed", status);
    if (!allow) ck_assert_msg(da_daemon_log_has(&D, "uid 65534 gid 65534 is not allowed"), "the refusal was not logged");
    da_daemon_stop(&D);
  }
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  ck_assert_int_eq(system(cmd), 0);
}
END_TEST

/* ---- defect 8: Stats is cheap and shows a client only its own numbers ---- */

static void setup_stats(void) {
  static const char *const args[] = {MODEL_ARGS("64"), "--ipc-mode", "0666", "--allow-uids", "65534",
                                     "--max-conn-per-peer", "1000", NULL};
  start_daemon(args);
  chmod(D.dir, 0755);
}

static void *stats_flood(void *arg) {
  atomic_int *stop = arg;
  detattn_client *c;
  detattn_stats s;
  if (detattn_connect(&c, D.url) != DETATTN_OK) return NULL;
  while (!*stop) detattn_stats_get(c, &s);
  detattn_close(c);
  return NULL;
}

/* p99 of n single-token forwards, in ms. */
static double victim_p99(int n) {
  detattn_client *c = connect_ok(D.url);
  detattn_server_info info;
  uint64_t seq;
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_OK);
  ck_assert_int_eq(detattn_seq_open(c, &seq), DETATTN_OK);
  uint16_t q[256], kv[128], o[256];
  for (int i = 0; i < 256; i++) q[i] = (uint16_t)(0x3c00 + i);
  for (int i = 0; i < 128; i++) kv[i] = (uint16_t)(0x3800 + i);
  double *t = malloc(sizeof(double) * (size_t)n);
  for (int i = 0; i < n; i++) {
    uint64_t t0 = da_now_ns();
    detattn_seq_io io = {.seq = seq, .pos = (uint32_t)i, .n_tokens = 1, .q = q, .k = kv, .v = kv, .o = o};
    ck_assert_int_eq(detattn_forward(c, 0, &io, 1), DETATTN_OK);
    t[i] = (double)(da_now_ns() - t0) / 1e6;
  }
  for (int i = 1; i < n; i++)
    for (int j = i; j > 0 && t[j - 1] > t[j]; j--) {
      double x = t[j];
      t[j] = t[j - 1];
      t[j - 1] = x;
    }
  double p = t[(n * 99) / 100];
  free(t);
  ck_assert_int_eq(detattn_seq_close(c, seq), DETATTN_OK);
  detattn_close(c);
  return p;
}

START_TEST(a_stats_flood_does_not_slow_a_victim) {
  /* Fill the statistics so a sorting implementation would have full rings to sort. */
  victim_p99(400);
  double alone = victim_p99(400);
  atomic_int stop = 0;
  pthread_t thr[4];
  for (int i = 0; i < 4; i++) pthread_create(&thr[i], NULL, stats_flood, (void *)&stop);
  /* The better of two runs: a sorting Stats costs every run (38 ms p99 on 1f7c08f), while a
   * scheduling hiccup on 2 busy cores (ASan: once 7.5 ms) hits one run. */
  double flooded = victim_p99(400), again = victim_p99(400);
  if (again < flooded) flooded = again;
  stop = 1;
  for (int i = 0; i < 4; i++) pthread_join(thr[i], NULL);
  fprintf(stderr, "stats flood: victim p99 %.2f ms alone, %.2f ms next to 4 Stats loops\n", alone, flooded);
  ck_assert_msg(flooded < 10 * alone + 10.0, "victim p99 %.2f ms under a Stats flood, %.2f ms alone", flooded, alone);
}
END_TEST

START_TEST(stats_shows_a_client_only_its_own_sequences) {
  if (geteuid() != 0) {
    fprintf(stderr, "stats view: not root; skipped\n");
    return;
  }
  /* The child forks before this process starts nng; it waits for the go byte. */
  int up[2], down[2];
  ck_assert_int_eq(pipe(up), 0);
  ck_assert_int_eq(pipe(down), 0);
  pid_t pid = fork();
  if (pid == 0) {
    close(up[0]);
    close(down[1]);
    char go;
    if (read(down[0], &go, 1) != 1) _exit(19);
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(20);
    detattn_client *n;
    detattn_stats s;
    uint64_t mine;
    if (detattn_connect(&n, D.url) != DETATTN_OK) _exit(21);
    detattn_set_timeout(n, 5000);
    if (detattn_seq_open(n, &mine) != DETATTN_OK || detattn_stats_get(n, &s) != DETATTN_OK) _exit(22);
    uint32_t v[2] = {s.sequences, s.clients};
    _exit(write(up[1], v, sizeof v) == sizeof v ? 0 : 23);
  }
  close(up[1]);
  close(down[0]);
  detattn_client *c = connect_ok(D.url);
  uint64_t seqs[3];
  for (int i = 0; i < 3; i++) ck_assert_int_eq(detattn_seq_open(c, &seqs[i]), DETATTN_OK);
  ck_assert_int_eq(write(down[1], "g", 1), 1);
  uint32_t v[2] = {0, 0};
  int status;
  ck_assert_int_eq(waitpid(pid, &status, 0), pid);
  ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "unprivileged child status 0x%x", status);
  ck_assert_int_eq(read(up[0], v, sizeof v), (ssize_t)sizeof v);
  close(up[0]);
  close(down[1]);
  ck_assert_msg(v[0] == 1 && v[1] == 1, "uid 65534 saw %u sequences and %u clients (its own: 1 and 1)", v[0], v[1]);
  detattn_stats s;
  ck_assert_int_eq(detattn_stats_get(c, &s), DETATTN_OK);
  ck_assert_uint_ge(s.sequences, 3); /* root sees everyone's */
  detattn_close(c);
}
END_TEST

/* ---- defect 9: smaller ones ---- */

static char tls_dir[64];

static void setup_tcp(void) {
  snprintf(tls_dir, sizeof tls_dir, "/tmp/detattn-tls-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(tls_dir));
  if (da_make_test_certs(tls_dir) != 0) ck_abort_msg("openssl could not make test certificates");
  static char cert[128], key[128];
  snprintf(cert, sizeof cert, "%s/server.pem", tls_dir);
  snprintf(key, sizeof key, "%s/server.key", tls_dir);
  static const char *args[] = {MODEL_ARGS("64"), "--listen", "tls+tcp://127.0.0.1:0", "--tls-cert", cert,
                               "--tls-key", key, NULL};
  start_daemon(args);
}

START_TEST(the_log_names_the_bound_tcp_port) {
  FILE *f = fopen(D.log, "r");
  char line[512];
  int port = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "listening on tls+tcp://127.0.0.1:%d", &port) == 1) break;
  fclose(f);
  ck_assert_msg(port > 0, "the daemon says it listens on port %d", port);
  /* The port is the one bound: a TCP connection to it is accepted. */
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                           .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  ck_assert_int_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  close(fd);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", tls_dir);
  ck_assert_int_eq(system(cmd), 0);
}
END_TEST

static void setup_killed(void) {
  static const char *const args[] = {MODEL_ARGS("64"), "--max-conn-per-peer", "1000", NULL};
  start_daemon(args);
}

/* Many clients SIGKILLed with a forward in flight: every page comes back, and the daemon
 * exits 0 with nothing leaked (under ASan/LSan the daemon's own exit fails on a leak). */
START_TEST(many_killed_clients_leave_nothing_behind) {
  enum { KILLS = 120 };
  for (int k = 0; k < KILLS; k++) {
    int fds[2];
    ck_assert_int_eq(pipe(fds), 0);
    pid_t pid = fork();
    if (pid == 0) {
      close(fds[0]);
      detattn_client *c;
      detattn_server_info info;
      uint64_t seq;
      if (detattn_connect(&c, D.url) || detattn_hello(c, &info) || detattn_seq_open(c, &seq)) _exit(10);
      static uint16_t q[200 * 256], kv[200 * 128], o[200 * 256];
      for (size_t i = 0; i < sizeof q / 2; i++) q[i] = (uint16_t)(0x3c00 + i % 97);
      for (size_t i = 0; i < sizeof kv / 2; i++) kv[i] = (uint16_t)(0x3800 + i % 89);
      detattn_seq_io io = {.seq = seq, .pos = 0, .n_tokens = 200, .q = q, .k = kv, .v = kv, .o = o};
      detattn_call *call;
      if (detattn_forward_start(c, 0, &io, 1, &call)) _exit(11);
      if (write(fds[1], "r", 1) != 1) _exit(12);
      for (;;) pause();
    }
    close(fds[1]);
    char b;
    struct pollfd pf = {.fd = fds[0], .events = POLLIN};
    int ready = poll(&pf, 1, 10000) == 1 && read(fds[0], &b, 1) == 1;
    close(fds[0]);
    /* Kill at a different moment each time: before, during or after the batch. */
    if (ready) da_test_sleep_ms(k % 4);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    ck_assert_msg(ready, "client %d did not start its forward", k);
  }
  detattn_client *c = connect_ok(D.url);
  detattn_stats s;
  for (int i = 0; i < 300; i++) {
    ck_assert_int_eq(detattn_stats_get(c, &s), DETATTN_OK);
    if (s.sequences == 0 && s.kv_pages_used == 0) break;
    da_test_sleep_ms(20);
  }
  ck_assert_msg(s.sequences == 0 && s.kv_pages_used == 0, "%u sequences and %u pages left behind", s.sequences,
                s.kv_pages_used);
  detattn_close(c);
  char why[128];
  ck_assert_msg(da_daemon_term_clean(&D, 20000, why, sizeof(why)) == 0, "%s", why);
}
END_TEST


/* ---- defect 7: decode next to a prefill flood ---- */

static void setup_flood(void) {
  static const char *const args[] = {"--layers", "1", "--q-heads", "8", "--kv-heads", "2", "--head-dim", "128",
                                     "--dtype", "bf16", "--kv-tokens", "262144", "--split-tokens", "256",
                                     "--max-seqs", "256", "--max-prefill-tokens", "64", "--threads", "2", NULL};
  start_daemon(args);
}

/* The flood: another process, 4 connections, each with 4 sequences prefilled 2048 tokens at
 * a time, until killed. */
static void flood_main(const char *url) {
  enum { CONNS = 4, SEQS = 4, N = 2048 };
  size_t qn = (size_t)N * 8 * 128, kvn = (size_t)N * 2 * 128;
  uint16_t *q = malloc(qn * 2), *kv = malloc(kvn * 2), *o = malloc(SEQS * qn * 2);
  da_rng r;
  da_rng_seed(&r, 77);
  da_rng_fill(&r, DA_BF16, q, qn, 1.0);
  da_rng_fill(&r, DA_BF16, kv, kvn, 1.0);
  detattn_client *c[CONNS];
  uint64_t seq[CONNS][SEQS];
  uint32_t pos[CONNS][SEQS] = {{0}};
  for (int i = 0; i < CONNS; i++) {
    if (detattn_connect(&c[i], url) != DETATTN_OK) _exit(1);
    detattn_set_timeout(c[i], 120000);
    for (int j = 0; j < SEQS; j++)
      if (detattn_seq_open(c[i], &seq[i][j]) != DETATTN_OK) _exit(2);
  }
  for (;;) {
    detattn_call *calls[CONNS][SEQS];
    for (int i = 0; i < CONNS; i++)
      for (int j = 0; j < SEQS; j++) {
        if (pos[i][j] + N > 60000) {
          detattn_seq_truncate(c[i], seq[i][j], 0);
          pos[i][j] = 0;
        }
        detattn_seq_io io = {.seq = seq[i][j], .pos = pos[i][j], .n_tokens = N, .q = q, .k = kv, .v = kv,
                             .o = o + (size_t)j * qn};
        if (detattn_forward_start(c[i], 0, &io, 1, &calls[i][j]) != DETATTN_OK) _exit(3);
        pos[i][j] += N;
      }
    for (int i = 0; i < CONNS; i++)
      for (int j = 0; j < SEQS; j++) detattn_call_wait(calls[i][j]);
  }
}

START_TEST(decode_is_not_starved_by_a_prefill_flood) {
  pid_t pid = fork();
  if (pid == 0) flood_main(D.url);
  da_test_sleep_ms(1500); /* the flood is queued */
  detattn_client *c = connect_ok(D.url);
  detattn_set_timeout(c, 60000);
  uint64_t seq;
  ck_assert_int_eq(detattn_seq_open(c, &seq), DETATTN_OK);
  enum { PRE = 256, STEPS = 40 };
  size_t qn = 8 * 128, kvn = 2 * 128;
  uint16_t *q = malloc(PRE * qn * 2), *kv = malloc(PRE * kvn * 2), *o = malloc(PRE * qn * 2);
  da_rng r;
  da_rng_seed(&r, seed);
  da_rng_fill(&r, DA_BF16, q, PRE * qn, 1.0);
  da_rng_fill(&r, DA_BF16, kv, PRE * kvn, 1.0);
  detattn_seq_io io = {.seq = seq, .pos = 0, .n_tokens = PRE, .q = q, .k = kv, .v = kv, .o = o};
  ck_assert_int_eq(detattn_forward(c, 0, &io, 1), DETATTN_OK);
  double worst = 0, sum = 0;
  for (int i = 0; i < STEPS; i++) {
    detattn_seq_io d1 = {.seq = seq, .pos = (uint32_t)(PRE + i), .n_tokens = 1, .q = q, .k = kv, .v = kv, .o = o};
    uint64_t t0 = da_now_ns();
    ck_assert_int_eq(detattn_forward(c, 0, &d1, 1), DETATTN_OK);
    double ms = (double)(da_now_ns() - t0) / 1e6;
    sum += ms;
    if (ms > worst) worst = ms;
  }
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  fprintf(stderr, "decode next to a prefill flood: %d steps, mean %.1f ms, worst %.1f ms\n", STEPS, sum / STEPS, worst);
  /* A decode step waits for at most the running batch (64 prefill queries) and its own: a
   * 2048-token prefill batch took ~1 s before the fix. */
  ck_assert_msg(worst < 500, "a decode step waited %.0f ms behind prefill", worst);
  detattn_close(c);
  free(q);
  free(kv);
  free(o);
}
END_TEST


/* ---- issue 13: per-client quotas ---- */

static void setup_quota(void) {
  static const char *const args[] = {"--layers", "1", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64",
                                     "--kv-tokens", "4096", "--split-tokens", "64", "--tile-tokens", "16",
                                     "--client-max-seqs", "12", "--client-max-inflight-tokens", "600", NULL};
  start_daemon(args);
}

START_TEST(one_client_cannot_take_every_page_or_sequence) {
  int up[2], down[2];
  ck_assert_int_eq(pipe(up), 0);
  ck_assert_int_eq(pipe(down), 0);
  pid_t pid = fork();
  if (pid == 0) { /* the hog: another process, so another client */
    close(up[0]);
    close(down[1]);
    detattn_client *c;
    detattn_server_info info;
    if (detattn_connect(&c, D.url) || detattn_hello(c, &info)) _exit(10);
    static uint16_t q[400 * 256], kv[400 * 128], o[400 * 256];
    for (size_t i = 0; i < sizeof q / 2; i++) q[i] = (uint16_t)(0x3c00 + i % 101);
    for (size_t i = 0; i < sizeof kv / 2; i++) kv[i] = (uint16_t)(0x3800 + i % 97);
    int st = DETATTN_OK, opened = 0;
    while (st == DETATTN_OK && opened < 20) {
      uint64_t seq;
      st = detattn_seq_open(c, &seq);
      if (st != DETATTN_OK) break;
      opened++;
      detattn_seq_io io = {.seq = seq, .pos = 0, .n_tokens = 400, .q = q, .k = kv, .v = kv, .o = o};
      st = detattn_forward(c, 0, &io, 1);
    }
    char msg[300];
    snprintf(msg, sizeof msg, "%d %d %s", st, opened, detattn_errmsg());
    if (write(up[1], msg, strlen(msg) + 1) < 0) _exit(11);
    char b;
    if (read(down[0], &b, 1) < 0) _exit(12); /* hold everything until told */
    _exit(0);
  }
  close(up[1]);
  close(down[0]);
  char msg[300] = "";
  ck_assert_int_gt(read(up[0], msg, sizeof msg - 1), 0);
  int st = -1, opened = 0;
  sscanf(msg, "%d %d", &st, &opened);
  fprintf(stderr, "quota: the hog stopped after %d sequences: %s\n", opened, msg);
  ck_assert_msg(st == DETATTN_RESOURCE_EXHAUSTED && strstr(msg, "--client-max-kv-tokens"),
                "the hog was not stopped by its KV quota: %s", msg);
  /* Another client still gets its short prompt in. */
  detattn_client *c = connect_ok(D.url);
  uint64_t seqs[12];
  ck_assert_int_eq(detattn_seq_open(c, &seqs[0]), DETATTN_OK);
  uint16_t q[16 * 256], kv[16 * 128], o[16 * 256];
  for (int i = 0; i < 16 * 256; i++) q[i] = (uint16_t)(0x3c00 + i % 89);
  for (int i = 0; i < 16 * 128; i++) kv[i] = (uint16_t)(0x3800 + i % 83);
  detattn_seq_io io = {.seq = seqs[0], .pos = 0, .n_tokens = 16, .q = q, .k = kv, .v = kv, .o = o};
  int fst = detattn_forward(c, 0, &io, 1);
  ck_assert_msg(fst == DETATTN_OK, "a second client's 16-token prompt: %s: %s", detattn_status_name(fst),
                detattn_errmsg());
  /* Its own sequence quota: 12. */
  for (int i = 1; i < 12; i++) ck_assert_int_eq(detattn_seq_open(c, &seqs[i]), DETATTN_OK);
  uint64_t extra;
  ck_assert_int_eq(detattn_seq_open(c, &extra), DETATTN_RESOURCE_EXHAUSTED);
  ck_assert_msg(strstr(detattn_errmsg(), "--client-max-seqs") != NULL, "%s", detattn_errmsg());
  /* Tokens in flight: 600 at most. */
  static uint16_t bq[700 * 256], bkv[700 * 128], bo[700 * 256];
  detattn_seq_io big = {.seq = seqs[1], .pos = 0, .n_tokens = 700, .q = bq, .k = bkv, .v = bkv, .o = bo};
  ck_assert_int_eq(detattn_forward(c, 0, &big, 1), DETATTN_RESOURCE_EXHAUSTED);
  ck_assert_msg(strstr(detattn_errmsg(), "--client-max-inflight-tokens") != NULL, "%s", detattn_errmsg());
  ck_assert_int_eq(write(down[1], "x", 1), 1);
  waitpid(pid, NULL, 0);
  detattn_close(c);
}
END_TEST


/* ---- a client that hangs up while the connection is being negotiated ---- */

/* libnng 1.5.2 (Debian 12) ends its ipc listener's accept loop for good when the daemon's
 * half of the SP handshake fails with EPIPE, i.e. when a client connects and hangs up before
 * the daemon has written its 8 bytes (fixed upstream in 1.6.0). Connections already open keep
 * working; every new one is accepted by the kernel and then never served. */
START_TEST(a_client_hanging_up_in_the_handshake_does_not_lock_out_new_clients) {
  detattn_client *old = connect_ok(D.url);
  detattn_server_info info;
  ck_assert_int_eq(detattn_hello(old, &info), DETATTN_OK);
  for (int round = 0; round < 2; round++) {
    /* An nng client that dials and closes at once: the daemon's handshake write meets a
     * closed peer. Raw connect-and-close races the daemon's write; this loses it reliably. */
    for (int i = 0; i < 10; i++) {
      nng_socket s;
      ck_assert_int_eq(nng_req0_open(&s), 0);
      ck_assert_int_eq(nng_dial(s, D.url, NULL, NNG_FLAG_NONBLOCK), 0);
      nng_close(s);
    }
    /* A new client is served within the daemon's listener check (about 4 s), every round. */
    uint64_t t0 = da_now_ns();
    int st = DETATTN_UNAVAILABLE;
    while (st != DETATTN_OK && da_now_ns() - t0 < 15000000000ull) {
      detattn_client *c;
      ck_assert_int_eq(detattn_connect(&c, D.url), DETATTN_OK);
      detattn_set_timeout(c, 3000);
      st = detattn_hello(c, &info);
      detattn_close(c);
    }
    ck_assert_msg(st == DETATTN_OK, "round %d: no new client was served for 15 s after handshake hang-ups", round);
    /* The connection opened before keeps working. */
    ck_assert_int_eq(detattn_hello(old, &info), DETATTN_OK);
  }
  detattn_close(old);
}
END_TEST

static Suite *abuse_suite(void) {
  const struct {
    const char *name;
    void (*setup)(void);
    const TTest *test;
    int timeout;
  } cases[] = {
      {"restart_model", setup_restart, client_refuses_a_restarted_daemon_with_another_model, 30},
      {"slow_reader", setup_slow_reader, a_client_that_never_reads_does_not_stall_the_others, 60},
      {"sigterm_loop", setup_sigterm, sigterm_under_load_exits_within_its_deadline_every_time, 120},
      {"partial_messages", setup_memory, partial_messages_are_dropped_and_their_memory_returned, 60},
      {"decode_budget", setup_memory, a_forward_of_a_million_empty_sequences_is_refused_cheaply, 60},
      {"fd_limit", setup_fds, idle_connections_cannot_lock_out_honest_clients, 60},
      {"ipc_path", setup_none, the_ipc_path_cannot_be_squatted_and_peers_are_checked, 60},
      {"stats_flood", setup_stats, a_stats_flood_does_not_slow_a_victim, 60},
      {"stats_view", setup_stats, stats_shows_a_client_only_its_own_sequences, 30},
      {"tcp_port", setup_tcp, the_log_names_the_bound_tcp_port, 30},
      {"killed_clients", setup_killed, many_killed_clients_leave_nothing_behind, 120},
      {"decode_flood", setup_flood, decode_is_not_starved_by_a_prefill_flood, 120},
      {"quotas", setup_quota, one_client_cannot_take_every_page_or_sequence, 60},
      {"handshake_hangup", setup_restart, a_client_hanging_up_in_the_handshake_does_not_lock_out_new_clients, 60},
  };
  Suite *s = suite_create("abuse");
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    TCase *t = tcase_create(cases[i].name);
    tcase_add_checked_fixture(t, cases[i].setup, teardown);
    tcase_set_timeout(t, cases[i].timeout);
    tcase_add_test(t, cases[i].test);
    suite_add_tcase(s, t);
  }
  return s;
}

int main(void) { return da_test_run(abuse_suite()); }
