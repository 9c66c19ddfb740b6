/*
 * test_device_failure.c — detattnd's device-failure path, made reachable without a GPU by
 * the test setting --fail-after-batches N (the worker reports batch N and every later one
 * as DETATTN_UNAVAILABLE "injected device failure", as a sticky device error would). The
 * real daemon (CPU backend) on an ipc:// socket in a temporary directory, driven through
 * libdetattn: the requests of the failing batch are answered UNAVAILABLE or INTERNAL with
 * the backend's message, nothing hangs, and the daemon exits 3 by itself.
 *
 * Usage: test_server_device_failure <path to detattnd>
 */
#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "da.h"
#include "daemon_proc.h"
#include "detattn.h"
#include "testutil.h"

#define HQ 4
#define HKV 2
#define HD 64
#define TOK 8 /* tokens per forward */
#define MAX_FWD 6

static const char *daemon_path;
static da_daemon_proc D;
static uint64_t seed;
static da_rng rng;

/* Batches of at most 32 tokens: one forward (8 appended + 8 query tokens) per batch when
 * alone, and with several clients a second batch is formed and handed to the worker while
 * the first one runs. */
static void start(const char *fail_after) {
  const char *args[] = {"--log-level", "debug","--threads", "1", "--layers", "2", "--q-heads", "4", "--kv-heads", "2",
                        "--head-dim", "64", "--page-tokens", "16", "--kv-tokens", "4096",
                        "--split-tokens", "16", "--tile-tokens", "16", "--max-request-tokens", "16",
                        "--max-batch-tokens", "32", "--contexts", "16", "--fail-after-batches",
                        fail_after, NULL};
  seed = da_test_seed(0xfa11);
  da_rng_seed(&rng, seed);
  ck_assert_msg(da_daemon_start(&D, daemon_path, args) == 0, "detattnd did not start");
}

static void teardown(void) { da_daemon_stop(&D); }

static detattn_client *connect_ok(void) {
  detattn_client *c;
  ck_assert_msg(detattn_connect(&c, D.url) == DETATTN_OK, "connect: %s", detattn_errmsg());
  detattn_set_timeout(c, 10000);
  return c;
}

/* The daemon must exit 3 by itself, promptly. */
static void assert_exits_3(void) {
  int rc = da_daemon_wait(&D, 10000);
  if (rc != 0) da_daemon_dump_log(&D);
  ck_assert_msg(rc == 0, "detattnd still running 10 s after the device failure (seed %llu)",
                (unsigned long long)seed);
  int st = D.exit_status;
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 3) da_daemon_dump_log(&D);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 3, "detattnd exit status 0x%x, want exit 3", st);
}

static int is_device_error(int st) { return st == DETATTN_UNAVAILABLE || st == DETATTN_INTERNAL; }

START_TEST(the_failing_batch_is_answered_unavailable_and_the_daemon_exits_3) {
  start("3");
  detattn_client *c = connect_ok();
  uint64_t seq;
  ck_assert_int_eq(detattn_seq_open(c, &seq), DETATTN_OK);
  const da_model m = {.n_layers = 2, .n_q_heads = HQ, .n_kv_heads = HKV, .head_dim = HD,
                      .dtype = DA_BF16, .scale = 0.125f};
  const size_t qn = (size_t)TOK * HQ * HD, kn = (size_t)TOK * HKV * HD;
  uint16_t *k_all = malloc(MAX_FWD * kn * 2), *v_all = malloc(MAX_FWD * kn * 2);
  uint16_t *o = malloc(qn * 2);
  double *ref = malloc(qn * sizeof(double));
  ck_assert(k_all && v_all && o && ref);
  int n_ok = 0, failed_at = -1;
  for (int f = 0; f < MAX_FWD && failed_at < 0; f++) {
    uint16_t *q = da_test_random_tensor(&rng, DA_BF16, qn, 1.0);
    uint16_t *k = da_test_random_tensor(&rng, DA_BF16, kn, 1.0);
    uint16_t *v = da_test_random_tensor(&rng, DA_BF16, kn, 1.0);
    ck_assert(q && k && v);
    memcpy(k_all + f * kn, k, kn * 2);
    memcpy(v_all + f * kn, v, kn * 2);
    detattn_seq_io io = {.seq = seq, .pos = (uint32_t)(f * TOK), .n_tokens = TOK, .q = q, .k = k, .v = v, .o = o};
    int st = detattn_forward(c, 0, &io, 1);
    if (st == DETATTN_OK) {
      ck_assert_int_eq(da_test_ref_attention(&m, k_all, v_all, (f + 1) * TOK, q, f * TOK, TOK, ref, NULL), 0);
      double err = da_test_rel_err(DA_BF16, o, ref, qn);
      ck_assert_msg(err < 2e-2, "forward %d before the failure: rel. error %g (seed %llu)", f, err,
                    (unsigned long long)seed);
      n_ok++;
    } else {
      ck_assert_msg(is_device_error(st), "forward %d: %s (%s), want UNAVAILABLE or INTERNAL (seed %llu)", f,
                    detattn_status_name(st), detattn_errmsg(), (unsigned long long)seed);
      ck_assert_msg(strstr(detattn_errmsg(), "injected device failure") != NULL,
                    "forward %d: message '%s' does not name the failure", f, detattn_errmsg());
      failed_at = f;
    }
    free(q), free(k), free(v);
  }
  /* One batch per forward here: batches 1 and 2 succeed, batch 3 is the first to fail. */
  ck_assert_msg(failed_at == 2 && n_ok == 2, "failed at forward %d after %d successes, want 2 and 2", failed_at,
                n_ok);
  /* A request after the failure is refused at once, or finds the daemon gone. */
  uint16_t *q = da_test_random_tensor(&rng, DA_BF16, qn, 1.0);
  detattn_seq_io io = {.seq = seq, .pos = 3 * TOK, .n_tokens = TOK, .q = q, .k = k_all, .v = v_all, .o = o};
  int st = detattn_forward(c, 0, &io, 1);
  ck_assert_msg(st != DETATTN_OK && st != DETATTN_DEADLINE_EXCEEDED, "forward after the failure: %s (%s)",
                detattn_status_name(st), detattn_errmsg());
  free(q);
  detattn_close(c);
  assert_exits_3();
  free(k_all), free(v_all), free(o), free(ref);
}
END_TEST

#define N_CLIENTS 4
#define PER_CLIENT 3

/* One run of the scenario: every forward is answered (OK before the failure, UNAVAILABLE or
 * INTERNAL with a message after it) and the daemon exits 3. Returns whether the daemon had
 * two batches in the worker at some point, which depends on timing. */
static int several_clients_scenario(void) {
  start("2");
  detattn_client *c[N_CLIENTS];
  uint64_t seq[N_CLIENTS];
  const size_t qn = (size_t)TOK * HQ * HD, kn = (size_t)TOK * HKV * HD;
  void *bufs[N_CLIENTS][PER_CLIENT][4];
  detattn_seq_io io[N_CLIENTS][PER_CLIENT];
  detattn_call *call[N_CLIENTS][PER_CLIENT];
  int started[N_CLIENTS][PER_CLIENT];
  char start_msg[N_CLIENTS][PER_CLIENT][256];
  for (int i = 0; i < N_CLIENTS; i++) {
    c[i] = connect_ok();
    detattn_server_info info;
    ck_assert_int_eq(detattn_hello(c[i], &info), DETATTN_OK); /* forward_start needs no round trip now */
    ck_assert_int_eq(detattn_seq_open(c[i], &seq[i]), DETATTN_OK);
  }
  /* Stopped while the requests are sent, the daemon finds them all waiting when it goes on. */
  kill(D.pid, SIGSTOP);
  /* Every client queues PER_CLIENT forwards at once, so batches are formed while others run. */
  for (int j = 0; j < PER_CLIENT; j++)
    for (int i = 0; i < N_CLIENTS; i++) {
      bufs[i][j][0] = da_test_random_tensor(&rng, DA_BF16, qn, 1.0);
      bufs[i][j][1] = da_test_random_tensor(&rng, DA_BF16, kn, 1.0);
      bufs[i][j][2] = da_test_random_tensor(&rng, DA_BF16, kn, 1.0);
      bufs[i][j][3] = malloc(qn * 2);
      ck_assert(bufs[i][j][0] && bufs[i][j][1] && bufs[i][j][2] && bufs[i][j][3]);
      io[i][j] = (detattn_seq_io){.seq = seq[i], .pos = (uint32_t)(j * TOK), .n_tokens = TOK, .q = bufs[i][j][0],
                                  .k = bufs[i][j][1], .v = bufs[i][j][2], .o = bufs[i][j][3]};
      /* Once the failure is known, a start may already be refused with it. */
      int st = detattn_forward_start(c[i], 0, &io[i][j], 1, &call[i][j]);
      if (st != DETATTN_OK) {
        call[i][j] = NULL;
        started[i][j] = st;
        snprintf(start_msg[i][j], sizeof start_msg[i][j], "%s", detattn_errmsg());
      }
    }
  kill(D.pid, SIGCONT);
  int n_ok = 0, n_failed = 0, n_named = 0;
  for (int i = 0; i < N_CLIENTS; i++)
    for (int j = 0; j < PER_CLIENT; j++) {
      int st = call[i][j] ? detattn_call_wait(call[i][j]) : started[i][j];
      const char *msg = call[i][j] ? detattn_errmsg() : start_msg[i][j];
      if (st == DETATTN_OK) {
        n_ok++;
        continue;
      }
      ck_assert_msg(is_device_error(st), "client %d forward %d: %s (%s), want UNAVAILABLE or INTERNAL (seed %llu)",
                    i, j, detattn_status_name(st), msg, (unsigned long long)seed);
      ck_assert_msg(msg[0] != '\0', "client %d forward %d: %s without a message", i, j, detattn_status_name(st));
      n_failed++;
      if (strstr(msg, "injected device failure") != NULL) n_named++;
    }
  ck_assert_msg(n_failed > 0 && n_named > 0, "%d ok, %d failed, %d naming the injected failure", n_ok, n_failed,
                n_named);
  int two_in_worker = da_daemon_log_has(&D, "2 in the worker");
  for (int i = 0; i < N_CLIENTS; i++) {
    detattn_close(c[i]);
    for (int j = 0; j < PER_CLIENT; j++)
      for (int b = 0; b < 4; b++) free(bufs[i][j][b]);
  }
  assert_exits_3();
  return two_in_worker;
}

START_TEST(forwards_in_flight_from_several_clients_are_all_answered_when_the_device_fails) {
  /* The two-batches-in-the-worker path must be among the runs; on a loaded machine one run
   * may form its batches one at a time, so try a few fresh daemons. */
  enum { ATTEMPTS = 5 };
  int hit = 0;
  for (int a = 0; a < ATTEMPTS && !hit; a++) {
    hit = several_clients_scenario();
    if (!hit) da_daemon_dump_log(&D);
    da_daemon_stop(&D);
  }
  ck_assert_msg(hit, "no second batch was handed to the worker while one ran, in %d runs", ATTEMPTS);
}
END_TEST

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s <path to detattnd>\n", argv[0]);
    return 2;
  }
  daemon_path = argv[1];
  signal(SIGPIPE, SIG_IGN);
  Suite *s = suite_create("device_failure");
  TCase *tc = tcase_create("device_failure");
  tcase_add_checked_fixture(tc, NULL, teardown);
  tcase_set_timeout(tc, 50);
  tcase_add_test(tc, the_failing_batch_is_answered_unavailable_and_the_daemon_exits_3);
  tcase_add_test(tc, forwards_in_flight_from_several_clients_are_all_answered_when_the_device_fails);
  suite_add_tcase(s, tc);
  return da_test_run(s);
}
