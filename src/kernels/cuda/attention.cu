// Attention over the paged KV cache with GQA, for every mode: decode (one
// query), verification (causal inside the block), the draft block (no mask)
// and prefill. Heads of up to 128 dims take the tensor-core kernel of
// attention_mma.cu; this file has the per-row kernel for larger heads and the
// combination of splits that both use. Splits count from key 0, so a row's
// splits and their combination order depend only on its own visible keys: a
// token's attention output is the same alone or in a batch.
//
// Per-row kernel: a block of two warps owns one (query row, KV head, split of
// kAttnSplitKeys keys) and serves every query head of that KV head's group, so
// each key and value row is read once per group. Each warp takes 32 keys: lane
// j reads key j's row and scores it for every head, the warp takes the softmax
// of its tile, then reads the value rows coalesced (lane l owns dims [l*D,
// l*D + D)), several in flight. The two warps merge in order.
#include <cuda_bf16.h>

#include <cmath>
#include <map>
#include <mutex>
#include <type_traits>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/attention_mma.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"

namespace dflash::cuda {
namespace {

// Query heads per warp: the group rounded up to 1, 2, 4 or 8; larger groups go in chunks of 8.
constexpr int kGroupChunk(int group) { return group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : 8; }

// D bf16 values of a row, loaded as one raw word (2 to 16 bytes).
template <int D>
using Raw = std::conditional_t<D == 1, uint16_t, std::conditional_t<D == 2, uint32_t,
                               std::conditional_t<D == 4, uint2, uint4>>>;

template <int D>
__device__ __forceinline__ Raw<D> load_raw(const bf16* p) {
  if constexpr (D == 1) return *p;
  else return __ldg(reinterpret_cast<const Raw<D>*>(p));
}

template <int D>
__device__ __forceinline__ void unpack(const Raw<D>& raw, float (&f)[D]) {
  if constexpr (D == 1) {
    f[0] = __bfloat162float(__ushort_as_bfloat16(raw));
  } else {
    const auto* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < D / 2; ++i) {
      const float2 x = __bfloat1622float2(h2[i]);
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
}

constexpr int kTileWarps = kAttnSplitKeys / 32;  // one 32-key tile per warp; the block is one split
constexpr int kVBatch = 16;                      // V rows loaded together

// D: head dims per lane in the V phase (head_dim <= 32 * D); G: query heads per
// warp (the group, or a chunk of it, is at most G). Loops stay loops where they
// can: each warp runs the code once, so a fully unrolled body would be fetched
// from memory instruction by instruction.
template <int D, int G>
__global__ void __launch_bounds__(32 * kTileWarps)
    attention_kernel(const bf16* q, int64_t q_stride, const bf16* kc, int64_t k_stride, const bf16* vc,
                     int64_t v_stride, const AttnRow* rows, const int32_t* page_tables, AttnShape shp,
                     float* workspace, int max_splits, bf16* out, int64_t out_stride) {
  constexpr int kChunks = 4 * D;  // 8-value chunks of a key row (head_dim <= 32 * D)
  __shared__ __align__(16) float q_s[G][32 * D];        // scaled queries
  __shared__ float p_s[kTileWarps][G][32];              // scores, then probabilities, per key
  __shared__ float other[kTileWarps - 1][G][2 + 32 * D];  // later warps' (m, l, acc) per head
  pdl_begin();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = shp.n_heads / shp.n_kv_heads, chunks = (group + G - 1) / G;
  const int chunk = blockIdx.x % chunks, kv_head = (blockIdx.x / chunks) % shp.n_kv_heads;
  const int row = blockIdx.x / chunks / shp.n_kv_heads;
  const int split = blockIdx.y;
  const AttnRow r = rows[row];
  const Visible vis = visible_keys(r, shp.sliding_window);
  const int n_splits = n_splits_of(vis);
  // A row without keys belongs to another kernel of the call (run_attention hides the keys of
  // the prefill and long forms' rows from this one): it writes nothing. The whole block leaves
  // together.
  if (r.n_keys == 0 || split >= max(n_splits, 1)) return;
  const int hd = shp.head_dim, h0 = kv_head * group + chunk * G;
  const int nh = min(G, group - chunk * G);
  const bool has_dims = lane * D < hd;
  const int64_t head_off = static_cast<int64_t>(kv_head) * hd;
  const float scale = rsqrtf(static_cast<float>(hd));

  for (int i = threadIdx.x; i < G * 32 * D; i += blockDim.x) {
    const int h = i / (32 * D), d = i % (32 * D);
    const bf16* qh = q + row * q_stride + static_cast<int64_t>(h0 + h) * hd;
    q_s[h][d] = h < nh && d < hd ? __bfloat162float(__ushort_as_bfloat16(qh[d])) * scale : 0.0f;
  }
  __syncthreads();

  float acc[G][D], m[G], l[G];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.0f;
#pragma unroll
    for (int i = 0; i < D; ++i) acc[h][i] = 0.0f;
  }

  // This warp's tile: keys [base, base + 32) of the split; lane j owns key base + j.
  const int32_t* pages = page_tables + r.page_offset;
  const int lo = max(vis.begin, split * kAttnSplitKeys), hi = min(vis.end, (split + 1) * kAttnSplitKeys);
  const int base = split * kAttnSplitKeys + warp * 32;
  const int j_lo = max(lo - base, 0), j_hi = min(hi - base, 32);  // visible keys of the tile (warp-uniform)
  if (j_lo < j_hi) {
    const int key = base + lane;
    const bool visible = key >= lo && key < hi;
    const int64_t slot = visible ? key_slot(pages, key, shp.page_size) : 0;
    // Scores: each lane reads its key's row once, in two halves (registers), and scores it for
    // every head of the group.
    constexpr int kPart = kChunks > 4 ? kChunks / 2 : kChunks;
    const bf16* kr = kc + slot * k_stride + head_off;
    float sc[G];
#pragma unroll
    for (int h = 0; h < G; ++h) sc[h] = 0.0f;
#pragma unroll 1
    for (int c0 = 0; c0 < kChunks; c0 += kPart) {
      uint4 k_row[kPart];
#pragma unroll
      for (int c = 0; c < kPart; ++c)
        k_row[c] = visible && (c0 + c) * 8 < hd ? __ldg(reinterpret_cast<const uint4*>(kr + (c0 + c) * 8))
                                                : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int h = 0; h < G; ++h) {
        if (h >= nh) continue;
#pragma unroll
        for (int c = 0; c < kPart; ++c) {
          if ((c0 + c) * 8 >= hd) break;
          const auto* h2 = reinterpret_cast<const __nv_bfloat162*>(&k_row[c]);
          const float4 qa = *reinterpret_cast<const float4*>(&q_s[h][(c0 + c) * 8]);
          const float4 qb = *reinterpret_cast<const float4*>(&q_s[h][(c0 + c) * 8 + 4]);
          const float2 k0 = __bfloat1622float2(h2[0]), k1 = __bfloat1622float2(h2[1]);
          const float2 k2 = __bfloat1622float2(h2[2]), k3 = __bfloat1622float2(h2[3]);
          sc[h] += qa.x * k0.x + qa.y * k0.y + qa.z * k1.x + qa.w * k1.y + qb.x * k2.x + qb.y * k2.y +
                   qb.z * k3.x + qb.w * k3.y;
        }
      }
    }
#pragma unroll
    for (int h = 0; h < G; ++h)
      if (h < nh) p_s[warp][h][lane] = visible ? sc[h] : -INFINITY;
#pragma unroll
    for (int h = 0; h < G; ++h) {
      if (h >= nh) continue;
      const float score = p_s[warp][h][lane];
      m[h] = warp_max(score);  // finite: the tile has a visible key
      const float p = visible ? __expf(score - m[h]) : 0.0f;
      l[h] = p;
      p_s[warp][h][lane] = p;
    }
    __syncwarp();
    // Values: V rows read coalesced (lane l owns dims [l*D, l*D + D)), kVBatch rows in flight.
    const int64_t v_off = head_off + lane * D;
    for (int c = j_lo / kVBatch * kVBatch; c < j_hi; c += kVBatch) {
      Raw<D> vt[kVBatch];
#pragma unroll
      for (int u = 0; u < kVBatch; ++u) {
        const int j = c + u;
        const int64_t sj = __shfl_sync(kFull, slot, j & 31);
        vt[u] = j >= j_lo && j < j_hi && has_dims ? load_raw<D>(vc + sj * v_stride + v_off) : Raw<D>{};
      }
#pragma unroll
      for (int u = 0; u < kVBatch; ++u) {
        float vf[D];
        unpack<D>(vt[u], vf);
#pragma unroll
        for (int h = 0; h < G; ++h) {
          const float pj = p_s[warp][h][(c + u) & 31];  // 0 for keys outside [j_lo, j_hi)
#pragma unroll
          for (int i = 0; i < D; ++i) acc[h][i] += pj * vf[i];
        }
      }
    }
  }
#pragma unroll
  for (int h = 0; h < G; ++h) l[h] = warp_sum(l[h]);

  // The block's warps merge in warp order (a fixed order: batch-independent).
  if (warp > 0) {
#pragma unroll
    for (int h = 0; h < G; ++h) {
      float* o = other[warp - 1][h];
      if (lane == 0) o[0] = m[h], o[1] = l[h];
#pragma unroll
      for (int i = 0; i < D; ++i) o[2 + lane * D + i] = acc[h][i];
    }
  }
  __syncthreads();
  if (warp > 0) return;
#pragma unroll
  for (int h = 0; h < G; ++h) {
    if (h >= nh) continue;
    for (int w = 0; w < kTileWarps - 1; ++w) {
      const float* o = other[w][h];
      const float m_new = fmaxf(m[h], o[0]);
      if (m_new == -INFINITY) continue;  // neither has a visible key
      const float c_self = __expf(m[h] - m_new), c_other = __expf(o[0] - m_new);
      l[h] = l[h] * c_self + o[1] * c_other;
#pragma unroll
      for (int i = 0; i < D; ++i) acc[h][i] = acc[h][i] * c_self + o[2 + lane * D + i] * c_other;
      m[h] = m_new;
    }
    const int head = h0 + h;
    if (n_splits <= 1) {
      if (!has_dims) continue;
      auto* o = reinterpret_cast<__nv_bfloat16*>(out + row * out_stride + static_cast<int64_t>(head) * hd + lane * D);
      const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
#pragma unroll
      for (int i = 0; i < D; ++i) o[i] = __float2bfloat16(acc[h][i] * inv);
      continue;
    }
    float* part = workspace + ((static_cast<int64_t>(row) * shp.n_heads + head) * max_splits + split) * (hd + 2);
    if (lane == 0) part[0] = m[h], part[1] = l[h];
    if (has_dims) {
#pragma unroll
      for (int i = 0; i < D; ++i) part[2 + lane * D + i] = acc[h][i];
    }
  }
}

// `per_head` warps per (row, head) combine the row's splits (combine_splits), each 32 * kDims of
// its dims: several warps a head shorten each warp's chain of dependent loads and merges, which
// is what the kernel waits on (it is short of neither bandwidth nor warps). It releases the next
// kernel when the attention before it did (attention_may_release_early).
template <int kDims>
__global__ void combine_kernel(const AttnRow* rows, int n_rows, AttnShape shp, const float* workspace,
                               int max_splits, bf16* out, int64_t out_stride, int per_head, int release_early) {
  if (release_early) pdl_release();
  // The rows are staged metadata: read before the wait (pdl.cuh).
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int64_t item = warp / per_head;
  const int dim0 = static_cast<int>(warp % per_head) * 32 * kDims;
  const bool valid = item < static_cast<int64_t>(n_rows) * shp.n_heads;
  const int row = valid ? static_cast<int>(item / shp.n_heads) : 0, head = static_cast<int>(item % shp.n_heads);
  const int n_splits = valid ? n_splits_of(visible_keys(rows[row], shp.sliding_window)) : 0;
  pdl_wait();
  if (n_splits <= 1) return;  // written directly by the attention kernel (or no such row)
  combine_splits<kDims>(workspace + item * max_splits * (shp.head_dim + 2), n_splits, shp.head_dim,
                        out + row * out_stride + static_cast<int64_t>(head) * shp.head_dim, dim0);
  pdl_release();
}

int max_splits_for(int max_keys) { return (max_keys + kAttnSplitKeys - 1) / kAttnSplitKeys; }

void launch_combine(const AttnRow* rows, int n_rows, int splits, const AttnShape& shp, const float* workspace,
                    Mat out, bool release_early, KernelForms::Combine form, cudaStream_t s) {
  if (splits <= 1) return;
  const int64_t items = static_cast<int64_t>(n_rows) * shp.n_heads;
  // A warp per 32 dims of a head where the GPU holds all those warps at once (a few rows: the
  // kernel waits on each warp's chain; batch 1 verification 7.35 -> 7.27 ms a DFlash step), else
  // a warp per head (many rows: the heads' m and l would be loaded and merged by every warp of
  // the head; DFlash batch 8 10.27 -> 10.77 ms with a warp per 32 dims).
  // `form` forces a side (tests: the same bits).
  using Combine = KernelForms::Combine;
  const int dim_warps = (shp.head_dim + 31) / 32;
  const bool split_dims =
      form == Combine::by_rule
          ? gpu_holds_grid(reinterpret_cast<const void*>(combine_kernel<1>), 128, (items * dim_warps + 3) / 4)
          : form == Combine::per_32_dims;
  const auto kernel = split_dims ? combine_kernel<1> : shp.head_dim <= 128 ? combine_kernel<4> : combine_kernel<8>;
  const int per_head = split_dims ? dim_warps : 1;
  const unsigned blocks = static_cast<unsigned>((items * per_head + 3) / 4);
  release_early = release_early && attention_may_release_early(reinterpret_cast<const void*>(kernel), 128, blocks);
  launch(kernel, blocks, 128, s, rows, n_rows, shp, workspace, splits, out.data, out.stride, per_head,
         release_early ? 1 : 0);
}

}  // namespace

// Released early, the o product's blocks are placed and stream their first weights while the
// attention runs (H100: the DFlash step -0.1 ms at batch 1).
bool attention_may_release_early(const void* kernel, int threads, int64_t blocks) {
  return gpu_holds_grid(kernel, threads, blocks);
}

int sm_count() {
  static const int sms = [] {  // the backend runs on one device, chosen before any launch
    int device = 0, n = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    return n;
  }();
  return sms;
}

bool gpu_holds_grid(const void* kernel, int threads, int64_t blocks) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int64_t> capacity;  // blocks the GPU holds at once
  std::lock_guard<std::mutex> lock(mu);
  auto it = capacity.find({kernel, threads});
  if (it == capacity.end()) {
    int per_sm = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
    it = capacity.emplace(std::make_pair(kernel, threads), int64_t{sm_count()} * per_sm).first;
  }
  return blocks <= it->second;
}

int64_t attention_workspace_bytes(int n_rows, int n_tiles, int max_keys, const AttnShape& shape, bool fused,
                                  KernelForms::Splits form) {
  const int splits = max_splits_for(max_keys);
  if (splits <= 1 || attention_mma_combines_splits(shape, n_rows, n_tiles, splits, fused, form)) return 0;
  return static_cast<int64_t>(n_rows) * shape.n_heads * splits * (shape.head_dim + 2) * sizeof(float);
}

int attention_rows_per_tile(const AttnShape& shape) {
  const int heads = attention_mma_heads(shape);
  return heads > 0 ? 16 / heads : 1;
}

bool attention_fresh_supported(const AttnShape& shp, int n_tiles, int max_keys) {
  return attention_mma_heads(shp) > 0 && (shp.head_dim == 64 || shp.head_dim == 128) &&
         attention_mma_fresh_in_one_wave(shp, n_tiles, max_splits_for(max_keys) > 0 ? max_splits_for(max_keys) : 1);
}

void launch_attention_fresh(const Mat& q, const AttnFresh& fresh, const Mat& k_cache, const Mat& v_cache,
                            const AttnRow* rows, int n_rows, const AttnTile* tiles, int n_tiles, int max_keys,
                            const int32_t* page_tables, const AttnShape& shp, float* workspace, Mat out,
                            const KernelForms& forms, cudaStream_t s) {
  if (n_rows == 0) return;
  const int splits = max_splits_for(max_keys) > 0 ? max_splits_for(max_keys) : 1;
  bool early = false, combined = false;
  launch_attention_mma(q, fresh, k_cache, v_cache, rows, n_rows, tiles, n_tiles, splits, page_tables, shp, workspace,
                       out, forms.attention_splits, early, combined, s);
  if (!combined) launch_combine(rows, n_rows, splits, shp, workspace, out, early, forms.combine, s);
}

void launch_attention(const Mat& q, const Mat& k_cache, const Mat& v_cache, const AttnRow* rows, int n_rows,
                      const AttnTile* tiles, int n_tiles, const AttnTile* runs, int n_runs, int most_tiles, int max_keys,
                      const int32_t* page_tables, const AttnShape& shp, float* workspace, Mat out,
                      const KernelForms& forms, cudaStream_t s) {
  if (n_rows == 0) return;
  if (attention_mma_heads(shp) > 0) {
    // A sequence's tiles share each split's keys where its rows fill two tiles or more on average
    // (verification and draft blocks) and the decode kernel's grid without splits has 3 blocks an
    // SM or more. The shared-keys blocks are one wave that takes about as long at any batch (a
    // warp walks its tile's splits one after another), the decode kernel's time grows with the
    // batch: H200, 12 layers of the 30B-A3B shape, DFlash batch 32 9.51-9.58 -> 8.71-8.79 ms a
    // step, batch 16 7.88-8.00 -> 7.60-7.66, 8B shape batch 16 12.58-12.76 -> 11.31-11.38; without
    // the grid condition batch 8 was slower (5.14 -> 5.52 ms: 32 blocks), batch 2 much slower
    // (bench/results/bench_step_h200_attention_shared_keys_builds_ab.txt).
    using Splits = KernelForms::Splits;
    const int heads = attention_mma_heads(shp), group = shp.n_heads / shp.n_kv_heads;
    const int64_t blocks = int64_t{n_tiles} * shp.n_kv_heads * ((group + heads - 1) / heads);
    const bool shared = forms.attention_splits == Splits::by_rule
                            ? 2 * n_runs <= n_tiles && blocks >= 3 * int64_t{sm_count()}
                            : forms.attention_splits == Splits::shared_keys;
    if (shared)
      return launch_attention_shared_keys(q, k_cache, v_cache, rows, tiles, runs, n_runs, most_tiles, page_tables,
                                          shp, out, s);
    return launch_attention_fresh(q, AttnFresh{}, k_cache, v_cache, rows, n_rows, tiles, n_tiles, max_keys,
                                  page_tables, shp, workspace, out, forms, s);
  }
  const int splits = max_splits_for(max_keys) > 0 ? max_splits_for(max_keys) : 1;
  const int group = shp.n_heads / shp.n_kv_heads, chunks = (group + kGroupChunk(group) - 1) / kGroupChunk(group);
  const dim3 grid(static_cast<unsigned>(n_rows * shp.n_kv_heads * chunks), static_cast<unsigned>(splits));
  auto run = [&](auto kernel) {
    launch(kernel, grid, 32 * kTileWarps, s, q.data, q.stride, k_cache.data, k_cache.stride, v_cache.data,
           v_cache.stride, rows, page_tables, shp, workspace, splits, out.data, out.stride);
  };
  auto by_group = [&](auto d) {
    constexpr int D = decltype(d)::value;
    if (group <= 1) run(attention_kernel<D, 1>);
    else if (group <= 2) run(attention_kernel<D, 2>);
    else if (group <= 4) run(attention_kernel<D, 4>);
    else run(attention_kernel<D, 8>);  // larger groups go in chunks of 8 heads
  };
  if (shp.head_dim <= 32) by_group(std::integral_constant<int, 1>{});
  else if (shp.head_dim <= 64) by_group(std::integral_constant<int, 2>{});
  else if (shp.head_dim <= 128) by_group(std::integral_constant<int, 4>{});
  else by_group(std::integral_constant<int, 8>{});
  launch_combine(rows, n_rows, splits, shp, workspace, out, /*release_early=*/false, forms.combine, s);
}

}  // namespace dflash::cuda
