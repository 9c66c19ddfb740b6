/*
 * metrics.h — detattnd's Prometheus metrics: a plain snapshot of the daemon's counters,
 * gauges and histograms (filled on the loop thread), and its rendering in the Prometheus
 * text exposition format (version 0.0.4), served on /metrics by http.h.
 *
 * Histograms come from kernels/hist.h. Their Prometheus buckets are `le` bounds of the form
 * 2^e - 1 (nanoseconds for times, exposed in seconds; plain counts for sizes), where
 * da_hist_count_le is exact, so a bucket's count is the true number of values <= its bound.
 *
 * Thread: any; the functions here only read their arguments.
 */
#ifndef DA_METRICS_H
#define DA_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "hist.h"
#include "transport.h"
#include "wire.h"

/* Times: le = (2^e - 1) ns for e in [10, 35] (1.023 us .. 34.4 s); sizes: 2^e - 1 for e in
 * [0, 24] (0 .. 16777215). */
#define DA_METRICS_TIME_E0 10
#define DA_METRICS_TIME_N 26
#define DA_METRICS_SIZE_N 25
#define DA_METRICS_LE_MAX 26
#define DA_METRICS_CODES 17 /* gRPC status codes 0..16 */

/* Data planes, as the label plane="copy|shm|cuda". */
typedef enum da_metrics_plane {
  DA_METRICS_PLANE_COPY = 0,
  DA_METRICS_PLANE_SHM = 1,
  DA_METRICS_PLANE_CUDA = 2,
  DA_METRICS_PLANES
} da_metrics_plane;

typedef enum da_metrics_hist_kind { DA_METRICS_TIME = 0, DA_METRICS_SIZE = 1 } da_metrics_hist_kind;

/* One histogram's Prometheus view: le[i] = values <= bound i (cumulative). */
typedef struct da_metrics_hist {
  da_metrics_hist_kind kind;
  uint64_t count;
  double sum; /* in the histogram's unit (ns for times) */
  uint64_t le[DA_METRICS_LE_MAX];
} da_metrics_hist;

typedef struct da_metrics_snapshot {
  /* identity (detattn_build_info) */
  char version[32], backend[16], arch[32];
  uint32_t kernel_version;
  uint64_t fingerprint;
  int device;
  int split_tokens, page_tokens;
  double start_time_s; /* unix time the daemon started */
  /* health */
  int backend_up; /* the backend is open and its device has not failed */
  int draining;   /* SIGTERM (or a device failure): new requests get UNAVAILABLE */
  /* requests: answered, by op and status code */
  uint64_t requests[DA_OP_COUNT][DA_METRICS_CODES];
  da_metrics_hist op_seconds[DA_OP_COUNT]; /* receipt to reply */
  da_metrics_hist queue_seconds;           /* admission to the batch that appends it */
  da_metrics_hist batch_run_seconds;       /* a batch in the backend */
  da_metrics_hist batch_submit_seconds;    /* of it, the backend's submit (host staging, launches) */
  da_metrics_hist cuda_event_wait_seconds; /* cuda plane: receipt until the wait_event completed */
  da_metrics_hist batch_tokens, batch_requests;
  uint64_t batches, forward_tokens, inrow_rows, partial_rows;
  /* state */
  int64_t kv_pages_total, kv_pages_free;
  int64_t sequences, clients;
  int64_t arenas;
  uint64_t arena_bytes;
  da_transport_counts conn;
  uint64_t tensor_bytes[DA_METRICS_PLANES][2]; /* [plane][0: in (q, k, v), 1: out (o, lse)] */
  uint64_t requests_nng, requests_doorbell;    /* answered, by the transport that carried them */
  int64_t doorbell_rings;                      /* doorbell rings mapped */
  uint64_t doorbell_wakeups;                   /* eventfd wake-ups of sleeping rings */
  uint64_t worker_idle_sleeps;                 /* the backend worker's idle periods that ended asleep */
  uint64_t worker_wait_sleeps;                 /* polled batches it saw complete only after a sleep */
  uint64_t cuda_event_queries, cuda_event_query_ns; /* ready-event queries, and the time spent in them */
  uint64_t late_yields[2];                     /* spin yields back late: [0] the loop's, [1] the worker's */
  /* device */
  uint64_t busy_ns;  /* time with a batch in the backend, since start */
  uint64_t now_ns;   /* da_now_ns() when the snapshot was taken */
  uint64_t start_ns; /* da_now_ns() at start */
  uint64_t mem_kv, mem_acc, mem_staging; /* bytes the pools took at start */
  uint64_t mem_total, mem_free;          /* the device's, after the pools (0: unknown) */
} da_metrics_snapshot;

/* Fills out from h (a kernels/hist.h histogram) with the buckets of kind. */
void da_metrics_hist_fill(da_metrics_hist *out, const da_hist *h, da_metrics_hist_kind kind);
/* The i-th `le` bound of kind, in its unit (ns for times); i < the kind's bucket count. */
uint64_t da_metrics_le_bound(da_metrics_hist_kind kind, int i);
int da_metrics_le_count(da_metrics_hist_kind kind);

/* Renders s in the Prometheus text format into a malloc'ed, NUL-terminated buffer (*out,
 * length *len). busy_ratio is the device busy fraction to report (the caller keeps the
 * previous snapshot; see http.c). Returns 0 or DETATTN_RESOURCE_EXHAUSTED. */
int da_metrics_render(const da_metrics_snapshot *s, double busy_ratio, char **out, size_t *len);

/* The content type of the rendering. */
#define DA_METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

#endif /* DA_METRICS_H */
