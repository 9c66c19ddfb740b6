/*
 * http.h — detattnd's HTTP listener (--http-listen http://HOST:PORT), on nng's HTTP server
 * (nng/supplemental/http; nng parses HTTP, this module only registers handlers):
 *
 *   GET /metrics  the Prometheus text format (metrics.h)
 *   GET /healthz  200 "ok" when the daemon's loop answers within timeout_ms, else 503
 *   GET /readyz   200 "ready" when the backend is up and the daemon is not draining, else
 *                 503 with the reason
 *
 * Threads. nng runs the handlers on its own threads, while every counter belongs to the
 * daemon's loop thread. A handler therefore asks the loop for a snapshot: it bumps a
 * request ticket under a mutex, wakes the loop with a uv_async, and waits on a condition
 * variable, at most timeout_ms, for the loop to answer that ticket. The loop's callback
 * (fill) copies its state into a plain da_metrics_snapshot on the loop thread, so the
 * numbers of one scrape are consistent with each other and nothing is read while the loop
 * writes it; concurrent scrapes share one round trip. A round trip costs the loop one
 * pass over its histograms (microseconds) only when someone scrapes, rather than a
 * periodic copy, and a loop that does not answer is exactly what /healthz must report,
 * which a snapshot the loop refreshes on a timer would hide behind a stale copy.
 *
 * Thread: da_http_open and da_http_close on the loop thread (the uv_async lives on that
 * loop, unreferenced, so it does not keep the loop running).
 */
#ifndef DA_HTTP_H
#define DA_HTTP_H

#include <stddef.h>
#include <uv.h>

#include "metrics.h"

typedef struct da_http da_http;

typedef struct da_http_cfg {
  const char *url; /* http://HOST:PORT; port 0 picks a free port (da_http_url gives it) */
  uv_loop_t *loop;
  /* Called on the loop thread: fill out from the daemon's state. */
  void (*fill)(void *arg, da_metrics_snapshot *out);
  void *arg;
  int timeout_ms; /* how long a handler waits for the loop; 0: 1000 */
} da_http_cfg;

/* Starts the listener. On failure writes a message naming the URL to err. */
int da_http_open(da_http **out, const da_http_cfg *cfg, char *err, size_t errlen);
/* The URL listened on (the bound port in place of 0). */
const char *da_http_url(const da_http *h);
/* Stops the listener: waiting handlers answer 503 at once, nng's server is stopped, and
 * the uv_async is closed (freed in its close callback: run the loop afterwards). NULL is a
 * no-op. */
void da_http_close(da_http *h);

#endif /* DA_HTTP_H */
