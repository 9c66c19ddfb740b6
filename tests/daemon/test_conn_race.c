/*
 * test_conn_race.c — a connection that libnng removes (REM_POST) before it reports it added
 * (ADD_POST), against the real detattnd built with -DDETATTN_FAULT_INJECT=ON on an ipc://
 * socket in a temporary directory. libnng 1.5.2 runs REM_POST on its reaper thread without
 * waiting for the thread that reports ADD_POST, and starts receiving from the connection
 * before either: so a client may connect, open sequences, send forwards and hang up while
 * that thread is preempted. DA_FAULT_CONNECT_DELAY_MS (server/fault.c) holds every ADD_POST
 * back for DELAY_MS to force that order. The soak saw it once as one sequence with 0 pages
 * left behind by a client killed mid-request (soak_short, seed 1795796923).
 *
 * Each tcase is its own ctest (CK_RUN_CASE).
 */
#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "da.h"
#include "daemon_proc.h"
#include "detattn.h"
#include "testutil.h"

#include <nng/nng.h>

enum { HQ = 4, HKV = 2, HD = 64, PROMPT = 40, DELAY_MS = 800 };

static da_daemon_proc D;
static uint64_t seed;
static uint16_t q[PROMPT * HQ * HD], kv[PROMPT * HKV * HD], o[PROMPT * HQ * HD];

static void setup(void) {
  static const char *const args[] = {"--layers", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64",
                                     "--kv-tokens", "4096", "--split-tokens", "64", "--tile-tokens", "16",
                                     "--threads", "1", "--max-seqs", "64", NULL};
  seed = da_test_seed(0xc0ec7ull);
  da_rng g;
  da_rng_seed(&g, seed);
  da_rng_fill(&g, DA_BF16, q, sizeof q / 2, 1.0);
  da_rng_fill(&g, DA_BF16, kv, sizeof kv / 2, 1.0);
  char v[16];
  snprintf(v, sizeof v, "%d", DELAY_MS);
  setenv("DA_FAULT_CONNECT_DELAY_MS", v, 1);
  int rv = da_daemon_start(&D, DETATTND_PATH, args);
  unsetenv("DA_FAULT_CONNECT_DELAY_MS");
  if (rv != 0) ck_abort_msg("detattnd did not start");
}

static void teardown(void) {
  da_daemon_stop(&D);
  nng_fini();
}

static detattn_client *connect_ok(void) {
  detattn_client *c;
  ck_assert_int_eq(detattn_connect(&c, D.url), DETATTN_OK);
  detattn_set_timeout(c, 20000);
  return c;
}

/* The client's work and hang-up must fit in the delay, or the order was not forced. */
static void check_within_delay(uint64_t t0) {
  double ms = (double)(da_now_ns() - t0) / 1e6;
  ck_assert_msg(ms < DELAY_MS / 2, "the client took %.0f ms, not well within the %d ms connect delay: the order "
                "under test was not forced (raise DELAY_MS)", ms, DELAY_MS);
}

/* A fresh client (itself held back DELAY_MS, served meanwhile) sees no sequence, no page and
 * no other client left; it runs a sequence of its own; SIGTERM exits 0 (under ASan: no leak). */
static void check_nothing_left(void) {
  detattn_client *c = connect_ok();
  detattn_stats s = {0};
  for (int i = 0; i < 150; i++) {
    ck_assert_int_eq(detattn_stats_get(c, &s), DETATTN_OK);
    if (s.sequences == 0 && s.kv_pages_used == 0 && s.clients == 1) break;
    da_test_sleep_ms(20);
  }
  ck_assert_msg(s.sequences == 0 && s.kv_pages_used == 0 && s.clients == 1,
                "%u sequences, %u pages and %u clients (1: this one) left behind by a connection gone before its "
                "connect was reported", s.sequences, s.kv_pages_used, s.clients);
  uint64_t a;
  ck_assert_int_eq(detattn_seq_open(c, &a), DETATTN_OK);
  for (uint32_t l = 0; l < 2; l++) {
    detattn_seq_io io = {.seq = a, .pos = 0, .n_tokens = PROMPT, .q = q, .k = kv, .v = kv, .o = o};
    ck_assert_int_eq(detattn_forward(c, l, &io, 1), DETATTN_OK);
  }
  ck_assert_int_eq(detattn_seq_close(c, a), DETATTN_OK);
  detattn_close(c);
  char why[128];
  ck_assert_msg(da_daemon_term_clean(&D, 20000, why, sizeof(why)) == 0, "%s", why);
}

/* Sequences opened (one prefilled, one empty) and the connection closed, all before its
 * ADD_POST: its sequences and pages are freed as for any closed connection. */
START_TEST(sequences_of_a_connection_gone_before_its_connect_is_reported_are_freed) {
  uint64_t t0 = da_now_ns();
  detattn_client *c = connect_ok();
  uint64_t a, b;
  ck_assert_int_eq(detattn_seq_open(c, &a), DETATTN_OK);
  for (uint32_t l = 0; l < 2; l++) {
    detattn_seq_io io = {.seq = a, .pos = 0, .n_tokens = PROMPT, .q = q, .k = kv, .v = kv, .o = o};
    ck_assert_int_eq(detattn_forward(c, l, &io, 1), DETATTN_OK);
  }
  ck_assert_int_eq(detattn_seq_open(c, &b), DETATTN_OK);
  detattn_close(c);
  check_within_delay(t0);
  check_nothing_left();
}
END_TEST

/* The same with forwards still in the daemon when the connection goes: the sequence closes
 * once they are done. */
START_TEST(a_connection_gone_before_its_connect_is_reported_with_forwards_in_flight_is_freed) {
  uint64_t t0 = da_now_ns();
  detattn_client *c = connect_ok();
  uint64_t a;
  ck_assert_int_eq(detattn_seq_open(c, &a), DETATTN_OK);
  detattn_call *calls[2];
  for (uint32_t l = 0; l < 2; l++) {
    detattn_seq_io io = {.seq = a, .pos = 0, .n_tokens = PROMPT, .q = q, .k = kv, .v = kv, .o = o};
    ck_assert_int_eq(detattn_forward_start(c, l, &io, 1, &calls[l]), DETATTN_OK);
  }
  detattn_close(c);
  for (int l = 0; l < 2; l++) detattn_call_wait(calls[l]);
  check_within_delay(t0);
  check_nothing_left();
}
END_TEST

static Suite *race_suite(void) {
  const da_test_case cases[] = {
      {"gone_before_connect", sequences_of_a_connection_gone_before_its_connect_is_reported_are_freed},
      {"gone_before_connect_inflight",
       a_connection_gone_before_its_connect_is_reported_with_forwards_in_flight_is_freed},
  };
  Suite *s = suite_create("conn_race");
  da_test_add_cases(s, cases, sizeof(cases) / sizeof(cases[0]), setup, teardown, 60);
  return s;
}

int main(void) { return da_test_run(race_suite()); }
