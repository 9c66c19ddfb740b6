#include "record.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "detattn.h"

void da_record_init(da_record *r, uint32_t n_layers) {
  memset(r, 0, sizeof(*r));
  r->n_layers = n_layers;
}

void da_record_fini(da_record *r) {
  if (!r) return;
  for (size_t i = 0; i < r->n_seqs; i++) free(r->seqs[i].h);
  free(r->seqs);
  memset(r, 0, sizeof(*r));
}

static int grow(da_record *r) {
  if (r->n_seqs < r->cap) return DETATTN_OK;
  size_t ncap = r->cap ? r->cap * 2 : 64;
  da_seq_hashes *n = realloc(r->seqs, ncap * sizeof(*n));
  if (!n) return DETATTN_RESOURCE_EXHAUSTED;
  r->seqs = n;
  r->cap = ncap;
  return DETATTN_OK;
}

int da_record_add(da_record *r, uint64_t index, uint32_t prompt, uint32_t output,
                  da_seq_hashes **out) {
  if (prompt == 0 || output == 0) return DETATTN_INVALID_ARGUMENT;
  if (grow(r) != DETATTN_OK) return DETATTN_RESOURCE_EXHAUSTED;
  da_seq_hashes *s = &r->seqs[r->n_seqs];
  s->index = index;
  s->prompt = prompt;
  s->output = output;
  s->n_tokens = prompt + output - 1;
  s->h = calloc((size_t)r->n_layers * s->n_tokens, sizeof(uint64_t));
  if (!s->h) return DETATTN_RESOURCE_EXHAUSTED;
  r->n_seqs++;
  *out = s;
  return DETATTN_OK;
}

int da_record_take(da_record *r, da_seq_hashes *s) {
  if (grow(r) != DETATTN_OK) return DETATTN_RESOURCE_EXHAUSTED;
  r->seqs[r->n_seqs++] = *s;
  s->h = NULL;
  return DETATTN_OK;
}

static int by_index(const void *a, const void *b) {
  uint64_t x = ((const da_seq_hashes *)a)->index, y = ((const da_seq_hashes *)b)->index;
  return x < y ? -1 : x > y;
}

void da_record_sort(da_record *r) {
  if (r->n_seqs > 1) qsort(r->seqs, r->n_seqs, sizeof(*r->seqs), by_index);
}

const da_seq_hashes *da_record_find(const da_record *r, uint64_t index) {
  size_t lo = 0, hi = r->n_seqs;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (r->seqs[mid].index < index) lo = mid + 1;
    else hi = mid;
  }
  return lo < r->n_seqs && r->seqs[lo].index == index ? &r->seqs[lo] : NULL;
}

int da_record_save(da_record *r, const char *path, char *msg, size_t msglen) {
  da_record_sort(r);
  FILE *f = fopen(path, "w");
  if (!f) {
    snprintf(msg, msglen, "cannot write record %s: %s", path, strerror(errno));
    return DETATTN_UNAVAILABLE;
  }
  fprintf(f, "detattn-load-record 1\nfingerprint %016" PRIx64 "\nnumerics %s\nworkload %s\n"
          "layers %" PRIu32 "\nsequences %zu\n", r->fingerprint, r->numerics, r->workload,
          r->n_layers, r->n_seqs);
  for (size_t i = 0; i < r->n_seqs; i++) {
    const da_seq_hashes *s = &r->seqs[i];
    fprintf(f, "seq %" PRIu64 " %" PRIu32 " %" PRIu32 "\n", s->index, s->prompt, s->output);
    for (uint32_t l = 0; l < r->n_layers; l++) {
      const uint64_t *h = s->h + (size_t)l * s->n_tokens;
      for (uint32_t t = 0; t < s->n_tokens; t++)
        fprintf(f, t ? " %016" PRIx64 : "%016" PRIx64, h[t]);
      fputc('\n', f);
    }
  }
  if (ferror(f) | (fclose(f) != 0)) {
    snprintf(msg, msglen, "error writing record %s", path);
    return DETATTN_UNAVAILABLE;
  }
  return DETATTN_OK;
}

/* Reads one line of any length into *buf; returns its length or -1 at end of file. */
static long read_line(FILE *f, char **buf, size_t *cap) {
  ssize_t n = getline(buf, cap, f);
  if (n < 0) return -1;
  if (n > 0 && (*buf)[n - 1] == '\n') (*buf)[--n] = '\0';
  return (long)n;
}

int da_record_load(da_record *r, const char *path, char *msg, size_t msglen) {
  da_record_init(r, 0);
  FILE *f = fopen(path, "r");
  if (!f) {
    snprintf(msg, msglen, "cannot open record %s: %s", path, strerror(errno));
    return DETATTN_NOT_FOUND;
  }
  char *line = NULL;
  size_t cap = 0;
  long lineno = 0;
  int version = 0;
  size_t n_seqs = 0;
#define NEXT() (lineno++, read_line(f, &line, &cap) >= 0)
  if (!NEXT() || sscanf(line, "detattn-load-record %d", &version) != 1 || version != 1) goto bad;
  if (!NEXT() || sscanf(line, "fingerprint %" SCNx64, &r->fingerprint) != 1) goto bad;
  if (!NEXT() || strncmp(line, "numerics ", 9) != 0) goto bad;
  snprintf(r->numerics, sizeof(r->numerics), "%s", line + 9);
  if (!NEXT() || strncmp(line, "workload ", 9) != 0) goto bad;
  snprintf(r->workload, sizeof(r->workload), "%s", line + 9);
  if (!NEXT() || sscanf(line, "layers %" SCNu32, &r->n_layers) != 1 || r->n_layers == 0) goto bad;
  if (!NEXT() || sscanf(line, "sequences %zu", &n_seqs) != 1) goto bad;
  for (size_t i = 0; i < n_seqs; i++) {
    uint64_t index;
    uint32_t prompt, output;
    da_seq_hashes *s;
    if (!NEXT() || sscanf(line, "seq %" SCNu64 " %" SCNu32 " %" SCNu32, &index, &prompt,
                          &output) != 3 || prompt == 0 || output == 0)
      goto bad;
    if (da_record_add(r, index, prompt, output, &s) != DETATTN_OK) goto bad;
    for (uint32_t l = 0; l < r->n_layers; l++) {
      if (!NEXT()) goto bad;
      char *p = line;
      for (uint32_t t = 0; t < s->n_tokens; t++) {
        char *end;
        errno = 0;
        s->h[(size_t)l * s->n_tokens + t] = strtoull(p, &end, 16);
        if (end == p || errno) goto bad;
        p = end;
      }
      while (*p == ' ') p++;
      if (*p) goto bad;
    }
  }
#undef NEXT
  free(line);
  fclose(f);
  da_record_sort(r);
  return DETATTN_OK;
bad:
  snprintf(msg, msglen, "record %s line %ld: malformed", path, lineno);
  free(line);
  fclose(f);
  da_record_fini(r);
  return DETATTN_DATA_LOSS;
}

void da_record_compare(const da_record *a, const da_record *b, da_record_diff *out) {
  memset(out, 0, sizeof(*out));
  out->fingerprints_differ = a->fingerprint != b->fingerprint;
  out->workloads_differ = strcmp(a->workload, b->workload) != 0;
  size_t i = 0, j = 0;
  while (i < a->n_seqs || j < b->n_seqs) {
    if (j >= b->n_seqs || (i < a->n_seqs && a->seqs[i].index < b->seqs[j].index)) {
      out->sequences_missing++;
      i++;
      continue;
    }
    if (i >= a->n_seqs || b->seqs[j].index < a->seqs[i].index) {
      out->sequences_missing++;
      j++;
      continue;
    }
    const da_seq_hashes *x = &a->seqs[i++], *y = &b->seqs[j++];
    if (x->prompt != y->prompt || x->output != y->output || a->n_layers != b->n_layers) {
      out->sequences_missing++;
      continue;
    }
    out->sequences_compared++;
    for (uint32_t l = 0; l < a->n_layers; l++) {
      for (uint32_t t = 0; t < x->n_tokens; t++) {
        size_t k = (size_t)l * x->n_tokens + t;
        out->outputs_compared++;
        if (x->h[k] == y->h[k]) continue;
        out->mismatches++;
        if (!out->have_first) {
          out->have_first = 1;
          out->first_seq = x->index;
          out->first_layer = l;
          out->first_token = t;
        }
      }
    }
  }
}
