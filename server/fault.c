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
 *   DA_FAULT_CUDA_AT=N (CUDA builds) fail the N-th counted CUDA runtime call instead:
 *                      cudaMalloc, cudaMallocHost, cudaHostAlloc (cudaErrorMemoryAllocation),
 *                      cudaStreamCreateWithFlags, cudaEventCreateWithFlags, cudaMemcpyAsync,
 *                      cudaMemsetAsync and kernel launches (cudaErrorLaunchOutOfResources,
 *                      not sticky; a launch that "fails" is skipped and its error is what
 *                      the next cudaGetLastError on that thread returns)
 *   DA_FAULT_CONNECT_DELAY_MS=N  libnng's thread that reports a new connection (ADD_POST)
 *                      waits N ms first, as a preempted thread would: the connection's
 *                      requests, its close and its removal (REM_POST) come before it
 * When the fault fires, "detattnd: fault: allocation N failed (injected)" goes to stderr.
 * tests/daemon/test_fault.c loops N over the daemon's start and over a client workload;
 * tests/daemon/test_conn_race.c uses the connect delay.
 */
#include "fault.h"

#ifdef DETATTN_FAULT_INJECT
#include <errno.h>
#include <execinfo.h>
#include <nng/nng.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static long connect_delay_ms;
static atomic_long countdown, cuda_countdown; /* calls left before the failing one; <= 0: none */
static atomic_int armed;
static long fail_at, cuda_fail_at;

static int fire(atomic_long *left, long at, const char *what) {
  if (!atomic_load_explicit(&armed, memory_order_relaxed)) return 0;
  if (atomic_fetch_sub_explicit(left, 1, memory_order_relaxed) != 1) return 0;
  char line[96];
  int n = snprintf(line, sizeof line, "detattnd: fault: %s %ld failed (injected)\n", what, at);
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

static int fail_now(void) { return fire(&countdown, fail_at, "allocation"); }

void da_fault_init(void) {
  const char *at = getenv("DA_FAULT_AT"), *cat = getenv("DA_FAULT_CUDA_AT"), *from = getenv("DA_FAULT_FROM");
  const char *delay = getenv("DA_FAULT_CONNECT_DELAY_MS");
  if (delay != NULL) connect_delay_ms = strtol(delay, NULL, 10);
  if (cat != NULL && (cuda_fail_at = strtol(cat, NULL, 10)) > 0) {
    atomic_store(&cuda_countdown, cuda_fail_at);
    if (at == NULL) at = "0";
  }
  if (at == NULL) return;
  fail_at = strtol(at, NULL, 10);
  if (fail_at <= 0 && cuda_fail_at <= 0) return;
  void *pc;
  backtrace(&pc, 1); /* loads the unwinder now, not inside a failing allocation */
  atomic_store(&countdown, fail_at > 0 ? fail_at : 0);
  if (from == NULL || strcmp(from, "ready") != 0) atomic_store(&armed, 1);
}

void da_fault_ready(void) {
  if (fail_at > 0 || cuda_fail_at > 0) atomic_store(&armed, 1);
}

void da_fault_connect_delay(void) {
  if (connect_delay_ms <= 0) return;
  struct timespec ts = {.tv_sec = connect_delay_ms / 1000, .tv_nsec = (connect_delay_ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
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

#ifdef DETATTN_HAVE_CUDA
#include <cuda_runtime_api.h>

static int cuda_now(void) { return fire(&cuda_countdown, cuda_fail_at, "CUDA call"); }
static _Thread_local cudaError_t pending; /* a skipped launch's error, for cudaGetLastError */

cudaError_t __real_cudaMalloc(void **p, size_t n);
cudaError_t __real_cudaMallocHost(void **p, size_t n);
cudaError_t __real_cudaHostAlloc(void **p, size_t n, unsigned flags);
cudaError_t __real_cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t __real_cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t __real_cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind k, cudaStream_t st);
cudaError_t __real_cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t st);
cudaError_t __real_cudaLaunchKernel(const void *f, dim3 g, dim3 b, void **args, size_t smem, cudaStream_t st);
cudaError_t __real_cudaGetLastError(void);

cudaError_t __wrap_cudaMalloc(void **p, size_t n) { return cuda_now() ? cudaErrorMemoryAllocation : __real_cudaMalloc(p, n); }
cudaError_t __wrap_cudaMallocHost(void **p, size_t n) {
  return cuda_now() ? cudaErrorMemoryAllocation : __real_cudaMallocHost(p, n);
}
cudaError_t __wrap_cudaHostAlloc(void **p, size_t n, unsigned flags) {
  return cuda_now() ? cudaErrorMemoryAllocation : __real_cudaHostAlloc(p, n, flags);
}
cudaError_t __wrap_cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) {
  return cuda_now() ? cudaErrorLaunchOutOfResources : __real_cudaStreamCreateWithFlags(s, flags);
}
cudaError_t __wrap_cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
  return cuda_now() ? cudaErrorLaunchOutOfResources : __real_cudaEventCreateWithFlags(e, flags);
}
cudaError_t __wrap_cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind k, cudaStream_t st) {
  return cuda_now() ? cudaErrorLaunchOutOfResources : __real_cudaMemcpyAsync(d, s, n, k, st);
}
cudaError_t __wrap_cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t st) {
  return cuda_now() ? cudaErrorLaunchOutOfResources : __real_cudaMemsetAsync(d, v, n, st);
}
cudaError_t __wrap_cudaLaunchKernel(const void *f, dim3 g, dim3 b, void **args, size_t smem, cudaStream_t st) {
  if (cuda_now()) {
    pending = cudaErrorLaunchOutOfResources;
    return pending;
  }
  return __real_cudaLaunchKernel(f, g, b, args, smem, st);
}
cudaError_t __wrap_cudaGetLastError(void) {
  cudaError_t e = pending;
  pending = cudaSuccess;
  cudaError_t r = __real_cudaGetLastError();
  return e != cudaSuccess ? e : r;
}
#endif
#endif
