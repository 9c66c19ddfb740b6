/*
 * test_doorbell.c — the same-host doorbell (proto/doorbell_ring.h) against the real detattnd
 * (CPU backend): the same bits over the doorbell as over nng and the copy plane (prefill
 * chunks, decode, fork, truncate); many threads sharing one client; hand-overs that must be
 * refused; hostile rings (lengths past the slot, garbage state words, a request rewritten
 * after it was published, a bell never rung) that may only hurt their own connection; a
 * client SIGKILLed with calls in flight; calls timing out (their slots come back); the daemon
 * draining; no doorbell where none is offered; the loop and the backend worker spinning
 * through a client's compute between calls, and giving way where no core is idle. Which transport carried the requests is read
 * from /metrics (detattn_requests_by_transport_total).
 *
 * Each tcase is its own ctest (CK_RUN_CASE); every test starts its own daemon.
 */
#include <check.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>

#include "da.h"
#include "daemon_proc.h"
#include "raw_client.h"
#include "detattn.h"
#include "detattn.pb-c.h"
#include "doorbell_ring.h"
#include "ops_util.h"
#include "testutil.h"

static da_daemon_proc D;
static char http_url[128];
static uint64_t seed;

/* Model: 2 layers, 4 q / 2 kv heads, d 64, bf16. */
#define HQ 4
#define HKV 2
#define HD 64
#define QROW (HQ * HD * 2)
#define KVROW (HKV * HD * 2)

/* Starts the daemon with the model and extra flags (NULL-terminated, may be NULL). */
static void start(const char *const *extra) {
  static const char *const model[] = {"--layers", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64",
                                      "--dtype", "bf16", "--kv-tokens", "32768", "--split-tokens", "64",
                                      "--tile-tokens", "16", "--threads", "2", "--max-conn-per-peer", "1000",
                                      "--max-seqs", "4096", "--http-listen", "http://127.0.0.1:0"};
  const char *args[64];
  size_t n = 0;
  for (size_t i = 0; i < sizeof model / sizeof model[0]; i++) args[n++] = model[i];
  for (size_t i = 0; extra && extra[i]; i++) args[n++] = extra[i];
  args[n] = NULL;
  ck_assert_msg(da_daemon_start(&D, DETATTND_PATH, args) == 0, "detattnd did not start");
  ck_assert_msg(ops_log_http_url(D.log, http_url, sizeof http_url) == 0, "no http_listening line in the log");
}

static void setup(void) {
  seed = da_test_seed(0xd00dbe11ull);
  memset(&D, 0, sizeof D);
}

static void teardown(void) {
  da_daemon_stop(&D);
  nng_fini();
}

/* SIGTERM: the daemon drains and exits 0 (under ASan, with its leak check: every ring
 * unmapped, every route answered). */
static void stop_clean(void) {
  char why[128];
  ck_assert_msg(da_daemon_term_clean(&D, 15000, why, sizeof(why)) == 0, "%s", why);
}

/* One series of the daemon's /metrics. */
static double metric(const char *series) {
  int status = 0, rc = -1;
  char *body = NULL;
  /* A scrape waits at most 1 s for the loop's snapshot (503 past it): under TSan on two
   * cores a busy loop can miss that, so a few tries. */
  for (int i = 0; i < 5 && (rc != 0 || status != 200); i++) {
    if (i > 0) usleep(200000);
    free(body);
    body = NULL;
    rc = ops_http_get(http_url, "/metrics", 5000, &status, &body);
  }
  if (rc != 0 || status != 200) da_daemon_dump_log(&D);
  ck_assert_msg(rc == 0 && status == 200, "GET %s/metrics failed (%s, status %d)", http_url,
                rc ? nng_strerror(rc) : "ok", status);
  double v = ops_metric(body, series);
  free(body);
  ck_assert_msg(!isnan(v), "no %s in /metrics", series);
  return v;
}

#define VIA_BELL "detattn_requests_by_transport_total{transport=\"doorbell\"}"
#define VIA_NNG "detattn_requests_by_transport_total{transport=\"nng\"}"

static detattn_client *connect_with(detattn_data_plane plane, detattn_doorbell bell, int timeout_ms) {
  detattn_client *c;
  detattn_connect_opts o;
  detattn_connect_opts_init(&o);
  o.data_plane = plane;
  o.doorbell = bell;
  o.arena_bytes = 16u << 20;
  o.timeout_ms = timeout_ms;
  ck_assert_int_eq(detattn_connect_ex(&c, D.url, &o), DETATTN_OK);
  detattn_server_info info;
  int st = detattn_hello(c, &info);
  ck_assert_msg(st == DETATTN_OK, "hello: %s: %s", detattn_status_name(st), detattn_errmsg());
  return c;
}

static detattn_stats stats_of(detattn_client *c) {
  detattn_stats s;
  int st = detattn_stats_get(c, &s);
  ck_assert_msg(st == DETATTN_OK, "stats: %s: %s", detattn_status_name(st), detattn_errmsg());
  return s;
}

/* Waits until no sequence, page or arena is left in the daemon (seen by c); asserts it. */
static void expect_empty(detattn_client *c, const char *when) {
  detattn_stats s = stats_of(c);
  for (int i = 0; i < 300 && (s.sequences || s.kv_pages_used || s.arenas); i++) {
    da_test_sleep_ms(20);
    s = stats_of(c);
  }
  ck_assert_msg(s.sequences == 0 && s.kv_pages_used == 0 && s.arenas == 0, "%s: %u sequences, %u pages, %u arenas left",
                when, s.sequences, s.kv_pages_used, s.arenas);
}

/* ---- same bits ---- */

/* Buffers for Forwards of up to `rows` tokens: in the arena when the client has one (so
 * tensors travel by reference and calls fit the doorbell), else on the heap. */
typedef struct bufs {
  detattn_client *c;
  int in_arena;
  uint16_t *q, *k, *v, *o;
  float *lse;
} bufs;

static void *mem(detattn_client *c, size_t n, int *in_arena) {
  void *p = detattn_arena_alloc(c, n);
  if (!p) {
    *in_arena = 0;
    p = malloc(n);
  }
  ck_assert_ptr_nonnull(p);
  return p;
}

static void bufs_init(bufs *b, detattn_client *c, int rows) {
  b->c = c;
  b->in_arena = 1;
  b->q = mem(c, (size_t)rows * QROW, &b->in_arena);
  b->k = mem(c, (size_t)rows * KVROW, &b->in_arena);
  b->v = mem(c, (size_t)rows * KVROW, &b->in_arena);
  b->o = mem(c, (size_t)rows * QROW, &b->in_arena);
  b->lse = mem(c, (size_t)rows * HQ * 4, &b->in_arena);
}

static void bufs_fini(bufs *b) {
  void *p[5] = {b->q, b->k, b->v, b->o, b->lse};
  for (int i = 0; i < 5; i++) {
    if (b->in_arena) detattn_arena_free(b->c, p[i]);
    else free(p[i]);
  }
}

/* Outputs of a workload, appended in call order. */
typedef struct outs {
  uint8_t *p;
  size_t len, cap;
  int calls; /* calls made (every one is eligible for the doorbell over shm) */
} outs;

static void outs_add(outs *w, const void *p, size_t n) {
  if (w->len + n > w->cap) {
    w->cap = (w->len + n) * 2;
    w->p = realloc(w->p, w->cap);
    ck_assert_ptr_nonnull(w->p);
  }
  memcpy(w->p + w->len, p, n);
  w->len += n;
}

/* One Forward of layer over n_seqs sequences, t[i] tokens each at pos[i] (advanced), inputs
 * drawn from r; outputs appended to w. */
static void fwd(detattn_client *c, bufs *b, da_rng *r, uint32_t layer, const uint64_t *seq, uint32_t *pos,
                const uint32_t *t, int n_seqs, outs *w) {
  detattn_seq_io io[8];
  size_t row = 0;
  for (int i = 0; i < n_seqs; i++) {
    da_rng_fill(r, DA_BF16, b->q + row * QROW / 2, (size_t)t[i] * QROW / 2, 1.0);
    da_rng_fill(r, DA_BF16, b->k + row * KVROW / 2, (size_t)t[i] * KVROW / 2, 1.0);
    da_rng_fill(r, DA_BF16, b->v + row * KVROW / 2, (size_t)t[i] * KVROW / 2, 1.0);
    da_test_poison(DA_BF16, b->o + row * QROW / 2, (size_t)t[i] * QROW / 2);
    io[i] = (detattn_seq_io){.seq = seq[i], .pos = pos[i], .n_tokens = t[i], .q = b->q + row * QROW / 2,
                             .k = b->k + row * KVROW / 2, .v = b->v + row * KVROW / 2, .o = b->o + row * QROW / 2,
                             .lse = b->lse + row * HQ};
    row += t[i];
  }
  int st = detattn_forward(c, layer, io, (size_t)n_seqs);
  ck_assert_msg(st == DETATTN_OK, "forward: %s: %s (seed %llu)", detattn_status_name(st), detattn_errmsg(),
                (unsigned long long)seed);
  w->calls++;
  outs_add(w, b->o, row * QROW);
  outs_add(w, b->lse, row * HQ * 4);
  for (int i = 0; i < n_seqs; i++) pos[i] += t[i];
}

/* Prefill in random chunks, decode, fork, truncate and re-append, decode again: every output
 * into w. The inputs and the chunking depend on the seed only. */
static void workload(detattn_client *c, outs *w) {
  enum { S = 3 };
  da_rng r;
  da_rng_seed(&r, seed);
  bufs b;
  bufs_init(&b, c, 256);
  uint64_t seq[S + 1];
  uint32_t len[2][S + 1] = {{0}}; /* per layer */
  for (int s = 0; s < S; s++) {
    ck_assert_int_eq(detattn_seq_open(c, &seq[s]), DETATTN_OK);
    w->calls++;
    uint32_t prompt = (uint32_t)da_rng_range(&r, 20, 150);
    while (len[0][s] < prompt) {
      uint32_t t = (uint32_t)da_rng_range(&r, 1, 64);
      if (t > prompt - len[0][s]) t = prompt - len[0][s];
      for (uint32_t l = 0; l < 2; l++) fwd(c, &b, &r, l, &seq[s], &len[l][s], &t, 1, w);
    }
  }
  uint32_t one[S + 1] = {1, 1, 1, 1};
  for (int step = 0; step < 6; step++)
    for (uint32_t l = 0; l < 2; l++) {
      uint32_t p[S];
      for (int s = 0; s < S; s++) p[s] = len[l][s];
      fwd(c, &b, &r, l, seq, p, one, S, w);
      for (int s = 0; s < S; s++) len[l][s] = p[s];
    }
  /* Fork sequence 0: both go on with different tokens. */
  ck_assert_int_eq(detattn_seq_fork(c, seq[0], &seq[S]), DETATTN_OK);
  w->calls++;
  for (uint32_t l = 0; l < 2; l++) len[l][S] = len[l][0];
  for (int step = 0; step < 3; step++)
    for (uint32_t l = 0; l < 2; l++) {
      uint64_t pair[2] = {seq[0], seq[S]};
      uint32_t p[2] = {len[l][0], len[l][S]};
      fwd(c, &b, &r, l, pair, p, one, 2, w);
      len[l][0] = p[0];
      len[l][S] = p[1];
    }
  /* Truncate sequence 1 by 5 and append 5 other tokens. */
  uint32_t cut = len[0][1] - 5, five = 5;
  ck_assert_int_eq(detattn_seq_truncate(c, seq[1], cut), DETATTN_OK);
  w->calls++;
  for (uint32_t l = 0; l < 2; l++) {
    len[l][1] = cut;
    fwd(c, &b, &r, l, &seq[1], &len[l][1], &five, 1, w);
    fwd(c, &b, &r, l, &seq[1], &len[l][1], one, 1, w);
  }
  for (int s = 0; s <= S; s++) {
    ck_assert_int_eq(detattn_seq_close(c, seq[s]), DETATTN_OK);
    w->calls++;
  }
  bufs_fini(&b);
}

START_TEST(doorbell_gives_the_bits_of_nng_and_of_the_copy_plane) {
  start(NULL);
  struct {
    detattn_data_plane plane;
    detattn_doorbell bell;
    const char *name;
  } ways[3] = {{DETATTN_PLANE_COPY, DETATTN_DOORBELL_OFF, "copy over nng"},
               {DETATTN_PLANE_SHM, DETATTN_DOORBELL_OFF, "shm over nng"},
               {DETATTN_PLANE_SHM, DETATTN_DOORBELL_ON, "shm over the doorbell"}};
  outs w[3] = {{0}};
  for (int i = 0; i < 3; i++) {
    detattn_client *c = connect_with(ways[i].plane, ways[i].bell, 20000);
    ck_assert_int_eq(detattn_doorbell_get(c), ways[i].bell == DETATTN_DOORBELL_ON ? DETATTN_DOORBELL_ON
                                                                                 : DETATTN_DOORBELL_OFF);
    double bell0 = metric(VIA_BELL), nng0 = metric(VIA_NNG);
    workload(c, &w[i]);
    double bell = metric(VIA_BELL) - bell0, nng = metric(VIA_NNG) - nng0;
    if (ways[i].bell == DETATTN_DOORBELL_ON)
      ck_assert_msg(bell == w[i].calls && nng == 0, "%s: %d calls, %.0f by the doorbell, %.0f by nng", ways[i].name,
                    w[i].calls, bell, nng);
    else
      ck_assert_msg(bell == 0, "%s: %.0f requests by the doorbell", ways[i].name, bell);
    detattn_close(c);
  }
  for (int i = 1; i < 3; i++) {
    ck_assert_uint_eq(w[i].len, w[0].len);
    ck_assert_msg(memcmp(w[i].p, w[0].p, w[0].len) == 0, "%s differs from copy over nng (seed %llu)", ways[i].name,
                  (unsigned long long)seed);
  }
  for (int i = 0; i < 3; i++) free(w[i].p);
  stop_clean();
}
END_TEST

/* ---- many threads, one client ---- */

#define T_THREADS 72 /* more than a ring's 64 slots: some calls find none free and use nng */
#define T_STEPS 12

typedef struct thr {
  detattn_client *c;
  pthread_barrier_t *go;
  int id;
  outs w;
  int failed;
  char err[200];
} thr;

/* Thread id's own sequence: a 24-token prefill and T_STEPS decode steps on both layers. */
static void thread_work(detattn_client *c, int id, outs *w, int *failed, char *err, size_t errlen) {
  da_rng r;
  da_rng_seed(&r, seed + (uint64_t)id * 7919u);
  bufs b;
  bufs_init(&b, c, 24);
  uint64_t seq;
  int st = detattn_seq_open(c, &seq);
  for (int step = 0; step <= T_STEPS && st == DETATTN_OK; step++)
    for (uint32_t l = 0; l < 2 && st == DETATTN_OK; l++) {
      uint32_t t = step == 0 ? 24 : 1, pos = step == 0 ? 0 : 24 + (uint32_t)step - 1;
      da_rng_fill(&r, DA_BF16, b.q, (size_t)t * QROW / 2, 1.0);
      da_rng_fill(&r, DA_BF16, b.k, (size_t)t * KVROW / 2, 1.0);
      da_rng_fill(&r, DA_BF16, b.v, (size_t)t * KVROW / 2, 1.0);
      detattn_seq_io io = {.seq = seq, .pos = pos, .n_tokens = t, .q = b.q, .k = b.k, .v = b.v, .o = b.o, .lse = b.lse};
      if ((st = detattn_forward(c, l, &io, 1)) == DETATTN_OK) {
        outs_add(w, b.o, (size_t)t * QROW);
        outs_add(w, b.lse, (size_t)t * HQ * 4);
      }
    }
  if (st == DETATTN_OK) st = detattn_seq_close(c, seq);
  if (st != DETATTN_OK) {
    *failed = st;
    snprintf(err, errlen, "%s: %s", detattn_status_name(st), detattn_errmsg());
  }
  bufs_fini(&b);
}

static void *thread_main(void *arg) {
  thr *t = arg;
  pthread_barrier_wait(t->go);
  thread_work(t->c, t->id, &t->w, &t->failed, t->err, sizeof t->err);
  return NULL;
}

START_TEST(many_threads_share_one_doorbell_client) {
  static const char *const extra[] = {"--max-inflight-per-conn", "1024", NULL};
  start(extra);
  detattn_client *c = connect_with(DETATTN_PLANE_SHM, DETATTN_DOORBELL_ON, 30000);
  double bell0 = metric(VIA_BELL);
  static thr t[T_THREADS];
  pthread_t th[T_THREADS];
  pthread_barrier_t go;
  pthread_barrier_init(&go, NULL, T_THREADS);
  for (int i = 0; i < T_THREADS; i++) {
    t[i] = (thr){.c = c, .go = &go, .id = i};
    ck_assert_int_eq(pthread_create(&th[i], NULL, thread_main, &t[i]), 0);
  }
  for (int i = 0; i < T_THREADS; i++) pthread_join(th[i], NULL);
  pthread_barrier_destroy(&go);
  double bell = metric(VIA_BELL) - bell0;
  for (int i = 0; i < T_THREADS; i++) ck_assert_msg(!t[i].failed, "thread %d: %s", i, t[i].err);
  ck_assert_msg(bell >= T_THREADS * (2 * (T_STEPS + 1) + 2) / 2, "only %.0f requests went by the doorbell", bell);
  /* The same work, one thread at a time over nng with the copy plane: the same bits. */
  detattn_client *ref = connect_with(DETATTN_PLANE_COPY, DETATTN_DOORBELL_OFF, 30000);
  for (int i = 0; i < T_THREADS; i++) {
    outs w = {0};
    int failed = 0;
    char err[200];
    thread_work(ref, i, &w, &failed, err, sizeof err);
    ck_assert_msg(!failed, "reference %d: %s", i, err);
    ck_assert_msg(w.len == t[i].w.len && memcmp(w.p, t[i].w.p, w.len) == 0,
                  "thread %d's outputs differ from the serial reference (seed %llu)", i, (unsigned long long)seed);
    free(w.p);
    free(t[i].w.p);
  }
  detattn_close(c);
  expect_empty(ref, "after the threads");
  detattn_close(ref);
  stop_clean();
}
END_TEST

/* ---- raw rings: hand-overs and hostile slots ---- */


/* A ring made by hand: a memfd with the layout of proto/doorbell_ring.h and an eventfd. */
typedef struct rring {
  int memfd, efd;
  uint8_t *base;
  uint64_t size;
  uint32_t slots, req, rep;
  uint64_t next_id;
} rring;

#define R_SLOTS 8
#define R_AREA 4096

static void rring_make(rring *g, int seals) {
  memset(g, 0, sizeof *g);
  g->slots = R_SLOTS;
  g->req = g->rep = R_AREA;
  g->size = da_ring_bytes(g->slots, g->req, g->rep);
  g->memfd = memfd_create("test-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ck_assert_int_ge(g->memfd, 0);
  ck_assert_int_eq(ftruncate(g->memfd, (off_t)g->size), 0);
  if (seals) ck_assert_int_eq(fcntl(g->memfd, F_ADD_SEALS, seals), 0);
  g->base = mmap(NULL, g->size, PROT_READ | PROT_WRITE, MAP_SHARED, g->memfd, 0);
  ck_assert_ptr_ne(g->base, MAP_FAILED);
  da_ring_hdr *h = (da_ring_hdr *)g->base;
  h->magic = DA_RING_MAGIC;
  h->version = DA_RING_VERSION;
  h->slots = g->slots;
  h->request_bytes = g->req;
  h->reply_bytes = g->rep;
  h->sleeping = 1;
  g->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  ck_assert_int_ge(g->efd, 0);
  g->next_id = 1000;
}

static void rring_free(rring *g) {
  munmap(g->base, g->size);
  close(g->memfd);
  close(g->efd);
}

static da_ring_slot *rslot(rring *g, uint32_t i) { return da_ring_slot_at(g->base, i, g->req, g->rep); }

/* RegisterArena with this ring's geometry (size: the layout's unless size_override). */
static int rring_register(da_raw *r, const rring *g, uint64_t size_override, uint32_t *id, uint64_t *token, char *msg,
                          size_t len) {
  Detattn__V1__DoorbellRing dr = DETATTN__V1__DOORBELL_RING__INIT;
  dr.slots = g->slots;
  dr.request_bytes = g->req;
  dr.reply_bytes = g->rep;
  return da_raw_register(r, size_override ? size_override : g->size, &dr, id, token, msg, len);
}

static int bell_side_send(const int *fds, int n_fds, uint32_t id, uint64_t token) {
  return da_raw_side_send(D.url, DA_RING_MAGIC, fds, n_fds, id, token);
}

static int rring_handover(const rring *g, uint32_t id, uint64_t token) {
  int fds[2] = {g->memfd, g->efd};
  return bell_side_send(fds, 2, id, token);
}

/* A registered and handed-over ring on r. */
static void rring_ready(da_raw *r, rring *g) {
  char msg[256];
  uint32_t id = 0;
  uint64_t token = 0;
  rring_make(g, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  da_raw_expect(rring_register(r, g, 0, &id, &token, msg, sizeof msg), msg, DETATTN_OK, "register the ring");
  ck_assert_int_eq(rring_handover(g, id, token), 0);
}

/* Writes len bytes of request into slot i, publishes it and (ring set) rings the bell. */
static void rring_put(rring *g, uint32_t i, const void *req, uint32_t len, uint32_t req_len, int ring) {
  da_ring_slot *s = rslot(g, i);
  memcpy((uint8_t *)s + DA_RING_SLOT_HDR_BYTES, req, len);
  __atomic_store_n(&s->req_len, req_len, __ATOMIC_RELAXED);
  __atomic_store_n(&s->state, DA_RING_REQUEST, __ATOMIC_SEQ_CST);
  uint64_t one = 1;
  if (ring) ck_assert_int_eq(write(g->efd, &one, 8), 8);
}

/* Packs rq (a fresh id) into slot i and publishes it; ring: and rings the bell. */
static void rring_put_rq_bell(rring *g, uint32_t i, Detattn__V1__Request *rq, int ring) {
  rq->id = g->next_id++;
  uint8_t buf[R_AREA];
  size_t n = detattn__v1__request__get_packed_size(rq);
  ck_assert_uint_le(n, sizeof buf);
  detattn__v1__request__pack(rq, buf);
  rring_put(g, i, buf, (uint32_t)n, (uint32_t)n, ring);
}

static void rring_put_rq(rring *g, uint32_t i, Detattn__V1__Request *rq) { rring_put_rq_bell(g, i, rq, 1); }

/* Waits up to timeout_ms for slot i to be DONE; 1 when it is. */
static int rring_done(rring *g, uint32_t i, int timeout_ms) {
  for (int t = 0; t < timeout_ms; t++) {
    if (__atomic_load_n(&rslot(g, i)->state, __ATOMIC_ACQUIRE) == DA_RING_DONE) return 1;
    da_test_sleep_ms(1);
  }
  return __atomic_load_n(&rslot(g, i)->state, __ATOMIC_ACQUIRE) == DA_RING_DONE;
}

/* Slot i's reply, decoded (the slot becomes FREE); its code in *code, message in msg. */
static Detattn__V1__Response *rring_reply(rring *g, uint32_t i, int *code, char *msg, size_t len) {
  ck_assert_msg(rring_done(g, i, 10000), "slot %u not answered (state %u)", i, rslot(g, i)->state);
  da_ring_slot *s = rslot(g, i);
  uint32_t n = s->rep_len;
  ck_assert_uint_ge(n, 1);
  ck_assert_uint_le(n, g->rep);
  Detattn__V1__Response *resp =
      detattn__v1__response__unpack(NULL, n, (uint8_t *)s + DA_RING_SLOT_HDR_BYTES + g->req);
  ck_assert_ptr_nonnull(resp);
  *code = resp->status ? (int)resp->status->code : 0;
  snprintf(msg, len, "%s", resp->status && resp->status->message ? resp->status->message : "");
  __atomic_store_n(&s->state, DA_RING_FREE, __ATOMIC_RELEASE);
  return resp;
}

/* rq: a SeqOpen request with body so. */
static void seq_open_request(Detattn__V1__Request *rq, Detattn__V1__SeqOpen *so) {
  detattn__v1__request__init(rq);
  detattn__v1__seq_open__init(so);
  rq->op_case = DETATTN__V1__REQUEST__OP_SEQ_OPEN;
  rq->seq_open = so;
}

/* The loop has let the ring sleep: rq published in slot 0 without the bell is not taken
 * until the bell rings, and is then answered OK. */
static void expect_bell_needed(rring *g, Detattn__V1__Request *rq, const char *what) {
  ck_assert_uint_eq(__atomic_load_n(&((da_ring_hdr *)g->base)->sleeping, __ATOMIC_SEQ_CST), 1);
  rring_put_rq_bell(g, 0, rq, 0);
  da_test_sleep_ms(100);
  ck_assert_msg(rslot(g, 0)->state == DA_RING_REQUEST, "%s: a request was taken from a sleeping ring without a bell",
                what);
  uint64_t one = 1;
  ck_assert_int_eq(write(g->efd, &one, 8), 8);
  char msg[256];
  int code;
  detattn__v1__response__free_unpacked(rring_reply(g, 0, &code, msg, sizeof msg), NULL);
  da_raw_expect(code, msg, DETATTN_OK, what);
}

static int rring_call(rring *g, uint32_t i, Detattn__V1__Request *rq, char *msg, size_t len,
                      Detattn__V1__Response **out) {
  rring_put_rq(g, i, rq);
  int code;
  Detattn__V1__Response *resp = rring_reply(g, i, &code, msg, len);
  ck_assert_uint_eq(resp->id, rq->id);
  if (out) *out = resp;
  else detattn__v1__response__free_unpacked(resp, NULL);
  return code;
}

START_TEST(ring_hand_overs_are_checked) {
  start(NULL);
  da_raw r;
  da_raw_open(&r, D.url);
  char msg[256];
  uint32_t id = 0;
  uint64_t token = 0;
  rring g;
  /* Geometry and size are checked at registration. */
  rring_make(&g, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  da_raw_expect(rring_register(&r, &g, g.size + 4096, &id, &token, msg, sizeof msg), msg, DETATTN_INVALID_ARGUMENT,
         "size other than the layout's");
  g.req = 1000; /* not a multiple of 64 */
  da_raw_expect(rring_register(&r, &g, da_ring_bytes(g.slots, 1024, g.rep), &id, &token, msg, sizeof msg), msg,
         DETATTN_INVALID_ARGUMENT, "request area of 1000 bytes");
  g.req = R_AREA;
  da_raw_expect(rring_register(&r, &g, 0, &id, &token, msg, sizeof msg), msg, DETATTN_OK, "register");
  /* An unsealed memfd, one descriptor only, a pipe for the eventfd, a wrong token, another
   * process, a header that does not match: each refused. */
  rring bad;
  rring_make(&bad, F_SEAL_SHRINK);
  ck_assert_int_eq(rring_handover(&bad, id, token), DETATTN_INVALID_ARGUMENT);
  ck_assert_msg(da_daemon_log_has(&D, "F_SEAL_GROW"), "the unsealed ring's refusal was not logged");
  rring_free(&bad);
  ck_assert_int_eq(bell_side_send(&g.memfd, 1, id, token), DETATTN_INVALID_ARGUMENT);
  int p[2];
  ck_assert_int_eq(pipe(p), 0);
  int with_pipe[2] = {g.memfd, p[0]};
  ck_assert_int_eq(bell_side_send(with_pipe, 2, id, token), DETATTN_INVALID_ARGUMENT);
  ck_assert_msg(da_daemon_log_has(&D, "not an eventfd"), "the pipe's refusal was not logged");
  close(p[0]);
  close(p[1]);
  ck_assert_int_eq(rring_handover(&g, id, token ^ 1), DETATTN_NOT_FOUND);
  pid_t pid = fork();
  if (pid == 0) _exit(rring_handover(&g, id, token) == DETATTN_PERMISSION_DENIED ? 0 : 1);
  int status;
  ck_assert_int_eq(waitpid(pid, &status, 0), pid);
  ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "another process handed the ring over");
  ((da_ring_hdr *)g.base)->slots = 9;
  ck_assert_int_eq(rring_handover(&g, id, token), DETATTN_INVALID_ARGUMENT);
  ((da_ring_hdr *)g.base)->slots = g.slots;
  /* The right one, once; a second ring on the connection is refused. */
  ck_assert_int_eq(rring_handover(&g, id, token), 0);
  ck_assert_int_eq(rring_handover(&g, id, token), DETATTN_NOT_FOUND);
  uint32_t id2;
  uint64_t token2;
  da_raw_expect(rring_register(&r, &g, 0, &id2, &token2, msg, sizeof msg), msg, DETATTN_ALREADY_EXISTS, "second ring");
  ck_assert_int_eq(metric("detattn_doorbell_rings"), 1);
  /* The ring works: a request through it is its connection's. */
  Detattn__V1__Request rq;
  Detattn__V1__SeqOpen so;
  seq_open_request(&rq, &so);
  Detattn__V1__Response *resp;
  da_raw_expect(rring_call(&g, 0, &rq, msg, sizeof msg, &resp), msg, DETATTN_OK, "seq_open through the ring");
  uint64_t seq = resp->seq_open->seq;
  detattn__v1__response__free_unpacked(resp, NULL);
  Detattn__V1__SeqClose sc = DETATTN__V1__SEQ_CLOSE__INIT;
  sc.seq = seq;
  rq = (Detattn__V1__Request)DETATTN__V1__REQUEST__INIT;
  rq.op_case = DETATTN__V1__REQUEST__OP_SEQ_CLOSE;
  rq.seq_close = &sc;
  da_raw_expect(da_raw_call(&r, &rq, msg, sizeof msg, NULL), msg, DETATTN_OK, "closing it over nng");
  da_raw_close(&r);
  for (int i = 0; i < 100 && metric("detattn_doorbell_rings") > 0; i++) da_test_sleep_ms(20);
  ck_assert_int_eq(metric("detattn_doorbell_rings"), 0);
  rring_free(&g);
}
END_TEST

/* A well-behaved doorbell client on another connection, run while a ring is abused. */
typedef struct bystander {
  pthread_t th;
  int stop; /* atomic */
  int calls, failed;
  char err[200];
} bystander;

static void *bystander_main(void *arg) {
  bystander *b = arg;
  detattn_client *c;
  detattn_connect_opts o;
  detattn_connect_opts_init(&o);
  o.doorbell = DETATTN_DOORBELL_ON;
  o.arena_bytes = 4u << 20;
  detattn_server_info info;
  int st = detattn_connect_ex(&c, D.url, &o);
  if (st == DETATTN_OK) st = detattn_hello(c, &info);
  uint64_t seq = 0;
  while (st == DETATTN_OK && !__atomic_load_n(&b->stop, __ATOMIC_ACQUIRE)) {
    if ((st = detattn_seq_open(c, &seq)) == DETATTN_OK) st = detattn_seq_close(c, seq);
    b->calls++;
  }
  if (st != DETATTN_OK) {
    b->failed = st;
    snprintf(b->err, sizeof b->err, "%s: %s", detattn_status_name(st), detattn_errmsg());
  }
  detattn_close(c);
  return NULL;
}

START_TEST(hostile_slots_only_hurt_their_own_ring) {
  start(NULL);
  bystander by = {0};
  ck_assert_int_eq(pthread_create(&by.th, NULL, bystander_main, &by), 0);
  da_raw r;
  da_raw_open(&r, D.url);
  rring g;
  rring_ready(&r, &g);
  char msg[256];
  int code;
  /* A length past the slot, a length of 0, bytes that are no Request. */
  uint8_t junk[R_AREA];
  da_rng rg;
  da_rng_seed(&rg, seed);
  for (size_t i = 0; i < sizeof junk; i++) junk[i] = (uint8_t)da_rng_u64(&rg);
  junk[0] = 0xff; /* field 31 of wire type 7, which does not exist: never a Request */
  rring_put(&g, 0, junk, 16, R_AREA + 1, 1);
  detattn__v1__response__free_unpacked(rring_reply(&g, 0, &code, msg, sizeof msg), NULL);
  da_raw_expect(code, msg, DETATTN_INVALID_ARGUMENT, "request length past the slot");
  rring_put(&g, 0, junk, 0, 0, 1);
  detattn__v1__response__free_unpacked(rring_reply(&g, 0, &code, msg, sizeof msg), NULL);
  da_raw_expect(code, msg, DETATTN_INVALID_ARGUMENT, "request length 0");
  rring_put(&g, 0, junk, 200, 200, 1);
  detattn__v1__response__free_unpacked(rring_reply(&g, 0, &code, msg, sizeof msg), NULL);
  da_raw_expect(code, msg, DETATTN_INVALID_ARGUMENT, "bytes that are no Request");
  /* Garbage state words stay as they are; the request beside them is answered. */
  const uint32_t garbage[] = {0xdeadbeefu, DA_RING_DONE, DA_RING_TAKEN, DA_RING_CLAIMED, DA_RING_LOST, 77};
  for (uint32_t i = 0; i < 6; i++) __atomic_store_n(&rslot(&g, i + 1)->state, garbage[i], __ATOMIC_SEQ_CST);
  Detattn__V1__Request rq;
  Detattn__V1__SeqOpen so;
  seq_open_request(&rq, &so);
  da_raw_expect(rring_call(&g, 7, &rq, msg, sizeof msg, NULL), msg, DETATTN_OK, "seq_open beside garbage");
  da_test_sleep_ms(20);
  for (uint32_t i = 0; i < 6; i++)
    ck_assert_msg(rslot(&g, i + 1)->state == garbage[i], "slot %u's garbage state changed to %u", i + 1,
                  rslot(&g, i + 1)->state);
  /* A request rewritten while the daemon takes it: whatever it read is answered, with OK or
   * an error, and the daemon serves on. */
  uint8_t good[256];
  rq.id = 1;
  size_t n = detattn__v1__request__get_packed_size(&rq);
  detattn__v1__request__pack(&rq, good);
  int answered = 0;
  for (int round = 0; round < 200; round++) {
    rring_put(&g, 0, good, (uint32_t)n, (uint32_t)n, 1);
    da_ring_slot *s = rslot(&g, 0);
    for (int k = 0; __atomic_load_n(&s->state, __ATOMIC_ACQUIRE) != DA_RING_DONE && k < 2000000; k++) {
      uint8_t *area = (uint8_t *)s + DA_RING_SLOT_HDR_BYTES;
      area[k % n] ^= (uint8_t)(k + 1);
      __atomic_store_n(&s->req_len, (uint32_t)(k % 3 == 0 ? R_AREA * 2 : (size_t)(k % (int)n) + 1), __ATOMIC_RELAXED);
    }
    Detattn__V1__Response *resp = rring_reply(&g, 0, &code, msg, sizeof msg);
    detattn__v1__response__free_unpacked(resp, NULL);
    answered++;
  }
  ck_assert_int_eq(answered, 200);
  /* The ring's bell: after the loop has been quiet for --doorbell-spin-us it sleeps; a
   * request published without ringing is not taken until the bell rings. */
  da_test_sleep_ms(50);
  expect_bell_needed(&g, &rq, "seq_open after the bell");
  /* The bystander was served all along. */
  __atomic_store_n(&by.stop, 1, __ATOMIC_RELEASE);
  pthread_join(by.th, NULL);
  ck_assert_msg(!by.failed, "the bystander failed: %s", by.err);
  ck_assert_int_gt(by.calls, 10);
  /* Closing the connection closes what the hostile ring opened. */
  da_raw_close(&r);
  detattn_client *c = connect_with(DETATTN_PLANE_COPY, DETATTN_DOORBELL_OFF, 10000);
  expect_empty(c, "after the hostile ring's connection closed");
  for (int i = 0; i < 100 && metric("detattn_doorbell_rings") > 0; i++) da_test_sleep_ms(20);
  ck_assert_int_eq(metric("detattn_doorbell_rings"), 0);
  detattn_close(c);
  rring_free(&g);
  stop_clean();
}
END_TEST

/* With --doorbell-spin-max-us the loop follows a client that computes between its calls: it
 * scans a ring for half again the last gap from a reply to the ring's next request, so a
 * request published within that after a reply is taken without the bell; past it, with
 * nothing new, the ring sleeps again and a request without the bell waits. The gaps are
 * hundreds of ms where the test asserts, so a slow machine cannot flip them; --spin-late-us 0,
 * as a busy test machine's late yields would end the spin (give_way tests that). */
START_TEST(the_loop_scans_through_a_clients_compute_between_calls) {
  static const char *const extra[] = {"--doorbell-spin-us", "1000", "--doorbell-spin-max-us", "1000000",
                                      "--spin-late-us", "0", NULL};
  start(extra);
  da_raw r;
  da_raw_open(&r, D.url);
  rring g;
  rring_ready(&r, &g);
  char msg[256];
  Detattn__V1__Request rq;
  Detattn__V1__SeqOpen so;
  seq_open_request(&rq, &so);
  da_raw_expect(rring_call(&g, 0, &rq, msg, sizeof msg, NULL), msg, DETATTN_OK, "first call");
  /* 400 ms of "compute": the loop sleeps after 1 ms; the bell wakes it, and it learns the gap. */
  da_test_sleep_ms(400);
  ck_assert_uint_eq(__atomic_load_n(&((da_ring_hdr *)g.base)->sleeping, __ATOMIC_SEQ_CST), 1);
  da_raw_expect(rring_call(&g, 0, &rq, msg, sizeof msg, NULL), msg, DETATTN_OK, "call after 400 ms");
  /* Now it scans for ~600 ms after each reply: 20 ms later, no bell, the request is taken. */
  da_test_sleep_ms(20);
  ck_assert_uint_eq(__atomic_load_n(&((da_ring_hdr *)g.base)->sleeping, __ATOMIC_SEQ_CST), 0);
  rring_put_rq_bell(&g, 0, &rq, 0);
  ck_assert_msg(rring_done(&g, 0, 5000), "a request 20 ms after a reply was not taken while the loop followed "
                                         "a 400 ms gap (state %u)", rslot(&g, 0)->state);
  int code;
  detattn__v1__response__free_unpacked(rring_reply(&g, 0, &code, msg, sizeof msg), NULL);
  da_raw_expect(code, msg, DETATTN_OK, "call without the bell");
  /* That gap was ~20 ms, so ~30 ms later the ring sleeps: 800 ms on, a request without the
   * bell waits, and the bell gets it answered. */
  da_test_sleep_ms(800);
  expect_bell_needed(&g, &rq, "call after the bell");
  da_raw_close(&r);
  rring_free(&g);
  stop_clean();
}
END_TEST

/* One sequence fed a token a call on layer 0: the spin tests' client. */
typedef struct tokens {
  detattn_client *c;
  da_rng r;
  bufs b;
  outs w;
  uint64_t seq;
  uint32_t pos;
} tokens;

static void tokens_open(tokens *t, detattn_client *c) {
  memset(t, 0, sizeof *t);
  t->c = c;
  da_rng_seed(&t->r, seed);
  bufs_init(&t->b, c, 1);
  ck_assert_int_eq(detattn_seq_open(c, &t->seq), DETATTN_OK);
}

static void tokens_call(tokens *t) {
  uint32_t one = 1;
  fwd(t->c, &t->b, &t->r, 0, &t->seq, &t->pos, &one, 1, &t->w);
}

/* Closes the sequence and the client. */
static void tokens_close(tokens *t) {
  ck_assert_int_eq(detattn_seq_close(t->c, t->seq), DETATTN_OK);
  bufs_fini(&t->b);
  free(t->w.p);
  detattn_close(t->c);
}

/* With --worker-spin-max-us the backend worker follows the gaps between batches as the loop
 * follows a ring: out of work, it spins for half again its last idle gap before it sleeps. Read
 * from detattn_worker_idle_sleeps_total; the gaps where the test asserts are hundreds of ms
 * apart (--spin-late-us 0, as above). */
#define WORKER_SLEEPS "detattn_worker_idle_sleeps_total"
START_TEST(the_worker_spins_through_a_clients_compute_between_calls) {
  static const char *const extra[] = {"--worker-spin-us", "1000", "--worker-spin-max-us", "1000000",
                                      "--spin-late-us", "0", NULL};
  start(extra);
  tokens t;
  tokens_open(&t, connect_with(DETATTN_PLANE_COPY, DETATTN_DOORBELL_OFF, 20000));
  tokens_call(&t);
  /* 400 ms of "compute": the worker sleeps after 1 ms, and learns the gap. */
  da_test_sleep_ms(400);
  tokens_call(&t);
  const double s1 = metric(WORKER_SLEEPS);
  ck_assert_msg(s1 >= 1, "%.0f idle sleeps after a 400 ms gap", s1);
  /* Now it spins ~600 ms after each batch: a batch ~20 ms later is caught awake. */
  da_test_sleep_ms(20);
  tokens_call(&t);
  const double s2 = metric(WORKER_SLEEPS);
  ck_assert_msg(s2 == s1, "a batch 20 ms after the last found the worker asleep (%.0f -> %.0f sleeps) while it "
                          "followed a 400 ms gap", s1, s2);
  /* That gap was ~20 ms: 800 ms on, the worker sleeps again. */
  da_test_sleep_ms(800);
  tokens_call(&t);
  const double s3 = metric(WORKER_SLEEPS);
  ck_assert_msg(s3 == s2 + 1, "after an 800 ms gap that followed a 20 ms one: %.0f -> %.0f sleeps", s2, s3);
  tokens_close(&t);
  stop_clean();
}
END_TEST

/* Busy threads for the test below: each spins until stop or its own deadline. */
typedef struct busy {
  int stop; /* atomic */
  uint64_t until_ns;
} busy;

static void *busy_main(void *p) {
  busy *b = p;
  volatile uint64_t x = 0;
  while (!__atomic_load_n(&b->stop, __ATOMIC_RELAXED) && da_now_ns() < b->until_ns)
    for (int i = 0; i < 10000; i++) x += (uint64_t)i;
  return NULL;
}

/* On a machine with no idle core a spin's yields come back late (another thread ran its time
 * slice there), and the loop and the worker give way (doorbell_ring.h, da_spin_guard): their
 * late yields are counted in detattn_spin_late_yields_total, and the calls go on. Two busy
 * threads per CPU this process may run on, for at most 10 s, while a doorbell client calls
 * every 20 ms; --spin-late-us 200, so that a scheduler's short slices count too. */
#define LATE_LOOP "detattn_spin_late_yields_total{thread=\"loop\"}"
#define LATE_WORKER "detattn_spin_late_yields_total{thread=\"worker\"}"
START_TEST(spins_give_way_when_no_core_is_idle) {
  static const char *const extra[] = {"--doorbell-spin-max-us", "1000000", "--worker-spin-us", "1000",
                                      "--worker-spin-max-us", "1000000", "--spin-late-us", "200", NULL};
  start(extra);
  tokens t;
  tokens_open(&t, connect_with(DETATTN_PLANE_SHM, DETATTN_DOORBELL_ON, 30000));
  ck_assert_int_eq(detattn_doorbell_get(t.c), DETATTN_DOORBELL_ON);
  /* Calls 50 ms apart: the loop and the worker follow that gap. */
  for (int i = 0; i < 3; i++) {
    tokens_call(&t);
    da_test_sleep_ms(50);
  }
  cpu_set_t cpus;
  ck_assert_int_eq(sched_getaffinity(0, sizeof cpus, &cpus), 0);
  const int n = 2 * CPU_COUNT(&cpus);
  busy bz = {0, da_now_ns() + 10000000000ull};
  pthread_t th[2 * CPU_SETSIZE];
  for (int i = 0; i < n; i++) ck_assert_int_eq(pthread_create(&th[i], NULL, busy_main, &bz), 0);
  double loop = 0, worker = 0;
  for (int i = 0; i < 100 && (loop == 0 || worker == 0) && da_now_ns() < bz.until_ns; i++) {
    da_test_sleep_ms(20);
    tokens_call(&t);
    if (i % 10 == 9) loop = metric(LATE_LOOP), worker = metric(LATE_WORKER);
  }
  __atomic_store_n(&bz.stop, 1, __ATOMIC_RELAXED);
  for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
  ck_assert_msg(loop > 0 && worker > 0, "%d busy threads: %.0f late yields of the loop, %.0f of the worker", n, loop,
                worker);
  tokens_close(&t);
  stop_clean();
}
END_TEST

/* ---- killed, timed out, drained ---- */

/* The child: a doorbell client with big Forwards by reference in flight, then killed. */
static void bell_victim(int fd_go, int fd_ready) {
  char go;
  if (read(fd_go, &go, 1) != 1) _exit(9);
  detattn_client *c;
  detattn_connect_opts o;
  detattn_connect_opts_init(&o);
  o.doorbell = DETATTN_DOORBELL_ON;
  o.arena_bytes = 32u << 20;
  detattn_server_info info;
  if (detattn_connect_ex(&c, D.url, &o) || detattn_hello(c, &info)) _exit(10);
  if (detattn_doorbell_get(c) != DETATTN_DOORBELL_ON) _exit(11);
  int failed = da_raw_calls_in_flight(c, QROW, KVROW, NULL);
  if (failed) _exit(11 + failed);
  if (write(fd_ready, "r", 1) != 1) _exit(15);
  for (;;) pause();
}

START_TEST(a_client_killed_with_doorbell_calls_in_flight_leaves_nothing_behind) {
  /* The child forks before this process starts nng; it waits for its go byte. */
  int go[2], ready[2];
  ck_assert_int_eq(pipe(go), 0);
  ck_assert_int_eq(pipe(ready), 0);
  start(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    close(go[1]);
    close(ready[0]);
    bell_victim(go[0], ready[1]);
  }
  close(go[0]);
  close(ready[1]);
  ck_assert_int_eq(write(go[1], "g", 1), 1);
  struct pollfd pf = {.fd = ready[0], .events = POLLIN};
  char b;
  int ok = poll(&pf, 1, 20000) == 1 && read(ready[0], &b, 1) == 1;
  double rings = metric("detattn_doorbell_rings"), bell = metric(VIA_BELL);
  kill(pid, SIGKILL);
  int status;
  waitpid(pid, &status, 0);
  ck_assert_msg(ok, "the doorbell client did not start its calls (status 0x%x)", status);
  ck_assert_int_eq(rings, 1);
  ck_assert_int_ge(bell, 4); /* its seq_opens; its Forwards are in flight */
  detattn_client *cc = connect_with(DETATTN_PLANE_COPY, DETATTN_DOORBELL_OFF, 20000);
  expect_empty(cc, "after the kill");
  for (int i = 0; i < 100 && metric("detattn_doorbell_rings") > 0; i++) da_test_sleep_ms(20);
  ck_assert_int_eq(metric("detattn_doorbell_rings"), 0);
  detattn_close(cc);
  /* The daemon serves on, over the doorbell. */
  detattn_client *c = connect_with(DETATTN_PLANE_SHM, DETATTN_DOORBELL_ON, 20000);
  ck_assert_int_eq(metric("detattn_doorbell_rings"), 1);
  outs w = {0};
  workload(c, &w);
  free(w.p);
  detattn_close(c);
  close(go[1]);
  close(ready[0]);
  stop_clean();
}
END_TEST

START_TEST(a_doorbell_call_past_its_deadline_fails_and_its_slot_comes_back) {
  /* Forwards wait --wait-us (1 s) for company before they run: every one times out, the
   * whole series (80 x 5 ms) before the first batch runs. */
  static const char *const extra[] = {"--wait-us", "1000000", "--max-inflight-per-conn", "1024", NULL};
  start(extra);
  enum { CALLS = 80 }; /* more than the ring's 64 slots */
  detattn_client *c = connect_with(DETATTN_PLANE_SHM, DETATTN_DOORBELL_ON, 20000);
  uint64_t seq[CALLS];
  for (int i = 0; i < CALLS; i++) ck_assert_int_eq(detattn_seq_open(c, &seq[i]), DETATTN_OK);
  /* One output block per call: the timed-out calls all run later, in one batch. */
  uint16_t *q = detattn_arena_alloc(c, QROW), *kv = detattn_arena_alloc(c, KVROW),
           *o = detattn_arena_alloc(c, (size_t)CALLS * QROW);
  ck_assert(q && kv && o);
  memset(q, 0x3c, QROW);
  memset(kv, 0x3b, KVROW);
  double bell0 = metric(VIA_BELL), nng0 = metric(VIA_NNG);
  detattn_set_timeout(c, 5);
  for (int i = 0; i < CALLS; i++) {
    detattn_seq_io io = {.seq = seq[i], .pos = 0, .n_tokens = 1, .q = q, .k = kv, .v = kv,
                         .o = o + (size_t)i * QROW / 2};
    uint64_t t0 = da_now_ns();
    int st = detattn_forward(c, 0, &io, 1);
    double ms = (double)(da_now_ns() - t0) * 1e-6;
    ck_assert_msg(st == DETATTN_DEADLINE_EXCEEDED, "call %d: %s: %s", i, detattn_status_name(st), detattn_errmsg());
    ck_assert_msg(strstr(detattn_errmsg(), "deadline") != NULL, "message: %s", detattn_errmsg());
    ck_assert_msg(ms < 500, "call %d took %.0f ms with a 5 ms timeout", i, ms);
  }
  detattn_set_timeout(c, 20000);
  /* A call past its deadline is not withdrawn once the daemon took it: all of them run, in
   * the batch after the window. Until then their slots stay taken, so the calls past the
   * ring's 64 slots went by nng: all 16, unless one had not left the client by its deadline
   * and never reached the daemon (under ThreadSanitizer on 2 busy cores: 79 of 80 ran once).
   * The doorbell's 64 cannot be lost (a slot is written before the call waits). Up to 20 s:
   * there the batch after the window can take seconds (a 3 s bound failed once). */
  const char *fwd_ok = "detattn_requests_total{op=\"forward\",code=\"OK\"}";
  double bell = 0, nng = 0, ok = 0;
  for (int i = 0; i < 2000; i++) {
    bell = metric(VIA_BELL) - bell0, nng = metric(VIA_NNG) - nng0, ok = metric(fwd_ok);
    if (nng > 0 && ok == bell + nng) break;
    da_test_sleep_ms(10);
  }
  ck_assert_msg(bell == 64 && nng > 0 && nng <= CALLS - 64 && ok == bell + nng,
                "timed-out Forwards: %.0f by the doorbell (want 64), %.0f by nng (want 1 to %d), %.0f ran (want all)",
                bell, nng, CALLS - 64, ok);
  /* Answered, every slot is the ring's again: all of the next calls go by the doorbell. */
  bell0 = metric(VIA_BELL);
  nng0 = metric(VIA_NNG);
  for (int i = 0; i < CALLS; i++) {
    ck_assert_int_eq(detattn_seq_truncate(c, seq[i], 0), DETATTN_OK);
    ck_assert_int_eq(detattn_seq_close(c, seq[i]), DETATTN_OK);
  }
  bell = metric(VIA_BELL) - bell0;
  nng = metric(VIA_NNG) - nng0;
  ck_assert_msg(bell == 2 * CALLS && nng == 0, "after the timeouts: %.0f by the doorbell (want %d), %.0f by nng", bell,
                2 * CALLS, nng);
  detattn_close(c);
  detattn_client *cc = connect_with(DETATTN_PLANE_COPY, DETATTN_DOORBELL_OFF, 20000);
  expect_empty(cc, "after the timeouts");
  detattn_close(cc);
  stop_clean();
}
END_TEST

/* A one-token Forward on a new sequence of c, its tensors in c's arena, started and left in
 * flight (the caller waits for it). */
static detattn_call *forward_in_flight(detattn_client *c) {
  uint64_t seq;
  ck_assert_int_eq(detattn_seq_open(c, &seq), DETATTN_OK);
  uint16_t *q = detattn_arena_alloc(c, QROW), *kv = detattn_arena_alloc(c, KVROW), *o = detattn_arena_alloc(c, QROW);
  ck_assert(q && kv && o);
  memset(q, 0x3c, QROW);
  memset(kv, 0x3b, KVROW);
  detattn_seq_io io = {.seq = seq, .pos = 0, .n_tokens = 1, .q = q, .k = kv, .v = kv, .o = o};
  detattn_call *k;
  ck_assert_int_eq(detattn_forward_start(c, 0, &io, 1, &k), DETATTN_OK);
  return k;
}

START_TEST(a_draining_daemon_answers_unavailable_through_the_ring) {
  static const char *const extra[] = {"--wait-us", "300000", NULL};
  start(extra);
  detattn_client *c = connect_with(DETATTN_PLANE_SHM, DETATTN_DOORBELL_ON, 20000);
  detattn_call *k = forward_in_flight(c);
  da_test_sleep_ms(30); /* the Forward waits in the daemon */
  double bell0 = metric(VIA_BELL);
  kill(D.pid, SIGTERM);
  int st = DETATTN_OK;
  uint64_t s2 = 0;
  for (int i = 0; i < 200 && st == DETATTN_OK; i++) {
    st = detattn_seq_open(c, &s2); /* left open: the daemon closes it with the connection */
    if (st == DETATTN_OK) da_test_sleep_ms(5);
  }
  ck_assert_msg(st == DETATTN_UNAVAILABLE && strstr(detattn_errmsg(), "draining"), "seq_open: %s: %s",
                detattn_status_name(st), detattn_errmsg());
  ck_assert_msg(metric(VIA_BELL) > bell0, "the draining answer did not come through the ring");
  st = detattn_call_wait(k);
  ck_assert_msg(st == DETATTN_OK, "the Forward in flight: %s: %s", detattn_status_name(st), detattn_errmsg());
  ck_assert_int_eq(da_daemon_wait(&D, 10000), 0);
  ck_assert_msg(WIFEXITED(D.exit_status) && WEXITSTATUS(D.exit_status) == 0, "exit status 0x%x", D.exit_status);
  detattn_close(c);
}
END_TEST

START_TEST(a_daemon_killed_fails_the_doorbell_calls_in_flight_at_once) {
  static const char *const extra[] = {"--wait-us", "1000000", NULL};
  start(extra);
  detattn_client *c = connect_with(DETATTN_PLANE_SHM, DETATTN_DOORBELL_ON, 30000);
  detattn_call *k = forward_in_flight(c);
  da_test_sleep_ms(50); /* taken, and waiting a second for company */
  kill(D.pid, SIGKILL);
  uint64_t t0 = da_now_ns();
  int st = detattn_call_wait(k);
  double ms = (double)(da_now_ns() - t0) * 1e-6;
  ck_assert_msg(st == DETATTN_UNAVAILABLE, "the call in flight: %s: %s", detattn_status_name(st), detattn_errmsg());
  ck_assert_msg(strstr(detattn_errmsg(), "lost"), "message: %s", detattn_errmsg());
  ck_assert_msg(ms < 5000, "the call in flight took %.0f ms to fail (its deadline is 30 s)", ms);
  ck_assert_int_eq(detattn_doorbell_get(c), DETATTN_DOORBELL_OFF);
  detattn_close(c);
}
END_TEST

START_TEST(no_doorbell_where_none_is_offered) {
  static const char *const off[] = {"--doorbell", "0", NULL};
  start(off);
  detattn_client *c;
  detattn_connect_opts o;
  detattn_connect_opts_init(&o);
  o.doorbell = DETATTN_DOORBELL_ON;
  detattn_server_info info;
  ck_assert_int_eq(detattn_connect_ex(&c, D.url, &o), DETATTN_OK);
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_FAILED_PRECONDITION);
  ck_assert_msg(strstr(detattn_errmsg(), "doorbell"), "message: %s", detattn_errmsg());
  detattn_close(c);
  c = connect_with(DETATTN_PLANE_AUTO, DETATTN_DOORBELL_AUTO, 10000);
  ck_assert_int_eq(detattn_doorbell_get(c), DETATTN_DOORBELL_OFF);
  ck_assert_int_eq(detattn_data_plane_get(c), DETATTN_PLANE_SHM);
  uint64_t seq;
  ck_assert_int_eq(detattn_seq_open(c, &seq), DETATTN_OK);
  ck_assert_int_eq(detattn_seq_close(c, seq), DETATTN_OK);
  detattn_close(c);
  /* A ring registered anyway is refused. */
  da_raw r;
  da_raw_open(&r, D.url);
  rring g;
  rring_make(&g, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  char msg[256];
  uint32_t id = 0;
  uint64_t token = 0;
  da_raw_expect(rring_register(&r, &g, 0, &id, &token, msg, sizeof msg), msg, DETATTN_FAILED_PRECONDITION,
         "a ring on a daemon without a doorbell");
  da_raw_close(&r);
  rring_free(&g);
  da_daemon_stop(&D);
  /* Over tcp: AUTO goes over nng, ON fails. */
  static const char *const tcp[] = {"--listen", "tcp://127.0.0.1:0", NULL};
  start(tcp);
  char url[200];
  ck_assert_msg(da_daemon_log_url(&D, url, sizeof url) == 0, "no 'listening on' line in the log");
  detattn_connect_opts_init(&o);
  ck_assert_int_eq(detattn_connect_ex(&c, url, &o), DETATTN_OK);
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_OK);
  ck_assert_int_eq(detattn_doorbell_get(c), DETATTN_DOORBELL_OFF);
  detattn_close(c);
  o.doorbell = DETATTN_DOORBELL_ON;
  ck_assert_int_eq(detattn_connect_ex(&c, url, &o), DETATTN_OK);
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_FAILED_PRECONDITION);
  detattn_close(c);
  /* Bad options are refused at connect. */
  o.doorbell = (detattn_doorbell)7;
  ck_assert_int_eq(detattn_connect_ex(&c, url, &o), DETATTN_INVALID_ARGUMENT);
  o.doorbell = DETATTN_DOORBELL_AUTO;
  o.doorbell_spin_us = -1;
  ck_assert_int_eq(detattn_connect_ex(&c, url, &o), DETATTN_INVALID_ARGUMENT);
}
END_TEST

static Suite *doorbell_suite(void) {
  Suite *s = suite_create("doorbell");
  const da_test_case cases[] = {
      {"same_bits", doorbell_gives_the_bits_of_nng_and_of_the_copy_plane},
      {"threads", many_threads_share_one_doorbell_client},
      {"handover", ring_hand_overs_are_checked},
      {"hostile", hostile_slots_only_hurt_their_own_ring},
      {"follows", the_loop_scans_through_a_clients_compute_between_calls},
      {"worker_follows", the_worker_spins_through_a_clients_compute_between_calls},
      {"give_way", spins_give_way_when_no_core_is_idle},
      {"killed", a_client_killed_with_doorbell_calls_in_flight_leaves_nothing_behind},
      {"deadline", a_doorbell_call_past_its_deadline_fails_and_its_slot_comes_back},
      {"drain", a_draining_daemon_answers_unavailable_through_the_ring},
      {"daemon_killed", a_daemon_killed_fails_the_doorbell_calls_in_flight_at_once},
      {"not_offered", no_doorbell_where_none_is_offered},
  };
  da_test_add_cases(s, cases, sizeof cases / sizeof cases[0], setup, teardown, 120);
  return s;
}

int main(void) { return da_test_run(doorbell_suite()); }
