/* gen_corpus.c — writes a seed corpus of valid messages for the fuzzers: requests of every
 * op (forwards of several shapes) and Forward replies (the first byte is fuzz_reply.c's
 * shape byte). Usage: gen_corpus <request dir> <reply dir> */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "detattn.pb-c.h"

static void put(const char *dir, const char *name, const uint8_t *pre, size_t npre, const uint8_t *b, size_t n) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  if (!f) exit(1);
  fwrite(pre, 1, npre, f);
  fwrite(b, 1, n, f);
  fclose(f);
}

static void put_req(const char *dir, const char *name, Detattn__V1__Request *rq) {
  uint8_t *b = malloc(detattn__v1__request__get_packed_size(rq) + 1);
  size_t n = detattn__v1__request__pack(rq, b);
  put(dir, name, NULL, 0, b, n);
  free(b);
}

int main(int argc, char **argv) {
  if (argc != 3) return 2;
  static uint8_t bytes[8 * 8 * 64 * 2];
  for (size_t i = 0; i < sizeof bytes; i++) bytes[i] = (uint8_t)(i * 37 + 11);
  Detattn__V1__Request rq = DETATTN__V1__REQUEST__INIT;
  Detattn__V1__Hello h = DETATTN__V1__HELLO__INIT;
  rq.id = 1;
  rq.op_case = DETATTN__V1__REQUEST__OP_HELLO;
  rq.hello = &h;
  put_req(argv[1], "hello", &rq);
  Detattn__V1__SeqTruncate t = DETATTN__V1__SEQ_TRUNCATE__INIT;
  t.seq = 4294967296ull;
  t.length = 5;
  rq.op_case = DETATTN__V1__REQUEST__OP_SEQ_TRUNCATE;
  rq.seq_truncate = &t;
  put_req(argv[1], "truncate", &rq);
  Detattn__V1__RegisterArena ra = DETATTN__V1__REGISTER_ARENA__INIT;
  ra.size = 1 << 20;
  rq.op_case = DETATTN__V1__REQUEST__OP_REGISTER_ARENA;
  rq.register_arena = &ra;
  put_req(argv[1], "register_arena", &rq);
  for (int shape = 0; shape < 4; shape++) {
    Detattn__V1__ForwardSeq s[3], *sp[3];
    Detattn__V1__TensorRef ref[5];
    Detattn__V1__Forward f = DETATTN__V1__FORWARD__INIT;
    int n = 1 + shape % 3;
    for (int i = 0; i < n; i++) {
      Detattn__V1__ForwardSeq init = DETATTN__V1__FORWARD_SEQ__INIT;
      s[i] = init;
      s[i].seq = 4294967296ull + (uint64_t)i;
      s[i].pos = (uint32_t)(i * 3);
      s[i].n_tokens = (uint32_t)(1 + i);
      if (shape == 3) { /* by reference */
        for (int j = 0; j < 5; j++) {
          Detattn__V1__TensorRef r0 = DETATTN__V1__TENSOR_REF__INIT;
          ref[j] = r0;
          ref[j].arena = 1;
          ref[j].offset = (uint64_t)j * 4096;
          ref[j].length = j == 0 || j == 3 ? (uint64_t)s[i].n_tokens * 1024 : j == 4 ? s[i].n_tokens * 32u : s[i].n_tokens * 256u;
        }
        s[i].q_ref = &ref[0], s[i].k_ref = &ref[1], s[i].v_ref = &ref[2], s[i].o_ref = &ref[3], s[i].lse_ref = &ref[4];
      } else {
        s[i].q = (ProtobufCBinaryData){(size_t)s[i].n_tokens * 1024, bytes};
        s[i].k = (ProtobufCBinaryData){(size_t)s[i].n_tokens * 256, bytes};
        s[i].v = (ProtobufCBinaryData){(size_t)s[i].n_tokens * 256, bytes};
      }
      sp[i] = &s[i];
    }
    f.layer = (uint32_t)shape;
    f.n_seqs = (size_t)n;
    f.seqs = sp;
    f.want_lse = shape == 3;
    rq.op_case = DETATTN__V1__REQUEST__OP_FORWARD;
    rq.forward = &f;
    char name[32];
    snprintf(name, sizeof name, "forward%d", shape);
    put_req(argv[1], name, &rq);
  }
  /* Replies to a Forward of the shape byte's sequences (model 4 q heads, d 64). */
  for (int shape = 0; shape < 8; shape++) {
    uint8_t sb = (uint8_t)shape;
    int n = 1 + (shape & 3), lse = (shape >> 2) & 1;
    Detattn__V1__Response r = DETATTN__V1__RESPONSE__INIT;
    Detattn__V1__Status st = DETATTN__V1__STATUS__INIT;
    Detattn__V1__ForwardReply fr = DETATTN__V1__FORWARD_REPLY__INIT;
    Detattn__V1__ForwardSeqOut so[4], *sop[4];
    for (int i = 0; i < n; i++) {
      Detattn__V1__ForwardSeqOut init = DETATTN__V1__FORWARD_SEQ_OUT__INIT;
      so[i] = init;
      so[i].o = (ProtobufCBinaryData){4 * 64 * 2, bytes};
      if (lse) so[i].lse = (ProtobufCBinaryData){4 * 4, bytes};
      sop[i] = &so[i];
    }
    fr.n_seqs = (size_t)n;
    fr.seqs = sop;
    r.id = 1;
    r.status = &st;
    r.result_case = DETATTN__V1__RESPONSE__RESULT_FORWARD;
    r.forward = &fr;
    uint8_t *b = malloc(detattn__v1__response__get_packed_size(&r) + 1);
    size_t len = detattn__v1__response__pack(&r, b);
    char name[32];
    snprintf(name, sizeof name, "reply%d", shape);
    put(argv[2], name, &sb, 1, b, len);
    free(b);
  }
  return 0;
}
