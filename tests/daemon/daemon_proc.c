#include "daemon_proc.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"

void da_daemon_dump_log(const da_daemon_proc *d) {
  FILE *f = fopen(d->log, "r");
  char line[512];
  if (!f) return;
  fprintf(stderr, "---- %s ----\n", d->log);
  while (fgets(line, sizeof line, f)) fputs(line, stderr);
  fprintf(stderr, "----\n");
  fclose(f);
}

int da_daemon_log_has(const da_daemon_proc *d, const char *needle) {
  FILE *f = fopen(d->log, "r");
  char line[512];
  int found = 0;
  if (!f) return 0;
  while (!found && fgets(line, sizeof line, f)) found = strstr(line, needle) != NULL;
  fclose(f);
  return found;
}

int da_daemon_log_url(const da_daemon_proc *d, char *url, size_t len) {
  FILE *f = fopen(d->log, "r");
  char line[512], word[512];
  int found = 0;
  url[0] = '\0';
  if (!f) return -1;
  while (!found && fgets(line, sizeof line, f)) found = sscanf(line, "listening on %511s", word) == 1;
  fclose(f);
  if (found) snprintf(url, len, "%s", word);
  return found ? 0 : -1;
}

/* Starts detattnd on d->url (set) in d->dir (exists). */
static int spawn(da_daemon_proc *d, const char *detattnd, const char *const *args) {
  const char *argv[64];
  int n = 0;

  argv[n++] = detattnd;
  argv[n++] = "--listen";
  argv[n++] = d->url;
  argv[n++] = "--backend";
  argv[n++] = "cpu";
  for (int i = 0; args && args[i] && n < 62; i++) argv[n++] = args[i];
  argv[n] = NULL;

  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    int fd = open(d->log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) {
      dup2(fd, 2);
      close(fd);
    }
    execv(detattnd, (char *const *)argv);
    _exit(127);
  }
  d->pid = pid;
  for (int waited = 0; waited < 15000; waited += 20) {
    if (da_daemon_log_has(d, "listening on")) return 0;
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      d->pid = 0;
      d->exit_status = status;
      fprintf(stderr, "detattnd exited before listening (status 0x%x)\n", status);
      da_daemon_dump_log(d);
      return -1;
    }
    da_test_sleep_ms(20);
  }
  fprintf(stderr, "detattnd did not print 'listening on' within 15 s\n");
  da_daemon_dump_log(d);
  return -1;
}

int da_daemon_start(da_daemon_proc *d, const char *detattnd, const char *const *args) {
  memset(d, 0, sizeof *d);
  snprintf(d->dir, sizeof d->dir, "/tmp/detattn-daemon-test-XXXXXX");
  if (!mkdtemp(d->dir)) return -1;
  snprintf(d->url, sizeof d->url, "ipc://%s/detattnd.sock", d->dir);
  snprintf(d->log, sizeof d->log, "%s/detattnd.log", d->dir);
  return spawn(d, detattnd, args);
}

int da_daemon_restart(da_daemon_proc *d, const char *detattnd, const char *const *args) {
  if (d->pid) {
    kill(d->pid, SIGTERM);
    if (da_daemon_wait(d, 5000) != 0) {
      kill(d->pid, SIGKILL);
      waitpid(d->pid, NULL, 0);
      d->pid = 0;
    }
  }
  unlink(d->log); /* the old log says "listening on" too */
  return spawn(d, detattnd, args);
}

int da_daemon_wait(da_daemon_proc *d, int timeout_ms) {
  if (!d->pid) return 0;
  for (int waited = 0; waited <= timeout_ms; waited += 10) {
    int status;
    pid_t r = waitpid(d->pid, &status, WNOHANG);
    if (r == d->pid || (r < 0 && errno == ECHILD)) {
      d->pid = 0;
      d->exit_status = status;
      return 0;
    }
    da_test_sleep_ms(10);
  }
  return -1;
}

int da_daemon_term_clean(da_daemon_proc *d, int timeout_ms, char *why, size_t len) {
  why[0] = '\0';
  if (d->pid && kill(d->pid, SIGTERM) != 0) snprintf(why, len, "SIGTERM: %s", strerror(errno));
  else if (da_daemon_wait(d, timeout_ms) != 0) snprintf(why, len, "the daemon did not exit %d ms after SIGTERM", timeout_ms);
  else if (!WIFEXITED(d->exit_status) || WEXITSTATUS(d->exit_status) != 0)
    snprintf(why, len, "daemon exit status 0x%x", d->exit_status);
  else if (da_daemon_log_has(d, "LeakSanitizer")) snprintf(why, len, "the daemon leaked (see its log)");
  if (why[0] == '\0') return 0;
  da_daemon_dump_log(d);
  return -1;
}

void da_daemon_stop(da_daemon_proc *d) {
  char path[192];
  if (d->pid) {
    kill(d->pid, SIGTERM);
    if (da_daemon_wait(d, 5000) != 0) {
      kill(d->pid, SIGKILL);
      waitpid(d->pid, NULL, 0);
      d->pid = 0;
    }
  }
  if (d->dir[0]) {
    snprintf(path, sizeof path, "%s/detattnd.sock", d->dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/detattnd.sock.lock", d->dir);
    unlink(path);
    unlink(d->log);
    rmdir(d->dir);
    d->dir[0] = '\0';
  }
}

int da_make_test_certs(const char *dir) {
  char cmd[4096];
  snprintf(cmd, sizeof cmd,
           "cd '%s' && exec > openssl.log 2>&1 && set -e && "
           "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > san.ext && "
           "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=detattn-test-ca && "
           "openssl req -x509 -newkey rsa:2048 -nodes -keyout other-ca.key -out other-ca.pem -days 2 -subj /CN=other-ca && "
           "openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=localhost && "
           "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 "
           "-extfile san.ext && "
           "openssl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr -subj /CN=client && "
           "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 2 && "
           "openssl req -newkey rsa:2048 -nodes -keyout rogue.key -out rogue.csr -subj /CN=rogue && "
           "openssl x509 -req -in rogue.csr -CA other-ca.pem -CAkey other-ca.key -CAcreateserial -out rogue.pem -days 2 && "
           "openssl req -newkey rsa:2048 -nodes -keyout expired.key -out expired.csr -subj /CN=expired && "
           "openssl x509 -req -in expired.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out expired.pem -days -1",
           dir);
  return system(cmd) == 0 ? 0 : -1;
}
