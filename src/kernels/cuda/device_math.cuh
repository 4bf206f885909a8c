// Small device helpers shared by the kernels: bf16 rounding and warp reductions
// (butterflies: every lane ends with the same result, in a fixed order).
#pragma once

#include <cuda_bf16.h>

namespace dflash::cuda {

// A float rounded to bf16 and back: what a torch op in bf16 stores.
__device__ __forceinline__ float round_bf(float v) { return __bfloat162float(__float2bfloat16(v)); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace dflash::cuda
