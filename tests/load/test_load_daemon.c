/*
 * End-to-end tests of detattn-load against CPU daemons that the test starts on ipc://
 * sockets in a mkdtemp directory (unchecked fixtures: the parent process starts them and
 * kills them at teardown, even when a test fails; they also die with the test process).
 *
 * Daemons: "a" and "a2" are identical (S = 64), "b" differs only in S = 128, so its
 * fingerprint differs and outputs of queries past position 64 differ in some bits.
 */
#include <check.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"
#include "workload.h"

enum { N_DAEMONS = 3 };
static const char *daemon_names[N_DAEMONS] = {"a", "a2", "b"};
static const char *daemon_split[N_DAEMONS] = {"64", "64", "128"};
static pid_t daemon_pid[N_DAEMONS];
static char daemon_url[N_DAEMONS][160];
static char dir[64];

enum { LAYERS = 2, QH = 4, KVH = 2, HD = 64 };

static int file_contains(const char *path, const char *needle) {
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  char buf[4096];
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = '\0';
  return strstr(buf, needle) != NULL;
}

/* Spawns argv with stdout and stderr to files; dies with this process. */
static pid_t spawn(char *const argv[], const char *out_path, const char *err_path) {
  pid_t pid = fork();
  if (pid != 0) return pid;
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  int o = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  int e = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (o < 0 || e < 0) _exit(126);
  dup2(o, 1);
  dup2(e, 2);
  execv(argv[0], argv);
  _exit(127);
}

static void stop(pid_t pid) {
  if (pid <= 0) return;
  kill(pid, SIGTERM);
  for (int i = 0; i < 50; i++) {
    if (waitpid(pid, NULL, WNOHANG) == pid) return;
    da_test_sleep_ms(100);
  }
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
}

static void start_daemons(void) {
  snprintf(dir, sizeof(dir), "/tmp/da-load-XXXXXX");
  if (!mkdtemp(dir)) {
    fprintf(stderr, "mkdtemp: %s\n", strerror(errno));
    exit(1);
  }
  for (int i = 0; i < N_DAEMONS; i++) {
    char log[128], out[128];
    snprintf(daemon_url[i], sizeof(daemon_url[i]), "ipc://%s/%s.sock", dir, daemon_names[i]);
    snprintf(log, sizeof(log), "%s/%s.log", dir, daemon_names[i]);
    snprintf(out, sizeof(out), "%s/%s.out", dir, daemon_names[i]);
    char *argv[] = {DA_DETATTND, "--listen", daemon_url[i], "--backend", "cpu", "--layers", "2",
                    "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64", "--dtype", "bf16",
                    "--page-tokens", "16", "--kv-tokens", "32768", "--split-tokens",
                    (char *)daemon_split[i], "--threads", "1", NULL};
    daemon_pid[i] = spawn(argv, out, log);
    int ready = 0;
    for (int t = 0; t < 200 && !ready; t++) {
      ready = file_contains(log, "listening on");
      if (!ready && waitpid(daemon_pid[i], NULL, WNOHANG) == daemon_pid[i]) {
        daemon_pid[i] = 0;
        break;
      }
      if (!ready) da_test_sleep_ms(50);
    }
    if (!ready) {
      fprintf(stderr, "daemon %s did not start; its log:\n", daemon_names[i]);
      char cmd[200];
      snprintf(cmd, sizeof(cmd), "cat '%s'", log);
      if (system(cmd) != 0) fprintf(stderr, "(no log)\n");
    }
  }
}

static void stop_daemons(void) {
  for (int i = N_DAEMONS - 1; i >= 0; i--) {
    stop(daemon_pid[i]);
    daemon_pid[i] = 0;
  }
  char cmd[128];
  snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", dir);
}

/* Runs detattn-load with the given arguments (NULL-terminated after --url URL --quiet);
 * returns its exit status, or -1 if it did not finish within 50 s. Its stdout and stderr
 * are in dir/<tag>.out and dir/<tag>.err. */
static int run_load(const char *tag, const char *url, const char *const *args) {
  char *argv[64];
  int n = 0;
  argv[n++] = DA_DETATTN_LOAD;
  argv[n++] = "--url";
  argv[n++] = (char *)url;
  argv[n++] = "--quiet";
  argv[n++] = "--timeout-ms"; /* a lost call fails the run instead of hanging it */
  argv[n++] = "20000";
  for (; *args && n < 62; args++) argv[n++] = (char *)*args;
  argv[n] = NULL;
  char out[128], err[128];
  snprintf(out, sizeof(out), "%s/%s.out", dir, tag);
  snprintf(err, sizeof(err), "%s/%s.err", dir, tag);
  pid_t pid = spawn(argv, out, err);
  for (int i = 0; i < 500; i++) {
    int st;
    if (waitpid(pid, &st, WNOHANG) == pid) {
      char cmd[300];
      snprintf(cmd, sizeof(cmd), "cat '%s' '%s' >&2", out, err);
      if (system(cmd) != 0) fprintf(stderr, "(no output)\n");
      return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    }
    da_test_sleep_ms(100);
  }
  fprintf(stderr, "detattn-load (%s) did not finish in 50 s; its output and the daemon logs:\n", tag);
  char cmd[512];
  snprintf(cmd, sizeof(cmd), "cat '%s' '%s' '%s'/*.log >&2", out, err, dir);
  if (system(cmd) != 0) fprintf(stderr, "(no output)\n");
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  return -1;
}

static cJSON *load_json(const char *name) {
  char path[128];
  snprintf(path, sizeof(path), "%s/%s", dir, name);
  FILE *f = fopen(path, "r");
  ck_assert_msg(f != NULL, "no JSON report %s", path);
  static char buf[1 << 16];
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = '\0';
  cJSON *j = cJSON_Parse(buf);
  ck_assert_msg(j != NULL, "JSON report %s does not parse", path);
  return j;
}

static double num(const cJSON *o, const char *name) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
  ck_assert_msg(cJSON_IsNumber(v), "field %s missing or not a number", name);
  return v->valuedouble;
}

static const cJSON *obj(const cJSON *o, const char *name) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
  ck_assert_msg(cJSON_IsObject(v), "field %s missing or not an object", name);
  return v;
}

static int is_true(const cJSON *o, const char *name) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
  ck_assert_msg(cJSON_IsBool(v), "field %s missing or not a bool", name);
  return cJSON_IsTrue(v);
}

static void check_daemons(void) {
  for (int i = 0; i < N_DAEMONS; i++)
    ck_assert_msg(daemon_pid[i] > 0, "daemon %s is not running", daemon_names[i]);
}

/* Forward calls the workload makes: per sequence, L * (prefill chunks + output - 1). */
static uint64_t expected_forwards(uint64_t seed, const char *prompt, const char *output,
                                  uint64_t requests, uint32_t chunk) {
  da_workload w = {0};
  char msg[128];
  w.seed = seed;
  ck_assert_int_eq(da_len_parse(prompt, &w.prompt, msg, sizeof(msg)), 0);
  ck_assert_int_eq(da_len_parse(output, &w.output, msg, sizeof(msg)), 0);
  uint64_t calls = 0;
  for (uint64_t i = 0; i < requests; i++) {
    uint32_t p, o;
    da_workload_lengths(&w, i, &p, &o);
    uint32_t chunks = chunk ? (p + chunk - 1) / chunk : 1;
    calls += (uint64_t)LAYERS * (chunks + o - 1);
  }
  return calls;
}

START_TEST(closed_loop_report_is_complete_and_verifies) {
  check_daemons();
  const char *args[] = {"--concurrency", "4", "--requests", "12", "--seed", "11", "--prompt",
                        "20:150", "--output", "2:10", "--prefill-chunk", "48", "--verify",
                        "--json", NULL, NULL};
  char json[128];
  snprintf(json, sizeof(json), "%s/closed.json", dir);
  args[14] = json;
  ck_assert_int_eq(run_load("closed", daemon_url[0], args), 0);
  cJSON *j = load_json("closed.json");
  ck_assert_uint_eq((uint64_t)num(j, "sequences"), 12);
  ck_assert_uint_eq((uint64_t)num(j, "forward_calls"),
                    expected_forwards(11, "20:150", "2:10", 12, 48));
  ck_assert(num(j, "tokens_per_s") > 0 && num(j, "forwards_per_s") > 0);
  const cJSON *lat = obj(j, "latency_us");
  ck_assert(num(lat, "p50") > 0);
  ck_assert(num(lat, "p50") <= num(lat, "p90") && num(lat, "p90") <= num(lat, "p99") &&
            num(lat, "p99") <= num(lat, "p999") && num(lat, "p999") <= num(lat, "max"));
  ck_assert_uint_eq((uint64_t)num(obj(j, "ttft_ms"), "count"), 12);
  ck_assert_uint_eq((uint64_t)num(j, "forward_errors"), 0);
  ck_assert(num(j, "outputs_compared") > 0);
  ck_assert_uint_eq((uint64_t)num(j, "mismatches"), 0);
  const cJSON *fp = cJSON_GetObjectItemCaseSensitive(j, "fingerprint");
  ck_assert(cJSON_IsString(fp) && strlen(fp->valuestring) == 16);
  const cJSON *srv = obj(j, "server");
  ck_assert(num(srv, "forwards") >= num(j, "forward_calls"));
  cJSON_Delete(j);
  char out[128];
  snprintf(out, sizeof(out), "%s/closed.out", dir);
  ck_assert(file_contains(out, "verify (replay alone)"));
  ck_assert(file_contains(out, "p99.9"));
}
END_TEST

START_TEST(open_loop_with_warmup_verifies_every_output) {
  check_daemons();
  char json[128];
  snprintf(json, sizeof(json), "%s/open.json", dir);
  const char *args[] = {"--rate", "15", "--burstiness", "0.5", "--duration", "2.5", "--warmup",
                        "0.5", "--prompt", "10:120", "--output", "3:12", "--prefill-chunk", "32",
                        "--connections", "2", "--verify", "--json", json, NULL};
  ck_assert_int_eq(run_load("open", daemon_url[0], args), 0);
  cJSON *j = load_json("open.json");
  double run = num(j, "sequences_run"), measured = num(j, "sequences");
  ck_assert(run > 0 && measured <= run);
  ck_assert(num(obj(j, "start_lag_ms"), "count") == measured);
  ck_assert(num(j, "forward_calls") > 0);
  ck_assert(num(j, "outputs_compared") > 0);
  ck_assert_uint_eq((uint64_t)num(j, "mismatches"), 0);
  ck_assert_uint_eq((uint64_t)num(obj(j, "verify"), "sequences_compared"), (uint64_t)run);
  const cJSON *mode = cJSON_GetObjectItemCaseSensitive(j, "mode");
  ck_assert_str_eq(mode->valuestring, "open");
  cJSON_Delete(j);
}
END_TEST

START_TEST(compare_detects_a_daemon_with_another_split_size) {
  check_daemons();
  char rec[128], jr[128], jb[128], ja[128];
  snprintf(rec, sizeof(rec), "%s/a.rec", dir);
  snprintf(jr, sizeof(jr), "%s/rec.json", dir);
  snprintf(jb, sizeof(jb), "%s/cmp_b.json", dir);
  snprintf(ja, sizeof(ja), "%s/cmp_a2.json", dir);
  /* Recorded alone (concurrency 1), compared under load (concurrency 4, 2 connections). */
  const char *rec_args[] = {"--concurrency", "1", "--requests", "6", "--seed", "5", "--prompt",
                            "70:200", "--output", "2:6", "--record", rec, "--json", jr, NULL};
  ck_assert_int_eq(run_load("record", daemon_url[0], rec_args), 0);
  cJSON *jrec = load_json("rec.json");
  const char *digest = cJSON_GetObjectItemCaseSensitive(jrec, "output_digest")->valuestring;
  const char *b_args[] = {"--concurrency", "4", "--connections", "2", "--requests", "6",
                          "--seed", "5", "--prompt", "70:200", "--output", "2:6", "--compare",
                          rec, "--json", jb, NULL};
  ck_assert_int_eq(run_load("cmp_b", daemon_url[2], b_args), 3);
  cJSON *j = load_json("cmp_b.json");
  const cJSON *c = obj(j, "compare");
  ck_assert(!is_true(c, "identical"));
  ck_assert(is_true(c, "fingerprints_differ"));
  ck_assert(num(c, "mismatches") > 0);
  ck_assert(num(c, "mismatches") < num(c, "outputs_compared")); /* positions < 64 agree */
  const cJSON *first = obj(c, "first_difference");
  ck_assert(num(first, "token") >= 64);
  ck_assert_str_ne(cJSON_GetObjectItemCaseSensitive(j, "output_digest")->valuestring, digest);
  cJSON_Delete(j);

  const char *a_args[] = {"--concurrency", "4", "--connections", "2", "--requests", "6",
                          "--seed", "5", "--prompt", "70:200", "--output", "2:6", "--compare",
                          rec, "--json", ja, NULL};
  ck_assert_int_eq(run_load("cmp_a2", daemon_url[1], a_args), 0);
  j = load_json("cmp_a2.json");
  c = obj(j, "compare");
  ck_assert(is_true(c, "identical"));
  ck_assert(!is_true(c, "fingerprints_differ"));
  ck_assert_uint_eq((uint64_t)num(c, "mismatches"), 0);
  ck_assert_uint_eq((uint64_t)num(c, "sequences_compared"), 6);
  ck_assert(num(c, "outputs_compared") > 6 * 70 * LAYERS);
  ck_assert_str_eq(cJSON_GetObjectItemCaseSensitive(j, "output_digest")->valuestring, digest);
  cJSON_Delete(j);
  cJSON_Delete(jrec);
}
END_TEST

START_TEST(bad_usage_exits_2_with_a_message) {
  check_daemons();
  const char *both[] = {"--rate", "5", "--concurrency", "2", "--requests", "1", NULL};
  ck_assert_int_eq(run_load("both", daemon_url[0], both), 2);
  char err[128];
  snprintf(err, sizeof(err), "%s/both.err", dir);
  ck_assert(file_contains(err, "exclude each other"));
  const char *badlen[] = {"--prompt", "9:3", NULL};
  ck_assert_int_eq(run_load("badlen", daemon_url[0], badlen), 2);
  snprintf(err, sizeof(err), "%s/badlen.err", dir);
  ck_assert(file_contains(err, "bad length"));
  const char *remote[] = {"--requests", "1", NULL};
  ck_assert_int_eq(run_load("remote", "tcp://192.0.2.1:5555", remote), 2);
  snprintf(err, sizeof(err), "%s/remote.err", dir);
  ck_assert(file_contains(err, "--allow-remote"));
  char missing[128];
  snprintf(missing, sizeof(missing), "%s/missing.rec", dir);
  const char *nofile[] = {"--requests", "1", "--compare", missing, NULL};
  ck_assert_int_eq(run_load("nofile", daemon_url[0], nofile), 2);
  snprintf(err, sizeof(err), "%s/nofile.err", dir);
  ck_assert(file_contains(err, "cannot open record"));
}
END_TEST

START_TEST(sweep_writes_csv_and_plot) {
  check_daemons();
  char prefix[128], csv[160], png[160];
  snprintf(prefix, sizeof(prefix), "%s/sweep", dir);
  snprintf(csv, sizeof(csv), "%s.csv", prefix);
  snprintf(png, sizeof(png), "%s.png", prefix);
  char json[160];
  snprintf(json, sizeof(json), "%s/sweep.json", dir);
  const char *args[] = {"--sweep", "concurrency=1,3", "--requests", "4", "--prompt", "16:64",
                        "--output", "2:5", "--sweep-out", prefix, "--json", json, NULL};
  ck_assert_int_eq(run_load("sweep", daemon_url[0], args), 0);
  cJSON *j = load_json("sweep.json");
  const cJSON *pts = cJSON_GetObjectItemCaseSensitive(j, "points");
  ck_assert_int_eq(cJSON_GetArraySize(pts), 2);
  for (int i = 0; i < 2; i++) {
    const cJSON *p = cJSON_GetArrayItem(pts, i);
    ck_assert(num(p, "value") == (i ? 3 : 1));
    ck_assert(num(p, "tokens_per_s") > 0);
    ck_assert(num(obj(p, "latency_us"), "p50") <= num(obj(p, "latency_us"), "p99"));
  }
  cJSON_Delete(j);
  FILE *f = fopen(csv, "r");
  ck_assert_ptr_nonnull(f);
  char line[512];
  int lines = 0;
  while (fgets(line, sizeof(line), f)) {
    if (lines == 0) ck_assert(strncmp(line, "concurrency,", 12) == 0);
    else ck_assert(atof(strchr(line, ',') + 1) == 4); /* 4 sequences per point */
    lines++;
  }
  fclose(f);
  ck_assert_int_eq(lines, 3);
  if (system("command -v gnuplot >/dev/null") == 0) {
    struct stat st;
    ck_assert_int_eq(stat(png, &st), 0);
    ck_assert_int_gt(st.st_size, 1000);
  }
}
END_TEST

int main(void) {
  Suite *s = suite_create("load_daemon");
  struct { const char *name; const TTest *t; } cases[] = {
      {"report", closed_loop_report_is_complete_and_verifies},
      {"open", open_loop_with_warmup_verifies_every_output},
      {"compare", compare_detects_a_daemon_with_another_split_size},
      {"usage", bad_usage_exits_2_with_a_message},
      {"sweep", sweep_writes_csv_and_plot},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    TCase *tc = tcase_create(cases[i].name);
    tcase_add_unchecked_fixture(tc, start_daemons, stop_daemons);
    tcase_set_timeout(tc, 55);
    tcase_add_test(tc, cases[i].t);
    suite_add_tcase(s, tc);
  }
  return da_test_run(s);
}
