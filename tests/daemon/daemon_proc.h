/*
 * daemon_proc.h — starts the real detattnd for an integration test and makes sure it dies
 * with the test: on an ipc:// socket in a fresh mkdtemp directory, stderr to a log file
 * there, PR_SET_PDEATHSIG so that a crashed or killed test takes the daemon with it.
 *
 * da_daemon_start returns once the daemon printed "listening on" (or fails, printing its
 * log). da_daemon_stop sends SIGTERM, waits (bounded), then SIGKILLs, reaps it and removes
 * the directory; safe to call twice and after the test reaped the daemon itself.
 */
#ifndef DA_DAEMON_PROC_H
#define DA_DAEMON_PROC_H

#include <sys/types.h>

typedef struct da_daemon_proc {
  pid_t pid;       /* 0 once reaped */
  int exit_status; /* waitpid status once reaped */
  char dir[64];
  char url[128];
  char log[128];
} da_daemon_proc;

/* args: extra detattnd flags, NULL-terminated (--listen and --backend cpu are added). */
int da_daemon_start(da_daemon_proc *d, const char *detattnd, const char *const *args);
/* Stops the daemon (SIGTERM, bounded) and starts detattnd again on the same URL and log. */
int da_daemon_restart(da_daemon_proc *d, const char *detattnd, const char *const *args);
/* Waits up to timeout_ms for the daemon to exit by itself; 0 when it did (exit_status set). */
int da_daemon_wait(da_daemon_proc *d, int timeout_ms);
void da_daemon_stop(da_daemon_proc *d);
/* SIGTERM, then waits up to timeout_ms: 0 when the daemon exited with status 0 and its log
 * has no LeakSanitizer report; else -1 with the reason in why (and the log's tail on stderr). */
int da_daemon_term_clean(da_daemon_proc *d, int timeout_ms, char *why, size_t len);
/* Prints the last lines of the daemon's log to stderr. */
void da_daemon_dump_log(const da_daemon_proc *d);
/* 1 when a line of the daemon's log so far contains needle, else 0 (also when there is no log). */
int da_daemon_log_has(const da_daemon_proc *d, const char *needle);
/* The address of the log's first "listening on" line in url: 0, or -1 ("" in url) when the log
 * has none. */
int da_daemon_log_url(const da_daemon_proc *d, char *url, size_t len);

/* Makes test certificates with the openssl CLI in dir: ca.pem/ca.key (a CA), server.pem/
 * server.key (signed by it, for 127.0.0.1 and localhost), client.pem/client.key (signed by
 * it), other-ca.pem and rogue.pem/rogue.key (a client signed by another CA), expired.pem/
 * expired.key (signed by the CA, expired yesterday). Returns 0, or -1 (openssl missing). */
int da_make_test_certs(const char *dir);

#endif /* DA_DAEMON_PROC_H */
