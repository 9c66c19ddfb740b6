/*
 * test_wire.c — the wire codec (server/wire.c): requests decode to the plain structs with
 * their tensors intact; malformed, oversized and inconsistent requests are rejected with
 * their own status and a message naming the problem; responses encode to messages that
 * protobuf-c reads back field for field.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "detattn.pb-c.h"
#include "testutil.h"
#include "wire.h"

static uint64_t seed;
static da_wire_limits lim;

static void setup(void) {
  seed = da_test_seed(0x5eed1234);
  lim = (da_wire_limits){.model = {.n_layers = 4, .n_q_heads = 4, .n_kv_heads = 2, .head_dim = 64,
                                   .dtype = DA_BF16, .scale = 0.125f},
                         .max_request_tokens = 256,
                         .max_message_bytes = 1 << 22,
                         .decode_bytes = 1 << 23};
}

/* A Forward request with n_seqs sequences of random lengths and seeded random tensors. */
typedef struct fwd_builder {
  Detattn__V1__Request req;
  Detattn__V1__Forward fwd;
  Detattn__V1__ForwardSeq seqs[16];
  Detattn__V1__ForwardSeq *ptrs[16];
  void *bufs[16][3];
} fwd_builder;

static void build_forward(fwd_builder *b, da_rng *r, int n_seqs, int max_tokens) {
  Detattn__V1__Request req = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__Forward fwd = DETATTN__V1__FORWARD__INIT;
  b->req = req;
  b->fwd = fwd;
  b->req.id = da_rng_u64(r);
  b->req.op_case = DETATTN__V1__REQUEST__OP_FORWARD;
  b->req.forward = &b->fwd;
  b->fwd.layer = (uint32_t)da_rng_range(r, 0, lim.model.n_layers - 1);
  b->fwd.want_lse = 1;
  b->fwd.n_seqs = (size_t)n_seqs;
  b->fwd.seqs = b->ptrs;
  const da_model *m = &lim.model;
  for (int i = 0; i < n_seqs; i++) {
    Detattn__V1__ForwardSeq s = DETATTN__V1__FORWARD_SEQ__INIT;
    s.seq = ((uint64_t)(i + 1) << 32) | (uint64_t)i;
    s.pos = (uint32_t)da_rng_range(r, 0, 1000);
    s.n_tokens = (uint32_t)da_rng_range(r, 1, max_tokens);
    size_t nq = (size_t)s.n_tokens * m->n_q_heads * m->head_dim, nk = (size_t)s.n_tokens * m->n_kv_heads * m->head_dim;
    b->bufs[i][0] = da_test_random_tensor(r, m->dtype, nq, 1.0);
    b->bufs[i][1] = da_test_random_tensor(r, m->dtype, nk, 1.0);
    b->bufs[i][2] = da_test_random_tensor(r, m->dtype, nk, 1.0);
    s.q = (ProtobufCBinaryData){nq * 2, b->bufs[i][0]};
    s.k = (ProtobufCBinaryData){nk * 2, b->bufs[i][1]};
    s.v = (ProtobufCBinaryData){nk * 2, b->bufs[i][2]};
    b->seqs[i] = s;
    b->ptrs[i] = &b->seqs[i];
  }
}

static void free_forward(fwd_builder *b) {
  for (size_t i = 0; i < b->fwd.n_seqs; i++)
    for (int j = 0; j < 3; j++) free(b->bufs[i][j]);
}

static uint8_t *pack(const Detattn__V1__Request *req, size_t *len) {
  *len = detattn__v1__request__get_packed_size(req);
  uint8_t *buf = malloc(*len ? *len : 1);
  detattn__v1__request__pack(req, buf);
  return buf;
}

static int decode_req(const Detattn__V1__Request *req, da_wire_request *out) {
  size_t len;
  uint8_t *buf = pack(req, &len);
  int rv = da_wire_decode(&lim, buf, len, out);
  free(buf);
  return rv;
}

START_TEST(forward_round_trips_with_tensors_intact) {
  da_rng r;
  da_rng_seed(&r, seed);
  fwd_builder b;
  build_forward(&b, &r, 5, 40);
  da_wire_request w;
  ck_assert_msg(decode_req(&b.req, &w) == 0, "seed %llu: %s", (unsigned long long)seed, w.err);
  ck_assert_int_eq(w.op, DA_OP_FORWARD);
  ck_assert_uint_eq(w.id, b.req.id);
  ck_assert_int_eq(w.layer, (int)b.fwd.layer);
  ck_assert_int_eq(w.want_lse, 1);
  ck_assert_int_eq(w.n_seqs, 5);
  int total = 0;
  for (int i = 0; i < 5; i++) {
    const Detattn__V1__ForwardSeq *s = &b.seqs[i];
    ck_assert_uint_eq(w.seqs[i].seq, s->seq);
    ck_assert_int_eq(w.seqs[i].pos, (int)s->pos);
    ck_assert_int_eq(w.seqs[i].n_tokens, (int)s->n_tokens);
    ck_assert_msg(memcmp(w.seqs[i].q.data, s->q.data, s->q.len) == 0, "seed %llu: q of seq %d differs",
                  (unsigned long long)seed, i);
    ck_assert(memcmp(w.seqs[i].k.data, s->k.data, s->k.len) == 0);
    ck_assert(memcmp(w.seqs[i].v.data, s->v.data, s->v.len) == 0);
    total += (int)s->n_tokens;
  }
  ck_assert_int_eq(w.n_tokens, total);
  da_wire_request_fini(&w);
  free_forward(&b);
}
END_TEST

START_TEST(sequence_ops_decode) {
  Detattn__V1__Request req = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__SeqTruncate t = DETATTN__V1__SEQ_TRUNCATE__INIT;
  da_rng r;
  da_rng_seed(&r, seed);
  t.seq = da_rng_u64(&r);
  t.length = (uint32_t)da_rng_range(&r, 0, 100000);
  req.id = 77;
  req.op_case = DETATTN__V1__REQUEST__OP_SEQ_TRUNCATE;
  req.seq_truncate = &t;
  da_wire_request w;
  ck_assert_int_eq(decode_req(&req, &w), 0);
  ck_assert_int_eq(w.op, DA_OP_SEQ_TRUNCATE);
  ck_assert_uint_eq(w.seq, t.seq);
  ck_assert_uint_eq(w.length, t.length);
  da_wire_request_fini(&w);

  Detattn__V1__Hello h = DETATTN__V1__HELLO__INIT;
  h.protocol_version = 1;
  h.client_name = "unit-test";
  req.op_case = DETATTN__V1__REQUEST__OP_HELLO;
  req.hello = &h;
  ck_assert_int_eq(decode_req(&req, &w), 0);
  ck_assert_int_eq(w.op, DA_OP_HELLO);
  ck_assert_str_eq(w.client_name, "unit-test");
  da_wire_request_fini(&w);
}
END_TEST

START_TEST(malformed_bytes_are_invalid_argument) {
  da_rng r;
  da_rng_seed(&r, seed);
  fwd_builder b;
  build_forward(&b, &r, 2, 8);
  size_t len;
  uint8_t *buf = pack(&b.req, &len);
  da_wire_request w;
  /* Cut inside the last tensor: a length prefix promises more bytes than there are. */
  ck_assert_int_eq(da_wire_decode(&lim, buf, len - 3, &w), DETATTN_INVALID_ARGUMENT);
  ck_assert_msg(strstr(w.err, "malformed"), "%s", w.err);
  ck_assert_uint_eq(w.id, 0);
  da_wire_request_fini(&w);
  /* Field 1 with wire type 7, which does not exist. */
  const uint8_t bad[] = {0x0f, 0x01, 0x02};
  ck_assert_int_eq(da_wire_decode(&lim, bad, sizeof(bad), &w), DETATTN_INVALID_ARGUMENT);
  da_wire_request_fini(&w);
  free(buf);
  free_forward(&b);
}
END_TEST

START_TEST(request_without_op_is_invalid_argument) {
  Detattn__V1__Request req = DETATTN__V1__REQUEST__INIT;
  req.id = 5;
  da_wire_request w;
  ck_assert_int_eq(decode_req(&req, &w), DETATTN_INVALID_ARGUMENT);
  ck_assert_uint_eq(w.id, 5);
  ck_assert_msg(strstr(w.err, "no op"), "%s", w.err);
  da_wire_request_fini(&w);
}
END_TEST

START_TEST(tensor_length_mismatch_names_field_expected_and_got) {
  da_rng r;
  da_rng_seed(&r, seed);
  const char *fields[] = {"q", "k", "v"};
  for (int f = 0; f < 3; f++) {
    fwd_builder b;
    build_forward(&b, &r, 3, 10);
    ProtobufCBinaryData *t = f == 0 ? &b.seqs[1].q : f == 1 ? &b.seqs[1].k : &b.seqs[1].v;
    size_t want = t->len;
    t->len -= 2;
    da_wire_request w;
    ck_assert_int_eq(decode_req(&b.req, &w), DETATTN_INVALID_ARGUMENT);
    char exp[128];
    snprintf(exp, sizeof(exp), "forward.seqs[1].%s: expected %zu bytes", fields[f], want);
    ck_assert_msg(strstr(w.err, exp), "seed %llu: '%s' lacks '%s'", (unsigned long long)seed, w.err, exp);
    snprintf(exp, sizeof(exp), "got %zu", want - 2);
    ck_assert_msg(strstr(w.err, exp), "'%s' lacks '%s'", w.err, exp);
    da_wire_request_fini(&w);
    free_forward(&b);
  }
}
END_TEST

START_TEST(forward_argument_errors_each_have_a_message) {
  da_rng r;
  da_rng_seed(&r, seed);
  struct {
    int what;
    const char *needle;
  } cases[] = {{0, "out of range"}, {1, "n_tokens is 0"}, {2, "more than 256 tokens"},
               {3, "more than once"}, {4, "seqs is empty"}};
  for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
    fwd_builder b;
    build_forward(&b, &r, 3, 20);
    switch (cases[c].what) {
    case 0: b.fwd.layer = (uint32_t)lim.model.n_layers; break;
    case 1: b.seqs[2].n_tokens = 0; break;
    case 2: b.seqs[0].n_tokens = 250; break;
    case 3: b.seqs[2].seq = b.seqs[0].seq; break;
    case 4: b.fwd.n_seqs = 0; break;
    }
    da_wire_request w;
    ck_assert_int_eq(decode_req(&b.req, &w), DETATTN_INVALID_ARGUMENT);
    ck_assert_msg(strstr(w.err, cases[c].needle), "case %zu: '%s' lacks '%s'", c, w.err, cases[c].needle);
    ck_assert_uint_eq(w.id, b.req.id);
    da_wire_request_fini(&w);
    b.fwd.n_seqs = 3;
    free_forward(&b);
  }
}
END_TEST

START_TEST(oversized_message_is_resource_exhausted) {
  da_rng r;
  da_rng_seed(&r, seed);
  fwd_builder b;
  build_forward(&b, &r, 2, 40);
  size_t len;
  uint8_t *buf = pack(&b.req, &len);
  da_wire_limits small = lim;
  small.max_message_bytes = len - 1;
  da_wire_request w;
  ck_assert_int_eq(da_wire_decode(&small, buf, len, &w), DETATTN_RESOURCE_EXHAUSTED);
  ck_assert_msg(strstr(w.err, "max-message-bytes"), "%s", w.err);
  da_wire_request_fini(&w);
  free(buf);
  free_forward(&b);
}
END_TEST

START_TEST(decode_allocation_is_bounded) {
  /* Many empty ForwardSeq entries: a few bytes each on the wire, a struct each decoded. */
  Detattn__V1__Request req = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__Forward fwd = DETATTN__V1__FORWARD__INIT;
  enum { N = 2000 };
  static Detattn__V1__ForwardSeq seqs[N];
  static Detattn__V1__ForwardSeq *ptrs[N];
  for (int i = 0; i < N; i++) {
    Detattn__V1__ForwardSeq s = DETATTN__V1__FORWARD_SEQ__INIT;
    seqs[i] = s;
    ptrs[i] = &seqs[i];
  }
  fwd.n_seqs = N;
  fwd.seqs = ptrs;
  req.op_case = DETATTN__V1__REQUEST__OP_FORWARD;
  req.forward = &fwd;
  size_t len;
  uint8_t *buf = pack(&req, &len);
  da_wire_limits small = lim;
  small.decode_bytes = len * 4;
  da_wire_request w;
  ck_assert_int_eq(da_wire_decode(&small, buf, len, &w), DETATTN_RESOURCE_EXHAUSTED);
  ck_assert_msg(strstr(w.err, "to decode"), "%s", w.err);
  da_wire_request_fini(&w);
  free(buf);
}
END_TEST

static void *heap_alloc(void *arg, size_t n) {
  (void)arg;
  return malloc(n ? n : 1);
}

static Detattn__V1__Response *encode_decode(const da_wire_response *resp) {
  void *buf;
  size_t len;
  ck_assert_int_eq(da_wire_encode(resp, heap_alloc, NULL, &buf, &len), 0);
  Detattn__V1__Response *m = detattn__v1__response__unpack(NULL, len, buf);
  free(buf);
  ck_assert_ptr_nonnull(m);
  return m;
}

START_TEST(error_reply_carries_code_and_message_only) {
  da_wire_response resp = {.id = 99, .code = DETATTN_FAILED_PRECONDITION, .message = "expected 3, got 4",
                           .op = DA_OP_FORWARD};
  Detattn__V1__Response *m = encode_decode(&resp);
  ck_assert_uint_eq(m->id, 99);
  ck_assert_uint_eq(m->status->code, DETATTN_FAILED_PRECONDITION);
  ck_assert_str_eq(m->status->message, "expected 3, got 4");
  ck_assert_int_eq(m->result_case, DETATTN__V1__RESPONSE__RESULT__NOT_SET);
  detattn__v1__response__free_unpacked(m, NULL);
}
END_TEST

START_TEST(hello_and_stats_replies_round_trip) {
  da_rng r;
  da_rng_seed(&r, seed);
  da_wire_hello_reply h = {.server_version = "9.8.7", .protocol_version = 1, .model = lim.model,
                           .page_tokens = 16, .backend = "cpu", .arch = "x86_64", .kernel_version = 3,
                           .num = {256, 64}, .fingerprint = da_rng_u64(&r), .max_message_bytes = 123456,
                           .max_tokens_per_request = 4096, .kv_capacity_tokens = 65536, .kv_pages = 4096,
                           .max_sequences = 77};
  da_wire_response resp = {.id = 1, .op = DA_OP_HELLO, .hello = &h};
  Detattn__V1__Response *m = encode_decode(&resp);
  ck_assert_int_eq(m->result_case, DETATTN__V1__RESPONSE__RESULT_HELLO);
  ck_assert_str_eq(m->hello->server_version, "9.8.7");
  ck_assert_uint_eq(m->hello->model->n_q_heads, 4);
  ck_assert_uint_eq(m->hello->model->page_tokens, 16);
  ck_assert(m->hello->model->scale == 0.125f);
  ck_assert_str_eq(m->hello->numerics->backend, "cpu");
  ck_assert_uint_eq(m->hello->numerics->split_tokens, 256);
  ck_assert_uint_eq(m->hello->numerics->fingerprint, h.fingerprint);
  ck_assert_uint_eq(m->hello->limits->kv_pages, 4096);
  ck_assert_uint_eq(m->hello->limits->max_sequences, 77);
  detattn__v1__response__free_unpacked(m, NULL);

  da_wire_stats_reply st = {.requests = da_rng_u64(&r) >> 20, .batches = 17, .kv_pages_free = 3,
                            .batch_tokens = {.count = 17, .mean = 2.5, .p50 = 2, .p99 = 9, .max = 11}};
  st.op_ok[DA_OP_FORWARD] = 41;
  st.op_errors[DA_OP_SEQ_CLOSE] = 2;
  resp = (da_wire_response){.id = 2, .op = DA_OP_STATS, .stats = &st};
  m = encode_decode(&resp);
  ck_assert_int_eq(m->result_case, DETATTN__V1__RESPONSE__RESULT_STATS);
  ck_assert_uint_eq(m->stats->requests, st.requests);
  ck_assert(m->stats->batch_tokens->p99 == 9);
  int seen = 0;
  for (size_t i = 0; i < m->stats->n_ops; i++) {
    if (strcmp(m->stats->ops[i]->op, "forward") == 0) seen += m->stats->ops[i]->ok == 41;
    if (strcmp(m->stats->ops[i]->op, "seq_close") == 0) seen += m->stats->ops[i]->errors == 2;
  }
  ck_assert_int_eq(seen, 2);
  detattn__v1__response__free_unpacked(m, NULL);
}
END_TEST

START_TEST(forward_reply_encodes_outputs_bit_for_bit) {
  da_rng r;
  da_rng_seed(&r, seed);
  enum { NS = 3 };
  da_wire_fwd_out outs[NS];
  void *bufs[NS];
  float *lses[NS];
  for (int i = 0; i < NS; i++) {
    int n = (int)da_rng_range(&r, 1, 30);
    size_t no = (size_t)n * lim.model.n_q_heads * lim.model.head_dim;
    bufs[i] = da_test_random_tensor(&r, DA_BF16, no, 1.0);
    lses[i] = malloc((size_t)n * lim.model.n_q_heads * sizeof(float));
    for (int j = 0; j < n * lim.model.n_q_heads; j++) lses[i][j] = (float)da_rng_normal(&r);
    outs[i] = (da_wire_fwd_out){bufs[i], no * 2, i == 1 ? NULL : lses[i], (size_t)n * lim.model.n_q_heads * 4};
  }
  da_wire_response resp = {.id = da_rng_u64(&r), .op = DA_OP_FORWARD, .n_outs = NS, .outs = outs};
  void *buf;
  size_t len;
  ck_assert_int_eq(da_wire_encode(&resp, heap_alloc, NULL, &buf, &len), 0);
  Detattn__V1__Response *m = detattn__v1__response__unpack(NULL, len, buf);
  ck_assert_ptr_nonnull(m);
  ck_assert_uint_eq(m->id, resp.id);
  ck_assert_ptr_nonnull(m->status);
  ck_assert_uint_eq(m->status->code, 0);
  ck_assert_int_eq(m->result_case, DETATTN__V1__RESPONSE__RESULT_FORWARD);
  ck_assert_uint_eq(m->forward->n_seqs, NS);
  for (int i = 0; i < NS; i++) {
    const Detattn__V1__ForwardSeqOut *o = m->forward->seqs[i];
    ck_assert_uint_eq(o->o.len, outs[i].o_len);
    ck_assert_msg(memcmp(o->o.data, bufs[i], o->o.len) == 0, "seed %llu: o of seq %d differs",
                  (unsigned long long)seed, i);
    if (i == 1) {
      ck_assert_uint_eq(o->lse.len, 0);
    } else {
      ck_assert_uint_eq(o->lse.len, outs[i].lse_len);
      ck_assert(memcmp(o->lse.data, lses[i], o->lse.len) == 0);
    }
  }
  detattn__v1__response__free_unpacked(m, NULL);
  free(buf);
  for (int i = 0; i < NS; i++) {
    free(bufs[i]);
    free(lses[i]);
  }
}
END_TEST

/* Reads every byte of a tensor the decoder handed out, so ASan checks its bounds. */
static unsigned touch(const void *p, size_t n) {
  const unsigned char *b = p;
  unsigned x = 0;
  for (size_t i = 0; i < n; i++) x += b[i];
  return x;
}

START_TEST(mutated_requests_decode_to_a_status_and_consistent_fields) {
  da_rng r;
  da_rng_seed(&r, seed);
  const da_model *m = &lim.model;
  const size_t qrow = (size_t)m->n_q_heads * m->head_dim * 2, kvrow = (size_t)m->n_kv_heads * m->head_dim * 2;
  int n_ok = 0, n_bad = 0;
  unsigned sink = 0;
  for (int iter = 0; iter < 4000; iter++) {
    fwd_builder b;
    build_forward(&b, &r, (int)da_rng_range(&r, 1, 3), 4);
    size_t len;
    uint8_t *buf = pack(&b.req, &len);
    /* A few random edits: flip a bit, overwrite a byte, cut the tail, or splice a varint. */
    int edits = (int)da_rng_range(&r, 1, 4);
    for (int e = 0; e < edits && len > 0; e++) {
      size_t at = (size_t)da_rng_range(&r, 0, (int64_t)len - 1);
      switch (da_rng_range(&r, 0, 3)) {
      case 0: buf[at] ^= (uint8_t)(1u << da_rng_range(&r, 0, 7)); break;
      case 1: buf[at] = (uint8_t)da_rng_u64(&r); break;
      case 2: len = at; break;
      default: buf[at] = (uint8_t)(0x80 | da_rng_u64(&r)); break;
      }
    }
    da_wire_request w;
    int st = da_wire_decode(&lim, buf, len, &w);
    ck_assert_int_eq(st, w.status);
    if (st != 0) {
      ck_assert_msg(st == DETATTN_INVALID_ARGUMENT || st == DETATTN_RESOURCE_EXHAUSTED,
                    "iteration %d: status %s (seed %llu)", iter, detattn_status_name(st), (unsigned long long)seed);
      ck_assert_msg(w.err[0] != '\0', "iteration %d: %s without a message", iter, detattn_status_name(st));
      n_bad++;
    } else {
      ck_assert_int_gt(w.op, DA_OP_INVALID);
      ck_assert_int_lt(w.op, DA_OP_COUNT);
      if (w.op == DA_OP_FORWARD) {
        ck_assert(w.layer >= 0 && w.layer < m->n_layers);
        int total = 0;
        for (int i = 0; i < w.n_seqs; i++) {
          const da_wire_fwd_seq *q = &w.seqs[i];
          ck_assert(q->n_tokens > 0 && q->pos >= 0);
          total += q->n_tokens;
          sink += touch(q->q.data, (size_t)q->n_tokens * qrow) + touch(q->k.data, (size_t)q->n_tokens * kvrow) +
                  touch(q->v.data, (size_t)q->n_tokens * kvrow);
        }
        ck_assert_int_eq(total, w.n_tokens);
        ck_assert_int_le(total, lim.max_request_tokens);
      }
      n_ok++;
    }
    da_wire_request_fini(&w);
    free(buf);
    free_forward(&b);
  }
  /* The edits must exercise both outcomes, or the test says nothing. */
  ck_assert_msg(n_ok > 50 && n_bad > 500, "%d decoded, %d rejected (sink %u)", n_ok, n_bad, sink);
}
END_TEST

int main(void) {
  Suite *s = suite_create("server_wire");
  TCase *tc = tcase_create("wire");
  tcase_add_checked_fixture(tc, setup, NULL);
  tcase_add_test(tc, forward_round_trips_with_tensors_intact);
  tcase_add_test(tc, sequence_ops_decode);
  tcase_add_test(tc, malformed_bytes_are_invalid_argument);
  tcase_add_test(tc, request_without_op_is_invalid_argument);
  tcase_add_test(tc, tensor_length_mismatch_names_field_expected_and_got);
  tcase_add_test(tc, forward_argument_errors_each_have_a_message);
  tcase_add_test(tc, oversized_message_is_resource_exhausted);
  tcase_add_test(tc, decode_allocation_is_bounded);
  tcase_add_test(tc, error_reply_carries_code_and_message_only);
  tcase_add_test(tc, hello_and_stats_replies_round_trip);
  tcase_add_test(tc, forward_reply_encodes_outputs_bit_for_bit);
  tcase_add_test(tc, mutated_requests_decode_to_a_status_and_consistent_fields);
  suite_add_tcase(s, tc);
  return da_test_run(s);
}
