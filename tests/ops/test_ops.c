/*
 * test_ops.c — detattnd for operators (issue 10), against the real daemon (CPU backend):
 *   metrics      /metrics after known traffic: requests by op and status code, histogram
 *                counts and buckets, tokens, tensor bytes by plane, sequences and pages
 *   probes       /healthz and /readyz; /readyz says "draining" after SIGTERM
 *   log_json     --log-format json: every line of a daemon's log is one JSON object with
 *                time, level, event, msg and fields
 *   bad_config   a bad setting after --log-format json is reported as one JSON line, exit 2
 *   http_in_use  --http-listen on a port already taken: exit 1 naming the URL
 *   promtool     `promtool check metrics` on a live scrape (skipped without promtool)
 *   prometheus   a real Prometheus scrapes the daemon on loopback and one series is read
 *                back through its HTTP API (skipped without prometheus)
 */
#include <check.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon_proc.h"
#include "detattn.h"
#include "ops_util.h"
#include "testutil.h"

#define HQ 4
#define HKV 2
#define D 64

static const char *const model_args[] = {"--layers", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64",
                                         "--page-tokens", "16", "--kv-tokens", "4096", "--split-tokens", "64",
                                         "--tile-tokens", "16", "--threads", "1", "--http-listen",
                                         "http://127.0.0.1:0"};
#define N_MODEL_ARGS (sizeof(model_args) / sizeof(model_args[0]))

static da_daemon_proc dp;
static char http_url[128];

/* Starts the daemon with the model above plus extra (NULL-terminated). */
static void start_daemon(const char *const *extra) {
  const char *args[64];
  size_t n = 0;
  for (size_t i = 0; i < N_MODEL_ARGS; i++) args[n++] = model_args[i];
  for (size_t i = 0; extra && extra[i]; i++) args[n++] = extra[i];
  args[n] = NULL;
  ck_assert_msg(da_daemon_start(&dp, DETATTND_PATH, args) == 0, "detattnd did not start");
  ck_assert_msg(ops_log_http_url(dp.log, http_url, sizeof http_url) == 0, "no http_listening line in the log");
}

static void teardown(void) { da_daemon_stop(&dp); }

/* What run_traffic did, for the expected metrics. */
typedef struct traffic {
  int forwards_ok, seqs_open;
  uint64_t tokens, in_bytes, out_bytes;
} traffic;

static void forward_random(detattn_client *c, da_rng *r, uint64_t seq, uint32_t layer, uint32_t pos, uint32_t n,
                           int with_lse, traffic *t) {
  size_t qn = (size_t)n * HQ * D, kn = (size_t)n * HKV * D;
  uint16_t *q = malloc(qn * 2), *k = malloc(kn * 2), *v = malloc(kn * 2), *o = malloc(qn * 2);
  float *lse = with_lse ? malloc((size_t)n * HQ * 4) : NULL;
  ck_assert(q && k && v && o);
  da_rng_fill(r, DA_BF16, q, qn, 1.0);
  da_rng_fill(r, DA_BF16, k, kn, 1.0);
  da_rng_fill(r, DA_BF16, v, kn, 1.0);
  detattn_seq_io io = {.seq = seq, .pos = pos, .n_tokens = n, .q = q, .k = k, .v = v, .o = o, .lse = lse};
  int st = detattn_forward(c, layer, &io, 1);
  ck_assert_msg(st == DETATTN_OK, "forward: %s %s", detattn_status_name(st), detattn_errmsg());
  t->forwards_ok++;
  t->tokens += n;
  t->in_bytes += (qn + 2 * kn) * 2;
  t->out_bytes += qn * 2 + (with_lse ? (size_t)n * HQ * 4 : 0);
  free(q);
  free(k);
  free(v);
  free(o);
  free(lse);
}

/* Two sequences, two layers: prefill, three decode steps; then one FAILED_PRECONDITION
 * (wrong pos) and one NOT_FOUND (unknown sequence). Leaves the client connected. */
static detattn_client *run_traffic(traffic *t, uint64_t seed) {
  detattn_connect_opts o;
  detattn_connect_opts_init(&o);
  o.data_plane = DETATTN_PLANE_COPY;
  detattn_client *c;
  ck_assert_int_eq(detattn_connect_ex(&c, dp.url, &o), DETATTN_OK);
  detattn_server_info info;
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_OK);
  da_rng r;
  da_rng_seed(&r, seed);
  memset(t, 0, sizeof *t);
  uint64_t seq[2];
  uint32_t len[2] = {37, 20};
  for (int s = 0; s < 2; s++) {
    ck_assert_int_eq(detattn_seq_open(c, &seq[s]), DETATTN_OK);
    t->seqs_open++;
    for (uint32_t l = 0; l < 2; l++) forward_random(c, &r, seq[s], l, 0, len[s], s == 0, t);
  }
  for (int step = 0; step < 3; step++)
    for (int s = 0; s < 2; s++) {
      for (uint32_t l = 0; l < 2; l++) forward_random(c, &r, seq[s], l, len[s], 1, l == 1, t);
      len[s]++;
    }
  uint16_t buf[HQ * D] = {0};
  uint16_t o_[HQ * D];
  detattn_seq_io bad = {.seq = seq[0], .pos = 5, .n_tokens = 1, .q = buf, .k = buf, .v = buf, .o = o_};
  ck_assert_int_eq(detattn_forward(c, 0, &bad, 1), DETATTN_FAILED_PRECONDITION);
  ck_assert_int_eq(detattn_seq_close(c, 12345), DETATTN_NOT_FOUND);
  return c;
}

static char *scrape(void) {
  int status = 0;
  char *body = NULL;
  ck_assert_msg(ops_http_get(http_url, "/metrics", 5000, &status, &body) == 0, "GET %s/metrics failed", http_url);
  ck_assert_int_eq(status, 200);
  return body;
}

static void assert_metric(const char *page, const char *series, double want) {
  double got = ops_metric(page, series);
  ck_assert_msg(got == want, "%s: got %g, want %g", series, got, want);
}

/* Every histogram of the page: buckets cumulative, +Inf equal to _count. */
static void assert_histograms_consistent(const char *page) {
  int n_hist = 0;
  for (const char *p = page; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
    if (strncmp(p, "# TYPE ", 7) != 0 || !strstr(p, " histogram")) continue;
    char name[128];
    ck_assert(sscanf(p + 7, "%127s", name) == 1);
    n_hist++;
    char bucket[160];
    snprintf(bucket, sizeof bucket, "%s_bucket{", name);
    double prev = -1;
    char labels_prev[128] = "";
    for (const char *q = p; q && *q; q = strchr(q, '\n') ? strchr(q, '\n') + 1 : NULL) {
      if (strncmp(q, bucket, strlen(bucket)) != 0) continue;
      const char *le = strstr(q, "le=\"");
      ck_assert(le != NULL);
      char labels[128];
      snprintf(labels, sizeof labels, "%.*s", (int)(le - q), q);
      if (strcmp(labels, labels_prev) != 0) prev = -1;
      snprintf(labels_prev, sizeof labels_prev, "%s", labels);
      double v = strtod(strchr(q, '}') + 2, NULL);
      ck_assert_msg(v >= prev, "%.*s is below the bucket before it", (int)(strchr(q, '\n') - q), q);
      prev = v;
      if (strncmp(le, "le=\"+Inf\"", 9) == 0) {
        char count[200];
        const char *lab = labels + strlen(bucket);
        size_t ll = strlen(lab);
        if (ll > 0 && lab[ll - 1] == ',') ll--;
        if (ll > 0) snprintf(count, sizeof count, "%s_count{%.*s}", name, (int)ll, lab);
        else snprintf(count, sizeof count, "%s_count", name);
        ck_assert_msg(ops_metric(page, count) == v, "%s is not the +Inf bucket (%g)", count, v);
      }
    }
  }
  ck_assert_int_ge(n_hist, 5);
}

START_TEST(test_metrics) {
  start_daemon(NULL);
  traffic t;
  uint64_t seed = da_test_seed(10);
  detattn_client *c = run_traffic(&t, seed);
  char *page = scrape();
  assert_metric(page, "detattn_requests_total{op=\"hello\",code=\"OK\"}", 1);
  assert_metric(page, "detattn_requests_total{op=\"seq_open\",code=\"OK\"}", t.seqs_open);
  assert_metric(page, "detattn_requests_total{op=\"forward\",code=\"OK\"}", t.forwards_ok);
  assert_metric(page, "detattn_requests_total{op=\"forward\",code=\"FAILED_PRECONDITION\"}", 1);
  assert_metric(page, "detattn_requests_total{op=\"seq_close\",code=\"NOT_FOUND\"}", 1);
  assert_metric(page, "detattn_request_duration_seconds_count{op=\"forward\"}", t.forwards_ok + 1);
  assert_metric(page, "detattn_forward_tokens_total", (double)t.tokens);
  assert_metric(page, "detattn_tensor_bytes_total{plane=\"copy\",direction=\"in\"}", (double)t.in_bytes);
  assert_metric(page, "detattn_tensor_bytes_total{plane=\"copy\",direction=\"out\"}", (double)t.out_bytes);
  assert_metric(page, "detattn_tensor_bytes_total{plane=\"shm\",direction=\"in\"}", 0);
  assert_metric(page, "detattn_sequences", 2);
  assert_metric(page, "detattn_clients", 1);
  assert_metric(page, "detattn_ready", 1);
  assert_metric(page, "detattn_draining", 0);
  /* 40 and 23 tokens at 16 per page: 3 + 2 pages. */
  assert_metric(page, "detattn_kv_pages{state=\"used\"}", 5);
  assert_metric(page, "detattn_kv_pages{state=\"free\"}", 4096 / 16 - 5);
  double batches = ops_metric(page, "detattn_batches_total");
  ck_assert_msg(batches >= 1 && batches <= t.forwards_ok, "batches %g for %d forwards", batches, t.forwards_ok);
  assert_metric(page, "detattn_batch_tokens_count", batches);
  assert_metric(page, "detattn_batch_run_seconds_count", batches);
  /* Each batch's submit is part of its run (the CPU backend computes in finish). */
  assert_metric(page, "detattn_batch_submit_seconds_count", batches);
  ck_assert(ops_metric(page, "detattn_batch_submit_seconds_sum") <= ops_metric(page, "detattn_batch_run_seconds_sum"));
  ck_assert(ops_metric(page, "detattn_queue_seconds_count") >= t.forwards_ok);
  double busy = ops_metric(page, "detattn_device_busy_seconds_total");
  ck_assert_msg(busy > 0 && busy <= ops_metric(page, "detattn_batch_run_seconds_sum") + 1.0, "busy %g", busy);
  double ratio = ops_metric(page, "detattn_device_busy_ratio");
  ck_assert_msg(ratio > 0 && ratio <= 1, "busy ratio %g", ratio);
  ck_assert(ops_metric(page, "detattn_device_memory_bytes{pool=\"kv\"}") > 0);
  /* Every Forward took at least one microsecond and less than 34 s. */
  assert_metric(page, "detattn_request_duration_seconds_bucket{op=\"forward\",le=\"1.023e-06\"}", 0);
  assert_metric(page, "detattn_request_duration_seconds_bucket{op=\"forward\",le=\"34.359738367\"}", t.forwards_ok + 1);
  assert_histograms_consistent(page);
  free(page);
  detattn_close(c);
}
END_TEST

START_TEST(test_probes) {
  start_daemon(NULL);
  int status;
  char *body;
  ck_assert_int_eq(ops_http_get(http_url, "/healthz", 5000, &status, &body), 0);
  ck_assert_int_eq(status, 200);
  ck_assert_str_eq(body, "ok\n");
  free(body);
  ck_assert_int_eq(ops_http_get(http_url, "/readyz", 5000, &status, &body), 0);
  ck_assert_int_eq(status, 200);
  ck_assert_str_eq(body, "ready\n");
  free(body);
  ck_assert_int_eq(ops_http_get(http_url, "/nothing", 5000, &status, &body), 0);
  ck_assert_int_eq(status, 404);
  free(body);
  /* After SIGTERM the daemon drains and lingers DRAIN_LINGER_MS (200 ms) before it closes:
   * /readyz must turn 503 "draining" while /healthz stays 200. */
  kill(dp.pid, SIGTERM);
  int seen = 0;
  for (int i = 0; i < 200 && !seen; i++) {
    if (ops_http_get(http_url, "/readyz", 1000, &status, &body) != 0) break;
    if (status != 200) {
      ck_assert_int_eq(status, 503);
      ck_assert_msg(strstr(body, "draining") != NULL, "readyz after SIGTERM: %s", body);
      seen = 1;
    }
    free(body);
  }
  ck_assert_msg(seen, "/readyz never said draining after SIGTERM");
  ck_assert_int_eq(da_daemon_wait(&dp, 10000), 0);
  ck_assert(WIFEXITED(dp.exit_status) && WEXITSTATUS(dp.exit_status) == 0);
}
END_TEST

static int valid_time(const char *s) {
  int y, mo, d, h, mi, sec, ms;
  char z;
  return strlen(s) == 24 && sscanf(s, "%4d-%2d-%2dT%2d:%2d:%2d.%3d%c", &y, &mo, &d, &h, &mi, &sec, &ms, &z) == 8 &&
         z == 'Z';
}

START_TEST(test_log_json) {
  const char *extra[] = {"--log-format", "json", "--log-level", "debug", NULL};
  start_daemon(extra);
  traffic t;
  detattn_client *c = run_traffic(&t, da_test_seed(11));
  detattn_close(c);
  kill(dp.pid, SIGTERM);
  ck_assert_int_eq(da_daemon_wait(&dp, 10000), 0);
  char *log = ops_read_file(dp.log);
  ck_assert(log != NULL);
  int lines = 0;
  const char *need[] = {"backend", "pools", "http_listening", "listening"};
  int have[4] = {0};
  for (char *save = NULL, *line = strtok_r(log, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
    lines++;
    cJSON *o = cJSON_Parse(line);
    ck_assert_msg(o != NULL && cJSON_IsObject(o), "log line %d is not a JSON object: %s", lines, line);
    cJSON *tm = cJSON_GetObjectItemCaseSensitive(o, "time"), *lv = cJSON_GetObjectItemCaseSensitive(o, "level"),
          *ev = cJSON_GetObjectItemCaseSensitive(o, "event"), *msg = cJSON_GetObjectItemCaseSensitive(o, "msg"),
          *f = cJSON_GetObjectItemCaseSensitive(o, "fields");
    ck_assert_msg(cJSON_IsString(tm) && valid_time(tm->valuestring), "line %d: time: %s", lines, line);
    ck_assert_msg(cJSON_IsString(lv) && (strcmp(lv->valuestring, "error") == 0 || strcmp(lv->valuestring, "warn") == 0 ||
                                         strcmp(lv->valuestring, "info") == 0 || strcmp(lv->valuestring, "debug") == 0),
                  "line %d: level: %s", lines, line);
    ck_assert_msg(cJSON_IsString(ev) && ev->valuestring[0], "line %d: event: %s", lines, line);
    ck_assert_msg(cJSON_IsString(msg), "line %d: msg: %s", lines, line);
    ck_assert_msg(cJSON_IsObject(f), "line %d: fields: %s", lines, line);
    for (int i = 0; i < 4; i++)
      if (strcmp(ev->valuestring, need[i]) == 0) have[i] = 1;
    if (strcmp(ev->valuestring, "backend") == 0) {
      cJSON *fp = cJSON_GetObjectItemCaseSensitive(f, "fingerprint"), *s = cJSON_GetObjectItemCaseSensitive(f, "split_tokens");
      ck_assert(cJSON_IsString(fp) && strlen(fp->valuestring) == 16);
      ck_assert(cJSON_IsNumber(s) && s->valueint == 64);
    }
    cJSON_Delete(o);
  }
  for (int i = 0; i < 4; i++) ck_assert_msg(have[i], "no %s event in the log", need[i]);
  ck_assert_msg(lines >= 10, "only %d log lines with --log-level debug", lines);
  free(log);
}
END_TEST

START_TEST(test_bad_config) {
  char dir[] = "/tmp/detattn-ops-XXXXXX", out[64];
  ck_assert(mkdtemp(dir) != NULL);
  snprintf(out, sizeof out, "%s/out", dir);
  const char *argv[] = {DETATTND_PATH, "--log-format", "json", "--kv-tokens", "-5", NULL};
  ck_assert_int_eq(ops_run(argv, NULL, out, 10000), 2);
  char *s = ops_read_file(out);
  ck_assert(s != NULL);
  ck_assert_msg(strchr(s, '\n') == s + strlen(s) - 1, "not one line: %s", s);
  cJSON *o = cJSON_Parse(s);
  ck_assert_msg(o != NULL, "not JSON: %s", s);
  ck_assert_str_eq(cJSON_GetObjectItemCaseSensitive(o, "event")->valuestring, "bad_config");
  ck_assert_str_eq(cJSON_GetObjectItemCaseSensitive(o, "level")->valuestring, "error");
  cJSON *err = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(o, "fields"), "error");
  ck_assert(cJSON_IsString(err) && strstr(err->valuestring, "kv-tokens") != NULL);
  cJSON_Delete(o);
  free(s);
  /* A URL that is not http:// is refused at load. */
  const char *argv2[] = {DETATTND_PATH, "--http-listen", "tcp://127.0.0.1:9", NULL};
  ck_assert_int_eq(ops_run(argv2, NULL, out, 10000), 2);
  s = ops_read_file(out);
  ck_assert_msg(s && strstr(s, "http-listen") && strstr(s, "http://HOST:PORT"), "%s", s ? s : "");
  free(s);
  ops_rm_rf(dir);
}
END_TEST

START_TEST(test_http_in_use) {
  start_daemon(NULL);
  char flag[160];
  snprintf(flag, sizeof flag, "--http-listen=%s", http_url);
  const char *args[64];
  size_t n = 0;
  for (size_t i = 0; i < N_MODEL_ARGS - 2; i++) args[n++] = model_args[i];
  args[n++] = flag;
  args[n] = NULL;
  da_daemon_proc second;
  ck_assert_int_ne(da_daemon_start(&second, DETATTND_PATH, args), 0);
  ck_assert(WIFEXITED(second.exit_status) && WEXITSTATUS(second.exit_status) == 1);
  char want[200];
  snprintf(want, sizeof want, "http-listen %s", http_url);
  ck_assert_msg(da_daemon_log_has(&second, want), "the refusal does not name %s", want);
  da_daemon_stop(&second);
}
END_TEST

START_TEST(test_promtool) {
  char promtool[512];
  ck_assert(ops_which("promtool", promtool, sizeof promtool) == 0);
  start_daemon(NULL);
  traffic t;
  detattn_client *c = run_traffic(&t, da_test_seed(12));
  char *page = scrape();
  char in[160], out[160];
  snprintf(in, sizeof in, "%s/scrape.txt", dp.dir);
  snprintf(out, sizeof out, "%s/promtool.out", dp.dir);
  da_test_write_file(in, page);
  const char *argv[] = {promtool, "check", "metrics", NULL};
  int rc = ops_run(argv, in, out, 30000);
  char *res = ops_read_file(out);
  ck_assert_msg(rc == 0 && res && res[0] == '\0', "promtool check metrics: exit %d: %s", rc, res ? res : "");
  free(res);
  unlink(in);
  unlink(out);
  free(page);
  detattn_close(c);
}
END_TEST

/* One value of a Prometheus instant query, or NAN while there is none. */
static double prom_query(const char *base, const char *query_escaped) {
  char path[512];
  snprintf(path, sizeof path, "/api/v1/query?query=%s", query_escaped);
  int status;
  char *body;
  if (ops_http_get(base, path, 3000, &status, &body) != 0) return NAN;
  double v = NAN;
  cJSON *o = status == 200 ? cJSON_Parse(body) : NULL;
  cJSON *res = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(o, "data"), "result");
  if (cJSON_IsArray(res) && cJSON_GetArraySize(res) == 1) {
    cJSON *val = cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(res, 0), "value");
    cJSON *s = cJSON_GetArrayItem(val, 1);
    if (cJSON_IsString(s)) v = strtod(s->valuestring, NULL);
  }
  cJSON_Delete(o);
  free(body);
  return v;
}

START_TEST(test_prometheus) {
  char prom[512];
  ck_assert(ops_which("prometheus", prom, sizeof prom) == 0);
  start_daemon(NULL);
  traffic t;
  detattn_client *c = run_traffic(&t, da_test_seed(13));
  char dir[] = "/tmp/detattn-prom-XXXXXX";
  ck_assert(mkdtemp(dir) != NULL);
  char cfg[128], data[128], log[128], yml[512], listen[64], base[96], cfg_flag[160], data_flag[160], listen_flag[96];
  snprintf(cfg, sizeof cfg, "%s/prometheus.yml", dir);
  snprintf(data, sizeof data, "%s/data", dir);
  snprintf(log, sizeof log, "%s/prometheus.log", dir);
  snprintf(yml, sizeof yml,
           "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: detattnd\n"
           "    static_configs:\n      - targets: ['%s']\n",
           http_url + strlen("http://"));
  da_test_write_file(cfg, yml);
  int port = ops_free_port();
  ck_assert(port > 0);
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  snprintf(base, sizeof base, "http://%s", listen);
  snprintf(cfg_flag, sizeof cfg_flag, "--config.file=%s", cfg);
  snprintf(data_flag, sizeof data_flag, "--storage.tsdb.path=%s", data);
  snprintf(listen_flag, sizeof listen_flag, "--web.listen-address=%s", listen);
  const char *argv[] = {prom, cfg_flag, data_flag, listen_flag, "--log.level=warn", NULL};
  pid_t pid = ops_spawn(argv, log);
  ck_assert(pid > 0);
  /* detattn_requests_total{op="forward",code="OK"} and up{job="detattnd"}, within 30 s. */
  const char *q = "detattn_requests_total%7Bop%3D%22forward%22%2Ccode%3D%22OK%22%7D";
  double v = NAN, up = NAN;
  for (int i = 0; i < 300 && !(v == t.forwards_ok && up == 1); i++) {
    da_test_sleep_ms(100);
    v = prom_query(base, q);
    up = prom_query(base, "up%7Bjob%3D%22detattnd%22%7D");
  }
  int status = ops_kill_wait(pid, 10000);
  if (!(v == t.forwards_ok && up == 1)) {
    char *l = ops_read_file(log);
    fprintf(stderr, "---- prometheus log ----\n%s----\n", l ? l : "");
    free(l);
  }
  ops_rm_rf(dir);
  ck_assert_msg(up == 1, "up{job=\"detattnd\"} is %g", up);
  ck_assert_msg(v == t.forwards_ok, "Prometheus has %g forwards, the client made %d", v, t.forwards_ok);
  ck_assert_msg(WIFEXITED(status) || WIFSIGNALED(status), "prometheus did not stop");
  detattn_close(c);
}
END_TEST

/* The promtool and prometheus cases skip (77) when their program is missing. */
static int skip_missing(void) {
  const char *k = getenv("CK_RUN_CASE");
  char path[512];
  if (k && (strcmp(k, "promtool") == 0 || strcmp(k, "prometheus") == 0) && ops_which(k, path, sizeof path) != 0) {
    printf("%s not found: skipped\n", k);
    return 1;
  }
  return 0;
}

int main(void) {
  if (skip_missing()) return 77;
  Suite *s = suite_create("ops");
  const da_test_case cases[] = {{"metrics", test_metrics},       {"probes", test_probes},     {"log_json", test_log_json},
               {"bad_config", test_bad_config}, {"http_in_use", test_http_in_use}, {"promtool", test_promtool},
               {"prometheus", test_prometheus}};
  da_test_add_cases(s, cases, sizeof(cases) / sizeof(cases[0]), NULL, teardown, 60);
  return da_test_run(s);
}
