/*
 * fuzz_request.c — libFuzzer harness for the daemon's request decoder and validation
 * (server/wire.c: da_wire_decode), with a model and limits like a small daemon's. Every
 * input must decode to a status with a message, or to consistent fields whose tensors lie
 * inside the input (ASan checks the reads); nothing may leak.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  da_wire_limits lim = {.model = {.n_layers = 4, .n_q_heads = 8, .n_kv_heads = 2, .head_dim = 64, .dtype = DA_BF16,
                                  .scale = 0.125f},
                        .max_request_tokens = 512, .max_message_bytes = 1 << 20,
                        .decode_bytes = 4 * size + (64 << 10)};
  da_wire_request r;
  int st = da_wire_decode(&lim, data, size, &r);
  if (st != r.status) abort();
  if (st != 0 && r.err[0] == '\0') abort(); /* every refusal says why */
  if (st == 0 && r.op == DA_OP_FORWARD) {
    size_t qrow = 8 * 64 * 2, kvrow = 2 * 64 * 2;
    long total = 0;
    for (int i = 0; i < r.n_seqs; i++) {
      const da_wire_fwd_seq *s = &r.seqs[i];
      if (s->n_tokens <= 0 || s->q.len != (size_t)s->n_tokens * qrow || s->k.len != (size_t)s->n_tokens * kvrow)
        abort();
      total += s->n_tokens;
      volatile uint8_t sink = 0;
      const da_wire_tensor *t[3] = {&s->q, &s->k, &s->v};
      for (int j = 0; j < 3; j++)
        if (t[j]->data) {
          const uint8_t *p = t[j]->data;
          for (size_t b = 0; b < t[j]->len; b += 61) sink ^= p[b];
          sink ^= p[t[j]->len - 1];
        }
      (void)sink;
    }
    if (total != r.n_tokens || total > lim.max_request_tokens || r.layer < 0 || r.layer >= 4) abort();
  }
  da_wire_request_fini(&r);
  return 0;
}
