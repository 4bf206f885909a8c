// A barrier across all blocks of a grid, for kernels whose grid the host has checked to be
// resident on the GPU at once (occupancy x SMs >= blocks), so that no block waits for one
// that cannot start. Two words of device memory, zero before the first use; a generation
// count lets consecutive launches reuse them without a reset.
#pragma once

namespace dflash::cuda {

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every block's writes before the barrier are visible to every block after it.
__device__ __forceinline__ void grid_barrier(unsigned* bar) {
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* count = bar;
    unsigned* gen = bar + 1;
    const unsigned g = load_acquire(gen);
    __threadfence();
    if (atomicAdd(count, 1u) == gridDim.x * gridDim.y * gridDim.z - 1) {
      atomicExch(count, 0u);
      __threadfence();
      atomicAdd(gen, 1u);
    } else {
      while (load_acquire(gen) == g) __nanosleep(32);
    }
    __threadfence();
  }
  __syncthreads();
}

}  // namespace dflash::cuda
