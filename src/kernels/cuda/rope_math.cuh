// Per-head RMSNorm + rotate-half RoPE, written once for the kernels that apply it: the norm +
// RoPE kernels (elementwise.cu), which hold a head in a warp, and the attention that rotates
// its own queries and new keys (attention_mma.cu), which holds a head in a quad of lanes. Both
// sum the squares in the same order and round the same operations (explicit _rn intrinsics:
// no contraction left to the compiler), so their results are bit-identical.
#pragma once

#include <cuda_bf16.h>

#include "kernels/cuda/device_math.cuh"

namespace dflash::cuda {

// The order of a head's sum of squares: piece p holds values [8p, 8p + 8), summed in order;
// part j (0..3) adds the pieces p with p % 4 == j in increasing p, starting from 0; the head's
// sum is (part0 + part1) + (part2 + part3).
__device__ __forceinline__ float piece_sumsq(const float (&v)[8], int n_valid) {
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (j < n_valid) s = __fmaf_rn(v[j], v[j], s);
  return s;
}
// The head's sum from the parts held by lanes 4m + j of every quad (every lane of the warp
// takes part; each quad's lanes end with their quad's sum, the same bits in each).
__device__ __forceinline__ float quad_sum_of_parts(float part) {
  const float pair = __fadd_rn(part, __shfl_xor_sync(kFull, part, 1));
  return __fadd_rn(pair, __shfl_xor_sync(kFull, pair, 2));
}
__device__ __forceinline__ float head_norm_scale(float sumsq, int head_dim, float eps) {
  return rsqrtf(__fadd_rn(__fdiv_rn(sumsq, static_cast<float>(head_dim)), eps));
}

// The rotation of pair i at position pos: what the norm + RoPE kernels compute in place and
// the rope table (launch_rope_table) holds for the attention.
__device__ __forceinline__ void rope_cos_sin(float pos, float inv_freq_i, float& cs, float& sn) {
  sincosf(__fmul_rn(pos, inv_freq_i), &sn, &cs);
}

// One rotation pair (i, i + head_dim / 2) of a head: normalized when norm (weights wa, wb),
// then rotated by the angle whose cosine and sine are cs and sn.
__device__ __forceinline__ void norm_rotate_pair(float& a, float& b, bool norm, float wa, float wb, float scale,
                                                 float cs, float sn) {
  if (norm) {
    a = __fmul_rn(wa, __fmul_rn(a, scale));
    b = __fmul_rn(wb, __fmul_rn(b, scale));
  }
  const float lo = __fmaf_rn(a, cs, -__fmul_rn(b, sn)), hi = __fmaf_rn(b, cs, __fmul_rn(a, sn));
  a = lo;
  b = hi;
}

}  // namespace dflash::cuda
