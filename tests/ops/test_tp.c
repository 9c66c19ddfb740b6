/*
 * test_tp.c — tensor parallelism over several daemons (plugin/tp.c, detattn_tp_*):
 *   bitwise_2way    two daemons of 4 q / 1 kv heads against one daemon of 8 / 2: every o
 *                   and lse of a seeded workload (chunked prefill, batched decode over
 *                   several sequences, a fork, a truncate and re-append) bit for bit equal
 *   bitwise_uneven  the same with unequal shards: 8 / 2 + 4 / 1 against 12 / 3
 *   errors          ranks that do not form one model are refused (naming the setting); an
 *                   error on every rank leaves the sequence usable; an error on one rank
 *                   only marks it (ABORTED) until it is truncated
 * DETATTN_TP_BACKEND=cuda runs the daemons with --backend cuda (all on --device 0, or
 * DETATTN_TP_DEVICES="0,1" one per rank); the test exits 77 when no device is usable.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon_proc.h"
#include "detattn.h"
#include "testutil.h"

#define MAX_RANKS 4

static int cuda;
static int head_dim = 64;
static da_daemon_proc single, ranks[MAX_RANKS];

static const char *device_of(int rank) {
  static char buf[MAX_RANKS + 1][8];
  const char *list = getenv("DETATTN_TP_DEVICES");
  int dev = 0;
  if (list && rank >= 0) {
    const char *p = list;
    for (int i = 0; i < rank && p; i++) {
      p = strchr(p, ',');
      if (p) p++;
    }
    if (p) dev = atoi(p);
  }
  snprintf(buf[rank + 1], sizeof buf[0], "%d", dev);
  return buf[rank + 1];
}

/* Starts a daemon of layers 2, q/kv heads as given, plus extra flags; rank -1: the single one. */
static int start(da_daemon_proc *d, int rank, int q_heads, int kv_heads, const char *kv_tokens) {
  char q[16], kv[16], hd[16];
  snprintf(q, sizeof q, "%d", q_heads);
  snprintf(kv, sizeof kv, "%d", kv_heads);
  snprintf(hd, sizeof hd, "%d", head_dim);
  const char *args[] = {"--layers", "2", "--q-heads", q, "--kv-heads", kv, "--head-dim", hd, "--page-tokens", "16",
                        "--kv-tokens", kv_tokens, "--split-tokens", cuda ? "128" : "64", "--tile-tokens",
                        cuda ? "64" : "16", "--threads", "1", "--backend", cuda ? "cuda" : "cpu", "--device",
                        device_of(rank), "--max-request-tokens", "1024", "--max-batch-tokens", "4096", NULL};
  return da_daemon_start(d, DETATTND_PATH, args);
}

static void teardown(void) {
  da_daemon_stop(&single);
  for (int r = 0; r < MAX_RANKS; r++) da_daemon_stop(&ranks[r]);
}

/* The same calls on one daemon (plain API) and on the TP group, outputs compared bitwise. */
typedef struct pair {
  detattn_client *one;
  detattn_tp *tp;
  int hq, hkv;
  da_rng rng;
  uint64_t seed;
  long compared;
} pair;

static void fwd(pair *p, uint32_t layer, const uint64_t *one_seq, const uint64_t *tp_seq, const uint32_t *pos,
                const uint32_t *n, size_t items, int with_lse) {
  detattn_seq_io a[8], b[8];
  void *bufs[8][6];
  for (size_t i = 0; i < items; i++) {
    size_t qn = (size_t)n[i] * p->hq * head_dim, kn = (size_t)n[i] * p->hkv * head_dim;
    uint16_t *q = malloc(qn * 2), *k = malloc(kn * 2), *v = malloc(kn * 2), *o1 = malloc(qn * 2), *o2 = malloc(qn * 2);
    float *l1 = with_lse ? malloc((size_t)n[i] * p->hq * 4) : NULL, *l2 = with_lse ? malloc((size_t)n[i] * p->hq * 4) : NULL;
    ck_assert(q && k && v && o1 && o2);
    da_rng_fill(&p->rng, DA_BF16, q, qn, 1.0);
    da_rng_fill(&p->rng, DA_BF16, k, kn, 1.0);
    da_rng_fill(&p->rng, DA_BF16, v, kn, 1.0);
    memset(o1, 0xa5, qn * 2); /* poison: a head left unwritten shows */
    memset(o2, 0x5a, qn * 2);
    a[i] = (detattn_seq_io){.seq = one_seq[i], .pos = pos[i], .n_tokens = n[i], .q = q, .k = k, .v = v, .o = o1, .lse = l1};
    b[i] = (detattn_seq_io){.seq = tp_seq[i], .pos = pos[i], .n_tokens = n[i], .q = q, .k = k, .v = v, .o = o2, .lse = l2};
    void *bb[6] = {q, k, v, o1, o2, l1};
    memcpy(bufs[i], bb, sizeof bb);
  }
  int s1 = detattn_forward(p->one, layer, a, items);
  ck_assert_msg(s1 == DETATTN_OK, "single daemon forward: %s %s (seed %llu)", detattn_status_name(s1), detattn_errmsg(),
                (unsigned long long)p->seed);
  int s2 = detattn_tp_forward(p->tp, layer, b, items);
  ck_assert_msg(s2 == DETATTN_OK, "tp forward: %s %s (seed %llu)", detattn_status_name(s2), detattn_errmsg(),
                (unsigned long long)p->seed);
  for (size_t i = 0; i < items; i++) {
    for (size_t t = 0; t < n[i]; t++)
      for (int h = 0; h < p->hq; h++) {
        size_t off = ((size_t)t * p->hq + h) * head_dim * 2;
        ck_assert_msg(memcmp((char *)a[i].o + off, (char *)b[i].o + off, (size_t)head_dim * 2) == 0,
                      "o differs: layer %u item %zu pos %u head %d (seed %llu)", layer, i, pos[i] + (uint32_t)t, h,
                      (unsigned long long)p->seed);
      }
    if (with_lse)
      ck_assert_msg(memcmp(a[i].lse, b[i].lse, (size_t)n[i] * p->hq * 4) == 0, "lse differs: layer %u item %zu (seed %llu)",
                    layer, i, (unsigned long long)p->seed);
    p->compared += (long)n[i] * p->hq;
    for (int j = 0; j < 6; j++) free(bufs[i][j]);
    free(b[i].lse);
  }
}

static int rnd(pair *p, int lo, int hi) { return lo + (int)(da_rng_u64(&p->rng) % (uint64_t)(hi - lo + 1)); }

static void run_bitwise(int n_ranks, const int *rq, const int *rkv) {
  int hq = 0, hkv = 0;
  for (int r = 0; r < n_ranks; r++) hq += rq[r], hkv += rkv[r];
  ck_assert_msg(start(&single, -1, hq, hkv, "16384") == 0, "single daemon did not start");
  const char *urls[MAX_RANKS];
  for (int r = 0; r < n_ranks; r++) {
    ck_assert_msg(start(&ranks[r], r, rq[r], rkv[r], "16384") == 0, "rank %d did not start", r);
    urls[r] = ranks[r].url;
  }
  pair p = {.hq = hq, .hkv = hkv, .seed = da_test_seed(1010)};
  da_rng_seed(&p.rng, p.seed);
  ck_assert_int_eq(detattn_connect(&p.one, single.url), DETATTN_OK);
  ck_assert_int_eq(detattn_tp_connect(&p.tp, urls, (size_t)n_ranks, NULL), DETATTN_OK);
  detattn_server_info i1, i2;
  ck_assert_int_eq(detattn_hello(p.one, &i1), DETATTN_OK);
  ck_assert_int_eq(detattn_tp_hello(p.tp, &i2), DETATTN_OK);
  ck_assert_uint_eq(i2.model.n_q_heads, (uint32_t)hq);
  ck_assert_uint_eq(i2.model.n_kv_heads, (uint32_t)hkv);
  ck_assert_msg(i1.fingerprint == i2.fingerprint, "fingerprints differ: %016llx vs %016llx",
                (unsigned long long)i1.fingerprint, (unsigned long long)i2.fingerprint);
  for (int r = 0; r < n_ranks; r++) {
    uint32_t q0, nq, k0, nk;
    ck_assert_int_eq(detattn_tp_shard(p.tp, (size_t)r, &q0, &nq, &k0, &nk), DETATTN_OK);
    ck_assert_uint_eq(nq, (uint32_t)rq[r]);
    ck_assert_uint_eq(nk, (uint32_t)rkv[r]);
  }

  enum { NS = 3 };
  uint64_t s1[NS + 1], s2[NS + 1];
  uint32_t len[NS + 1];
  for (int s = 0; s < NS; s++) {
    ck_assert_int_eq(detattn_seq_open(p.one, &s1[s]), DETATTN_OK);
    ck_assert_int_eq(detattn_tp_seq_open(p.tp, &s2[s]), DETATTN_OK);
    /* Prefill in random chunks, each chunk through both layers. */
    uint32_t total = (uint32_t)rnd(&p, 40, 300);
    len[s] = 0;
    while (len[s] < total) {
      uint32_t n = (uint32_t)rnd(&p, 1, 150);
      if (n > total - len[s]) n = total - len[s];
      for (uint32_t l = 0; l < 2; l++) fwd(&p, l, &s1[s], &s2[s], &len[s], &n, 1, l == 0);
      len[s] += n;
    }
  }
  /* Fork sequence 0 (prefix sharing), truncate sequence 1 by 5 tokens. */
  ck_assert_int_eq(detattn_seq_fork(p.one, s1[0], &s1[NS]), DETATTN_OK);
  ck_assert_int_eq(detattn_tp_seq_fork(p.tp, s2[0], &s2[NS]), DETATTN_OK);
  len[NS] = len[0];
  len[1] -= 5;
  ck_assert_int_eq(detattn_seq_truncate(p.one, s1[1], len[1]), DETATTN_OK);
  ck_assert_int_eq(detattn_tp_seq_truncate(p.tp, s2[1], len[1]), DETATTN_OK);
  /* Decode: every sequence (fork included) one token per step, all in one call per layer. */
  for (int step = 0; step < 6; step++) {
    uint32_t n[NS + 1];
    for (int s = 0; s <= NS; s++) n[s] = step == 0 && s == 1 ? 5 : 1; /* re-append the 5 */
    for (uint32_t l = 0; l < 2; l++) fwd(&p, l, s1, s2, len, n, NS + 1, 1);
    for (int s = 0; s <= NS; s++) len[s] += n[s];
  }
  for (int s = 0; s <= NS; s++) {
    ck_assert_int_eq(detattn_seq_close(p.one, s1[s]), DETATTN_OK);
    ck_assert_int_eq(detattn_tp_seq_close(p.tp, s2[s]), DETATTN_OK);
  }
  ck_assert_int_eq(detattn_tp_seq_close(p.tp, s2[0]), DETATTN_NOT_FOUND);
  printf("tp %d ranks: %ld (token, head) rows compared bitwise, 0 differ (seed %llu)\n", n_ranks, p.compared,
         (unsigned long long)p.seed);
  /* Every rank's sequences were closed: its pages are back. */
  for (int r = 0; r < n_ranks; r++) {
    detattn_stats st;
    ck_assert_int_eq(detattn_stats_get(detattn_tp_rank(p.tp, (size_t)r), &st), DETATTN_OK);
    ck_assert_uint_eq(st.kv_pages_used, 0);
  }
  detattn_tp_close(p.tp);
  detattn_close(p.one);
}

START_TEST(test_bitwise_2way) {
  const int q[] = {4, 4}, kv[] = {1, 1};
  run_bitwise(2, q, kv);
}
END_TEST

START_TEST(test_bitwise_uneven) {
  const int q[] = {8, 4}, kv[] = {2, 1};
  run_bitwise(2, q, kv);
}
END_TEST

START_TEST(test_errors) {
  /* Rank 1 holds only 4 pages, so a long Forward fails there and not on rank 0. */
  ck_assert(start(&ranks[0], 0, 4, 1, "4096") == 0);
  ck_assert(start(&ranks[1], 1, 4, 1, "64") == 0);
  const char *urls[] = {ranks[0].url, ranks[1].url};
  detattn_tp *tp;
  ck_assert_int_eq(detattn_tp_connect(&tp, urls, 2, NULL), DETATTN_OK);

  uint64_t seq;
  ck_assert_int_eq(detattn_tp_seq_open(tp, &seq), DETATTN_OK);
  enum { N = 100 };
  size_t qn = (size_t)N * 8 * head_dim, kn = (size_t)N * 2 * head_dim;
  uint16_t *q = calloc(qn, 2), *k = calloc(kn, 2), *v = calloc(kn, 2), *o = calloc(qn, 2);
  da_rng r;
  da_rng_seed(&r, da_test_seed(77));
  da_rng_fill(&r, DA_BF16, q, qn, 1.0);
  da_rng_fill(&r, DA_BF16, k, kn, 1.0);
  da_rng_fill(&r, DA_BF16, v, kn, 1.0);

  /* Wrong position: refused by every rank, nothing appended, the sequence stays usable. */
  detattn_seq_io io = {.seq = seq, .pos = 3, .n_tokens = 8, .q = q, .k = k, .v = v, .o = o};
  ck_assert_int_eq(detattn_tp_forward(tp, 0, &io, 1), DETATTN_FAILED_PRECONDITION);
  ck_assert_msg(strstr(detattn_errmsg(), "rank 0") != NULL, "%s", detattn_errmsg());
  io.pos = 0;
  ck_assert_int_eq(detattn_tp_forward(tp, 0, &io, 1), DETATTN_OK);
  /* 100 more tokens fit rank 0 and not rank 1 (64 tokens): the sequence is marked. */
  io = (detattn_seq_io){.seq = seq, .pos = 8, .n_tokens = N, .q = q, .k = k, .v = v, .o = o};
  ck_assert_int_eq(detattn_tp_forward(tp, 0, &io, 1), DETATTN_RESOURCE_EXHAUSTED);
  ck_assert_msg(strstr(detattn_errmsg(), "rank 1") && strstr(detattn_errmsg(), "truncated"), "%s", detattn_errmsg());
  io.n_tokens = 4;
  ck_assert_int_eq(detattn_tp_forward(tp, 0, &io, 1), DETATTN_ABORTED);
  uint64_t fork;
  ck_assert_int_eq(detattn_tp_seq_fork(tp, seq, &fork), DETATTN_ABORTED);
  /* Truncating every rank to the length before that Forward makes them agree again. */
  ck_assert_int_eq(detattn_tp_seq_truncate(tp, seq, 8), DETATTN_OK);
  ck_assert_int_eq(detattn_tp_forward(tp, 0, &io, 1), DETATTN_OK);
  ck_assert_int_eq(detattn_tp_seq_close(tp, seq), DETATTN_OK);
  io.seq = seq;
  ck_assert_int_eq(detattn_tp_forward(tp, 0, &io, 1), DETATTN_NOT_FOUND);
  detattn_tp_close(tp);

  /* Ranks that do not form one model. */
  da_daemon_stop(&ranks[1]);
  int saved = head_dim;
  head_dim = head_dim == 64 ? 128 : 64;
  ck_assert(start(&ranks[1], 1, 4, 1, "4096") == 0);
  head_dim = saved;
  ck_assert_int_eq(detattn_tp_connect(&tp, urls, 2, NULL), DETATTN_FAILED_PRECONDITION);
  ck_assert_msg(strstr(detattn_errmsg(), "head_dim") && strstr(detattn_errmsg(), "rank 1"), "%s", detattn_errmsg());
  ck_assert_int_eq(detattn_tp_connect(&tp, urls, 0, NULL), DETATTN_INVALID_ARGUMENT);
  free(q);
  free(k);
  free(v);
  free(o);
}
END_TEST

/* A TP call answered on every rank but not waited for when the group closes: waiting for it
 * afterwards gives CANCELLED and writes nothing (it read the freed group and the ranks'
 * unmapped arenas before). The later Forward on the same sequence runs after it. */
START_TEST(test_close_orphans_calls) {
  ck_assert(start(&ranks[0], 0, 4, 1, "4096") == 0);
  ck_assert(start(&ranks[1], 1, 4, 1, "4096") == 0);
  const char *urls[] = {ranks[0].url, ranks[1].url};
  detattn_tp *tp;
  ck_assert_int_eq(detattn_tp_connect(&tp, urls, 2, NULL), DETATTN_OK);
  uint64_t seq;
  ck_assert_int_eq(detattn_tp_seq_open(tp, &seq), DETATTN_OK);
  enum { N = 64 };
  size_t qn = (size_t)N * 8 * head_dim, kn = (size_t)N * 2 * head_dim;
  uint16_t *q = malloc(qn * 2), *k = malloc(kn * 2), *v = malloc(kn * 2), *o = malloc(qn * 2), *o1 = malloc(qn * 2);
  da_rng r;
  da_rng_seed(&r, da_test_seed(78));
  da_rng_fill(&r, DA_BF16, q, qn, 1.0);
  da_rng_fill(&r, DA_BF16, k, kn, 1.0);
  da_rng_fill(&r, DA_BF16, v, kn, 1.0);
  memset(o, 0xa5, qn * 2);
  detattn_seq_io a = {.seq = seq, .pos = 0, .n_tokens = N, .q = q, .k = k, .v = v, .o = o};
  detattn_tp_call *call;
  ck_assert_int_eq(detattn_tp_forward_start(tp, 0, &a, 1, &call), DETATTN_OK);
  detattn_seq_io b = {.seq = seq, .pos = N, .n_tokens = 1, .q = q, .k = k, .v = v, .o = o1};
  int st = detattn_tp_forward(tp, 0, &b, 1);
  ck_assert_msg(st == DETATTN_OK, "the later forward: %s: %s", detattn_status_name(st), detattn_errmsg());
  detattn_tp_close(tp);
  st = detattn_tp_call_wait(call);
  ck_assert_msg(st == DETATTN_CANCELLED, "waited after close: %s: %s", detattn_status_name(st), detattn_errmsg());
  size_t i = 0;
  while (i < qn * 2 && ((uint8_t *)o)[i] == 0xa5) i++;
  ck_assert_msg(i == qn * 2, "output byte %zu written after close", i);
  free(q);
  free(k);
  free(v);
  free(o);
  free(o1);
}
END_TEST

/* With DETATTN_TP_BACKEND=cuda: 77 (skip) when a CUDA daemon cannot start for want of a
 * device; any other start failure is a failure. */
static int cuda_skip(void) {
  da_daemon_proc d;
  if (start(&d, 0, 4, 1, "1024") == 0) {
    da_daemon_stop(&d);
    return 0;
  }
  int no_dev = da_daemon_log_has(&d, "no usable device") || da_daemon_log_has(&d, "not present") ||
               da_daemon_log_has(&d, "built for sm_");
  da_daemon_stop(&d);
  return no_dev;
}

int main(void) {
  const char *be = getenv("DETATTN_TP_BACKEND");
  cuda = be && strcmp(be, "cuda") == 0;
  if (cuda) {
    head_dim = 128;
    if (cuda_skip()) {
      printf("no usable CUDA device: skipped\n");
      return 77;
    }
  }
  Suite *s = suite_create("tp");
  const da_test_case cases[] = {{"bitwise_2way", test_bitwise_2way},
               {"bitwise_uneven", test_bitwise_uneven},
               {"errors", test_errors},
               {"close_orphans", test_close_orphans_calls}};
  da_test_add_cases(s, cases, sizeof(cases) / sizeof(cases[0]), NULL, teardown, 120);
  return da_test_run(s);
}
