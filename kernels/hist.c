#include "hist.h"

#include <string.h>

void da_hist_init(da_hist *h) {
  memset(h, 0, sizeof(*h));
  h->min = UINT64_MAX;
}

uint32_t da_hist_bucket(uint64_t v) {
  if (v < 2 * DA_HIST_SUB) return (uint32_t)v;
  int msb = 63 - __builtin_clzll(v);
  int shift = msb - DA_HIST_SUB_BITS;
  uint32_t top = (uint32_t)(v >> shift); /* in [SUB, 2 SUB) */
  return 2 * DA_HIST_SUB + (uint32_t)(shift - 1) * DA_HIST_SUB + (top - DA_HIST_SUB);
}

uint64_t da_hist_bucket_high(uint32_t b) {
  if (b < 2 * DA_HIST_SUB) return b;
  uint32_t shift = (b - 2 * DA_HIST_SUB) / DA_HIST_SUB + 1;
  uint64_t top = DA_HIST_SUB + (b - 2 * DA_HIST_SUB) % DA_HIST_SUB;
  uint64_t low = top << shift;
  return low + ((1ull << shift) - 1);
}

void da_hist_record(da_hist *h, uint64_t v) {
  h->buckets[da_hist_bucket(v)]++;
  h->count++;
  h->sum += (double)v;
  if (v < h->min) h->min = v;
  if (v > h->max) h->max = v;
}

void da_hist_merge(da_hist *dst, const da_hist *src) {
  if (src->count == 0) return;
  for (uint32_t i = 0; i < DA_HIST_BUCKETS; i++) dst->buckets[i] += src->buckets[i];
  dst->count += src->count;
  dst->sum += src->sum;
  if (src->min < dst->min) dst->min = src->min;
  if (src->max > dst->max) dst->max = src->max;
}

uint64_t da_hist_quantile(const da_hist *h, double q) {
  if (h->count == 0) return 0;
  if (q < 0) q = 0;
  if (q > 1) q = 1;
  double want = q * (double)h->count;
  uint64_t rank = (uint64_t)want;
  if ((double)rank < want) rank++;
  if (rank == 0) rank = 1;
  uint64_t seen = 0;
  for (uint32_t i = 0; i < DA_HIST_BUCKETS; i++) {
    seen += h->buckets[i];
    if (seen >= rank) {
      uint64_t v = da_hist_bucket_high(i);
      if (v > h->max) v = h->max;
      if (v < h->min) v = h->min;
      return v;
    }
  }
  return h->max;
}

double da_hist_mean(const da_hist *h) { return h->count ? h->sum / (double)h->count : 0.0; }

uint64_t da_hist_count_le(const da_hist *h, uint64_t bound) {
  if (h->count == 0 || bound < h->min) return 0;
  if (bound >= h->max) return h->count;
  uint32_t last = da_hist_bucket(bound);
  uint64_t n = 0;
  for (uint32_t i = 0; i <= last; i++) n += h->buckets[i];
  return n;
}
