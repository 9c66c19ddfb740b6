/*
 * fault.c — allocation fault injection for the test build (-DDETATTN_FAULT_INJECT=ON), in
 * the style of SQLite's: the N-th allocation the daemon's own code makes fails, once.
 *
 * In that build detattnd is linked with -Wl,--wrap for malloc, calloc, realloc,
 * posix_memalign, aligned_alloc, nng_msg_alloc and nng_aio_alloc, so every such call in
 * detattnd's objects (config, wire and its protobuf-c allocator, transport, planes,
 * scheduler, worker, KV cache, CPU backend) comes through here; libraries' internal
 * allocations do not. Environment:
 *   DA_FAULT_AT=N      fail the N-th counted allocation (1-based), then none
 *   DA_FAULT_FROM=start|ready   count from main() (default) or from "listening on"
 * When the fault fires, "detattnd: fault: allocation N failed (injected)" goes to stderr.
 * tests/daemon/test_fault.c loops N over the daemon's start and over a client workload.
 */
#include "fault.h"

#ifdef DETATTN_FAULT_INJECT
#include <execinfo.h>
#include <nng/nng.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static atomic_long countdown; /* allocations left before the failing one; <= 0: none */
static atomic_int armed;
static long fail_at;

static int fail_now(void) {
  if (!atomic_load_explicit(&armed, memory_order_relaxed)) return 0;
  if (atomic_fetch_sub_explicit(&countdown, 1, memory_order_relaxed) != 1) return 0;
  char line[96];
  int n = snprintf(line, sizeof line, "detattnd: fault: allocation %ld failed (injected)\n", fail_at);
  if (n > 0) {
    ssize_t w = write(2, line, (size_t)n); /* no allocation, no lock */
    (void)w;
  }
  if (getenv("DA_FAULT_BACKTRACE")) { /* where it failed, for addr2line */
    void *pcs[16];
    backtrace_symbols_fd(pcs, backtrace(pcs, 16), 2);
  }
  return 1;
}

void da_fault_init(void) {
  const char *at = getenv("DA_FAULT_AT"), *from = getenv("DA_FAULT_FROM");
  if (at == NULL || (fail_at = strtol(at, NULL, 10)) <= 0) return;
  void *pc;
  backtrace(&pc, 1); /* loads the unwinder now, not inside a failing allocation */
  atomic_store(&countdown, fail_at);
  if (from == NULL || strcmp(from, "ready") != 0) atomic_store(&armed, 1);
}

void da_fault_ready(void) {
  if (fail_at > 0) atomic_store(&armed, 1);
}

void *__real_malloc(size_t n);
void *__real_calloc(size_t k, size_t n);
void *__real_realloc(void *p, size_t n);
int __real_posix_memalign(void **p, size_t align, size_t n);
void *__real_aligned_alloc(size_t align, size_t n);
int __real_nng_msg_alloc(nng_msg **m, size_t n);
int __real_nng_aio_alloc(nng_aio **a, void (*cb)(void *), void *arg);

void *__wrap_malloc(size_t n) { return fail_now() ? NULL : __real_malloc(n); }
void *__wrap_calloc(size_t k, size_t n) { return fail_now() ? NULL : __real_calloc(k, n); }
void *__wrap_realloc(void *p, size_t n) { return fail_now() ? NULL : __real_realloc(p, n); }
int __wrap_posix_memalign(void **p, size_t align, size_t n) {
  return fail_now() ? 12 /* ENOMEM */ : __real_posix_memalign(p, align, n);
}
void *__wrap_aligned_alloc(size_t align, size_t n) { return fail_now() ? NULL : __real_aligned_alloc(align, n); }
int __wrap_nng_msg_alloc(nng_msg **m, size_t n) { return fail_now() ? NNG_ENOMEM : __real_nng_msg_alloc(m, n); }
int __wrap_nng_aio_alloc(nng_aio **a, void (*cb)(void *), void *arg) {
  return fail_now() ? NNG_ENOMEM : __real_nng_aio_alloc(a, cb, arg);
}
#endif
