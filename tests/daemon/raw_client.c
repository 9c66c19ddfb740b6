#include "raw_client.h"

#include <check.h>
#include <stdio.h>
#include <string.h>

#include <nng/protocol/reqrep0/req.h>

#include "client_impl.h"
#include "detattn.h"

void da_raw_open(da_raw *r, const char *url) {
  ck_assert_int_eq(nng_req0_open(&r->sock), 0);
  nng_socket_set_ms(r->sock, NNG_OPT_REQ_RESENDTIME, NNG_DURATION_INFINITE);
  nng_socket_set_ms(r->sock, NNG_OPT_RECVTIMEO, 10000);
  ck_assert_int_eq(nng_dial(r->sock, url, NULL, 0), 0);
  r->next_id = 1;
}

void da_raw_close(da_raw *r) { nng_close(r->sock); }

int da_raw_call(da_raw *r, Detattn__V1__Request *rq, char *msg, size_t len, Detattn__V1__Response **out) {
  rq->id = r->next_id++;
  size_t n = detattn__v1__request__get_packed_size(rq);
  nng_msg *m;
  ck_assert_int_eq(nng_msg_alloc(&m, n), 0);
  detattn__v1__request__pack(rq, nng_msg_body(m));
  ck_assert_int_eq(nng_sendmsg(r->sock, m, 0), 0);
  ck_assert_int_eq(nng_recvmsg(r->sock, &m, 0), 0);
  Detattn__V1__Response *resp = detattn__v1__response__unpack(NULL, nng_msg_len(m), nng_msg_body(m));
  nng_msg_free(m);
  ck_assert_ptr_nonnull(resp);
  int code = resp->status ? (int)resp->status->code : 0;
  snprintf(msg, len, "%s", resp->status && resp->status->message ? resp->status->message : "");
  if (out) *out = resp;
  else detattn__v1__response__free_unpacked(resp, NULL);
  return code;
}

void da_raw_expect(int got, const char *msg, int want, const char *what) {
  ck_assert_msg(got == want, "%s: got %s (%s), want %s", what, detattn_status_name(got), msg, detattn_status_name(want));
  ck_assert_msg(msg[0] != '\0' || want == 0, "%s: %s without a message", what, detattn_status_name(got));
}

uint64_t da_raw_seq_open(da_raw *r) {
  Detattn__V1__Request rq = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__SeqOpen so = DETATTN__V1__SEQ_OPEN__INIT;
  Detattn__V1__Response *resp;
  char msg[256];
  rq.op_case = DETATTN__V1__REQUEST__OP_SEQ_OPEN;
  rq.seq_open = &so;
  da_raw_expect(da_raw_call(r, &rq, msg, sizeof msg, &resp), msg, DETATTN_OK, "seq_open");
  uint64_t seq = resp->seq_open->seq;
  detattn__v1__response__free_unpacked(resp, NULL);
  return seq;
}

int da_raw_register(da_raw *r, uint64_t size, Detattn__V1__DoorbellRing *ring, uint32_t *id, uint64_t *token,
                    char *msg, size_t len) {
  Detattn__V1__Request rq = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__RegisterArena ra = DETATTN__V1__REGISTER_ARENA__INIT;
  Detattn__V1__Response *resp;
  ra.size = size;
  ra.doorbell = ring;
  rq.op_case = DETATTN__V1__REQUEST__OP_REGISTER_ARENA;
  rq.register_arena = &ra;
  int code = da_raw_call(r, &rq, msg, len, &resp);
  if (code == 0) {
    *id = resp->register_arena->arena;
    *token = resp->register_arena->token;
  }
  detattn__v1__response__free_unpacked(resp, NULL);
  return code;
}

void da_raw_fwd_init(da_raw_fwd *x, uint64_t seq, uint32_t region, int n, uint64_t base, uint64_t q_row,
                     uint64_t kv_row, uint64_t lse_row) {
  Detattn__V1__ForwardSeq fs = DETATTN__V1__FORWARD_SEQ__INIT;
  Detattn__V1__Forward f = DETATTN__V1__FORWARD__INIT;
  Detattn__V1__Request rq = DETATTN__V1__REQUEST__INIT;
  uint64_t len[5] = {n * q_row, n * kv_row, n * kv_row, n * q_row, n * lse_row};
  uint64_t off = base;
  for (int i = 0; i < 5; i++) {
    x->ref[i] = (Detattn__V1__TensorRef)DETATTN__V1__TENSOR_REF__INIT;
    x->ref[i].arena = region;
    x->ref[i].offset = off;
    x->ref[i].length = len[i];
    off += len[i];
  }
  x->fs = fs;
  x->fs.seq = seq;
  x->fs.n_tokens = (uint32_t)n;
  x->fs.q_ref = &x->ref[0];
  x->fs.k_ref = &x->ref[1];
  x->fs.v_ref = &x->ref[2];
  x->fs.o_ref = &x->ref[3];
  x->fs.lse_ref = &x->ref[4];
  x->fsp = &x->fs;
  x->f = f;
  x->f.n_seqs = 1;
  x->f.seqs = &x->fsp;
  x->f.want_lse = 1;
  x->rq = rq;
  x->rq.op_case = DETATTN__V1__REQUEST__OP_FORWARD;
  x->rq.forward = &x->f;
}

int da_raw_calls_in_flight(detattn_client *c, uint64_t q_row, uint64_t kv_row, void **q_out) {
  enum { N = 2000 };
  uint16_t *q = detattn_arena_alloc(c, N * q_row), *kv = detattn_arena_alloc(c, N * kv_row);
  uint16_t *out = detattn_arena_alloc(c, 4 * N * q_row);
  if (!q || !kv || !out) return 1;
  memset(q, 0x3c, N * q_row);
  memset(kv, 0x3b, N * kv_row);
  detattn_call *calls[4];
  for (int i = 0; i < 4; i++) {
    uint64_t seq;
    if (detattn_seq_open(c, &seq)) return 2;
    detattn_seq_io io = {.seq = seq, .pos = 0, .n_tokens = N, .q = q, .k = kv, .v = kv, .o = out + (size_t)i * N * q_row / 2};
    if (detattn_forward_start(c, 0, &io, 1, &calls[i])) return 3;
  }
  if (q_out) *q_out = q;
  return 0;
}

int da_raw_side_send(const char *url, uint32_t magic, const int *fds, int n_fds, uint32_t id, uint64_t token) {
  char path[128];
  snprintf(path, sizeof path, "%.90s.arena", url + 6);
  return da_side_handover(path, magic, id, token, fds, n_fds, 5000, "a test's descriptors");
}
