/*
 * test_abuse.c — the daemon and the client library under abuse (issue 12): each tcase is
 * one defect found by an abuse campaign and its own ctest (CK_RUN_CASE), against the real
 * detattnd (CPU backend, small model) on an ipc:// socket in a temporary directory.
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

static Suite *abuse_suite(void) {
  const struct {
    const char *name;
    void (*setup)(void);
    const TTest *test;
    int timeout;
  } cases[] = {
      {"restart_model", setup_restart, client_refuses_a_restarted_daemon_with_another_model, 30},
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
