/*
 * detattn-step-bench — what a serving stack pays per layer call through detattnd: B
 * sequences are prefilled to L tokens (chunks of --prefill-chunk, one Forward per layer per
 * chunk carrying every sequence that fits), then decoded for --steps steps of one Forward per
 * layer carrying all B sequences, one token each, over the chosen data plane.
 *
 * With --micro-batches 2 the batch is cut in two halves that ping-pong the way
 * attention-disaggregated serving does (MegaScale-Infer): while one half's attention is in
 * the daemon, the other half runs its MLP (simulated: --mlp-us of busy time per layer for
 * the whole batch, half of it per half), so the round trip hides behind the MLP.
 *
 * Prints a table; --json FILE writes layer_call_us_p50/p99, step_ms_p50/p99,
 * prefill_tokens_per_s, decode_tokens_per_s and the settings.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "da.h"
#include "detattn.h"
#include "devmem.h"
#include "hist.h"

typedef struct opts {
  const char *url, *json, *plane, *doorbell;
  int batch, context, steps, warmup, prefill_chunk, micro, layers, mlp_us;
  uint64_t seed;
} opts;

static void usage(FILE *f) {
  fprintf(f,
          "usage: detattn-step-bench --url URL [options]\n"
          "  --batch B            sequences decoded together (default 8)\n"
          "  --context L          tokens prefilled per sequence before decoding (default 1024)\n"
          "  --steps N            decode steps measured (default 50)\n"
          "  --warmup N           decode steps before the measured ones (default 5)\n"
          "  --prefill-chunk C    prefill chunk in tokens (default 512)\n"
          "  --layers N           layers driven (default: the model's)\n"
          "  --data-plane P       copy|shm|cuda|auto (default auto)\n"
          "  --doorbell D         auto|on|off: the same-host doorbell for per-layer calls (default auto)\n"
          "  --micro-batches M    1, or 2 halves in ping-pong (default 1)\n"
          "  --mlp-us U           simulated MLP busy time per layer for the whole batch (default 0)\n"
          "  --seed S             input seed (default 1)\n"
          "  --json FILE          write the results as JSON\n");
}

static int parse(int argc, char **argv, opts *o) {
  *o = (opts){.batch = 8, .context = 1024, .steps = 50, .warmup = 5, .prefill_chunk = 512, .micro = 1,
              .plane = "auto", .doorbell = "auto", .seed = 1};
  static const struct option lo[] = {
      {"url", 1, 0, 'u'},    {"batch", 1, 0, 'b'},         {"context", 1, 0, 'c'},       {"steps", 1, 0, 's'},
      {"warmup", 1, 0, 'w'}, {"prefill-chunk", 1, 0, 'p'}, {"layers", 1, 0, 'l'},        {"data-plane", 1, 0, 'd'},
      {"micro-batches", 1, 0, 'm'}, {"mlp-us", 1, 0, 'M'}, {"seed", 1, 0, 'S'},         {"json", 1, 0, 'j'},
      {"doorbell", 1, 0, 'D'},
      {"help", 0, 0, 'h'},   {0, 0, 0, 0}};
  int ch;
  while ((ch = getopt_long(argc, argv, "", lo, NULL)) != -1) {
    switch (ch) {
    case 'u': o->url = optarg; break;
    case 'b': o->batch = atoi(optarg); break;
    case 'c': o->context = atoi(optarg); break;
    case 's': o->steps = atoi(optarg); break;
    case 'w': o->warmup = atoi(optarg); break;
    case 'p': o->prefill_chunk = atoi(optarg); break;
    case 'l': o->layers = atoi(optarg); break;
    case 'd': o->plane = optarg; break;
    case 'D': o->doorbell = optarg; break;
    case 'm': o->micro = atoi(optarg); break;
    case 'M': o->mlp_us = atoi(optarg); break;
    case 'S': o->seed = strtoull(optarg, NULL, 10); break;
    case 'j': o->json = optarg; break;
    case 'h': usage(stdout); exit(0);
    default: return -1;
    }
  }
  if (!o->url || o->batch < 1 || o->context < 1 || o->steps < 1 || o->warmup < 0 || o->prefill_chunk < 1 ||
      (o->micro != 1 && o->micro != 2) || (o->micro == 2 && o->batch < 2) || o->mlp_us < 0 || o->layers < 0)
    return -1;
  return 0;
}

/* Busy time standing in for the MLP of a layer (a real stack computes here). */
static void spin_us(int us) {
  if (us <= 0) return;
  uint64_t until = da_now_ns() + (uint64_t)us * 1000u;
  while (da_now_ns() < until) {
  }
}

/* Tensors of the whole batch, in the arena when the plane is shm. */
typedef struct bufs {
  uint8_t *q, *k, *v, *o;
  size_t qrow, kvrow;
} bufs;

static void *mem(detattn_client *c, size_t n) {
  void *p = detattn_data_plane_get(c) == DETATTN_PLANE_SHM ? detattn_arena_alloc(c, n) : NULL;
  return p ? p : malloc(n);
}

/* --data-plane cuda: the same tensors, moved into one device allocation. */
static int to_device(bufs *b, size_t rows) {
  char why[160];
  if (!da_devmem_available(why, sizeof why)) {
    fprintf(stderr, "detattn-step-bench: --data-plane cuda: %s\n", why);
    return -1;
  }
  size_t qb = rows * b->qrow, kb = rows * b->kvrow;
  uint8_t *d = da_devmem_alloc(2 * qb + 2 * kb);
  if (!d || da_devmem_upload(d, b->q, qb) || da_devmem_upload(d + qb, b->k, kb) ||
      da_devmem_upload(d + qb + kb, b->v, kb)) {
    fprintf(stderr, "detattn-step-bench: --data-plane cuda: device memory for %zu rows failed\n", rows);
    return -1;
  }
  b->q = d, b->k = d + qb, b->v = d + qb + kb, b->o = d + qb + 2 * kb;
  return 0;
}

typedef struct bench {
  opts o;
  detattn_client *c;
  int cuda; /* --data-plane cuda: tensors in device memory, calls by detattn_forward_cuda */
  detattn_model m;
  int layers;
  uint64_t *seqs;
  uint32_t *len; /* [seq]: tokens in every layer */
  bufs b;        /* rows for max(batch, chunk tokens) */
  da_hist call_ns, step_ns;
  da_hist start_ns; /* one micro-batch: the part of a layer call spent in _start (build, send) */
} bench;

/* Starts the Forward of sequences [s0, s1) at layer l with t tokens each from pos len[s]. */
static int start(bench *x, int l, int s0, int s1, int t, detattn_seq_io *io, detattn_call **call) {
  for (int s = s0; s < s1; s++) {
    size_t r = (size_t)(s - s0) * (size_t)t;
    io[s - s0] = (detattn_seq_io){.seq = x->seqs[s], .pos = x->len[s], .n_tokens = (uint32_t)t,
                                  .q = x->b.q + r * x->b.qrow, .k = x->b.k + r * x->b.kvrow,
                                  .v = x->b.v + r * x->b.kvrow, .o = x->b.o + r * x->b.qrow};
  }
  if (x->cuda) return detattn_forward_cuda_start(x->c, (uint32_t)l, io, (size_t)(s1 - s0), NULL, call);
  return detattn_forward_start(x->c, (uint32_t)l, io, (size_t)(s1 - s0), call);
}

static int wait_call(detattn_call *call) {
  int st = detattn_call_wait(call);
  if (st != DETATTN_OK) fprintf(stderr, "detattn-step-bench: forward: %s: %s\n", detattn_status_name(st), detattn_errmsg());
  return st;
}

static int prefill(bench *x, double *secs) {
  const opts *o = &x->o;
  int max_tok = 4096;
  detattn_server_info info;
  if (detattn_hello(x->c, &info) == DETATTN_OK && info.max_tokens_per_request) max_tok = (int)info.max_tokens_per_request;
  detattn_seq_io *io = calloc((size_t)o->batch, sizeof *io);
  uint64_t t0 = da_now_ns();
  int st = DETATTN_OK;
  for (int done = 0; done < o->context && st == DETATTN_OK;) {
    int t = o->prefill_chunk < o->context - done ? o->prefill_chunk : o->context - done;
    int per = max_tok / t > 0 ? max_tok / t : 1; /* sequences per Forward */
    for (int s0 = 0; s0 < o->batch && st == DETATTN_OK; s0 += per) {
      int s1 = s0 + per < o->batch ? s0 + per : o->batch;
      for (int l = 0; l < x->layers && st == DETATTN_OK; l++) {
        detattn_call *call;
        st = start(x, l, s0, s1, t, io, &call);
        if (st == DETATTN_OK) st = wait_call(call);
      }
      for (int s = s0; s < s1; s++) x->len[s] += (uint32_t)t;
    }
    done += t;
  }
  *secs = (double)(da_now_ns() - t0) * 1e-9;
  free(io);
  return st;
}

/* One decode step over every layer; times each layer call. */
static int step(bench *x, int timed) {
  const opts *o = &x->o;
  int B = o->batch, half = B / 2;
  detattn_seq_io *io = calloc((size_t)B, sizeof *io);
  int st = DETATTN_OK;
  uint64_t t0 = da_now_ns();
  for (int l = 0; l < x->layers && st == DETATTN_OK; l++) {
    detattn_call *a, *b;
    if (o->micro == 1) {
      uint64_t c0 = da_now_ns();
      st = start(x, l, 0, B, 1, io, &a);
      if (timed) da_hist_record(&x->start_ns, da_now_ns() - c0);
      if (st == DETATTN_OK) st = wait_call(a);
      if (timed) da_hist_record(&x->call_ns, da_now_ns() - c0);
      spin_us(o->mlp_us);
    } else {
      /* Half A's attention overlaps half B's MLP of the previous layer, and the other way. */
      uint64_t c0 = da_now_ns();
      st = start(x, l, 0, half, 1, io, &a);
      if (st != DETATTN_OK) break;
      if (l > 0) spin_us(o->mlp_us / 2);
      st = wait_call(a);
      if (timed) da_hist_record(&x->call_ns, da_now_ns() - c0);
      if (st != DETATTN_OK) break;
      c0 = da_now_ns();
      st = start(x, l, half, B, 1, io + half, &b);
      if (st != DETATTN_OK) break;
      spin_us(o->mlp_us / 2);
      st = wait_call(b);
      if (timed) da_hist_record(&x->call_ns, da_now_ns() - c0);
    }
  }
  if (o->micro == 2 && st == DETATTN_OK) spin_us(o->mlp_us / 2); /* half B's last MLP */
  if (timed && st == DETATTN_OK) da_hist_record(&x->step_ns, da_now_ns() - t0);
  for (int s = 0; s < B; s++) x->len[s]++;
  free(io);
  return st;
}

int main(int argc, char **argv) {
  bench x;
  memset(&x, 0, sizeof x);
  if (parse(argc, argv, &x.o) != 0) {
    usage(stderr);
    return 2;
  }
  const opts *o = &x.o;
  detattn_connect_opts co;
  detattn_connect_opts_init(&co);
  static const char *const names[] = {"auto", "copy", "shm", "cuda"};
  co.data_plane = (detattn_data_plane)-1;
  for (int i = 0; i < 4; i++)
    if (strcmp(o->plane, names[i]) == 0) co.data_plane = (detattn_data_plane)i;
  if ((int)co.data_plane < 0) {
    fprintf(stderr, "detattn-step-bench: --data-plane %s is not copy, shm, cuda or auto\n", o->plane);
    return 2;
  }
  static const char *const bells[] = {"auto", "off", "on"};
  co.doorbell = (detattn_doorbell)-1;
  for (int i = 0; i < 3; i++)
    if (strcmp(o->doorbell, bells[i]) == 0) co.doorbell = (detattn_doorbell)i;
  if ((int)co.doorbell < 0) {
    fprintf(stderr, "detattn-step-bench: --doorbell %s is not auto, on or off\n", o->doorbell);
    return 2;
  }
  int chunk_rows = o->prefill_chunk * o->batch;
  detattn_server_info info;
  int st = detattn_connect_ex(&x.c, o->url, &co);
  if (st == DETATTN_OK) st = detattn_hello(x.c, &info);
  if (st != DETATTN_OK) {
    fprintf(stderr, "detattn-step-bench: connect %s: %s: %s\n", o->url, detattn_status_name(st), detattn_errmsg());
    return 1;
  }
  x.m = info.model;
  x.layers = o->layers > 0 && o->layers < (int)x.m.n_layers ? o->layers : (int)x.m.n_layers;
  x.b.qrow = (size_t)x.m.n_q_heads * x.m.head_dim * 2;
  x.b.kvrow = (size_t)x.m.n_kv_heads * x.m.head_dim * 2;
  size_t rows = (size_t)(chunk_rows > o->batch ? chunk_rows : o->batch);
  if (rows > info.max_tokens_per_request && info.max_tokens_per_request) rows = info.max_tokens_per_request;
  if (rows < (size_t)o->batch) rows = (size_t)o->batch;
  x.b.q = mem(x.c, rows * x.b.qrow);
  x.b.k = mem(x.c, rows * x.b.kvrow);
  x.b.v = mem(x.c, rows * x.b.kvrow);
  x.b.o = mem(x.c, rows * x.b.qrow);
  da_rng r;
  da_rng_seed(&r, o->seed);
  da_dtype dt = x.m.dtype == DETATTN_FP16 ? DA_FP16 : DA_BF16;
  da_rng_fill(&r, dt, x.b.q, rows * x.b.qrow / 2, 1.0);
  da_rng_fill(&r, dt, x.b.k, rows * x.b.kvrow / 2, 1.0);
  da_rng_fill(&r, dt, x.b.v, rows * x.b.kvrow / 2, 1.0);
  if (co.data_plane == DETATTN_PLANE_CUDA && (st = to_device(&x.b, rows)) != 0) return 1;
  x.cuda = co.data_plane == DETATTN_PLANE_CUDA;
  x.seqs = calloc((size_t)o->batch, sizeof *x.seqs);
  x.len = calloc((size_t)o->batch, sizeof *x.len);
  for (int s = 0; s < o->batch && st == DETATTN_OK; s++) st = detattn_seq_open(x.c, &x.seqs[s]);
  if (st != DETATTN_OK) {
    fprintf(stderr, "detattn-step-bench: seq_open: %s\n", detattn_errmsg());
    return 1;
  }
  double pre_s = 0;
  if ((st = prefill(&x, &pre_s)) != DETATTN_OK) return 1;
  da_hist_init(&x.call_ns);
  da_hist_init(&x.start_ns);
  da_hist_init(&x.step_ns);
  for (int i = 0; i < o->warmup + o->steps && st == DETATTN_OK; i++) st = step(&x, i >= o->warmup);
  if (st != DETATTN_OK) return 1;
  const char *plane = detattn_data_plane_name(x.cuda ? DETATTN_PLANE_CUDA : detattn_data_plane_get(x.c));
  int bell = detattn_doorbell_get(x.c) == DETATTN_DOORBELL_ON;
  double pre_tps = (double)o->batch * o->context / pre_s;
  double step_p50 = (double)da_hist_quantile(&x.step_ns, 0.5) * 1e-6, step_p99 = (double)da_hist_quantile(&x.step_ns, 0.99) * 1e-6;
  double call_p50 = (double)da_hist_quantile(&x.call_ns, 0.5) * 1e-3, call_p99 = (double)da_hist_quantile(&x.call_ns, 0.99) * 1e-3;
  double dec_tps = (double)o->batch / (da_hist_mean(&x.step_ns) * 1e-9);
  printf("| plane | doorbell | B | L | layers | micro | mlp us | layer call p50 us | p99 us | step p50 ms | p99 ms | decode tok/s | prefill tok/s |\n");
  printf("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n");
  printf("| %s | %s | %d | %d | %d | %d | %d | %.1f | %.1f | %.3f | %.3f | %.0f | %.0f |\n", plane, bell ? "on" : "off",
         o->batch, o->context, x.layers, o->micro, o->mlp_us, call_p50, call_p99, step_p50, step_p99, dec_tps, pre_tps);
  if (o->json) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "url", o->url);
    cJSON_AddStringToObject(j, "data_plane", plane);
    cJSON_AddBoolToObject(j, "doorbell", bell);
    cJSON_AddNumberToObject(j, "batch", o->batch);
    cJSON_AddNumberToObject(j, "context", o->context);
    cJSON_AddNumberToObject(j, "layers", x.layers);
    cJSON_AddNumberToObject(j, "steps", o->steps);
    cJSON_AddNumberToObject(j, "micro_batches", o->micro);
    cJSON_AddNumberToObject(j, "mlp_us", o->mlp_us);
    cJSON_AddNumberToObject(j, "prefill_chunk", o->prefill_chunk);
    cJSON_AddNumberToObject(j, "layer_call_us_p50", call_p50);
    cJSON_AddNumberToObject(j, "layer_call_us_p99", call_p99);
    if (o->micro == 1)
      cJSON_AddNumberToObject(j, "call_start_us_p50", (double)da_hist_quantile(&x.start_ns, 0.5) * 1e-3);
    cJSON_AddNumberToObject(j, "step_ms_p50", step_p50);
    cJSON_AddNumberToObject(j, "step_ms_p99", step_p99);
    cJSON_AddNumberToObject(j, "decode_tokens_per_s", dec_tps);
    cJSON_AddNumberToObject(j, "prefill_tokens_per_s", pre_tps);
    cJSON_AddStringToObject(j, "backend", info.backend);
    char *txt = cJSON_Print(j);
    FILE *f = fopen(o->json, "w");
    if (!f || fprintf(f, "%s\n", txt) < 0) {
      fprintf(stderr, "detattn-step-bench: cannot write %s\n", o->json);
      return 1;
    }
    fclose(f);
    free(txt);
    cJSON_Delete(j);
  }
  for (int s = 0; s < o->batch; s++) detattn_seq_close(x.c, x.seqs[s]);
  detattn_close(x.c);
  return 0;
}
