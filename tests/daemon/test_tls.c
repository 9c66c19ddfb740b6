/*
 * test_tls.c — transport security against the real detattnd: mutual TLS with certificates
 * made here by the openssl CLI (a good client, no client certificate, a client of another
 * CA, an expired client, a client that cannot verify the daemon), and the listen URLs that
 * are refused at start (tls+tcp without a certificate, tcp:// beyond loopback without
 * --insecure-tcp).
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nng/nng.h>

#include "da.h"
#include "daemon_proc.h"
#include "detattn.h"
#include "testutil.h"

static da_daemon_proc D;
static char certs[64], url[160];

static char *path(const char *name) {
  static char buf[8][160];
  static int i;
  i = (i + 1) % 8;
  snprintf(buf[i], sizeof buf[i], "%s/%s", certs, name);
  return buf[i];
}

static void setup(void) {
  snprintf(certs, sizeof certs, "/tmp/detattn-tls-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(certs));
  if (da_make_test_certs(certs) != 0) ck_abort_msg("openssl could not make the test certificates");
  const char *args[] = {"--layers", "1", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64",
                        "--listen", "tls+tcp://127.0.0.1:0", "--tls-cert", path("server.pem"),
                        "--tls-key", path("server.key"), "--tls-ca", path("ca.pem"), NULL};
  if (da_daemon_start(&D, DETATTND_PATH, args) != 0) ck_abort_msg("detattnd did not start");
  da_daemon_log_url(&D, url, sizeof url);
  ck_assert_msg(strncmp(url, "tls+tcp://127.0.0.1:", 20) == 0 && strcmp(url + strlen(url) - 2, ":0") != 0,
                "listening on '%s'", url);
}

static void teardown(void) {
  da_daemon_stop(&D);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", certs);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", certs);
  nng_fini();
}

/* Connects with the given files and returns the status of connect + hello. */
static int try_client(const char *ca, const char *cert, const char *key) {
  detattn_connect_opts o;
  detattn_connect_opts_init(&o);
  o.tls_ca = ca;
  o.tls_cert = cert;
  o.tls_key = key;
  o.tls_server_name = "localhost"; /* mbedTLS 2.28 matches DNS names, not IP addresses */
  o.timeout_ms = 3000;
  detattn_client *c;
  int st = detattn_connect_ex(&c, url, &o);
  if (st != DETATTN_OK) return st;
  detattn_server_info info;
  st = detattn_hello(c, &info);
  if (st == DETATTN_OK) {
    uint64_t seq;
    st = detattn_seq_open(c, &seq);
    if (st == DETATTN_OK) st = detattn_seq_close(c, seq);
  }
  detattn_close(c);
  return st;
}

START_TEST(a_client_with_a_certificate_of_the_ca_is_served) {
  int st = try_client(path("ca.pem"), path("client.pem"), path("client.key"));
  ck_assert_msg(st == DETATTN_OK, "good client: %s: %s", detattn_status_name(st), detattn_errmsg());
}
END_TEST

START_TEST(clients_without_a_valid_certificate_are_refused) {
  const struct {
    const char *what, *ca, *cert, *key;
  } bad[] = {
      {"no client certificate", "ca.pem", NULL, NULL},
      {"a client of another CA", "ca.pem", "rogue.pem", "rogue.key"},
      {"an expired client certificate", "ca.pem", "expired.pem", "expired.key"},
      {"a client that trusts another CA", "other-ca.pem", "client.pem", "client.key"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int st = try_client(path(bad[i].ca), bad[i].cert ? path(bad[i].cert) : NULL, bad[i].key ? path(bad[i].key) : NULL);
    fprintf(stderr, "%s: %s (%s)\n", bad[i].what, detattn_status_name(st), detattn_errmsg());
    ck_assert_msg(st == DETATTN_PERMISSION_DENIED || st == DETATTN_UNAVAILABLE,
                  "%s was answered %s", bad[i].what, detattn_status_name(st));
  }
  /* A TLS client needs a CA to verify the daemon. */
  ck_assert_int_eq(try_client(NULL, path("client.pem"), path("client.key")), DETATTN_INVALID_ARGUMENT);
  /* The daemon still serves good clients. */
  ck_assert_int_eq(try_client(path("ca.pem"), path("client.pem"), path("client.key")), DETATTN_OK);
}
END_TEST

/* Runs detattnd with args and returns its exit status; its stderr goes to out. */
static int run_daemon(const char *const *args, char *out, size_t len) {
  char cmd[2048];
  int n = snprintf(cmd, sizeof cmd, "timeout 10 %s --backend cpu --layers 1 --q-heads 4 --kv-heads 2 --head-dim 64",
                   DETATTND_PATH);
  for (int i = 0; args[i]; i++) n += snprintf(cmd + n, sizeof cmd - (size_t)n, " %s", args[i]);
  snprintf(cmd + n, sizeof cmd - (size_t)n, " 2>&1");
  const int st = da_test_capture(cmd, out, len);
  return st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

START_TEST(unsafe_listen_urls_are_refused_at_start) {
  char out[2048];
  const char *no_cert[] = {"--listen", "tls+tcp://127.0.0.1:0", NULL};
  ck_assert_int_eq(run_daemon(no_cert, out, sizeof out), 2);
  ck_assert_msg(strstr(out, "--tls-cert") != NULL, "no reason given: %s", out);
  const char *wide[] = {"--listen", "tcp://0.0.0.0:0", NULL};
  ck_assert_int_eq(run_daemon(wide, out, sizeof out), 2);
  ck_assert_msg(strstr(out, "--insecure-tcp") != NULL, "no reason given: %s", out);
  const char *files_no_tls[] = {"--listen", "tcp://127.0.0.1:0", "--tls-ca", "/nonexistent", NULL};
  ck_assert_int_eq(run_daemon(files_no_tls, out, sizeof out), 2);
  /* Explicitly insecure: starts (and is stopped by timeout's SIGTERM, exit 0 or 124). */
  const char *insecure[] = {"--listen", "tcp://0.0.0.0:0", "--insecure-tcp", "--drain-timeout-ms", "100", NULL};
  char cmd_out[2048];
  int st = run_daemon(insecure, cmd_out, sizeof cmd_out);
  ck_assert_msg(strstr(cmd_out, "listening on tcp://0.0.0.0:") != NULL, "status %d: %s", st, cmd_out);
}
END_TEST

int main(void) {
  Suite *s = suite_create("tls");
  TCase *t = tcase_create("tls");
  tcase_add_checked_fixture(t, setup, teardown);
  tcase_set_timeout(t, 90);
  tcase_add_test(t, a_client_with_a_certificate_of_the_ca_is_served);
  tcase_add_test(t, clients_without_a_valid_certificate_are_refused);
  tcase_add_test(t, unsafe_listen_urls_are_refused_at_start);
  suite_add_tcase(s, t);
  return da_test_run(s);
}
