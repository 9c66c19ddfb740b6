#include "metrics.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "da.h"

int da_metrics_le_count(da_metrics_hist_kind kind) {
  return kind == DA_METRICS_TIME ? DA_METRICS_TIME_N : DA_METRICS_SIZE_N;
}

uint64_t da_metrics_le_bound(da_metrics_hist_kind kind, int i) {
  int e = kind == DA_METRICS_TIME ? DA_METRICS_TIME_E0 + i : i;
  return (1ull << e) - 1;
}

/* One pass over the buckets: every bound 2^e - 1 is the top of a bucket, so the running
 * sum at that bucket is the exact count of values <= bound (kernels/hist.h). */
void da_metrics_hist_fill(da_metrics_hist *out, const da_hist *h, da_metrics_hist_kind kind) {
  memset(out, 0, sizeof(*out));
  out->kind = kind;
  out->count = h->count;
  out->sum = h->sum;
  int n = da_metrics_le_count(kind), i = 0;
  uint64_t seen = 0;
  if (h->count == 0) return;
  for (uint32_t b = 0; b < DA_HIST_BUCKETS && i < n; b++) {
    seen += h->buckets[b];
    while (i < n && da_hist_bucket(da_metrics_le_bound(kind, i)) == b) out->le[i++] = seen;
    if (seen == h->count) break;
  }
  for (; i < n; i++) out->le[i] = h->count;
}

/* ---- a growing text buffer ---- */

typedef struct sbuf {
  char *p;
  size_t len, cap;
  int oom;
} sbuf;

static void put(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(sbuf *b, const char *fmt, ...) {
  if (b->oom) return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    if (n < 0) {
      b->oom = 1;
      return;
    }
    if ((size_t)n < b->cap - b->len) {
      b->len += (size_t)n;
      return;
    }
    size_t cap = b->cap * 2 + (size_t)n + 1;
    char *q = realloc(b->p, cap);
    if (q == NULL) {
      b->oom = 1;
      return;
    }
    b->p = q;
    b->cap = cap;
  }
}

static void head(sbuf *b, const char *name, const char *type, const char *help) {
  put(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A histogram series; labels: "" or `op="forward"` (without braces). */
static void hist(sbuf *b, const char *name, const char *labels, const da_metrics_hist *h) {
  const char *sep = labels[0] ? "," : "";
  int n = da_metrics_le_count(h->kind);
  double unit = h->kind == DA_METRICS_TIME ? 1e-9 : 1.0;
  for (int i = 0; i < n; i++)
    put(b, "%s_bucket{%s%sle=\"%.12g\"} %llu\n", name, labels, sep,
        (double)da_metrics_le_bound(h->kind, i) * unit, (unsigned long long)h->le[i]);
  put(b, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, labels, sep, (unsigned long long)h->count);
  put(b, labels[0] ? "%s_sum{%s} %.9g\n" : "%s_sum%s %.9g\n", name, labels, h->sum * unit);
  put(b, labels[0] ? "%s_count{%s} %llu\n" : "%s_count%s %llu\n", name, labels, (unsigned long long)h->count);
}

static const char *const plane_names[DA_METRICS_PLANES] = {"copy", "shm", "cuda"};

int da_metrics_render(const da_metrics_snapshot *s, double busy_ratio, char **out, size_t *len) {
  sbuf b = {.cap = 16384};
  b.p = malloc(b.cap);
  if (b.p == NULL) return DETATTN_RESOURCE_EXHAUSTED;
  b.p[0] = '\0';

  head(&b, "detattn_build_info", "gauge",
       "Constant 1, labelled with the server version, backend, device architecture, kernel version and "
       "numerics fingerprint.");
  put(&b,
      "detattn_build_info{version=\"%s\",backend=\"%s\",arch=\"%s\",kernel_version=\"%u\",fingerprint=\"%016llx\","
      "device=\"%d\",split_tokens=\"%d\"} 1\n",
      s->version, s->backend, s->arch, s->kernel_version, (unsigned long long)s->fingerprint, s->device,
      s->split_tokens);
  head(&b, "detattn_start_time_seconds", "gauge", "Start time of the daemon since the Unix epoch, in seconds.");
  put(&b, "detattn_start_time_seconds %.3f\n", s->start_time_s);
  head(&b, "detattn_ready", "gauge", "1 when the daemon accepts work: backend up and not draining (as /readyz).");
  put(&b, "detattn_ready %d\n", s->backend_up && !s->draining);
  head(&b, "detattn_backend_up", "gauge", "1 while the backend is open and its device has not failed.");
  put(&b, "detattn_backend_up %d\n", s->backend_up);
  head(&b, "detattn_draining", "gauge", "1 after SIGTERM or a device failure: new requests get UNAVAILABLE.");
  put(&b, "detattn_draining %d\n", s->draining);

  head(&b, "detattn_requests_total", "counter",
       "Requests answered, by op and status code (gRPC names; code!=\"OK\" are the errors).");
  for (int op = 0; op < DA_OP_COUNT; op++)
    for (int c = 0; c < DA_METRICS_CODES; c++) {
      uint64_t n = s->requests[op][c];
      if (n == 0 && !(c == 0 && op != DA_OP_INVALID)) continue;
      put(&b, "detattn_requests_total{op=\"%s\",code=\"%s\"} %llu\n", da_op_name((da_op)op), detattn_status_name(c),
          (unsigned long long)n);
    }
  head(&b, "detattn_requests_by_transport_total", "counter",
       "Requests answered, by the transport that carried them: nng, or a same-host doorbell ring.");
  put(&b, "detattn_requests_by_transport_total{transport=\"nng\"} %llu\n", (unsigned long long)s->requests_nng);
  put(&b, "detattn_requests_by_transport_total{transport=\"doorbell\"} %llu\n",
      (unsigned long long)s->requests_doorbell);
  head(&b, "detattn_doorbell_rings", "gauge", "Doorbell rings mapped (one per connection that uses one).");
  put(&b, "detattn_doorbell_rings %lld\n", (long long)s->doorbell_rings);
  head(&b, "detattn_doorbell_wakeups_total", "counter",
       "Times a client woke a sleeping doorbell ring through its eventfd (requests that found the loop "
       "scanning needed none).");
  put(&b, "detattn_doorbell_wakeups_total %llu\n", (unsigned long long)s->doorbell_wakeups);
  head(&b, "detattn_worker_idle_sleeps_total", "counter",
       "Times the backend worker, out of work, slept before its next batch (a batch handed over while it "
       "spun needed no wake-up).");
  put(&b, "detattn_worker_idle_sleeps_total %llu\n", (unsigned long long)s->worker_idle_sleeps);
  head(&b, "detattn_worker_wait_sleeps_total", "counter",
       "Batches the backend worker, polling the device, saw complete only after sleeping (the batch "
       "outlasted its poll's spin: each such batch is seen up to a sleep late).");
  put(&b, "detattn_worker_wait_sleeps_total %llu\n", (unsigned long long)s->worker_wait_sleeps);
  head(&b, "detattn_spin_late_yields_total", "counter",
       "Times a spinning thread's yield came back late (another thread ran on its core: no idle core); each "
       "ends that spin, and for 1 s no spin follows a client's gap.");
  put(&b, "detattn_spin_late_yields_total{thread=\"loop\"} %llu\n", (unsigned long long)s->late_yields[0]);
  put(&b, "detattn_spin_late_yields_total{thread=\"worker\"} %llu\n", (unsigned long long)s->late_yields[1]);
  head(&b, "detattn_request_duration_seconds", "histogram",
       "Time from a request's receipt to its reply, by op (queueing and batching included).");
  for (int op = 1; op < DA_OP_COUNT; op++) {
    char lab[64];
    snprintf(lab, sizeof lab, "op=\"%s\"", da_op_name((da_op)op));
    hist(&b, "detattn_request_duration_seconds", lab, &s->op_seconds[op]);
  }
  head(&b, "detattn_queue_seconds", "histogram",
       "Time from a Forward's admission to the start of the batch that appends its tokens.");
  hist(&b, "detattn_queue_seconds", "", &s->queue_seconds);
  head(&b, "detattn_batch_run_seconds", "histogram", "Time a batch spends in the backend (staging, kernels, copy-back).");
  hist(&b, "detattn_batch_run_seconds", "", &s->batch_run_seconds);
  head(&b, "detattn_batch_submit_seconds", "histogram",
       "Of a batch's run, the time in the backend's submit: a device backend's host staging (validation, "
       "packing, copies queued) and kernel launches; near zero where the backend runs batches in finish (CPU).");
  hist(&b, "detattn_batch_submit_seconds", "", &s->batch_submit_seconds);
  head(&b, "detattn_cuda_event_wait_seconds", "histogram",
       "cuda plane: time from a Forward's receipt until its client's inputs-ready event had completed.");
  hist(&b, "detattn_cuda_event_wait_seconds", "", &s->cuda_event_wait_seconds);
  head(&b, "detattn_cuda_event_queries_total", "counter",
       "cuda plane: queries of clients' inputs-ready events (the loop polls a held Forward's event).");
  put(&b, "detattn_cuda_event_queries_total %llu\n", (unsigned long long)s->cuda_event_queries);
  head(&b, "detattn_cuda_event_query_seconds_total", "counter", "cuda plane: time the loop spent in those queries.");
  put(&b, "detattn_cuda_event_query_seconds_total %.9f\n", 1e-9 * (double)s->cuda_event_query_ns);
  head(&b, "detattn_batch_tokens", "histogram", "Appended + query tokens per batch.");
  hist(&b, "detattn_batch_tokens", "", &s->batch_tokens);
  head(&b, "detattn_batch_requests", "histogram", "Requests with work in a batch.");
  hist(&b, "detattn_batch_requests", "", &s->batch_requests);
  head(&b, "detattn_batches_total", "counter", "Batches run by the backend.");
  put(&b, "detattn_batches_total %llu\n", (unsigned long long)s->batches);
  head(&b, "detattn_forward_tokens_total", "counter", "Query tokens of Forwards answered OK.");
  put(&b, "detattn_forward_tokens_total %llu\n", (unsigned long long)s->forward_tokens);
  head(&b, "detattn_split_rows_total", "counter",
       "(token, q head) rows computed, by how their splits ran: in one CTA/thread (inrow) or as partials + "
       "combine (partial). Either gives the same bits.");
  put(&b, "detattn_split_rows_total{mode=\"inrow\"} %llu\n", (unsigned long long)s->inrow_rows);
  put(&b, "detattn_split_rows_total{mode=\"partial\"} %llu\n", (unsigned long long)s->partial_rows);

  head(&b, "detattn_kv_pages", "gauge", "KV cache pages, by state.");
  put(&b, "detattn_kv_pages{state=\"used\"} %lld\n", (long long)(s->kv_pages_total - s->kv_pages_free));
  put(&b, "detattn_kv_pages{state=\"free\"} %lld\n", (long long)s->kv_pages_free);
  head(&b, "detattn_kv_page_tokens", "gauge", "Tokens per KV page.");
  put(&b, "detattn_kv_page_tokens %d\n", s->page_tokens);
  head(&b, "detattn_sequences", "gauge", "Sequences open.");
  put(&b, "detattn_sequences %lld\n", (long long)s->sequences);
  head(&b, "detattn_clients", "gauge", "Client connections the daemon knows.");
  put(&b, "detattn_clients %lld\n", (long long)s->clients);
  head(&b, "detattn_connections_open", "gauge", "Connections open in the transport.");
  put(&b, "detattn_connections_open %d\n", s->conn.open);
  head(&b, "detattn_connections_accepted_total", "counter", "Connections admitted.");
  put(&b, "detattn_connections_accepted_total %llu\n", (unsigned long long)s->conn.accepted);
  head(&b, "detattn_connections_refused_total", "counter",
       "Connections refused at connect, by reason (max-connections, max-conn-per-peer, peer credentials).");
  put(&b, "detattn_connections_refused_total{reason=\"max_connections\"} %llu\n", (unsigned long long)s->conn.refused_cap);
  put(&b, "detattn_connections_refused_total{reason=\"max_conn_per_peer\"} %llu\n",
      (unsigned long long)s->conn.refused_peer);
  put(&b, "detattn_connections_refused_total{reason=\"credentials\"} %llu\n", (unsigned long long)s->conn.refused_creds);
  head(&b, "detattn_connections_dropped_total", "counter",
       "Connections the daemon closed, by reason (a reader too slow for its replies, idle).");
  put(&b, "detattn_connections_dropped_total{reason=\"slow_reader\"} %llu\n", (unsigned long long)s->conn.dropped_slow);
  put(&b, "detattn_connections_dropped_total{reason=\"idle\"} %llu\n", (unsigned long long)s->conn.dropped_idle);
  head(&b, "detattn_listener_replaced_total", "counter",
       "ipc listeners replaced after one stopped taking connections (libnng 1.5.2; should stay 0).");
  put(&b, "detattn_listener_replaced_total %llu\n", (unsigned long long)s->conn.listener_replaced);

  head(&b, "detattn_tensor_bytes_total", "counter",
       "Tensor bytes of admitted Forwards, by data plane and direction (in: q, k, v; out: o, lse).");
  for (int p = 0; p < DA_METRICS_PLANES; p++)
    for (int dir = 0; dir < 2; dir++)
      put(&b, "detattn_tensor_bytes_total{plane=\"%s\",direction=\"%s\"} %llu\n", plane_names[p], dir ? "out" : "in",
          (unsigned long long)s->tensor_bytes[p][dir]);
  head(&b, "detattn_arenas", "gauge", "Shared-memory arenas mapped.");
  put(&b, "detattn_arenas %lld\n", (long long)s->arenas);
  head(&b, "detattn_arena_bytes", "gauge", "Bytes of shared-memory arenas mapped.");
  put(&b, "detattn_arena_bytes %llu\n", (unsigned long long)s->arena_bytes);

  head(&b, "detattn_device_busy_seconds_total", "counter",
       "Time with at least one batch in the backend; rate() of it is the busy fraction.");
  put(&b, "detattn_device_busy_seconds_total %.9g\n", (double)s->busy_ns * 1e-9);
  head(&b, "detattn_device_busy_ratio", "gauge",
       "Fraction of time with a batch in the backend, since the previous scrape (at least 1 s before).");
  put(&b, "detattn_device_busy_ratio %.6f\n", busy_ratio);
  head(&b, "detattn_device_memory_bytes", "gauge", "Device memory the daemon's pools took at start, by pool.");
  put(&b, "detattn_device_memory_bytes{pool=\"kv\"} %llu\n", (unsigned long long)s->mem_kv);
  put(&b, "detattn_device_memory_bytes{pool=\"accumulators\"} %llu\n", (unsigned long long)s->mem_acc);
  put(&b, "detattn_device_memory_bytes{pool=\"staging\"} %llu\n", (unsigned long long)s->mem_staging);
  if (s->mem_total > 0) {
    head(&b, "detattn_device_memory_total_bytes", "gauge", "The device's memory.");
    put(&b, "detattn_device_memory_total_bytes %llu\n", (unsigned long long)s->mem_total);
    head(&b, "detattn_device_memory_free_bytes", "gauge", "The device's free memory once the pools were taken.");
    put(&b, "detattn_device_memory_free_bytes %llu\n", (unsigned long long)s->mem_free);
  }
  if (b.oom) {
    free(b.p);
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  *out = b.p;
  *len = b.len;
  return 0;
}
