/*
 * detattn-bench: times attention shapes on a backend. See bench.h and --help.
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"

#define FILL_CHUNK 1024

static const bench_shape default_shapes[] = {
    {BENCH_DECODE, 1, 1024},    {BENCH_DECODE, 1, 4096},    {BENCH_DECODE, 1, 16384},
    {BENCH_DECODE, 8, 1024},    {BENCH_DECODE, 8, 4096},    {BENCH_DECODE, 8, 16384},
    {BENCH_DECODE, 32, 1024},   {BENCH_DECODE, 32, 4096},   {BENCH_DECODE, 32, 16384},
    {BENCH_PREFILL, 1, 512},    {BENCH_PREFILL, 1, 2048},
};
static const bench_shape quick_shapes[] = {
    {BENCH_DECODE, 1, 1024}, {BENCH_DECODE, 1, 4096}, {BENCH_DECODE, 8, 1024},
    {BENCH_DECODE, 8, 4096}, {BENCH_PREFILL, 1, 512},
};

void bench_rates(const bench_opts *o, const bench_shape *s, bench_result *r) {
  const double sec = r->ms * 1e-3;
  const double b = s->batch, l = s->ctx, d = o->model.head_dim;
  const double qtok = s->kind == BENCH_DECODE ? b : b * l;
  const double pairs = s->kind == BENCH_DECODE ? b * l : b * l * (l + 1) / 2;
  const double kv_bytes = b * l * o->model.n_kv_heads * d * 2 * da_dtype_size(o->model.dtype);
  r->tokens_per_s = qtok / sec;
  r->kv_gbps = kv_bytes / sec * 1e-9;
  r->gflops = 4.0 * d * pairs * o->model.n_q_heads / sec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int bench_backend_path(const bench_opts *o, const bench_shape *s, bench_result *out) {
  const da_model *m = &o->model;
  const int pt = o->page_tokens, L = s->ctx, B = s->batch;
  const int pps = (L + pt - 1) / pt;
  const size_t krow = (size_t)m->n_kv_heads * m->head_dim, qrow = (size_t)m->n_q_heads * m->head_dim;
  const int kv_tokens = L > FILL_CHUNK ? L : FILL_CHUNK;
  const int q_tokens = s->kind == BENCH_DECODE ? B : L;
  da_backend_cfg cfg = {.model = *m, .num = o->num, .page_tokens = pt, .n_pages = B * pps,
                        .n_threads = o->n_threads};
  int rv = DETATTN_RESOURCE_EXHAUSTED;
  da_backend *be = NULL;
  int32_t *pages = malloc(sizeof(int32_t) * (size_t)B * pps);
  uint16_t *k = malloc(krow * kv_tokens * 2), *v = malloc(krow * kv_tokens * 2);
  uint16_t *q = malloc(qrow * q_tokens * 2), *oo = malloc(qrow * q_tokens * 2);
  da_append *ap = calloc((size_t)B, sizeof(da_append));
  da_attn *at = calloc((size_t)B, sizeof(da_attn));
  double *times = calloc((size_t)o->max_reps, sizeof(double));
  if (!pages || !k || !v || !q || !oo || !ap || !at || !times) {
    snprintf(out->err, sizeof(out->err), "out of memory for shape buffers");
    goto done;
  }
  rv = da_backend_open(&be, o->backend, &cfg, out->err, sizeof(out->err));
  if (rv != 0) goto done;
  da_rng r;
  da_rng_seed(&r, o->seed);
  da_rng_fill(&r, m->dtype, k, krow * kv_tokens, 1.0);
  da_rng_fill(&r, m->dtype, v, krow * kv_tokens, 1.0);
  da_rng_fill(&r, m->dtype, q, qrow * q_tokens, 1.0);
  /* Pages: a random permutation of the pool, pps per sequence. */
  for (int i = 0; i < B * pps; i++) pages[i] = i;
  for (int i = B * pps - 1; i > 0; i--) {
    const int j = (int)da_rng_range(&r, 0, i);
    const int32_t t = pages[i];
    pages[i] = pages[j];
    pages[j] = t;
  }
  da_batch_result res;
  /* Decode: the cache holds the first L - 1 tokens of every sequence before timing. */
  if (s->kind == BENCH_DECODE) {
    for (int pos = 0; pos < L - 1; pos += FILL_CHUNK) {
      const int n = L - 1 - pos < FILL_CHUNK ? L - 1 - pos : FILL_CHUNK;
      for (int b = 0; b < B; b++)
        ap[b] = (da_append){.layer = 0, .pos = pos, .n_tokens = n, .pages = pages + b * pps,
                            .n_pages = pps, .k = k, .v = v};
      da_batch fill = {.appends = ap, .n_appends = B};
      rv = da_backend_run(be, &fill, &res);
      if (rv != 0) goto fail_run;
    }
  }
  for (int b = 0; b < B; b++) {
    const int32_t *pg = pages + b * pps;
    if (s->kind == BENCH_DECODE) {
      ap[b] = (da_append){.layer = 0, .pos = L - 1, .n_tokens = 1, .pages = pg, .n_pages = pps,
                          .k = k + (size_t)((L - 1) % FILL_CHUNK) * krow,
                          .v = v + (size_t)((L - 1) % FILL_CHUNK) * krow};
      at[b] = (da_attn){.layer = 0, .q_pos = L - 1, .n_q = 1, .pages = pg, .n_pages = pps,
                        .q = q + (size_t)b * qrow, .o = oo + (size_t)b * qrow};
    } else {
      ap[b] = (da_append){.layer = 0, .pos = 0, .n_tokens = L, .pages = pg, .n_pages = pps,
                          .k = k, .v = v};
      at[b] = (da_attn){.layer = 0, .q_pos = 0, .n_q = L, .pages = pg, .n_pages = pps,
                        .q = q, .o = oo};
    }
  }
  da_batch batch = {.appends = ap, .n_appends = B, .attns = at, .n_attns = B,
                    .split_mode = o->split_mode};
  rv = da_backend_run(be, &batch, &res); /* warm-up */
  if (rv != 0) goto fail_run;
  const uint64_t t_start = da_now_ns();
  int reps = 0;
  while (reps < o->max_reps &&
         (reps < o->min_reps || (double)(da_now_ns() - t_start) * 1e-9 < o->min_seconds)) {
    const uint64_t t0 = da_now_ns();
    rv = da_backend_run(be, &batch, &res);
    if (rv != 0) goto fail_run;
    times[reps++] = (double)(da_now_ns() - t0) * 1e-6;
  }
  qsort(times, (size_t)reps, sizeof(double), cmp_double);
  out->reps = reps;
  out->ms = times[reps / 2];
  out->ms_min = times[0];
  out->inrow_rows = res.inrow_rows;
  out->partial_rows = res.partial_rows;
  bench_rates(o, s, out);
  goto done;

fail_run:
  memcpy(out->err, res.err, sizeof(out->err));
  out->err[sizeof(out->err) - 1] = '\0';
done:
  da_backend_close(be);
  free(times);
  free(at);
  free(ap);
  free(oo);
  free(q);
  free(v);
  free(k);
  free(pages);
  return rv;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: detattn-bench [options]\n"
          "  --backend NAME     cpu, cuda or auto (default cpu); in CUDA builds, --backend cuda\n"
          "                     runs the CUDA kernel benchmark (bench_cuda.c) with the other\n"
          "                     options passed to it, unless --generic is given\n"
          "  --generic          time the backend through kernels/backend.h (any backend)\n"
          "  --quick            a small shape set, short timing (about 20 s on 2 cores)\n"
          "  --threads N        CPU worker threads (default: all online CPUs)\n"
          "  --split-mode M     auto, inrow or partial (default auto)\n"
          "  --shape K:B:L      run only this shape (K decode or prefill); repeatable\n"
          "  --hq N --hkv N --head-dim N --dtype bf16|fp16   model (default 32/8/128 bf16)\n"
          "  --page N --split N --tile N   page tokens (16), split S (512), tile T (64)\n"
          "  --min-time SEC     time each shape at least this long (default 0.5)\n"
          "  --seed N           data seed (default 1)\n");
}

static int parse_int(const char *s, int *out) {
  char *end;
  long v = strtol(s, &end, 10);
  if (*s == '\0' || *end != '\0' || v < 0 || v > (1L << 30)) return -1;
  *out = (int)v;
  return 0;
}

int bench_parse_split_mode(const char *s, da_split_mode *out) {
  if (strcmp(s, "auto") == 0) *out = DA_SPLIT_AUTO;
  else if (strcmp(s, "inrow") == 0) *out = DA_SPLIT_INROW;
  else if (strcmp(s, "partial") == 0) *out = DA_SPLIT_PARTIAL;
  else return -1;
  return 0;
}

static int parse_shape(const char *s, bench_shape *out) {
  char kind[16];
  int b, l;
  if (sscanf(s, "%15[a-z]:%d:%d", kind, &b, &l) != 3 || b < 1 || l < 1) return -1;
  if (strcmp(kind, "decode") == 0) out->kind = BENCH_DECODE;
  else if (strcmp(kind, "prefill") == 0) out->kind = BENCH_PREFILL;
  else return -1;
  out->batch = b;
  out->ctx = l;
  return 0;
}

/* In CUDA builds, "--backend cuda" without --generic hands the other arguments to the
 * CUDA kernel benchmark. Returns -1 when that does not apply. */
static int run_cuda_kernels(int argc, char **argv) {
#if defined(DETATTN_HAVE_CUDA) && defined(DETATTN_BENCH_CUDA)
  int cuda = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--generic") == 0) return -1;
    if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc && strcmp(argv[i + 1], "cuda") == 0)
      cuda = 1;
  }
  if (!cuda) return -1;
  char **rest = calloc((size_t)argc + 1, sizeof(char *));
  if (rest == NULL) return 1;
  int n = 0;
  for (int i = 0; i < argc; i++) {
    if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc) {
      i++;
      continue;
    }
    rest[n++] = argv[i];
  }
  int rv = da_bench_cuda(n, rest);
  free(rest);
  return rv;
#else
  (void)argc;
  (void)argv;
  return -1;
#endif
}

int main(int argc, char **argv) {
  const int cuda_rv = run_cuda_kernels(argc, argv);
  if (cuda_rv >= 0) return cuda_rv;
  bench_opts o = {.backend = "cpu",
                  .model = {.n_layers = 1, .n_q_heads = 32, .n_kv_heads = 8, .head_dim = 128,
                            .dtype = DA_BF16},
                  .num = {.split_tokens = DA_DEFAULT_SPLIT_TOKENS,
                          .tile_tokens = DA_DEFAULT_TILE_TOKENS},
                  .page_tokens = 16,
                  .split_mode = DA_SPLIT_AUTO,
                  .min_seconds = 0.5,
                  .min_reps = 3,
                  .max_reps = 200,
                  .seed = 1};
  bench_shape user[64];
  int n_user = 0, quick = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
    int bad = 0;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      usage(stdout);
      return 0;
    } else if (strcmp(a, "--quick") == 0) {
      quick = 1;
      continue;
    } else if (strcmp(a, "--generic") == 0) {
      continue;
    } else if (val == NULL) {
      bad = 1;
    } else if (strcmp(a, "--backend") == 0) {
      o.backend = val;
    } else if (strcmp(a, "--threads") == 0) {
      bad = parse_int(val, &o.n_threads);
    } else if (strcmp(a, "--split-mode") == 0) {
      bad = bench_parse_split_mode(val, &o.split_mode);
    } else if (strcmp(a, "--shape") == 0) {
      bad = n_user == 64 || parse_shape(val, &user[n_user++]);
    } else if (strcmp(a, "--hq") == 0) {
      bad = parse_int(val, &o.model.n_q_heads);
    } else if (strcmp(a, "--hkv") == 0) {
      bad = parse_int(val, &o.model.n_kv_heads);
    } else if (strcmp(a, "--head-dim") == 0) {
      bad = parse_int(val, &o.model.head_dim);
    } else if (strcmp(a, "--dtype") == 0) {
      bad = da_dtype_parse(val, &o.model.dtype) != 0;
    } else if (strcmp(a, "--page") == 0) {
      bad = parse_int(val, &o.page_tokens);
    } else if (strcmp(a, "--split") == 0) {
      bad = parse_int(val, &o.num.split_tokens);
    } else if (strcmp(a, "--tile") == 0) {
      bad = parse_int(val, &o.num.tile_tokens);
    } else if (strcmp(a, "--min-time") == 0) {
      o.min_seconds = atof(val);
      bad = !(o.min_seconds >= 0.0);
    } else if (strcmp(a, "--seed") == 0) {
      o.seed = strtoull(val, NULL, 0);
    } else {
      fprintf(stderr, "detattn-bench: unknown option '%s'\n", a);
      usage(stderr);
      return 2;
    }
    if (bad) {
      fprintf(stderr, "detattn-bench: bad value for %s\n", a);
      return 2;
    }
    i++;
  }
  if (quick) {
    o.min_seconds = o.min_seconds < 0.1 ? o.min_seconds : 0.1;
    o.min_reps = 2;
  }
  da_model_defaults(&o.model);
  char msg[256];
  if (da_model_check(&o.model, &o.num, msg, sizeof(msg)) != 0) {
    fprintf(stderr, "detattn-bench: %s\n", msg);
    return 2;
  }
  const bench_shape *shapes = n_user ? user : quick ? quick_shapes : default_shapes;
  const int n_shapes = n_user ? n_user
                       : quick ? (int)(sizeof(quick_shapes) / sizeof(quick_shapes[0]))
                               : (int)(sizeof(default_shapes) / sizeof(default_shapes[0]));

  struct utsname un;
  time_t now = time(NULL);
  char date[32];
  strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", gmtime(&now));
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  printf("# detattn-bench %s  backend %s  host %s  %ld CPUs online", date, o.backend,
         uname(&un) == 0 ? un.machine : "?", online);
  if (strcmp(o.backend, "cpu") == 0) printf("  threads %d", o.n_threads ? o.n_threads : (int)online);
  printf("\n");
  printf("# model Hq=%d Hkv=%d d=%d %s  page %d  S=%d T=%d  split mode %s\n", o.model.n_q_heads,
         o.model.n_kv_heads, o.model.head_dim, da_dtype_name(o.model.dtype), o.page_tokens,
         o.num.split_tokens, o.num.tile_tokens,
         o.split_mode == DA_SPLIT_AUTO ? "auto" : o.split_mode == DA_SPLIT_INROW ? "inrow" : "partial");
  printf("%-8s %4s %6s %10s %10s %12s %9s %9s %6s %s\n", "kind", "B", "L", "ms(med)", "ms(min)",
         "tok/s", "KV GB/s", "GFLOP/s", "reps", "rows in-row/partial");
  int failed = 0;
  for (int i = 0; i < n_shapes; i++) {
    const bench_shape *s = &shapes[i];
    bench_result r = {0};
    int rv = bench_backend_path(&o, s, &r);
    const char *kind = s->kind == BENCH_DECODE ? "decode" : "prefill";
    if (rv != 0) {
      printf("%-8s %4d %6d  failed: %s: %s\n", kind, s->batch, s->ctx, detattn_status_name(rv), r.err);
      failed = 1;
      continue;
    }
    printf("%-8s %4d %6d %10.3f %10.3f %12.0f %9.2f %9.2f %6d %lld/%lld\n", kind, s->batch, s->ctx,
           r.ms, r.ms_min, r.tokens_per_s, r.kv_gbps, r.gflops, r.reps,
           (long long)r.inrow_rows, (long long)r.partial_rows);
    fflush(stdout);
  }
  return failed;
}
