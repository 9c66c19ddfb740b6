/*
 * pdl.cuh — programmatic dependent launch (sm_90): a kernel launched with
 * cudaLaunchAttributeProgrammaticStreamSerialization may start while the kernel before it in
 * the stream still runs, once every CTA of that kernel has called da_pdl_trigger (or ended);
 * it must call da_pdl_wait before it touches memory that kernel writes or reads (the wait
 * returns when that grid has completed and its writes are visible). Every kernel of a step
 * triggers at its start, so the next one's prologue (barriers, its work items, page ids:
 * staged by copies that completed before) runs under it. No-ops before sm_90 and when the
 * kernel was launched without the attribute.
 */
#ifndef DA_CUDA_PDL_CUH
#define DA_CUDA_PDL_CUH

#include <cuda_runtime.h>

/* The launch configuration of grid x block (smem bytes of dynamic shared memory) on stream,
 * as a programmatic dependent when pdl (attr: the caller's, alive until the launch). */
static inline cudaLaunchConfig_t da_pdl_config(unsigned grid, unsigned block, size_t smem, cudaStream_t stream,
                                               cudaLaunchAttribute *attr, bool pdl) {
  attr->id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr->val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t lc = {};
  lc.gridDim = dim3(grid);
  lc.blockDim = dim3(block);
  lc.dynamicSmemBytes = smem;
  lc.stream = stream;
  lc.attrs = attr;
  lc.numAttrs = pdl ? 1 : 0;
  return lc;
}

__device__ __forceinline__ void da_pdl_trigger() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void da_pdl_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

#endif /* DA_CUDA_PDL_CUH */
