/*
 * bench_tp.c — what tensor parallelism's fan-out costs per layer call (not a test).
 *
 * Starts three daemons of one model (32 q / 8 kv heads, d 128, bf16, 4 layers): one with
 * every head, and two ranks of 16 q / 4 kv heads each, all on one backend (and on CUDA on
 * --device 0 unless --devices A,B,C says otherwise). Then times, per layer call, the same
 * work three ways, each mode's calls back to back (--order blocks, the default: a serving
 * stack's steady state) or taking turns call by call (--order interleaved: a daemon then
 * idles while the others run, and wakes up cold for its next call):
 *   one    detattn_forward on the daemon with every head
 *   tp2    detattn_tp_forward over the two ranks (gather, fan out, wait, scatter)
 *   tp1    detattn_tp_forward over the one daemon (the TP wrapper alone)
 * Cases: decode at B sequences x 1 token at context L, and a 512-token prefill chunk. It
 * also compares every o of `one` and `tp2` bitwise. Prints a markdown table.
 *
 * Usage: bench_tp [--backend cpu|cuda] [--devices 0,0,0] [--iters N] [--ctx L] [--order blocks|interleaved]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon_proc.h"
#include "detattn.h"
#include "testutil.h"

#define HQ 32
#define HKV 8
#define D 128
#define LAYERS 4

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static double pct(uint64_t *v, int n, double q) {
  qsort(v, (size_t)n, sizeof *v, cmp_u64);
  int i = (int)(q * (n - 1) + 0.5);
  return (double)v[i] / 1000.0;
}

typedef struct mode {
  const char *name;
  detattn_client *c; /* one */
  detattn_tp *tp;    /* tp2, tp1 */
  uint64_t seq[64];
  uint64_t *lat;
  int n_lat;
} mode;

static int call(mode *m, uint32_t layer, detattn_seq_io *io, size_t n) {
  return m->tp ? detattn_tp_forward(m->tp, layer, io, n) : detattn_forward(m->c, layer, io, n);
}

static void die(const char *what, int st) {
  fprintf(stderr, "bench_tp: %s: %s %s\n", what, detattn_status_name(st), detattn_errmsg());
  exit(1);
}

static int seq_open(mode *m, uint64_t *s) { return m->tp ? detattn_tp_seq_open(m->tp, s) : detattn_seq_open(m->c, s); }
static int seq_trunc(mode *m, uint64_t s, uint32_t len) {
  return m->tp ? detattn_tp_seq_truncate(m->tp, s, len) : detattn_seq_truncate(m->c, s, len);
}
static int seq_close(mode *m, uint64_t s) { return m->tp ? detattn_tp_seq_close(m->tp, s) : detattn_seq_close(m->c, s); }

static uint64_t fnv(const void *p, size_t n) {
  const unsigned char *b = p;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

/* Runs iters layer calls of B sequences x n tokens per mode (prefill: n = 512 at pos 0, the
 * sequences truncated back to 0 between calls; decode: contexts grow by one token per step
 * of LAYERS calls). interleave: the modes take turns call by call; otherwise each mode runs
 * its calls back to back (a serving stack's steady state), one mode after the other. The
 * outputs of modes 0 and 1 are compared call by call (hashes). */
static void run_case(mode *ms, int n_modes, int B, int n, int ctx, int iters, int interleave, long *mismatch) {
  size_t qn = (size_t)B * n * HQ * D, kn = (size_t)B * n * HKV * D;
  uint16_t *q = malloc(qn * 2), *k = malloc(kn * 2), *v = malloc(kn * 2), *o = malloc(qn * 2);
  uint64_t *hash[3];
  for (int i = 0; i < n_modes; i++) hash[i] = calloc((size_t)iters + 10, sizeof(uint64_t));
  da_rng r;
  da_rng_seed(&r, 4242);
  da_rng_fill(&r, DA_BF16, q, qn, 1.0);
  da_rng_fill(&r, DA_BF16, k, kn, 1.0);
  da_rng_fill(&r, DA_BF16, v, kn, 1.0);
  int prefill = n > 1;
  uint32_t pos[3][64];
  detattn_seq_io io[64];
  /* Sequences: decode ones are prefilled to ctx first (chunks of 512, every layer). */
  for (int mi = 0; mi < n_modes; mi++) {
    mode *m = &ms[mi];
    m->n_lat = 0;
    for (int b = 0; b < B; b++) {
      int st = seq_open(m, &m->seq[b]);
      if (st) die("seq_open", st);
      pos[mi][b] = prefill ? 0 : (uint32_t)ctx;
    }
    da_rng_seed(&r, 777); /* the same contexts in every mode */
    if (!prefill)
      for (int p0 = 0; p0 < ctx; p0 += 512)
        for (uint32_t l = 0; l < LAYERS; l++) {
          int c = ctx - p0 < 512 ? ctx - p0 : 512;
          uint16_t *big_q = malloc((size_t)c * HQ * D * 2), *big_k = malloc((size_t)c * HKV * D * 2),
                   *big_o = malloc((size_t)c * HQ * D * 2);
          da_rng_fill(&r, DA_BF16, big_q, (size_t)c * HQ * D, 1.0);
          da_rng_fill(&r, DA_BF16, big_k, (size_t)c * HKV * D, 1.0);
          for (int b = 0; b < B; b++) {
            detattn_seq_io x = {.seq = m->seq[b], .pos = (uint32_t)p0, .n_tokens = (uint32_t)c, .q = big_q, .k = big_k,
                                .v = big_k, .o = big_o};
            int st = call(m, l, &x, 1);
            if (st) die("prefill to ctx", st);
          }
          free(big_q);
          free(big_k);
          free(big_o);
        }
  }
  int outer = interleave ? iters + 10 : n_modes, inner = interleave ? n_modes : iters + 10;
  for (int a = 0; a < outer; a++)
    for (int c = 0; c < inner; c++) {
      int it = interleave ? a : c, mi = interleave ? c : a;
      mode *m = &ms[mi];
      uint32_t layer = prefill ? 0 : (uint32_t)(it % LAYERS);
      for (int b = 0; b < B; b++)
        io[b] = (detattn_seq_io){.seq = m->seq[b], .pos = pos[mi][b], .n_tokens = (uint32_t)n,
                                 .q = q + (size_t)b * n * HQ * D, .k = k + (size_t)b * n * HKV * D,
                                 .v = v + (size_t)b * n * HKV * D, .o = o + (size_t)b * n * HQ * D};
      uint64_t t0 = da_now_ns();
      int st = call(m, layer, io, (size_t)B);
      uint64_t t1 = da_now_ns();
      if (st) die(m->name, st);
      if (it >= 10) m->lat[m->n_lat++] = t1 - t0;
      hash[mi][it] = fnv(o, qn * 2);
      if (prefill)
        for (int b = 0; b < B; b++) {
          st = seq_trunc(m, m->seq[b], 0);
          if (st) die("truncate", st);
        }
      else if (layer == LAYERS - 1)
        for (int b = 0; b < B; b++) pos[mi][b]++;
    }
  for (int it = 0; n_modes > 1 && it < iters + 10; it++) *mismatch += hash[0][it] != hash[1][it];
  for (int mi = 0; mi < n_modes; mi++) {
    for (int b = 0; b < B; b++) seq_close(&ms[mi], ms[mi].seq[b]);
    free(hash[mi]);
  }
  free(q);
  free(k);
  free(v);
  free(o);
}

int main(int argc, char **argv) {
  const char *backend = "cpu", *devices = "0,0,0";
  int iters = 200, ctx = 1024, interleave = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--backend") == 0) backend = argv[i + 1];
    else if (strcmp(argv[i], "--devices") == 0) devices = argv[i + 1];
    else if (strcmp(argv[i], "--iters") == 0) iters = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--ctx") == 0) ctx = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--order") == 0) interleave = strcmp(argv[i + 1], "interleaved") == 0;
  }
  int cuda = strcmp(backend, "cuda") == 0;
  char dev[3][8];
  const char *p = devices;
  for (int i = 0; i < 3; i++) {
    snprintf(dev[i], sizeof dev[i], "%d", p ? atoi(p) : 0);
    p = p ? strchr(p, ',') : NULL;
    if (p) p++;
  }
  da_daemon_proc d[3];
  const char *heads[3][2] = {{"32", "8"}, {"16", "4"}, {"16", "4"}};
  /* Per mode: 32 sequences of ctx + iters / LAYERS tokens; daemon 0 serves two modes. */
  long per_mode = 32L * (ctx + iters / LAYERS + 32) + 1024;
  char kv[2][24];
  snprintf(kv[0], sizeof kv[0], "%ld", 2 * per_mode);
  snprintf(kv[1], sizeof kv[1], "%ld", per_mode);
  for (int i = 0; i < 3; i++) {
    const char *args[] = {"--layers", "4", "--q-heads", heads[i][0], "--kv-heads", heads[i][1], "--head-dim", "128",
                          "--page-tokens", "16", "--kv-tokens", kv[i > 0], "--split-tokens", "512", "--tile-tokens",
                          "64", "--backend", backend, "--device", dev[i], "--max-seqs", "256",
                          /* the bench is each daemon's only client: its quota is the whole cache */
                          "--client-max-kv-tokens", kv[i > 0], NULL};
    if (da_daemon_start(&d[i], DETATTND_PATH, args) != 0) {
      fprintf(stderr, "bench_tp: daemon %d did not start\n", i);
      for (int j = 0; j < i; j++) da_daemon_stop(&d[j]);
      return cuda ? 77 : 1;
    }
  }
  mode ms[3] = {{.name = "one"}, {.name = "tp2"}, {.name = "tp1"}};
  int st;
  if ((st = detattn_connect(&ms[0].c, d[0].url)) != 0) die("connect", st);
  const char *urls2[] = {d[1].url, d[2].url}, *urls1[] = {d[0].url};
  if ((st = detattn_tp_connect(&ms[1].tp, urls2, 2, NULL)) != 0) die("tp_connect 2", st);
  if ((st = detattn_tp_connect(&ms[2].tp, urls1, 1, NULL)) != 0) die("tp_connect 1", st);
  for (int i = 0; i < 3; i++) ms[i].lat = malloc(sizeof(uint64_t) * (size_t)iters);
  detattn_server_info info;
  detattn_hello(ms[0].c, &info);
  printf("bench_tp: backend %s (%s), model %d q / %d kv heads, d %d, %d layers; tp2 = 2 daemons of 16 / 4 heads "
         "(devices %s); %d calls per mode, %s; plane %s\n\n",
         info.backend, info.arch, HQ, HKV, D, LAYERS, devices, iters,
         interleave ? "interleaved call by call" : "each mode's calls back to back",
         detattn_data_plane_name(detattn_data_plane_get(ms[0].c)));
  printf("| case | one p50 us | tp2 p50 us | tp2 / one | tp1 p50 us | one p99 us | tp2 p99 us | o differ |\n");
  printf("|---|--:|--:|--:|--:|--:|--:|--:|\n");
  struct {
    const char *name;
    int B, n;
  } cases[] = {{"decode B1", 1, 1}, {"decode B8", 8, 1}, {"decode B32", 32, 1}, {"prefill 512", 1, 512}};
  for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
    long mismatch = 0;
    run_case(ms, 3, cases[c].B, cases[c].n, ctx, iters, interleave, &mismatch);
    double p50[3], p99[3];
    for (int i = 0; i < 3; i++) {
      p99[i] = pct(ms[i].lat, ms[i].n_lat, 0.99);
      p50[i] = pct(ms[i].lat, ms[i].n_lat, 0.50);
    }
    char label[64];
    if (cases[c].n > 1) snprintf(label, sizeof label, "%s", cases[c].name);
    else snprintf(label, sizeof label, "%s, L %d", cases[c].name, ctx);
    printf("| %s | %.1f | %.1f | %.2f | %.1f | %.1f | %.1f | %ld |\n", label, p50[0], p50[1], p50[1] / p50[0], p50[2],
           p99[0], p99[1], mismatch);
    fflush(stdout);
  }
  detattn_tp_close(ms[1].tp);
  detattn_tp_close(ms[2].tp);
  detattn_close(ms[0].c);
  for (int i = 0; i < 3; i++) {
    free(ms[i].lat);
    da_daemon_stop(&d[i]);
  }
  return 0;
}
