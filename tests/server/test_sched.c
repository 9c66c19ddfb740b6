/*
 * test_sched.c — the batch scheduler (server/scheduler.c) over the real KV cache
 * bookkeeping: token budget, arrival order per (sequence, layer), write before attend,
 * S-aligned chunking with the append in the first chunk, round-robin fairness, decode before
 * prefill, the prefill budget, fairness per tenant, atomic multi-sequence admission,
 * copy-on-write copies, split-mode choice and completion.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache.h"
#include "scheduler.h"
#include "testutil.h"

#define HQ 2
#define HKV 1
#define HD 64
#define ROW_BYTES (HQ * HD * 2)

static uint64_t seed;
static da_kvcache *kv;
static da_sched *s;
static da_sched_batch batch;
static int n_done;

typedef struct fixture_cfg {
  int n_pages, split, budget, max_req, partial_rows, acc_slots, max_prefill;
} fixture_cfg;

static void make(fixture_cfg f) {
  da_kvcache_cfg kc = {.n_layers = 2, .page_tokens = 16, .n_pages = f.n_pages, .max_seqs = 16,
                       .max_seq_tokens = 8192};
  ck_assert_int_eq(da_kvcache_alloc(&kv, &kc), 0);
  da_sched_cfg sc = {.model = {.n_layers = 2, .n_q_heads = HQ, .n_kv_heads = HKV, .head_dim = HD,
                               .dtype = DA_BF16, .scale = 0.125f},
                     .split_tokens = f.split, .page_tokens = 16, .max_batch_tokens = f.budget,
                     .max_request_tokens = f.max_req, .acc_slots = f.acc_slots,
                     .partial_rows = f.partial_rows, .max_prefill_tokens = f.max_prefill};
  ck_assert_int_eq(da_sched_alloc(&s, &sc, kv), 0);
  da_sched_batch_init(&batch);
  n_done = 0;
}

static void setup(void) { seed = da_test_seed(0xbadc0ffee); }

static void teardown(void) {
  da_sched_batch_fini(&batch);
  da_sched_free(s);
  da_kvcache_free(kv);
  s = NULL;
  kv = NULL;
}

static uint32_t open_seq(void) {
  uint32_t h;
  ck_assert_int_eq(da_kvcache_open(kv, &h), 0);
  return h;
}

/* An item with buffers sized for its tokens (contents are never read by the scheduler). */
static da_sched_item *new_item(uint32_t seq, int layer, int pos, int n, void *user) {
  da_sched_item *it = calloc(1, sizeof(*it));
  it->kv_seq = seq;
  it->wire_seq = seq;
  it->layer = layer;
  it->pos = pos;
  it->n = n;
  it->q = malloc((size_t)n * ROW_BYTES);
  it->k = malloc((size_t)n * HKV * HD * 2);
  it->v = it->k;
  it->o = malloc((size_t)n * ROW_BYTES);
  it->user = user;
  return it;
}

static void free_item(da_sched_item *it) {
  free((void *)it->q);
  free((void *)it->k);
  free(it->o);
  free(it);
}

static void count_done(void *arg, da_sched_item *it) {
  (void)arg;
  it->user = (void *)((uintptr_t)it->user + 1);
  n_done++;
}

/* Recomputes the batch's cost from what the backend would run. */
static int batch_cost(const da_sched_batch *b) {
  int t = 0;
  for (int i = 0; i < b->b.n_appends; i++) t += b->b.appends[i].n_tokens;
  for (int i = 0; i < b->b.n_attns; i++) t += b->b.attns[i].n_q;
  return t;
}

/* ---- randomized: budget, FIFO per (seq, layer), write before attend, S-aligned ---- */

#define N_CLIENTS 4
#define SEQS_PER_CLIENT 2
#define N_REQ 80
#define MAXLEN 8192

START_TEST(random_load_keeps_budget_order_and_write_before_attend) {
  const int S = 128, BUDGET = 1024;
  make((fixture_cfg){.n_pages = 4096, .split = S, .budget = BUDGET, .max_req = 512, .partial_rows = 64,
                     .acc_slots = 1 << 20});
  da_rng r;
  da_rng_seed(&r, seed);
  da_sched_queue qs[N_CLIENTS];
  uint32_t seqs[N_CLIENTS][SEQS_PER_CLIENT];
  for (int c = 0; c < N_CLIENTS; c++) {
    da_sched_queue_init(&qs[c]);
    for (int j = 0; j < SEQS_PER_CLIENT; j++) seqs[c][j] = open_seq();
  }
  static int admitted_len[16][2], written[16][2];
  static unsigned char attended[16][2][MAXLEN];
  memset(admitted_len, 0, sizeof(admitted_len));
  memset(written, 0, sizeof(written));
  memset(attended, 0, sizeof(attended));
  da_sched_item *items[N_REQ];
  int n_items = 0, n_batches = 0, total_queries = 0;
  char err[256];
  while (n_items < N_REQ || da_sched_items_in_flight(s) > 0) {
    if (n_items < N_REQ && da_rng_range(&r, 0, 2) > 0) {
      int c = (int)da_rng_range(&r, 0, N_CLIENTS - 1);
      uint32_t sq = seqs[c][da_rng_range(&r, 0, SEQS_PER_CLIENT - 1)];
      int layer = (int)da_rng_range(&r, 0, 1);
      int n = da_rng_range(&r, 0, 3) == 0 ? (int)da_rng_range(&r, 1, 512) : 1;
      da_sched_item *it = new_item(sq, layer, admitted_len[sq][layer], n, NULL);
      ck_assert_msg(da_sched_admit(s, &qs[c], it, 1, 1, err, sizeof(err)) == 0, "seed %llu: %s",
                    (unsigned long long)seed, err);
      admitted_len[sq][layer] += n;
      total_queries += n;
      items[n_items++] = it;
      continue;
    }
    ck_assert_int_eq(da_sched_form(s, &batch, 2), 0);
    if (batch.n_entries == 0) continue;
    n_batches++;
    ck_assert_msg(batch.tokens <= BUDGET, "seed %llu: batch of %d tokens over budget %d",
                  (unsigned long long)seed, batch.tokens, BUDGET);
    ck_assert_int_eq(batch_cost(&batch), batch.tokens);
    int k = 0;
    for (int i = 0; i < batch.n_entries; i++) {
      const da_sched_entry *e = &batch.entries[i];
      const da_sched_item *it = e->item;
      ck_assert_int_eq(e->appends, e->q0 == 0); /* the append rides with the first chunk */
      if (e->appends) {
        const da_append *a = &batch.b.appends[k++];
        ck_assert_int_eq(a->pos, it->pos);
        ck_assert_int_eq(a->n_tokens, it->n);
        ck_assert_msg(a->pos == written[it->kv_seq][it->layer],
                      "seed %llu: seq %u layer %d appended at %d, expected %d (arrival order)",
                      (unsigned long long)seed, it->kv_seq, it->layer, a->pos, written[it->kv_seq][it->layer]);
        written[it->kv_seq][it->layer] += a->n_tokens;
      }
    }
    ck_assert_int_eq(k, batch.b.n_appends);
    for (int i = 0; i < batch.n_entries; i++) {
      const da_sched_entry *e = &batch.entries[i];
      const da_attn *a = &batch.b.attns[i];
      const da_sched_item *it = e->item;
      int end = a->q_pos + a->n_q;
      ck_assert_msg(end <= written[it->kv_seq][it->layer], "seed %llu: attention past written keys",
                    (unsigned long long)seed);
      ck_assert_msg(end % S == 0 || end == it->pos + it->n, "seed %llu: chunk end %d not S-aligned",
                    (unsigned long long)seed, end);
      ck_assert_ptr_eq(a->q, (const char *)it->q + (size_t)e->q0 * ROW_BYTES);
      ck_assert_int_ge(a->n_pages * 16, end);
      for (int p = a->q_pos; p < end; p++) {
        ck_assert_msg(!attended[it->kv_seq][it->layer][p], "seed %llu: position %d attended twice",
                      (unsigned long long)seed, p);
        attended[it->kv_seq][it->layer][p] = 1;
      }
    }
    da_sched_complete(s, &batch, count_done, NULL);
  }
  int n_attended = 0;
  for (int q = 0; q < 16; q++)
    for (int l = 0; l < 2; l++)
      for (int p = 0; p < MAXLEN; p++) n_attended += attended[q][l][p];
  ck_assert_int_eq(n_attended, total_queries);
  ck_assert_int_eq(n_done, N_REQ);
  ck_assert_int_eq(da_sched_pending_tokens(s), 0);
  for (int i = 0; i < N_REQ; i++) {
    ck_assert_msg((uintptr_t)items[i]->user == 1, "item %d completed %lu times", i, (unsigned long)(uintptr_t)items[i]->user);
    free_item(items[i]);
  }
  ck_assert_int_gt(n_batches, 1);
}
END_TEST

START_TEST(long_prefill_is_split_at_S_boundaries_with_append_first) {
  const int S = 256;
  make((fixture_cfg){.n_pages = 256, .split = S, .budget = 1000 + S, .max_req = 1000, .partial_rows = 0});
  da_sched_queue q;
  da_sched_queue_init(&q);
  uint32_t sq = open_seq();
  char err[256];
  da_sched_item *pre = new_item(sq, 0, 0, 100, NULL);
  ck_assert_int_eq(da_sched_admit(s, &q, pre, 1, 1, err, sizeof(err)), 0);
  da_sched_item *it = new_item(sq, 0, 100, 1000, NULL);
  ck_assert_int_eq(da_sched_admit(s, &q, it, 1, 1, err, sizeof(err)), 0);
  /* Batch 1: the 100-token prefill whole; the big item's first chunk needs 1000 + 156 and
   * does not fit after it. */
  ck_assert_int_eq(da_sched_form(s, &batch, 2), 0);
  ck_assert_int_eq(batch.n_entries, 1);
  ck_assert_ptr_eq(batch.entries[0].item, pre);
  da_sched_complete(s, &batch, count_done, NULL);
  /* Batch 2: the append of all 1000 tokens plus queries [100, 256) only. */
  ck_assert_int_eq(da_sched_form(s, &batch, 3), 0);
  ck_assert_int_eq(batch.b.n_appends, 1);
  ck_assert_int_eq(batch.b.appends[0].pos, 100);
  ck_assert_int_eq(batch.b.appends[0].n_tokens, 1000);
  ck_assert_int_eq(batch.b.n_attns, 1);
  ck_assert_int_eq(batch.b.attns[0].q_pos, 100);
  ck_assert_int_eq(batch.b.attns[0].n_q, 156);
  da_sched_complete(s, &batch, count_done, NULL);
  ck_assert_int_eq(n_done, 1); /* the big item is not done yet */
  /* Batch 3: the remaining queries [256, 1100), chunks merged into one entry, no append. */
  ck_assert_int_eq(da_sched_form(s, &batch, 4), 0);
  ck_assert_int_eq(batch.b.n_appends, 0);
  ck_assert_int_eq(batch.b.n_attns, 1);
  ck_assert_int_eq(batch.b.attns[0].q_pos, 256);
  ck_assert_int_eq(batch.b.attns[0].n_q, 844);
  ck_assert_ptr_eq(batch.b.attns[0].o, (char *)it->o + (size_t)156 * ROW_BYTES);
  da_sched_complete(s, &batch, count_done, NULL);
  ck_assert_int_eq(n_done, 2);
  ck_assert_int_eq(da_sched_form(s, &batch, 5), 0);
  ck_assert_int_eq(batch.n_entries, 0);
  free_item(pre);
  free_item(it);
}
END_TEST

START_TEST(clients_share_batches_round_robin) {
  const int S = 64;
  make((fixture_cfg){.n_pages = 1024, .split = S, .budget = 2048, .max_req = 1024, .partial_rows = 0});
  da_sched_queue qa, qb, qc;
  da_sched_queue_init(&qa);
  da_sched_queue_init(&qb);
  da_sched_queue_init(&qc);
  uint32_t sa = open_seq(), sb = open_seq(), sc = open_seq();
  char err[256];
  enum { ND = 300 };
  da_sched_item *big = new_item(sa, 0, 0, 1024, (void *)0);
  ck_assert_int_eq(da_sched_admit(s, &qa, big, 1, 1, err, sizeof(err)), 0);
  da_sched_item *db[ND], *dc[ND];
  for (int i = 0; i < ND; i++) {
    db[i] = new_item(sb, 0, i, 1, NULL);
    ck_assert_int_eq(da_sched_admit(s, &qb, db[i], 1, 1, err, sizeof(err)), 0);
    dc[i] = new_item(sc, 1, i, 1, NULL);
    ck_assert_int_eq(da_sched_admit(s, &qc, dc[i], 1, 1, err, sizeof(err)), 0);
  }
  int batches = 0;
  for (;;) {
    ck_assert_int_eq(da_sched_form(s, &batch, 2), 0);
    if (batch.n_entries == 0) break;
    batches++;
    int nb = 0, nc = 0;
    for (int i = 0; i < batch.n_entries; i++) {
      uint32_t q = batch.entries[i].item->kv_seq;
      nb += q == sb;
      nc += q == sc;
    }
    /* While B and C both have work, each gets a unit every round: equal shares. */
    int b_left = 0, c_left = 0;
    for (int i = 0; i < ND; i++) {
      b_left += db[i]->q_next < db[i]->n;
      c_left += dc[i]->q_next < dc[i]->n;
    }
    if (b_left > 0 && c_left > 0) {
      ck_assert_int_gt(nb, 0);
      ck_assert_msg(abs(nb - nc) <= 1, "batch %d: client B got %d units, C %d", batches, nb, nc);
    }
    da_sched_complete(s, &batch, count_done, NULL);
    if (batches == 1) ck_assert_msg(big->appended, "the prefill client was starved in the first batch");
  }
  ck_assert_int_eq(n_done, 2 * ND + 1);
  free_item(big);
  for (int i = 0; i < ND; i++) {
    free_item(db[i]);
    free_item(dc[i]);
  }
}
END_TEST


START_TEST(decode_heads_are_formed_before_prefill_chunks) {
  make((fixture_cfg){.n_pages = 1024, .split = 64, .budget = 4096, .max_req = 1024});
  da_sched_queue qa, qb;
  da_sched_queue_init(&qa);
  da_sched_queue_init(&qb);
  qa.tenant = 1;
  qb.tenant = 2;
  uint32_t sa = open_seq(), sb = open_seq();
  char err[256];
  da_sched_item *pre = new_item(sa, 0, 0, 1024, NULL), *dec = new_item(sb, 0, 0, 1, NULL);
  ck_assert_int_eq(da_sched_admit(s, &qa, pre, 1, 1, err, sizeof(err)), 0); /* first in the ring */
  ck_assert_int_eq(da_sched_admit(s, &qb, dec, 1, 2, err, sizeof(err)), 0);
  ck_assert_int_eq(da_sched_pending_decode(s), 1);
  ck_assert_int_eq(da_sched_form(s, &batch, 3), 0);
  ck_assert_int_ge(batch.n_entries, 2);
  ck_assert_msg(batch.entries[0].item == dec, "the decode step was not formed first");
  ck_assert_int_eq(da_sched_pending_decode(s), 0);
  da_sched_complete(s, &batch, count_done, NULL);
  while (da_sched_form(s, &batch, 4) == 0 && batch.n_entries > 0) da_sched_complete(s, &batch, count_done, NULL);
  ck_assert_int_eq(n_done, 2);
  free_item(pre);
  free_item(dec);
}
END_TEST

START_TEST(prefill_budget_bounds_prefill_queries_per_batch) {
  enum { N = 1000, BUDGET = 100 };
  make((fixture_cfg){.n_pages = 1024, .split = 64, .budget = 2048, .max_req = 1024, .max_prefill = BUDGET});
  da_sched_queue q;
  da_sched_queue_init(&q);
  uint32_t sa = open_seq();
  char err[256];
  da_sched_item *pre = new_item(sa, 0, 0, N, NULL);
  ck_assert_int_eq(da_sched_admit(s, &q, pre, 1, 1, err, sizeof(err)), 0);
  int batches = 0, next = 0;
  for (;;) {
    ck_assert_int_eq(da_sched_form(s, &batch, 2), 0);
    if (batch.n_entries == 0) break;
    batches++;
    ck_assert_int_eq(batch.n_entries, 1);
    ck_assert_msg(batch.query_tokens <= BUDGET, "batch %d: %d prefill queries", batches, batch.query_tokens);
    ck_assert_int_eq(batch.entries[0].q0, next); /* in order, each query once */
    ck_assert_int_eq(batch.b.n_appends, batches == 1); /* the append goes with the first chunk */
    next += batch.entries[0].nq;
    da_sched_complete(s, &batch, count_done, NULL);
  }
  ck_assert_int_eq(next, N);
  ck_assert_int_eq(batches, (N + BUDGET - 1) / BUDGET);
  ck_assert_int_eq(n_done, 1);
  free_item(pre);
}
END_TEST

START_TEST(tenants_share_equally_whatever_their_connections) {
  enum { PER = 40 };
  /* Decode room per batch: budget - (max_req + S) = 16 tokens, 8 single-token steps. */
  make((fixture_cfg){.n_pages = 1024, .split = 64, .budget = 64 + 64 + 16, .max_req = 64});
  da_sched_queue qx[4], qy;
  char err[256];
  da_sched_item *items[5][PER];
  uint32_t seqs[5];
  for (int c = 0; c < 5; c++) {
    da_sched_queue *q = c < 4 ? &qx[c] : &qy;
    da_sched_queue_init(q);
    q->tenant = c < 4 ? 7 : 9; /* tenant 7 has four connections, tenant 9 one */
    seqs[c] = open_seq();
    for (int i = 0; i < PER; i++) {
      items[c][i] = new_item(seqs[c], 0, i, 1, NULL);
      ck_assert_int_eq(da_sched_admit(s, q, items[c][i], 1, 1, err, sizeof(err)), 0);
    }
  }
  int batches = 0;
  for (;;) {
    ck_assert_int_eq(da_sched_form(s, &batch, 2), 0);
    if (batch.n_entries == 0) break;
    batches++;
    int nx = 0, ny = 0;
    for (int i = 0; i < batch.n_entries; i++) {
      uint32_t q = batch.entries[i].item->kv_seq;
      if (q == seqs[4]) ny++;
      else nx++;
    }
    int y_left = 0;
    for (int i = 0; i < PER; i++) y_left += items[4][i]->q_next < items[4][i]->n;
    if (y_left > 0) /* while both tenants still have work */
      ck_assert_msg(abs(nx - ny) <= 1, "batch %d: tenant of 4 connections got %d steps, tenant of 1 got %d",
                    batches, nx, ny);
    da_sched_complete(s, &batch, count_done, NULL);
  }
  ck_assert_int_eq(n_done, 5 * PER);
  for (int c = 0; c < 5; c++)
    for (int i = 0; i < PER; i++) free_item(items[c][i]);
}
END_TEST

START_TEST(multi_sequence_admission_is_all_or_nothing) {
  make((fixture_cfg){.n_pages = 10, .split = 64, .budget = 4096, .max_req = 1024, .partial_rows = 0});
  da_sched_queue q;
  da_sched_queue_init(&q);
  uint32_t s1 = open_seq(), s2 = open_seq();
  char err[256];
  da_sched_item *a = new_item(s1, 0, 0, 100, NULL); /* 7 pages */
  ck_assert_int_eq(da_sched_admit(s, &q, a, 1, 1, err, sizeof(err)), 0);
  ck_assert_int_eq(da_kvcache_pages_free(kv), 3);
  int64_t pending = da_sched_pending_tokens(s);
  /* seq 1 layer 1 fits in its pages (cost 0); seq 2 needs 4 pages; 3 are free. */
  da_sched_item *two = calloc(2, sizeof(*two));
  da_sched_item *x = new_item(s1, 1, 0, 16, NULL), *y = new_item(s2, 0, 0, 64, NULL);
  two[0] = *x;
  two[1] = *y;
  ck_assert_int_eq(da_sched_admit(s, &q, two, 2, 1, err, sizeof(err)), DETATTN_RESOURCE_EXHAUSTED);
  ck_assert_msg(strstr(err, "needs 4 pages, 3 free"), "%s", err);
  ck_assert_int_eq(da_kvcache_length(kv, s1, 1), 0);
  ck_assert_int_eq(da_kvcache_length(kv, s2, 0), 0);
  ck_assert_int_eq(da_kvcache_pages_free(kv), 3);
  ck_assert_int_eq(da_sched_pending_tokens(s), pending);
  ck_assert_int_eq(da_sched_items_in_flight(s), 1);
  /* A smaller second sequence fits: both are admitted together. */
  two[1].n = 48;
  ck_assert_msg(da_sched_admit(s, &q, two, 2, 1, err, sizeof(err)) == 0, "%s", err);
  ck_assert_int_eq(da_kvcache_length(kv, s1, 1), 16);
  ck_assert_int_eq(da_kvcache_length(kv, s2, 0), 48);
  ck_assert_int_eq(da_kvcache_pages_free(kv), 0);
  ck_assert_int_eq(da_sched_items_in_flight(s), 3);
  while (da_sched_items_in_flight(s) > 0) {
    ck_assert_int_eq(da_sched_form(s, &batch, 2), 0);
    ck_assert_int_gt(batch.n_entries, 0);
    da_sched_complete(s, &batch, count_done, NULL);
  }
  ck_assert_int_eq(n_done, 3);
  free(two);
  free_item(a);
  free_item(x);
  free_item(y);
}
END_TEST

START_TEST(wrong_position_is_failed_precondition_and_changes_nothing) {
  make((fixture_cfg){.n_pages = 64, .split = 64, .budget = 4096, .max_req = 1024, .partial_rows = 0});
  da_sched_queue q;
  da_sched_queue_init(&q);
  uint32_t s1 = open_seq();
  char err[256];
  da_sched_item *a = new_item(s1, 0, 5, 10, NULL);
  ck_assert_int_eq(da_sched_admit(s, &q, a, 1, 1, err, sizeof(err)), DETATTN_FAILED_PRECONDITION);
  ck_assert_msg(strstr(err, "expected 0, got 5"), "%s", err);
  ck_assert_int_eq(da_kvcache_length(kv, s1, 0), 0);
  ck_assert_int_eq(da_kvcache_pages_free(kv), 64);
  ck_assert_int_eq(da_sched_pending_tokens(s), 0);
  ck_assert_int_eq(da_sched_form(s, &batch, 2), 0);
  ck_assert_int_eq(batch.n_entries, 0);
  a->pos = 0;
  a->kv_seq = 9; /* never opened */
  ck_assert_int_eq(da_sched_admit(s, &q, a, 1, 1, err, sizeof(err)), DETATTN_NOT_FOUND);
  free_item(a);
}
END_TEST

START_TEST(copy_on_write_copies_run_in_the_next_batch) {
  make((fixture_cfg){.n_pages = 64, .split = 64, .budget = 4096, .max_req = 1024, .partial_rows = 0});
  da_sched_queue q;
  da_sched_queue_init(&q);
  uint32_t src = open_seq();
  char err[256];
  da_sched_item *a = new_item(src, 0, 0, 20, NULL); /* page 1 half full */
  ck_assert_int_eq(da_sched_admit(s, &q, a, 1, 1, err, sizeof(err)), 0);
  ck_assert_int_eq(da_sched_form(s, &batch, 2), 0);
  ck_assert_int_eq(batch.b.n_copies, 0);
  da_sched_complete(s, &batch, count_done, NULL);
  uint32_t fork;
  ck_assert_int_eq(da_kvcache_fork(kv, src, &fork), 0);
  da_sched_item *b = new_item(fork, 0, 20, 4, NULL);
  ck_assert_int_eq(da_sched_admit(s, &q, b, 1, 1, err, sizeof(err)), 0);
  ck_assert_int_eq(da_sched_form(s, &batch, 3), 0);
  ck_assert_int_ge(batch.b.n_copies, 1);
  int np;
  const int32_t *src_pages = da_kvcache_pages(kv, src, &np);
  ck_assert_int_eq(batch.b.copies[0].src, src_pages[1]);
  ck_assert_int_eq(batch.b.n_appends, 1);
  ck_assert_int_eq(batch.b.copies[0].dst, batch.b.appends[0].pages[1]);
  ck_assert_int_ne(batch.b.appends[0].pages[1], src_pages[1]);
  da_sched_complete(s, &batch, count_done, NULL);
  ck_assert_int_eq(da_sched_form(s, &batch, 4), 0);
  ck_assert_int_eq(batch.b.n_copies, 0);
  free_item(a);
  free_item(b);
}
END_TEST

START_TEST(page_table_snapshot_is_owned_by_the_batch) {
  make((fixture_cfg){.n_pages = 64, .split = 64, .budget = 4096, .max_req = 1024, .partial_rows = 0});
  da_sched_queue q;
  da_sched_queue_init(&q);
  uint32_t sq = open_seq();
  char err[256];
  da_sched_item *a = new_item(sq, 0, 0, 40, NULL);
  ck_assert_int_eq(da_sched_admit(s, &q, a, 1, 1, err, sizeof(err)), 0);
  ck_assert_int_eq(da_sched_form(s, &batch, 2), 0);
  int np;
  const int32_t *live = da_kvcache_pages(kv, sq, &np);
  ck_assert_ptr_ne(batch.b.attns[0].pages, live);
  int32_t before[3];
  memcpy(before, batch.b.attns[0].pages, sizeof(before));
  ck_assert_int_eq(memcmp(before, live, sizeof(before)), 0);
  /* The loop thread keeps changing the cache while the batch runs. */
  da_sched_item *b = new_item(sq, 0, 40, 200, NULL);
  ck_assert_int_eq(da_sched_admit(s, &q, b, 1, 1, err, sizeof(err)), 0);
  ck_assert_int_eq(memcmp(before, batch.b.attns[0].pages, sizeof(before)), 0);
  da_sched_complete(s, &batch, count_done, NULL);
  free_item(a);
  free_item(b);
}
END_TEST

/* Admits an item of n tokens from pos of sequence seq to queue q, forms its batch (the whole
 * item) at time t and returns the batch's split mode (the batch completed; the caller frees
 * *it). */
static da_split_mode mode_of(da_sched_queue *q, uint32_t seq, int pos, int n, uint64_t t, da_sched_item **it) {
  char err[256];
  *it = new_item(seq, 0, pos, n, NULL);
  ck_assert_int_eq(da_sched_admit(s, q, *it, 1, 1, err, sizeof(err)), 0);
  ck_assert_int_eq(da_sched_form(s, &batch, t), 0);
  ck_assert_ptr_null(q->head);
  const da_split_mode mode = batch.b.split_mode;
  da_sched_complete(s, &batch, count_done, NULL);
  return mode;
}

START_TEST(split_mode_follows_batch_shape) {
  make((fixture_cfg){.n_pages = 256, .split = 64, .budget = 4096, .max_req = 1024, .partial_rows = 64,
                     .acc_slots = 1 << 16});
  da_sched_queue q;
  da_sched_queue_init(&q);
  const uint32_t sq = open_seq(), s2 = open_seq();
  da_sched_item *pre, *dec, *shortd;
  ck_assert_int_eq(mode_of(&q, sq, 0, 500, 2, &pre), DA_SPLIT_INROW);   /* 1000 rows */
  ck_assert_int_eq(mode_of(&q, sq, 500, 1, 3, &dec), DA_SPLIT_PARTIAL); /* 2 rows over 8 splits */
  ck_assert_int_eq(mode_of(&q, s2, 0, 10, 4, &shortd), DA_SPLIT_INROW); /* one split per row */
  free_item(pre);
  free_item(dec);
  free_item(shortd);
}
END_TEST

/* partial_rows < 0 (the daemon's default): every batch goes to the backend as AUTO, whatever
 * its shape, so the backend picks from its own device (a B 8 decode step of 32 q heads has 256
 * rows: the fixed rule of 256 ran it in-row on the GPU, on 64 of 132 SMs). */
START_TEST(split_mode_is_the_backends_by_default) {
  make((fixture_cfg){.n_pages = 256, .split = 64, .budget = 4096, .max_req = 1024, .partial_rows = -1,
                     .acc_slots = 1 << 16});
  da_sched_queue q;
  da_sched_queue_init(&q);
  const uint32_t sq = open_seq();
  da_sched_item *pre, *dec;
  ck_assert_int_eq(mode_of(&q, sq, 0, 500, 2, &pre), DA_SPLIT_AUTO);
  ck_assert_int_eq(mode_of(&q, sq, 500, 1, 3, &dec), DA_SPLIT_AUTO);
  free_item(pre);
  free_item(dec);
}
END_TEST

START_TEST(partial_needs_free_accumulator_slots) {
  make((fixture_cfg){.n_pages = 256, .split = 64, .budget = 4096, .max_req = 1024, .partial_rows = 64,
                     .acc_slots = 8});
  da_sched_queue q;
  da_sched_queue_init(&q);
  const uint32_t sq = open_seq();
  da_sched_item *pre, *dec;
  (void)mode_of(&q, sq, 0, 500, 2, &pre);
  ck_assert_int_eq(mode_of(&q, sq, 500, 1, 3, &dec), DA_SPLIT_INROW); /* needs 2 x 8 = 16 slots > 8 */
  free_item(pre);
  free_item(dec);
}
END_TEST

START_TEST(cancel_drops_unstarted_items_and_keeps_the_started_one) {
  const int S = 64;
  make((fixture_cfg){.n_pages = 256, .split = S, .budget = 300 + S, .max_req = 300, .partial_rows = 0});
  da_sched_queue q;
  da_sched_queue_init(&q);
  uint32_t s1 = open_seq(), s2 = open_seq();
  char err[256];
  da_sched_item *big = new_item(s1, 0, 0, 300, NULL); /* five chunks */
  da_sched_item *b = new_item(s1, 1, 0, 10, NULL), *c = new_item(s2, 0, 0, 20, NULL);
  ck_assert_int_eq(da_sched_admit(s, &q, big, 1, 1, err, sizeof(err)), 0);
  ck_assert_int_eq(da_sched_admit(s, &q, b, 1, 1, err, sizeof(err)), 0);
  ck_assert_int_eq(da_sched_admit(s, &q, c, 1, 1, err, sizeof(err)), 0);
  ck_assert_int_eq(da_sched_form(s, &batch, 2), 0); /* append 300 + queries [0, 64) */
  ck_assert_int_eq(batch.n_entries, 1);
  ck_assert_int_lt(big->q_next, big->n);
  int64_t before = da_sched_pending_tokens(s);
  ck_assert_int_eq(da_sched_cancel(s, &q, count_done, NULL), 2);
  ck_assert_int_eq(n_done, 2);
  ck_assert_int_eq((int)(uintptr_t)b->user, 1);
  ck_assert_int_eq((int)(uintptr_t)c->user, 1);
  ck_assert_int_eq(da_sched_pending_tokens(s), before - 2 * (10 + 20));
  da_sched_complete(s, &batch, count_done, NULL);
  while (da_sched_items_in_flight(s) > 0) {
    ck_assert_int_eq(da_sched_form(s, &batch, 3), 0);
    ck_assert_int_gt(batch.n_entries, 0);
    for (int i = 0; i < batch.n_entries; i++) ck_assert_ptr_eq(batch.entries[i].item, big);
    da_sched_complete(s, &batch, count_done, NULL);
  }
  ck_assert_int_eq(n_done, 3);
  ck_assert_int_eq(big->q_done, big->n);
  ck_assert_int_eq(da_sched_pending_tokens(s), 0);
  ck_assert_int_eq(da_sched_cancel(s, &q, count_done, NULL), 0);
  free_item(big);
  free_item(b);
  free_item(c);
}
END_TEST

int main(void) {
  Suite *su = suite_create("server_sched");
  TCase *tc = tcase_create("sched");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, random_load_keeps_budget_order_and_write_before_attend);
  tcase_add_test(tc, long_prefill_is_split_at_S_boundaries_with_append_first);
  tcase_add_test(tc, clients_share_batches_round_robin);
  tcase_add_test(tc, decode_heads_are_formed_before_prefill_chunks);
  tcase_add_test(tc, prefill_budget_bounds_prefill_queries_per_batch);
  tcase_add_test(tc, tenants_share_equally_whatever_their_connections);
  tcase_add_test(tc, multi_sequence_admission_is_all_or_nothing);
  tcase_add_test(tc, wrong_position_is_failed_precondition_and_changes_nothing);
  tcase_add_test(tc, copy_on_write_copies_run_in_the_next_batch);
  tcase_add_test(tc, page_table_snapshot_is_owned_by_the_batch);
  tcase_add_test(tc, split_mode_follows_batch_shape);
  tcase_add_test(tc, split_mode_is_the_backends_by_default);
  tcase_add_test(tc, partial_needs_free_accumulator_slots);
  tcase_add_test(tc, cancel_drops_unstarted_items_and_keeps_the_started_one);
  suite_add_tcase(su, tc);
  return da_test_run(su);
}
