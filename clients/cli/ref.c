#include <math.h>
#include <stdlib.h>

#include "da.h"
#include "verify.h"

static double elem(const detattn_model *m, const void *t, size_t i) {
  return (double)da_to_f32((da_dtype)m->dtype, ((const uint16_t *)t)[i]);
}

void da_verify_reference(const detattn_model *m, uint32_t n, const void *q, const void *k, const void *v,
                         double *o, double *lse) {
  uint32_t hq = m->n_q_heads, hkv = m->n_kv_heads, d = m->head_dim, group = hq / hkv;
  double *s = malloc((size_t)(n ? n : 1) * sizeof *s);

  for (uint32_t p = 0; p < n; p++) {
    uint32_t w0 = m->window && p + 1 > m->window ? p + 1 - m->window : 0;
    for (uint32_t h = 0; h < hq; h++) {
      uint32_t g = h / group;
      const size_t qo = ((size_t)p * hq + h) * d;
      double mx = -INFINITY;
      for (uint32_t j = w0; j <= p; j++) {
        const size_t ko = ((size_t)j * hkv + g) * d;
        double dot = 0;
        for (uint32_t x = 0; x < d; x++) dot += elem(m, q, qo + x) * elem(m, k, ko + x);
        double sc = (double)m->scale * dot;
        if (m->softcap > 0) sc = m->softcap * tanh(sc / m->softcap);
        s[j] = sc;
        if (sc > mx) mx = sc;
      }
      double l = 0;
      for (uint32_t j = w0; j <= p; j++) l += exp(s[j] - mx);
      double *out = o + qo;
      for (uint32_t x = 0; x < d; x++) out[x] = 0;
      for (uint32_t j = w0; j <= p; j++) {
        const size_t vo = ((size_t)j * hkv + g) * d;
        double wgt = exp(s[j] - mx) / l;
        for (uint32_t x = 0; x < d; x++) out[x] += wgt * elem(m, v, vo + x);
      }
      lse[(size_t)p * hq + h] = mx + log(l);
    }
  }
  free(s);
}
