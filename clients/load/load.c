#include "load.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <xxhash.h>

#include "devmem.h"

typedef struct engine engine;

typedef struct worker {
  engine *e;
  pthread_t th;
  /* Input and output buffers, grown on demand; with the cuda plane their device copies
   * (inputs uploaded before each call, o downloaded after it for hashing). */
  void *q, *k, *v, *o;
  void *dq, *dk, *dv, *d_o;
  size_t cap_tokens;
  da_hist fwd, fwd_prefill, fwd_decode, ttft, tpot, start_lag;
  uint64_t sequences, forward_calls, tokens, prompt_tokens, output_tokens, last_done_ns;
  uint64_t sequences_total, sequences_failed, forward_errors, digest;
  int first_error_status;
  char first_error[160];
  da_record rec;
} worker;

struct engine {
  const da_load_cfg *cfg;
  const da_workload *w;
  detattn_client **clients;
  uint32_t n_clients;
  uint32_t chunk;
  uint64_t t0_ns, warm_ns, end_ns;
  pthread_mutex_t mu;
  uint64_t next_index;
  da_arrivals arr;
  bool stop;
  uint64_t done_seqs, done_tokens, done_fwd;
  uint32_t workers_done;
};

static size_t qrow_bytes(const da_workload *w) {
  return (size_t)w->n_q_heads * w->head_dim * da_dtype_size(w->dtype);
}
static size_t kvrow_bytes(const da_workload *w) {
  return (size_t)w->n_kv_heads * w->head_dim * da_dtype_size(w->dtype);
}

static void sleep_until(uint64_t t_ns) {
  struct timespec ts = {.tv_sec = (time_t)(t_ns / 1000000000ull),
                        .tv_nsec = (long)(t_ns % 1000000000ull)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
  }
}

/*
 * The first call on a new connection: hello, retried (at most 4 more times, 20 ms apart)
 * while it answers UNAVAILABLE, since a daemon may see a new connection's first request
 * before it has registered the connection. Retries are counted and reported.
 */
static int handshake(detattn_client *c, detattn_server_info *info, uint32_t *retries) {
  int rc = DETATTN_UNAVAILABLE;
  for (int i = 0; i < 5; i++) {
    if (i) {
      (*retries)++;
      usleep(20000);
    }
    rc = detattn_hello(c, info);
    if (rc != DETATTN_UNAVAILABLE) break;
  }
  return rc;
}

static int worker_reserve(worker *wk, const da_workload *w, size_t n) {
  if (n <= wk->cap_tokens) return DETATTN_OK;
  void *q = realloc(wk->q, n * qrow_bytes(w));
  if (q) wk->q = q;
  void *k = realloc(wk->k, n * kvrow_bytes(w));
  if (k) wk->k = k;
  void *v = realloc(wk->v, n * kvrow_bytes(w));
  if (v) wk->v = v;
  void *o = realloc(wk->o, n * qrow_bytes(w));
  if (o) wk->o = o;
  if (!q || !k || !v || !o) return DETATTN_RESOURCE_EXHAUSTED;
  if (wk->e->cfg->data_plane == DETATTN_PLANE_CUDA) {
    void **d[4] = {&wk->dq, &wk->dk, &wk->dv, &wk->d_o};
    size_t b[4] = {n * qrow_bytes(w), n * kvrow_bytes(w), n * kvrow_bytes(w), n * qrow_bytes(w)};
    for (int i = 0; i < 4; i++) {
      da_devmem_free(*d[i]);
      if (!(*d[i] = da_devmem_alloc(b[i]))) return DETATTN_RESOURCE_EXHAUSTED;
    }
  }
  wk->cap_tokens = n;
  return DETATTN_OK;
}

/* One Forward of io (host tensors) over the configured plane. */
static int forward(worker *wk, detattn_client *c, const da_workload *w, uint32_t layer, detattn_seq_io *io) {
  if (wk->e->cfg->data_plane != DETATTN_PLANE_CUDA) return detattn_forward(c, layer, io, 1);
  size_t qb = io->n_tokens * qrow_bytes(w), kb = io->n_tokens * kvrow_bytes(w);
  if (da_devmem_upload(wk->dq, io->q, qb) || da_devmem_upload(wk->dk, io->k, kb) ||
      da_devmem_upload(wk->dv, io->v, kb))
    return DETATTN_INTERNAL;
  detattn_seq_io d = *io;
  d.q = wk->dq, d.k = wk->dk, d.v = wk->dv, d.o = wk->d_o;
  int rc = detattn_forward_cuda(c, layer, &d, 1, NULL);
  if (rc == DETATTN_OK && da_devmem_download(io->o, wk->d_o, qb)) return DETATTN_INTERNAL;
  return rc;
}

static void worker_init(worker *wk, engine *e, uint32_t n_layers) {
  memset(wk, 0, sizeof(*wk));
  wk->e = e;
  da_hist_init(&wk->fwd);
  da_hist_init(&wk->fwd_prefill);
  da_hist_init(&wk->fwd_decode);
  da_hist_init(&wk->ttft);
  da_hist_init(&wk->tpot);
  da_hist_init(&wk->start_lag);
  da_record_init(&wk->rec, n_layers);
}

static void worker_fini(worker *wk) {
  free(wk->q);
  free(wk->k);
  free(wk->v);
  free(wk->o);
  da_devmem_free(wk->dq);
  da_devmem_free(wk->dk);
  da_devmem_free(wk->dv);
  da_devmem_free(wk->d_o);
  da_record_fini(&wk->rec);
}

static void note_error(worker *wk, int rc, const char *what) {
  if (wk->first_error_status == 0) {
    wk->first_error_status = rc;
    snprintf(wk->first_error, sizeof(wk->first_error), "%s: %s: %s", what,
             detattn_status_name(rc), detattn_errmsg());
  }
}

/*
 * Runs sequence idx from open to close on client c; arrival_ns is when it was due to
 * start (0: when the first call is sent). Hashes every output row into *s (allocated here,
 * freed by the caller). measure: record latencies and counts into wk.
 */
static int run_seq(worker *wk, detattn_client *c, const da_workload *w, uint32_t chunk,
                   uint64_t idx, uint64_t arrival_ns, uint64_t warm_ns, bool measure,
                   da_seq_hashes *s) {
  uint32_t prompt, output;
  da_workload_lengths(w, idx, &prompt, &output);
  memset(s, 0, sizeof(*s));
  s->index = idx;
  s->prompt = prompt;
  s->output = output;
  s->n_tokens = prompt + output - 1;
  s->h = calloc((size_t)w->n_layers * s->n_tokens, sizeof(uint64_t));
  uint32_t step_max = chunk && chunk < prompt ? chunk : prompt;
  if (!s->h || worker_reserve(wk, w, step_max) != DETATTN_OK) return DETATTN_RESOURCE_EXHAUSTED;

  size_t qb = qrow_bytes(w);
  uint64_t seq;
  uint32_t n = step_max;
  da_workload_inputs(w, idx, 0, 0, n, wk->q, wk->k, wk->v);
  bool open_loop = arrival_ns != 0;
  if (open_loop) sleep_until(arrival_ns);
  else arrival_ns = da_now_ns();
  bool measured_seq = measure && arrival_ns >= warm_ns;
  if (measured_seq && open_loop) {
    uint64_t now = da_now_ns();
    da_hist_record(&wk->start_lag, now > arrival_ns ? now - arrival_ns : 0);
  }
  int rc = detattn_seq_open(c, &seq);
  if (rc != DETATTN_OK) {
    note_error(wk, rc, "seq_open");
    return rc;
  }
  uint64_t first_token_ns = 0, done = 0;
  for (uint32_t pos = 0; pos < s->n_tokens; pos += n) {
    n = pos < prompt ? (prompt - pos < step_max ? prompt - pos : step_max) : 1;
    for (uint32_t layer = 0; layer < w->n_layers; layer++) {
      uint64_t sched;
      if (pos == 0 && layer == 0) {
        sched = arrival_ns;
      } else {
        da_workload_inputs(w, idx, layer, pos, n, wk->q, wk->k, wk->v);
        sched = da_now_ns();
      }
      detattn_seq_io io = {.seq = seq, .pos = pos, .n_tokens = n, .q = wk->q, .k = wk->k,
                           .v = wk->v, .o = wk->o, .lse = NULL};
      rc = forward(wk, c, w, layer, &io);
      done = da_now_ns();
      if (rc != DETATTN_OK) {
        wk->forward_errors++;
        note_error(wk, rc, "forward");
        detattn_seq_close(c, seq);
        return rc;
      }
      uint64_t *h = s->h + (size_t)layer * s->n_tokens + pos;
      for (uint32_t t = 0; t < n; t++) h[t] = XXH3_64bits((const char *)wk->o + t * qb, qb);
      if (measure && sched >= warm_ns) {
        uint64_t lat = done - sched;
        da_hist_record(&wk->fwd, lat);
        da_hist_record(pos < prompt ? &wk->fwd_prefill : &wk->fwd_decode, lat);
        wk->forward_calls++;
        if (layer + 1 == w->n_layers) {
          wk->tokens += n;
          if (pos < prompt) wk->prompt_tokens += n;
          if (pos + n >= prompt) wk->output_tokens++;
        }
        wk->last_done_ns = done;
      }
    }
    if (pos + n == prompt) first_token_ns = done;
    if (measure) {
      pthread_mutex_lock(&wk->e->mu);
      wk->e->done_tokens += n;
      wk->e->done_fwd += w->n_layers;
      pthread_mutex_unlock(&wk->e->mu);
    }
  }
  rc = detattn_seq_close(c, seq);
  if (rc != DETATTN_OK) {
    note_error(wk, rc, "seq_close");
    return rc;
  }
  if (measured_seq) {
    wk->sequences++;
    da_hist_record(&wk->ttft, first_token_ns - arrival_ns);
    if (output > 1) da_hist_record(&wk->tpot, (done - first_token_ns) / (output - 1));
  }
  return DETATTN_OK;
}

/* The next sequence to start and when it is due (0: now, closed loop); false when done. */
static bool next_seq(engine *e, uint64_t *idx, uint64_t *arrival) {
  bool ok = false;
  pthread_mutex_lock(&e->mu);
  if (e->stop || (e->cfg->requests && e->next_index >= e->cfg->requests)) goto out;
  if (e->cfg->mode == DA_LOAD_OPEN) {
    *arrival = e->t0_ns + (uint64_t)(da_arrivals_next(&e->arr) * 1e9);
    if (*arrival >= e->end_ns) {
      e->stop = true;
      goto out;
    }
  } else {
    *arrival = 0;
    if (da_now_ns() >= e->end_ns) {
      e->stop = true;
      goto out;
    }
  }
  *idx = e->next_index++;
  ok = true;
out:
  pthread_mutex_unlock(&e->mu);
  return ok;
}

static void *worker_main(void *arg) {
  worker *wk = arg;
  engine *e = wk->e;
  uint64_t idx, arrival;
  while (next_seq(e, &idx, &arrival)) {
    da_seq_hashes s;
    wk->sequences_total++;
    int rc = run_seq(wk, e->clients[idx % e->n_clients], e->w, e->chunk, idx, arrival,
                     e->warm_ns, true, &s);
    if (rc == DETATTN_OK)
      wk->digest += XXH3_64bits_withSeed(s.h, (size_t)e->w->n_layers * s.n_tokens * 8, idx);
    if (rc == DETATTN_OK && !e->cfg->keep_hashes) {
      free(s.h);
      s.h = NULL;
    }
    if (rc == DETATTN_OK && (!s.h || da_record_take(&wk->rec, &s) == DETATTN_OK)) {
      pthread_mutex_lock(&e->mu);
      e->done_seqs++;
      pthread_mutex_unlock(&e->mu);
    } else {
      wk->sequences_failed++;
      free(s.h);
    }
  }
  pthread_mutex_lock(&e->mu);
  e->workers_done++;
  pthread_mutex_unlock(&e->mu);
  return NULL;
}

static uint32_t max_prompt(const da_workload *w) {
  if (!w->n_trace) return w->prompt.hi;
  uint32_t m = 1;
  for (size_t i = 0; i < w->n_trace; i++)
    if (w->trace[i].prompt > m) m = w->trace[i].prompt;
  return m;
}

static uint32_t effective_chunk(const da_load_cfg *cfg, const da_workload *w,
                                const detattn_server_info *info) {
  uint32_t c = cfg->prefill_chunk ? cfg->prefill_chunk : max_prompt(w);
  if (info->max_tokens_per_request && c > info->max_tokens_per_request)
    c = info->max_tokens_per_request;
  return c;
}

void da_load_connect_opts(const da_load_cfg *cfg, int data_plane, detattn_connect_opts *o) {
  detattn_connect_opts_init(o);
  o->data_plane = (detattn_data_plane)data_plane;
  o->tls_ca = cfg->tls_ca;
  o->tls_cert = cfg->tls_cert;
  o->tls_key = cfg->tls_key;
}

int da_load_hello(const da_load_cfg *cfg, da_workload *w, detattn_server_info *info, char *msg, size_t msglen) {
  const char *url = cfg->url;
  int timeout_ms = cfg->timeout_ms;
  detattn_client *c = NULL;
  detattn_connect_opts co;
  da_load_connect_opts(cfg, DETATTN_PLANE_COPY, &co);
  int rc = detattn_connect_ex(&c, url, &co);
  if (rc != DETATTN_OK) {
    snprintf(msg, msglen, "connect %s: %s", url, detattn_errmsg());
    return rc;
  }
  /* The first call waits for the connection: fail fast when no daemon is there. */
  detattn_set_timeout(c, timeout_ms > 0 && timeout_ms < 10000 ? timeout_ms : 10000);
  uint32_t retries = 0;
  rc = handshake(c, info, &retries);
  if (rc != DETATTN_OK) {
    snprintf(msg, msglen, "hello %s: %s: %s", url, detattn_status_name(rc), detattn_errmsg());
    goto out;
  }
  w->n_layers = info->model.n_layers;
  w->n_q_heads = info->model.n_q_heads;
  w->n_kv_heads = info->model.n_kv_heads;
  w->head_dim = info->model.head_dim;
  w->dtype = info->model.dtype == DETATTN_FP16 ? DA_FP16 : DA_BF16;
  if (!w->n_layers || !w->n_q_heads || !w->n_kv_heads || !w->head_dim) {
    snprintf(msg, msglen, "hello %s: the daemon reported an empty model", url);
    rc = DETATTN_FAILED_PRECONDITION;
  }
out:
  detattn_close(c);
  return rc;
}

static void progress(engine *e, bool final) {
  uint64_t seqs, toks, fwd;
  pthread_mutex_lock(&e->mu);
  seqs = e->done_seqs;
  toks = e->done_tokens;
  fwd = e->done_fwd;
  pthread_mutex_unlock(&e->mu);
  double el = (double)(da_now_ns() - e->t0_ns) * 1e-9;
  double frac = 0;
  if (e->cfg->requests) frac = (double)seqs / (double)e->cfg->requests;
  else if (e->cfg->duration_s > 0) frac = el / e->cfg->duration_s;
  if (frac > 1) frac = 1;
  char bar[31];
  int filled = (int)(frac * 30);
  for (int i = 0; i < 30; i++) bar[i] = i < filled ? '#' : '.';
  bar[30] = '\0';
  fprintf(stderr, "\r[%s] %3.0f%%  %6.1fs  seq %" PRIu64 "  fwd %" PRIu64 "  %.0f tok/s   %s",
          bar, frac * 100, el, seqs, fwd, el > 0 ? (double)toks / el : 0.0,
          final ? "\n" : "");
  fflush(stderr);
}

static void merge_worker(da_load_result *r, worker *wk) {
  da_hist_merge(&r->fwd, &wk->fwd);
  da_hist_merge(&r->fwd_prefill, &wk->fwd_prefill);
  da_hist_merge(&r->fwd_decode, &wk->fwd_decode);
  da_hist_merge(&r->ttft, &wk->ttft);
  da_hist_merge(&r->tpot, &wk->tpot);
  da_hist_merge(&r->start_lag, &wk->start_lag);
  r->sequences += wk->sequences;
  r->forward_calls += wk->forward_calls;
  r->tokens += wk->tokens;
  r->prompt_tokens += wk->prompt_tokens;
  r->output_tokens += wk->output_tokens;
  r->sequences_total += wk->sequences_total;
  r->sequences_failed += wk->sequences_failed;
  r->forward_errors += wk->forward_errors;
  r->digest += wk->digest;
  if (!r->first_error_status && wk->first_error_status) {
    r->first_error_status = wk->first_error_status;
    memcpy(r->first_error, wk->first_error, sizeof(r->first_error));
  }
  for (size_t i = 0; i < wk->rec.n_seqs; i++) da_record_take(&r->record, &wk->rec.seqs[i]);
}

static void result_init(da_load_result *r, uint32_t n_layers) {
  memset(r, 0, sizeof(*r));
  da_hist_init(&r->fwd);
  da_hist_init(&r->fwd_prefill);
  da_hist_init(&r->fwd_decode);
  da_hist_init(&r->ttft);
  da_hist_init(&r->tpot);
  da_hist_init(&r->start_lag);
  da_record_init(&r->record, n_layers);
}

void da_load_result_fini(da_load_result *r) {
  if (r) da_record_fini(&r->record);
}

static void fill_record_header(da_record *rec, const detattn_server_info *info,
                               const da_workload *w) {
  rec->fingerprint = info->fingerprint;
  snprintf(rec->numerics, sizeof(rec->numerics), "%s %s kernel=%" PRIu32 " split=%" PRIu32
           " tile=%" PRIu32, info->backend[0] ? info->backend : "?", info->arch[0] ? info->arch : "?",
           info->kernel_version, info->split_tokens, info->tile_tokens);
  da_workload_describe(w, rec->workload, sizeof(rec->workload));
}

static int connect_all(engine *e, const da_load_cfg *cfg, da_load_result *res, char *msg,
                       size_t msglen) {
  e->n_clients = cfg->connections ? cfg->connections : 1;
  e->clients = calloc(e->n_clients, sizeof(*e->clients));
  if (!e->clients) return DETATTN_RESOURCE_EXHAUSTED;
  detattn_connect_opts co;
  da_load_connect_opts(cfg, cfg->data_plane, &co);
  for (uint32_t i = 0; i < e->n_clients; i++) {
    int rc = detattn_connect_ex(&e->clients[i], cfg->url, &co);
    if (rc != DETATTN_OK) {
      snprintf(msg, msglen, "connect %s: %s", cfg->url, detattn_errmsg());
      return rc;
    }
    detattn_set_timeout(e->clients[i], cfg->timeout_ms);
    rc = handshake(e->clients[i], &res->info, &res->connect_retries);
    if (rc != DETATTN_OK) {
      snprintf(msg, msglen, "hello: %s: %s", detattn_status_name(rc), detattn_errmsg());
      return rc;
    }
    int p = (int)detattn_data_plane_get(e->clients[i]);
    res->data_plane_used = i == 0 || p == res->data_plane_used ? p : -1;
  }
  return DETATTN_OK;
}

static void disconnect_all(engine *e) {
  for (uint32_t i = 0; e->clients && i < e->n_clients; i++) detattn_close(e->clients[i]);
  free(e->clients);
  e->clients = NULL;
}

int da_load_run(const da_load_cfg *cfg, const da_workload *w, da_load_result *res, char *msg,
                size_t msglen) {
  result_init(res, w->n_layers);
  engine e = {.cfg = cfg, .w = w};
  worker *wks = NULL;
  uint32_t n_workers = cfg->mode == DA_LOAD_OPEN ? cfg->max_inflight : cfg->concurrency;
  uint32_t started = 0;
  int rc = DETATTN_OK;
  if (n_workers == 0) n_workers = 1;
  pthread_mutex_init(&e.mu, NULL);

  rc = connect_all(&e, cfg, res, msg, msglen);
  if (rc != DETATTN_OK) goto fail_connect;
  fill_record_header(&res->record, &res->info, w);
  e.chunk = effective_chunk(cfg, w, &res->info);
  res->have_stats = detattn_stats_get(e.clients[0], &res->stats_before) == DETATTN_OK;

  wks = calloc(n_workers, sizeof(*wks));
  if (!wks) {
    snprintf(msg, msglen, "out of memory for %" PRIu32 " workers", n_workers);
    rc = DETATTN_RESOURCE_EXHAUSTED;
    goto fail_connect;
  }
  e.t0_ns = da_now_ns();
  e.warm_ns = e.t0_ns + (uint64_t)(cfg->warmup_s * 1e9);
  e.end_ns = cfg->duration_s > 0 ? e.t0_ns + (uint64_t)(cfg->duration_s * 1e9) : UINT64_MAX;
  if (cfg->mode == DA_LOAD_OPEN) da_arrivals_init(&e.arr, w->seed, cfg->rate, cfg->burstiness);
  for (; started < n_workers; started++) {
    worker_init(&wks[started], &e, w->n_layers);
    if (pthread_create(&wks[started].th, NULL, worker_main, &wks[started]) != 0) {
      worker_fini(&wks[started]);
      pthread_mutex_lock(&e.mu);
      e.stop = true;
      pthread_mutex_unlock(&e.mu);
      snprintf(msg, msglen, "cannot start worker thread %" PRIu32, started);
      rc = DETATTN_RESOURCE_EXHAUSTED;
      break;
    }
  }
  for (;;) {
    pthread_mutex_lock(&e.mu);
    bool all = e.workers_done == started;
    pthread_mutex_unlock(&e.mu);
    if (all) break;
    if (cfg->progress) progress(&e, false);
    usleep(200000);
  }
  if (cfg->progress) progress(&e, true);
  uint64_t last_done = e.warm_ns;
  for (uint32_t i = 0; i < started; i++) {
    pthread_join(wks[i].th, NULL);
    merge_worker(res, &wks[i]);
    if (wks[i].last_done_ns > last_done) last_done = wks[i].last_done_ns;
    worker_fini(&wks[i]);
  }
  free(wks);
  da_record_sort(&res->record);
  if (res->have_stats)
    res->have_stats = detattn_stats_get(e.clients[0], &res->stats_after) == DETATTN_OK;
  res->elapsed_s = (double)(last_done - e.warm_ns) * 1e-9;
  if (res->elapsed_s > 0) {
    res->tokens_per_s = (double)res->tokens / res->elapsed_s;
    res->output_tokens_per_s = (double)res->output_tokens / res->elapsed_s;
    res->forwards_per_s = (double)res->forward_calls / res->elapsed_s;
    res->sequences_per_s = (double)res->sequences / res->elapsed_s;
  }
fail_connect:
  disconnect_all(&e);
  pthread_mutex_destroy(&e.mu);
  return rc;
}

int da_load_replay(const da_load_cfg *cfg, const da_workload *w, const da_record *ran,
                   da_record *replay, uint32_t *retries, char *msg, size_t msglen) {
  da_record_init(replay, w->n_layers);
  replay->fingerprint = ran->fingerprint;
  memcpy(replay->numerics, ran->numerics, sizeof(replay->numerics));
  memcpy(replay->workload, ran->workload, sizeof(replay->workload));
  detattn_client *c = NULL;
  detattn_server_info info;
  detattn_connect_opts co; /* the reference: bytes in messages */
  da_load_connect_opts(cfg, DETATTN_PLANE_COPY, &co);
  int rc = detattn_connect_ex(&c, cfg->url, &co);
  if (rc != DETATTN_OK) {
    snprintf(msg, msglen, "connect %s: %s", cfg->url, detattn_errmsg());
    return rc;
  }
  detattn_set_timeout(c, cfg->timeout_ms);
  rc = handshake(c, &info, retries);
  if (rc != DETATTN_OK) {
    snprintf(msg, msglen, "hello: %s: %s", detattn_status_name(rc), detattn_errmsg());
    goto out;
  }
  replay->fingerprint = info.fingerprint;
  engine e = {.cfg = cfg, .w = w};
  pthread_mutex_init(&e.mu, NULL);
  worker wk;
  worker_init(&wk, &e, w->n_layers);
  uint32_t chunk = effective_chunk(cfg, w, &info);
  for (size_t i = 0; i < ran->n_seqs; i++) {
    da_seq_hashes s;
    rc = run_seq(&wk, c, w, chunk, ran->seqs[i].index, 0, 0, false, &s);
    if (rc == DETATTN_OK) rc = da_record_take(replay, &s);
    free(s.h);
    if (rc != DETATTN_OK) {
      snprintf(msg, msglen, "replay of sequence %" PRIu64 ": %s", ran->seqs[i].index,
               wk.first_error[0] ? wk.first_error : detattn_status_name(rc));
      break;
    }
    if (cfg->progress) {
      fprintf(stderr, "\rverify: %zu/%zu sequences", i + 1, ran->n_seqs);
      fflush(stderr);
    }
  }
  if (cfg->progress) fputc('\n', stderr);
  worker_fini(&wk);
  pthread_mutex_destroy(&e.mu);
out:
  detattn_close(c);
  if (rc != DETATTN_OK) da_record_fini(replay);
  return rc;
}
