#include "report.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cjson/cJSON.h>

static const double us = 1e-3, ms = 1e-6;

static void row(FILE *f, const char *name, const da_hist *h, double unit) {
  if (h->count == 0) {
    fprintf(f, "%-16s %9s\n", name, "0");
    return;
  }
  fprintf(f, "%-16s %9" PRIu64 " %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f\n", name, h->count,
          da_hist_mean(h) * unit, (double)da_hist_quantile(h, 0.50) * unit,
          (double)da_hist_quantile(h, 0.90) * unit, (double)da_hist_quantile(h, 0.99) * unit,
          (double)da_hist_quantile(h, 0.999) * unit, (double)h->max * unit);
}

static void mode_text(const da_load_cfg *cfg, char *buf, size_t len) {
  if (cfg->mode == DA_LOAD_OPEN)
    snprintf(buf, len, "open loop, %.2f seq/s (%s, burstiness %.2f), up to %" PRIu32 " in flight",
             cfg->rate, cfg->burstiness == 1.0 ? "Poisson" : "gamma", cfg->burstiness,
             cfg->max_inflight);
  else
    snprintf(buf, len, "closed loop, concurrency %" PRIu32, cfg->concurrency);
}

static void diff_text(FILE *f, const char *what, const da_record_diff *d) {
  fprintf(f, "%s: %" PRIu64 " outputs compared over %" PRIu64 " sequences, %" PRIu64
          " differ", what, d->outputs_compared, d->sequences_compared, d->mismatches);
  if (d->have_first)
    fprintf(f, " (first: sequence %" PRIu64 " layer %" PRIu32 " token %" PRIu32 ")",
            d->first_seq, d->first_layer, d->first_token);
  if (d->sequences_missing) fprintf(f, "; %" PRIu64 " sequences not in both", d->sequences_missing);
  fputc('\n', f);
}

void da_report_print(FILE *f, const da_load_cfg *cfg, const da_workload *w,
                     const da_load_result *res, const da_report_checks *chk) {
  const detattn_server_info *in = &res->info;
  char mode[160];
  mode_text(cfg, mode, sizeof(mode));
  fprintf(f, "detattn-load: %s, %" PRIu32 " connection(s), %s\n", mode,
          cfg->connections ? cfg->connections : 1, cfg->url);
  fprintf(f, "daemon: %s %s %s kernel %" PRIu32 ", S=%" PRIu32 " T=%" PRIu32
          ", fingerprint %016" PRIx64 "\n", in->server_version, in->backend, in->arch,
          in->kernel_version, in->split_tokens, in->tile_tokens, in->fingerprint);
  fprintf(f, "model: %" PRIu32 " layers, %" PRIu32 " q / %" PRIu32 " kv heads, head_dim %" PRIu32
          ", %s; workload %s\n\n", w->n_layers, w->n_q_heads, w->n_kv_heads, w->head_dim,
          da_dtype_name(w->dtype), res->record.workload);
  fprintf(f, "%-16s %9s %9s %9s %9s %9s %9s %9s\n", "", "count", "mean", "p50", "p90", "p99",
          "p99.9", "max");
  row(f, "forward (us)", &res->fwd, us);
  row(f, "  prefill (us)", &res->fwd_prefill, us);
  row(f, "  decode (us)", &res->fwd_decode, us);
  row(f, "ttft (ms)", &res->ttft, ms);
  row(f, "tpot (ms)", &res->tpot, ms);
  if (cfg->mode == DA_LOAD_OPEN) row(f, "start lag (ms)", &res->start_lag, ms);
  if (cfg->mode == DA_LOAD_OPEN && da_hist_quantile(&res->start_lag, 0.5) > 1000000)
    fprintf(f, "note: sequences started late (all %" PRIu32 " in flight: --max-inflight); the lag"
            " is in the latencies above\n", cfg->max_inflight);
  fprintf(f, "\nthroughput: %.1f tokens/s (%.1f output tokens/s), %.1f Forward/s, %.2f seq/s"
          " over %.2f s (after %.1f s warmup)\n", res->tokens_per_s, res->output_tokens_per_s,
          res->forwards_per_s, res->sequences_per_s, res->elapsed_s, cfg->warmup_s);
  fprintf(f, "sequences: %" PRIu64 " measured, %" PRIu64 " run, %" PRIu64 " failed; Forward calls %"
          PRIu64 " measured, %" PRIu64 " errors\n", res->sequences, res->sequences_total,
          res->sequences_failed, res->forward_calls, res->forward_errors);
  fprintf(f, "output digest: %016" PRIx64 " over %" PRIu64 " sequences (equal digests: equal bits)\n",
          res->digest, res->sequences_total - res->sequences_failed);
  if (res->first_error_status)
    fprintf(f, "first error: %s\n", res->first_error);
  if (res->connect_retries)
    fprintf(f, "connection handshakes retried after UNAVAILABLE: %" PRIu32 "\n",
            res->connect_retries);
  if (res->have_stats) {
    const detattn_stats *a = &res->stats_before, *b = &res->stats_after;
    uint64_t batches = b->batches - a->batches, toks = b->forward_tokens - a->forward_tokens;
    fprintf(f, "server (this run): %" PRIu64 " Forwards, %" PRIu64 " batches, %.1f tokens/batch,"
            " %" PRIu64 " in-row / %" PRIu64 " partial split items\n", b->forwards - a->forwards,
            batches, batches ? (double)toks / (double)batches : 0.0,
            b->inrow_items - a->inrow_items, b->partial_items - a->partial_items);
    fprintf(f, "server (since start): batch tokens p50 %.0f p99 %.0f max %.0f, requests/batch mean"
            " %.2f max %.0f, queue us p50 %.0f p99 %.0f max %.0f\n", b->batch_tokens_p50,
            b->batch_tokens_p99, b->batch_tokens_max, b->batch_requests_mean,
            b->batch_requests_max, b->queue_us_p50, b->queue_us_p99, b->queue_us_max);
  }
  if (chk->verified) diff_text(f, "verify (replay alone)", &chk->verify);
  if (chk->compared) {
    char what[300];
    snprintf(what, sizeof(what), "compare with %s", chk->compare_file);
    diff_text(f, what, &chk->compare);
    fprintf(f, "compare: %s; fingerprints %s (%016" PRIx64 " recorded, %016" PRIx64 " now)%s\n",
            da_record_identical(&chk->compare) ? "identical" : "DIFFERENT",
            chk->compare.fingerprints_differ ? "differ" : "equal", chk->compare_fingerprint,
            in->fingerprint, chk->compare.workloads_differ ? "; workloads differ" : "");
  }
}

static cJSON *hist_json(cJSON *parent, const char *name, const da_hist *h, double unit) {
  cJSON *o = cJSON_AddObjectToObject(parent, name);
  if (!o) return NULL;
  cJSON_AddNumberToObject(o, "count", (double)h->count);
  cJSON_AddNumberToObject(o, "mean", da_hist_mean(h) * unit);
  cJSON_AddNumberToObject(o, "p50", (double)da_hist_quantile(h, 0.50) * unit);
  cJSON_AddNumberToObject(o, "p90", (double)da_hist_quantile(h, 0.90) * unit);
  cJSON_AddNumberToObject(o, "p99", (double)da_hist_quantile(h, 0.99) * unit);
  cJSON_AddNumberToObject(o, "p999", (double)da_hist_quantile(h, 0.999) * unit);
  cJSON_AddNumberToObject(o, "max", (double)(h->count ? h->max : 0) * unit);
  return o;
}

static void diff_json(cJSON *o, const da_record_diff *d) {
  cJSON_AddNumberToObject(o, "sequences_compared", (double)d->sequences_compared);
  cJSON_AddNumberToObject(o, "sequences_missing", (double)d->sequences_missing);
  cJSON_AddNumberToObject(o, "outputs_compared", (double)d->outputs_compared);
  cJSON_AddNumberToObject(o, "mismatches", (double)d->mismatches);
  if (d->have_first) {
    cJSON *fd = cJSON_AddObjectToObject(o, "first_difference");
    cJSON_AddNumberToObject(fd, "sequence", (double)d->first_seq);
    cJSON_AddNumberToObject(fd, "layer", d->first_layer);
    cJSON_AddNumberToObject(fd, "token", d->first_token);
  } else {
    cJSON_AddNullToObject(o, "first_difference");
  }
}

/* Prints root to path and frees root. */
static int write_json(cJSON *root, const char *path, char *msg, size_t msglen) {
  int rc = DETATTN_OK;
  char *text = cJSON_Print(root);
  cJSON_Delete(root);
  if (!text) {
    snprintf(msg, msglen, "out of memory building the JSON report");
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  FILE *f = fopen(path, "w");
  if (!f || fputs(text, f) < 0 || fputc('\n', f) == EOF) {
    snprintf(msg, msglen, "cannot write %s: %s", path, strerror(errno));
    rc = DETATTN_UNAVAILABLE;
  }
  if (f && fclose(f) != 0 && rc == DETATTN_OK) {
    snprintf(msg, msglen, "cannot write %s: %s", path, strerror(errno));
    rc = DETATTN_UNAVAILABLE;
  }
  cJSON_free(text);
  return rc;
}

static void hex(char *buf, uint64_t v) { snprintf(buf, 17, "%016" PRIx64, v); }

int da_report_json(const char *path, const da_load_cfg *cfg, const da_workload *w,
                   const da_load_result *res, const da_report_checks *chk, char *msg,
                   size_t msglen) {
  char fp[17];
  cJSON *root = cJSON_CreateObject();
  if (!root) goto oom;
  cJSON_AddStringToObject(root, "url", cfg->url);
  cJSON_AddStringToObject(root, "mode", cfg->mode == DA_LOAD_OPEN ? "open" : "closed");
  if (cfg->mode == DA_LOAD_OPEN) {
    cJSON_AddNumberToObject(root, "rate", cfg->rate);
    cJSON_AddNumberToObject(root, "burstiness", cfg->burstiness);
  } else {
    cJSON_AddNumberToObject(root, "concurrency", cfg->concurrency);
  }
  cJSON_AddNumberToObject(root, "seed", (double)w->seed);
  cJSON_AddStringToObject(root, "workload", res->record.workload);
  hex(fp, res->info.fingerprint);
  cJSON_AddStringToObject(root, "fingerprint", fp);
  cJSON_AddStringToObject(root, "numerics", res->record.numerics);
  cJSON_AddStringToObject(root, "data_plane", res->data_plane_used < 0 ? "mixed"
                                              : detattn_data_plane_name((detattn_data_plane)res->data_plane_used));
  hex(fp, res->digest);
  cJSON_AddStringToObject(root, "output_digest", fp);
  cJSON_AddNumberToObject(root, "sequences", (double)res->sequences);
  cJSON_AddNumberToObject(root, "sequences_run", (double)res->sequences_total);
  cJSON_AddNumberToObject(root, "sequences_failed", (double)res->sequences_failed);
  cJSON_AddNumberToObject(root, "forward_calls", (double)res->forward_calls);
  cJSON_AddNumberToObject(root, "forward_errors", (double)res->forward_errors);
  cJSON_AddNumberToObject(root, "tokens", (double)res->tokens);
  cJSON_AddNumberToObject(root, "prompt_tokens", (double)res->prompt_tokens);
  cJSON_AddNumberToObject(root, "output_tokens", (double)res->output_tokens);
  cJSON_AddNumberToObject(root, "elapsed_s", res->elapsed_s);
  cJSON_AddNumberToObject(root, "tokens_per_s", res->tokens_per_s);
  cJSON_AddNumberToObject(root, "output_tokens_per_s", res->output_tokens_per_s);
  cJSON_AddNumberToObject(root, "forwards_per_s", res->forwards_per_s);
  hist_json(root, "latency_us", &res->fwd, us);
  hist_json(root, "prefill_latency_us", &res->fwd_prefill, us);
  hist_json(root, "decode_latency_us", &res->fwd_decode, us);
  hist_json(root, "ttft_ms", &res->ttft, ms);
  hist_json(root, "tpot_ms", &res->tpot, ms);
  if (cfg->mode == DA_LOAD_OPEN) hist_json(root, "start_lag_ms", &res->start_lag, ms);
  if (res->first_error_status) cJSON_AddStringToObject(root, "first_error", res->first_error);
  cJSON_AddNumberToObject(root, "connect_retries", res->connect_retries);
  if (res->have_stats) {
    const detattn_stats *a = &res->stats_before, *b = &res->stats_after;
    cJSON *s = cJSON_AddObjectToObject(root, "server");
    uint64_t batches = b->batches - a->batches;
    cJSON_AddNumberToObject(s, "forwards", (double)(b->forwards - a->forwards));
    cJSON_AddNumberToObject(s, "forward_tokens", (double)(b->forward_tokens - a->forward_tokens));
    cJSON_AddNumberToObject(s, "batches", (double)batches);
    cJSON_AddNumberToObject(s, "tokens_per_batch", batches ? (double)(b->forward_tokens - a->forward_tokens) / (double)batches : 0.0);
    cJSON_AddNumberToObject(s, "inrow_items", (double)(b->inrow_items - a->inrow_items));
    cJSON_AddNumberToObject(s, "partial_items", (double)(b->partial_items - a->partial_items));
    cJSON_AddNumberToObject(s, "batch_tokens_p50", b->batch_tokens_p50);
    cJSON_AddNumberToObject(s, "batch_tokens_p99", b->batch_tokens_p99);
    cJSON_AddNumberToObject(s, "batch_requests_mean", b->batch_requests_mean);
    cJSON_AddNumberToObject(s, "queue_us_p50", b->queue_us_p50);
    cJSON_AddNumberToObject(s, "queue_us_p99", b->queue_us_p99);
    cJSON_AddNumberToObject(s, "queue_us_max", b->queue_us_max);
  }
  /* Totals over both checks; each check's own numbers are in "verify" and "compare". */
  uint64_t compared = (chk->verified ? chk->verify.outputs_compared : 0) +
                      (chk->compared ? chk->compare.outputs_compared : 0);
  uint64_t mismatches = (chk->verified ? chk->verify.mismatches : 0) +
                        (chk->compared ? chk->compare.mismatches : 0);
  cJSON_AddNumberToObject(root, "outputs_compared", (double)compared);
  cJSON_AddNumberToObject(root, "mismatches", (double)mismatches);
  if (chk->verified) diff_json(cJSON_AddObjectToObject(root, "verify"), &chk->verify);
  if (chk->compared) {
    cJSON *c = cJSON_AddObjectToObject(root, "compare");
    cJSON_AddStringToObject(c, "file", chk->compare_file);
    cJSON_AddBoolToObject(c, "identical", da_record_identical(&chk->compare));
    cJSON_AddBoolToObject(c, "fingerprints_differ", chk->compare.fingerprints_differ);
    cJSON_AddBoolToObject(c, "workloads_differ", chk->compare.workloads_differ);
    hex(fp, chk->compare_fingerprint);
    cJSON_AddStringToObject(c, "recorded_fingerprint", fp);
    diff_json(c, &chk->compare);
  }
  return write_json(root, path, msg, msglen);
oom:
  cJSON_Delete(root);
  snprintf(msg, msglen, "out of memory building the JSON report");
  return DETATTN_RESOURCE_EXHAUSTED;
}

void da_sweep_point_from(da_sweep_point *p, double value, const da_load_result *res) {
  memset(p, 0, sizeof(*p));
  p->value = value;
  p->sequences = res->sequences;
  p->forward_calls = res->forward_calls;
  p->errors = res->forward_errors + res->sequences_failed;
  p->tokens_per_s = res->tokens_per_s;
  p->forwards_per_s = res->forwards_per_s;
  p->p50_us = (double)da_hist_quantile(&res->fwd, 0.50) * us;
  p->p90_us = (double)da_hist_quantile(&res->fwd, 0.90) * us;
  p->p99_us = (double)da_hist_quantile(&res->fwd, 0.99) * us;
  p->p999_us = (double)da_hist_quantile(&res->fwd, 0.999) * us;
  p->ttft_p50_ms = (double)da_hist_quantile(&res->ttft, 0.50) * ms;
  p->ttft_p99_ms = (double)da_hist_quantile(&res->ttft, 0.99) * ms;
  p->tpot_p50_ms = (double)da_hist_quantile(&res->tpot, 0.50) * ms;
}

int da_report_sweep(const char *prefix, const char *param, const da_sweep_point *pts, size_t n,
                    bool *plotted, char *msg, size_t msglen) {
  char csv[1024], png[1024];
  snprintf(csv, sizeof(csv), "%s.csv", prefix);
  snprintf(png, sizeof(png), "%s.png", prefix);
  *plotted = false;
  FILE *f = fopen(csv, "w");
  if (!f) {
    snprintf(msg, msglen, "cannot write %s: %s", csv, strerror(errno));
    return DETATTN_UNAVAILABLE;
  }
  fprintf(f, "%s,sequences,forward_calls,errors,tokens_per_s,forwards_per_s,p50_us,p90_us,"
          "p99_us,p999_us,ttft_p50_ms,ttft_p99_ms,tpot_p50_ms\n", param);
  for (size_t i = 0; i < n; i++) {
    const da_sweep_point *p = &pts[i];
    fprintf(f, "%g,%" PRIu64 ",%" PRIu64 ",%" PRIu64 ",%.2f,%.2f,%.1f,%.1f,%.1f,%.1f,%.3f,%.3f,%.3f\n",
            p->value, p->sequences, p->forward_calls, p->errors, p->tokens_per_s,
            p->forwards_per_s, p->p50_us, p->p90_us, p->p99_us, p->p999_us, p->ttft_p50_ms,
            p->ttft_p99_ms, p->tpot_p50_ms);
  }
  if (ferror(f) | (fclose(f) != 0)) {
    snprintf(msg, msglen, "error writing %s", csv);
    return DETATTN_UNAVAILABLE;
  }
  FILE *g = popen("gnuplot 2>/dev/null", "w");
  if (!g) return DETATTN_OK;
  fprintf(g,
          "set terminal png size 960,640 font ',11'\n"
          "set output '%s'\n"
          "set datafile separator ','\n"
          "set title 'detattn-load: Forward latency vs throughput (point labels: %s)'\n"
          "set offsets graph 0.05, graph 0.12, 0, 0\n"
          "set format y '%%g'\n"
          "set xlabel 'throughput (tokens/s)'\n"
          "set ylabel 'Forward latency (us)'\n"
          "set logscale y\n"
          "set grid\n"
          "set key top left\n"
          "plot '%s' skip 1 using 5:7 with linespoints pt 7 lw 2 title 'p50', "
          "'' skip 1 using 5:9 with linespoints pt 5 lw 2 title 'p99', "
          "'' skip 1 using 5:10 with linespoints pt 9 lw 2 title 'p99.9', "
          "'' skip 1 using 5:9:(sprintf('%%g', $1)) with labels offset 0,1.2 notitle\n",
          png, param, csv);
  int st = pclose(g);
  *plotted = st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0;
  return DETATTN_OK;
}

int da_report_sweep_json(const char *path, const char *param, const da_sweep_point *pts,
                         size_t n, char *msg, size_t msglen) {
  cJSON *root = cJSON_CreateObject();
  cJSON *arr = root ? cJSON_AddArrayToObject(root, "points") : NULL;
  if (!arr) {
    cJSON_Delete(root);
    snprintf(msg, msglen, "out of memory building the JSON report");
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  cJSON_AddStringToObject(root, "sweep", param);
  for (size_t i = 0; i < n; i++) {
    const da_sweep_point *p = &pts[i];
    cJSON *o = cJSON_CreateObject();
    cJSON_AddItemToArray(arr, o);
    cJSON_AddNumberToObject(o, "value", p->value);
    cJSON_AddNumberToObject(o, "sequences", (double)p->sequences);
    cJSON_AddNumberToObject(o, "forward_calls", (double)p->forward_calls);
    cJSON_AddNumberToObject(o, "errors", (double)p->errors);
    cJSON_AddNumberToObject(o, "tokens_per_s", p->tokens_per_s);
    cJSON_AddNumberToObject(o, "forwards_per_s", p->forwards_per_s);
    cJSON *l = cJSON_AddObjectToObject(o, "latency_us");
    cJSON_AddNumberToObject(l, "p50", p->p50_us);
    cJSON_AddNumberToObject(l, "p90", p->p90_us);
    cJSON_AddNumberToObject(l, "p99", p->p99_us);
    cJSON_AddNumberToObject(l, "p999", p->p999_us);
    cJSON *t = cJSON_AddObjectToObject(o, "ttft_ms");
    cJSON_AddNumberToObject(t, "p50", p->ttft_p50_ms);
    cJSON_AddNumberToObject(t, "p99", p->ttft_p99_ms);
    cJSON *tp = cJSON_AddObjectToObject(o, "tpot_ms");
    cJSON_AddNumberToObject(tp, "p50", p->tpot_p50_ms);
  }
  return write_json(root, path, msg, msglen);
}
