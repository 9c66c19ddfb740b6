/*
 * mbarrier.cuh — shared-memory addresses and mbarriers for every CUDA file that needs them
 * (sm_80 and sm_90): prefill_sm90.cu through sm90.cuh, combine.cu directly.
 */
#ifndef DA_CUDA_MBARRIER_CUH
#define DA_CUDA_MBARRIER_CUH

#include <stdint.h>

namespace da_cu {

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/* Whether the phase of the given parity has completed. On sm_90 try_wait may suspend the
 * thread until it does (or a time limit passes), leaving the issue slots to other warps. */
__device__ __forceinline__ bool mbar_try(uint32_t bar, uint32_t parity) {
  uint32_t ok;
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
#else
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
#endif
  return ok != 0;
}
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
/* Waits for the phase of the given parity to complete. A wait of more than 10 s means a
 * pipeline bug (a barrier that can never complete): the thread stores to address 0, so the
 * launch fails with an illegal-address error instead of hanging the device. (Not __trap():
 * a trap anywhere in a setmaxnreg.inc region makes ptxas allocate that region with the
 * kernel's entry register count, and the wgmma pipeline of prefill_sm90.cu spills.) */
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if (mbar_try(bar, parity)) return;
  const uint64_t t0 = global_ns();
  while (!mbar_try(bar, parity))
    if (global_ns() - t0 > 10000000000ull) asm volatile("st.global.u32 [%0], %1;" ::"l"(0ull), "r"(0u) : "memory");
}

} // namespace da_cu

#endif /* DA_CUDA_MBARRIER_CUH */
