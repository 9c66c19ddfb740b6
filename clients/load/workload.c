#include "workload.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include <xxhash.h>

static int parse_u32(const char *s, char **end, uint32_t *out) {
  if (!isdigit((unsigned char)*s)) return -1;
  errno = 0;
  unsigned long long v = strtoull(s, end, 10);
  if (errno || v == 0 || v > UINT32_MAX) return -1;
  *out = (uint32_t)v;
  return 0;
}

int da_len_parse(const char *s, da_len_dist *out, char *msg, size_t msglen) {
  char *end;
  da_len_dist d = {0};
  if (parse_u32(s, &end, &d.lo) != 0) goto bad;
  if (*end == '\0') {
    d.kind = DA_LEN_FIXED;
    d.hi = d.lo;
  } else if (*end == ':') {
    if (parse_u32(end + 1, &end, &d.hi) != 0 || *end != '\0' || d.hi < d.lo) goto bad;
    d.kind = DA_LEN_UNIFORM;
  } else {
    goto bad;
  }
  *out = d;
  return DETATTN_OK;
bad:
  snprintf(msg, msglen, "bad length \"%s\": want N or LO:HI with 1 <= LO <= HI", s);
  return DETATTN_INVALID_ARGUMENT;
}

int da_trace_load(const char *path, da_trace_entry **out, size_t *n, char *msg, size_t msglen) {
  FILE *f = fopen(path, "r");
  if (!f) {
    snprintf(msg, msglen, "cannot open trace %s: %s", path, strerror(errno));
    return DETATTN_NOT_FOUND;
  }
  da_trace_entry *v = NULL;
  size_t len = 0, cap = 0;
  char line[256];
  int lineno = 0, rc = DETATTN_OK;
  while (fgets(line, sizeof(line), f)) {
    lineno++;
    char *p = line;
    while (*p == ' ' || *p == '\t') p++;
    if (*p == '#' || *p == '\n' || *p == '\r' || *p == '\0') continue;
    if (lineno == 1 && !isdigit((unsigned char)*p)) continue;
    da_trace_entry e;
    char *end;
    if (parse_u32(p, &end, &e.prompt) != 0) goto bad_line;
    while (*end == ' ') end++;
    if (*end != ',') goto bad_line;
    end++;
    while (*end == ' ') end++;
    if (parse_u32(end, &end, &e.output) != 0) goto bad_line;
    while (*end == ' ' || *end == '\r' || *end == '\n') end++;
    if (*end != '\0') goto bad_line;
    if (len == cap) {
      size_t ncap = cap ? cap * 2 : 64;
      da_trace_entry *nv = realloc(v, ncap * sizeof(*v));
      if (!nv) {
        snprintf(msg, msglen, "out of memory reading trace %s", path);
        rc = DETATTN_RESOURCE_EXHAUSTED;
        goto fail;
      }
      v = nv;
      cap = ncap;
    }
    v[len++] = e;
  }
  if (len == 0) {
    snprintf(msg, msglen, "trace %s has no (prompt,output) lines", path);
    rc = DETATTN_INVALID_ARGUMENT;
    goto fail;
  }
  fclose(f);
  *out = v;
  *n = len;
  return DETATTN_OK;
bad_line:
  snprintf(msg, msglen, "trace %s line %d: want \"prompt,output\" with positive integers",
           path, lineno);
  rc = DETATTN_INVALID_ARGUMENT;
fail:
  free(v);
  fclose(f);
  return rc;
}

static uint64_t mix(uint64_t seed, uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t key[4] = {a, b, c, d};
  return XXH3_64bits_withSeed(key, sizeof(key), seed);
}

static uint32_t draw_len(const da_len_dist *d, da_rng *r) {
  if (d->kind == DA_LEN_FIXED) return d->lo;
  return (uint32_t)da_rng_range(r, d->lo, d->hi);
}

void da_workload_lengths(const da_workload *w, uint64_t i, uint32_t *prompt, uint32_t *output) {
  if (w->n_trace) {
    const da_trace_entry *e = &w->trace[i % w->n_trace];
    *prompt = e->prompt;
    *output = e->output;
    return;
  }
  da_rng r;
  da_rng_seed(&r, mix(w->seed, 1, i, 0, 0));
  *prompt = draw_len(&w->prompt, &r);
  *output = draw_len(&w->output, &r);
}

/* Unit-variance uniform values in [-sqrt(3), sqrt(3)), 16 random bits each: cheap enough
 * that the client does not compete with a CPU daemon for cores. */
static void fill_uniform(da_rng *r, da_dtype t, uint16_t *dst, size_t n) {
  const float step = 3.4641016f / 65536.0f, lo = -1.7320508f;
  for (size_t i = 0; i < n; i += 4) {
    uint64_t bits = da_rng_u64(r);
    for (size_t j = 0; j < 4 && i + j < n; j++, bits >>= 16)
      dst[i + j] = da_from_f32(t, lo + step * (float)(bits & 0xffffu));
  }
}

void da_workload_inputs(const da_workload *w, uint64_t i, uint32_t layer, uint32_t pos,
                        uint32_t n, void *q, void *k, void *v) {
  size_t qrow = (size_t)w->n_q_heads * w->head_dim;
  size_t kvrow = (size_t)w->n_kv_heads * w->head_dim;
  size_t es = da_dtype_size(w->dtype);
  for (uint32_t t = 0; t < n; t++) {
    da_rng r;
    da_rng_seed(&r, mix(w->seed, 2, i, layer, pos + t));
    fill_uniform(&r, w->dtype, (uint16_t *)((char *)q + t * qrow * es), qrow);
    fill_uniform(&r, w->dtype, (uint16_t *)((char *)k + t * kvrow * es), kvrow);
    fill_uniform(&r, w->dtype, (uint16_t *)((char *)v + t * kvrow * es), kvrow);
  }
}

void da_workload_describe(const da_workload *w, char *buf, size_t len) {
  char lens[96];
  if (w->n_trace) {
    uint64_t h = XXH3_64bits(w->trace, w->n_trace * sizeof(*w->trace));
    snprintf(lens, sizeof(lens), "trace:%zu:%016" PRIx64, w->n_trace, h);
  } else {
    snprintf(lens, sizeof(lens), "prompt:%" PRIu32 ":%" PRIu32 ",output:%" PRIu32 ":%" PRIu32,
             w->prompt.lo, w->prompt.hi, w->output.lo, w->output.hi);
  }
  snprintf(buf, len, "seed=%" PRIu64 ",%s,model=%" PRIu32 "x%" PRIu32 "x%" PRIu32 "x%" PRIu32 ":%s",
           w->seed, lens, w->n_layers, w->n_q_heads, w->n_kv_heads, w->head_dim,
           da_dtype_name(w->dtype));
}

double da_gamma_sample(da_rng *r, double shape) {
  if (shape < 1.0) {
    /* Boost: gamma(a) = gamma(a + 1) * U^(1/a). */
    double u = da_rng_uniform(r);
    return da_gamma_sample(r, shape + 1.0) * pow(u > 0 ? u : 0x1.0p-53, 1.0 / shape);
  }
  double d = shape - 1.0 / 3.0, c = 1.0 / sqrt(9.0 * d);
  for (;;) {
    double x = da_rng_normal(r), v = 1.0 + c * x;
    if (v <= 0) continue;
    v = v * v * v;
    double u = da_rng_uniform(r);
    if (u < 1.0 - 0.0331 * x * x * x * x) return d * v;
    if (u > 0 && log(u) < 0.5 * x * x + d * (1.0 - v + log(v))) return d * v;
  }
}

void da_arrivals_init(da_arrivals *a, uint64_t seed, double rate, double burstiness) {
  da_rng_seed(&a->rng, mix(seed, 3, 0, 0, 0));
  a->rate = rate;
  a->burstiness = burstiness;
  a->t = 0;
}

double da_arrivals_next(da_arrivals *a) {
  double t = a->t;
  double gap = da_gamma_sample(&a->rng, a->burstiness) / (a->burstiness * a->rate);
  a->t += gap;
  return t;
}
