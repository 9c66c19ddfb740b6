#include <stdio.h>

#include "devmem.h"

int da_devmem_available(char *why, size_t len) {
  snprintf(why, len, "this build has no CUDA (configure with -DDETATTN_CUDA=ON)");
  return 0;
}

void *da_devmem_alloc(size_t n) {
  (void)n;
  return NULL;
}

void da_devmem_free(void *p) { (void)p; }

int da_devmem_upload(void *dst, const void *src, size_t n) {
  (void)dst, (void)src, (void)n;
  return -1;
}

int da_devmem_download(void *dst, const void *src, size_t n) {
  (void)dst, (void)src, (void)n;
  return -1;
}

int da_devmem_sync(void) { return -1; }
