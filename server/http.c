#include "http.h"

#include <arpa/inet.h>
#include <nng/nng.h>
#include <nng/supplemental/http/http.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "da.h"
#include "log.h"

struct da_http {
  nng_http_server *srv;
  uv_async_t async;
  void (*fill)(void *arg, da_metrics_snapshot *out);
  void *arg;
  int timeout_ms;
  char url[128];
  da_metrics_snapshot *work; /* the loop's scratch */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  /* under mu */
  uint64_t asked, answered; /* snapshot tickets */
  da_metrics_snapshot snap; /* the latest answer */
  int closing, active;      /* handlers running */
  uint64_t prev_now, prev_busy; /* the busy ratio's previous sample */
  double ratio;
  int have_ratio;
};

/* ---- the loop side ---- */

static void on_async(uv_async_t *a) {
  da_http *h = a->data;
  pthread_mutex_lock(&h->mu);
  uint64_t t = h->asked;
  pthread_mutex_unlock(&h->mu);
  if (t == h->answered) return; /* answered already (tickets only grow; read under mu below) */
  h->fill(h->arg, h->work);
  pthread_mutex_lock(&h->mu);
  h->snap = *h->work;
  h->answered = t;
  pthread_cond_broadcast(&h->cv);
  pthread_mutex_unlock(&h->mu);
}

/* ---- the handlers (nng threads) ---- */

/* Waits for a snapshot the loop took after this call started; 0 when it came in time. */
static int snapshot(da_http *h, da_metrics_snapshot *out, double *ratio) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += h->timeout_ms / 1000;
  dl.tv_nsec += (long)(h->timeout_ms % 1000) * 1000000L;
  if (dl.tv_nsec >= 1000000000L) {
    dl.tv_sec++;
    dl.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&h->mu);
  uint64_t want = ++h->asked;
  uv_async_send(&h->async);
  while (h->answered < want && !h->closing)
    if (pthread_cond_timedwait(&h->cv, &h->mu, &dl) != 0) break;
  int ok = h->answered >= want && !h->closing;
  if (ok) {
    *out = h->snap;
    if (ratio) {
      /* Busy fraction over the time since the previous sample, taken at least 1 s apart; the
       * first scrape covers the time since start. */
      uint64_t now = out->now_ns, busy = out->busy_ns;
      if (h->prev_now == 0) h->prev_now = out->start_ns;
      if (now > h->prev_now && (now - h->prev_now >= 1000000000u || !h->have_ratio)) {
        h->ratio = (double)(busy - h->prev_busy) / (double)(now - h->prev_now);
        h->have_ratio = 1;
        if (now - h->prev_now >= 1000000000u) {
          h->prev_now = now;
          h->prev_busy = busy;
        }
      }
      *ratio = h->ratio > 1.0 ? 1.0 : h->ratio;
    }
  }
  pthread_mutex_unlock(&h->mu);
  return ok ? 0 : -1;
}

static void respond(nng_aio *aio, uint16_t status, const char *type, const void *body, size_t len) {
  nng_http_res *res;
  int rv = nng_http_res_alloc(&res);
  if (rv != 0) {
    nng_aio_finish(aio, rv);
    return;
  }
  if ((rv = nng_http_res_set_status(res, status)) != 0 || (rv = nng_http_res_set_header(res, "Content-Type", type)) != 0 ||
      (rv = nng_http_res_set_header(res, "Cache-Control", "no-store")) != 0 ||
      (rv = nng_http_res_copy_data(res, body, len)) != 0) {
    nng_http_res_free(res);
    nng_aio_finish(aio, rv);
    return;
  }
  nng_aio_set_output(aio, 0, res);
  nng_aio_finish(aio, 0);
}

static void text(nng_aio *aio, uint16_t status, const char *msg) {
  respond(aio, status, "text/plain; charset=utf-8", msg, strlen(msg));
}

static da_http *enter(nng_aio *aio) {
  nng_http_handler *hd = nng_aio_get_input(aio, 1);
  da_http *h = nng_http_handler_get_data(hd);
  pthread_mutex_lock(&h->mu);
  int closing = h->closing;
  if (!closing) h->active++;
  pthread_mutex_unlock(&h->mu);
  if (closing) {
    text(aio, NNG_HTTP_STATUS_SERVICE_UNAVAILABLE, "stopping\n");
    return NULL;
  }
  return h;
}

static void leave(da_http *h) {
  pthread_mutex_lock(&h->mu);
  h->active--;
  pthread_cond_broadcast(&h->cv);
  pthread_mutex_unlock(&h->mu);
}

static void on_metrics(nng_aio *aio) {
  da_http *h = enter(aio);
  if (h == NULL) return;
  da_metrics_snapshot *s = malloc(sizeof(*s));
  double ratio = 0;
  char *body = NULL;
  size_t len = 0;
  if (s == NULL) text(aio, NNG_HTTP_STATUS_SERVICE_UNAVAILABLE, "out of memory\n");
  else if (snapshot(h, s, &ratio) != 0)
    text(aio, NNG_HTTP_STATUS_SERVICE_UNAVAILABLE, "the daemon's loop did not answer in time\n");
  else if (da_metrics_render(s, ratio, &body, &len) != 0)
    text(aio, NNG_HTTP_STATUS_SERVICE_UNAVAILABLE, "out of memory\n");
  else
    respond(aio, NNG_HTTP_STATUS_OK, DA_METRICS_CONTENT_TYPE, body, len);
  free(body);
  free(s);
  leave(h);
}

static void on_healthz(nng_aio *aio) {
  da_http *h = enter(aio);
  if (h == NULL) return;
  da_metrics_snapshot *s = malloc(sizeof(*s));
  if (s != NULL && snapshot(h, s, NULL) == 0) text(aio, NNG_HTTP_STATUS_OK, "ok\n");
  else text(aio, NNG_HTTP_STATUS_SERVICE_UNAVAILABLE, "the daemon's loop did not answer in time\n");
  free(s);
  leave(h);
}

static void on_readyz(nng_aio *aio) {
  da_http *h = enter(aio);
  if (h == NULL) return;
  da_metrics_snapshot *s = malloc(sizeof(*s));
  if (s == NULL || snapshot(h, s, NULL) != 0)
    text(aio, NNG_HTTP_STATUS_SERVICE_UNAVAILABLE, "the daemon's loop did not answer in time\n");
  else if (!s->backend_up)
    text(aio, NNG_HTTP_STATUS_SERVICE_UNAVAILABLE, "not ready: the backend's device failed\n");
  else if (s->draining)
    text(aio, NNG_HTTP_STATUS_SERVICE_UNAVAILABLE, "not ready: draining\n");
  else
    text(aio, NNG_HTTP_STATUS_OK, "ready\n");
  free(s);
  leave(h);
}

/* ---- open and close ---- */

static void on_closed(uv_handle_t *a) {
  da_http *h = a->data;
  pthread_mutex_destroy(&h->mu);
  pthread_cond_destroy(&h->cv);
  free(h->work);
  free(h);
}

static void stop_server(da_http *h) {
  pthread_mutex_lock(&h->mu);
  h->closing = 1;
  pthread_cond_broadcast(&h->cv);
  while (h->active > 0) pthread_cond_wait(&h->cv, &h->mu);
  pthread_mutex_unlock(&h->mu);
  if (h->srv) {
    nng_http_server_stop(h->srv);
    nng_http_server_release(h->srv); /* frees the handlers it holds */
    h->srv = NULL;
  }
}

void da_http_close(da_http *h) {
  if (h == NULL) return;
  stop_server(h);
  uv_close((uv_handle_t *)&h->async, on_closed);
}

const char *da_http_url(const da_http *h) { return h->url; }

int da_http_open(da_http **out, const da_http_cfg *cfg, char *err, size_t errlen) {
  *out = NULL;
  if (strncmp(cfg->url, "http://", 7) != 0) {
    snprintf(err, errlen, "http-listen: '%s' is not an http://HOST:PORT URL", cfg->url);
    return DETATTN_INVALID_ARGUMENT;
  }
  da_http *h = calloc(1, sizeof(*h));
  if (h == NULL || (h->work = malloc(sizeof(*h->work))) == NULL) {
    free(h);
    snprintf(err, errlen, "http-listen: out of memory");
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  h->fill = cfg->fill;
  h->arg = cfg->arg;
  h->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : 1000;
  pthread_mutex_init(&h->mu, NULL);
  pthread_cond_init(&h->cv, NULL);
  uv_async_init(cfg->loop, &h->async, on_async);
  h->async.data = h;
  uv_unref((uv_handle_t *)&h->async);

  nng_url *u = NULL;
  int rv = nng_url_parse(&u, cfg->url);
  if (rv == 0) rv = nng_http_server_hold(&h->srv, u);
  static const struct {
    const char *path;
    void (*cb)(nng_aio *);
  } routes[] = {{"/metrics", on_metrics}, {"/healthz", on_healthz}, {"/readyz", on_readyz}};
  for (size_t i = 0; rv == 0 && i < sizeof(routes) / sizeof(routes[0]); i++) {
    nng_http_handler *hd;
    if ((rv = nng_http_handler_alloc(&hd, routes[i].path, routes[i].cb)) != 0) break;
    if ((rv = nng_http_handler_set_data(hd, h, NULL)) != 0 || (rv = nng_http_handler_collect_body(hd, true, 0)) != 0 ||
        (rv = nng_http_server_add_handler(h->srv, hd)) != 0) {
      nng_http_handler_free(hd);
      break;
    }
  }
  if (rv == 0) rv = nng_http_server_start(h->srv);
  if (rv != 0) {
    snprintf(err, errlen, "http-listen %s: %s", cfg->url, nng_strerror(rv));
    nng_url_free(u);
    da_http_close(h);
    return rv == NNG_EADDRINUSE ? DETATTN_UNAVAILABLE : DETATTN_INVALID_ARGUMENT;
  }
  nng_sockaddr sa;
  int port = 0;
  if (nng_http_server_get_addr(h->srv, &sa) == 0) {
    if (sa.s_family == NNG_AF_INET) port = ntohs(sa.s_in.sa_port);
    else if (sa.s_family == NNG_AF_INET6) port = ntohs(sa.s_in6.sa_port);
  }
  snprintf(h->url, sizeof h->url, "http://%s:%d", u->u_hostname[0] ? u->u_hostname : "0.0.0.0",
           port ? port : atoi(u->u_port));
  nng_url_free(u);
  *out = h;
  return 0;
}
