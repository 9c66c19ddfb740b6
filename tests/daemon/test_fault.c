/*
 * test_fault.c — SQLite-style fault injection against the real detattnd built with
 * -DDETATTN_FAULT_INJECT=ON (server/fault.c): for N = 1, 2, ... the N-th allocation of the
 * daemon's own code fails once, until N passes the number of allocations made.
 *
 *  start:    the N-th allocation from main() fails. The daemon either starts and serves a
 *            hello, or exits with a non-zero status and an error line: never a signal (a
 *            crash, or an ASan report, which aborts).
 *  workload: the N-th allocation after "listening on" fails while a client runs open,
 *            a 2-layer prefill, fork, truncate, decode on the fork, and close. Each call
 *            returns OK or a status (never a lost reply); then a fresh client runs the same
 *            workload with every call OK (the failure was transient: the daemon serves on);
 *            pages and sequences return to 0 once the first client has gone; and SIGTERM
 *            exits 0 (under ASan, with its leak check).
 *
 * Usage: test_fault DETATTND start|workload [MAX_N [MIN_N]]. Exit 0 when every N passed.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "da.h"
#include "daemon_proc.h"
#include "detattn.h"

enum { HQ = 4, HKV = 2, HD = 64, PROMPT = 40 };
static const char *const CPU_ARGS[] = {"--layers", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64",
                                       "--kv-tokens", "4096", "--split-tokens", "64", "--tile-tokens", "16",
                                       "--threads", "1", "--max-seqs", "64", NULL};
/* DA_TEST_FAULT_CUDA=1 (on the GPU machine): CUDA runtime calls fail instead (fault.c). */
static const char *const CUDA_ARGS[] = {"--layers", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64",
                                        "--kv-tokens", "4096", "--split-tokens", "64", "--tile-tokens", "64",
                                        "--max-seqs", "64", "--backend", "cuda", "--staging-mib", "16", NULL};
static const char *const *ARGS = CPU_ARGS;
static const char *AT_VAR = "DA_FAULT_AT";
static int failures;

#define FAIL(...)                                                   \
  do {                                                              \
    fprintf(stderr, "test_fault N=%ld: ", n_at);                    \
    fprintf(stderr, __VA_ARGS__);                                   \
    fprintf(stderr, "\n");                                          \
    failures++;                                                     \
  } while (0)

static long n_at;

/* Runs the workload; returns the number of calls that were not OK, -1 when one was lost
 * (DEADLINE_EXCEEDED or CANCELLED: a request the daemon never answered). */
static int workload(detattn_client *c) {
  static uint16_t q[PROMPT * HQ * HD], kv[PROMPT * HKV * HD], o[PROMPT * HQ * HD];
  da_rng g;
  da_rng_seed(&g, 0xfa17u);
  da_rng_fill(&g, DA_BF16, q, sizeof q / 2, 1.0);
  da_rng_fill(&g, DA_BF16, kv, sizeof kv / 2, 1.0);
  int bad = 0, st;
  uint64_t a = 0, b = 0;
#define CALL(expr)                                                                       \
  do {                                                                                   \
    st = (expr);                                                                         \
    if (st == DETATTN_DEADLINE_EXCEEDED || st == DETATTN_CANCELLED) return -1;           \
    if (st != DETATTN_OK) bad++;                                                         \
  } while (0)
  CALL(detattn_seq_open(c, &a));
  for (uint32_t l = 0; l < 2 && st == DETATTN_OK; l++) {
    detattn_seq_io io = {.seq = a, .pos = 0, .n_tokens = PROMPT, .q = q, .k = kv, .v = kv, .o = o};
    CALL(detattn_forward(c, l, &io, 1));
  }
  CALL(detattn_seq_fork(c, a, &b));
  if (st == DETATTN_OK) {
    CALL(detattn_seq_truncate(c, b, PROMPT / 2));
    for (uint32_t l = 0; l < 2 && st == DETATTN_OK; l++) {
      detattn_seq_io io = {.seq = b, .pos = PROMPT / 2, .n_tokens = 1, .q = q, .k = kv, .v = kv, .o = o};
      CALL(detattn_forward(c, l, &io, 1));
    }
    CALL(detattn_seq_close(c, b));
  }
  if (a) CALL(detattn_seq_close(c, a));
  return bad;
#undef CALL
}

/* Starts the daemon with its N-th call (counted from `from`) set to fail; 0 when it listens. */
static int start_with_fault(da_daemon_proc *d, const char *detattnd, const char *from) {
  char v[32];
  snprintf(v, sizeof v, "%ld", n_at);
  setenv(AT_VAR, v, 1);
  setenv("DA_FAULT_FROM", from, 1);
  return da_daemon_start(d, detattnd, ARGS);
}

/* SIGTERM must end it with status 0 (under ASan: no leak). */
static void stop_clean(da_daemon_proc *d) {
  kill(d->pid, SIGTERM);
  if (da_daemon_wait(d, 20000) != 0) FAIL("no exit after SIGTERM");
  else if (!WIFEXITED(d->exit_status) || WEXITSTATUS(d->exit_status) != 0) {
    FAIL("SIGTERM exit status %d%s", d->exit_status, WIFSIGNALED(d->exit_status) ? " (a signal)" : "");
    da_daemon_dump_log(d);
  }
}

static int run_start(const char *detattnd, long min_n, long max_n) {
  for (n_at = min_n; n_at <= max_n; n_at++) {
    da_daemon_proc d;
    int started = start_with_fault(&d, detattnd, "start") == 0;
    if (started) {
      /* A fault after "listening on" may refuse the first connection (out of memory at
       * admission): the second must be served. */
      int ok = 0;
      for (int attempt = 0; attempt < 2 && !ok; attempt++) {
        detattn_client *c;
        detattn_server_info info;
        if (detattn_connect(&c, d.url) != DETATTN_OK) continue;
        detattn_set_timeout(c, 10000);
        ok = detattn_hello(c, &info) == DETATTN_OK;
        detattn_close(c);
      }
      if (!ok) {
        FAIL("started but two hellos failed: %s", detattn_errmsg());
        da_daemon_dump_log(&d);
      }
      stop_clean(&d);
    } else {
      da_daemon_wait(&d, 5000);
      if (d.pid != 0 || !WIFEXITED(d.exit_status) || WEXITSTATUS(d.exit_status) == 0) {
        FAIL("did not start and did not exit with an error (status %d%s)", d.exit_status,
             WIFSIGNALED(d.exit_status) ? ", a signal" : "");
        da_daemon_dump_log(&d);
      } else if (!da_daemon_log_has(&d, "out of memory") && !da_daemon_log_has(&d, "Out of memory") &&
                 !da_daemon_log_has(&d, "cannot allocate") && !da_daemon_log_has(&d, "cuda: ")) {
        FAIL("exited %d without saying it ran out of memory", WEXITSTATUS(d.exit_status));
        da_daemon_dump_log(&d);
      }
    }
    int fired = da_daemon_log_has(&d, "(injected)");
    da_daemon_stop(&d);
    if (!fired) break; /* N passed every allocation of the start */
  }
  printf("test_fault start: %ld allocations failed one at a time, %d failures\n", n_at - 1, failures);
  return failures != 0;
}

static int run_workload(const char *detattnd, long min_n, long max_n) {
  for (n_at = min_n; n_at <= max_n; n_at++) {
    da_daemon_proc d;
    if (start_with_fault(&d, detattnd, "ready") != 0) {
      FAIL("did not start");
      break;
    }
    detattn_client *c1 = NULL, *c2 = NULL;
    if (detattn_connect(&c1, d.url) != DETATTN_OK) FAIL("connect");
    detattn_set_timeout(c1, 10000);
    int r = workload(c1);
    if (r < 0) {
      FAIL("a call was never answered: %s", detattn_errmsg());
      da_daemon_dump_log(&d);
    }
    detattn_close(c1);
    int fired = da_daemon_log_has(&d, "(injected)");
    if (fired && da_daemon_log_has(&d, "device failed for good")) {
      /* A CUDA error the backend counts as sticky: it must exit on its own, with its code. */
      if (da_daemon_wait(&d, 30000) != 0 || !WIFEXITED(d.exit_status) || WEXITSTATUS(d.exit_status) == 0)
        FAIL("the device failed but the daemon did not exit with an error (status %d)", d.exit_status);
      da_daemon_stop(&d);
      continue;
    }
    /* The daemon serves on. */
    /* A fault still to come may refuse this client's connection once: then a second
     * client must run it all. */
    int r2 = -1;
    for (int attempt = 0; attempt < 2 && r2 != 0; attempt++) {
      if (c2) detattn_close(c2);
      if (detattn_connect(&c2, d.url) != DETATTN_OK) FAIL("connect after the fault");
      detattn_set_timeout(c2, 10000);
      r2 = workload(c2);
    }
    if (r2 != 0) {
      FAIL("after the fault, the workload got %d non-OK calls: %s", r2, detattn_errmsg());
      da_daemon_dump_log(&d);
    }
    detattn_stats st = {0};
    for (int i = 0; i < 100; i++) {
      if (detattn_stats_get(c2, &st) != DETATTN_OK) break;
      if (st.kv_pages_used == 0 && st.sequences == 0) break;
      usleep(20000);
    }
    if (st.kv_pages_used || st.sequences) FAIL("%u pages and %u sequences left", st.kv_pages_used, st.sequences);
    detattn_close(c2);
    stop_clean(&d);
    da_daemon_stop(&d);
    if (!fired) break;
  }
  printf("test_fault workload: %ld allocations failed one at a time, %d failures\n", n_at - 1, failures);
  return failures != 0;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: test_fault DETATTND start|workload [MAX_N [MIN_N]]\n");
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  if (getenv("DA_TEST_FAULT_CUDA")) {
    if (access("/dev/nvidia0", F_OK) != 0) {
      printf("skip: no CUDA device\n");
      return 77;
    }
    ARGS = CUDA_ARGS;
    AT_VAR = "DA_FAULT_CUDA_AT";
  }
  long max_n = argc > 3 ? atol(argv[3]) : 100000, min_n = argc > 4 ? atol(argv[4]) : 1;
  if (strcmp(argv[2], "start") == 0) return run_start(argv[1], min_n, max_n);
  return run_workload(argv[1], min_n, max_n);
}
