/*
 * testutil.h — helpers shared by the detattn test suites (static library da_testutil).
 *
 * The Check runner every test program's main() ends with, small file, time and subprocess
 * helpers, an fp64 reference attention over plain contiguous K/V, random page tables, seeded
 * random tensors, bitwise comparison and relative error. Everything is single-threaded, allocates
 * only where it says so, and never touches a backend: tests build their batches with it and
 * run them through kernels/backend.h themselves.
 *
 * Shapes follow kernels/backend.h: k, v: [n_kv][n_kv_heads][head_dim],
 * q, o: [n_q][n_q_heads][head_dim], lse: [n_q][n_q_heads]. Tensors in a da_dtype are arrays
 * of uint16_t.
 */
#ifndef DA_TESTUTIL_H
#define DA_TESTUTIL_H

#include <stddef.h>
#include <stdint.h>

#include "da.h"

/* Check's types (<check.h> declares the same typedefs); tests include <check.h> themselves. */
typedef struct Suite Suite;
typedef struct SRunner SRunner;
typedef struct TTest TTest;

/* One tcase of a suite: its name (what CK_RUN_CASE and a ctest entry select) and its test. */
typedef struct da_test_case {
  const char *name;
  const TTest *test;
} da_test_case;
/* Adds a tcase to s for each of the n cases, each with the checked fixture setup, teardown
 * (either may be NULL) and the timeout. */
void da_test_add_cases(Suite *s, const da_test_case *cases, size_t n, void (*setup)(void), void (*teardown)(void),
                       int timeout_s);

/* Runs every test of s that Check's environment selects (CK_RUN_SUITE, CK_RUN_CASE; CK_FORK
 * and CK_VERBOSITY apply too), frees the runner and s, and returns the process exit status:
 * 0 when at least one test ran and none failed, 1 otherwise. A run that selects no test is a
 * failure (it says so on stderr), so that a ctest entry whose CK_RUN_CASE names no tcase
 * cannot pass. */
int da_test_run(Suite *s);
/* The same for a runner holding several suites (srunner_add_suite); frees sr. */
int da_test_run_runner(SRunner *sr);
/* Writes text to the file at path (created or truncated); a Check assertion fails the
 * test if the file cannot be opened. */
void da_test_write_file(const char *path, const char *text);

/* Sleeps ms milliseconds (nanosleep; a signal may cut it short). */
void da_test_sleep_ms(int ms);

/* Runs cmd with /bin/sh (popen) and reads all it writes to stdout into out (at most cap - 1
 * bytes kept, always NUL-terminated, the rest read and dropped so the command never blocks).
 * Returns its wait status (WIFEXITED, WEXITSTATUS), or -1 if it could not be started. */
int da_test_capture(const char *cmd, char *out, size_t cap);

/* The seed for a test: the environment variable DETATTN_TEST_SEED (decimal or 0x hex) if it
 * is set, else deflt. Print it in every failure message so a failure can be replayed. */
uint64_t da_test_seed(uint64_t deflt);

/* Reference causal attention in fp64 for n_q queries at absolute positions
 * [q_pos, q_pos + n_q), against keys at positions [0, n_kv) stored contiguously
 * (k, v: [n_kv][n_kv_heads][head_dim], m->dtype). Query at p sees keys [w0, p],
 * w0 = 0 or max(0, p - window + 1); q head h reads kv head h / (n_q_heads / n_kv_heads).
 * Score = scale * (q . k) in fp64; with softcap > 0, score = softcap * tanh(score / softcap).
 * Writes o: [n_q][n_q_heads][head_dim] and, when lse != NULL, lse: [n_q][n_q_heads]
 * (natural log). Returns DETATTN_INVALID_ARGUMENT if q_pos + n_q > n_kv or the model is
 * malformed, else 0. */
int da_test_ref_attention(const da_model *m, const void *k, const void *v, int n_kv,
                          const void *q, int q_pos, int n_q, double *o, double *lse);

/* Fills pages[0, n) with distinct page ids drawn uniformly from [0, pool_pages) (a prefix of
 * a random permutation), so that tests catch indexing bugs that identity tables hide.
 * Requires n <= pool_pages. */
void da_test_random_pages(da_rng *r, int32_t *pages, int n, int pool_pages);

/* Like da_test_random_pages, but draws only ids whose used[] entry is zero and marks them
 * used; for several sequences sharing one pool. Returns 0, or DETATTN_RESOURCE_EXHAUSTED
 * (nothing drawn or marked) if fewer than n ids are free. used: [pool_pages]. */
int da_test_random_pages_from(da_rng *r, int32_t *pages, int n, uint8_t *used, int pool_pages);

/* malloc()s n elements of dtype t filled with N(0, stddev^2) values. Caller frees.
 * Returns NULL when out of memory. */
void *da_test_random_tensor(da_rng *r, da_dtype t, size_t n, double stddev);

/* The first byte offset where a and b differ, or -1 when the nbytes are identical. */
ptrdiff_t da_test_first_diff(const void *a, const void *b, size_t nbytes);

/* ||x - ref||_2 / ||ref||_2 over n elements; x in dtype t (da_test_rel_err) or fp32
 * (da_test_rel_err_f32). Returns +inf if x holds a NaN or infinity. */
double da_test_rel_err(da_dtype t, const void *x, const double *ref, size_t n);
double da_test_rel_err_f32(const float *x, const double *ref, size_t n);
/* max |x - ref| over n fp32 elements; +inf if x holds a NaN or infinity. */
double da_test_max_abs_err_f32(const float *x, const double *ref, size_t n);

/* Fills n elements of dtype t (da_test_poison) or fp32 (da_test_poison_f32) with NaN. */
void da_test_poison(da_dtype t, void *dst, size_t n);
void da_test_poison_f32(float *dst, size_t n);

#endif /* DA_TESTUTIL_H */
