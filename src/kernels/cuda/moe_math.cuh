// The routing of one token by one warp: shared by the routing kernel (moe.cu) and the routed
// MLP of a single token (moe_token.cu), so that both choose the same experts with the same
// weights, bit for bit.
#pragma once

#include <cfloat>
#include <cstdint>

#include "kernels/cuda/device_math.cuh"

namespace dflash::cuda {

// The better of two candidates: larger probability, else the lower expert index.
__device__ __forceinline__ bool moe_better(float p, int e, float q, int f) { return p > q || (p == q && e < f); }

// The calling warp routes one token: logit(e) gives its router logit for expert e < E <= 32 *
// kPerLane; p = softmax in float32, then top_k rounds of a warp-wide best untaken expert. Each
// chosen expert is passed once to emit(j, e, weight) by the lane that holds it: j its rank among
// the chosen in increasing expert index (the order of the weighted sum), weight its p (divided by
// the chosen experts' sum, taken in rank order, with norm).
template <int kPerLane, typename Logit, typename Emit>
__device__ __forceinline__ void route_token(Logit logit, int E, int top_k, bool norm, Emit emit) {
  const int lane = threadIdx.x % 32;
  float p[kPerLane];
  float m = -FLT_MAX;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? logit(e) : -FLT_MAX;
    m = fmaxf(m, p[i]);
  }
  m = warp_max(m);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? expf(p[i] - m) : 0.0f;
    sum += p[i];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) p[i] = lane + 32 * i < E ? p[i] / sum : -1.0f;  // -1: no expert

  uint32_t taken = 0;  // bit i: this lane's expert lane + 32 i is chosen
  float top_sum = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    float bp = -2.0f;
    int be = INT32_MAX;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      if (!(taken >> i & 1) && p[i] >= 0.0f && moe_better(p[i], e, bp, be)) bp = p[i], be = e;
    }
    // The warp's best: the largest probability (as the bits of a non-negative float, which order
    // as unsigned integers; 0: none), then the lowest expert holding it. Two warp reductions
    // instead of five rounds of two shuffles.
    const unsigned key = bp >= 0.0f ? __float_as_uint(fabsf(bp)) + 1u : 0u;
    const unsigned best = __reduce_max_sync(kFull, key);
    const unsigned best_e = __reduce_min_sync(kFull, key == best ? static_cast<unsigned>(be) : 0xFFFFFFFFu);
    if (best == 0u) bp = -2.0f, be = INT32_MAX;
    else bp = __uint_as_float(best - 1u), be = static_cast<int>(best_e);
    if (be % 32 == lane) taken |= 1u << (be / 32);
    top_sum += bp;  // in rank order
  }
  int before = 0;  // chosen experts of lower index than this lane's i-th
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const uint32_t chosen = __ballot_sync(kFull, taken >> i & 1);
    if (taken >> i & 1) emit(before + __popc(chosen & ((1u << lane) - 1u)), lane + 32 * i, norm ? p[i] / top_sum : p[i]);
    before += __popc(chosen);
  }
}

}  // namespace dflash::cuda
