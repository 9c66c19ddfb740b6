/*
 * devmem.h — device memory for the clients that test and measure the CUDA data plane
 * (detattn verify, detattn-step-bench, detattn-load): a thin layer over the CUDA runtime
 * in CUDA builds, and a stub that says so elsewhere. Synchronous; any thread.
 */
#ifndef DA_DEVMEM_H
#define DA_DEVMEM_H

#include <stddef.h>

/* 1 when this build can allocate device memory and a device is present; else 0 and why. */
int da_devmem_available(char *why, size_t len);
/* cudaMalloc of n bytes on the current device (device 0 unless set); NULL on failure. */
void *da_devmem_alloc(size_t n);
void da_devmem_free(void *p);
/* Blocking copies; 0 on success. */
int da_devmem_upload(void *dst, const void *src, size_t n);
int da_devmem_download(void *dst, const void *src, size_t n);
/* Waits for all work on the device (after calls whose outputs are read on the host). */
int da_devmem_sync(void);

#endif /* DA_DEVMEM_H */
