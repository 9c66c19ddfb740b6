/*
 * test_plugin.c — libdetattn against a scripted fake daemon (an nng rep0 socket in a
 * thread, answering with protobuf messages built here), so that the library's transport
 * and response checks are tested without detattnd: status pass-through, length checks
 * that write nothing, deadlines, connection loss without resend, concurrent calls.
 */
#include <check.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>

#include "client_impl.h"
#include "da.h"
#include "detattn.h"
#include "detattn.pb-c.h"
#include "doorbell_ring.h"
#include "testutil.h"

typedef Detattn__V1__Request Request;
typedef Detattn__V1__Response Response;

/* How the fake daemon answers. */
enum fake_mode {
  FAKE_OK,          /* well-formed replies */
  FAKE_STATUS,      /* every request except hello: NOT_FOUND with a message */
  FAKE_SHORT_O,     /* forward replies with o one element short */
  FAKE_SILENT,      /* receives, never replies */
  FAKE_DROP,        /* hello answered; the first other request closes the socket */
  FAKE_REVERSE,     /* raw: collects `batch` requests, answers in reverse order */
};

typedef struct fake {
  char dir[64];
  char url[128];
  nng_socket sock;
  pthread_t thr;
  enum fake_mode mode;
  int batch;
  int received;      /* requests received (all kinds), under mu */
  int received_fwd;  /* forward requests received, under mu */
  pthread_mutex_t mu;
  uint64_t next_seq;
} fake;

static const detattn_model fake_model = {
    .n_layers = 2, .n_q_heads = 4, .n_kv_heads = 2, .head_dim = 64, .dtype = DETATTN_BF16,
    .scale = 0.125f, .softcap = 0.0f, .window = 0, .page_tokens = 16};

/* Builds the reply to rq in fake f's mode into *buf (malloc'd), or returns 0 for none. */
static size_t build_reply(fake *f, const Request *rq, uint8_t **buf) {
  Response r = DETATTN__V1__RESPONSE__INIT;
  Detattn__V1__Status status = DETATTN__V1__STATUS__INIT;
  Detattn__V1__HelloReply hello = DETATTN__V1__HELLO_REPLY__INIT;
  Detattn__V1__ModelConfig model = DETATTN__V1__MODEL_CONFIG__INIT;
  Detattn__V1__Numerics num = DETATTN__V1__NUMERICS__INIT;
  Detattn__V1__Limits lim = DETATTN__V1__LIMITS__INIT;
  Detattn__V1__SeqOpenReply open = DETATTN__V1__SEQ_OPEN_REPLY__INIT;
  Detattn__V1__ForwardReply fwd = DETATTN__V1__FORWARD_REPLY__INIT;
  Detattn__V1__ForwardSeqOut outs[8], *outp[8];
  uint8_t *obuf[8] = {0};

  r.id = rq->id;
  r.status = &status;
  if (rq->op_case == DETATTN__V1__REQUEST__OP_HELLO) {
    model.n_layers = fake_model.n_layers;
    model.n_q_heads = fake_model.n_q_heads;
    model.n_kv_heads = fake_model.n_kv_heads;
    model.head_dim = fake_model.head_dim;
    model.scale = fake_model.scale;
    model.page_tokens = fake_model.page_tokens;
    num.backend = "fake";
    num.arch = "none";
    num.split_tokens = 256;
    num.tile_tokens = 64;
    num.fingerprint = 0x1234abcd5678ef01ull;
    lim.max_message_bytes = 1 << 20;
    lim.max_tokens_per_request = 512;
    lim.kv_pages = 64;
    lim.kv_capacity_tokens = 1024;
    hello.server_version = "fake-0";
    hello.protocol_version = DETATTN_PROTOCOL_VERSION;
    hello.model = &model;
    hello.numerics = &num;
    hello.limits = &lim;
    r.result_case = DETATTN__V1__RESPONSE__RESULT_HELLO;
    r.hello = &hello;
  } else if (f->mode == FAKE_STATUS) {
    status.code = DETATTN_NOT_FOUND;
    status.message = "sequence 77 not found";
  } else if (rq->op_case == DETATTN__V1__REQUEST__OP_SEQ_OPEN) {
    pthread_mutex_lock(&f->mu);
    open.seq = ++f->next_seq;
    pthread_mutex_unlock(&f->mu);
    r.result_case = DETATTN__V1__RESPONSE__RESULT_SEQ_OPEN;
    r.seq_open = &open;
  } else if (rq->op_case == DETATTN__V1__REQUEST__OP_FORWARD) {
    /* o[t][h][d] = the request's q (same shape); lse = pos + t + layer as floats. */
    const Detattn__V1__Forward *in = rq->forward;
    size_t n = in->n_seqs < 8 ? in->n_seqs : 8;
    for (size_t i = 0; i < n; i++) {
      Detattn__V1__ForwardSeqOut init = DETATTN__V1__FORWARD_SEQ_OUT__INIT;
      const Detattn__V1__ForwardSeq *s = in->seqs[i];
      outs[i] = init;
      outs[i].o = s->q;
      if (f->mode == FAKE_SHORT_O && outs[i].o.len >= 2) outs[i].o.len -= 2;
      if (in->want_lse) {
        size_t rows = (size_t)s->n_tokens * fake_model.n_q_heads;
        float *l = malloc(rows * sizeof *l);
        for (size_t j = 0; j < rows; j++)
          l[j] = (float)(s->pos + j / fake_model.n_q_heads + in->layer);
        obuf[i] = (uint8_t *)l;
        outs[i].lse = (ProtobufCBinaryData){rows * sizeof *l, obuf[i]};
      }
      outp[i] = &outs[i];
    }
    fwd.n_seqs = n;
    fwd.seqs = outp;
    r.result_case = DETATTN__V1__RESPONSE__RESULT_FORWARD;
    r.forward = &fwd;
  } else {
    status.code = DETATTN_UNIMPLEMENTED;
    status.message = "fake daemon";
  }
  size_t len = detattn__v1__response__get_packed_size(&r);
  *buf = malloc(len ? len : 1);
  detattn__v1__response__pack(&r, *buf);
  for (int i = 0; i < 8; i++) free(obuf[i]);
  return len;
}

static int fake_handle(fake *f, nng_msg *m, nng_msg **reply) {
  Request *rq = detattn__v1__request__unpack(NULL, nng_msg_len(m), nng_msg_body(m));
  *reply = NULL;
  if (!rq) return 0;
  pthread_mutex_lock(&f->mu);
  f->received++;
  if (rq->op_case == DETATTN__V1__REQUEST__OP_FORWARD) f->received_fwd++;
  pthread_mutex_unlock(&f->mu);
  int hello = rq->op_case == DETATTN__V1__REQUEST__OP_HELLO;
  int is_fwd = rq->op_case == DETATTN__V1__REQUEST__OP_FORWARD;
  if ((f->mode == FAKE_SILENT || f->mode == FAKE_DROP) && !hello) {
    detattn__v1__request__free_unpacked(rq, NULL);
    return f->mode == FAKE_DROP ? -1 : 0;
  }
  uint8_t *buf;
  size_t len = build_reply(f, rq, &buf);
  detattn__v1__request__free_unpacked(rq, NULL);
  nng_msg_alloc(reply, 0);
  nng_msg_header_append(*reply, nng_msg_header(m), nng_msg_header_len(m));
  nng_msg_append(*reply, buf, len);
  free(buf);
  return is_fwd;
}

static void *fake_main(void *arg) {
  fake *f = arg;
  nng_msg *held[64];
  int nheld = 0;
  for (;;) {
    nng_msg *m, *reply;
    if (nng_recvmsg(f->sock, &m, 0) != 0) break;
    int rc = fake_handle(f, m, &reply);
    if (rc < 0) {
      nng_msg_free(m);
      nng_close(f->sock);
      break;
    }
    if (f->mode == FAKE_REVERSE && reply && rc == 1) {
      held[nheld++] = reply;
      nng_msg_free(m);
      if (nheld == f->batch) {
        while (nheld > 0) nng_sendmsg(f->sock, held[--nheld], 0);
      }
      continue;
    }
    nng_msg_free(m);
    if (reply && nng_sendmsg(f->sock, reply, 0) != 0) nng_msg_free(reply);
  }
  while (nheld > 0) nng_msg_free(held[--nheld]);
  return NULL;
}

static void fake_listen(fake *f) {
  int rv = f->mode == FAKE_REVERSE ? nng_rep0_open_raw(&f->sock) : nng_rep0_open(&f->sock);
  ck_assert_int_eq(rv, 0);
  ck_assert_int_eq(nng_listen(f->sock, f->url, NULL, 0), 0);
  ck_assert_int_eq(pthread_create(&f->thr, NULL, fake_main, f), 0);
}

static void fake_start(fake *f, enum fake_mode mode) {
  memset(f, 0, sizeof *f);
  snprintf(f->dir, sizeof f->dir, "/tmp/detattn-plugin-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(f->dir));
  snprintf(f->url, sizeof f->url, "ipc://%s/fake.sock", f->dir);
  f->mode = mode;
  f->batch = 4;
  pthread_mutex_init(&f->mu, NULL);
  fake_listen(f);
}

static void fake_stop(fake *f) {
  nng_close(f->sock);
  pthread_join(f->thr, NULL);
  char path[160];
  snprintf(path, sizeof path, "%s/fake.sock", f->dir);
  unlink(path);
  rmdir(f->dir);
  pthread_mutex_destroy(&f->mu);
}

static int fake_count(fake *f, int fwd) {
  pthread_mutex_lock(&f->mu);
  int n = fwd ? f->received_fwd : f->received;
  pthread_mutex_unlock(&f->mu);
  return n;
}

/* Seeded random bf16 q/k/v for one item of n tokens. */
typedef struct item_bufs {
  uint16_t *q, *k, *v, *o;
  float *lse;
} item_bufs;

static void item_alloc(da_rng *r, item_bufs *b, detattn_seq_io *io, uint64_t seq, uint32_t pos, uint32_t n) {
  size_t qn = (size_t)n * fake_model.n_q_heads * fake_model.head_dim;
  size_t kvn = (size_t)n * fake_model.n_kv_heads * fake_model.head_dim;
  b->q = malloc(qn * 2);
  b->k = malloc(kvn * 2);
  b->v = malloc(kvn * 2);
  b->o = malloc(qn * 2);
  b->lse = malloc((size_t)n * fake_model.n_q_heads * sizeof(float));
  da_rng_fill(r, DA_BF16, b->q, qn, 1.0);
  da_rng_fill(r, DA_BF16, b->k, kvn, 1.0);
  da_rng_fill(r, DA_BF16, b->v, kvn, 1.0);
  memset(b->o, 0xA5, qn * 2);
  memset(b->lse, 0xA5, (size_t)n * fake_model.n_q_heads * sizeof(float));
  *io = (detattn_seq_io){.seq = seq, .pos = pos, .n_tokens = n, .q = b->q, .k = b->k, .v = b->v,
                         .o = b->o, .lse = b->lse};
}

static void item_free(item_bufs *b) {
  free(b->q);
  free(b->k);
  free(b->v);
  free(b->o);
  free(b->lse);
}

static uint64_t test_seed(void) {
  const char *s = getenv("DETATTN_TEST_SEED");
  return s ? strtoull(s, NULL, 0) : 0x5eed0001ull;
}

START_TEST(hello_returns_the_daemon_model_and_fingerprint) {
  fake f;
  detattn_client *c;
  detattn_server_info info;
  fake_start(&f, FAKE_OK);
  ck_assert_int_eq(detattn_connect(&c, f.url), DETATTN_OK);
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_OK);
  ck_assert_str_eq(info.backend, "fake");
  ck_assert_uint_eq(info.model.n_q_heads, fake_model.n_q_heads);
  ck_assert_uint_eq(info.model.head_dim, fake_model.head_dim);
  ck_assert_uint_eq(info.fingerprint, 0x1234abcd5678ef01ull);
  ck_assert_uint_eq(info.max_tokens_per_request, 512);
  detattn_close(c);
  fake_stop(&f);
}
END_TEST

START_TEST(forward_returns_outputs_of_every_item) {
  fake f;
  detattn_client *c;
  da_rng r;
  item_bufs b[3];
  detattn_seq_io io[3];
  uint64_t seed = test_seed();
  da_rng_seed(&r, seed);
  fake_start(&f, FAKE_OK);
  ck_assert_int_eq(detattn_connect(&c, f.url), DETATTN_OK);
  for (int i = 0; i < 3; i++) item_alloc(&r, &b[i], &io[i], 10 + i, 5 * i, (uint32_t)da_rng_range(&r, 1, 9));
  ck_assert_int_eq(detattn_forward(c, 1, io, 3), DETATTN_OK);
  for (int i = 0; i < 3; i++) {
    size_t qbytes = (size_t)io[i].n_tokens * fake_model.n_q_heads * fake_model.head_dim * 2;
    ck_assert_msg(memcmp(b[i].o, b[i].q, qbytes) == 0, "item %d: o differs from the fake's echo (seed %llu)", i,
                  (unsigned long long)seed);
    for (uint32_t t = 0; t < io[i].n_tokens; t++)
      ck_assert_float_eq(b[i].lse[t * fake_model.n_q_heads], (float)(io[i].pos + t + 1));
    item_free(&b[i]);
  }
  detattn_close(c);
  fake_stop(&f);
}
END_TEST

START_TEST(daemon_status_and_message_reach_the_caller) {
  fake f;
  detattn_client *c;
  fake_start(&f, FAKE_STATUS);
  ck_assert_int_eq(detattn_connect(&c, f.url), DETATTN_OK);
  ck_assert_int_eq(detattn_seq_close(c, 77), DETATTN_NOT_FOUND);
  ck_assert_str_eq(detattn_errmsg(), "sequence 77 not found");
  detattn_close(c);
  fake_stop(&f);
}
END_TEST

START_TEST(forward_reply_of_wrong_length_is_internal_and_writes_nothing) {
  fake f;
  detattn_client *c;
  da_rng r;
  item_bufs b;
  detattn_seq_io io;
  da_rng_seed(&r, test_seed());
  fake_start(&f, FAKE_SHORT_O);
  ck_assert_int_eq(detattn_connect(&c, f.url), DETATTN_OK);
  item_alloc(&r, &b, &io, 1, 0, 4);
  size_t qbytes = (size_t)4 * fake_model.n_q_heads * fake_model.head_dim * 2;
  uint8_t *before = malloc(qbytes);
  memcpy(before, b.o, qbytes);
  ck_assert_int_eq(detattn_forward(c, 0, &io, 1), DETATTN_INTERNAL);
  ck_assert_ptr_nonnull(strstr(detattn_errmsg(), "o has"));
  ck_assert_int_eq(memcmp(before, b.o, qbytes), 0);
  free(before);
  item_free(&b);
  detattn_close(c);
  fake_stop(&f);
}
END_TEST

START_TEST(no_daemon_gives_unavailable_at_the_deadline) {
  char dir[] = "/tmp/detattn-plugin-XXXXXX", url[128];
  detattn_client *c;
  detattn_server_info info;
  ck_assert_ptr_nonnull(mkdtemp(dir));
  snprintf(url, sizeof url, "ipc://%s/nobody.sock", dir);
  ck_assert_int_eq(detattn_connect(&c, url), DETATTN_OK);
  detattn_set_timeout(c, 200);
  uint64_t t0 = da_now_ns();
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_UNAVAILABLE);
  uint64_t ms = (da_now_ns() - t0) / 1000000;
  ck_assert_msg(ms >= 150 && ms < 2000, "hello returned after %llu ms, deadline 200 ms", (unsigned long long)ms);
  ck_assert_ptr_nonnull(strstr(detattn_errmsg(), "no connection"));
  detattn_close(c);
  rmdir(dir);
}
END_TEST

START_TEST(daemon_started_after_connect_is_reached) {
  fake f;
  detattn_client *c;
  detattn_server_info info;
  memset(&f, 0, sizeof f);
  snprintf(f.dir, sizeof f.dir, "/tmp/detattn-plugin-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(f.dir));
  snprintf(f.url, sizeof f.url, "ipc://%s/fake.sock", f.dir);
  pthread_mutex_init(&f.mu, NULL);
  ck_assert_int_eq(detattn_connect(&c, f.url), DETATTN_OK);
  usleep(100 * 1000);
  fake_listen(&f);
  detattn_set_timeout(c, 5000);
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_OK);
  detattn_close(c);
  fake_stop(&f);
}
END_TEST

START_TEST(silent_daemon_gives_deadline_exceeded) {
  fake f;
  detattn_client *c;
  uint64_t seq;
  fake_start(&f, FAKE_SILENT);
  ck_assert_int_eq(detattn_connect(&c, f.url), DETATTN_OK);
  detattn_set_timeout(c, 300);
  ck_assert_int_eq(detattn_seq_open(c, &seq), DETATTN_DEADLINE_EXCEEDED);
  ck_assert_ptr_nonnull(strstr(detattn_errmsg(), "no reply"));
  detattn_close(c);
  fake_stop(&f);
}
END_TEST

START_TEST(lost_connection_fails_the_call_and_never_resends_it) {
  fake f;
  detattn_client *c;
  da_rng r;
  item_bufs b;
  detattn_seq_io io;
  da_rng_seed(&r, test_seed());
  fake_start(&f, FAKE_DROP);
  ck_assert_int_eq(detattn_connect(&c, f.url), DETATTN_OK);
  detattn_set_timeout(c, 5000);
  item_alloc(&r, &b, &io, 1, 0, 2);
  uint64_t t0 = da_now_ns();
  ck_assert_int_eq(detattn_forward(c, 0, &io, 1), DETATTN_UNAVAILABLE);
  ck_assert_msg(da_now_ns() - t0 < 3000000000ull, "the lost connection was noticed only at the deadline");
  pthread_join(f.thr, NULL);
  ck_assert_int_eq(fake_count(&f, 1), 1);
  /* A daemon at the same address again: the failed request must not arrive there. */
  f.mode = FAKE_OK;
  fake_listen(&f);
  int st = detattn_forward(c, 0, &io, 1);
  ck_assert_msg(st == DETATTN_OK, "forward after reconnecting: %s: %s", detattn_status_name(st), detattn_errmsg());
  ck_assert_int_eq(fake_count(&f, 1), 2);
  item_free(&b);
  detattn_close(c);
  fake_stop(&f);
}
END_TEST

START_TEST(calls_in_flight_complete_out_of_order) {
  fake f;
  detattn_client *c;
  da_rng r;
  enum { N = 4 };
  item_bufs b[N];
  detattn_seq_io io[N];
  detattn_call *k[N];
  detattn_server_info info;
  uint64_t seed = test_seed();
  da_rng_seed(&r, seed);
  fake_start(&f, FAKE_REVERSE); /* holds 4 forwards, then answers the last first */
  ck_assert_int_eq(detattn_connect(&c, f.url), DETATTN_OK);
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_OK);
  for (int i = 0; i < N; i++) {
    item_alloc(&r, &b[i], &io[i], 1, 0, (uint32_t)da_rng_range(&r, 1, 6));
    ck_assert_int_eq(detattn_forward_start(c, (uint32_t)(i % 2), &io[i], 1, &k[i]), DETATTN_OK);
  }
  for (int i = 0; i < N; i++) {
    ck_assert_int_eq(detattn_call_wait(k[i]), DETATTN_OK);
    size_t qbytes = (size_t)io[i].n_tokens * fake_model.n_q_heads * fake_model.head_dim * 2;
    ck_assert_msg(memcmp(b[i].o, b[i].q, qbytes) == 0, "call %d got another call's output (seed %llu)", i,
                  (unsigned long long)seed);
    ck_assert_float_eq(b[i].lse[0], (float)(i % 2));
    item_free(&b[i]);
  }
  detattn_close(c);
  fake_stop(&f);
}
END_TEST

typedef struct opener {
  detattn_client *c;
  uint64_t seqs[50];
  int rc;
} opener;

static void *open_many(void *arg) {
  opener *o = arg;
  o->rc = 0;
  for (int i = 0; i < 50 && !o->rc; i++) o->rc = detattn_seq_open(o->c, &o->seqs[i]);
  return NULL;
}

START_TEST(threads_sharing_a_client_each_get_their_own_replies) {
  fake f;
  detattn_client *c;
  enum { T = 6 };
  pthread_t thr[T];
  opener op[T];
  fake_start(&f, FAKE_OK);
  ck_assert_int_eq(detattn_connect(&c, f.url), DETATTN_OK);
  for (int t = 0; t < T; t++) {
    op[t].c = c;
    ck_assert_int_eq(pthread_create(&thr[t], NULL, open_many, &op[t]), 0);
  }
  uint8_t seen[T * 50 + 1] = {0};
  for (int t = 0; t < T; t++) {
    pthread_join(thr[t], NULL);
    ck_assert_int_eq(op[t].rc, DETATTN_OK);
    for (int i = 0; i < 50; i++) {
      uint64_t s = op[t].seqs[i];
      ck_assert_msg(s >= 1 && s <= T * 50 && !seen[s], "sequence id %llu handed out twice or out of range",
                    (unsigned long long)s);
      seen[s] = 1;
    }
  }
  detattn_close(c);
  fake_stop(&f);
}
END_TEST

START_TEST(bad_arguments_are_rejected_before_sending) {
  fake f;
  detattn_client *c;
  detattn_seq_io io = {.seq = 1, .pos = 0, .n_tokens = 3};
  detattn_call *k;
  fake_start(&f, FAKE_OK);
  ck_assert_int_eq(detattn_connect(&c, f.url), DETATTN_OK);
  ck_assert_int_eq(detattn_forward(c, 0, NULL, 1), DETATTN_INVALID_ARGUMENT);
  ck_assert_int_eq(detattn_forward(c, 0, &io, 0), DETATTN_INVALID_ARGUMENT);
  ck_assert_int_eq(detattn_forward(c, 0, &io, 1), DETATTN_INVALID_ARGUMENT);
  ck_assert_ptr_nonnull(strstr(detattn_errmsg(), "NULL"));
  ck_assert_int_eq(detattn_forward_start(c, 0, &io, 1, &k), DETATTN_INVALID_ARGUMENT);
  ck_assert_int_eq(fake_count(&f, 0), 0);
  ck_assert_int_eq(detattn_call_wait(NULL), DETATTN_INVALID_ARGUMENT);
  detattn_close(c);
  fake_stop(&f);
  ck_assert_int_eq(detattn_connect(&c, NULL), DETATTN_INVALID_ARGUMENT);
  detattn_client *c2;
  ck_assert_int_eq(detattn_connect(&c2, "nosuch://x"), DETATTN_INVALID_ARGUMENT);
  detattn_close(c2);
}
END_TEST

START_TEST(close_cancels_calls_in_flight) {
  fake f;
  detattn_client *c;
  da_rng r;
  item_bufs b;
  detattn_seq_io io;
  detattn_call *k;
  detattn_server_info info;
  da_rng_seed(&r, test_seed());
  fake_start(&f, FAKE_SILENT);
  ck_assert_int_eq(detattn_connect(&c, f.url), DETATTN_OK);
  ck_assert_int_eq(detattn_hello(c, &info), DETATTN_OK);
  item_alloc(&r, &b, &io, 1, 0, 3);
  ck_assert_int_eq(detattn_forward_start(c, 0, &io, 1, &k), DETATTN_OK);
  uint64_t t0 = da_now_ns();
  detattn_close(c);
  int st = detattn_call_wait(k);
  ck_assert_msg(st == DETATTN_CANCELLED, "call after close: %s: %s", detattn_status_name(st), detattn_errmsg());
  ck_assert_msg(da_now_ns() - t0 < 2000000000ull, "close waited for the call's deadline");
  item_free(&b);
  fake_stop(&f);
}
END_TEST

typedef struct err_thread {
  detattn_client *c;
  int status;
  char msg[256];
} err_thread;

static void *fail_in_thread(void *arg) {
  err_thread *e = arg;
  e->status = detattn_seq_close(e->c, 77);
  snprintf(e->msg, sizeof e->msg, "%s", detattn_errmsg());
  return NULL;
}

START_TEST(error_messages_are_per_thread) {
  fake f;
  detattn_client *c;
  pthread_t t;
  err_thread e;
  fake_start(&f, FAKE_STATUS);
  ck_assert_int_eq(detattn_connect(&c, f.url), DETATTN_OK);
  ck_assert_int_eq(detattn_forward(c, 0, NULL, 1), DETATTN_INVALID_ARGUMENT);
  char mine[256];
  snprintf(mine, sizeof mine, "%s", detattn_errmsg());
  e.c = c;
  ck_assert_int_eq(pthread_create(&t, NULL, fail_in_thread, &e), 0);
  pthread_join(t, NULL);
  ck_assert_int_eq(e.status, DETATTN_NOT_FOUND);
  ck_assert_str_eq(e.msg, "sequence 77 not found");
  ck_assert_str_eq(detattn_errmsg(), mine);
  detattn_close(c);
  fake_stop(&f);
}
END_TEST

/* nng reaps closed sockets and pipes on its own threads; let it finish before the test
 * process exits, so that LeakSanitizer sees only leaks of ours. */
static void reap_nng(void) { nng_fini(); }

/* A doorbell call spins for its reply as long as the option says, and, where adaptive and
 * alone on its ring, half again as long as the ring's last call waited, up to the cap. */
START_TEST(doorbell_spin_follows_the_last_call) {
  const uint64_t us = 1000;
  ck_assert_uint_eq(da_ring_spin_budget(0, 1, 0, 300 * us), 0); /* 0: never spins */
  ck_assert_uint_eq(da_ring_spin_budget(50 * us, 0, 0, 300 * us), 50 * us); /* not adaptive */
  ck_assert_uint_eq(da_ring_spin_budget(50 * us, 1, 1, 300 * us), 50 * us); /* another call waits */
  ck_assert_uint_eq(da_ring_spin_budget(50 * us, 1, 0, 0), 50 * us);        /* no call answered yet */
  ck_assert_uint_eq(da_ring_spin_budget(50 * us, 1, 0, 20 * us), 50 * us);  /* short calls: the option */
  ck_assert_uint_eq(da_ring_spin_budget(50 * us, 1, 0, 270 * us), 405 * us);
  ck_assert_uint_eq(da_ring_spin_budget(50 * us, 1, 0, 10000 * us), DA_RING_SPIN_MAX_NS);
  ck_assert_uint_eq(da_ring_spin_budget(5000 * us, 1, 0, 10000 * us), 5000 * us); /* the option above the cap */
}
END_TEST

/* A spin's yield that comes back late ends the spin and stops following for DA_SPIN_CALM_NS
 * (doorbell_ring.h); late_ns 0 never gives way. */
START_TEST(a_late_yield_stops_the_following_for_a_while) {
  const uint64_t us = 1000, t = 5000000000ull;
  da_spin_guard g = {.late_ns = DA_SPIN_LATE_NS};
  ck_assert(da_spin_guard_calm(&g, t));
  ck_assert(!da_spin_guard_late(&g, t, t + DA_SPIN_LATE_NS - 1)); /* in time */
  ck_assert(da_spin_guard_calm(&g, t + 1000 * us));
  ck_assert(da_spin_guard_late(&g, t, t + DA_SPIN_LATE_NS)); /* late: gives way */
  ck_assert_uint_eq(g.late, 1);
  ck_assert(!da_spin_guard_calm(&g, t + DA_SPIN_LATE_NS));
  ck_assert(!da_spin_guard_calm(&g, t + DA_SPIN_LATE_NS + DA_SPIN_CALM_NS - 1));
  ck_assert(da_spin_guard_calm(&g, t + DA_SPIN_LATE_NS + DA_SPIN_CALM_NS));
  da_spin_guard never = {.late_ns = 0};
  ck_assert(!da_spin_guard_late(&never, t, t + 10 * DA_SPIN_CALM_NS));
  ck_assert(da_spin_guard_calm(&never, t));
  ck_assert_uint_eq(never.late, 0);
}
END_TEST

static Suite *plugin_suite(void) {
  Suite *s = suite_create("plugin");
  TCase *t = tcase_create("fake_daemon");
  tcase_add_checked_fixture(t, NULL, reap_nng);
  tcase_set_timeout(t, 20);
  tcase_add_test(t, hello_returns_the_daemon_model_and_fingerprint);
  tcase_add_test(t, doorbell_spin_follows_the_last_call);
  tcase_add_test(t, a_late_yield_stops_the_following_for_a_while);
  tcase_add_test(t, forward_returns_outputs_of_every_item);
  tcase_add_test(t, daemon_status_and_message_reach_the_caller);
  tcase_add_test(t, forward_reply_of_wrong_length_is_internal_and_writes_nothing);
  tcase_add_test(t, no_daemon_gives_unavailable_at_the_deadline);
  tcase_add_test(t, daemon_started_after_connect_is_reached);
  tcase_add_test(t, silent_daemon_gives_deadline_exceeded);
  tcase_add_test(t, lost_connection_fails_the_call_and_never_resends_it);
  tcase_add_test(t, calls_in_flight_complete_out_of_order);
  tcase_add_test(t, threads_sharing_a_client_each_get_their_own_replies);
  tcase_add_test(t, bad_arguments_are_rejected_before_sending);
  tcase_add_test(t, close_cancels_calls_in_flight);
  tcase_add_test(t, error_messages_are_per_thread);
  suite_add_tcase(s, t);
  return s;
}

int main(void) {
  return da_test_run(plugin_suite());
}
