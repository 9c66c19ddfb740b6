/*
 * hist.h — a log-linear histogram (HdrHistogram-style buckets): detattn-load's latencies
 * and the daemon's statistics (queue time, batch sizes, per-op latency), whose Stats replies
 * and Prometheus metrics read it without sorting anything.
 *
 * Values are unsigned 64-bit (nanoseconds for latencies). Values below 256 are counted
 * exactly; above, each power-of-two range [2^e, 2^(e+1)) is cut into 128 equal buckets, so
 * a reported percentile is within 1/128 (0.8 %) of a recorded value, never below it.
 * A histogram is caller-owned storage (about 60 KiB); not thread-safe: use one per thread
 * and merge them.
 */
#ifndef DA_HIST_H
#define DA_HIST_H

#include <stdint.h>

#define DA_HIST_SUB_BITS 7
#define DA_HIST_SUB (1u << DA_HIST_SUB_BITS)
#define DA_HIST_BUCKETS (2 * DA_HIST_SUB + (64 - DA_HIST_SUB_BITS - 1) * DA_HIST_SUB)

typedef struct da_hist {
  uint64_t count;
  uint64_t min, max;
  double sum;
  uint64_t buckets[DA_HIST_BUCKETS];
} da_hist;

/* Empties h. */
void da_hist_init(da_hist *h);
void da_hist_record(da_hist *h, uint64_t v);
/* dst += src. */
void da_hist_merge(da_hist *dst, const da_hist *src);
/* The value at quantile q in [0, 1]: the highest value equivalent to the bucket holding
 * the ceil(q * count)-th smallest value, clamped to [min, max]. 0 when empty. */
uint64_t da_hist_quantile(const da_hist *h, double q);
double da_hist_mean(const da_hist *h);

/* How many recorded values are <= bound. Exact when bound + 1 is the lowest value of a
 * bucket, which holds for every bound below 256 and every 2^e - 1 (Prometheus `le`
 * buckets at powers of two); otherwise it counts the whole bucket holding bound. */
uint64_t da_hist_count_le(const da_hist *h, uint64_t bound);

/* Bucket index of v and the highest value equivalent to bucket b (exposed for tests). */
uint32_t da_hist_bucket(uint64_t v);
uint64_t da_hist_bucket_high(uint32_t b);

#endif /* DA_HIST_H */
