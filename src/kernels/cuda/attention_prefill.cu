// Attention on tensor cores, FlashAttention-2's way, for long query segments (prefill chunks)
// and for rows with many keys: a block owns 16 query vectors a warp (rows x heads of one KV
// head's group, as in attention_mma.cu) and walks the keys its rows see in tiles of 64 (32 at
// head_dim 256, where a warp's 16 x 256 output and queries already take 192 registers a thread),
// each K and V tile staged once in shared memory (cp.async, double buffered) for all its warps;
// every warp keeps the online softmax state of its 16 vectors in registers.
//
// Prefill form: one pass over all the keys, no splits. Long form (rows with at least
// kAttnLongKeys keys): blocks of kAttnLongSplitKeys keys each (grid.y), whose partial states a
// combine kernel merges in split order; a 16-row verification block then reads each K/V row
// once per KV head, not once per 4-row tile as the decode kernel does.
//
// A vector's arithmetic does not depend on the other vectors of its block (tiles start at
// multiples of the tile size, a tile with none of its keys leaves its state as it is), so rows are
// batch-invariant; they do not match the decode kernel's bits (another summation order), so a
// row's kernel must follow from the row alone where that matters (launch.h).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/pdl.cuh"

namespace dflash::cuda {
namespace {

constexpr int kWarps = 4;
// Keys per shared-memory tile.
template <int HD>
constexpr int kTileKeys = HD == 256 ? 32 : 64;

// 2^x (ex2.approx: 2 ulp; 2^-inf = 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <int HD>
struct PrefillSmem {
  // Rows padded by 16 bytes: the 8 rows an ldmatrix reads fall on different banks.
  bf16 k[2][kTileKeys<HD>][HD + 8];
  bf16 v[2][kTileKeys<HD>][HD + 8];
};

// Splits of the long form a row's visible keys fall in (counted from key 0, as n_splits_of).
__device__ __forceinline__ int long_splits(const Visible& v) {
  return v.end > v.begin ? (v.end - 1) / kAttnLongSplitKeys - v.begin / kAttnLongSplitKeys + 1 : 0;
}

// A block: tile tiles[n_tiles - 1 - blockIdx.x / (KV heads x head chunks)] (the latest rows,
// which see the most keys, start first), one KV head, one chunk of `heads` of its query heads.
// Warp w takes rows w * R .. w * R + R - 1 of the tile (R = 16 / heads) x the chunk's heads;
// lane (g, qd) holds vectors g and g + 8 in the mma fragment layout.
// kSplit: the long form; block row blockIdx.y takes keys [y * S, y * S + S) (S =
// kAttnLongSplitKeys) and a vector with keys in several splits writes its partial state (m in
// log2 units, l, acc) to workspace[(work_rows[row] * n_heads + head) * max_splits + split].
template <int HD, bool kSplit>
__global__ void __launch_bounds__(kWarps * 32, 2)
    attention_tiles_kernel(const bf16* __restrict__ q, int64_t q_stride, const bf16* __restrict__ kc,
                           int64_t k_stride, const bf16* __restrict__ vc, int64_t v_stride,
                           const AttnRow* __restrict__ rows, const AttnTile* __restrict__ tiles, int n_tiles,
                           const int32_t* __restrict__ page_tables, AttnShape shp, int heads,
                           const int32_t* __restrict__ work_rows, float* __restrict__ workspace, int max_splits,
                           bf16* __restrict__ out, int64_t out_stride) {
  DFLASH_DYNAMIC_SMEM(smem_raw);
  auto& sm = *reinterpret_cast<PrefillSmem<HD>*>(smem_raw);
  constexpr int TK = kTileKeys<HD>;
  constexpr int kSteps = HD / 16;  // 16-dim steps of the score product
  constexpr int kDimTiles = HD / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, qd = lane % 4;
  const int group = shp.n_heads / shp.n_kv_heads, chunks = (group + heads - 1) / heads;
  const int chunk = blockIdx.x % chunks, kv_head = (blockIdx.x / chunks) % shp.n_kv_heads;
  const AttnTile tile = tiles[n_tiles - 1 - static_cast<int>(blockIdx.x / chunks / shp.n_kv_heads)];
  const int warp_rows = 16 / heads;
  const AttnRow first = rows[tile.first_row];

  // This thread's vectors g and g + 8: row, head, visible keys [lo, hi).
  int vrow[2], vhead[2], lo[2], hi[2];
  bool vok[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = g + 8 * h, ri = warp * warp_rows + i / heads, hj = chunk * heads + i % heads;
    vok[h] = i < warp_rows * heads && ri < tile.n_rows && hj < group;
    vrow[h] = tile.first_row + (vok[h] ? ri : 0);
    vhead[h] = kv_head * group + (vok[h] ? hj : 0);
    const Visible vis = visible_keys(rows[vrow[h]], shp.sliding_window);
    lo[h] = vok[h] ? vis.begin : 0;
    hi[h] = vok[h] ? vis.end : 0;
  }
  // The keys any vector of the block sees.
  __shared__ int range_s[2];
  if (threadIdx.x == 0) range_s[0] = INT32_MAX, range_s[1] = 0;
  __syncthreads();
  {
    int b = INT32_MAX, e = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (lo[h] < hi[h]) b = min(b, lo[h]), e = max(e, hi[h]);
    b = __reduce_min_sync(kFull, b);
    e = __reduce_max_sync(kFull, e);
    if (lane == 0) atomicMin(&range_s[0], b), atomicMax(&range_s[1], e);
  }
  __syncthreads();
  const int split = kSplit ? static_cast<int>(blockIdx.y) : 0;
  const int split_begin = kSplit ? split * kAttnLongSplitKeys : 0;
  const int split_end = kSplit ? split_begin + kAttnLongSplitKeys : INT32_MAX;
  const int key_begin = max(range_s[0], split_begin) / TK * TK, key_end = min(range_s[1], split_end);
  const int n_key_tiles = key_end > key_begin ? (key_end - key_begin + TK - 1) / TK : 0;

  const int32_t* pages = page_tables + first.page_offset;
  const int64_t head_off = static_cast<int64_t>(kv_head) * HD;
  constexpr int kRowPieces = HD / 8;                                 // 16-byte pieces of a key row
  constexpr int kPieces = TK * kRowPieces / (kWarps * 32);  // of a tile, per thread
  // The K and V rows of keys [k0, k0 + TK) into buffer `buf` (keys past the sequence: zeros).
  // The long form reads each K/V row once a step: its copies go to L2 marked evict-first
  // (device_math.cuh). A prefill's rows are read again by the sequence's other query tiles.
  const uint64_t kv_policy = evict_first_policy();
  auto copy = [&](bf16* dst, const bf16* src, bool ok) {
    if constexpr (kSplit) cp_async16_evict_first(dst, src, ok, kv_policy);
    else cp_async16_hint<128>(dst, src, ok);
  };
  auto issue_tile = [&](int k0, int buf) {
#pragma unroll
    for (int j = 0; j < kPieces; ++j) {
      const int p = threadIdx.x + j * kWarps * 32, kr = p / kRowPieces, part = p % kRowPieces, key = k0 + kr;
      const bool ok = key < first.n_keys;
      const int64_t slot = ok ? key_slot(pages, key, shp.page_size) : 0;
      copy(&sm.k[buf][kr][part * 8], kc + slot * k_stride + head_off + part * 8, ok);
      copy(&sm.v[buf][kr][part * 8], vc + slot * v_stride + head_off + part * 8, ok);
    }
    cp_async_commit();
  };

  // Everything above reads staged metadata only (pdl.cuh); queries, keys and values come from
  // the kernels before this one.
  pdl_wait();
  if (n_key_tiles > 0) issue_tile(key_begin, 0);

  // The queries as A fragments: qa[s] for dims [16s, 16s + 16).
  uint32_t qa[kSteps][4];
#pragma unroll
  for (int s = 0; s < kSteps; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int h = r % 2, d = 16 * s + 2 * qd + 8 * (r / 2);
      qa[s][r] = vok[h] ? *reinterpret_cast<const uint32_t*>(q + vrow[h] * q_stride +
                                                             static_cast<int64_t>(vhead[h]) * HD + d)
                        : 0u;
    }

  // Scores in log2 units: exp(x * scale) = exp2(x * scale * log2(e)).
  const float scale = rsqrtf(static_cast<float>(HD)) * 1.44269504088896340736f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float acc[kDimTiles][4] = {};
  // Whether this warp's vectors see any key of [k0, k0 + TK).
  auto warp_sees = [&](int k0) {
    bool any = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) any |= lo[h] < hi[h] && lo[h] < k0 + TK && hi[h] > k0;
    return __any_sync(kFull, any);
  };

  for (int t = 0; t < n_key_tiles; ++t) {
    const int k0 = key_begin + t * TK, buf = t % 2;
    if (t + 1 < n_key_tiles) {
      issue_tile(k0 + TK, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (warp_sees(k0)) {
      // S = Q K^T: n-tile kt holds keys k0 + 8kt + 2qd + {0, 1} of vectors g (0, 1) and g + 8 (2, 3).
      float sc[TK / 8][4] = {};
#pragma unroll
      for (int c = 0; c < HD / 32; ++c)
#pragma unroll
        for (int kt = 0; kt < TK / 8; ++kt) {
          uint32_t b[4];
          ldmatrix_x4(b, &sm.k[buf][8 * kt + lane % 8][32 * c + 8 * (lane / 8)]);
          mma_bf16(sc[kt], qa[2 * c][0], qa[2 * c][1], qa[2 * c][2], qa[2 * c][3], b[0], b[1]);
          mma_bf16(sc[kt], qa[2 * c + 1][0], qa[2 * c + 1][1], qa[2 * c + 1][2], qa[2 * c + 1][3], b[2], b[3]);
        }
      // Online softmax: masked, P rounded to bf16 and summed as rounded.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int kt = 0; kt < TK / 8; ++kt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int key = k0 + 8 * kt + 2 * qd + e;
            const float v = key >= lo[h] && key < hi[h] ? sc[kt][2 * h + e] * scale : -INFINITY;
            sc[kt][2 * h + e] = v;
            mx = fmaxf(mx, v);
          }
        mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
        const float m_new = fmaxf(m[h], mx);
        const float alpha = m_new == -INFINITY ? 1.0f : fast_exp2(m[h] - m_new);
        float sum = 0.0f;
#pragma unroll
        for (int kt = 0; kt < TK / 8; ++kt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float v = sc[kt][2 * h + e];
            const float p = v == -INFINITY ? 0.0f : round_bf(fast_exp2(v - m_new));
            sc[kt][2 * h + e] = p;
            sum += p;
          }
        sum += __shfl_xor_sync(kFull, sum, 1);
        sum += __shfl_xor_sync(kFull, sum, 2);
        l[h] = l[h] * alpha + sum;
        m[h] = m_new;
#pragma unroll
        for (int nt = 0; nt < kDimTiles; ++nt) acc[nt][2 * h] *= alpha, acc[nt][2 * h + 1] *= alpha;
      }
      // O += P V: P's A fragments are the score tiles' accumulators, V's B fragments come transposed.
#pragma unroll
      for (int j = 0; j < TK / 16; ++j) {
        const uint32_t a0 = pack_bf16(sc[2 * j][0], sc[2 * j][1]), a1 = pack_bf16(sc[2 * j][2], sc[2 * j][3]);
        const uint32_t a2 = pack_bf16(sc[2 * j + 1][0], sc[2 * j + 1][1]);
        const uint32_t a3 = pack_bf16(sc[2 * j + 1][2], sc[2 * j + 1][3]);
#pragma unroll
        for (int np = 0; np < HD / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, &sm.v[buf][16 * j + lane % 8 + 8 * ((lane / 8) % 2)][np * 16 + 8 * (lane / 16)]);
          mma_bf16(acc[2 * np], a0, a1, a2, a3, b[0], b[1]);
          mma_bf16(acc[2 * np + 1], a0, a1, a2, a3, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with `buf` before the next tile's copies refill it
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // The vector's splits: those its keys fall in (a row that sees no key: split 0, zeros).
    const bool mine = lo[h] >= hi[h] ? split == 0 : lo[h] < split_end && hi[h] > split_begin;
    if (!vok[h] || !mine) continue;
    if (kSplit && long_splits(Visible{lo[h], hi[h]}) > 1) {
      const int64_t item = static_cast<int64_t>(work_rows[vrow[h]]) * shp.n_heads + vhead[h];
      float* part = workspace + (item * max_splits + split) * (HD + 2);
      if (qd == 0) part[0] = m[h], part[1] = l[h];
#pragma unroll
      for (int nt = 0; nt < kDimTiles; ++nt)
        *reinterpret_cast<float2*>(part + 2 + nt * 8 + 2 * qd) = make_float2(acc[nt][2 * h], acc[nt][2 * h + 1]);
      continue;
    }
    const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;  // a row that sees no key: zeros
    bf16* o = out + vrow[h] * out_stride + static_cast<int64_t>(vhead[h]) * HD;
#pragma unroll
    for (int nt = 0; nt < kDimTiles; ++nt)
      *reinterpret_cast<uint32_t*>(o + nt * 8 + 2 * qd) = pack_bf16(acc[nt][2 * h] * inv, acc[nt][2 * h + 1] * inv);
  }
  pdl_release();
}

// A warp per 32 dims of a (row, head) of the long form's rows with several splits merges their
// partial states in split order (every warp of a head merges m and l the same way, so each dim
// gets the same bits as from a warp per head). Everything 32 splits need is requested before any
// of it is used: a row at 32768 keys has 64 splits, and one trip to L2 a split made this kernel
// take longer than the attention before it.
__global__ void long_combine_kernel(const AttnRow* __restrict__ rows, int n_rows, AttnShape shp,
                                    const int32_t* __restrict__ work_rows, const float* __restrict__ workspace,
                                    int max_splits, bf16* __restrict__ out, int64_t out_stride) {
  constexpr int kBatch = 32;
  const int dim_warps = shp.head_dim / 32;
  const int64_t warp_id = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int64_t item = warp_id / dim_warps;
  const int lane = threadIdx.x % 32, hd = shp.head_dim, d = static_cast<int>(warp_id % dim_warps) * 32 + lane;
  const bool valid = item < static_cast<int64_t>(n_rows) * shp.n_heads;
  const int row = valid ? static_cast<int>(item / shp.n_heads) : 0, head = static_cast<int>(item % shp.n_heads);
  const Visible vis = visible_keys(rows[row], shp.sliding_window);
  const int n_splits = valid ? long_splits(vis) : 0;
  pdl_wait();
  if (n_splits > 1) {
    const int64_t work_item = static_cast<int64_t>(work_rows[row]) * shp.n_heads + head;
    const float* base = workspace + (work_item * max_splits + vis.begin / kAttnLongSplitKeys) * (hd + 2);
    float m = -INFINITY, l = 0.0f, a = 0.0f;
    for (int s0 = 0; s0 < n_splits; s0 += kBatch) {
      float mb[kBatch], lb[kBatch], v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const bool ok = s0 + u < n_splits;
        const float* part = base + (s0 + u) * (hd + 2);
        mb[u] = ldcg_if(part, ok, -INFINITY);  // predicated, not branched (ldcg_if)
        lb[u] = ldcg_if(part + 1, ok, 0.0f);
        v[u] = ldcg_if(part + 2 + d, ok, 0.0f);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const float m_new = fmaxf(m, mb[u]);
        if (m_new == -INFINITY) continue;  // neither has a visible key
        const float c_self = fast_exp2(m - m_new), c_part = fast_exp2(mb[u] - m_new);
        l = __fmaf_rn(l, c_self, __fmul_rn(lb[u], c_part));
        a = __fmaf_rn(a, c_self, __fmul_rn(v[u], c_part));
        m = m_new;
      }
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    reinterpret_cast<__nv_bfloat16*>(out + row * out_stride + static_cast<int64_t>(head) * hd)[d] =
        __float2bfloat16(a * inv);
  }
  pdl_release();
}

template <int HD, bool kSplit>
void launch_tiles(const Mat& q, const Mat& k_cache, const Mat& v_cache, const AttnRow* rows, const AttnTile* tiles,
                  int n_tiles, int splits, const int32_t* page_tables, const AttnShape& shp, const int32_t* work_rows,
                  float* workspace, Mat out, cudaStream_t s) {
  const auto kernel = attention_tiles_kernel<HD, kSplit>;
  constexpr size_t smem = sizeof(PrefillSmem<HD>);
  static std::atomic<uint64_t> configured{0};
  once_per_device(configured, [&] {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  });
  const int heads = attention_prefill_heads(shp), group = shp.n_heads / shp.n_kv_heads;
  const int chunks = (group + heads - 1) / heads;
  const dim3 grid(static_cast<unsigned>(n_tiles * shp.n_kv_heads * chunks), static_cast<unsigned>(splits));
  launch_smem(kernel, grid, kWarps * 32, smem, s, q.data, q.stride, k_cache.data, k_cache.stride, v_cache.data,
              v_cache.stride, rows, tiles, n_tiles, page_tables, shp, heads, work_rows, workspace, splits, out.data,
              out.stride);
}

template <bool kSplit>
void launch_by_dim(const Mat& q, const Mat& k_cache, const Mat& v_cache, const AttnRow* rows, const AttnTile* tiles,
                   int n_tiles, int splits, const int32_t* page_tables, const AttnShape& shp, const int32_t* work_rows,
                   float* workspace, Mat out, cudaStream_t s) {
  const auto form = shp.head_dim == 64    ? launch_tiles<64, kSplit>
                    : shp.head_dim == 128 ? launch_tiles<128, kSplit>
                                          : launch_tiles<256, kSplit>;
  form(q, k_cache, v_cache, rows, tiles, n_tiles, splits, page_tables, shp, work_rows, workspace, out, s);
}

}  // namespace

int attention_prefill_heads(const AttnShape& shp) {
  if (shp.head_dim != 64 && shp.head_dim != 128 && shp.head_dim != 256) return 0;
  return std::min(shp.n_heads / shp.n_kv_heads, 16);
}

int attention_prefill_rows_per_tile(const AttnShape& shp) {
  const int heads = attention_prefill_heads(shp);
  return heads > 0 ? kWarps * (16 / heads) : 0;
}

void launch_attention_prefill(const Mat& q, const Mat& k_cache, const Mat& v_cache, const AttnRow* rows,
                              const AttnTile* tiles, int n_tiles, const int32_t* page_tables, const AttnShape& shp,
                              Mat out, cudaStream_t s) {
  if (n_tiles == 0) return;
  launch_by_dim<false>(q, k_cache, v_cache, rows, tiles, n_tiles, 1, page_tables, shp, nullptr, nullptr, out, s);
}

int64_t attention_long_workspace_bytes(int n_long_rows, int max_keys, const AttnShape& shp) {
  const int64_t splits = (max_keys + kAttnLongSplitKeys - 1) / kAttnLongSplitKeys;
  return splits > 1 ? int64_t{n_long_rows} * shp.n_heads * splits * (shp.head_dim + 2) * int64_t{sizeof(float)} : 0;
}

void launch_attention_long(const Mat& q, const Mat& k_cache, const Mat& v_cache, const AttnRow* rows, int n_rows,
                           const int32_t* work_rows, const AttnTile* tiles, int n_tiles, int max_keys,
                           const int32_t* page_tables, const AttnShape& shp, float* workspace, Mat out,
                           cudaStream_t s) {
  if (n_tiles == 0) return;
  const int splits = std::max(1, (max_keys + kAttnLongSplitKeys - 1) / kAttnLongSplitKeys);
  launch_by_dim<true>(q, k_cache, v_cache, rows, tiles, n_tiles, splits, page_tables, shp, work_rows, workspace, out,
                      s);
  if (splits <= 1) return;
  const int64_t warps = int64_t{n_rows} * shp.n_heads * (shp.head_dim / 32);
  launch(long_combine_kernel, static_cast<unsigned>((warps + 3) / 4), 128, s, rows, n_rows, shp, work_rows,
         static_cast<const float*>(workspace), splits, out.data, out.stride);
}

}  // namespace dflash::cuda
