// The decode attention's shared-keys form: a block owns a run of up to 8 tiles of one sequence
// (a verification or draft block: 16 rows are 4-8 tiles) for one KV head and chunk of its query
// heads, a warp per tile, and walks the sequence's splits of kAttnSplitKeys keys in order. Each
// split's keys and values are copied once into shared memory for all the block's warps (three
// buffers: the next two splits' copies are in flight while one is computed), where the decode
// kernel (attention_mma.cu) reads them again for every tile and every split in its own block.
//
// Same bits as the decode kernel, by the same arithmetic in the same order: a warp treats the
// split's four groups of 16 keys as the decode kernel's four warps (attention_key_tile.cuh),
// merges groups 1, 2, 3 into group 0 as its warp 0 does, and each split into a running state as
// its loop form and the combine kernel do (attention_common.cuh); a vector with one split writes
// that split's result. The running state stays in registers, one dim-tile pair at a time.
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/attention_key_tile.cuh"
#include "kernels/cuda/attention_mma.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"

namespace dflash::cuda {
namespace {

constexpr int kGroups = kAttnSplitKeys / 16;  // groups of 16 keys a split: the decode kernel's warps
constexpr int kMaxTiles = 8;                   // tiles (warps) a block
constexpr int kVecs = 16;                      // query vectors a tile
constexpr int kStages = 3;                     // splits in shared memory: two in flight while one is used

template <int HD>
struct SharedKeys {
  // Rows padded by 16 bytes, as the decode kernel's V tiles (ldmatrix reads 8 rows on different banks).
  bf16 k[kStages][kAttnSplitKeys][HD + 8];
  bf16 v[kStages][kAttnSplitKeys][HD + 8];
};

// runs[blockIdx.x / (KV heads x chunks)]: tiles [first_row, first_row + n_rows) of `tiles`, all of
// one sequence (AttnTile read as a run of tiles).
template <int HD>
__global__ void __launch_bounds__(kMaxTiles * 32, 1)
    attention_shared_keys_kernel(const bf16* q, int64_t q_stride, const bf16* kc, int64_t k_stride, const bf16* vc,
                                 int64_t v_stride, const AttnRow* rows, const AttnTile* tiles, const AttnTile* runs,
                                 const int32_t* page_tables, AttnShape shp, int heads, bf16* out, int64_t out_stride) {
  constexpr int kChunks = HD / 32, kDimTiles = HD / 8, kRow = HD + 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<SharedKeys<HD>*>(smem_raw);
  __shared__ int splits_s;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, qd = lane % 4, hd = shp.head_dim;
  const int group = shp.n_heads / shp.n_kv_heads, chunks = (group + heads - 1) / heads;
  const int chunk = blockIdx.x % chunks, kv_head = (blockIdx.x / chunks) % shp.n_kv_heads;
  const AttnTile run = runs[blockIdx.x / chunks / shp.n_kv_heads];
  const bool has_tile = warp < run.n_rows;
  const AttnTile tile = tiles[run.first_row + (has_tile ? warp : 0)];
  const AttnRow seq = rows[tiles[run.first_row].first_row];  // the sequence's keys and page table
  const int32_t* pages = page_tables + seq.page_offset;
  const int64_t head_off = static_cast<int64_t>(kv_head) * hd;

  // This lane's two query vectors, g and g + 8 (vector i = row i / heads, head i % heads), as
  // the decode kernel takes them.
  int vrow[2], vhead[2], vsplits[2];
  bool vok[2];
  Visible vis[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = g + 8 * h, ri = i / heads, hj = chunk * heads + i % heads;
    vok[h] = has_tile && ri < kVecs / heads && ri < tile.n_rows && hj < group;
    vrow[h] = tile.first_row + (vok[h] ? ri : 0);
    vhead[h] = kv_head * group + hj;
    vis[h] = visible_keys(rows[vrow[h]], shp.sliding_window);
    vsplits[h] = vok[h] ? max(n_splits_of(vis[h]), 1) : 0;  // a row with no keys still writes its zeros
  }
  if (threadIdx.x == 0) splits_s = 0;
  __syncthreads();
  const int mine = __reduce_max_sync(kFull, max(vsplits[0], vsplits[1]));
  if (lane == 0) atomicMax(&splits_s, mine);
  __syncthreads();
  const int n_splits = splits_s;

  // Split s's keys and values go into buffer s % kStages, one cp.async group a split (empty past
  // the last): the split's 64 key rows are shared out to the block's 64, 128 or 256 threads, 1, 2
  // or 4 threads a row (keys past the sequence's and dims past head_dim read as zeros, as in the
  // decode kernel). A row's cache slot is looked up a split ahead of its copies, so that the page
  // table's round trip is not on the way to them.
  const int per_row = static_cast<int>(blockDim.x) / kAttnSplitKeys, pieces = HD / 8 / per_row;
  const int my_row = threadIdx.x / per_row, my_part = (threadIdx.x % per_row) * pieces;
  auto slot_of = [&](int split) -> int64_t {
    const int key = split * kAttnSplitKeys + my_row;
    return split < n_splits && key < seq.n_keys ? key_slot(pages, key, shp.page_size) : -1;
  };
  auto stage = [&](int split, int64_t slot) {
    const int buf = split % kStages;
#pragma unroll
    for (int i = 0; i < (split < n_splits ? pieces : 0); ++i) {
      const int part = my_part + i;
      const bool ok = slot >= 0 && part * 8 < hd;
      cp_async16_hint<128>(&sm.k[buf][my_row][part * 8], ok ? kc + slot * k_stride + head_off + part * 8 : kc, ok);
      cp_async16_hint<128>(&sm.v[buf][my_row][part * 8], ok ? vc + slot * v_stride + head_off + part * 8 : vc, ok);
    }
    cp_async_commit();
  };
  // The page tables are staged metadata (pdl.cuh): the first slots are looked up before the wait.
  int64_t first_slots[kStages - 1];
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) first_slots[i] = slot_of(i);
  int64_t next_slot = slot_of(kStages - 1);
  // The previous kernel wrote the new keys and values (and the queries): they are read after it.
  pdl_wait();
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) stage(i, first_slots[i]);

  const uint4 zero = make_uint4(0, 0, 0, 0);
  uint4 qa[kChunks][2];
#pragma unroll
  for (int c = 0; c < kChunks; ++c)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      qa[c][h] = vok[h] && c * 32 + qd * 8 < hd
                     ? load16(q + vrow[h] * q_stride + static_cast<int64_t>(vhead[h]) * hd + c * 32 + qd * 8)
                     : zero;
  const float scale = rsqrtf(static_cast<float>(hd));

  // The running state of the vectors with several splits: m and l a vector, acc a dim tile (in
  // registers); a vector with one split keeps that split's l and acc here.
  float st_m[2] = {-INFINITY, -INFINITY}, st_l[2] = {0.0f, 0.0f}, st[kDimTiles][4];
#pragma unroll
  for (int nt = 0; nt < kDimTiles; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) st[nt][i] = 0.0f;

  for (int split = 0; split < n_splits; ++split) {
    const int buf = split % kStages;
    // Into the buffer of split - 1, which every warp has finished with (the barrier below).
    stage(split + kStages - 1, next_slot);
    next_slot = slot_of(split + kStages);
    cp_async_wait<kStages - 1>();
    __syncthreads();  // the split's keys and values are in, for every warp
    if (__any_sync(kFull, split < vsplits[0] || split < vsplits[1])) {
      int lo[2], hi[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        lo[h] = max(vis[h].begin, split * kAttnSplitKeys);
        hi[h] = vok[h] ? min(vis[h].end, (split + 1) * kAttnSplitKeys) : lo[h];
      }
      // Each group's scores, softmax and P, as the decode kernel's warp of those keys.
      float gm[kGroups][2], gl[kGroups][2];
      uint32_t pa[kGroups][4];
#pragma unroll
      for (int k = 0; k < kGroups; ++k) {
        uint4 kb[2][kChunks];
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int c = 0; c < kChunks; ++c)
            kb[t][c] = *reinterpret_cast<const uint4*>(&sm.k[buf][16 * k + 8 * t + g][c * 32 + qd * 8]);
        float sc[2][4] = {};
        key_tile_scores<kChunks>(qa, kb, sc);
        key_tile_softmax(sc, split * kAttnSplitKeys + 16 * k, qd, lo, hi, scale, gm[k], gl[k]);
        key_tile_p(sc, pa[k]);
      }
      // Groups 1, 2, 3 merge into group 0 in turn (the decode kernel's warp 0), then the split
      // into the running state (its loop form; the combine kernel).
      float m[2] = {gm[0][0], gm[0][1]}, l[2] = {gl[0][0], gl[0][1]};
      MergeCoef cg[kGroups - 1][2];
#pragma unroll
      for (int k = 1; k < kGroups; ++k)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          cg[k - 1][h] = merge_coef(m[h], gm[k][h]);
          if (!cg[k - 1][h].skip) l[h] = merged(l[h], gl[k][h], cg[k - 1][h]);
        }
      bool take[2], single[2];
      MergeCoef cs[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        take[h] = vok[h] && split < vsplits[h];
        single[h] = vsplits[h] == 1;
        cs[h] = {1.0f, 0.0f, true};
        if (take[h] && single[h]) {
          st_l[h] = l[h];
        } else if (take[h]) {
          cs[h] = merge_coef(st_m[h], m[h]);
          if (!cs[h].skip) st_l[h] = merged(st_l[h], l[h], cs[h]);
        }
      }
#pragma unroll
      for (int np = 0; np < HD / 16; ++np) {
        float a[2][4], b[2][4];
        key_tile_pv(pa[0], &sm.v[buf][0][0], kRow, np, a[0], a[1]);
#pragma unroll
        for (int k = 1; k < kGroups; ++k) {
          key_tile_pv(pa[k], &sm.v[buf][16 * k][0], kRow, np, b[0], b[1]);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if (cg[k - 1][h].skip) continue;
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
              for (int e = 0; e < 2; ++e) a[j][2 * h + e] = merged(a[j][2 * h + e], b[j][2 * h + e], cg[k - 1][h]);
          }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (!take[h] || (!single[h] && cs[h].skip)) continue;
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = st[2 * np + j][2 * h + e];
              x = single[h] ? a[j][2 * h + e] : merged(x, a[j][2 * h + e], cs[h]);
            }
        }
      }
    }
    __syncthreads();  // every warp has read this buffer before the next split's copies refill it
  }

  // Every vector of a tile writes acc / l (the decode kernel's last split or only split).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (!vok[h]) continue;
    bf16* o = out + vrow[h] * out_stride + static_cast<int64_t>(vhead[h]) * hd;
    const float inv = inverse_of_sum(st_l[h]);
#pragma unroll
    for (int nt = 0; nt < kDimTiles; ++nt) {
      const int d = nt * 8 + 2 * qd;
      if (d < hd)
        *reinterpret_cast<uint32_t*>(o + d) = pack_bf16(__fmul_rn(st[nt][2 * h], inv), __fmul_rn(st[nt][2 * h + 1], inv));
    }
  }
  pdl_release();
}

template <int HD>
void launch_shared_keys(const Mat& q, const Mat& k_cache, const Mat& v_cache, const AttnRow* rows,
                        const AttnTile* tiles, const AttnTile* runs, int n_runs, int most_tiles,
                        const int32_t* page_tables, const AttnShape& shp, Mat out, cudaStream_t s) {
  const auto kernel = attention_shared_keys_kernel<HD>;
  constexpr size_t smem = sizeof(SharedKeys<HD>);
  static std::atomic<uint64_t> configured{0};
  once_per_device(configured, [&] {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  });
  const int heads = attention_mma_heads(shp), group = shp.n_heads / shp.n_kv_heads;
  const int chunks = (group + heads - 1) / heads;
  const dim3 grid(static_cast<unsigned>(n_runs * shp.n_kv_heads * chunks));
  // A grid that fits the SMs one block each gets 8 warps a block (one an SM); a larger one a warp
  // per tile of the longest run, rounded up to 2, 4 or 8 (the copies' split of rows), so that two
  // blocks of 4 tiles share an SM (H200, 8B shape, DFlash batch 32: 256 blocks, 19.75-19.88 ->
  // 18.95-19.07 ms a step; at batch 16, 128 blocks, two a SM were slower: 11.12 -> 11.68).
  const int warps = int64_t{grid.x} <= sm_count() || most_tiles > 4 ? kMaxTiles : most_tiles <= 2 ? 2 : 4;
  launch_smem(kernel, grid, warps * 32, smem, s, q.data, q.stride, k_cache.data, k_cache.stride, v_cache.data,
              v_cache.stride, rows, tiles, runs, page_tables, shp, heads, out.data, out.stride);
}

}  // namespace

int attention_run_tiles() { return kMaxTiles; }

void launch_attention_shared_keys(const Mat& q, const Mat& k_cache, const Mat& v_cache, const AttnRow* rows,
                                  const AttnTile* tiles, const AttnTile* runs, int n_runs, int most_tiles,
                                  const int32_t* page_tables, const AttnShape& shp, Mat out, cudaStream_t s) {
  if (n_runs == 0) return;
  if (shp.head_dim <= 64)
    launch_shared_keys<64>(q, k_cache, v_cache, rows, tiles, runs, n_runs, most_tiles, page_tables, shp, out, s);
  else
    launch_shared_keys<128>(q, k_cache, v_cache, rows, tiles, runs, n_runs, most_tiles, page_tables, shp, out, s);
}

}  // namespace dflash::cuda
