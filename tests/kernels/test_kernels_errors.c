/* The CPU backend rejects bad configurations and bad batches with INVALID_ARGUMENT and a
 * specific message, and a rejected batch changes nothing: no page copied, no K/V written,
 * no output written. */
#include <stdio.h>

#include "kt.h"

#define POOL 64
#define PT 16

typedef struct cfg_case {
  const char *name, *msg;
  void (*mutate)(da_backend_cfg *c);
} cfg_case;

static void page_tokens_12(da_backend_cfg *c) { c->page_tokens = 12; }
static void no_pages(da_backend_cfg *c) { c->n_pages = 0; }
static void tile_8(da_backend_cfg *c) { c->num.tile_tokens = 8; }
static void split_not_multiple(da_backend_cfg *c) { c->num.split_tokens = 72; }
static void head_dim_96(da_backend_cfg *c) { c->model.head_dim = 96; }
static void threads_negative(da_backend_cfg *c) { c->n_threads = -1; }
static void slots_negative(da_backend_cfg *c) { c->acc_slots = -5; }
static void heads_not_multiple(da_backend_cfg *c) { c->model.n_q_heads = 6; c->model.n_kv_heads = 4; }

static const cfg_case cfg_cases[] = {
    {"page tokens 12", "page tokens", page_tokens_12},
    {"no pages", "at least 1 page", no_pages},
    {"tile 8", "tile tokens", tile_8},
    {"split not a multiple of tile", "multiple of tile", split_not_multiple},
    {"head dim 96", "head_dim", head_dim_96},
    {"negative threads", "threads", threads_negative},
    {"negative accumulator slots", "accumulator slots", slots_negative},
    {"q heads not a multiple of kv heads", "multiple of kv heads", heads_not_multiple},
};

static da_model model(void) { return kt_model(2, 4, 2, 64, DA_BF16, 0.0f, 0); }

START_TEST(create_rejects_bad_config_with_message) {
  const cfg_case *c = &cfg_cases[_i];
  da_model m = model();
  da_backend_cfg cfg = kt_cfg(&m, 64, 16, PT, POOL, 2);
  c->mutate(&cfg);
  da_backend *be = NULL;
  char err[256] = "";
  int rv = da_backend_open(&be, "cpu", &cfg, err, sizeof(err));
  ck_assert_msg(rv == DETATTN_INVALID_ARGUMENT, "%s: got %s", c->name, detattn_status_name(rv));
  ck_assert_ptr_null(be);
  ck_assert_msg(strstr(err, c->msg) != NULL, "%s: message '%s' lacks '%s'", c->name, err, c->msg);
}
END_TEST

/* A valid batch (page copy, append overwriting the sequence's tokens, attention) that one
 * mutation makes invalid. */
typedef struct bad_batch {
  kt_seq *s;
  uint16_t *k2, *v2;
  int32_t pages[512];
  da_page_copy cp;
  da_append ap;
  da_attn at[2];
  da_batch b;
} bad_batch;

typedef struct run_case {
  const char *name, *msg;
  void (*mutate)(bad_batch *x);
} run_case;

static void append_layer_high(bad_batch *x) { x->ap.layer = 2; }
static void append_layer_negative(bad_batch *x) { x->ap.layer = -1; }
static void attn_layer_high(bad_batch *x) { x->at[1].layer = 7; }
static void page_id_outside_pool(bad_batch *x) { x->pages[1] = POOL; x->at[1].pages = x->pages; }
static void page_id_negative(bad_batch *x) { x->pages[0] = -3; x->ap.pages = x->pages; }
static void table_too_short(bad_batch *x) { x->at[1].n_pages = 1; }
static void n_q_negative(bad_batch *x) { x->at[1].n_q = -2; }
static void append_pos_negative(bad_batch *x) { x->ap.pos = -1; }
static void q_null(bad_batch *x) { x->at[1].q = NULL; }
static void o_null(bad_batch *x) { x->at[1].o = NULL; }
static void k_null(bad_batch *x) { x->ap.k = NULL; }
static void copy_outside_pool(bad_batch *x) { x->cp.dst = POOL + 1; }
static void split_mode_unknown(bad_batch *x) { x->b.split_mode = (da_split_mode)9; }
static void attns_null(bad_batch *x) { x->b.attns = NULL; }
static void too_many_tokens(bad_batch *x) {
  static int32_t big[70000 / PT + 1];
  x->at[1].q_pos = 0;
  x->at[1].n_q = 70000;
  x->at[1].pages = big;
  x->at[1].n_pages = 70000 / PT + 1;
}

static const run_case run_cases[] = {
    {"append layer past the model", "layer 2", append_layer_high},
    {"append layer negative", "layer -1", append_layer_negative},
    {"attn layer past the model", "layer 7", attn_layer_high},
    {"page id outside the pool", "outside the pool", page_id_outside_pool},
    {"page id negative", "page id -3", page_id_negative},
    {"page table too short", "does not cover", table_too_short},
    {"negative query count", "queries", n_q_negative},
    {"negative append position", "tokens", append_pos_negative},
    {"q NULL", "q or o is NULL", q_null},
    {"o NULL", "q or o is NULL", o_null},
    {"k NULL", "k or v is NULL", k_null},
    {"copy outside the pool", "copy 0", copy_outside_pool},
    {"unknown split mode", "split mode", split_mode_unknown},
    {"attns NULL", "NULL", attns_null},
    {"more tokens than the batch limit", "limit", too_many_tokens},
};

START_TEST(run_rejects_bad_batch_and_changes_nothing) {
  const run_case *c = &run_cases[_i];
  const uint64_t seed = da_test_seed(9000 + (uint64_t)_i);
  da_rng r;
  da_rng_seed(&r, seed);
  da_model m = model();
  uint8_t used[POOL] = {0};
  kt_seq s;
  kt_seq_make(&s, &m, &r, 1, 100, PT, used, POOL, 1.0);
  da_backend_cfg cfg = kt_cfg(&m, 64, 16, PT, POOL, 2);
  da_backend *be = kt_open(&cfg);
  kt_forward(be, &s, 0, s.len, DA_SPLIT_AUTO, seed);
  const size_t no = (size_t)s.len * m.n_q_heads * m.head_dim;
  uint16_t *before = malloc(no * 2);
  memcpy(before, s.o, no * 2);

  /* The bad batch: copy a page of the sequence over another of its pages, overwrite its K/V
   * with other values, attend. */
  bad_batch x = {.s = &s};
  const size_t nk = (size_t)s.len * m.n_kv_heads * m.head_dim;
  x.k2 = da_test_random_tensor(&r, m.dtype, nk, 1.0);
  x.v2 = da_test_random_tensor(&r, m.dtype, nk, 1.0);
  memcpy(x.pages, s.pages, sizeof(int32_t) * (size_t)s.n_pages);
  x.cp = (da_page_copy){.src = s.pages[0], .dst = s.pages[3]};
  x.ap = kt_append(&s, 0, s.len);
  x.ap.k = x.k2;
  x.ap.v = x.v2;
  kt_seq_poison_out(&s);
  x.at[0] = kt_attn(&s, 0, 10);
  x.at[1] = kt_attn(&s, 10, s.len - 10);
  x.b = (da_batch){.copies = &x.cp, .n_copies = 1, .appends = &x.ap, .n_appends = 1,
                   .attns = x.at, .n_attns = 2, .split_mode = DA_SPLIT_AUTO};
  c->mutate(&x);
  da_batch_result res;
  int rv = da_backend_run(be, &x.b, &res);
  ck_assert_msg(rv == DETATTN_INVALID_ARGUMENT, "%s: got %s", c->name, detattn_status_name(rv));
  ck_assert_msg(strstr(res.err, c->msg) != NULL, "%s: message '%s' lacks '%s'", c->name,
                res.err, c->msg);
  ck_assert_int_eq(res.inrow_rows + res.partial_rows, 0);
  /* No output written. */
  uint16_t *poisoned = malloc(no * 2);
  da_test_poison(m.dtype, poisoned, no);
  ck_assert_msg(da_test_first_diff(s.o, poisoned, no * 2) < 0, "%s: output written", c->name);
  /* The cache still holds the original tokens: attention gives the same bits as before. */
  da_attn at = kt_attn(&s, 0, s.len);
  da_batch ok = {.attns = &at, .n_attns = 1};
  kt_run(be, &ok, seed);
  ck_assert_msg(da_test_first_diff(s.o, before, no * 2) < 0,
                "seed %llu: %s: the rejected batch changed the cache", (unsigned long long)seed,
                c->name);
  free(poisoned);
  free(before);
  free(x.k2);
  free(x.v2);
  kt_seq_free(&s);
  da_backend_close(be);
}
END_TEST

START_TEST(info_names_backend_and_fingerprints_numerics) {
  da_model m = model();
  da_backend_cfg cfg = kt_cfg(&m, 64, 16, PT, POOL, 2);
  da_backend *be = kt_open(&cfg);
  const da_backend_info *info = da_backend_get_info(be);
  ck_assert_str_eq(info->name, "cpu");
  ck_assert_int_gt((int)strlen(info->arch), 0);
  ck_assert_int_eq(info->n_pages, POOL);
  ck_assert_uint_eq(info->kv_bytes, (size_t)2 * 2 * POOL * PT * 2 * 64 * 2);
  ck_assert_int_gt(info->acc_slots, 0);
  ck_assert_uint_eq(info->fingerprint,
                    da_fingerprint("cpu", info->kernel_version, info->arch, &m, &cfg.num));
  da_backend_cfg cfg2 = cfg;
  cfg2.num.split_tokens = 128;
  da_backend *be2 = kt_open(&cfg2);
  ck_assert_uint_ne(da_backend_get_info(be2)->fingerprint, info->fingerprint);
  da_backend_close(be2);
  da_backend_close(be);
}
END_TEST

int main(void) {
  Suite *s = suite_create("kernels_errors");
  TCase *tc = tcase_create("cpu");
  tcase_set_timeout(tc, 60);
  tcase_add_loop_test(tc, create_rejects_bad_config_with_message, 0,
                      (int)(sizeof(cfg_cases) / sizeof(cfg_cases[0])));
  tcase_add_loop_test(tc, run_rejects_bad_batch_and_changes_nothing, 0,
                      (int)(sizeof(run_cases) / sizeof(run_cases[0])));
  tcase_add_test(tc, info_names_backend_and_fingerprints_numerics);
  suite_add_tcase(s, tc);
  return da_test_run(s);
}
