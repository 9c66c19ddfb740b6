/*
 * fuzz_reply.c — libFuzzer harness for libdetattn's reply decoder (da_call_deliver: what
 * detattn_call_wait does with the bytes a daemon sends back to a Forward). The first input
 * byte picks the call's shape (1-4 sequences of 1-8 tokens, with or without lse); the rest
 * is the reply. A hostile daemon must not crash the client, make it read or write outside
 * the caller's buffers (ASan: each buffer is allocated exactly), or leak.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "client_impl.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  uint8_t shape = data[0];
  size_t n = 1 + (shape & 3);
  int want_lse = (shape >> 2) & 1;
  detattn_call k;
  memset(&k, 0, sizeof k);
  k.id = 1;
  k.op = 7; /* Request.forward */
  k.model = (detattn_model){.n_layers = 2, .n_q_heads = 4, .n_kv_heads = 2, .head_dim = 64, .dtype = DETATTN_BF16};
  k.want_lse = want_lse;
  k.n_out = n;
  da_call_out out[4];
  memset(out, 0, sizeof out);
  for (size_t i = 0; i < n; i++) {
    out[i].n_tokens = 1 + (uint32_t)((shape >> (3 + i)) & 1) * 7;
    out[i].o = malloc((size_t)out[i].n_tokens * 4 * 64 * 2);
    out[i].lse = want_lse ? malloc((size_t)out[i].n_tokens * 4 * 4) : NULL;
  }
  k.out = out;
  int st = da_call_deliver(&k, data + 1, size - 1);
  (void)st;
  for (size_t i = 0; i < n; i++) {
    free(out[i].o);
    free(out[i].lse);
  }
  return 0;
}
