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
  if constexpr (kFirst == 0) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, "
        "%33, 1, 1, 1, 0, 0;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b));
  } else {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, "
        "%33, 1, 1, 1, 0, 0;"
        : "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b));
  }
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
