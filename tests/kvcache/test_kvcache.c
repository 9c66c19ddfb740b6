/*
 * test_kvcache.c — the KV cache bookkeeping (server/kvcache.c): page allocation, fork and
 * copy-on-write plans, truncate, exhaustion and invalid arguments leaving everything
 * unchanged, and a seeded randomized test against a reference model that also simulates
 * page contents, so a wrong copy-on-write plan shows up as a corrupted token.
 *
 * Usage: test_kvcache [unit|model]   (no argument: both suites)
 * DETATTN_TEST_SEED=<n> overrides the model test's seeds (seed, seed + 1, seed + 2).
 */
#include <check.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache.h"
#include "testutil.h"

/* Check's ck_assert records a mark point (a write to a pipe) even when it passes: the
 * model test's inner loops use this instead. */
#define REQUIRE(cond, ...)                       \
  do {                                           \
    if (!(cond)) ck_abort_msg(__VA_ARGS__);      \
  } while (0)

/* ---- state snapshots: everything observable through the public API ---- */

#define MAX_PAGES 64
#define MAX_SEQS 8
#define MAX_LAYERS 4
#define MAX_TABLE 64

typedef struct snap {
  int total, free, open;
  int refs[MAX_PAGES];
  int len[MAX_SEQS][MAX_LAYERS]; /* negative status when the sequence is closed */
  int np[MAX_SEQS];
  int has_table[MAX_SEQS];
  int32_t table[MAX_SEQS][MAX_TABLE];
} snap;

static void take(const da_kvcache *kv, const da_kvcache_cfg *cfg, snap *s) {
  ck_assert_int_le(cfg->n_pages, MAX_PAGES);
  ck_assert_int_le(cfg->max_seqs, MAX_SEQS);
  ck_assert_int_le(cfg->n_layers, MAX_LAYERS);
  memset(s, 0, sizeof(*s));
  s->total = da_kvcache_pages_total(kv);
  s->free = da_kvcache_pages_free(kv);
  s->open = da_kvcache_seqs_open(kv);
  for (int p = 0; p < cfg->n_pages; p++) s->refs[p] = da_kvcache_page_refs(kv, p);
  for (int q = 0; q < cfg->max_seqs; q++) {
    for (int l = 0; l < cfg->n_layers; l++) s->len[q][l] = da_kvcache_length(kv, (uint32_t)q, l);
    const int32_t *t = da_kvcache_pages(kv, (uint32_t)q, &s->np[q]);
    s->has_table[q] = t != NULL;
    REQUIRE(s->np[q] <= MAX_TABLE, "table of %d pages", s->np[q]);
    if (t != NULL) memcpy(s->table[q], t, (size_t)s->np[q] * sizeof(int32_t));
  }
}

static void assert_same(const snap *a, const snap *b, const char *what) {
  ck_assert_msg(a->free == b->free, "%s: pages_free %d -> %d", what, a->free, b->free);
  ck_assert_msg(a->open == b->open, "%s: seqs_open %d -> %d", what, a->open, b->open);
  ck_assert_msg(memcmp(a->refs, b->refs, sizeof(a->refs)) == 0, "%s: refcounts changed", what);
  ck_assert_msg(memcmp(a->len, b->len, sizeof(a->len)) == 0, "%s: lengths changed", what);
  ck_assert_msg(memcmp(a->has_table, b->has_table, sizeof(a->has_table)) == 0, "%s: open sequences changed", what);
  ck_assert_msg(memcmp(a->np, b->np, sizeof(a->np)) == 0, "%s: table sizes changed", what);
  ck_assert_msg(memcmp(a->table, b->table, sizeof(a->table)) == 0, "%s: page tables changed", what);
}

/* ---- fixture: 3 layers, 16-token pages, 16 pages, 4 sequences of up to 128 tokens ---- */

static const da_kvcache_cfg base_cfg = {
    .n_layers = 3, .page_tokens = 16, .n_pages = 16, .max_seqs = 4, .max_seq_tokens = 128};
static da_kvcache *kv;
static da_page_copy cp[16];
static int ncp;

static void setup(void) { ck_assert_int_eq(da_kvcache_alloc(&kv, &base_cfg), 0); }

/* Closes whatever a test left open, then checks the pool is whole again. */
static void teardown(void) {
  for (int q = 0; q < base_cfg.max_seqs; q++)
    if (da_kvcache_pages(kv, (uint32_t)q, NULL) != NULL) ck_assert_int_eq(da_kvcache_close(kv, (uint32_t)q), 0);
  ck_assert_int_eq(da_kvcache_seqs_open(kv), 0);
  ck_assert_int_eq(da_kvcache_pages_free(kv), da_kvcache_pages_total(kv));
  for (int p = 0; p < base_cfg.n_pages; p++) ck_assert_int_eq(da_kvcache_page_refs(kv, p), 0);
  da_kvcache_free(kv);
  kv = NULL;
}

static uint32_t open_seq(void) {
  uint32_t s = UINT32_MAX;
  ck_assert_int_eq(da_kvcache_open(kv, &s), 0);
  return s;
}

static void append_ok(uint32_t s, int layer, int pos, int n) {
  int cost = da_kvcache_append_cost(kv, s, layer, pos, n);
  int before = da_kvcache_pages_free(kv);
  ck_assert_int_ge(cost, 0);
  ck_assert_int_eq(da_kvcache_append(kv, s, layer, pos, n, cp, 16, &ncp), 0);
  ck_assert_int_eq(da_kvcache_pages_free(kv), before - cost);
  ck_assert_int_eq(da_kvcache_length(kv, s, layer), pos + n);
}

static void append_all(uint32_t s, int pos, int n) {
  for (int l = 0; l < base_cfg.n_layers; l++) append_ok(s, l, pos, n);
}

static int n_pages_of(uint32_t s) {
  int n = -1;
  ck_assert_ptr_nonnull(da_kvcache_pages(kv, s, &n));
  return n;
}

/* ---- unit tests ---- */

START_TEST(alloc_rejects_bad_config) {
  const da_kvcache_cfg bad[] = {
      {0, 16, 16, 4, 128}, {3, 0, 16, 4, 128},  {3, 12, 16, 4, 128}, {3, -16, 16, 4, 128},
      {3, 16, 0, 4, 128},  {3, 16, 16, 0, 128}, {3, 16, 16, 4, 0},   {3, 16, -1, 4, 128},
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    da_kvcache *k = (da_kvcache *)&bad[i]; /* a sentinel that must not be overwritten */
    ck_assert_int_eq(da_kvcache_alloc(&k, &bad[i]), DETATTN_INVALID_ARGUMENT);
    ck_assert_ptr_eq(k, (da_kvcache *)&bad[i]);
  }
  ck_assert_int_eq(da_kvcache_alloc(NULL, &base_cfg), DETATTN_INVALID_ARGUMENT);
  da_kvcache_free(NULL);
}
END_TEST

START_TEST(open_hands_out_distinct_handles_and_reuses_closed_ones) {
  uint32_t s[4];
  for (int i = 0; i < 4; i++) {
    s[i] = open_seq();
    for (int j = 0; j < i; j++) ck_assert_uint_ne(s[i], s[j]);
    for (int l = 0; l < 3; l++) ck_assert_int_eq(da_kvcache_length(kv, s[i], l), 0);
    ck_assert_int_eq(n_pages_of(s[i]), 0);
  }
  ck_assert_int_eq(da_kvcache_seqs_open(kv), 4);
  uint32_t x = 77;
  ck_assert_int_eq(da_kvcache_open(kv, &x), DETATTN_RESOURCE_EXHAUSTED);
  ck_assert_uint_eq(x, 77);
  ck_assert_ptr_nonnull(strstr(da_kvcache_errmsg(kv), "sequence slot"));
  append_all(s[2], 0, 20);
  ck_assert_int_eq(da_kvcache_close(kv, s[2]), 0);
  ck_assert_ptr_null(da_kvcache_pages(kv, s[2], NULL));
  uint32_t again = open_seq();
  ck_assert_uint_eq(again, s[2]);
  for (int l = 0; l < 3; l++) ck_assert_int_eq(da_kvcache_length(kv, again, l), 0);
  ck_assert_int_eq(n_pages_of(again), 0);
}
END_TEST

START_TEST(append_takes_one_page_per_page_tokens_shared_by_all_layers) {
  uint32_t s = open_seq();
  ck_assert_int_eq(da_kvcache_append_cost(kv, s, 0, 0, 40), 3);
  append_ok(s, 0, 0, 40);
  ck_assert_int_eq(ncp, 0);
  ck_assert_int_eq(n_pages_of(s), 3);
  ck_assert_int_eq(da_kvcache_pages_free(kv), 13);
  /* Other layers reuse the table's pages. */
  ck_assert_int_eq(da_kvcache_append_cost(kv, s, 1, 0, 40), 0);
  append_ok(s, 1, 0, 40);
  append_ok(s, 2, 0, 7);
  ck_assert_int_eq(da_kvcache_pages_free(kv), 13);
  /* Filling page 2 exactly takes nothing; position 48 starts page 3. */
  append_ok(s, 0, 40, 8);
  ck_assert_int_eq(n_pages_of(s), 3);
  append_ok(s, 0, 48, 1);
  ck_assert_int_eq(n_pages_of(s), 4);
  const int32_t *t = da_kvcache_pages(kv, s, NULL);
  for (int i = 0; i < 4; i++) {
    ck_assert_int_eq(da_kvcache_page_refs(kv, t[i]), 1);
    for (int j = 0; j < i; j++) ck_assert_int_ne(t[i], t[j]);
  }
  ck_assert_int_eq(da_kvcache_length(kv, s, 1), 40);
  ck_assert_int_eq(da_kvcache_length(kv, s, 2), 7);
}
END_TEST

START_TEST(append_that_does_not_fit_changes_nothing) {
  uint32_t a = open_seq(), b = open_seq(), c = open_seq();
  append_all(a, 0, 90);  /* 6 pages */
  append_all(b, 0, 128); /* 8 pages */
  append_all(c, 0, 3);   /* 1 page: 1 left */
  ck_assert_int_eq(da_kvcache_pages_free(kv), 1);
  snap before, after;
  take(kv, &base_cfg, &before);
  ck_assert_int_eq(da_kvcache_append_cost(kv, a, 0, 90, 30), 2);
  ncp = -5;
  ck_assert_int_eq(da_kvcache_append(kv, a, 0, 90, 30, cp, 16, &ncp), DETATTN_RESOURCE_EXHAUSTED);
  ck_assert_int_eq(ncp, -5);
  ck_assert_msg(strstr(da_kvcache_errmsg(kv), "needed 2 pages, 1 free") != NULL, "message: %s",
                da_kvcache_errmsg(kv));
  take(kv, &base_cfg, &after);
  assert_same(&before, &after, "exhausted append");
  /* What does fit still works afterwards. */
  append_ok(a, 0, 90, 20);
  ck_assert_int_eq(da_kvcache_pages_free(kv), 0);
}
END_TEST

START_TEST(copy_on_write_that_does_not_fit_changes_nothing) {
  uint32_t a = open_seq(), b;
  append_all(a, 0, 40);
  ck_assert_int_eq(da_kvcache_fork(kv, a, &b), 0);
  uint32_t c = open_seq();
  append_all(c, 0, 16 * 8); /* 8 of the 13 other pages */
  uint32_t d = open_seq();
  append_all(d, 0, 16 * 5); /* the last 5 */
  ck_assert_int_eq(da_kvcache_pages_free(kv), 0);
  snap before, after;
  take(kv, &base_cfg, &before);
  /* The copy of b's shared partial page cannot be made. */
  ck_assert_int_eq(da_kvcache_append_cost(kv, b, 1, 40, 2), 1);
  ck_assert_int_eq(da_kvcache_append(kv, b, 1, 40, 2, cp, 16, &ncp), DETATTN_RESOURCE_EXHAUSTED);
  ck_assert_msg(strstr(da_kvcache_errmsg(kv), "needed 1 pages, 0 free") != NULL, "message: %s",
                da_kvcache_errmsg(kv));
  take(kv, &base_cfg, &after);
  assert_same(&before, &after, "exhausted copy-on-write");
}
END_TEST

START_TEST(fork_shares_every_page_and_copies_lengths) {
  uint32_t a = open_seq(), b;
  append_ok(a, 0, 0, 40);
  append_ok(a, 1, 0, 33);
  append_ok(a, 2, 0, 5);
  int free_before = da_kvcache_pages_free(kv);
  ck_assert_int_eq(da_kvcache_fork(kv, a, &b), 0);
  ck_assert_uint_ne(a, b);
  ck_assert_int_eq(da_kvcache_pages_free(kv), free_before);
  int na, nb;
  const int32_t *ta = da_kvcache_pages(kv, a, &na), *tb = da_kvcache_pages(kv, b, &nb);
  ck_assert_int_eq(na, 3);
  ck_assert_int_eq(nb, 3);
  for (int i = 0; i < 3; i++) {
    ck_assert_int_eq(ta[i], tb[i]);
    ck_assert_int_eq(da_kvcache_page_refs(kv, ta[i]), 2);
  }
  for (int l = 0; l < 3; l++) ck_assert_int_eq(da_kvcache_length(kv, b, l), da_kvcache_length(kv, a, l));
  /* Closing the source leaves the fork holding every page alone. */
  ck_assert_int_eq(da_kvcache_close(kv, a), 0);
  for (int i = 0; i < 3; i++) ck_assert_int_eq(da_kvcache_page_refs(kv, tb[i]), 1);
  ck_assert_int_eq(da_kvcache_pages_free(kv), free_before);
}
END_TEST

START_TEST(first_write_to_shared_partial_page_copies_it_and_second_does_not) {
  uint32_t a = open_seq(), b;
  append_all(a, 0, 40); /* pages 0, 1 full; page 2 holds 8 of 16 */
  int32_t ta[3];
  memcpy(ta, da_kvcache_pages(kv, a, NULL), sizeof(ta));
  ck_assert_int_eq(da_kvcache_fork(kv, a, &b), 0);
  int free_before = da_kvcache_pages_free(kv);

  ck_assert_int_eq(da_kvcache_append_cost(kv, b, 0, 40, 3), 1);
  append_ok(b, 0, 40, 3);
  ck_assert_int_eq(ncp, 1);
  ck_assert_int_eq(cp[0].src, ta[2]);
  ck_assert_int_ne(cp[0].dst, ta[2]);
  ck_assert_int_eq(da_kvcache_pages_free(kv), free_before - 1);
  const int32_t *tb = da_kvcache_pages(kv, b, NULL);
  ck_assert_int_eq(tb[0], ta[0]);
  ck_assert_int_eq(tb[1], ta[1]);
  ck_assert_int_eq(tb[2], cp[0].dst);
  /* The source keeps its page, now unshared. */
  const int32_t *ta_now = da_kvcache_pages(kv, a, NULL);
  ck_assert_int_eq(memcmp(ta_now, ta, sizeof(ta)), 0);
  ck_assert_int_eq(da_kvcache_page_refs(kv, ta[2]), 1);
  ck_assert_int_eq(da_kvcache_page_refs(kv, cp[0].dst), 1);
  ck_assert_int_eq(da_kvcache_page_refs(kv, ta[0]), 2);
  ck_assert_int_eq(da_kvcache_page_refs(kv, ta[1]), 2);

  /* The copy held all layers: a second write (another layer) into it copies nothing. */
  int32_t copy = cp[0].dst;
  append_ok(b, 1, 40, 3);
  ck_assert_int_eq(ncp, 0);
  append_ok(b, 0, 43, 2);
  ck_assert_int_eq(ncp, 0);
  ck_assert_int_eq(da_kvcache_pages(kv, b, NULL)[2], copy);
  /* The source's page is no longer shared either: its write happens in place. */
  append_ok(a, 0, 40, 4);
  ck_assert_int_eq(ncp, 0);
  ck_assert_int_eq(da_kvcache_pages(kv, a, NULL)[2], ta[2]);
  ck_assert_int_eq(da_kvcache_pages_free(kv), free_before - 1);
}
END_TEST

START_TEST(write_at_page_boundary_after_fork_takes_a_new_page_without_copy) {
  uint32_t a = open_seq(), b;
  append_all(a, 0, 32);
  ck_assert_int_eq(da_kvcache_fork(kv, a, &b), 0);
  append_ok(b, 0, 32, 5);
  ck_assert_int_eq(ncp, 0);
  ck_assert_int_eq(n_pages_of(b), 3);
  ck_assert_int_eq(n_pages_of(a), 2);
  ck_assert_int_eq(da_kvcache_page_refs(kv, da_kvcache_pages(kv, b, NULL)[2]), 1);
}
END_TEST

START_TEST(append_over_several_shared_pages_copies_each_in_order) {
  uint32_t a = open_seq(), b;
  append_ok(a, 0, 0, 64); /* 4 pages */
  append_ok(a, 1, 0, 20);
  ck_assert_int_eq(da_kvcache_fork(kv, a, &b), 0);
  ck_assert_int_eq(da_kvcache_truncate(kv, b, 50), 0);
  ck_assert_int_eq(n_pages_of(b), 4);
  ck_assert_int_eq(da_kvcache_length(kv, b, 0), 50);
  ck_assert_int_eq(da_kvcache_length(kv, b, 1), 20);
  int32_t before[4];
  memcpy(before, da_kvcache_pages(kv, b, NULL), sizeof(before));
  /* Layer 1 from 20 to 50 writes pages 1, 2 and 3, all shared with a. */
  ck_assert_int_eq(da_kvcache_append_cost(kv, b, 1, 20, 30), 3);
  append_ok(b, 1, 20, 30);
  ck_assert_int_eq(ncp, 3);
  const int32_t *tb = da_kvcache_pages(kv, b, NULL);
  ck_assert_int_eq(tb[0], before[0]);
  for (int i = 0; i < 3; i++) {
    ck_assert_int_eq(cp[i].src, before[i + 1]);
    ck_assert_int_eq(cp[i].dst, tb[i + 1]);
    ck_assert_int_eq(da_kvcache_page_refs(kv, cp[i].src), 1);
    ck_assert_int_eq(da_kvcache_page_refs(kv, cp[i].dst), 1);
  }
  ck_assert_int_eq(da_kvcache_page_refs(kv, tb[0]), 2);
}
END_TEST

START_TEST(truncate_releases_pages_and_reappend_reuses_them) {
  uint32_t a = open_seq();
  append_all(a, 0, 64);
  ck_assert_int_eq(da_kvcache_pages_free(kv), 12);
  int32_t t0[4];
  memcpy(t0, da_kvcache_pages(kv, a, NULL), sizeof(t0));
  /* Mid-page: the page holding position 19 stays. */
  ck_assert_int_eq(da_kvcache_truncate(kv, a, 20), 0);
  ck_assert_int_eq(n_pages_of(a), 2);
  ck_assert_int_eq(da_kvcache_pages_free(kv), 14);
  ck_assert_int_eq(da_kvcache_page_refs(kv, t0[2]), 0);
  ck_assert_int_eq(da_kvcache_page_refs(kv, t0[3]), 0);
  for (int l = 0; l < 3; l++) ck_assert_int_eq(da_kvcache_length(kv, a, l), 20);
  /* Longer than the sequence: nothing happens. */
  ck_assert_int_eq(da_kvcache_truncate(kv, a, 1000), 0);
  ck_assert_int_eq(da_kvcache_length(kv, a, 0), 20);
  ck_assert_int_eq(n_pages_of(a), 2);
  /* Re-append from 20 writes page 1 in place, then takes two fresh pages. */
  ck_assert_int_eq(da_kvcache_append_cost(kv, a, 0, 20, 44), 2);
  append_ok(a, 0, 20, 44);
  ck_assert_int_eq(ncp, 0);
  const int32_t *t = da_kvcache_pages(kv, a, NULL);
  ck_assert_int_eq(t[0], t0[0]);
  ck_assert_int_eq(t[1], t0[1]);
  ck_assert_int_eq(da_kvcache_pages_free(kv), 12);
  append_ok(a, 1, 20, 44);
  ck_assert_int_eq(da_kvcache_pages_free(kv), 12);
  /* At a page boundary the page past it is released; to 0, all of them. */
  ck_assert_int_eq(da_kvcache_truncate(kv, a, 32), 0);
  ck_assert_int_eq(n_pages_of(a), 2);
  ck_assert_int_eq(da_kvcache_truncate(kv, a, 0), 0);
  ck_assert_int_eq(n_pages_of(a), 0);
  ck_assert_int_eq(da_kvcache_pages_free(kv), 16);
  append_ok(a, 2, 0, 1);
  ck_assert_int_eq(n_pages_of(a), 1);
}
END_TEST

START_TEST(truncate_keeps_pages_for_the_longest_layer) {
  uint32_t a = open_seq();
  append_ok(a, 0, 0, 10);
  append_ok(a, 1, 0, 60);
  ck_assert_int_eq(da_kvcache_truncate(kv, a, 40), 0);
  ck_assert_int_eq(da_kvcache_length(kv, a, 0), 10);
  ck_assert_int_eq(da_kvcache_length(kv, a, 1), 40);
  ck_assert_int_eq(da_kvcache_length(kv, a, 2), 0);
  ck_assert_int_eq(n_pages_of(a), 3);
}
END_TEST

START_TEST(truncating_a_fork_drops_only_its_references) {
  uint32_t a = open_seq(), b;
  append_all(a, 0, 50);
  ck_assert_int_eq(da_kvcache_fork(kv, a, &b), 0);
  int free_before = da_kvcache_pages_free(kv);
  ck_assert_int_eq(da_kvcache_truncate(kv, b, 17), 0);
  ck_assert_int_eq(da_kvcache_pages_free(kv), free_before);
  const int32_t *ta = da_kvcache_pages(kv, a, NULL);
  ck_assert_int_eq(da_kvcache_page_refs(kv, ta[0]), 2);
  ck_assert_int_eq(da_kvcache_page_refs(kv, ta[1]), 2);
  ck_assert_int_eq(da_kvcache_page_refs(kv, ta[2]), 1);
  ck_assert_int_eq(da_kvcache_page_refs(kv, ta[3]), 1);
  /* Re-appending into the shared page 1 copies it, then takes a new page. */
  append_ok(b, 0, 17, 20);
  ck_assert_int_eq(ncp, 1);
  ck_assert_int_eq(cp[0].src, ta[1]);
  ck_assert_int_eq(da_kvcache_pages_free(kv), free_before - 2);
}
END_TEST

START_TEST(close_releases_every_page) {
  uint32_t a = open_seq();
  append_all(a, 0, 70);
  ck_assert_int_eq(da_kvcache_pages_free(kv), 11);
  ck_assert_int_eq(da_kvcache_close(kv, a), 0);
  ck_assert_int_eq(da_kvcache_pages_free(kv), 16);
  ck_assert_int_eq(da_kvcache_seqs_open(kv), 0);
}
END_TEST

/* Every invalid call: its status, its message, and no change to anything. */
START_TEST(invalid_arguments_are_rejected_and_change_nothing) {
  uint32_t a = open_seq(), b = open_seq(), c;
  append_all(a, 0, 40);
  ck_assert_int_eq(da_kvcache_fork(kv, a, &c), 0);
  ck_assert_int_eq(da_kvcache_close(kv, b), 0); /* b (handle 1) is now closed */
  ck_assert_uint_eq(b, 1);
  snap before, after;
  take(kv, &base_cfg, &before);
  const int small = da_kvcache_max_copies(10, 16) - 1;
#define EXPECT(call, want, frag)                                                              \
  do {                                                                                        \
    int rv_ = (call);                                                                         \
    ck_assert_msg(rv_ == (want), "%s: got %s, want %s", #call, detattn_status_name(rv_),     \
                  detattn_status_name(want));                                                 \
    ck_assert_msg(strstr(da_kvcache_errmsg(kv), frag) != NULL, "%s: message '%s' lacks '%s'", \
                  #call, da_kvcache_errmsg(kv), frag);                                        \
  } while (0)
  EXPECT(da_kvcache_append(kv, b, 0, 0, 1, cp, 16, &ncp), DETATTN_NOT_FOUND, "sequence 1 is not open");
  EXPECT(da_kvcache_append(kv, 9999, 0, 0, 1, cp, 16, &ncp), DETATTN_NOT_FOUND, "sequence 9999 is not open");
  EXPECT(da_kvcache_append(kv, a, -1, 40, 1, cp, 16, &ncp), DETATTN_INVALID_ARGUMENT, "layer -1 out of range");
  EXPECT(da_kvcache_append(kv, a, 3, 40, 1, cp, 16, &ncp), DETATTN_INVALID_ARGUMENT, "layer 3 out of range");
  EXPECT(da_kvcache_append(kv, a, 0, 40, 0, cp, 16, &ncp), DETATTN_INVALID_ARGUMENT, "token count 0");
  EXPECT(da_kvcache_append(kv, a, 0, 40, -3, cp, 16, &ncp), DETATTN_INVALID_ARGUMENT, "token count -3");
  EXPECT(da_kvcache_append(kv, a, 0, -1, 2, cp, 16, &ncp), DETATTN_INVALID_ARGUMENT, "position -1");
  EXPECT(da_kvcache_append(kv, a, 0, 40, 89, cp, 16, &ncp), DETATTN_INVALID_ARGUMENT, "max_seq_tokens 128");
  EXPECT(da_kvcache_append(kv, a, 0, 40, INT_MAX, cp, 16, &ncp), DETATTN_INVALID_ARGUMENT, "max_seq_tokens 128");
  EXPECT(da_kvcache_append(kv, a, 0, 39, 1, cp, 16, &ncp), DETATTN_FAILED_PRECONDITION, "expected pos 40, got 39");
  EXPECT(da_kvcache_append(kv, a, 1, 41, 1, cp, 16, &ncp), DETATTN_FAILED_PRECONDITION, "expected pos 40, got 41");
  EXPECT(da_kvcache_append(kv, c, 0, 40, 10, cp, small, &ncp), DETATTN_INVALID_ARGUMENT, "copy plan buffer");
  EXPECT(da_kvcache_append(kv, c, 0, 40, 10, NULL, 16, &ncp), DETATTN_INVALID_ARGUMENT, "copy plan buffer");
  EXPECT(da_kvcache_append(kv, c, 0, 40, 10, cp, 16, NULL), DETATTN_INVALID_ARGUMENT, "n_copies is NULL");
  EXPECT(da_kvcache_fork(kv, b, &c), DETATTN_NOT_FOUND, "sequence 1 is not open");
  EXPECT(da_kvcache_fork(kv, a, NULL), DETATTN_INVALID_ARGUMENT, "seq_out is NULL");
  EXPECT(da_kvcache_truncate(kv, b, 0), DETATTN_NOT_FOUND, "sequence 1 is not open");
  EXPECT(da_kvcache_truncate(kv, a, -1), DETATTN_INVALID_ARGUMENT, "length -1 < 0");
  EXPECT(da_kvcache_close(kv, b), DETATTN_NOT_FOUND, "sequence 1 is not open");
  EXPECT(da_kvcache_close(kv, UINT32_MAX), DETATTN_NOT_FOUND, "is not open");
  EXPECT(da_kvcache_open(kv, NULL), DETATTN_INVALID_ARGUMENT, "seq_out is NULL");
#undef EXPECT
  take(kv, &base_cfg, &after);
  assert_same(&before, &after, "invalid calls");

  /* append_cost reports the same statuses, negated. */
  ck_assert_int_eq(da_kvcache_append_cost(kv, b, 0, 0, 1), -DETATTN_NOT_FOUND);
  ck_assert_int_eq(da_kvcache_append_cost(kv, a, 3, 40, 1), -DETATTN_INVALID_ARGUMENT);
  ck_assert_int_eq(da_kvcache_append_cost(kv, a, 0, 40, 0), -DETATTN_INVALID_ARGUMENT);
  ck_assert_int_eq(da_kvcache_append_cost(kv, a, 0, 40, 89), -DETATTN_INVALID_ARGUMENT);
  ck_assert_int_eq(da_kvcache_append_cost(kv, a, 0, 41, 1), -DETATTN_FAILED_PRECONDITION);
  /* Queries on bad handles, layers and pages. */
  ck_assert_int_eq(da_kvcache_length(kv, b, 0), -DETATTN_NOT_FOUND);
  ck_assert_int_eq(da_kvcache_length(kv, a, 3), -DETATTN_INVALID_ARGUMENT);
  ck_assert_int_eq(da_kvcache_length(kv, a, -1), -DETATTN_INVALID_ARGUMENT);
  int np = 5;
  ck_assert_ptr_null(da_kvcache_pages(kv, b, &np));
  ck_assert_int_eq(np, 0);
  ck_assert_int_eq(da_kvcache_page_refs(kv, -1), -DETATTN_INVALID_ARGUMENT);
  ck_assert_int_eq(da_kvcache_page_refs(kv, 16), -DETATTN_INVALID_ARGUMENT);
  take(kv, &base_cfg, &after);
  assert_same(&before, &after, "invalid calls and queries");
}
END_TEST

START_TEST(fork_without_a_free_slot_changes_nothing) {
  uint32_t a = open_seq(), x;
  append_all(a, 0, 30);
  for (int i = 0; i < 3; i++) ck_assert_int_eq(da_kvcache_fork(kv, a, &x), 0);
  snap before, after;
  take(kv, &base_cfg, &before);
  x = 1234;
  ck_assert_int_eq(da_kvcache_fork(kv, a, &x), DETATTN_RESOURCE_EXHAUSTED);
  ck_assert_uint_eq(x, 1234);
  ck_assert_ptr_nonnull(strstr(da_kvcache_errmsg(kv), "max_seqs 4"));
  take(kv, &base_cfg, &after);
  assert_same(&before, &after, "fork without slot");
  ck_assert_int_eq(da_kvcache_page_refs(kv, da_kvcache_pages(kv, a, NULL)[0]), 4);
}
END_TEST

/* ---- randomized model-based test ---- */

/*
 * The reference model: per sequence, open or not and the token values of every layer (so
 * its lengths). A simulated page store receives exactly what the backend would: the
 * planned copies (whole pages, every layer) then the writes through the page table. After
 * every operation each open sequence must read back its own tokens through its table, and
 * the allocator's invariants must hold.
 */
enum { M_LAYERS = 3, M_PT = 4, M_PAGES = 24, M_SEQS = 6, M_MAXTOK = 40, M_OPS = 20000 };
static const da_kvcache_cfg model_cfg = {M_LAYERS, M_PT, M_PAGES, M_SEQS, M_MAXTOK};

typedef struct model {
  int open[M_SEQS];
  int len[M_SEQS][M_LAYERS];
  uint32_t val[M_SEQS][M_LAYERS][M_MAXTOK];
  uint32_t store[M_PAGES][M_LAYERS][M_PT];
  int n_open;
} model;

typedef struct model_stats {
  int exhausted, copies, forks, truncates;
} model_stats;

static void check_model(const da_kvcache *k, const model *m, uint64_t seed, int op) {
  int count[M_PAGES] = {0};
  int refs_sum = 0, tables_sum = 0, free_count = 0;
  REQUIRE(da_kvcache_seqs_open(k) == m->n_open, "seed %llu op %d: seqs_open", (unsigned long long)seed, op);
  for (int q = 0; q < M_SEQS; q++) {
    int np;
    const int32_t *t = da_kvcache_pages(k, (uint32_t)q, &np);
    REQUIRE((t != NULL) == m->open[q], "seed %llu op %d: seq %d open state", (unsigned long long)seed, op, q);
    if (!m->open[q]) continue;
    int longest = 0;
    for (int l = 0; l < M_LAYERS; l++) {
      REQUIRE(da_kvcache_length(k, (uint32_t)q, l) == m->len[q][l],
                    "seed %llu op %d: seq %d layer %d length %d, model %d", (unsigned long long)seed, op, q, l,
                    da_kvcache_length(k, (uint32_t)q, l), m->len[q][l]);
      if (m->len[q][l] > longest) longest = m->len[q][l];
    }
    REQUIRE(np == (longest + M_PT - 1) / M_PT, "seed %llu op %d: seq %d has %d pages for %d tokens",
                  (unsigned long long)seed, op, q, np, longest);
    tables_sum += np;
    for (int i = 0; i < np; i++) {
      REQUIRE(t[i] >= 0 && t[i] < M_PAGES, "seed %llu op %d: page id %d", (unsigned long long)seed, op, t[i]);
      for (int j = 0; j < i; j++)
        REQUIRE(t[i] != t[j], "seed %llu op %d: seq %d holds page %d twice", (unsigned long long)seed, op, q,
                      t[i]);
      count[t[i]]++;
    }
    for (int l = 0; l < M_LAYERS; l++)
      for (int p = 0; p < m->len[q][l]; p++)
        REQUIRE(m->store[t[p / M_PT]][l][p % M_PT] == m->val[q][l][p],
                      "seed %llu op %d: seq %d layer %d pos %d reads %u, wrote %u", (unsigned long long)seed, op, q,
                      l, p, m->store[t[p / M_PT]][l][p % M_PT], m->val[q][l][p]);
  }
  for (int p = 0; p < M_PAGES; p++) {
    int r = da_kvcache_page_refs(k, p);
    REQUIRE(r == count[p], "seed %llu op %d: page %d refcount %d, held by %d tables",
                  (unsigned long long)seed, op, p, r, count[p]);
    refs_sum += r;
    free_count += r == 0;
  }
  REQUIRE(refs_sum == tables_sum, "seed %llu op %d: refcount sum %d, table entries %d",
                (unsigned long long)seed, op, refs_sum, tables_sum);
  REQUIRE(da_kvcache_pages_free(k) == free_count, "seed %llu op %d: free %d, unreferenced %d",
                (unsigned long long)seed, op, da_kvcache_pages_free(k), free_count);
  REQUIRE(da_kvcache_pages_total(k) == M_PAGES, "pages_total");
}

/* A random handle: usually an open one, sometimes a closed or unknown one. */
static uint32_t pick_seq(da_rng *r, const model *m) {
  if (m->n_open > 0 && da_rng_range(r, 0, 9) > 0) {
    for (;;) {
      uint32_t q = (uint32_t)da_rng_range(r, 0, M_SEQS - 1);
      if (m->open[q]) return q;
    }
  }
  return (uint32_t)da_rng_range(r, 0, M_SEQS + 1);
}

static int is_open(const model *m, uint32_t q) { return q < M_SEQS && m->open[q]; }

static void op_append(da_kvcache *k, model *m, da_rng *r, uint64_t seed, int op, model_stats *st) {
  static snap before, after;
  uint32_t q = pick_seq(r, m);
  int layer = da_rng_range(r, 0, 19) == 0 ? (int)da_rng_range(r, -1, M_LAYERS) : (int)da_rng_range(r, 0, M_LAYERS - 1);
  int n = da_rng_range(r, 0, 29) == 0 ? (int)da_rng_range(r, -2, 0) : (int)da_rng_range(r, 1, 13);
  int len = is_open(m, q) && layer >= 0 && layer < M_LAYERS ? m->len[q][layer] : 0;
  int pos = da_rng_range(r, 0, 14) == 0 ? len + (int)da_rng_range(r, -2, 2) : len;

  int want;
  if (!is_open(m, q)) want = DETATTN_NOT_FOUND;
  else if (layer < 0 || layer >= M_LAYERS || n <= 0 || pos < 0 || pos + n > M_MAXTOK) want = DETATTN_INVALID_ARGUMENT;
  else if (pos != len) want = DETATTN_FAILED_PRECONDITION;
  else want = 0;

  take(k, &model_cfg, &before);
  int cost = da_kvcache_append_cost(k, q, layer, pos, n);
  da_page_copy copies[M_MAXTOK / M_PT + 2];
  int nc = -1;
  int rv = da_kvcache_append(k, q, layer, pos, n, copies, M_MAXTOK / M_PT + 2, &nc);
  if (want == 0 && cost > before.free) want = DETATTN_RESOURCE_EXHAUSTED;
  REQUIRE(rv == want, "seed %llu op %d: append seq %u layer %d pos %d n %d: %s, want %s (%s)",
                (unsigned long long)seed, op, q, layer, pos, n, detattn_status_name(rv), detattn_status_name(want),
                da_kvcache_errmsg(k));
  if (rv != 0) {
    if (rv != DETATTN_RESOURCE_EXHAUSTED)
      REQUIRE(cost == -rv, "seed %llu op %d: cost %d for %s", (unsigned long long)seed, op, cost,
                    detattn_status_name(rv));
    else
      st->exhausted++;
    take(k, &model_cfg, &after);
    assert_same(&before, &after, "failed append");
    return;
  }
  /* The plan, recomputed from the state before: new pages past the table, copies of
   * shared pages written, in page order; pages below the write untouched. */
  int first = pos / M_PT, last = (pos + n - 1) / M_PT, k_copy = 0, n_new = 0;
  take(k, &model_cfg, &after);
  for (int i = first; i <= last; i++) {
    if (i >= before.np[q]) {
      n_new++;
      REQUIRE(before.refs[after.table[q][i]] == 0, "seed %llu op %d: new page was in use", (unsigned long long)seed, op);
    } else if (before.refs[before.table[q][i]] > 1) {
      REQUIRE(k_copy < nc && copies[k_copy].src == before.table[q][i] && copies[k_copy].dst == after.table[q][i],
                    "seed %llu op %d: copy %d of page index %d", (unsigned long long)seed, op, k_copy, i);
      REQUIRE(before.refs[copies[k_copy].dst] == 0, "seed %llu op %d: copy target was in use", (unsigned long long)seed, op);
      k_copy++;
    } else {
      REQUIRE(after.table[q][i] == before.table[q][i], "seed %llu op %d: unshared page %d moved", (unsigned long long)seed, op, i);
    }
  }
  REQUIRE(nc == k_copy && cost == n_new + k_copy && after.free == before.free - cost,
          "seed %llu op %d: %d copies (want %d), cost %d (want %d), free %d -> %d", (unsigned long long)seed, op, nc,
          k_copy, cost, n_new + k_copy, before.free, after.free);
  for (int i = 0; i < first; i++)
    REQUIRE(after.table[q][i] == before.table[q][i], "seed %llu op %d: page %d below the write moved", (unsigned long long)seed, op, i);
  st->copies += nc;

  /* What the backend does: the copies in order, then the write. */
  for (int c = 0; c < nc; c++) memcpy(m->store[copies[c].dst], m->store[copies[c].src], sizeof(m->store[0]));
  for (int p = pos; p < pos + n; p++) {
    uint32_t v = (uint32_t)da_rng_u64(r);
    m->val[q][layer][p] = v;
    m->store[after.table[q][p / M_PT]][layer][p % M_PT] = v;
  }
  m->len[q][layer] = pos + n;
}

static void run_model(uint64_t seed) {
  da_kvcache *k = NULL;
  ck_assert_int_eq(da_kvcache_alloc(&k, &model_cfg), 0);
  static model m;
  memset(&m, 0, sizeof(m));
  da_rng r;
  da_rng_seed(&r, seed);
  for (int p = 0; p < M_PAGES; p++)
    for (int l = 0; l < M_LAYERS; l++)
      for (int s = 0; s < M_PT; s++) m.store[p][l][s] = 0xdeadbeefu; /* poison */
  model_stats st = {0};
  for (int op = 0; op < M_OPS; op++) {
    int kind = (int)da_rng_range(&r, 0, 99);
    int free_before = da_kvcache_pages_free(k);
    if (kind < 8) { /* open */
      uint32_t q = UINT32_MAX;
      int rv = da_kvcache_open(k, &q);
      ck_assert_int_eq(rv, m.n_open < M_SEQS ? 0 : DETATTN_RESOURCE_EXHAUSTED);
      if (rv == 0) {
        ck_assert_msg(q < M_SEQS && !m.open[q], "seed %llu op %d: open gave %u", (unsigned long long)seed, op, q);
        m.open[q] = 1;
        m.n_open++;
        memset(m.len[q], 0, sizeof(m.len[q]));
      }
    } else if (kind < 16) { /* fork */
      uint32_t src = pick_seq(&r, &m), q = UINT32_MAX;
      int rv = da_kvcache_fork(k, src, &q);
      int want = !is_open(&m, src) ? DETATTN_NOT_FOUND : m.n_open < M_SEQS ? 0 : DETATTN_RESOURCE_EXHAUSTED;
      ck_assert_msg(rv == want, "seed %llu op %d: fork %u: %s", (unsigned long long)seed, op, src,
                    detattn_status_name(rv));
      if (rv == 0) {
        ck_assert(q < M_SEQS && !m.open[q]);
        m.open[q] = 1;
        m.n_open++;
        memcpy(m.len[q], m.len[src], sizeof(m.len[q]));
        memcpy(m.val[q], m.val[src], sizeof(m.val[q]));
        ck_assert_int_eq(da_kvcache_pages_free(k), free_before);
        st.forks++;
      }
    } else if (kind < 26) { /* truncate */
      uint32_t q = pick_seq(&r, &m);
      int len = (int)da_rng_range(&r, -1, M_MAXTOK + 2);
      int rv = da_kvcache_truncate(k, q, len);
      int want = !is_open(&m, q) ? DETATTN_NOT_FOUND : len < 0 ? DETATTN_INVALID_ARGUMENT : 0;
      ck_assert_msg(rv == want, "seed %llu op %d: truncate %u to %d: %s", (unsigned long long)seed, op, q, len,
                    detattn_status_name(rv));
      if (rv == 0) {
        for (int l = 0; l < M_LAYERS; l++)
          if (m.len[q][l] > len) m.len[q][l] = len;
        st.truncates++;
      }
      ck_assert_int_ge(da_kvcache_pages_free(k), free_before);
    } else if (kind < 32) { /* close */
      uint32_t q = pick_seq(&r, &m);
      int rv = da_kvcache_close(k, q);
      ck_assert_int_eq(rv, is_open(&m, q) ? 0 : DETATTN_NOT_FOUND);
      if (rv == 0) {
        m.open[q] = 0;
        m.n_open--;
      }
    } else {
      op_append(k, &m, &r, seed, op, &st);
    }
    check_model(k, &m, seed, op);
  }
  /* The run must have exercised the hard paths, not only the easy ones. */
  ck_assert_msg(st.exhausted > 10 && st.copies > 100 && st.forks > 100 && st.truncates > 100,
                "seed %llu: too few interesting cases: %d exhausted appends, %d copies, %d forks, %d truncates",
                (unsigned long long)seed, st.exhausted, st.copies, st.forks, st.truncates);
  for (uint32_t q = 0; q < M_SEQS; q++)
    if (m.open[q]) ck_assert_int_eq(da_kvcache_close(k, q), 0);
  ck_assert_int_eq(da_kvcache_pages_free(k), M_PAGES);
  da_kvcache_free(k);
}

START_TEST(random_operations_match_the_reference_model) {
  run_model(da_test_seed(0x6b76636163686521ull) + (uint64_t)_i);
}
END_TEST

static Suite *unit_suite(void) {
  Suite *s = suite_create("unit");
  TCase *tc = tcase_create("kvcache");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, alloc_rejects_bad_config);
  tcase_add_test(tc, open_hands_out_distinct_handles_and_reuses_closed_ones);
  tcase_add_test(tc, append_takes_one_page_per_page_tokens_shared_by_all_layers);
  tcase_add_test(tc, append_that_does_not_fit_changes_nothing);
  tcase_add_test(tc, copy_on_write_that_does_not_fit_changes_nothing);
  tcase_add_test(tc, fork_shares_every_page_and_copies_lengths);
  tcase_add_test(tc, first_write_to_shared_partial_page_copies_it_and_second_does_not);
  tcase_add_test(tc, write_at_page_boundary_after_fork_takes_a_new_page_without_copy);
  tcase_add_test(tc, append_over_several_shared_pages_copies_each_in_order);
  tcase_add_test(tc, truncate_releases_pages_and_reappend_reuses_them);
  tcase_add_test(tc, truncate_keeps_pages_for_the_longest_layer);
  tcase_add_test(tc, truncating_a_fork_drops_only_its_references);
  tcase_add_test(tc, close_releases_every_page);
  tcase_add_test(tc, invalid_arguments_are_rejected_and_change_nothing);
  tcase_add_test(tc, fork_without_a_free_slot_changes_nothing);
  suite_add_tcase(s, tc);
  return s;
}

static Suite *model_suite(void) {
  Suite *s = suite_create("model");
  TCase *tc = tcase_create("random");
  tcase_add_loop_test(tc, random_operations_match_the_reference_model, 0, 3);
  tcase_set_timeout(tc, 60);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) {
  const char *which = argc > 1 ? argv[1] : "all";
  SRunner *sr = srunner_create(NULL);
  if (strcmp(which, "unit") == 0 || strcmp(which, "all") == 0) srunner_add_suite(sr, unit_suite());
  if (strcmp(which, "model") == 0 || strcmp(which, "all") == 0) srunner_add_suite(sr, model_suite());
  return da_test_run_runner(sr);
}
