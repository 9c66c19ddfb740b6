#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "da.h"
#include "devmem.h"
#include "verify.h"

/* One sequence on one layer: inputs and both passes' outputs for all its tokens. */
typedef struct seq_layer {
  uint32_t layer;
  uint16_t *q, *k, *v;
  uint16_t *o_ref, *o_conc;
  float *lse_ref, *lse_conc;
  /* cuda plane: the concurrent pass's tensors in device memory (inside its sequence's
   * allocation, dev_seq) */
  uint16_t *dq, *dk, *dv, *d_o;
  float *dlse;
} seq_layer;

struct da_verify {
  da_verify_cfg cfg;
  detattn_server_info info;
  int n_seqs, n_layers;
  uint32_t *prompt, *total; /* per sequence: prompt tokens, prompt + decode steps */
  uint32_t max_chunk;       /* tokens per Forward, from the daemon's limits */
  seq_layer *sl;            /* [n_seqs][n_layers] */
  size_t q_row, kv_row;     /* elements per token */
  int cuda;                 /* the concurrent pass uses the cuda plane */
  void **dev_seq;           /* [n_seqs]: one device allocation per sequence */
};

void da_verify_cfg_defaults(da_verify_cfg *c) {
  if (!c->seqs) c->seqs = 16;
  if (!c->clients) c->clients = 4;
  if (!c->layers_used) c->layers_used = 4;
  if (!c->max_prompt) c->max_prompt = 384;
  if (c->decode_steps < 0) c->decode_steps = 0;
  if (!c->timeout_ms) c->timeout_ms = 60000;
}

/* Connect options of the workload's connections: its TLS files and a data plane. */
static void connect_opts(const da_verify_cfg *cfg, detattn_connect_opts *o, detattn_data_plane plane) {
  detattn_connect_opts_init(o);
  o->data_plane = plane;
  o->tls_ca = cfg->tls_ca;
  o->tls_cert = cfg->tls_cert;
  o->tls_key = cfg->tls_key;
}

static int fail(char *msg, size_t len, int st, const char *what) {
  snprintf(msg, len, "%s: %s: %s", what, detattn_status_name(st), detattn_errmsg());
  return st;
}

static uint64_t mix(uint64_t seed, uint64_t a, uint64_t b) {
  da_rng r;
  da_rng_seed(&r, seed ^ (a * 0x9e3779b97f4a7c15ull) ^ (b * 0xc2b2ae3d27d4eb4full));
  return da_rng_u64(&r);
}

int da_verify_n_seqs(const da_verify *v) { return v->n_seqs; }
int da_verify_n_layers(const da_verify *v) { return v->n_layers; }
const detattn_server_info *da_verify_info(const da_verify *v) { return &v->info; }

void da_verify_get(const da_verify *v, int seq, int li, da_verify_tensors *out) {
  const seq_layer *t = &v->sl[(size_t)seq * v->n_layers + li];
  *out = (da_verify_tensors){t->layer, v->total[seq], t->q, t->k, t->v, t->o_conc, t->lse_conc};
}

void da_verify_free(da_verify *v) {
  if (!v) return;
  if (v->sl) {
    for (int i = 0; i < v->n_seqs * v->n_layers; i++) {
      seq_layer *t = &v->sl[i];
      free(t->q);
      free(t->k);
      free(t->v);
      free(t->o_ref);
      free(t->o_conc);
      free(t->lse_ref);
      free(t->lse_conc);
    }
  }
  if (v->dev_seq)
    for (int s = 0; s < v->n_seqs; s++) da_devmem_free(v->dev_seq[s]);
  free(v->dev_seq);
  free(v->sl);
  free(v->prompt);
  free(v->total);
  free(v);
}

static int draw_workload(da_verify *v, char *msg, size_t len) {
  const detattn_model *m = &v->info.model;
  da_rng r;
  uint64_t pages = 0;

  da_rng_seed(&r, mix(v->cfg.seed, 1, 0));
  v->prompt = calloc((size_t)v->n_seqs, sizeof *v->prompt);
  v->total = calloc((size_t)v->n_seqs, sizeof *v->total);
  v->sl = calloc((size_t)v->n_seqs * v->n_layers, sizeof *v->sl);
  if (!v->prompt || !v->total || !v->sl) goto oom;
  for (int s = 0; s < v->n_seqs; s++) {
    v->prompt[s] = (uint32_t)da_rng_range(&r, 1, v->cfg.max_prompt);
    v->total[s] = v->prompt[s] + (uint32_t)v->cfg.decode_steps;
    pages += (v->total[s] + m->page_tokens - 1) / m->page_tokens;
  }
  if (v->info.kv_pages && pages > v->info.kv_pages) {
    snprintf(msg, len, "workload needs %llu KV pages, the daemon has %u: lower --seqs or --max-prompt",
             (unsigned long long)pages, v->info.kv_pages);
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  for (int s = 0; s < v->n_seqs; s++) {
    for (int li = 0; li < v->n_layers; li++) {
      seq_layer *t = &v->sl[(size_t)s * v->n_layers + li];
      size_t n = v->total[s];
      t->layer = (uint32_t)((uint64_t)li * m->n_layers / (uint64_t)v->n_layers);
      t->q = malloc(n * v->q_row * 2);
      t->k = malloc(n * v->kv_row * 2);
      t->v = malloc(n * v->kv_row * 2);
      t->o_ref = malloc(n * v->q_row * 2);
      t->o_conc = malloc(n * v->q_row * 2);
      t->lse_ref = malloc(n * m->n_q_heads * sizeof(float));
      t->lse_conc = malloc(n * m->n_q_heads * sizeof(float));
      if (!t->q || !t->k || !t->v || !t->o_ref || !t->o_conc || !t->lse_ref || !t->lse_conc) goto oom;
      da_rng in;
      da_rng_seed(&in, mix(v->cfg.seed, 2 + (uint64_t)s, t->layer));
      da_rng_fill(&in, (da_dtype)m->dtype, t->q, n * v->q_row, 1.0);
      da_rng_fill(&in, (da_dtype)m->dtype, t->k, n * v->kv_row, 1.0);
      da_rng_fill(&in, (da_dtype)m->dtype, t->v, n * v->kv_row, 1.0);
      /* Distinct poison in each pass, so a row the daemon never wrote cannot match. */
      memset(t->o_ref, 0x7f, n * v->q_row * 2);
      memset(t->o_conc, 0xff, n * v->q_row * 2);
      memset(t->lse_ref, 0x7f, n * m->n_q_heads * sizeof(float));
      memset(t->lse_conc, 0xff, n * m->n_q_heads * sizeof(float));
    }
  }
  return DETATTN_OK;
oom:
  snprintf(msg, len, "out of memory drawing the workload");
  return DETATTN_RESOURCE_EXHAUSTED;
}

int da_verify_alloc(da_verify **out, const da_verify_cfg *cfg, char *msg, size_t len) {
  detattn_client *c;
  da_verify *v;
  int st;

  *out = NULL;
  if (!(v = calloc(1, sizeof *v))) {
    snprintf(msg, len, "out of memory");
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  v->cfg = *cfg;
  da_verify_cfg_defaults(&v->cfg);
  if (v->cfg.seqs < 1 || v->cfg.clients < 1 || v->cfg.layers_used < 1 || v->cfg.max_prompt < 1) {
    snprintf(msg, len, "seqs, clients, layers-used and max-prompt must be at least 1");
    da_verify_free(v);
    return DETATTN_INVALID_ARGUMENT;
  }
  detattn_connect_opts o0;
  connect_opts(&v->cfg, &o0, DETATTN_PLANE_COPY);
  if ((st = detattn_connect_ex(&c, v->cfg.url, &o0)) != DETATTN_OK) {
    da_verify_free(v);
    return fail(msg, len, st, "connect");
  }
  detattn_set_timeout(c, v->cfg.timeout_ms);
  st = detattn_hello(c, &v->info);
  detattn_close(c);
  if (st != DETATTN_OK) {
    da_verify_free(v);
    return fail(msg, len, st, "hello");
  }
  const detattn_model *m = &v->info.model;
  v->n_seqs = v->cfg.seqs;
  v->n_layers = v->cfg.layers_used < (int)m->n_layers ? v->cfg.layers_used : (int)m->n_layers;
  v->q_row = (size_t)m->n_q_heads * m->head_dim;
  v->kv_row = (size_t)m->n_kv_heads * m->head_dim;
  v->max_chunk = v->info.max_tokens_per_request ? v->info.max_tokens_per_request : 4096;
  if (v->info.max_message_bytes) {
    uint64_t per_token = (v->q_row + 2 * v->kv_row) * 2 + 64;
    uint64_t fit = v->info.max_message_bytes / 2 / per_token;
    if (fit < 1) fit = 1;
    if (fit < v->max_chunk) v->max_chunk = (uint32_t)fit;
  }
  if ((st = draw_workload(v, msg, len)) != DETATTN_OK) {
    da_verify_free(v);
    return st;
  }
  *out = v;
  return DETATTN_OK;
}

/* Cuts a prompt into chunks of at most cap tokens (sometimes all of it at once), then
 * one chunk per decode step. chunks: room for prompt + steps entries. */
static int cut(da_rng *r, uint32_t prompt, uint32_t steps, uint32_t cap, uint32_t *chunks) {
  int n = 0;
  for (uint32_t rem = prompt; rem > 0;) {
    uint32_t c = da_rng_range(r, 0, 3) == 0 ? rem : (uint32_t)da_rng_range(r, 1, rem);
    if (c > cap) c = cap;
    chunks[n++] = c;
    rem -= c;
  }
  for (uint32_t i = 0; i < steps; i++) chunks[n++] = 1;
  return n;
}

static detattn_seq_io io_for(const da_verify *v, const seq_layer *t, uint64_t seq, uint32_t pos, uint32_t n,
                             int conc) {
  size_t hq = v->info.model.n_q_heads;
  if (conc && v->cuda)
    return (detattn_seq_io){
        .seq = seq, .pos = pos, .n_tokens = n,
        .q = t->dq + pos * v->q_row, .k = t->dk + pos * v->kv_row, .v = t->dv + pos * v->kv_row,
        .o = t->d_o + pos * v->q_row, .lse = t->dlse + pos * hq};
  return (detattn_seq_io){
      .seq = seq, .pos = pos, .n_tokens = n,
      .q = t->q + pos * v->q_row, .k = t->k + pos * v->kv_row, .v = t->v + pos * v->kv_row,
      .o = (conc ? t->o_conc : t->o_ref) + pos * v->q_row,
      .lse = (conc ? t->lse_conc : t->lse_ref) + pos * hq};
}

static int reference_pass(da_verify *v, da_verify_result *res, char *msg, size_t len) {
  detattn_client *c;
  uint32_t *chunks = NULL;
  char what[96];
  int st;
  da_rng r;

  detattn_connect_opts co; /* the reference: bytes in messages */
  connect_opts(&v->cfg, &co, DETATTN_PLANE_COPY);
  if ((st = detattn_connect_ex(&c, v->cfg.url, &co)) != DETATTN_OK) return fail(msg, len, st, "reference pass: connect");
  detattn_set_timeout(c, v->cfg.timeout_ms);
  da_rng_seed(&r, mix(v->cfg.seed, 3, 0));
  for (int s = 0; s < v->n_seqs && st == DETATTN_OK; s++) {
    uint64_t seq;
    free(chunks);
    if (!(chunks = malloc(v->total[s] * sizeof *chunks))) {
      st = DETATTN_RESOURCE_EXHAUSTED;
      snprintf(msg, len, "out of memory");
      break;
    }
    int nc = cut(&r, v->prompt[s], (uint32_t)v->cfg.decode_steps, v->max_chunk, chunks);
    if ((st = detattn_seq_open(c, &seq)) != DETATTN_OK) {
      fail(msg, len, st, "reference pass: seq_open");
      break;
    }
    uint32_t pos = 0;
    for (int i = 0; i < nc && st == DETATTN_OK; i++) {
      for (int li = 0; li < v->n_layers && st == DETATTN_OK; li++) {
        const seq_layer *t = &v->sl[(size_t)s * v->n_layers + li];
        detattn_seq_io io = io_for(v, t, seq, pos, chunks[i], 0);
        if ((st = detattn_forward(c, t->layer, &io, 1)) != DETATTN_OK) {
          snprintf(what, sizeof what, "reference pass: forward seq %d layer %u pos %u tokens %u", s, t->layer, pos,
                   chunks[i]);
          fail(msg, len, st, what);
        }
        res->forwards_ref++;
      }
      pos += chunks[i];
    }
    int cst = detattn_seq_close(c, seq);
    if (st == DETATTN_OK && cst != DETATTN_OK) st = fail(msg, len, cst, "reference pass: seq_close");
  }
  free(chunks);
  detattn_close(c);
  return st;
}

/* One connection of the concurrent pass. */
typedef struct worker {
  da_verify *v;
  int index;
  uint64_t forwards;
  uint64_t fingerprint;
  int plane;
  int status;
  char msg[400];
} worker;

typedef struct cursor {
  int s;           /* workload sequence */
  uint64_t seq;    /* daemon sequence id */
  uint32_t *chunks;
  int n_chunks, next;
  uint32_t pos;
} cursor;

static int worker_round(worker *w, detattn_client *c, cursor *cur, int n_cur, da_rng *r) {
  da_verify *v = w->v;
  int order[64], n_active = 0, st = DETATTN_OK;
  int n_calls = 0;
  detattn_call **calls = malloc((size_t)n_cur * (size_t)v->n_layers * sizeof *calls);

  if (!calls) {
    snprintf(w->msg, sizeof w->msg, "out of memory");
    return DETATTN_RESOURCE_EXHAUSTED;
  }

  for (int i = 0; i < n_cur; i++)
    if (cur[i].next < cur[i].n_chunks) order[n_active++] = i;
  for (int i = n_active - 1; i > 0; i--) {
    int j = (int)da_rng_range(r, 0, i), x = order[i];
    order[i] = order[j];
    order[j] = x;
  }
  /* Groups of 1-3 sequences within the token cap; every layer of every group in flight. */
  for (int g0 = 0; g0 < n_active && st == DETATTN_OK;) {
    int want = (int)da_rng_range(r, 1, 3), g1 = g0;
    uint32_t tokens = 0;
    while (g1 < n_active && g1 - g0 < want) {
      uint32_t c = cur[order[g1]].chunks[cur[order[g1]].next];
      if (g1 > g0 && tokens + c > v->max_chunk) break;
      tokens += c;
      g1++;
    }
    for (int li = 0; li < v->n_layers && st == DETATTN_OK; li++) {
      detattn_seq_io io[64];
      uint32_t layer = 0;
      for (int x = g0; x < g1; x++) {
        const cursor *k = &cur[order[x]];
        const seq_layer *t = &v->sl[(size_t)k->s * v->n_layers + li];
        layer = t->layer;
        io[x - g0] = io_for(v, t, k->seq, k->pos, k->chunks[k->next], 1);
      }
      if ((st = v->cuda ? detattn_forward_cuda_start(c, layer, io, (size_t)(g1 - g0), NULL, &calls[n_calls])
                        : detattn_forward_start(c, layer, io, (size_t)(g1 - g0), &calls[n_calls])) != DETATTN_OK)
        fail(w->msg, sizeof w->msg, st, "concurrent pass: forward_start");
      else
        n_calls++;
    }
    g0 = g1;
  }
  for (int i = 0; i < n_calls; i++) {
    int cst = detattn_call_wait(calls[i]);
    w->forwards++;
    if (cst != DETATTN_OK && st == DETATTN_OK) st = fail(w->msg, sizeof w->msg, cst, "concurrent pass: forward");
  }
  free(calls);
  for (int i = 0; i < n_active; i++) {
    cursor *k = &cur[order[i]];
    k->pos += k->chunks[k->next];
    k->next++;
  }
  return st;
}

static void *worker_main(void *arg) {
  worker *w = arg;
  da_verify *v = w->v;
  detattn_client *c;
  detattn_server_info info;
  cursor cur[64];
  int n_cur = 0, st;
  da_rng r;

  memset(cur, 0, sizeof cur);
  detattn_connect_opts co;
  connect_opts(&v->cfg, &co, v->cfg.data_plane_set ? (detattn_data_plane)v->cfg.data_plane : DETATTN_PLANE_COPY);
  if ((st = detattn_connect_ex(&c, v->cfg.url_b ? v->cfg.url_b : v->cfg.url, &co)) != DETATTN_OK) {
    w->status = fail(w->msg, sizeof w->msg, st, "concurrent pass: connect");
    return NULL;
  }
  detattn_set_timeout(c, v->cfg.timeout_ms);
  if ((st = detattn_hello(c, &info)) != DETATTN_OK) {
    fail(w->msg, sizeof w->msg, st, "concurrent pass: hello");
    goto done;
  }
  w->fingerprint = info.fingerprint;
  w->plane = v->cuda ? DETATTN_PLANE_CUDA : (int)detattn_data_plane_get(c);
  da_rng_seed(&r, mix(v->cfg.seed, 4, (uint64_t)w->index));
  for (int s = w->index; s < v->n_seqs && n_cur < 64; s += v->cfg.clients) {
    cursor *k = &cur[n_cur++];
    k->s = s;
    if (!(k->chunks = malloc(v->total[s] * sizeof *k->chunks))) {
      st = DETATTN_RESOURCE_EXHAUSTED;
      snprintf(w->msg, sizeof w->msg, "out of memory");
      goto done;
    }
    k->n_chunks = cut(&r, v->prompt[s], (uint32_t)v->cfg.decode_steps, v->max_chunk, k->chunks);
    if ((st = detattn_seq_open(c, &k->seq)) != DETATTN_OK) {
      fail(w->msg, sizeof w->msg, st, "concurrent pass: seq_open");
      k->n_chunks = -1; /* not opened */
      goto done;
    }
  }
  for (;;) {
    int active = 0;
    for (int i = 0; i < n_cur; i++) active += cur[i].next < cur[i].n_chunks;
    if (!active) break;
    if ((st = worker_round(w, c, cur, n_cur, &r)) != DETATTN_OK) break;
  }
done:
  for (int i = 0; i < n_cur; i++) {
    if (cur[i].n_chunks >= 0) {
      int cst = detattn_seq_close(c, cur[i].seq);
      if (st == DETATTN_OK && cst != DETATTN_OK) st = fail(w->msg, sizeof w->msg, cst, "concurrent pass: seq_close");
    }
    free(cur[i].chunks);
  }
  detattn_close(c);
  w->status = st;
  return NULL;
}

/* cuda plane: every sequence's inputs and outputs in one device allocation of its own
 * (several registrations per connection), inputs uploaded before the pass. */
static int device_setup(da_verify *v, char *msg, size_t len) {
  const size_t hq = v->info.model.n_q_heads;
  char why[160];
  if (!da_devmem_available(why, sizeof why)) {
    snprintf(msg, len, "--data-plane cuda: %s", why);
    return DETATTN_FAILED_PRECONDITION;
  }
  if (!(v->dev_seq = calloc((size_t)v->n_seqs, sizeof *v->dev_seq))) {
    snprintf(msg, len, "out of memory");
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  for (int s = 0; s < v->n_seqs; s++) {
    const size_t n = v->total[s], qb = n * v->q_row * 2, kb = n * v->kv_row * 2, lb = n * hq * 4;
    const size_t per = (2 * qb + 2 * kb + lb + 255) & ~(size_t)255;
    uint8_t *d = v->dev_seq[s] = da_devmem_alloc(per * (size_t)v->n_layers);
    if (!d) {
      snprintf(msg, len, "--data-plane cuda: cannot allocate %zu bytes of device memory", per * (size_t)v->n_layers);
      return DETATTN_RESOURCE_EXHAUSTED;
    }
    for (int li = 0; li < v->n_layers; li++, d += per) {
      seq_layer *t = &v->sl[(size_t)s * v->n_layers + li];
      t->dq = (uint16_t *)d, t->dk = (uint16_t *)(d + qb), t->dv = (uint16_t *)(d + qb + kb);
      t->d_o = (uint16_t *)(d + qb + 2 * kb), t->dlse = (float *)(d + 2 * qb + 2 * kb);
      if (da_devmem_upload(t->dq, t->q, qb) || da_devmem_upload(t->dk, t->k, kb) ||
          da_devmem_upload(t->dv, t->v, kb) || da_devmem_upload(t->d_o, t->o_conc, qb) ||
          da_devmem_upload(t->dlse, t->lse_conc, lb)) {
        snprintf(msg, len, "--data-plane cuda: uploading the workload failed");
        return DETATTN_INTERNAL;
      }
    }
  }
  return DETATTN_OK;
}

/* cuda plane: the pass's outputs back to the host for the comparison. */
static int device_collect(da_verify *v, char *msg, size_t len) {
  const size_t hq = v->info.model.n_q_heads;
  if (da_devmem_sync() != 0) {
    snprintf(msg, len, "--data-plane cuda: device synchronize failed");
    return DETATTN_INTERNAL;
  }
  for (int s = 0; s < v->n_seqs; s++)
    for (int li = 0; li < v->n_layers; li++) {
      seq_layer *t = &v->sl[(size_t)s * v->n_layers + li];
      const size_t n = v->total[s];
      if (da_devmem_download(t->o_conc, t->d_o, n * v->q_row * 2) ||
          da_devmem_download(t->lse_conc, t->dlse, n * hq * 4)) {
        snprintf(msg, len, "--data-plane cuda: downloading the outputs failed");
        return DETATTN_INTERNAL;
      }
    }
  return DETATTN_OK;
}

static int concurrent_pass(da_verify *v, da_verify_result *res, char *msg, size_t len) {
  int n = v->cfg.clients, st = DETATTN_OK;
  v->cuda = v->cfg.data_plane_set && v->cfg.data_plane == DETATTN_PLANE_CUDA;
  if (v->cuda && (st = device_setup(v, msg, len)) != DETATTN_OK) return st;
  worker *w = calloc((size_t)n, sizeof *w);
  pthread_t *thr = calloc((size_t)n, sizeof *thr);
  int *started = calloc((size_t)n, sizeof *started);

  if (!w || !thr || !started) {
    snprintf(msg, len, "out of memory");
    st = DETATTN_RESOURCE_EXHAUSTED;
    goto done;
  }
  if ((v->n_seqs + n - 1) / n > 64) {
    snprintf(msg, len, "at most 64 sequences per client: raise --clients or lower --seqs");
    st = DETATTN_INVALID_ARGUMENT;
    goto done;
  }
  for (int i = 0; i < n; i++) {
    w[i] = (worker){.v = v, .index = i};
    started[i] = pthread_create(&thr[i], NULL, worker_main, &w[i]) == 0;
    if (!started[i]) {
      snprintf(msg, len, "cannot start client thread %d", i);
      st = DETATTN_RESOURCE_EXHAUSTED;
    }
  }
  for (int i = 0; i < n; i++)
    if (started[i]) pthread_join(thr[i], NULL);
  /* Every connection of the pass saw one daemon: without url_b, the reference pass's. */
  res->fingerprint_b = v->cfg.url_b ? w[0].fingerprint : res->fingerprint;
  res->data_plane_used = w[0].plane;
  for (int i = 1; i < n; i++)
    if (w[i].plane != res->data_plane_used) res->data_plane_used = -1; /* mixed */
  if (v->cuda && st == DETATTN_OK) st = device_collect(v, msg, len);
  for (int i = 0; i < n && st == DETATTN_OK; i++) {
    res->forwards_concurrent += w[i].forwards;
    if (w[i].status != DETATTN_OK) {
      st = w[i].status;
      snprintf(msg, len, "client %d: %s", i, w[i].msg);
    } else if (w[i].fingerprint != res->fingerprint_b) {
      st = DETATTN_FAILED_PRECONDITION;
      snprintf(msg, len, "client %d saw fingerprint %016llx, expected %016llx: the daemon changed", i,
               (unsigned long long)w[i].fingerprint, (unsigned long long)res->fingerprint_b);
    }
  }
done:
  free(w);
  free(thr);
  free(started);
  return st;
}

static void compare(const da_verify *v, da_verify_result *res) {
  const size_t hq = v->info.model.n_q_heads;
  for (int s = 0; s < v->n_seqs; s++) {
    for (int li = 0; li < v->n_layers; li++) {
      const seq_layer *t = &v->sl[(size_t)s * v->n_layers + li];
      for (uint32_t p = 0; p < v->total[s]; p++) {
        int bad_o = memcmp(t->o_ref + p * v->q_row, t->o_conc + p * v->q_row, v->q_row * 2) != 0;
        int bad_l = memcmp(t->lse_ref + p * hq, t->lse_conc + p * hq, hq * sizeof(float)) != 0;
        res->outputs_compared++;
        if (!bad_o && !bad_l) continue;
        if (!res->mismatches++)
          snprintf(res->first_mismatch, sizeof res->first_mismatch, "sequence %d layer %u token %u: %s differ", s,
                   t->layer, p, bad_o && bad_l ? "o and lse" : bad_o ? "o" : "lse");
      }
    }
  }
}

static int check_reference(const da_verify *v, da_verify_result *res) {
  const detattn_model *m = &v->info.model;
  const size_t hq = m->n_q_heads;
  for (int s = 0; s < v->n_seqs; s++) {
    size_t n = v->total[s];
    double *o = malloc(n * v->q_row * sizeof *o), *lse = malloc(n * hq * sizeof *lse);
    if (!o || !lse) {
      free(o);
      free(lse);
      return DETATTN_RESOURCE_EXHAUSTED;
    }
    for (int li = 0; li < v->n_layers; li++) {
      const seq_layer *t = &v->sl[(size_t)s * v->n_layers + li];
      da_verify_reference(m, (uint32_t)n, t->q, t->k, t->v, o, lse);
      for (size_t p = 0; p < n; p++) {
        double num = 0, den = 0;
        for (size_t x = 0; x < v->q_row; x++) {
          double got = da_to_f32((da_dtype)m->dtype, t->o_conc[p * v->q_row + x]), ref = o[p * v->q_row + x];
          num += (got - ref) * (got - ref);
          den += ref * ref;
        }
        double rel = den > 0 ? sqrt(num / den) : sqrt(num);
        if (!(rel <= res->max_rel_err)) res->max_rel_err = isnan(rel) ? INFINITY : rel;
        for (size_t h = 0; h < hq; h++) {
          double e = fabs((double)t->lse_conc[p * hq + h] - lse[p * hq + h]);
          if (!(e <= res->max_lse_abs_err)) res->max_lse_abs_err = isnan(e) ? INFINITY : e;
        }
      }
    }
    free(o);
    free(lse);
  }
  return DETATTN_OK;
}

int da_verify_run(da_verify *v, da_verify_result *res, char *msg, size_t len) {
  int st;
  uint64_t t0, t1;

  memset(res, 0, sizeof *res);
  msg[0] = '\0';
  res->fingerprint = v->info.fingerprint;
  for (int s = 0; s < v->n_seqs; s++) res->tokens += (uint64_t)v->total[s] * (uint64_t)v->n_layers;
  t0 = da_now_ns();
  if ((st = reference_pass(v, res, msg, len)) != DETATTN_OK) return st;
  t1 = da_now_ns();
  res->ref_seconds = (double)(t1 - t0) * 1e-9;
  if ((st = concurrent_pass(v, res, msg, len)) != DETATTN_OK) return st;
  res->concurrent_seconds = (double)(da_now_ns() - t1) * 1e-9;
  compare(v, res);
  if (v->cfg.check_ref && (st = check_reference(v, res)) != DETATTN_OK) {
    snprintf(msg, len, "out of memory for the fp64 reference");
    return st;
  }
  return DETATTN_OK;
}
