#include "testutil.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

uint64_t da_test_seed(uint64_t deflt) {
  const char *s = getenv("DETATTN_TEST_SEED");
  if (s == NULL || *s == '\0') return deflt;
  char *end = NULL;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 0);
  if (errno != 0 || end == s || *end != '\0') return deflt;
  return (uint64_t)v;
}

static double load(da_dtype t, const void *base, size_t i) {
  return (double)da_to_f32(t, ((const uint16_t *)base)[i]);
}

int da_test_ref_attention(const da_model *m, const void *k, const void *v, int n_kv,
                          const void *q, int q_pos, int n_q, double *o, double *lse) {
  if (m->n_kv_heads < 1 || m->n_q_heads % m->n_kv_heads || m->head_dim < 1 || q_pos < 0 ||
      n_q < 0 || (int64_t)q_pos + n_q > n_kv)
    return DETATTN_INVALID_ARGUMENT;
  const int hq = m->n_q_heads, hk = m->n_kv_heads, d = m->head_dim, g = hq / hk;
  const double scale = m->scale, cap = m->softcap;
  double *s = malloc(sizeof(double) * (size_t)(n_kv > 0 ? n_kv : 1));
  if (s == NULL) return DETATTN_RESOURCE_EXHAUSTED;
  for (int t = 0; t < n_q; t++) {
    const int p = q_pos + t;
    const int w0 = m->window > 0 && p - m->window + 1 > 0 ? p - m->window + 1 : 0;
    for (int h = 0; h < hq; h++) {
      const int kh = h / g;
      const size_t qoff = ((size_t)t * hq + h) * d;
      double mx = -INFINITY;
      for (int i = w0; i <= p; i++) {
        const size_t koff = ((size_t)i * hk + kh) * d;
        double dot = 0.0;
        for (int c = 0; c < d; c++) dot += load(m->dtype, q, qoff + c) * load(m->dtype, k, koff + c);
        dot *= scale;
        if (cap > 0.0) dot = cap * tanh(dot / cap);
        s[i] = dot;
        if (dot > mx) mx = dot;
      }
      double l = 0.0;
      double *out = o + qoff;
      for (int c = 0; c < d; c++) out[c] = 0.0;
      for (int i = w0; i <= p; i++) {
        const double e = exp(s[i] - mx);
        const size_t voff = ((size_t)i * hk + kh) * d;
        l += e;
        for (int c = 0; c < d; c++) out[c] += e * load(m->dtype, v, voff + c);
      }
      for (int c = 0; c < d; c++) out[c] /= l;
      if (lse != NULL) lse[(size_t)t * hq + h] = mx + log(l);
    }
  }
  free(s);
  return 0;
}

void da_test_random_pages(da_rng *r, int32_t *pages, int n, int pool_pages) {
  /* The first n steps of a Fisher-Yates shuffle of [0, pool_pages). */
  int32_t *perm = malloc(sizeof(int32_t) * (size_t)pool_pages);
  if (perm == NULL) abort();
  for (int i = 0; i < pool_pages; i++) perm[i] = i;
  for (int i = 0; i < n; i++) {
    int j = (int)da_rng_range(r, i, pool_pages - 1);
    int32_t tmp = perm[i];
    perm[i] = perm[j];
    perm[j] = tmp;
    pages[i] = perm[i];
  }
  free(perm);
}

int da_test_random_pages_from(da_rng *r, int32_t *pages, int n, uint8_t *used, int pool_pages) {
  int32_t *free_ids = malloc(sizeof(int32_t) * (size_t)(pool_pages > 0 ? pool_pages : 1));
  if (free_ids == NULL) abort();
  int nfree = 0;
  for (int i = 0; i < pool_pages; i++)
    if (!used[i]) free_ids[nfree++] = i;
  if (nfree < n) {
    free(free_ids);
    return DETATTN_RESOURCE_EXHAUSTED;
  }
  for (int i = 0; i < n; i++) {
    int j = (int)da_rng_range(r, i, nfree - 1);
    int32_t tmp = free_ids[i];
    free_ids[i] = free_ids[j];
    free_ids[j] = tmp;
    pages[i] = free_ids[i];
    used[free_ids[i]] = 1;
  }
  free(free_ids);
  return 0;
}

void *da_test_random_tensor(da_rng *r, da_dtype t, size_t n, double stddev) {
  void *p = malloc(n * da_dtype_size(t) + 1);
  if (p != NULL) da_rng_fill(r, t, p, n, stddev);
  return p;
}

ptrdiff_t da_test_first_diff(const void *a, const void *b, size_t nbytes) {
  const unsigned char *x = a, *y = b;
  for (size_t i = 0; i < nbytes; i++)
    if (x[i] != y[i]) return (ptrdiff_t)i;
  return -1;
}

static double rel_err(const double *num_den) {
  if (num_den[1] == 0.0) return num_den[0] == 0.0 ? 0.0 : INFINITY;
  return sqrt(num_den[0]) / sqrt(num_den[1]);
}

double da_test_rel_err(da_dtype t, const void *x, const double *ref, size_t n) {
  double acc[2] = {0.0, 0.0};
  for (size_t i = 0; i < n; i++) {
    const double xv = load(t, x, i);
    if (!isfinite(xv)) return INFINITY;
    acc[0] += (xv - ref[i]) * (xv - ref[i]);
    acc[1] += ref[i] * ref[i];
  }
  return rel_err(acc);
}

double da_test_rel_err_f32(const float *x, const double *ref, size_t n) {
  double acc[2] = {0.0, 0.0};
  for (size_t i = 0; i < n; i++) {
    const double xv = x[i];
    if (!isfinite(xv)) return INFINITY;
    acc[0] += (xv - ref[i]) * (xv - ref[i]);
    acc[1] += ref[i] * ref[i];
  }
  return rel_err(acc);
}

double da_test_max_abs_err_f32(const float *x, const double *ref, size_t n) {
  double mx = 0.0;
  for (size_t i = 0; i < n; i++) {
    if (!isfinite(x[i])) return INFINITY;
    const double e = fabs((double)x[i] - ref[i]);
    if (e > mx) mx = e;
  }
  return mx;
}

void da_test_poison(da_dtype t, void *dst, size_t n) {
  const uint16_t nan = t == DA_BF16 ? 0x7fc0u : 0x7e00u;
  uint16_t *p = dst;
  for (size_t i = 0; i < n; i++) p[i] = nan;
}

void da_test_poison_f32(float *dst, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] = NAN;
}

void da_test_sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

int da_test_capture(const char *cmd, char *out, size_t cap) {
  FILE *p = popen(cmd, "r");
  if (p == NULL) return -1;
  size_t len = 0;
  char sink[512];
  for (;;) {
    const size_t room = cap > len + 1 ? cap - len - 1 : 0;
    const size_t n = room > 0 ? fread(out + len, 1, room, p) : fread(sink, 1, sizeof sink, p);
    if (n == 0) break;
    if (room > 0) len += n;
  }
  if (cap > 0) out[len] = '\0';
  return pclose(p);
}
