/*
 * report.h — what detattn-load tells its user: the summary table (text), the JSON report
 * (cJSON), and the sweep's CSV and plot (gnuplot).
 */
#ifndef DA_REPORT_H
#define DA_REPORT_H

#include <stdbool.h>
#include <stdio.h>

#include "load.h"
#include "record.h"

/* The checks done after a run: replay verification and comparison with a record file. */
typedef struct da_report_checks {
  bool verified;
  da_record_diff verify;
  bool compared;
  const char *compare_file;
  uint64_t compare_fingerprint;
  da_record_diff compare;
} da_report_checks;

void da_report_print(FILE *f, const da_load_cfg *cfg, const da_workload *w,
                     const da_load_result *res, const da_report_checks *chk);
/* Writes the JSON report to path. Errors: UNAVAILABLE (I/O), message in msg. */
int da_report_json(const char *path, const da_load_cfg *cfg, const da_workload *w,
                   const da_load_result *res, const da_report_checks *chk, char *msg,
                   size_t msglen);

/* One point of a sweep. */
typedef struct da_sweep_point {
  double value;
  uint64_t sequences, forward_calls, errors;
  double tokens_per_s, forwards_per_s;
  double p50_us, p90_us, p99_us, p999_us;
  double ttft_p50_ms, ttft_p99_ms, tpot_p50_ms;
} da_sweep_point;

void da_sweep_point_from(da_sweep_point *p, double value, const da_load_result *res);
/* Writes prefix.csv and, when gnuplot is available, prefix.png (latency vs throughput).
 * *plotted says whether the PNG was written. Errors: UNAVAILABLE (CSV I/O). */
int da_report_sweep(const char *prefix, const char *param, const da_sweep_point *pts, size_t n,
                    bool *plotted, char *msg, size_t msglen);

/* Writes the sweep as JSON: {"sweep": param, "points": [{value, sequences, forward_calls,
 * errors, tokens_per_s, forwards_per_s, latency_us {p50, p90, p99, p999}, ttft_ms {p50,
 * p99}, tpot_ms {p50}}]}. Errors: UNAVAILABLE (I/O). */
int da_report_sweep_json(const char *path, const char *param, const da_sweep_point *pts,
                         size_t n, char *msg, size_t msglen);

#endif /* DA_REPORT_H */
