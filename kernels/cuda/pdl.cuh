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
