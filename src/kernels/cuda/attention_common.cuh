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

// Splits combine in split order, one at a time, into a running (m, l, acc) that starts empty
// (-inf, 0, 0): merge_coef takes the next split's maximum and gives the two scale factors, then
// merged() scales each of l and acc. The roundings are spelled out (no contraction left to the
// compiler), so the combine kernel and the attention kernel that combines its own splits
// (attention_mma.cu) compute the same bits.
struct MergeCoef {
  float self, other;
  bool skip;  // neither has a visible key: the state stays as it is
};
__device__ __forceinline__ MergeCoef merge_coef(float& m, float m_split) {
  const float m_new = fmaxf(m, m_split);
  if (m_new == -INFINITY) return {1.0f, 0.0f, true};
  const MergeCoef c{__expf(m - m_new), __expf(m_split - m_new), false};
  m = m_new;
  return c;
}
__device__ __forceinline__ float merged(float x, float x_split, const MergeCoef& c) {
  return __fmaf_rn(x, c.self, __fmul_rn(x_split, c.other));
}
// The output value of a combined state: acc / l (0 for a row that saw no key).
__device__ __forceinline__ float inverse_of_sum(float l) { return l > 0.0f ? __fdiv_rn(1.0f, l) : 0.0f; }

// One warp combines the splits of one (row, head), or of its dims from dim0 on: `base` holds
// n_splits partials of (m, l, acc[hd]) floats, merged in split order as above. Everything kBatch
// splits need is requested before any of it is used (one trip to L2 for a row of up to kBatch
// splits). Loads bypass L1: the partials come from another kernel. kDims: head dims per lane
// (dims dim0 .. dim0 + 32 * kDims - 1); it, dim0 and kBatch change registers, not results (every
// dim is combined on its own, with the same m and l).
template <int kDims>
__device__ __forceinline__ void combine_splits(const float* base, int n_splits, int hd, bf16* out, int dim0 = 0) {
  constexpr int kBatch = kDims <= 4 ? 16 : 8;
  const int lane = threadIdx.x % 32, stride = hd + 2;
  float mb[kBatch], lb[kBatch], v[kBatch][kDims];  // a batch of splits: maxima, sums, this lane's values
  float m = -INFINITY, l = 0.0f, a[kDims];
#pragma unroll
  for (int j = 0; j < kDims; ++j) a[j] = 0.0f;
  // Predicated loads from a pointer walked a split at a time: the branches and address work of
  // guarded __ldcg loads were 511 of the 16-row combine's 919 instructions a warp before its first
  // merge (Nsight Compute, H200: bench/results/ncu_h200_attention_b1_moe.txt).
  const float* split_at = base;
  for (int s0 = 0; s0 < n_splits; s0 += kBatch) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const bool ok = s0 + u < n_splits;
      mb[u] = ldcg_if(split_at, ok, -INFINITY);
      lb[u] = ldcg_if(split_at + 1, ok, 0.0f);
#pragma unroll
      for (int j = 0; j < kDims; ++j) {
        const int d = dim0 + lane + 32 * j;
        v[u][j] = ldcg_if(split_at + 2 + d, ok && d < hd, 0.0f);  // every split writes its values
      }
      split_at += stride;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (s0 + u >= n_splits) break;
      const MergeCoef c = merge_coef(m, mb[u]);
      if (c.skip) continue;
      l = merged(l, lb[u], c);
#pragma unroll
      for (int j = 0; j < kDims; ++j) a[j] = merged(a[j], v[u][j], c);
    }
  }
  const float inv = inverse_of_sum(l);
  auto* o = reinterpret_cast<__nv_bfloat16*>(out);
#pragma unroll
  for (int j = 0; j < kDims; ++j) {
    const int d = dim0 + lane + 32 * j;
    if (d < hd) o[d] = __float2bfloat16(__fmul_rn(a[j], inv));
  }
}

}  // namespace dflash::cuda
