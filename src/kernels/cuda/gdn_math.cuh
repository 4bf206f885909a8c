// Device helpers shared by the Gated DeltaNet kernels (gated_delta_net.cu, gdn_chunked.cu): the
// segment fields, the gates, and q/k normalization.
#pragma once

#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/gated_delta_net.h"

namespace dflash::cuda {

constexpr int kGdnRowsPerLane = 8;  // k_dim <= 256: a warp holds a row of q or k, 8 values a lane

__device__ __forceinline__ float gdn_silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float gdn_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float gdn_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Segment i of the staged fields (GdnSegment packed as kSegFields ints).
__device__ __forceinline__ GdnSegment gdn_segment(const int32_t* segs, int i) {
  const int32_t* s = segs + i * kSegFields;
  return {s[0], s[1], s[2], s[3], s[4], s[5] != 0, s[6] != 0};
}

// A row's q and k of key head kh as one warp holds them (lane: dims lane, lane + 32, ...),
// L2-normalized, q also scaled by k_dim^-1/2.
__device__ __forceinline__ void gdn_normalize_qk(float (&q)[kGdnRowsPerLane], float (&k)[kGdnRowsPerLane],
                                                 float q_scale) {
  float qq = 0.0f, kk = 0.0f;
#pragma unroll
  for (int m = 0; m < kGdnRowsPerLane; ++m) {
    qq += q[m] * q[m];
    kk += k[m] * k[m];
  }
  const float q_inv = rsqrtf(warp_sum(qq) + 1e-6f) * q_scale, k_inv = rsqrtf(warp_sum(kk) + 1e-6f);
#pragma unroll
  for (int m = 0; m < kGdnRowsPerLane; ++m) {
    q[m] *= q_inv;
    k[m] *= k_inv;
  }
}

// beta = sigmoid(b), rounded to bf16 as transformers in bf16 rounds it.
__device__ __forceinline__ float gdn_beta(float b) { return round_bf(gdn_sigmoid(b)); }
// g = -exp(A_log) * softplus(a + dt_bias): the state decays by exp(g) at a row.
__device__ __forceinline__ float gdn_log_decay(float a, float a_log_h, float dt_bias_h) {
  return -expf(a_log_h) * gdn_softplus(a + dt_bias_h);
}

}  // namespace dflash::cuda
