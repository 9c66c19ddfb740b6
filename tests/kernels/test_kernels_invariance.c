/* The bit-exact invariances of DESIGN.md §1 on the CPU backend: a sequence's outputs do not
 * depend on the batch around it, on how its tokens are chunked, on the split mode, on the
 * thread count, on the KV page size, or on its history (fork by page copy, truncate and
 * re-append). */
#include <stdio.h>

#include "kt.h"

static const kt_case cases[] = {
    {"bf16 8q/2kv d128", 8, 2, 128, DA_BF16, 0.0f, 0, 64, 16, 16},
    {"fp16 4q/1kv d64 window 90 softcap 20", 4, 1, 64, DA_FP16, 20.0f, 90, 32, 16, 8},
};
#define N_CASES ((int)(sizeof(cases) / sizeof(cases[0])))
#define POOL 600
#define MAX_SEQS 8

typedef struct fixture {
  const kt_case *c;
  uint64_t seed;
  da_rng r;
  da_model m;
  uint8_t used[POOL];
} fixture;

static void fx_init(fixture *f, int i, uint64_t base) {
  memset(f, 0, sizeof(*f));
  f->c = &cases[i];
  f->seed = da_test_seed(base + (uint64_t)i);
  da_rng_seed(&f->r, f->seed);
  f->m = kt_model(2, f->c->hq, f->c->hk, f->c->d, f->c->dt, f->c->softcap, f->c->window);
}

static da_backend *fx_open(fixture *f, int n_threads, int acc_slots) {
  da_backend_cfg cfg = kt_cfg(&f->m, f->c->split, f->c->tile, f->c->ptok, POOL, n_threads);
  cfg.acc_slots = acc_slots;
  return kt_open(&cfg);
}

/* A batch appending all of seqs and attending all their tokens, each sequence's queries
 * cut into random pieces drawn from piece_seed (equal seeds give equal pieces). */
typedef struct full_batch {
  da_append ap[MAX_SEQS];
  da_attn at[MAX_SEQS * 4];
  da_batch b;
} full_batch;

static void make_full_batch(full_batch *fb, kt_seq *seqs, int n, uint64_t piece_seed,
                            da_split_mode mode) {
  da_rng pr;
  da_rng_seed(&pr, piece_seed);
  int na = 0;
  for (int i = 0; i < n; i++) {
    fb->ap[i] = kt_append(&seqs[i], 0, seqs[i].len);
    int pos = 0;
    for (int piece = 0; piece < 3 && pos < seqs[i].len; piece++) {
      const int n_q = piece == 2 ? seqs[i].len - pos : (int)da_rng_range(&pr, 1, seqs[i].len - pos);
      fb->at[na++] = kt_attn(&seqs[i], pos, n_q);
      pos += n_q;
    }
    if (pos < seqs[i].len) fb->at[na++] = kt_attn(&seqs[i], pos, seqs[i].len - pos);
  }
  fb->b = (da_batch){.appends = fb->ap, .n_appends = n, .attns = fb->at, .n_attns = na,
                     .split_mode = mode};
}

START_TEST(row_alone_equals_row_in_random_batches) {
  fixture f;
  fx_init(&f, _i, 2000);
  kt_seq t;
  kt_seq_make(&t, &f.m, &f.r, 1, 333, f.c->ptok, f.used, POOL, 1.5);
  da_backend *be = fx_open(&f, 2, 0);
  kt_forward(be, &t, 0, t.len, DA_SPLIT_AUTO, f.seed);
  da_backend_close(be);
  for (int trial = 0; trial < 4; trial++) {
    uint8_t used[POOL] = {0};
    be = fx_open(&f, 2, 0);
    kt_seq t2, others[MAX_SEQS];
    kt_seq_clone(&t2, &t, &f.r, f.c->ptok, used, POOL);
    const int n_others = (int)da_rng_range(&f.r, 1, 6);
    for (int i = 0; i < n_others; i++)
      kt_seq_make(&others[i], &f.m, &f.r, (int)da_rng_range(&f.r, 0, 1),
                  (int)da_rng_range(&f.r, 1, 300), f.c->ptok, used, POOL, 1.5);
    /* The target goes in at a random place among the other sequences. */
    kt_seq all[MAX_SEQS];
    const int at = (int)da_rng_range(&f.r, 0, n_others);
    for (int i = 0, j = 0; i <= n_others; i++) all[i] = i == at ? t2 : others[j++];
    full_batch fb;
    const da_split_mode mode = (da_split_mode)da_rng_range(&f.r, 0, 2);
    make_full_batch(&fb, all, n_others + 1, da_rng_u64(&f.r), mode);
    kt_run(be, &fb.b, f.seed);
    char what[96];
    snprintf(what, sizeof(what), "%s trial %d (%d others, mode %d)", f.c->name, trial, n_others,
             (int)mode);
    kt_assert_same_bits(&t, &all[at], f.seed, what);
    for (int i = 0; i <= n_others; i++) kt_seq_free(&all[i]);
    da_backend_close(be);
  }
  kt_seq_free(&t);
}
END_TEST

START_TEST(one_shot_chunked_and_token_by_token_give_same_bits) {
  fixture f;
  fx_init(&f, _i, 3000);
  da_backend *be = fx_open(&f, 2, 0);
  kt_seq a, b, c;
  kt_seq_make(&a, &f.m, &f.r, 0, 300, f.c->ptok, f.used, POOL, 1.5);
  kt_seq_clone(&b, &a, &f.r, f.c->ptok, f.used, POOL);
  kt_seq_clone(&c, &a, &f.r, f.c->ptok, f.used, POOL);
  kt_forward(be, &a, 0, a.len, DA_SPLIT_AUTO, f.seed);
  for (int pos = 0; pos < b.len;) {
    int n = (int)da_rng_range(&f.r, 1, 97);
    if (n > b.len - pos) n = b.len - pos;
    kt_forward(be, &b, pos, n, (da_split_mode)da_rng_range(&f.r, 0, 2), f.seed);
    pos += n;
  }
  for (int pos = 0; pos < c.len; pos++) kt_forward(be, &c, pos, 1, DA_SPLIT_AUTO, f.seed);
  kt_assert_same_bits(&a, &b, f.seed, "one-shot vs chunked prefill");
  kt_assert_same_bits(&a, &c, f.seed, "one-shot vs token-by-token decode");
  kt_seq_free(&a);
  kt_seq_free(&b);
  kt_seq_free(&c);
  da_backend_close(be);
}
END_TEST

/* n sequences of random layer and length in [1, max_len]. */
static void make_seqs(fixture *f, kt_seq *seqs, int n, int max_len) {
  for (int i = 0; i < n; i++)
    kt_seq_make(&seqs[i], &f->m, &f->r, (int)da_rng_range(&f->r, 0, 1),
                (int)da_rng_range(&f->r, 1, max_len), f->c->ptok, f->used, POOL, 1.5);
}

START_TEST(inrow_partial_and_auto_give_same_bits) {
  fixture f;
  fx_init(&f, _i, 4000);
  enum { N = 4 };
  kt_seq base[N], run[3][N];
  make_seqs(&f, base, N, 250);
  const uint64_t pieces = da_rng_u64(&f.r);
  da_backend *be = fx_open(&f, 2, 40000);
  const da_split_mode modes[3] = {DA_SPLIT_INROW, DA_SPLIT_PARTIAL, DA_SPLIT_AUTO};
  for (int mi = 0; mi < 3; mi++) {
    for (int i = 0; i < N; i++) kt_seq_clone(&run[mi][i], &base[i], &f.r, f.c->ptok, f.used, POOL);
    full_batch fb;
    make_full_batch(&fb, run[mi], N, pieces, modes[mi]);
    da_batch_result res;
    int rv = da_backend_run(be, &fb.b, &res);
    ck_assert_msg(rv == 0, "seed %llu: %s", (unsigned long long)f.seed, res.err);
    int64_t rows = 0;
    for (int i = 0; i < N; i++) rows += (int64_t)base[i].len * f.m.n_q_heads;
    ck_assert_int_eq(res.inrow_rows + res.partial_rows, rows);
    if (modes[mi] == DA_SPLIT_INROW) ck_assert_int_eq(res.partial_rows, 0);
    if (modes[mi] == DA_SPLIT_PARTIAL) ck_assert_int_eq(res.inrow_rows, 0);
  }
  for (int i = 0; i < N; i++) {
    kt_assert_same_bits(&run[0][i], &run[1][i], f.seed, "in-row vs partial");
    kt_assert_same_bits(&run[0][i], &run[2][i], f.seed, "in-row vs auto");
  }
  for (int i = 0; i < N; i++) {
    kt_seq_free(&base[i]);
    for (int mi = 0; mi < 3; mi++) kt_seq_free(&run[mi][i]);
  }
  da_backend_close(be);
}
END_TEST

/* Three runs of the same N sequences, run k on a backend of threads[k] threads and pages of
 * ptoks[k] tokens: every token but each sequence's last in one batch of chunks (run 1 as
 * partials), then the last as a decode step of its own. Runs 1 and 2 must give run 0's bits
 * (what[0], what[1] name them in a failure). */
static void assert_three_backends_same_bits(fixture *f, const int threads[3], const int ptoks[3],
                                            const char *const what[2]) {
  enum { N = 5 };
  kt_seq base[N], run[3][N];
  make_seqs(f, base, N, 200);
  const uint64_t pieces = da_rng_u64(&f->r);
  for (int k = 0; k < 3; k++) {
    uint8_t used[POOL] = {0};
    da_backend_cfg cfg = kt_cfg(&f->m, f->c->split, f->c->tile, ptoks[k], POOL, threads[k]);
    da_backend *be = kt_open(&cfg);
    for (int i = 0; i < N; i++) {
      kt_seq_clone(&run[k][i], &base[i], &f->r, ptoks[k], used, POOL);
      run[k][i].len--;
    }
    full_batch fb;
    make_full_batch(&fb, run[k], N, pieces, k == 1 ? DA_SPLIT_PARTIAL : DA_SPLIT_AUTO);
    if (fb.b.n_attns > 0) kt_run(be, &fb.b, f->seed); /* sequences of one token: none */
    for (int i = 0; i < N; i++) {
      kt_forward(be, &run[k][i], run[k][i].len, 1, DA_SPLIT_AUTO, f->seed);
      run[k][i].len++;
    }
    da_backend_close(be);
  }
  for (int i = 0; i < N; i++) {
    kt_assert_same_bits(&run[0][i], &run[1][i], f->seed, what[0]);
    kt_assert_same_bits(&run[0][i], &run[2][i], f->seed, what[1]);
  }
  for (int i = 0; i < N; i++) {
    kt_seq_free(&base[i]);
    for (int k = 0; k < 3; k++) kt_seq_free(&run[k][i]);
  }
}

START_TEST(thread_count_does_not_change_bits) {
  fixture f;
  fx_init(&f, _i, 5000);
  const int threads[3] = {1, 3, 8}, ptoks[3] = {f.c->ptok, f.c->ptok, f.c->ptok};
  const char *const what[2] = {"1 thread vs 3 threads", "1 thread vs 8 threads"};
  assert_three_backends_same_bits(&f, threads, ptoks, what);
}
END_TEST

/* KV pages of 8, the case's and 64 tokens hold the same keys: a tile reads them from one,
 * two or eight pages, and the bits may not change (NOTES v5.20: page size is a
 * configuration, not a numerics, choice). */
START_TEST(page_size_does_not_change_bits) {
  fixture f;
  fx_init(&f, _i, 5500);
  const int threads[3] = {2, 2, 2}, ptoks[3] = {f.c->ptok, 8, 64};
  const char *const what[2] = {"case's page size vs 8 tokens", "case's page size vs 64 tokens"};
  assert_three_backends_same_bits(&f, threads, ptoks, what);
}
END_TEST

START_TEST(partial_falls_back_to_inrow_when_slots_run_short) {
  fixture f;
  fx_init(&f, _i, 6000);
  enum { N = 4 };
  kt_seq a[N], b[N];
  /* Long sequences decoded one token each: a row needs one slot per split. */
  for (int i = 0; i < N; i++) {
    kt_seq_make(&a[i], &f.m, &f.r, 0, 200 + 50 * i, f.c->ptok, f.used, POOL, 1.5);
    kt_seq_clone(&b[i], &a[i], &f.r, f.c->ptok, f.used, POOL);
  }
  /* Room for the first sequence's partials only. */
  const int p0 = a[0].len - 1;
  const int w0 = f.c->window > 0 && p0 - f.c->window + 1 > 0 ? p0 - f.c->window + 1 : 0;
  const int slots = f.m.n_q_heads * (p0 / f.c->split - w0 / f.c->split + 1) + 1;
  da_backend *small = fx_open(&f, 2, slots), *big = fx_open(&f, 2, 0);
  for (int i = 0; i < N; i++) {
    kt_forward(small, &a[i], 0, a[i].len - 1, DA_SPLIT_INROW, f.seed);
    kt_forward(big, &b[i], 0, b[i].len - 1, DA_SPLIT_INROW, f.seed);
  }
  da_attn at[N], bt[N];
  for (int i = 0; i < N; i++) {
    at[i] = kt_attn(&a[i], a[i].len - 1, 1);
    bt[i] = kt_attn(&b[i], b[i].len - 1, 1);
  }
  da_append aa[N], ba[N];
  for (int i = 0; i < N; i++) {
    aa[i] = kt_append(&a[i], a[i].len - 1, 1);
    ba[i] = kt_append(&b[i], b[i].len - 1, 1);
  }
  da_batch bs = {.appends = aa, .n_appends = N, .attns = at, .n_attns = N,
                 .split_mode = DA_SPLIT_PARTIAL};
  da_batch bb = {.appends = ba, .n_appends = N, .attns = bt, .n_attns = N,
                 .split_mode = DA_SPLIT_INROW};
  da_batch_result res;
  int rv = da_backend_run(small, &bs, &res);
  ck_assert_msg(rv == 0, "seed %llu: partial with %d slots failed: %s", (unsigned long long)f.seed,
                slots, res.err);
  ck_assert_int_eq(res.partial_rows, f.m.n_q_heads);
  ck_assert_int_eq(res.inrow_rows, (N - 1) * f.m.n_q_heads);
  kt_run(big, &bb, f.seed);
  for (int i = 0; i < N; i++) kt_assert_same_bits(&a[i], &b[i], f.seed, "fallback vs in-row");
  for (int i = 0; i < N; i++) {
    kt_seq_free(&a[i]);
    kt_seq_free(&b[i]);
  }
  da_backend_close(small);
  da_backend_close(big);
}
END_TEST

START_TEST(auto_runs_long_decode_as_partials_and_big_batches_in_row) {
  fixture f;
  fx_init(&f, _i, 6500);
  kt_seq a, b;
  kt_seq_make(&a, &f.m, &f.r, 0, 8 * f.c->split + 5, f.c->ptok, f.used, POOL, 1.5);
  kt_seq_clone(&b, &a, &f.r, f.c->ptok, f.used, POOL);
  da_backend *be = fx_open(&f, 4, 0);
  kt_forward(be, &a, 0, a.len - 1, DA_SPLIT_INROW, f.seed);
  kt_forward(be, &b, 0, b.len - 1, DA_SPLIT_INROW, f.seed);
  /* One decode row over many splits, few work items for 4 threads: partials. */
  da_append ap = kt_append(&a, a.len - 1, 1);
  da_attn at = kt_attn(&a, a.len - 1, 1);
  da_batch one = {.appends = &ap, .n_appends = 1, .attns = &at, .n_attns = 1,
                  .split_mode = DA_SPLIT_AUTO};
  da_batch_result res;
  ck_assert_int_eq(da_backend_run(be, &one, &res), 0);
  ck_assert_int_eq(res.partial_rows, f.m.n_q_heads);
  ck_assert_int_eq(res.inrow_rows, 0);
  kt_forward(be, &b, b.len - 1, 1, DA_SPLIT_INROW, f.seed);
  kt_assert_same_bits(&a, &b, f.seed, "auto (partial) vs in-row decode");
  /* A whole prefill gives plenty of work items: in-row. */
  kt_seq_poison_out(&a);
  da_attn all = kt_attn(&a, 0, a.len);
  da_batch big = {.attns = &all, .n_attns = 1, .split_mode = DA_SPLIT_AUTO};
  ck_assert_int_eq(da_backend_run(be, &big, &res), 0);
  ck_assert_int_eq(res.inrow_rows, (int64_t)a.len * f.m.n_q_heads);
  ck_assert_int_eq(res.partial_rows, 0);
  kt_assert_same_bits(&a, &b, f.seed, "auto (in-row) prefill vs token by token");
  kt_seq_free(&a);
  kt_seq_free(&b);
  da_backend_close(be);
}
END_TEST

START_TEST(fork_by_page_copy_gives_same_bits_as_fresh_sequence) {
  fixture f;
  fx_init(&f, _i, 7000);
  da_backend *be = fx_open(&f, 2, 0);
  const int prefix = 5 * f.c->ptok + 3, len = prefix + 60;
  /* fresh: the child's tokens from scratch. */
  kt_seq fresh, parent, child;
  kt_seq_make(&fresh, &f.m, &f.r, 1, len, f.c->ptok, f.used, POOL, 1.5);
  kt_seq_clone(&parent, &fresh, &f.r, f.c->ptok, f.used, POOL);
  /* The parent continues with tokens of its own after the prefix. */
  const size_t krow = (size_t)f.m.n_kv_heads * f.m.head_dim;
  da_rng_fill(&f.r, f.m.dtype, parent.k + prefix * krow, (size_t)(len - prefix) * krow, 1.0);
  da_rng_fill(&f.r, f.m.dtype, parent.v + prefix * krow, (size_t)(len - prefix) * krow, 1.0);
  kt_forward(be, &parent, 0, prefix, DA_SPLIT_AUTO, f.seed);
  /* The child shares the full pages of the prefix and gets a copy of the partial page. */
  kt_seq_clone(&child, &fresh, &f.r, f.c->ptok, f.used, POOL);
  const int shared = prefix / f.c->ptok;
  for (int i = 0; i < shared; i++) child.pages[i] = parent.pages[i];
  da_page_copy cp = {.src = parent.pages[shared], .dst = child.pages[shared]};
  da_batch b = {.copies = &cp, .n_copies = 1};
  kt_run(be, &b, f.seed);
  kt_forward(be, &parent, prefix, len - prefix, DA_SPLIT_AUTO, f.seed);
  kt_forward(be, &child, prefix, len - prefix, DA_SPLIT_PARTIAL, f.seed);
  kt_forward(be, &fresh, 0, len, DA_SPLIT_INROW, f.seed);
  const size_t orow = (size_t)f.m.n_q_heads * f.m.head_dim;
  ptrdiff_t d = da_test_first_diff(child.o + prefix * orow, fresh.o + prefix * orow,
                                   (size_t)(len - prefix) * orow * 2);
  ck_assert_msg(d < 0, "seed %llu: forked child differs from fresh at byte %td",
                (unsigned long long)f.seed, d);
  d = da_test_first_diff(child.o + prefix * orow, parent.o + prefix * orow,
                         (size_t)(len - prefix) * orow * 2);
  ck_assert_msg(d >= 0, "seed %llu: parent's own continuation leaked into the child",
                (unsigned long long)f.seed);
  kt_seq_free(&fresh);
  kt_seq_free(&parent);
  kt_seq_free(&child);
  da_backend_close(be);
}
END_TEST

START_TEST(truncate_and_reappend_gives_same_bits) {
  fixture f;
  fx_init(&f, _i, 8000);
  da_backend *be = fx_open(&f, 2, 0);
  kt_seq a, b;
  kt_seq_make(&a, &f.m, &f.r, 0, 250, f.c->ptok, f.used, POOL, 1.5);
  kt_seq_clone(&b, &a, &f.r, f.c->ptok, f.used, POOL);
  kt_forward(be, &a, 0, a.len, DA_SPLIT_AUTO, f.seed);
  /* b first appends rejected draft tokens at [170, 250), then rolls back to 170. */
  const int keep = 170;
  const size_t krow = (size_t)f.m.n_kv_heads * f.m.head_dim;
  uint16_t *dk = da_test_random_tensor(&f.r, f.m.dtype, (size_t)(b.len - keep) * krow, 1.0);
  uint16_t *dv = da_test_random_tensor(&f.r, f.m.dtype, (size_t)(b.len - keep) * krow, 1.0);
  kt_forward(be, &b, 0, keep, DA_SPLIT_AUTO, f.seed);
  da_append draft = kt_append(&b, keep, b.len - keep);
  draft.k = dk;
  draft.v = dv;
  da_batch db = {.appends = &draft, .n_appends = 1};
  kt_run(be, &db, f.seed);
  kt_forward(be, &b, keep, b.len - keep, DA_SPLIT_AUTO, f.seed);
  kt_assert_same_bits(&a, &b, f.seed, "truncated and re-appended vs straight");
  free(dk);
  free(dv);
  kt_seq_free(&a);
  kt_seq_free(&b);
  da_backend_close(be);
}
END_TEST

int main(void) {
  Suite *s = suite_create("kernels_invariance");
  TCase *tc = tcase_create("cpu");
  tcase_set_timeout(tc, 60);
  tcase_add_loop_test(tc, row_alone_equals_row_in_random_batches, 0, N_CASES);
  tcase_add_loop_test(tc, one_shot_chunked_and_token_by_token_give_same_bits, 0, N_CASES);
  tcase_add_loop_test(tc, inrow_partial_and_auto_give_same_bits, 0, N_CASES);
  tcase_add_loop_test(tc, thread_count_does_not_change_bits, 0, N_CASES);
  tcase_add_loop_test(tc, page_size_does_not_change_bits, 0, N_CASES);
  tcase_add_loop_test(tc, partial_falls_back_to_inrow_when_slots_run_short, 0, N_CASES);
  tcase_add_loop_test(tc, auto_runs_long_decode_as_partials_and_big_batches_in_row, 0, N_CASES);
  tcase_add_loop_test(tc, fork_by_page_copy_gives_same_bits_as_fresh_sequence, 0, N_CASES);
  tcase_add_loop_test(tc, truncate_and_reappend_gives_same_bits, 0, N_CASES);
  suite_add_tcase(s, tc);
  return da_test_run(s);
}
