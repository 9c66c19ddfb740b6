/*
 * detattn-load — drives a detattnd like a serving stack, measures latency and throughput,
 * and proves the outputs stayed bit-identical under load (replay, record and compare).
 *
 * Exit status: 0 success; 1 the run had failed calls or --verify found differences;
 * 2 bad usage or the daemon could not be reached; 3 --compare found a difference.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "load.h"
#include "report.h"

#define MAX_SWEEP 32

typedef struct options {
  da_load_cfg cfg;
  da_workload w;
  const char *trace, *record, *compare, *json, *sweep, *sweep_out;
  bool verify, quiet, rate_set, conc_set, allow_remote;
  char sweep_param[16];
  double sweep_values[MAX_SWEEP];
  size_t n_sweep;
} options;

static void usage(FILE *f) {
  fprintf(f,
    "usage: detattn-load --url URL [options]\n"
    "URL: ipc://PATH or tcp://127.0.0.1:PORT (a remote daemon only with --allow-remote)\n"
    "Drives a detattnd with a seeded workload of sequences (prefill, then decode steps of one\n"
    "Forward per layer), reports latency and throughput, and checks outputs bit for bit.\n\n"
    "workload:\n"
    "  --seed N             workload seed (default 1): lengths and inputs of sequence i\n"
    "                       depend only on (seed, i)\n"
    "  --prompt N|LO:HI     prompt length, fixed or uniform (default 128)\n"
    "  --output N|LO:HI     output length, fixed or uniform (default 32)\n"
    "  --trace FILE         CSV of prompt,output lengths (sequence i uses line i mod n)\n"
    "  --prefill-chunk N    prefill in chunks of N tokens (default 0: whole prompt)\n"
    "load:\n"
    "  --concurrency N      closed loop: N sequences in flight (default 4)\n"
    "  --rate R             open loop: R sequence arrivals per second\n"
    "  --burstiness B       open loop: gamma shape of inter-arrival gaps (1 = Poisson)\n"
    "  --max-inflight N     open loop: at most N sequences run at once (default 64)\n"
    "  --duration S         start no sequence after S seconds (default 10 if no --requests)\n"
    "  --requests N         run sequences 0 .. N-1\n"
    "  --warmup S           leave calls scheduled in the first S seconds out of the stats\n"
    "  --connections N      client connections (default 1)\n"
    "  --data-plane P       copy|shm|cuda|auto: how tensors travel (default auto; replays copy)\n"
    "  --tls-ca F, --tls-cert F, --tls-key F   tls+tcp://: the daemon's CA, this client's cert and key\n"
    "  --timeout-ms N       per-call timeout (default 60000)\n"
    "checks and output:\n"
    "  --verify             afterwards replay every sequence alone and compare bits\n"
    "  --record FILE        save the fingerprint and every output hash\n"
    "  --compare FILE       compare this run's outputs with a recorded run\n"
    "  --json FILE          write the report (with --sweep: every point) as JSON\n"
    "  --sweep P=V1,V2,...  repeat the run for P = concurrency or rate; writes CSV + PNG\n"
    "  --sweep-out PREFIX   sweep output files PREFIX.csv, PREFIX.png (default detattn-load-sweep)\n"
    "  --quiet              no progress bar (it is shown only when stderr is a terminal)\n"
    "exit status: 0 ok, 1 failed calls or verify mismatches, 2 usage or connection error,\n"
    "3 compare found a difference\n");
}

static int parse_double(const char *name, const char *s, double lo, double *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || end == s || *end || !(v >= lo)) {
    fprintf(stderr, "detattn-load: %s: want a number >= %g, got \"%s\"\n", name, lo, s);
    return -1;
  }
  *out = v;
  return 0;
}

static int parse_u64(const char *name, const char *s, uint64_t lo, uint64_t hi, uint64_t *out) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || end == s || *end || s[0] == '-' || v < lo || v > hi) {
    fprintf(stderr, "detattn-load: %s: want an integer in [%" PRIu64 ", %" PRIu64 "], got \"%s\"\n",
            name, lo, hi, s);
    return -1;
  }
  *out = v;
  return 0;
}

/* ipc://, or tcp:// / tls+tcp:// to a loopback host. */
static bool url_is_local(const char *url) {
  if (strncmp(url, "ipc://", 6) == 0) return true;
  const char *host = NULL;
  if (strncmp(url, "tcp://", 6) == 0) host = url + 6;
  else if (strncmp(url, "tls+tcp://", 10) == 0) host = url + 10;
  if (!host) return false;
  return strncmp(host, "127.", 4) == 0 || strncmp(host, "localhost:", 10) == 0 ||
         strncmp(host, "[::1]:", 6) == 0;
}

static int parse_sweep(options *o) {
  const char *eq = strchr(o->sweep, '=');
  size_t plen = eq ? (size_t)(eq - o->sweep) : 0;
  if (!eq || plen >= sizeof(o->sweep_param)) goto bad;
  memcpy(o->sweep_param, o->sweep, plen);
  o->sweep_param[plen] = '\0';
  bool conc = strcmp(o->sweep_param, "concurrency") == 0;
  if (!conc && strcmp(o->sweep_param, "rate") != 0) goto bad;
  char buf[512];
  snprintf(buf, sizeof(buf), "%s", eq + 1);
  char *save = NULL;
  for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
    if (o->n_sweep == MAX_SWEEP) goto bad;
    double v;
    if (parse_double("--sweep", t, conc ? 1 : 1e-9, &v) != 0) return -1;
    if (conc && v != (double)(uint32_t)v) goto bad;
    o->sweep_values[o->n_sweep++] = v;
  }
  if (o->n_sweep == 0) goto bad;
  return 0;
bad:
  fprintf(stderr, "detattn-load: --sweep: want concurrency=N1,N2,... or rate=R1,R2,... "
          "(at most %d values), got \"%s\"\n", MAX_SWEEP, o->sweep);
  return -1;
}

enum { O_SEED = 256, O_PROMPT, O_OUTPUT, O_TRACE, O_CHUNK, O_CONC, O_RATE, O_BURST, O_INFLIGHT,
       O_DURATION, O_REQUESTS, O_WARMUP, O_CONNS, O_TIMEOUT, O_VERIFY, O_RECORD, O_COMPARE,
       O_JSON, O_SWEEP, O_SWEEP_OUT, O_QUIET, O_URL, O_HELP, O_REMOTE, O_PLANE, O_TLS_CA, O_TLS_CERT,
       O_TLS_KEY };

static const struct option long_opts[] = {
    {"url", required_argument, 0, O_URL},           {"seed", required_argument, 0, O_SEED},
    {"prompt", required_argument, 0, O_PROMPT},     {"output", required_argument, 0, O_OUTPUT},
    {"trace", required_argument, 0, O_TRACE},       {"prefill-chunk", required_argument, 0, O_CHUNK},
    {"concurrency", required_argument, 0, O_CONC},  {"rate", required_argument, 0, O_RATE},
    {"burstiness", required_argument, 0, O_BURST},  {"max-inflight", required_argument, 0, O_INFLIGHT},
    {"duration", required_argument, 0, O_DURATION}, {"requests", required_argument, 0, O_REQUESTS},
    {"warmup", required_argument, 0, O_WARMUP},     {"connections", required_argument, 0, O_CONNS},
    {"timeout-ms", required_argument, 0, O_TIMEOUT}, {"verify", no_argument, 0, O_VERIFY},
    {"record", required_argument, 0, O_RECORD},     {"compare", required_argument, 0, O_COMPARE},
    {"json", required_argument, 0, O_JSON},         {"sweep", required_argument, 0, O_SWEEP},
    {"sweep-out", required_argument, 0, O_SWEEP_OUT}, {"quiet", no_argument, 0, O_QUIET},
    {"help", no_argument, 0, O_HELP},               {"allow-remote", no_argument, 0, O_REMOTE},
    {"data-plane", required_argument, 0, O_PLANE},  {"tls-ca", required_argument, 0, O_TLS_CA},
    {"tls-cert", required_argument, 0, O_TLS_CERT}, {"tls-key", required_argument, 0, O_TLS_KEY},
    {0, 0, 0, 0}};

static int parse_args(options *o, int argc, char **argv) {
  char msg[256];
  uint64_t u;
  double d;
  o->cfg.concurrency = 4;
  o->cfg.burstiness = 1.0;
  o->cfg.max_inflight = 64;
  o->cfg.connections = 1;
  o->cfg.timeout_ms = 60000;
  o->w.seed = 1;
  o->w.prompt = (da_len_dist){DA_LEN_FIXED, 128, 128};
  o->w.output = (da_len_dist){DA_LEN_FIXED, 32, 32};
  o->sweep_out = "detattn-load-sweep";
  int c;
  while ((c = getopt_long(argc, argv, "h", long_opts, NULL)) != -1) {
    switch (c) {
    case O_URL: o->cfg.url = optarg; break;
    case O_SEED: if (parse_u64("--seed", optarg, 0, UINT64_MAX, &o->w.seed)) return -1; break;
    case O_PROMPT:
    case O_OUTPUT:
      if (da_len_parse(optarg, c == O_PROMPT ? &o->w.prompt : &o->w.output, msg, sizeof(msg))) {
        fprintf(stderr, "detattn-load: --%s: %s\n", c == O_PROMPT ? "prompt" : "output", msg);
        return -1;
      }
      break;
    case O_TRACE: o->trace = optarg; break;
    case O_CHUNK:
      if (parse_u64("--prefill-chunk", optarg, 0, UINT32_MAX, &u)) return -1;
      o->cfg.prefill_chunk = (uint32_t)u;
      break;
    case O_CONC:
      if (parse_u64("--concurrency", optarg, 1, 4096, &u)) return -1;
      o->cfg.concurrency = (uint32_t)u;
      o->conc_set = true;
      break;
    case O_RATE:
      if (parse_double("--rate", optarg, 1e-9, &o->cfg.rate)) return -1;
      o->rate_set = true;
      break;
    case O_BURST:
      if (parse_double("--burstiness", optarg, 1e-3, &o->cfg.burstiness)) return -1;
      break;
    case O_INFLIGHT:
      if (parse_u64("--max-inflight", optarg, 1, 4096, &u)) return -1;
      o->cfg.max_inflight = (uint32_t)u;
      break;
    case O_DURATION: if (parse_double("--duration", optarg, 0, &o->cfg.duration_s)) return -1; break;
    case O_REQUESTS: if (parse_u64("--requests", optarg, 1, UINT64_MAX, &o->cfg.requests)) return -1; break;
    case O_WARMUP: if (parse_double("--warmup", optarg, 0, &o->cfg.warmup_s)) return -1; break;
    case O_CONNS:
      if (parse_u64("--connections", optarg, 1, 256, &u)) return -1;
      o->cfg.connections = (uint32_t)u;
      break;
    case O_TIMEOUT:
      if (parse_double("--timeout-ms", optarg, 0, &d)) return -1;
      o->cfg.timeout_ms = (int)d;
      break;
    case O_VERIFY: o->verify = true; break;
    case O_RECORD: o->record = optarg; break;
    case O_COMPARE: o->compare = optarg; break;
    case O_JSON: o->json = optarg; break;
    case O_SWEEP: o->sweep = optarg; break;
    case O_SWEEP_OUT: o->sweep_out = optarg; break;
    case O_QUIET: o->quiet = true; break;
    case O_REMOTE: o->allow_remote = true; break;
    case O_TLS_CA: o->cfg.tls_ca = optarg; break;
    case O_TLS_CERT: o->cfg.tls_cert = optarg; break;
    case O_TLS_KEY: o->cfg.tls_key = optarg; break;
    case O_PLANE: {
      static const char *const names[] = {"auto", "copy", "shm", "cuda"};
      int found = -1;
      for (int i = 0; i < 4; i++)
        if (strcmp(optarg, names[i]) == 0) found = i;
      if (found < 0) {
        fprintf(stderr, "detattn-load: --data-plane %s is not copy, shm, cuda or auto\n", optarg);
        return -1;
      }
      o->cfg.data_plane = found;
      break;
    }
    case 'h':
    case O_HELP: usage(stdout); exit(0);
    default: usage(stderr); return -1;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "detattn-load: unexpected argument \"%s\"\n", argv[optind]);
    return -1;
  }
  if (!o->cfg.url) {
    fprintf(stderr, "detattn-load: --url is required (ipc://PATH or tcp://127.0.0.1:PORT)\n");
    return -1;
  }
  if (!o->allow_remote && !url_is_local(o->cfg.url)) {
    fprintf(stderr, "detattn-load: --url %s is not ipc:// or a loopback tcp:// address; "
            "pass --allow-remote to load a remote daemon\n", o->cfg.url);
    return -1;
  }
  if (o->rate_set && o->conc_set) {
    fprintf(stderr, "detattn-load: --rate (open loop) and --concurrency (closed loop) exclude each other\n");
    return -1;
  }
  o->cfg.mode = o->rate_set ? DA_LOAD_OPEN : DA_LOAD_CLOSED;
  if (o->cfg.warmup_s > 0 && o->cfg.duration_s > 0 && o->cfg.warmup_s >= o->cfg.duration_s) {
    fprintf(stderr, "detattn-load: --warmup (%g s) must be shorter than --duration (%g s)\n",
            o->cfg.warmup_s, o->cfg.duration_s);
    return -1;
  }
  if (o->cfg.duration_s == 0 && o->cfg.requests == 0) o->cfg.duration_s = 10;
  if (o->sweep) {
    if (parse_sweep(o)) return -1;
    if (o->verify || o->record || o->compare) {
      fprintf(stderr, "detattn-load: --sweep does not combine with --verify, --record or --compare\n");
      return -1;
    }
  }
  if (o->trace && da_trace_load(o->trace, &o->w.trace, &o->w.n_trace, msg, sizeof(msg))) {
    fprintf(stderr, "detattn-load: --trace: %s\n", msg);
    return -1;
  }
  o->cfg.progress = !o->quiet && isatty(STDERR_FILENO);
  o->cfg.keep_hashes = o->verify || o->record || o->compare;
  return 0;
}

static int run_sweep(options *o) {
  da_sweep_point pts[MAX_SWEEP];
  bool conc = strcmp(o->sweep_param, "concurrency") == 0;
  char msg[512];
  int status = 0;
  printf("%-12s %10s %10s %12s %10s %10s %10s %10s %10s\n", o->sweep_param, "sequences",
         "Forwards", "tokens/s", "p50 us", "p90 us", "p99 us", "p99.9 us", "errors");
  for (size_t i = 0; i < o->n_sweep; i++) {
    da_load_cfg cfg = o->cfg;
    if (conc) {
      cfg.mode = DA_LOAD_CLOSED;
      cfg.concurrency = (uint32_t)o->sweep_values[i];
    } else {
      cfg.mode = DA_LOAD_OPEN;
      cfg.rate = o->sweep_values[i];
    }
    da_load_result res;
    int rc = da_load_run(&cfg, &o->w, &res, msg, sizeof(msg));
    if (rc != DETATTN_OK) {
      fprintf(stderr, "detattn-load: %s\n", msg);
      da_load_result_fini(&res);
      return 2;
    }
    da_sweep_point_from(&pts[i], o->sweep_values[i], &res);
    const da_sweep_point *p = &pts[i];
    printf("%-12g %10" PRIu64 " %10" PRIu64 " %12.1f %10.1f %10.1f %10.1f %10.1f %10" PRIu64 "\n",
           p->value, p->sequences, p->forward_calls, p->tokens_per_s, p->p50_us, p->p90_us,
           p->p99_us, p->p999_us, p->errors);
    fflush(stdout);
    if (p->errors) status = 1;
    da_load_result_fini(&res);
  }
  bool plotted;
  if (da_report_sweep(o->sweep_out, o->sweep_param, pts, o->n_sweep, &plotted, msg, sizeof(msg))) {
    fprintf(stderr, "detattn-load: %s\n", msg);
    return 2;
  }
  if (o->json && da_report_sweep_json(o->json, o->sweep_param, pts, o->n_sweep, msg, sizeof(msg))) {
    fprintf(stderr, "detattn-load: --json: %s\n", msg);
    return 2;
  }
  printf("wrote %s.csv%s%s%s\n", o->sweep_out, plotted ? " and " : " (gnuplot unavailable: no plot)",
         plotted ? o->sweep_out : "", plotted ? ".png" : "");
  return status;
}

static int run_once(options *o) {
  char msg[512];
  int status = 0;
  da_record recorded = {0};
  da_report_checks chk = {0};
  da_load_result res;
  if (o->compare) {
    if (da_record_load(&recorded, o->compare, msg, sizeof(msg)) != DETATTN_OK) {
      fprintf(stderr, "detattn-load: --compare: %s\n", msg);
      return 2;
    }
  }
  int rc = da_load_run(&o->cfg, &o->w, &res, msg, sizeof(msg));
  if (rc != DETATTN_OK) {
    fprintf(stderr, "detattn-load: %s\n", msg);
    status = 2;
    goto out;
  }
  if (res.sequences_failed || res.forward_errors) status = 1;
  if (o->verify) {
    da_record replay;
    rc = da_load_replay(&o->cfg, &o->w, &res.record, &replay, &res.connect_retries, msg,
                        sizeof(msg));
    if (rc != DETATTN_OK) {
      fprintf(stderr, "detattn-load: --verify: %s\n", msg);
      status = 1;
    } else {
      chk.verified = true;
      da_record_compare(&res.record, &replay, &chk.verify);
      if (chk.verify.mismatches || chk.verify.sequences_missing) status = 1;
      da_record_fini(&replay);
    }
  }
  if (o->compare) {
    chk.compared = true;
    chk.compare_file = o->compare;
    chk.compare_fingerprint = recorded.fingerprint;
    da_record_compare(&recorded, &res.record, &chk.compare);
    if (!da_record_identical(&chk.compare) && status == 0) status = 3;
  }
  da_report_print(stdout, &o->cfg, &o->w, &res, &chk);
  if (o->record && da_record_save(&res.record, o->record, msg, sizeof(msg)) != DETATTN_OK) {
    fprintf(stderr, "detattn-load: --record: %s\n", msg);
    status = 2;
  }
  if (o->json &&
      da_report_json(o->json, &o->cfg, &o->w, &res, &chk, msg, sizeof(msg)) != DETATTN_OK) {
    fprintf(stderr, "detattn-load: --json: %s\n", msg);
    status = 2;
  }
out:
  da_load_result_fini(&res);
  da_record_fini(&recorded);
  return status;
}

int main(int argc, char **argv) {
  options o = {0};
  char msg[512];
  if (parse_args(&o, argc, argv) != 0) return 2;
  detattn_server_info info;
  if (da_load_hello(&o.cfg, &o.w, &info, msg, sizeof(msg)) != DETATTN_OK) {
    fprintf(stderr, "detattn-load: %s\n", msg);
    free(o.w.trace);
    return 2;
  }
  int status = o.sweep ? run_sweep(&o) : run_once(&o);
  free(o.w.trace);
  return status;
}
