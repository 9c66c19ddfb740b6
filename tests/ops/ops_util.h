/*
 * ops_util.h — helpers of the operations tests (tests/ops): an HTTP GET through nng's HTTP
 * client, reading one series out of a Prometheus text page, a free loopback port, running a
 * program with its output captured, finding a program on PATH, removing a directory tree.
 */
#ifndef DA_OPS_UTIL_H
#define DA_OPS_UTIL_H

#include <stddef.h>
#include <sys/types.h>

/* GET base + path (base "http://127.0.0.1:PORT"). On success returns 0 with the status and
 * a malloc'ed NUL-terminated body (free it); -1 when no response came within timeout_ms. */
/* 0, or the nng error of the transaction. */
int ops_http_get(const char *base, const char *path, int timeout_ms, int *status, char **body);

/* The value of the sample whose name and labels are exactly series (`name{a="b"}` or a bare
 * name) in a Prometheus text page; NAN when absent. */
double ops_metric(const char *page, const char *series);

/* A loopback TCP port that was free a moment ago (bind to port 0, read it, close). */
int ops_free_port(void);

/* The daemon's metrics URL from its log ("http://127.0.0.1:PORT" of the http_listening
 * line) into out; 0 when found. */
int ops_log_http_url(const char *log_path, char *out, size_t outlen);

/* Runs argv (argv[0] a path) with stdin from in_path (NULL: /dev/null) and stdout+stderr
 * to out_path; waits at most timeout_ms (then SIGKILL). Returns the exit status (0..255),
 * or -1 when it did not exit normally. */
int ops_run(const char *const *argv, const char *in_path, const char *out_path, int timeout_ms);

/* Starts argv in the background with output to out_path, dying with the test
 * (PR_SET_PDEATHSIG). Returns the pid, or -1. */
pid_t ops_spawn(const char *const *argv, const char *out_path);
/* SIGTERM, wait up to timeout_ms, then SIGKILL; reaps. Returns the wait status. */
int ops_kill_wait(pid_t pid, int timeout_ms);

/* The full path of program name on PATH (or the absolute path given) into out; 0 if found. */
int ops_which(const char *name, char *out, size_t outlen);

/* rm -rf path (a tree of plain files and directories). */
void ops_rm_rf(const char *path);

/* The whole file as a malloc'ed NUL-terminated string, or NULL. */
char *ops_read_file(const char *path);

#endif /* DA_OPS_UTIL_H */
