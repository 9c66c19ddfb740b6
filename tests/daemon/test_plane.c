/*
 * test_plane.c — the shared-memory data plane against the real detattnd (CPU backend): the
 * same bits as the copy path (through `verify` and through tensors allocated in the
 * arena), and hostile or broken clients — references outside an arena, unknown, pending,
 * released and foreign arenas, an unsealed memfd, a hand-over from another process, a
 * client killed with calls in flight, a client unmapping its arena mid-call, a silent side
 * connection — each answered with its status while nothing is written outside the named
 * memory and every arena is unmapped when its connection closes.
 */
#include <check.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
#include "testutil.h"
#include "verify.h"

static da_daemon_proc D;
static uint64_t seed;

/* Model: 2 layers, 4 q / 2 kv heads, d 64, bf16. */
#define HQ 4
#define HKV 2
#define HD 64
#define QROW (HQ * HD * 2)
#define KVROW (HKV * HD * 2)

static void setup(void) {
  static const char *const args[] = {"--layers", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64",
                                     "--dtype", "bf16", "--kv-tokens", "16384", "--split-tokens", "64",
                                     "--tile-tokens", "16", "--threads", "2", "--max-conn-per-peer", "1000", NULL};
  seed = da_test_seed(0x5a4e5eedull);
  if (da_daemon_start(&D, DETATTND_PATH, args) != 0) ck_abort_msg("detattnd did not start");
}

static void teardown(void) {
  da_daemon_stop(&D);
  nng_fini();
}

static detattn_client *connect_plane(detattn_data_plane p) {
  detattn_client *c;
  detattn_connect_opts o;
  detattn_connect_opts_init(&o);
  o.data_plane = p;
  o.arena_bytes = 8u << 20;
  o.timeout_ms = 20000;
  ck_assert_int_eq(detattn_connect_ex(&c, D.url, &o), DETATTN_OK);
  detattn_server_info info;
  int st = detattn_hello(c, &info);
  ck_assert_msg(st == DETATTN_OK, "hello: %s: %s", detattn_status_name(st), detattn_errmsg());
  ck_assert_int_eq(detattn_data_plane_get(c), p);
  return c;
}

static detattn_stats stats_of(detattn_client *c) {
  detattn_stats s;
  ck_assert_int_eq(detattn_stats_get(c, &s), DETATTN_OK);
  return s;
}

/* ---- same bits ---- */

START_TEST(verify_over_shm_matches_the_copy_pass_bitwise) {
  da_verify_cfg cfg = {.url = D.url, .seed = seed, .seqs = 12, .clients = 6, .layers_used = 2, .max_prompt = 150,
                       .decode_steps = 6, .data_plane = DETATTN_PLANE_SHM, .data_plane_set = 1};
  da_verify *v;
  da_verify_result r;
  char msg[512];
  ck_assert_msg(da_verify_alloc(&v, &cfg, msg, sizeof msg) == DETATTN_OK, "%s", msg);
  ck_assert_msg(da_verify_run(v, &r, msg, sizeof msg) == DETATTN_OK, "%s", msg);
  ck_assert_int_eq(r.data_plane_used, DETATTN_PLANE_SHM);
  ck_assert_uint_gt(r.outputs_compared, 1000);
  ck_assert_msg(r.mismatches == 0, "%llu outputs differ between copy and shm, first %s (seed %llu)",
                (unsigned long long)r.mismatches, r.first_mismatch, (unsigned long long)seed);
  da_verify_free(v);
}
END_TEST

/* One prefill of n tokens on a fresh sequence of c; inputs and outputs where the caller says. */
static void prefill(detattn_client *c, int n, const void *q, const void *kv, void *o, float *lse) {
  uint64_t seq;
  ck_assert_int_eq(detattn_seq_open(c, &seq), DETATTN_OK);
  detattn_seq_io io = {.seq = seq, .pos = 0, .n_tokens = (uint32_t)n, .q = q, .k = kv, .v = kv, .o = o, .lse = lse};
  int st = detattn_forward(c, 0, &io, 1);
  ck_assert_msg(st == DETATTN_OK, "forward: %s: %s", detattn_status_name(st), detattn_errmsg());
  ck_assert_int_eq(detattn_seq_close(c, seq), DETATTN_OK);
}

START_TEST(tensors_in_the_arena_travel_by_reference_with_the_same_bits) {
  enum { N = 300 };
  da_rng r;
  da_rng_seed(&r, seed);
  uint16_t *q = malloc(N * QROW), *kv = malloc(N * KVROW), *o_copy = malloc(N * QROW), *o_heap = malloc(N * QROW);
  float *l_copy = malloc(N * HQ * 4), *l_heap = malloc(N * HQ * 4);
  da_rng_fill(&r, DA_BF16, q, N * QROW / 2, 1.0);
  da_rng_fill(&r, DA_BF16, kv, N * KVROW / 2, 1.0);
  detattn_client *cc = connect_plane(DETATTN_PLANE_COPY), *cs = connect_plane(DETATTN_PLANE_SHM);
  prefill(cc, N, q, kv, o_copy, l_copy);
  /* Heap pointers through the shm plane (copied into the arena and back). */
  da_test_poison(DA_BF16, o_heap, N * QROW / 2);
  prefill(cs, N, q, kv, o_heap, l_heap);
  ck_assert_msg(memcmp(o_copy, o_heap, N * QROW) == 0 && memcmp(l_copy, l_heap, N * HQ * 4) == 0,
                "shm with heap buffers differs from copy (seed %llu)", (unsigned long long)seed);
  /* Everything in the arena: no copy at all, the daemon writes o and lse in place. */
  uint16_t *aq = detattn_arena_alloc(cs, N * QROW), *akv = detattn_arena_alloc(cs, N * KVROW);
  uint16_t *ao = detattn_arena_alloc(cs, N * QROW);
  float *al = detattn_arena_alloc(cs, N * HQ * 4);
  ck_assert(aq && akv && ao && al);
  ck_assert_uint_eq((uintptr_t)aq % 64, 0);
  memcpy(aq, q, N * QROW);
  memcpy(akv, kv, N * KVROW);
  da_test_poison(DA_BF16, ao, N * QROW / 2);
  prefill(cs, N, aq, akv, ao, al);
  ck_assert_msg(memcmp(o_copy, ao, N * QROW) == 0 && memcmp(l_copy, al, N * HQ * 4) == 0,
                "shm in the arena differs from copy (seed %llu)", (unsigned long long)seed);
  detattn_stats s = stats_of(cs);
  ck_assert_uint_ge(s.arenas, 1);
  detattn_arena_free(cs, aq);
  detattn_arena_free(cs, akv);
  detattn_arena_free(cs, ao);
  detattn_arena_free(cs, al);
  /* After freeing, one block the size of the whole arena minus a page fits again. */
  void *big = detattn_arena_alloc(cs, (8u << 20) - 4096);
  ck_assert_ptr_nonnull(big);
  detattn_arena_free(cs, big);
  detattn_close(cs);
  /* Closing the connection unmaps its arena. */
  for (int i = 0; i < 100 && stats_of(cc).arenas > 0; i++) da_test_sleep_ms(20);
  ck_assert_uint_eq(stats_of(cc).arenas, 0);
  detattn_close(cc);
  free(q);
  free(kv);
  free(o_copy);
  free(o_heap);
  free(l_copy);
  free(l_heap);
}
END_TEST

/* A call answered but not yet waited for when its client closes: detattn_call_wait after
 * detattn_close returns CANCELLED and writes nothing. Before, it copied the outputs out of
 * the unmapped arena (shm: a crash) and freed arena blocks through the freed client. On
 * both planes: the later call on the same sequence runs after it, so its reply is in. */
START_TEST(a_call_answered_but_not_waited_for_ends_cancelled_after_close) {
  enum { N = 96 };
  da_rng r;
  da_rng_seed(&r, seed);
  uint16_t *q = malloc(N * QROW), *kv = malloc(N * KVROW), *o = malloc(N * QROW), *o1 = malloc(QROW);
  uint16_t *poison = malloc(N * QROW);
  float *lse = malloc(N * HQ * 4), *lse1 = malloc(HQ * 4);
  da_test_poison(DA_BF16, poison, N * QROW / 2);
  da_rng_fill(&r, DA_BF16, q, N * QROW / 2, 1.0);
  da_rng_fill(&r, DA_BF16, kv, N * KVROW / 2, 1.0);
  static const detattn_data_plane planes[] = {DETATTN_PLANE_SHM, DETATTN_PLANE_COPY};
  for (int i = 0; i < 2; i++) {
    detattn_client *c = connect_plane(planes[i]);
    uint64_t seq;
    ck_assert_int_eq(detattn_seq_open(c, &seq), DETATTN_OK);
    da_test_poison(DA_BF16, o, N * QROW / 2);
    memset(lse, 0xff, N * HQ * 4);
    detattn_seq_io a = {.seq = seq, .pos = 0, .n_tokens = N, .q = q, .k = kv, .v = kv, .o = o, .lse = lse};
    detattn_call *k;
    ck_assert_int_eq(detattn_forward_start(c, 0, &a, 1, &k), DETATTN_OK);
    detattn_seq_io b = {.seq = seq, .pos = N, .n_tokens = 1, .q = q, .k = kv, .v = kv, .o = o1, .lse = lse1};
    int st = detattn_forward(c, 0, &b, 1);
    ck_assert_msg(st == DETATTN_OK, "plane %d: the later forward: %s: %s", planes[i], detattn_status_name(st),
                  detattn_errmsg());
    detattn_close(c);
    st = detattn_call_wait(k);
    ck_assert_msg(st == DETATTN_CANCELLED, "plane %d: waited after close: %s: %s", planes[i],
                  detattn_status_name(st), detattn_errmsg());
    ck_assert_msg(memcmp(o, poison, N * QROW) == 0, "plane %d: outputs written after close", planes[i]);
  }
  free(q);
  free(kv);
  free(o);
  free(o1);
  free(poison);
  free(lse);
  free(lse1);
}
END_TEST

/* ---- hostile and broken clients, with raw requests ---- */

/* Hands fd over for arena id; the daemon's status byte (DETATTN_UNAVAILABLE: no answer). */
static int handover(int fd, uint32_t id, uint64_t token) {
  return da_raw_side_send(D.url, 0x52414144u /* "DAAR" */, &fd, 1, id, token);
}

static uint32_t raw_register(da_raw *r, uint64_t size, uint64_t *token) {
  char msg[256];
  uint32_t id = 0;
  da_raw_expect(da_raw_register(r, size, NULL, &id, token, msg, sizeof msg), msg, DETATTN_OK, "register_arena");
  return id;
}

/* A memfd of size bytes, sealed against shrinking when sealed is set. */
static int make_memfd(size_t size, int sealed) {
  int fd = memfd_create("test-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(ftruncate(fd, (off_t)size), 0);
  if (sealed) ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  return fd;
}

START_TEST(bad_references_and_arenas_get_their_codes_and_write_nothing) {
  enum { SIZE = 1 << 20, N = 16 };
  da_raw r;
  da_raw_open(&r, D.url);
  char msg[256];
  uint64_t token, seq = da_raw_seq_open(&r);
  uint32_t id = raw_register(&r, SIZE, &token);
  da_raw_fwd x;
  /* Not handed over yet. */
  da_raw_fwd_init(&x, seq, id, N, 0, QROW, KVROW, HQ * 4);
  da_raw_expect(da_raw_call(&r, &x.rq, msg, sizeof msg, NULL), msg, DETATTN_FAILED_PRECONDITION, "arena not handed over");
  /* An unsealed memfd is refused (it could be truncated under the daemon). */
  int bad = make_memfd(SIZE, 0);
  ck_assert_int_eq(handover(bad, id, token), DETATTN_INVALID_ARGUMENT);
  close(bad);
  ck_assert_msg(da_daemon_log_has(&D, "sealed against shrinking"), "the refusal was not logged");
  /* A wrong token is refused. */
  int fd = make_memfd(SIZE, 1);
  ck_assert_int_eq(handover(fd, id, token ^ 1), DETATTN_NOT_FOUND);
  /* A hand-over from another process (its pid is not the registering one's) is refused. */
  pid_t pid = fork();
  if (pid == 0) _exit(handover(fd, id, token) == DETATTN_PERMISSION_DENIED ? 0 : 1);
  int status;
  ck_assert_int_eq(waitpid(pid, &status, 0), pid);
  ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "another process handed the arena over");
  /* The right one. */
  ck_assert_int_eq(handover(fd, id, token), 0);
  uint8_t *mem = mmap(NULL, SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ck_assert_ptr_ne(mem, MAP_FAILED);
  da_rng rg;
  da_rng_seed(&rg, seed);
  da_rng_fill(&rg, DA_BF16, mem, SIZE / 2, 1.0);
  uint8_t *before = malloc(SIZE);
  memcpy(before, mem, SIZE);
  /* References outside the arena, overflowing, misaligned, or of the wrong length. */
  da_raw_fwd_init(&x, seq, id, N, SIZE - 100, QROW, KVROW, HQ * 4);
  da_raw_expect(da_raw_call(&r, &x.rq, msg, sizeof msg, NULL), msg, DETATTN_INVALID_ARGUMENT, "q past the arena's end");
  da_raw_fwd_init(&x, seq, id, N, 0, QROW, KVROW, HQ * 4);
  x.ref[3].offset = UINT64_MAX - 10;
  da_raw_expect(da_raw_call(&r, &x.rq, msg, sizeof msg, NULL), msg, DETATTN_INVALID_ARGUMENT, "o offset overflowing");
  da_raw_fwd_init(&x, seq, id, N, 1, QROW, KVROW, HQ * 4);
  da_raw_expect(da_raw_call(&r, &x.rq, msg, sizeof msg, NULL), msg, DETATTN_INVALID_ARGUMENT, "misaligned q");
  da_raw_fwd_init(&x, seq, id, N, 0, QROW, KVROW, HQ * 4);
  x.ref[0].length -= 2;
  da_raw_expect(da_raw_call(&r, &x.rq, msg, sizeof msg, NULL), msg, DETATTN_INVALID_ARGUMENT, "q length wrong");
  /* Unknown arena; the arena of another connection. */
  da_raw_fwd_init(&x, seq, id + 1000, N, 0, QROW, KVROW, HQ * 4);
  da_raw_expect(da_raw_call(&r, &x.rq, msg, sizeof msg, NULL), msg, DETATTN_NOT_FOUND, "unknown arena");
  da_raw other;
  da_raw_open(&other, D.url);
  uint64_t oseq = da_raw_seq_open(&other);
  da_raw_fwd_init(&x, oseq, id, N, 0, QROW, KVROW, HQ * 4);
  da_raw_expect(da_raw_call(&other, &x.rq, msg, sizeof msg, NULL), msg, DETATTN_NOT_FOUND, "another connection's arena");
  ck_assert_msg(memcmp(before, mem, SIZE) == 0, "a refused forward wrote into the arena");
  /* Nothing was appended: pos 0 is still the sequence's length, and a good forward works. */
  da_raw_fwd_init(&x, seq, id, N, 0, QROW, KVROW, HQ * 4);
  da_raw_expect(da_raw_call(&r, &x.rq, msg, sizeof msg, NULL), msg, DETATTN_OK, "good forward");
  size_t o_at = (size_t)N * (QROW + 2 * KVROW), end = o_at + (size_t)N * (QROW + HQ * 4);
  ck_assert_msg(memcmp(before, mem, o_at) == 0 && memcmp(before + end, mem + end, SIZE - end) == 0,
                "the daemon wrote outside o and lse");
  ck_assert_msg(memcmp(before + o_at, mem + o_at, end - o_at) != 0, "o and lse were not written");
  /* Released: later references fail; a second release is NOT_FOUND. */
  Detattn__V1__Request rq = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__UnregisterArena ua = DETATTN__V1__UNREGISTER_ARENA__INIT;
  ua.arena = id;
  rq.op_case = DETATTN__V1__REQUEST__OP_UNREGISTER_ARENA;
  rq.unregister_arena = &ua;
  da_raw_expect(da_raw_call(&r, &rq, msg, sizeof msg, NULL), msg, DETATTN_OK, "unregister");
  da_raw_expect(da_raw_call(&r, &rq, msg, sizeof msg, NULL), msg, DETATTN_NOT_FOUND, "unregister twice");
  x.fs.pos = N;
  da_raw_expect(da_raw_call(&r, &x.rq, msg, sizeof msg, NULL), msg, DETATTN_NOT_FOUND, "released arena");
  /* Arenas over the size limit or of size 0. */
  Detattn__V1__RegisterArena ra = DETATTN__V1__REGISTER_ARENA__INIT;
  rq = (Detattn__V1__Request)DETATTN__V1__REQUEST__INIT;
  rq.op_case = DETATTN__V1__REQUEST__OP_REGISTER_ARENA;
  rq.register_arena = &ra;
  da_raw_expect(da_raw_call(&r, &rq, msg, sizeof msg, NULL), msg, DETATTN_INVALID_ARGUMENT, "arena of 0 bytes");
  ra.size = 1ull << 50;
  da_raw_expect(da_raw_call(&r, &rq, msg, sizeof msg, NULL), msg, DETATTN_INVALID_ARGUMENT, "arena of 1 PiB");
  munmap(mem, SIZE);
  close(fd);
  free(before);
  da_raw_close(&other);
  da_raw_close(&r);
  detattn_client *c = connect_plane(DETATTN_PLANE_COPY);
  for (int i = 0; i < 100 && stats_of(c).arenas > 0; i++) da_test_sleep_ms(20);
  ck_assert_uint_eq(stats_of(c).arenas, 0);
  detattn_close(c);
}
END_TEST

/* The child: an shm client with a big forward in flight; it unmaps its own arena while the
 * call runs, then waits to be killed. */
static void shm_victim(int fd_go, int fd_ready, int unmap) {
  char go;
  if (read(fd_go, &go, 1) != 1) _exit(9);
  detattn_client *c;
  detattn_connect_opts o;
  detattn_connect_opts_init(&o);
  o.data_plane = DETATTN_PLANE_SHM;
  o.arena_bytes = 32u << 20;
  detattn_server_info info;
  if (detattn_connect_ex(&c, D.url, &o) || detattn_hello(c, &info)) _exit(10);
  void *q;
  int failed = da_raw_calls_in_flight(c, QROW, KVROW, &q);
  if (failed) _exit(10 + failed);
  if (unmap) {
    /* Pull the whole arena out from under the daemon's feet (its own mapping stays). */
    uint8_t *base = (uint8_t *)q - 64;
    munmap((void *)((uintptr_t)base & ~(uintptr_t)4095), 32u << 20);
  }
  if (write(fd_ready, "r", 1) != 1) _exit(14);
  for (;;) pause();
}

START_TEST(a_client_killed_or_unmapping_mid_call_leaves_nothing_behind) {
  /* Both clients fork before this process starts nng; each waits for its go byte. */
  int go[2][2], ready[2][2];
  pid_t pid[2];
  for (int round = 0; round < 2; round++) {
    ck_assert_int_eq(pipe(go[round]), 0);
    ck_assert_int_eq(pipe(ready[round]), 0);
    pid[round] = fork();
    if (pid[round] == 0) {
      close(go[round][1]);
      close(ready[round][0]);
      shm_victim(go[round][0], ready[round][1], round);
    }
    close(go[round][0]);
    close(ready[round][1]);
  }
  detattn_client *c = connect_plane(DETATTN_PLANE_COPY);
  for (int round = 0; round < 2; round++) {
    ck_assert_int_eq(write(go[round][1], "g", 1), 1);
    struct pollfd pf = {.fd = ready[round][0], .events = POLLIN};
    char b;
    int ok = poll(&pf, 1, 20000) == 1 && read(ready[round][0], &b, 1) == 1;
    close(ready[round][0]);
    close(go[round][1]);
    detattn_stats s = stats_of(c);
    kill(pid[round], SIGKILL);
    int status;
    waitpid(pid[round], &status, 0);
    ck_assert_msg(ok, "round %d: the shm client did not start its calls (status 0x%x)", round, status);
    ck_assert_uint_ge(s.arenas, 1);
    for (int i = 0; i < 300; i++) {
      s = stats_of(c);
      if (s.arenas == 0 && s.sequences == 0 && s.kv_pages_used == 0) break;
      da_test_sleep_ms(20);
    }
    ck_assert_msg(s.arenas == 0 && s.sequences == 0 && s.kv_pages_used == 0,
                  "round %d: %u arenas, %u sequences, %u pages left", round, s.arenas, s.sequences, s.kv_pages_used);
  }
  /* A side connection that sends nothing is closed; the daemon serves on. */
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%.90s.arena", D.url + 6);
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ck_assert_int_eq(connect(s, (struct sockaddr *)&sa, sizeof sa), 0);
  struct pollfd pf = {.fd = s, .events = POLLIN};
  uint8_t code = 0;
  ck_assert_msg(poll(&pf, 1, 6000) == 1 && read(s, &code, 1) == 1 && code == DETATTN_DEADLINE_EXCEEDED,
                "a silent side connection was not closed with DEADLINE_EXCEEDED (%u)", code);
  close(s);
  uint64_t seq;
  ck_assert_int_eq(detattn_seq_open(c, &seq), DETATTN_OK);
  ck_assert_int_eq(detattn_seq_close(c, seq), DETATTN_OK);
  detattn_close(c);
}
END_TEST

START_TEST(shm_is_refused_over_tcp_and_auto_falls_back_to_copy) {
  static const char *const args[] = {"--layers", "1", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64",
                                     "--listen", "tcp://127.0.0.1:0", NULL};
  da_daemon_proc t;
  ck_assert_int_eq(da_daemon_start(&t, DETATTND_PATH, args), 0);
  char url[200];
  ck_assert_msg(da_daemon_log_url(&t, url, sizeof url) == 0, "no 'listening on' line in the log");
  detattn_connect_opts o;
  detattn_connect_opts_init(&o);
  detattn_client *c;
  detattn_server_info info;
  ck_assert_int_eq(detattn_connect_ex(&c, url, &o), DETATTN_OK); /* AUTO */
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_OK);
  ck_assert_int_eq(detattn_data_plane_get(c), DETATTN_PLANE_COPY);
  ck_assert_uint_eq(info.data_planes, 1u << DETATTN_PLANE_COPY);
  detattn_close(c);
  o.data_plane = DETATTN_PLANE_SHM;
  ck_assert_int_eq(detattn_connect_ex(&c, url, &o), DETATTN_OK);
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_FAILED_PRECONDITION);
  ck_assert_msg(strstr(detattn_errmsg(), "shared-memory") != NULL, "message: %s", detattn_errmsg());
  detattn_close(c);
  da_daemon_stop(&t);
}
END_TEST

START_TEST(the_cuda_plane_is_refused_clearly_by_a_daemon_without_it) {
  /* The option: a CPU daemon offers copy and shm, not cuda. */
  detattn_connect_opts o;
  detattn_connect_opts_init(&o);
  o.data_plane = DETATTN_PLANE_CUDA;
  detattn_client *c;
  detattn_server_info info;
  ck_assert_int_eq(detattn_connect_ex(&c, D.url, &o), DETATTN_OK);
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_FAILED_PRECONDITION);
  ck_assert_msg(strstr(detattn_errmsg(), "no cuda plane") != NULL, "message: %s", detattn_errmsg());
  detattn_close(c);

  /* The call, from a client on the default plane: refused before anything is sent. */
  c = connect_plane(DETATTN_PLANE_SHM);
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_OK);
  ck_assert_uint_eq(info.data_planes, (1u << DETATTN_PLANE_COPY) | (1u << DETATTN_PLANE_SHM));
  uint64_t seq;
  ck_assert_int_eq(detattn_seq_open(c, &seq), DETATTN_OK);
  uint16_t buf[QROW];
  detattn_seq_io io = {.seq = seq, .pos = 0, .n_tokens = 1, .q = buf, .k = buf, .v = buf, .o = buf};
  ck_assert_int_eq(detattn_forward_cuda(c, 0, &io, 1, NULL), DETATTN_FAILED_PRECONDITION);
  ck_assert_msg(strstr(detattn_errmsg(), "no cuda plane") != NULL, "message: %s", detattn_errmsg());

  /* Raw requests: RegisterCuda, and a Forward naming an event nobody registered. */
  da_raw r;
  da_raw_open(&r, D.url);
  char msg[256];
  uint8_t handle[64] = {1};
  Detattn__V1__Request rq = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__RegisterCuda rc = DETATTN__V1__REGISTER_CUDA__INIT;
  rc.handle = (ProtobufCBinaryData){sizeof handle, handle};
  rc.size = 4096;
  rq.op_case = DETATTN__V1__REQUEST__OP_REGISTER_CUDA;
  rq.register_cuda = &rc;
  da_raw_expect(da_raw_call(&r, &rq, msg, sizeof msg, NULL), msg, DETATTN_FAILED_PRECONDITION, "register_cuda on a CPU daemon");
  rc.handle.len = 0;
  da_raw_expect(da_raw_call(&r, &rq, msg, sizeof msg, NULL), msg, DETATTN_INVALID_ARGUMENT, "register_cuda without a handle");
  uint64_t token = 0;
  uint32_t arena = raw_register(&r, 1 << 20, &token);
  int fd = make_memfd(1 << 20, 1);
  ck_assert_int_eq(handover(fd, arena, token), 0);
  close(fd);
  uint64_t rseq = da_raw_seq_open(&r);
  da_raw_fwd x;
  da_raw_fwd_init(&x, rseq, arena, 2, 0, QROW, KVROW, HQ * 4);
  x.f.wait_event = 77;
  da_raw_expect(da_raw_call(&r, &x.rq, msg, sizeof msg, NULL), msg, DETATTN_NOT_FOUND, "forward with an unknown wait_event");
  x.f.wait_event = 0;
  x.f.signal_event = arena; /* an arena is not an event */
  da_raw_expect(da_raw_call(&r, &x.rq, msg, sizeof msg, NULL), msg, DETATTN_NOT_FOUND, "forward signalling an arena");
  /* Nothing was appended: the same Forward at pos 0 still succeeds. */
  x.f.signal_event = 0;
  da_raw_expect(da_raw_call(&r, &x.rq, msg, sizeof msg, NULL), msg, DETATTN_OK, "forward after the refusals");
  da_raw_close(&r);
  detattn_close(c);
}
END_TEST

static Suite *plane_suite(void) {
  Suite *s = suite_create("plane");
  TCase *t = tcase_create("shm");
  tcase_add_checked_fixture(t, setup, teardown);
  tcase_set_timeout(t, 60);
  tcase_add_test(t, verify_over_shm_matches_the_copy_pass_bitwise);
  tcase_add_test(t, tensors_in_the_arena_travel_by_reference_with_the_same_bits);
  tcase_add_test(t, a_call_answered_but_not_waited_for_ends_cancelled_after_close);
  tcase_add_test(t, bad_references_and_arenas_get_their_codes_and_write_nothing);
  tcase_add_test(t, a_client_killed_or_unmapping_mid_call_leaves_nothing_behind);
  tcase_add_test(t, shm_is_refused_over_tcp_and_auto_falls_back_to_copy);
  tcase_add_test(t, the_cuda_plane_is_refused_clearly_by_a_daemon_without_it);
  suite_add_tcase(s, t);
  return s;
}

int main(void) { return da_test_run(plane_suite()); }
