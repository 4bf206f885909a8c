// Hopper warpgroup products (wgmma, sm_90a) for the kernels that use them: shared-memory operand
// descriptors for K-major tiles in the 128-byte swizzle, the m64n64k16 bf16 product with float32
// accumulators, and the fences around it. Compiled for other targets, the product traps: callers
// take these kernels only where wgmma_built() says the device runs sm_90a code.
#pragma once

#include <cstdint>

namespace dflash::cuda {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DFLASH_WGMMA 1
#endif

// A K-major operand in the 128-byte swizzle: rows of 128 bytes (64 bf16), 16-byte piece c of row r
// stored at piece c ^ (r % 8), 8-row groups 1024 bytes apart, the tile 1024-byte aligned; `p`
// points into row 0 at the k16 step's first byte (32 bytes a step).
__device__ __forceinline__ uint64_t sw128_desc(const void* p) {
  const uint64_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  constexpr uint64_t sbo = 1024;  // next 8-row group; the leading offset is unused with the swizzle
  return ((a & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | ((sbo >> 4) << 32) | (uint64_t{1} << 62);
}

// d[kFirst + 4 j + i] += A (64 rows) * B (64 columns) over 16 k, for the calling warpgroup: warp q
// of the warpgroup holds rows 16 q + lane / 4 (+ 8 for i & 2), columns 8 j + 2 (lane % 4) (+ 1 for
// odd i), j < 8.
template <int kFirst>
__device__ __forceinline__ void wgmma_64x64(float (&d)[64], uint64_t a, uint64_t b) {
  static_assert(kFirst == 0 || kFirst == 32, "two halves of 64 accumulators");
#ifdef DFLASH_WGMMA
#define DFLASH_ACC4(i) "+f"(d[kFirst + i]), "+f"(d[kFirst + i + 1]), "+f"(d[kFirst + i + 2]), "+f"(d[kFirst + i + 3])
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
      "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, "
      "%33, 1, 1, 1, 0, 0;"
      : DFLASH_ACC4(0), DFLASH_ACC4(4), DFLASH_ACC4(8), DFLASH_ACC4(12), DFLASH_ACC4(16), DFLASH_ACC4(20),
        DFLASH_ACC4(24), DFLASH_ACC4(28)
      : "l"(a), "l"(b));
#undef DFLASH_ACC4
#else
  __trap();
#endif
}

// Before a warpgroup's products: its earlier register accesses come first.
__device__ __forceinline__ void wgmma_fence() {
#ifdef DFLASH_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

// Commits the warpgroup's products issued so far and waits for all of them; the accumulators may
// be read after it (the empty statements keep the compiler from moving their uses above the wait).
__device__ __forceinline__ void wgmma_commit_wait(float (&d)[64]) {
#ifdef DFLASH_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#endif
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Copies by cp.async become visible to the warpgroup products (another proxy) after this, once
// the block's barrier follows.
__device__ __forceinline__ void fence_proxy_async() {
#ifdef DFLASH_WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

}  // namespace dflash::cuda
