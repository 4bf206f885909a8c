// What both attention kernels and their split combination agree on: which keys
// a query row sees, how its keys fall into splits, and how splits combine.
#pragma once

#include <cuda_bf16.h>

#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.h"

namespace dflash::cuda {

struct Visible {
  int begin, end;  // keys [begin, end)
};

__device__ __forceinline__ Visible visible_keys(const AttnRow& r, int window) {
  int end = r.causal ? min(r.position + 1, r.n_keys) : r.n_keys;
  int begin = window > 0 ? max(0, r.position - window + 1) : 0;
  return {begin, max(begin, end)};
}

// Splits count from key 0, so a row's splits depend only on its own visible keys.
__device__ __forceinline__ int n_splits_of(const Visible& v) { return (v.end + kAttnSplitKeys - 1) / kAttnSplitKeys; }

// The key-row slot of key `key` of a sequence through its page table.
__device__ __forceinline__ int64_t key_slot(const int32_t* pages, int key, int page_size) {
  return static_cast<int64_t>(pages[key / page_size]) * page_size + key % page_size;
}

// One warp combines the splits of one (row, head): `base` holds n_splits partials of
// (m, l, acc[hd]) floats. The normalizer goes over lanes (lane-strided, then a butterfly),
// the values in split order. Everything the first kBatch splits need is requested before any
// of it is used (one trip to L2 for a row of up to kBatch splits). Fixed orders, whatever the
// batch: batch-independent. Loads bypass L1: the partials come from another kernel.
// kDims: head dims per lane (head_dim <= 32 * kDims); it and kBatch change registers, not results.
template <int kDims>
__device__ __forceinline__ void combine_splits(const float* base, int n_splits, int hd, bf16* out) {
  constexpr int kBatch = kDims <= 4 ? 16 : 8;
  const int lane = threadIdx.x % 32, stride = hd + 2;
  float mb[kBatch], v[kBatch][kDims];  // a batch of splits: their maxima and this lane's values
  auto load_batch = [&](int s0) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int s = s0 + u;
      mb[u] = s < n_splits ? __ldcg(base + s * stride) : -INFINITY;
#pragma unroll
      for (int j = 0; j < kDims; ++j) {
        const int d = lane + 32 * j;
        v[u][j] = s < n_splits && d < hd ? __ldcg(base + s * stride + 2 + d) : 0.0f;  // every split writes its values
      }
    }
  };
  load_batch(0);
  const float m_lane = lane < n_splits ? __ldcg(base + lane * stride) : -INFINITY;
  const float l_lane = lane < n_splits ? __ldcg(base + lane * stride + 1) : 0.0f;
  float m = m_lane;
  for (int s = lane + 32; s < n_splits; s += 32) m = fmaxf(m, __ldcg(base + s * stride));
  m = warp_max(m);
  float l = m_lane != -INFINITY ? l_lane * __expf(m_lane - m) : 0.0f;
  for (int s = lane + 32; s < n_splits; s += 32) {
    const float ms = __ldcg(base + s * stride);
    if (ms != -INFINITY) l += __ldcg(base + s * stride + 1) * __expf(ms - m);
  }
  l = warp_sum(l);
  float a[kDims];
#pragma unroll
  for (int j = 0; j < kDims; ++j) a[j] = 0.0f;
  for (int s0 = 0; s0 < n_splits; s0 += kBatch) {
    if (s0 > 0) load_batch(s0);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const float c = mb[u] != -INFINITY ? __expf(mb[u] - m) : 0.0f;
#pragma unroll
      for (int j = 0; j < kDims; ++j) a[j] += v[u][j] * c;
    }
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  auto* o = reinterpret_cast<__nv_bfloat16*>(out);
#pragma unroll
  for (int j = 0; j < kDims; ++j) {
    const int d = lane + 32 * j;
    if (d < hd) o[d] = __float2bfloat16(a[j] * inv);
  }
}

}  // namespace dflash::cuda
