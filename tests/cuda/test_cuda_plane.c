/*
 * test_cuda_plane.c — the CUDA data plane against a real `detattnd --backend cuda`: this test
 * process and the daemon share one GPU by CUDA IPC. Device tensors give the bits of the copy
 * reference; the daemon waits for the client's stream before reading inputs; hostile and
 * broken clients (bad handles and references, an event that never completes, a client
 * SIGKILLed mid-call, a buffer freed mid-call) get clear statuses and leave nothing behind.
 *
 * CK_FORK=no (CUDA does not survive fork): killed and freeing clients are fresh processes,
 * this binary re-executed as `test_cuda_plane victim-kill|victim-free URL FD`.
 * Exits 77 (skipped) without a usable device.
 */
#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime.h>

#include "daemon_proc.h"
#include "detattn.h"
#include "raw_client.h"
#include "testutil.h"
#include "verify.h"

/* Model: 2 layers, 4 q / 2 kv heads, d 128, bf16, S 128. */
#define HQ 4
#define HKV 2
#define HD 128
#define QROW ((uint64_t)HQ * HD * 2)
#define KVROW ((uint64_t)HKV * HD * 2)
#define LROW ((uint64_t)HQ * 4)
#define EVENT_TIMEOUT_MS 600

static da_daemon_proc D;
static uint64_t seed;
static const char *self_path;

#define CU(x)                                                                                \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    ck_assert_msg(e_ == cudaSuccess, "%s: %s", #x, cudaGetErrorString(e_));                  \
  } while (0)

static const char *const daemon_args[] = {
    "--backend", "cuda", "--layers", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "128", "--dtype", "bf16",
    "--kv-tokens", "32768", "--split-tokens", "128", "--max-conn-per-peer", "1000",
    "--cuda-event-timeout-ms", "600", NULL};

static void setup(void) {
  seed = da_test_seed(0xc0dac0daull);
  if (da_daemon_start(&D, DETATTND_PATH, daemon_args) != 0) ck_abort_msg("detattnd --backend cuda did not start");
}

static void teardown(void) {
  da_daemon_dump_log(&D); /* GPU runs are few: every run's log is worth reading */
  da_daemon_stop(&D);
}

static detattn_client *connect_plane(detattn_data_plane p) {
  detattn_connect_opts o;
  detattn_connect_opts_init(&o);
  o.data_plane = p;
  o.arena_bytes = 16u << 20;
  o.timeout_ms = 20000;
  detattn_client *c;
  ck_assert_int_eq(detattn_connect_ex(&c, D.url, &o), DETATTN_OK);
  detattn_server_info info;
  int st = detattn_hello(c, &info);
  ck_assert_msg(st == DETATTN_OK, "hello: %s: %s", detattn_status_name(st), detattn_errmsg());
  ck_assert_msg(info.data_planes & (1u << DETATTN_PLANE_CUDA), "the CUDA daemon does not offer the cuda plane");
  return c;
}

static detattn_stats stats_of(detattn_client *c) {
  detattn_stats s;
  ck_assert_int_eq(detattn_stats_get(c, &s), DETATTN_OK);
  return s;
}

/* Waits (bounded) until the daemon maps no region and holds no sequence. */
static void expect_released(detattn_client *c, const char *what) {
  detattn_stats s = stats_of(c);
  for (int i = 0; i < 100 && (s.arenas > 0 || s.sequences > 0); i++) {
    usleep(50000);
    s = stats_of(c);
  }
  ck_assert_msg(s.arenas == 0 && s.sequences == 0, "%s: %u regions and %u sequences still held", what, s.arenas,
                s.sequences);
}

static void first_diff(const char *what, const void *a, const void *b, size_t n) {
  const uint8_t *x = a, *y = b;
  for (size_t i = 0; i < n; i++)
    if (x[i] != y[i]) ck_abort_msg("%s differs first at byte %zu of %zu (%02x vs %02x)", what, i, n, x[i], y[i]);
}

/* ---- same bits ---- */

START_TEST(verify_over_cuda_matches_the_copy_pass_bitwise) {
  da_verify_cfg cfg = {.url = D.url, .seed = seed, .seqs = 24, .clients = 6, .layers_used = 2, .max_prompt = 300,
                       .decode_steps = 6, .check_ref = 1, .data_plane = DETATTN_PLANE_CUDA, .data_plane_set = 1};
  da_verify_cfg_defaults(&cfg);
  da_verify *v;
  da_verify_result res;
  char msg[512];
  ck_assert_msg(da_verify_alloc(&v, &cfg, msg, sizeof msg) == DETATTN_OK, "%s", msg);
  int st = da_verify_run(v, &res, msg, sizeof msg);
  ck_assert_msg(st == DETATTN_OK, "verify: %s: %s", detattn_status_name(st), msg);
  printf("verify over cuda: %llu rows compared, %llu differ, plane %d, max rel err %.2e\n",
         (unsigned long long)res.outputs_compared, (unsigned long long)res.mismatches, res.data_plane_used,
         res.max_rel_err);
  ck_assert_int_eq(res.data_plane_used, DETATTN_PLANE_CUDA);
  ck_assert_uint_gt(res.outputs_compared, 1000);
  ck_assert_msg(res.mismatches == 0, "%llu rows differ; first %s", (unsigned long long)res.mismatches,
                res.first_mismatch);
  da_verify_free(v);
}
END_TEST

static void sleep_host(void *ms) { usleep((useconds_t)(uintptr_t)ms * 1000u); }

START_TEST(device_tensors_give_the_bits_of_host_tensors_and_follow_the_stream) {
  const int n = 150; /* prefill 150 tokens, then 4 decode steps */
  const int total = n + 4;
  da_rng r;
  da_rng_seed(&r, seed);
  uint16_t *q = malloc(total * QROW), *k = malloc(total * KVROW), *v = malloc(total * KVROW);
  uint16_t *o_copy = malloc(total * QROW), *o_dev = malloc(total * QROW);
  float *l_copy = malloc(total * LROW), *l_dev = malloc(total * LROW);
  da_rng_fill(&r, DA_BF16, q, total * QROW / 2, 1.0);
  da_rng_fill(&r, DA_BF16, k, total * KVROW / 2, 1.0);
  da_rng_fill(&r, DA_BF16, v, total * KVROW / 2, 1.0);

  /* The reference: bytes in messages. */
  detattn_client *cc = connect_plane(DETATTN_PLANE_COPY);
  uint64_t s_copy;
  ck_assert_int_eq(detattn_seq_open(cc, &s_copy), DETATTN_OK);
  for (int layer = 0; layer < 2; layer++)
    for (int pos = 0; pos < total; pos += pos < n ? n : 1) {
      int t = pos < n ? n : 1;
      detattn_seq_io io = {.seq = s_copy, .pos = (uint32_t)pos, .n_tokens = (uint32_t)t, .q = q + pos * QROW / 2,
                           .k = k + pos * KVROW / 2, .v = v + pos * KVROW / 2, .o = o_copy + pos * QROW / 2,
                           .lse = l_copy + pos * LROW / 4};
      ck_assert_int_eq(detattn_forward(cc, (uint32_t)layer, &io, 1), DETATTN_OK);
    }

  /* Device tensors, written on a stream that is still busy when each call starts: the daemon
   * must wait for the stream (its "ready" event), or it reads the poison. */
  detattn_client *c = connect_plane(DETATTN_PLANE_CUDA);
  cudaStream_t st;
  CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  uint8_t *dq, *dkv, *dout;
  CU(cudaMalloc((void **)&dq, total * QROW));
  CU(cudaMalloc((void **)&dkv, 2 * total * KVROW));
  CU(cudaMalloc((void **)&dout, total * (QROW + LROW)));
  CU(cudaMemset(dq, 0xff, total * QROW)); /* NaN poison */
  CU(cudaMemset(dkv, 0xff, 2 * total * KVROW));
  CU(cudaDeviceSynchronize());
  uint64_t seq;
  ck_assert_int_eq(detattn_seq_open(c, &seq), DETATTN_OK);
  for (int layer = 0; layer < 2; layer++)
    for (int pos = 0; pos < total; pos += pos < n ? n : 1) {
      int t = pos < n ? n : 1;
      CU(cudaLaunchHostFunc(st, sleep_host, (void *)(uintptr_t)30));
      CU(cudaMemcpyAsync(dq + pos * QROW, q + pos * QROW / 2, t * QROW, cudaMemcpyHostToDevice, st));
      CU(cudaMemcpyAsync(dkv + pos * KVROW, k + pos * KVROW / 2, t * KVROW, cudaMemcpyHostToDevice, st));
      CU(cudaMemcpyAsync(dkv + (total + pos) * KVROW, v + pos * KVROW / 2, t * KVROW, cudaMemcpyHostToDevice, st));
      detattn_seq_io io = {.seq = seq, .pos = (uint32_t)pos, .n_tokens = (uint32_t)t, .q = dq + pos * QROW,
                           .k = dkv + pos * KVROW, .v = dkv + (total + pos) * KVROW, .o = dout + pos * QROW,
                           .lse = (float *)(dout + total * QROW + pos * LROW)};
      detattn_call *call;
      int rc = detattn_forward_cuda_start(c, (uint32_t)layer, &io, 1, st, &call);
      ck_assert_msg(rc == DETATTN_OK, "forward_cuda_start: %s: %s", detattn_status_name(rc), detattn_errmsg());
      rc = detattn_call_wait(call);
      ck_assert_msg(rc == DETATTN_OK, "forward_cuda: %s: %s", detattn_status_name(rc), detattn_errmsg());
      /* Ordered after the outputs on the stream: read them back as the caller would. */
      CU(cudaMemcpyAsync(o_dev + pos * QROW / 2, dout + pos * QROW, t * QROW, cudaMemcpyDeviceToHost, st));
      CU(cudaMemcpyAsync(l_dev + pos * LROW / 4, dout + total * QROW + pos * LROW, t * LROW, cudaMemcpyDeviceToHost,
                         st));
    }
  CU(cudaStreamSynchronize(st));
  /* Only the last layer's outputs are kept in both runs (each layer overwrote them). */
  first_diff("o (cuda vs copy)", o_dev, o_copy, total * QROW);
  first_diff("lse (cuda vs copy)", l_dev, l_copy, total * LROW);
  detattn_stats s = stats_of(c);
  ck_assert_uint_ge(s.arenas, 3); /* three allocations registered (and the shm arena) */
  detattn_close(c);
  detattn_close(cc);
  expect_released(connect_plane(DETATTN_PLANE_COPY), "after close");
  CU(cudaFree(dq));
  CU(cudaFree(dkv));
  CU(cudaFree(dout));
  CU(cudaStreamDestroy(st));
  free(q), free(k), free(v), free(o_copy), free(o_dev), free(l_copy), free(l_dev);
}
END_TEST

/* ---- hostile and broken clients ---- */

static uint32_t raw_register_cuda(da_raw *r, int event, const void *h, size_t len, uint64_t size, int want,
                                  const char *what) {
  Detattn__V1__Request rq = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__RegisterCuda rc = DETATTN__V1__REGISTER_CUDA__INIT;
  Detattn__V1__Response *resp;
  char msg[300];
  rc.handle = (ProtobufCBinaryData){len, (uint8_t *)(uintptr_t)h};
  rc.size = size;
  rc.event = event;
  rq.op_case = DETATTN__V1__REQUEST__OP_REGISTER_CUDA;
  rq.register_cuda = &rc;
  int got = da_raw_call(r, &rq, msg, sizeof msg, &resp);
  printf("%-40s %s %s\n", what, detattn_status_name(got), msg);
  da_raw_expect(got, msg, want, what);
  uint32_t id = got == 0 ? resp->register_cuda->id : 0;
  detattn__v1__response__free_unpacked(resp, NULL);
  return id;
}

static void raw_forward(da_raw *r, da_raw_fwd *x, int want, const char *what) {
  char msg[300];
  int got = da_raw_call(r, &x->rq, msg, sizeof msg, NULL);
  printf("%-40s %s %s\n", what, detattn_status_name(got), msg);
  da_raw_expect(got, msg, want, what);
}

START_TEST(bad_handles_references_and_events_get_their_codes_and_write_nothing) {
  const size_t size = 1 << 20;
  uint8_t *buf;
  CU(cudaMalloc((void **)&buf, size));
  CU(cudaMemset(buf, 0, size));
  cudaIpcMemHandle_t mh;
  CU(cudaIpcGetMemHandle(&mh, buf));
  cudaEvent_t ev;
  CU(cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming));
  cudaIpcEventHandle_t eh;
  CU(cudaIpcGetEventHandle(&eh, ev));

  da_raw r, other;
  da_raw_open(&r, D.url);
  da_raw_open(&other, D.url);
  uint8_t junk[64];
  for (int i = 0; i < 64; i++) junk[i] = (uint8_t)(i * 37 + 11);
  raw_register_cuda(&r, 0, junk, sizeof junk, size, DETATTN_INVALID_ARGUMENT, "a made-up memory handle");
  raw_register_cuda(&r, 0, &mh, 10, size, DETATTN_INVALID_ARGUMENT, "a short memory handle");
  raw_register_cuda(&r, 0, &mh, sizeof mh, 64u << 20, DETATTN_INVALID_ARGUMENT, "a size past the allocation");
  raw_register_cuda(&r, 1, junk, sizeof junk, 0, DETATTN_INVALID_ARGUMENT, "a made-up event handle");
  uint32_t id = raw_register_cuda(&r, 0, &mh, sizeof mh, size, DETATTN_OK, "a good memory handle");
  uint32_t eid = raw_register_cuda(&r, 1, &eh, sizeof eh, 0, DETATTN_OK, "a good event handle");
  /* The same allocation on a second connection of this process: opened again (refcounted). */
  uint32_t id2 = raw_register_cuda(&other, 0, &mh, sizeof mh, size, DETATTN_OK, "the same handle, 2nd connection");
  ck_assert_uint_ne(id, id2);

  uint64_t seq = da_raw_seq_open(&r);
  da_raw_fwd x;
  da_raw_fwd_init(&x, seq, id, 4, 0, QROW, KVROW, LROW);
  x.ref[0].offset = size - 64;
  raw_forward(&r, &x, DETATTN_INVALID_ARGUMENT, "q past the buffer's end");
  da_raw_fwd_init(&x, seq, id, 4, 2, QROW, KVROW, LROW);
  x.ref[0].offset = 1;
  raw_forward(&r, &x, DETATTN_INVALID_ARGUMENT, "misaligned q");
  da_raw_fwd_init(&x, seq, eid, 4, 0, QROW, KVROW, LROW);
  raw_forward(&r, &x, DETATTN_NOT_FOUND, "an event named as a tensor");
  da_raw_fwd_init(&x, seq, id, 4, 0, QROW, KVROW, LROW);
  x.ref[3].arena = 0; /* o in the reply, q by device reference: the device cannot write it */
  x.fs.o_ref = NULL;
  raw_forward(&r, &x, DETATTN_INVALID_ARGUMENT, "q on the device, o in the reply");
  da_raw_fwd_init(&x, seq, id2, 4, 0, QROW, KVROW, LROW);
  raw_forward(&r, &x, DETATTN_NOT_FOUND, "another connection's buffer");
  da_raw_fwd_init(&x, seq, id, 4, 0, QROW, KVROW, LROW);
  x.f.wait_event = id;
  raw_forward(&r, &x, DETATTN_NOT_FOUND, "a buffer named as the wait event");
  /* Nothing was appended: the good Forward at pos 0, waiting on a recorded event and asking
   * for a second one to be recorded once its outputs are written. */
  cudaEvent_t done;
  CU(cudaEventCreateWithFlags(&done, cudaEventInterprocess | cudaEventDisableTiming));
  cudaIpcEventHandle_t dh;
  CU(cudaIpcGetEventHandle(&dh, done));
  uint32_t did = raw_register_cuda(&r, 1, &dh, sizeof dh, 0, DETATTN_OK, "a second event handle");
  cudaStream_t blocked;
  CU(cudaStreamCreateWithFlags(&blocked, cudaStreamNonBlocking));
  CU(cudaLaunchHostFunc(blocked, sleep_host, (void *)(uintptr_t)2000));
  CU(cudaEventRecord(done, blocked)); /* pending for 2 s unless the daemon records it later */
  CU(cudaEventRecord(ev, 0));
  x.f.wait_event = eid;
  x.f.signal_event = did;
  raw_forward(&r, &x, DETATTN_OK, "the good forward");
  cudaError_t q = cudaEventQuery(done);
  ck_assert_msg(q == cudaSuccess, "signal_event not recorded by the daemon: %s", cudaGetErrorString(q));
  CU(cudaStreamSynchronize(blocked));
  CU(cudaStreamDestroy(blocked));
  CU(cudaEventDestroy(done));

  da_raw_close(&r);
  da_raw_close(&other);
  detattn_client *c = connect_plane(DETATTN_PLANE_COPY);
  expect_released(c, "after the raw connections closed");
  detattn_close(c);
  CU(cudaEventDestroy(ev));
  CU(cudaFree(buf));
}
END_TEST

START_TEST(an_event_that_does_not_complete_is_answered_deadline_exceeded) {
  detattn_client *c = connect_plane(DETATTN_PLANE_CUDA);
  cudaStream_t st;
  CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  uint8_t *d;
  CU(cudaMalloc((void **)&d, 8 * (2 * QROW + 2 * KVROW)));
  CU(cudaMemset(d, 0, 8 * (2 * QROW + 2 * KVROW)));
  CU(cudaDeviceSynchronize());
  uint64_t seq;
  ck_assert_int_eq(detattn_seq_open(c, &seq), DETATTN_OK);
  detattn_seq_io io = {.seq = seq, .pos = 0, .n_tokens = 8, .q = d, .k = d + 8 * QROW, .v = d + 8 * (QROW + KVROW),
                       .o = d + 8 * (QROW + 2 * KVROW)};
  CU(cudaLaunchHostFunc(st, sleep_host, (void *)(uintptr_t)(3 * EVENT_TIMEOUT_MS)));
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int rc = detattn_forward_cuda(c, 0, &io, 1, st);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-6;
  printf("blocked stream: %s after %.0f ms: %s\n", detattn_status_name(rc), ms, detattn_errmsg());
  ck_assert_int_eq(rc, DETATTN_DEADLINE_EXCEEDED);
  ck_assert_msg(strstr(detattn_errmsg(), "cuda-event-timeout-ms") != NULL, "message: %s", detattn_errmsg());
  ck_assert_msg(ms >= EVENT_TIMEOUT_MS * 0.9 && ms < EVENT_TIMEOUT_MS * 2.5, "answered after %.0f ms", ms);
  CU(cudaStreamSynchronize(st));
  /* Nothing was appended: the same call at pos 0 now succeeds. */
  rc = detattn_forward_cuda(c, 0, &io, 1, st);
  ck_assert_msg(rc == DETATTN_OK, "after the timeout: %s: %s", detattn_status_name(rc), detattn_errmsg());
  CU(cudaStreamSynchronize(st));
  detattn_close(c);
  CU(cudaFree(d));
  CU(cudaStreamDestroy(st));
}
END_TEST

/* A victim process: registers a buffer, sends a Forward whose inputs wait behind a sleeping
 * stream, tells the parent (a byte on fd), then either sleeps to be killed ("kill") or frees
 * its buffer at once and waits for the answer ("free"; prints the status). */
static int victim(const char *mode, const char *url, int fd) {
  detattn_connect_opts o;
  detattn_connect_opts_init(&o);
  o.data_plane = DETATTN_PLANE_CUDA;
  o.timeout_ms = 20000;
  detattn_client *c;
  detattn_server_info info;
  if (detattn_connect_ex(&c, url, &o) != DETATTN_OK || detattn_hello(c, &info) != DETATTN_OK) return 2;
  uint8_t *d;
  if (cudaMalloc((void **)&d, 64 * (2 * QROW + 2 * KVROW)) != cudaSuccess) return 3;
  cudaMemset(d, 0x3c, 64 * (2 * QROW + 2 * KVROW));
  cudaDeviceSynchronize();
  cudaStream_t st;
  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  uint64_t seq;
  if (detattn_seq_open(c, &seq) != DETATTN_OK) return 4;
  detattn_seq_io io = {.seq = seq, .pos = 0, .n_tokens = 64, .q = d, .k = d + 64 * QROW,
                       .v = d + 64 * (QROW + KVROW), .o = d + 64 * (QROW + 2 * KVROW)};
  cudaLaunchHostFunc(st, sleep_host, (void *)(uintptr_t)300);
  detattn_call *call;
  if (detattn_forward_cuda_start(c, 0, &io, 1, st, &call) != DETATTN_OK) return 5;
  if (write(fd, "s", 1) != 1) return 6;
  if (strcmp(mode, "kill") == 0) {
    sleep(30);
    return 7;
  }
  cudaFree(d); /* waits for the device (the sleeping stream), then frees under the daemon */
  int rc = detattn_call_wait(call);
  printf("victim-free: the call ended %s (%s)\n", detattn_status_name(rc), detattn_errmsg());
  detattn_close(c);
  return 0;
}

static pid_t spawn_victim(const char *mode, int *rd) {
  int p[2];
  ck_assert_int_eq(pipe(p), 0);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    close(p[0]);
    char fd[16], m[32];
    snprintf(fd, sizeof fd, "%d", p[1]);
    snprintf(m, sizeof m, "victim-%s", mode);
    execl(self_path, self_path, m, D.url, fd, (char *)NULL);
    _exit(127);
  }
  close(p[1]);
  *rd = p[0];
  char b;
  ck_assert_msg(read(p[0], &b, 1) == 1, "the %s victim did not get its call sent", mode);
  return pid;
}

START_TEST(a_client_killed_or_freeing_its_buffer_mid_call_leaves_the_daemon_serving) {
  int rd;
  pid_t pid = spawn_victim("kill", &rd);
  kill(pid, SIGKILL);
  int ws;
  ck_assert_int_eq(waitpid(pid, &ws, 0), pid);
  close(rd);
  detattn_client *c = connect_plane(DETATTN_PLANE_COPY);
  expect_released(c, "after the killed client");

  pid = spawn_victim("free", &rd);
  ck_assert_int_eq(waitpid(pid, &ws, 0), pid);
  close(rd);
  ck_assert_msg(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "the freeing victim ended with status %d", ws);
  expect_released(c, "after the client that freed its buffer");
  ck_assert_msg(kill(D.pid, 0) == 0, "the daemon is gone");
  detattn_close(c);

  /* The daemon still serves device tensors. */
  c = connect_plane(DETATTN_PLANE_CUDA);
  uint8_t *d;
  CU(cudaMalloc((void **)&d, 4 * (2 * QROW + 2 * KVROW)));
  CU(cudaMemset(d, 0, 4 * (2 * QROW + 2 * KVROW)));
  CU(cudaDeviceSynchronize());
  uint64_t seq;
  ck_assert_int_eq(detattn_seq_open(c, &seq), DETATTN_OK);
  detattn_seq_io io = {.seq = seq, .pos = 0, .n_tokens = 4, .q = d, .k = d + 4 * QROW, .v = d + 4 * (QROW + KVROW),
                       .o = d + 4 * (QROW + 2 * KVROW)};
  int rc = detattn_forward_cuda(c, 1, &io, 1, NULL);
  ck_assert_msg(rc == DETATTN_OK, "after the victims: %s: %s", detattn_status_name(rc), detattn_errmsg());
  detattn_close(c);
  CU(cudaFree(d));
}
END_TEST

static Suite *cuda_plane_suite(void) {
  Suite *s = suite_create("cuda_plane");
  TCase *t = tcase_create("cuda_plane");
  tcase_add_checked_fixture(t, setup, teardown);
  tcase_set_timeout(t, 120);
  tcase_add_test(t, verify_over_cuda_matches_the_copy_pass_bitwise);
  tcase_add_test(t, device_tensors_give_the_bits_of_host_tensors_and_follow_the_stream);
  tcase_add_test(t, bad_handles_references_and_events_get_their_codes_and_write_nothing);
  tcase_add_test(t, an_event_that_does_not_complete_is_answered_deadline_exceeded);
  tcase_add_test(t, a_client_killed_or_freeing_its_buffer_mid_call_leaves_the_daemon_serving);
  suite_add_tcase(s, t);
  return s;
}

int main(int argc, char **argv) {
  self_path = argv[0];
  if (argc == 4 && strncmp(argv[1], "victim-", 7) == 0) return victim(argv[1] + 7, argv[2], atoi(argv[3]));
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    printf("no CUDA device: skipped\n");
    return 77;
  }
  return da_test_run(cuda_plane_suite());
}
