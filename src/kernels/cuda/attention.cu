// Attention over the paged KV cache with GQA, one kernel for every mode:
// decode (one query), verification (causal inside the block), the draft block
// (no mask) and prefill. A warp owns one (query row, head, split); a split is
// kAttnSplitKeys consecutive key positions, counted from key 0, so a row's
// splits and their combination order depend only on that row's visible keys:
// a token's attention output is the same alone or inside a batch.
//
// In a split, lane j scores key base + j (a full dot product over head_dim),
// the warp keeps an online softmax, and lane l accumulates output dims
// l, l + 32, ... . Several splits are combined by a second kernel.
#include <cuda_bf16.h>

#include <cmath>

#include "kernels/cuda/launch.h"

namespace dflash::cuda {
namespace {

constexpr int kHeadsPerBlock = 4;
constexpr int kMaxHeadDim = 256;

struct Visible {
  int begin, end;  // keys [begin, end)
};

__device__ __forceinline__ Visible visible_keys(const AttnRow& r, int window) {
  int end = r.causal ? min(r.position + 1, r.n_keys) : r.n_keys;
  int begin = window > 0 ? max(0, r.position - window + 1) : 0;
  return {begin, max(begin, end)};
}

__device__ __forceinline__ int n_splits_of(const Visible& v) { return (v.end + kAttnSplitKeys - 1) / kAttnSplitKeys; }

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ const __nv_bfloat16* key_row(const bf16* cache, int64_t stride, const int32_t* pages,
                                                        int page_size, int key, int kv_head, int head_dim) {
  const int64_t slot = static_cast<int64_t>(pages[key / page_size]) * page_size + key % page_size;
  return reinterpret_cast<const __nv_bfloat16*>(cache + slot * stride + static_cast<int64_t>(kv_head) * head_dim);
}

// DPL: output dims per lane (head_dim <= 32 * DPL).
template <int DPL>
__global__ void __launch_bounds__(32 * kHeadsPerBlock)
    attention_kernel(const bf16* q, int64_t q_stride, const bf16* kc, int64_t k_stride, const bf16* vc,
                     int64_t v_stride, const AttnRow* rows, const int32_t* page_tables, AttnShape shp,
                     float* workspace, int max_splits, bf16* out, int64_t out_stride) {
  __shared__ float q_s[kHeadsPerBlock][kMaxHeadDim];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int head_groups = (shp.n_heads + kHeadsPerBlock - 1) / kHeadsPerBlock;
  const int row = blockIdx.x / head_groups;
  const int head = (blockIdx.x % head_groups) * kHeadsPerBlock + warp;
  const int split = blockIdx.y;
  const AttnRow r = rows[row];
  const Visible vis = visible_keys(r, shp.sliding_window);
  const int n_splits = n_splits_of(vis);
  if (head >= shp.n_heads || (split >= n_splits && !(split == 0 && n_splits == 0))) return;
  const int hd = shp.head_dim;
  const int kv_head = head / (shp.n_heads / shp.n_kv_heads);
  const float scale = rsqrtf(static_cast<float>(hd));
  const auto* qv = reinterpret_cast<const __nv_bfloat16*>(q + row * q_stride + static_cast<int64_t>(head) * hd);
  for (int d = lane; d < hd; d += 32) q_s[warp][d] = __bfloat162float(qv[d]) * scale;
  __syncwarp();

  const int32_t* pages = page_tables + r.page_offset;
  const int lo = max(vis.begin, split * kAttnSplitKeys), hi = min(vis.end, (split + 1) * kAttnSplitKeys);
  float m = -INFINITY, l = 0.0f, acc[DPL];
#pragma unroll
  for (int i = 0; i < DPL; ++i) acc[i] = 0.0f;
  for (int base = split * kAttnSplitKeys; base < hi; base += 32) {
    const int key = base + lane;
    float score = -INFINITY;
    if (key >= lo && key < hi) {
      const __nv_bfloat16* kr = key_row(kc, k_stride, pages, shp.page_size, key, kv_head, hd);
      float s = 0.0f;
      for (int d = 0; d < hd; d += 8) {
        const uint4 raw = *reinterpret_cast<const uint4*>(kr + d);
        const auto* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __bfloat1622float2(h2[i]);
          s += q_s[warp][d + 2 * i] * f.x + q_s[warp][d + 2 * i + 1] * f.y;
        }
      }
      score = s;
    }
    const float m_new = fmaxf(m, warp_max(score));
    if (m_new == -INFINITY) continue;  // nothing visible yet
    const float p = score == -INFINITY ? 0.0f : __expf(score - m_new);
    const float correction = __expf(m - m_new);
    l = l * correction + warp_sum(p);
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[i] *= correction;
    m = m_new;
    const int n_here = min(32, hi - base);
    for (int j = 0; j < n_here; ++j) {
      const float pj = __shfl_sync(0xffffffffu, p, j);
      if (base + j < lo) continue;
      const __nv_bfloat16* vr = key_row(vc, v_stride, pages, shp.page_size, base + j, kv_head, hd);
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const int d = lane + 32 * i;
        if (d < hd) acc[i] += pj * __bfloat162float(vr[d]);
      }
    }
  }

  if (n_splits <= 1) {
    auto* o = reinterpret_cast<__nv_bfloat16*>(out + row * out_stride + static_cast<int64_t>(head) * hd);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const int d = lane + 32 * i;
      if (d < hd) o[d] = __float2bfloat16(acc[i] * inv);
    }
    return;
  }
  float* part = workspace + ((static_cast<int64_t>(row) * shp.n_heads + head) * max_splits + split) * (hd + 2);
  if (lane == 0) part[0] = m, part[1] = l;
#pragma unroll
  for (int i = 0; i < DPL; ++i) {
    const int d = lane + 32 * i;
    if (d < hd) part[2 + d] = acc[i];
  }
}

// One warp per (row, head): combines the row's splits in split order.
__global__ void combine_kernel(const AttnRow* rows, int n_rows, AttnShape shp, const float* workspace,
                               int max_splits, bf16* out, int64_t out_stride) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (item >= static_cast<int64_t>(n_rows) * shp.n_heads) return;
  const int lane = threadIdx.x % 32, hd = shp.head_dim;
  const int row = static_cast<int>(item / shp.n_heads), head = static_cast<int>(item % shp.n_heads);
  const int n_splits = n_splits_of(visible_keys(rows[row], shp.sliding_window));
  if (n_splits <= 1) return;  // written directly by attention_kernel
  const float* base = workspace + item * max_splits * (hd + 2);
  float m = -INFINITY;
  for (int s = 0; s < n_splits; ++s) m = fmaxf(m, base[s * (hd + 2)]);
  float l = 0.0f;
  for (int s = 0; s < n_splits; ++s) {
    const float ms = base[s * (hd + 2)];
    if (ms != -INFINITY) l += base[s * (hd + 2) + 1] * __expf(ms - m);
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  auto* o = reinterpret_cast<__nv_bfloat16*>(out + row * out_stride + static_cast<int64_t>(head) * hd);
  for (int d = lane; d < hd; d += 32) {
    float a = 0.0f;
    for (int s = 0; s < n_splits; ++s) {
      const float ms = base[s * (hd + 2)];
      if (ms != -INFINITY) a += base[s * (hd + 2) + 2 + d] * __expf(ms - m);
    }
    o[d] = __float2bfloat16(a * inv);
  }
}

int max_splits_for(int max_keys) { return (max_keys + kAttnSplitKeys - 1) / kAttnSplitKeys; }

}  // namespace

int64_t attention_workspace_bytes(int n_rows, int max_keys, const AttnShape& shape) {
  const int splits = max_splits_for(max_keys);
  if (splits <= 1) return 0;
  return static_cast<int64_t>(n_rows) * shape.n_heads * splits * (shape.head_dim + 2) * sizeof(float);
}

void launch_attention(const Mat& q, const Mat& k_cache, const Mat& v_cache, const AttnRow* rows, int n_rows,
                      int max_keys, const int32_t* page_tables, const AttnShape& shp, float* workspace, Mat out,
                      cudaStream_t s) {
  if (n_rows == 0) return;
  const int splits = max_splits_for(max_keys) > 0 ? max_splits_for(max_keys) : 1;
  const int head_groups = (shp.n_heads + kHeadsPerBlock - 1) / kHeadsPerBlock;
  const dim3 grid(static_cast<unsigned>(n_rows * head_groups), static_cast<unsigned>(splits));
  const int dpl = (shp.head_dim + 31) / 32;
  auto run = [&](auto kernel) {
    kernel<<<grid, 32 * kHeadsPerBlock, 0, s>>>(q.data, q.stride, k_cache.data, k_cache.stride, v_cache.data,
                                                v_cache.stride, rows, page_tables, shp, workspace, splits, out.data,
                                                out.stride);
  };
  if (dpl <= 1) run(attention_kernel<1>);
  else if (dpl <= 2) run(attention_kernel<2>);
  else if (dpl <= 4) run(attention_kernel<4>);
  else run(attention_kernel<8>);
  if (splits > 1) {
    const int64_t items = static_cast<int64_t>(n_rows) * shp.n_heads;
    combine_kernel<<<static_cast<unsigned>((items + 3) / 4), 128, 0, s>>>(rows, n_rows, shp, workspace, splits,
                                                                          out.data, out.stride);
  }
}

}  // namespace dflash::cuda
