/*
 * da.h — the definitions every part of detattn shares: dtypes and their conversions, the
 * model and numerics configuration, the numerics fingerprint, a seeded random generator,
 * and status names. Status codes are the public DETATTN_* codes (plugin/include/detattn.h):
 * internal functions return them, 0 on success.
 */
#ifndef DA_H
#define DA_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "detattn.h"

typedef enum da_dtype { DA_BF16 = 0, DA_FP16 = 1 } da_dtype;

/* The attention model served by one daemon. Scale, softcap and window are part of the
 * numerics fingerprint. */
typedef struct da_model {
  int n_layers;
  int n_q_heads;  /* a multiple of n_kv_heads */
  int n_kv_heads;
  int head_dim;   /* 64, 128 or 256 */
  da_dtype dtype;
  float scale;    /* applied to q·k; da_model_defaults sets 1/sqrt(head_dim) */
  float softcap;  /* 0: off */
  int window;     /* 0: full causal; else keys in [p - window + 1, p] */
} da_model;

/* The numerics configuration: split size S and tile size T, both in tokens, S % T == 0.
 * Fixed for the life of a daemon; never derived from load. */
typedef struct da_numerics {
  int split_tokens;
  int tile_tokens;
} da_numerics;

#define DA_DEFAULT_SPLIT_TOKENS 512
#define DA_DEFAULT_TILE_TOKENS 64

/* Fills a model with defaults for unset (zero) fields: scale = 1/sqrt(head_dim). */
void da_model_defaults(da_model *m);
/* Checks a model and numerics pair; on error writes a specific message to msg. */
int da_model_check(const da_model *m, const da_numerics *nu, char *msg, size_t msglen);

static inline size_t da_dtype_size(da_dtype t) { (void)t; return 2; }
const char *da_dtype_name(da_dtype t);
int da_dtype_parse(const char *s, da_dtype *out);

/* bf16 / fp16 <-> fp32, round to nearest even, NaN kept NaN. Identical on every backend. */
static inline float da_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t da_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
float da_fp16_to_f32(uint16_t h);
uint16_t da_f32_to_fp16(float f);
static inline float da_to_f32(da_dtype t, uint16_t h) {
  return t == DA_BF16 ? da_bf16_to_f32(h) : da_fp16_to_f32(h);
}
static inline uint16_t da_from_f32(da_dtype t, float f) {
  return t == DA_BF16 ? da_f32_to_bf16(f) : da_f32_to_fp16(f);
}

/* The numerics fingerprint: XXH64 over a canonical text of backend name, kernel version,
 * device architecture, S, T, dtype, head_dim, scale, softcap and window. Equal
 * fingerprints and equal inputs give equal bits. */
uint64_t da_fingerprint(const char *backend, uint32_t kernel_version, const char *arch,
                        const da_model *m, const da_numerics *nu);

/* A small seeded generator (splitmix64) for tests, benchmarks and workloads. */
typedef struct da_rng {
  uint64_t s;
} da_rng;
static inline void da_rng_seed(da_rng *r, uint64_t seed) { r->s = seed; }
static inline uint64_t da_rng_u64(da_rng *r) {
  uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
/* Uniform in [0, 1). */
static inline double da_rng_uniform(da_rng *r) { return (double)(da_rng_u64(r) >> 11) * 0x1.0p-53; }
/* Uniform integer in [lo, hi]. */
static inline int64_t da_rng_range(da_rng *r, int64_t lo, int64_t hi) {
  return lo + (int64_t)(da_rng_u64(r) % (uint64_t)(hi - lo + 1));
}
/* Standard normal (Box-Muller). */
double da_rng_normal(da_rng *r);
/* Fills n elements of dtype t with N(0, stddev^2) values. */
void da_rng_fill(da_rng *r, da_dtype t, void *dst, size_t n, double stddev);

/* Monotonic clock in nanoseconds. */
uint64_t da_now_ns(void);
/* A hint inside a bounded spin-wait loop (x86 pause, arm yield): lets the sibling hardware
 * thread run and eases the memory traffic of the spin. */
static inline void da_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

#endif /* DA_H */
