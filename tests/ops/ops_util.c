#include "ops_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ftw.h>
#include <math.h>
#include <netinet/in.h>
#include <nng/nng.h>
#include <nng/supplemental/http/http.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

int ops_http_get(const char *base, const char *path, int timeout_ms, int *status, char **body) {
  char u[1024];
  snprintf(u, sizeof u, "%s%s", base, path);
  nng_url *url = NULL;
  nng_http_client *cli = NULL;
  nng_http_req *req = NULL;
  nng_http_res *res = NULL;
  nng_aio *aio = NULL;
  int rv = nng_url_parse(&url, u);
  if (rv == 0) rv = nng_http_client_alloc(&cli, url);
  if (rv == 0) rv = nng_http_req_alloc(&req, url);
  if (rv == 0) rv = nng_http_res_alloc(&res);
  if (rv == 0) rv = nng_aio_alloc(&aio, NULL, NULL);
  if (rv == 0) {
    nng_aio_set_timeout(aio, timeout_ms);
    nng_http_client_transact(cli, req, res, aio);
    nng_aio_wait(aio);
    rv = nng_aio_result(aio);
  }
  if (rv == 0) {
    void *data;
    size_t len;
    *status = nng_http_res_get_status(res);
    nng_http_res_get_data(res, &data, &len);
    *body = malloc(len + 1);
    if (*body) {
      memcpy(*body, data, len);
      (*body)[len] = '\0';
    } else {
      rv = NNG_ENOMEM;
    }
  }
  if (aio) nng_aio_free(aio);
  if (res) nng_http_res_free(res);
  if (req) nng_http_req_free(req);
  if (cli) nng_http_client_free(cli);
  if (url) nng_url_free(url);
  return rv;
}

double ops_metric(const char *page, const char *series) {
  size_t n = strlen(series);
  for (const char *p = page; p && *p;) {
    if (strncmp(p, series, n) == 0 && p[n] == ' ') return strtod(p + n + 1, NULL);
    p = strchr(p, '\n');
    if (p) p++;
  }
  return NAN;
}

int ops_free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t l = sizeof a;
  int port = -1;
  if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &l) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0) close(fd);
  return port;
}

int ops_log_http_url(const char *log_path, char *out, size_t outlen) {
  char *s = ops_read_file(log_path);
  if (!s) return -1;
  int rv = -1;
  const char *p = strstr(s, "metrics and probes on http://");
  if (p) {
    p = strstr(p, "http://");
    size_t n = strcspn(p, " \"\n");
    if (n < outlen) {
      memcpy(out, p, n);
      out[n] = '\0';
      rv = 0;
    }
  }
  free(s);
  return rv;
}

static pid_t start(const char *const *argv, const char *in_path, const char *out_path) {
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid != 0) return pid;
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(127);
  int in = open(in_path ? in_path : "/dev/null", O_RDONLY);
  int out = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (in < 0 || out < 0) _exit(126);
  dup2(in, 0);
  dup2(out, 1);
  dup2(out, 2);
  close(in);
  close(out);
  execv(argv[0], (char *const *)argv);
  _exit(127);
}

int ops_run(const char *const *argv, const char *in_path, const char *out_path, int timeout_ms) {
  pid_t pid = start(argv, in_path, out_path);
  if (pid < 0) return -1;
  int status = 0;
  for (int waited = 0;; waited += 10) {
    if (waitpid(pid, &status, WNOHANG) == pid) break;
    if (waited >= timeout_ms) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    struct timespec ts = {0, 10000000L};
    nanosleep(&ts, NULL);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

pid_t ops_spawn(const char *const *argv, const char *out_path) { return start(argv, NULL, out_path); }

int ops_kill_wait(pid_t pid, int timeout_ms) {
  int status = 0;
  kill(pid, SIGTERM);
  for (int waited = 0;; waited += 10) {
    if (waitpid(pid, &status, WNOHANG) == pid) return status;
    if (waited >= timeout_ms) break;
    struct timespec ts = {0, 10000000L};
    nanosleep(&ts, NULL);
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return status;
}

int ops_which(const char *name, char *out, size_t outlen) {
  if (name[0] == '/') {
    snprintf(out, outlen, "%s", name);
    return access(out, X_OK) == 0 ? 0 : -1;
  }
  const char *path = getenv("PATH");
  char buf[4096];
  snprintf(buf, sizeof buf, "%s:/usr/bin:/usr/local/bin", path ? path : "");
  for (char *save = NULL, *dir = strtok_r(buf, ":", &save); dir; dir = strtok_r(NULL, ":", &save)) {
    snprintf(out, outlen, "%s/%s", dir, name);
    if (access(out, X_OK) == 0) return 0;
  }
  return -1;
}

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st;
  (void)flag;
  (void)ftw;
  remove(p);
  return 0;
}

void ops_rm_rf(const char *path) { nftw(path, rm_one, 16, FTW_DEPTH | FTW_PHYS); }

char *ops_read_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 4096, len = 0;
  char *s = malloc(cap);
  for (size_t n; s && (n = fread(s + len, 1, cap - len - 1, f)) > 0;) {
    len += n;
    if (cap - len < 2) {
      char *t = realloc(s, cap * 2);
      if (!t) {
        free(s);
        s = NULL;
        break;
      }
      s = t;
      cap *= 2;
    }
  }
  fclose(f);
  if (s) s[len] = '\0';
  return s;
}
