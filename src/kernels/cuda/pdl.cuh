// Programmatic dependent launch (Hopper and later): a kernel may start while
// the kernel before it in the stream is still finishing, so the launch latency
// and the previous kernel's tail overlap. Every kernel launched through
// `launch` calls pdl_wait() before it touches memory that an earlier kernel
// writes (or reads: the wait also orders writes after earlier reads), and then
// pdl_release() so that the next kernel may be scheduled (pdl_begin() does
// both). Work that needs no earlier result, such as prefetching weights, may
// come before that. So may reads of batch metadata that the host stages (positions,
// attention rows, page tables): the staging copies precede the kernel in the stream, a
// kernel after a copy starts only once the copy is done, and no kernel writes them.
//
// Every kernel waits unconditionally, before any early return: a kernel then
// completes only after its predecessor has, so ordering stays transitive. A kernel
// whose predecessor releases only after its own wait (the products: pdl_begin) may
// also read, before its wait, what kernels before that predecessor wrote: they are
// complete once it runs (the fused attention's cached keys and values).
// Kernels that fill the SMs and come before a product (attention, the split
// combine) release at their end instead: a product launched early would place
// its blocks on the few SMs already free and run on part of the GPU. The RMSNorm
// kernel between two products (a few blocks) releases before its wait, so that
// the product after it starts streaming while the one before it finishes.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"

namespace dflash::cuda {

// Set once by the backend: on where the device has it (Hopper and later). Kernels compiled for
// earlier architectures have no griddepcontrol instructions (below) and launch as usual.
inline bool g_pdl_enabled = false;

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The usual start of a kernel: wait for the previous kernel, then let the next one be scheduled.
__device__ __forceinline__ void pdl_begin() {
  pdl_wait();
  pdl_release();
}

// kernel<<<grid, block, smem, s>>>(args...), allowed to overlap its predecessor when PDL is on.
template <typename... Params, typename... Args>
void launch_smem(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = g_pdl_enabled ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...));
}

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t s, Args... args) {
  launch_smem(kernel, grid, block, 0, s, args...);
}

}  // namespace dflash::cuda
