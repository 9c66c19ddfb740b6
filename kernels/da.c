#include "da.h"

#include <stdio.h>
#include <time.h>
#include <xxhash.h>

const char *detattn_status_name(int status) {
  switch (status) {
#define XX(name, num, msg) \
  case num:                \
    return #name;
    DETATTN_STATUS_MAP(XX)
#undef XX
  }
  return "UNKNOWN_STATUS";
}

const char *detattn_status_str(int status) {
  switch (status) {
#define XX(name, num, msg) \
  case num:                \
    return msg;
    DETATTN_STATUS_MAP(XX)
#undef XX
  }
  return "unknown status";
}

const char *da_dtype_name(da_dtype t) { return t == DA_BF16 ? "bf16" : "fp16"; }

int da_dtype_parse(const char *s, da_dtype *out) {
  if (strcmp(s, "bf16") == 0) *out = DA_BF16;
  else if (strcmp(s, "fp16") == 0) *out = DA_FP16;
  else return DETATTN_INVALID_ARGUMENT;
  return 0;
}

void da_model_defaults(da_model *m) {
  if (m->scale == 0.0f && m->head_dim > 0) m->scale = (float)(1.0 / sqrt((double)m->head_dim));
}

int da_model_check(const da_model *m, const da_numerics *nu, char *msg, size_t msglen) {
#define BAD(...)                              \
  do {                                        \
    if (msg) snprintf(msg, msglen, __VA_ARGS__); \
    return DETATTN_INVALID_ARGUMENT;          \
  } while (0)
  if (m->n_layers < 1 || m->n_layers > 4096) BAD("layers must be in [1, 4096], got %d", m->n_layers);
  if (m->n_kv_heads < 1 || m->n_kv_heads > 1024) BAD("kv heads must be in [1, 1024], got %d", m->n_kv_heads);
  if (m->n_q_heads < m->n_kv_heads || m->n_q_heads % m->n_kv_heads)
    BAD("q heads (%d) must be a positive multiple of kv heads (%d)", m->n_q_heads, m->n_kv_heads);
  if (m->head_dim != 64 && m->head_dim != 128 && m->head_dim != 256)
    BAD("head_dim must be 64, 128 or 256, got %d", m->head_dim);
  if (m->dtype != DA_BF16 && m->dtype != DA_FP16) BAD("dtype must be bf16 or fp16");
  if (!(m->scale > 0.0f) || !isfinite(m->scale)) BAD("scale must be finite and > 0");
  if (m->softcap < 0.0f || !isfinite(m->softcap)) BAD("softcap must be finite and >= 0");
  if (m->window < 0) BAD("window must be >= 0");
  if (nu->tile_tokens < 16 || nu->tile_tokens > 256 || (nu->tile_tokens & (nu->tile_tokens - 1)))
    BAD("tile tokens must be a power of two in [16, 256], got %d", nu->tile_tokens);
  if (nu->split_tokens < nu->tile_tokens || nu->split_tokens % nu->tile_tokens)
    BAD("split tokens (%d) must be a positive multiple of tile tokens (%d)", nu->split_tokens,
        nu->tile_tokens);
#undef BAD
  return 0;
}

float da_fp16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {
      /* Subnormal: value is man * 2^-24, exact in fp32. */
      float f = (float)man * 0x1.0p-24f;
      memcpy(&u, &f, 4);
      u |= sign;
    }
  } else {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

uint16_t da_f32_to_fp16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
  if (a < 0x38800000u) {
    /* Result is subnormal or zero: round a * 2^24 to an integer, ties to even. */
    float af;
    memcpy(&af, &a, 4);
    float s = af * 0x1.0p24f;
    uint32_t r = (uint32_t)s;
    float frac = s - (float)r;
    if (frac > 0.5f || (frac == 0.5f && (r & 1u))) r++;
    return (uint16_t)(sign | r);
  }
  uint32_t e = (a >> 23) - 112u;
  uint32_t m = a & 0x7fffffu;
  uint32_t h = (e << 10) | (m >> 13);
  uint32_t rest = m & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
  return (uint16_t)(sign | h);
}

uint64_t da_fingerprint(const char *backend, uint32_t kernel_version, const char *arch,
                        const da_model *m, const da_numerics *nu) {
  char buf[512];
  uint32_t sc, cap;
  memcpy(&sc, &m->scale, 4);
  memcpy(&cap, &m->softcap, 4);
  int n = snprintf(buf, sizeof(buf),
                   "detattn-numerics-v1;backend=%s;kernel=%u;arch=%s;S=%d;T=%d;dtype=%s;"
                   "head_dim=%d;scale=%08x;softcap=%08x;window=%d",
                   backend, kernel_version, arch, nu->split_tokens, nu->tile_tokens,
                   da_dtype_name(m->dtype), m->head_dim, sc, cap, m->window);
  return XXH64(buf, (size_t)n, 0);
}

double da_rng_normal(da_rng *r) {
  double u1 = da_rng_uniform(r), u2 = da_rng_uniform(r);
  if (u1 < 1e-300) u1 = 1e-300;
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

void da_rng_fill(da_rng *r, da_dtype t, void *dst, size_t n, double stddev) {
  uint16_t *p = dst;
  for (size_t i = 0; i < n; i++) p[i] = da_from_f32(t, (float)(da_rng_normal(r) * stddev));
}

uint64_t da_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
