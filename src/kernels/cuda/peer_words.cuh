// The peer collectives' flagged words (peer_collectives.h): 4 data bytes and a 4-byte flag, the
// call's number, stored together in 8 bytes over NVLink, so that a receiver that sees the flag
// has the data (an aligned 8-byte store arrives whole).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace dflash::cuda {

__device__ __forceinline__ void store_flagged(uint2* p, uint32_t word, uint32_t flag) {
  asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(word), "r"(flag) : "memory");
}

// Waits until the word at p carries `flag`. The stop flag lives in host memory (a read crosses
// PCIe): looked at once every 4096 polls; the word is then meaningless.
__device__ __forceinline__ uint32_t load_flagged(const uint2* p, uint32_t flag, const volatile int* stop) {
  for (uint32_t polls = 1;; ++polls) {
    uint32_t x, f;
    asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(x), "=r"(f) : "l"(p) : "memory");
    if (f == flag || (polls % 4096 == 0 && *stop)) return x;
  }
}

}  // namespace dflash::cuda
