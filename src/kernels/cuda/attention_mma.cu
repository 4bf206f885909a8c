// Attention on tensor cores for head_dim <= 128, FlashAttention-2's tile
// products with the query vectors of a tile of rows as the M side. A block owns
// one (tile of rows of one sequence, KV head, chunk of its query heads, split of
// kAttnSplitKeys keys); its 16 query vectors are rows x heads of the GQA group,
// so a verification block of 16 rows reads each key and value row 4 times (one
// per tile) instead of 16, and a decode row reads it once for its whole group.
//
// Warp w takes keys [16w, 16w + 16) of the split: scores S = Q K^T with K rows
// read straight into B fragments (Q and K use the same permutation of the dims
// inside each 32-dim chunk, which leaves the dot products unchanged), a masked
// softmax over its 16 keys in fp32, P rounded to bf16 (and summed as rounded),
// then O += P V with V staged in shared memory and read transposed by ldmatrix.
// The warps merge in warp order; several splits are combined by the combine
// kernel of attention.cu, exactly as for the per-row kernel, or (kLoop) by the
// block itself: it runs its tile's splits one after another and merges each
// into a running state in shared memory with the combine's arithmetic
// (attention_common.cuh), so both forms give the same bits. The loop form is
// for grids that fill the GPU without splitting (large batches): no partials
// go through memory and no combine kernel runs.
//
// No arithmetic mixes the rows of a tile and every order is fixed, so a row's
// result does not depend on the rows it is batched with.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/attention_key_tile.cuh"
#include "kernels/cuda/attention_mma.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/rope_math.cuh"

namespace dflash::cuda {
namespace {

constexpr int kWarps = kAttnSplitKeys / 16;  // 16 keys per warp
constexpr int kVecs = 16;                    // query vectors per block: the mma M side

// A key row's 16 bytes, L2 fetching the whole 128-byte line from DRAM at once (a key row's head
// is 128-256 bytes; key and value rows both carry the hint: H100, context 2048, batch 32, 11.62
// -> 11.45 ms a plain step, no change at batch 1); kL2Only: through L2 only (.cg, not kept in L1)
// instead of the read-only path.
template <bool kL2Only>
__device__ __forceinline__ uint4 load_key16(const bf16* p) {
  uint4 v;
  if constexpr (kL2Only)
    asm volatile("ld.global.cg.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else
    asm volatile("ld.global.nc.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// A head held by a quad of lanes (lane qd: dims c * 32 + qd * 8 + (0..7) in x[c]; the head is
// all kChunks * 32 dims): per-head RMSNorm (norm_w may be null) and RoPE by `rope` (the rope
// table's row of the position), the arithmetic of launch_qkv_rope_kv_write (rope_math.cuh).
// Every lane of the warp takes part.
template <int kChunks>
__device__ __forceinline__ void norm_rope_quad(uint4 (&x)[kChunks], const bf16* norm_w, float eps,
                                               const float2* rope, int qd) {
  constexpr int kHalf = kChunks / 2, kDims = kChunks * 32;
  float v[kChunks][8];
  uint4 w[kChunks];  // norm weights of the lane's dims, unpacked when used (registers)
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    unpack8(x[c], v[c]);
    w[c] = norm_w ? __ldg(reinterpret_cast<const uint4*>(norm_w + c * 32 + qd * 8)) : uint4{};
  }
  float scale = 1.0f;
  if (norm_w) {
    float part = 0.0f;  // pieces 4c + qd in increasing c
#pragma unroll
    for (int c = 0; c < kChunks; ++c) part = __fadd_rn(part, piece_sumsq(v[c], 8));
    scale = head_norm_scale(quad_sum_of_parts(part), kDims, eps);
  }
  auto weight = [&](int c, int j) { return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(&w[c])[j]); };
#pragma unroll
  for (int c = 0; c < kHalf; ++c)
#pragma unroll
    for (int j = 0; j < 8; j += 2) {  // pairs c * 32 + qd * 8 + j, + 1: (cos, sin) of both in one float4
      const float4 r = __ldg(reinterpret_cast<const float4*>(rope + c * 32 + qd * 8 + j));
      norm_rotate_pair(v[c][j], v[c + kHalf][j], norm_w != nullptr, weight(c, j), weight(c + kHalf, j), scale, r.x, r.y);
      norm_rotate_pair(v[c][j + 1], v[c + kHalf][j + 1], norm_w != nullptr, weight(c, j + 1), weight(c + kHalf, j + 1),
                       scale, r.z, r.w);
    }
#pragma unroll
  for (int c = 0; c < kChunks; ++c) x[c] = pack8(v[c]);
}

// One block's split: scores, softmax and values for its 16 query vectors (vector g and g + 8
// of this thread: vrow, vhead, vpos, visible keys [lo, hi) of the split, vsplits splits in
// all), then the warps' merge and the output (one split) or the split's partial (several).
// With fresh.k: queries and the keys from r0.fresh_begin on come from qkv, normalized and
// rotated here; a block of the first head chunk writes the new keys of its own tile's rows
// (`writes`: rows [first, first + n) of the batch) to the cache. kLoop (the loop form): the
// four warps share the merge, which runs once a split, and each split merges into the running
// state st_m, st_l, st_acc; else warp 0 merges alone (fewer shared-memory trips: faster where a
// block runs one split) and the split's result goes out. The same arithmetic either way.
template <int HD, bool kFused, bool kLoop, typename Ready>
__device__ __forceinline__ void attend_split(const bf16* q, int64_t q_stride, bf16* kc, int64_t k_stride, bf16* vc,
                                             int64_t v_stride, const AttnFresh& fresh, const AttnRow r0,
                                             const AttnTile writes, const int32_t* page_tables, const AttnShape& shp,
                                             int kv_head, int split, const int (&vrow)[2], const int (&vhead)[2],
                                             const int (&vpos)[2], const int (&lo)[2], const int (&hi)[2],
                                             const int (&vsplits)[2], const bool (&vok)[2], float* workspace,
                                             int max_splits, bf16* out, int64_t out_stride, bf16 (*v_s)[16][HD + 8],
                                             float* merge_s, bf16 (*q_s)[HD + 8],
                                             float (&st_m)[2], float (&st_l)[2], float* st_acc, Ready&& ready) {
  constexpr int kChunks = HD / 32;   // 32-dim chunks of the score product
  constexpr int kDimTiles = HD / 8;  // 8-dim tiles of the output
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, qd = lane % 4, hd = shp.head_dim;
  // A key's row of qkv when it is new (fused, from fresh_begin on), else -1; whether this block writes it.
  auto fresh_row = [&](int key) { return kFused && key >= r0.fresh_begin ? r0.fresh_row + key - r0.fresh_begin : -1; };
  auto writes_row = [&](int row) { return row >= writes.first_row && row < writes.first_row + writes.n_rows; };

  // The warp's keys: n-tile t holds keys kbase + 8t + (0..7); this lane loads key kbase + 8t + g.
  // With pages of a multiple of 16 keys, the warp's 16 keys are the consecutive cache rows from
  // slot0 on: one page lookup, and no shuffles for the V tile's rows.
  const int32_t* pages = page_tables + r0.page_offset;
  const int kbase = split * kAttnSplitKeys + warp * 16;
  const bool consecutive = shp.page_size % 16 == 0;
  const int64_t slot0 = consecutive && kbase < r0.n_keys ? key_slot(pages, kbase, shp.page_size) : 0;
  int64_t slot[2];
  bool kok[2];
  int krow[2];
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const int key = kbase + 8 * t + g;
    kok[t] = key < r0.n_keys;
    slot[t] = !kok[t] ? 0 : consecutive ? slot0 + 8 * t + g : key_slot(pages, key, shp.page_size);
    krow[t] = kok[t] ? fresh_row(key) : -1;
  }
  const int64_t head_off = static_cast<int64_t>(kv_head) * hd;
  // Everything above reads only the batch's metadata (pdl.cuh: staged by copies that precede this
  // kernel, never written by a kernel), so it runs before the wait, under the previous kernel's tail.
  // In the fused form so do the loads of keys and values already in the cache: only
  // earlier steps' kernels wrote them, and those are complete once this kernel runs (its
  // predecessor, the q/k/v product, releases it after its own wait; pdl.cuh), so their DRAM
  // latency goes under the product's tail too (H100, batch 1: about -0.02 ms a step).

  // V rows of the warp's 16 keys head for shared memory first, then K and Q into registers.
  constexpr int kPieces = 16 * HD / 8;  // 16-byte pieces of the warp's V tile
  auto v_src = [&](int kr, int part, bool& ok, int& row, int64_t& sl) {
    if (consecutive) {
      sl = slot0 + kr;
    } else {
      const int64_t s0 = __shfl_sync(kFull, slot[0], (kr % 8) * 4), s1 = __shfl_sync(kFull, slot[1], (kr % 8) * 4);
      sl = kr < 8 ? s0 : s1;
    }
    ok = kbase + kr < r0.n_keys && part * 8 < hd;
    row = ok ? fresh_row(kbase + kr) : -1;
    return !ok ? vc : row >= 0 ? fresh.v + row * fresh.stride + head_off + part * 8 : vc + sl * v_stride + head_off + part * 8;
  };
  // f(kr, part, src, ok, row, slot) for each of this lane's pieces of the warp's V tile.
  auto for_v_pieces = [&](auto f) {
#pragma unroll
    for (int p = lane; p < kPieces; p += 32) {
      const int kr = p / (HD / 8), part = p % (HD / 8);
      bool ok;
      int row;
      int64_t sl;
      const bf16* src = v_src(kr, part, ok, row, sl);
      f(kr, part, src, ok, row, sl);
    }
  };
  uint4 kb[2][kChunks], qa[kChunks][2];
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const bf16* krow_ptr[2];  // this lane's key rows (head kv_head, its first dims)
#pragma unroll
  for (int t = 0; t < 2; ++t)
    krow_ptr[t] = (krow[t] >= 0 ? fresh.k + krow[t] * fresh.stride : kc + slot[t] * k_stride) + head_off + qd * 8;
  // through_l2: cache rows requested before the wait go through L2 only (.cg), so that nothing
  // of them comes from L1 as it was before they were written.
  auto request_kv = [&](bool through_l2) {
    for_v_pieces([&](int kr, int part, const bf16* src, bool ok, int, int64_t) {
      cp_async16_hint<128>(&v_s[warp][kr][part * 8], src, ok);
    });
    cp_async_commit();
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int d = c * 32 + qd * 8;
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const bf16* kp = krow_ptr[t] + c * 32;
        kb[t][c] = !(kok[t] && d < hd) ? zero
                   : through_l2        ? load_key16<true>(kp)
                                       : load_key16<false>(kp);
      }
    }
  };
  // A warp whose 16 keys are all in the cache requests them before the wait; one with new keys
  // (from qkv, written by the product this kernel waits for) after it.
  if (kFused && !__any_sync(kFull, krow[0] >= 0 || krow[1] >= 0)) {
    request_kv(true);
    ready();
  } else {
    ready();
    request_kv(false);
  }
  auto q_src = [&](int h, int d) { return q + vrow[h] * q_stride + static_cast<int64_t>(vhead[h]) * hd + d; };
  if constexpr (kFused) {
    // The queries are normalized and rotated once per block, into q_s: quad g of warp h < 2
    // takes vector g + 8h.
    if (warp < 2) {
      const bool second = warp == 1, ok = second ? vok[1] : vok[0];  // (no dynamic index: registers)
      const bf16* src = q + (second ? vrow[1] : vrow[0]) * q_stride + static_cast<int64_t>(second ? vhead[1] : vhead[0]) * hd;
      uint4 x[kChunks];
#pragma unroll
      for (int c = 0; c < kChunks; ++c) x[c] = ok ? load16(src + c * 32 + qd * 8) : zero;
      norm_rope_quad<kChunks>(x, fresh.q_norm, fresh.eps, fresh.rope + int64_t{second ? vpos[1] : vpos[0]} * (HD / 2), qd);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) *reinterpret_cast<uint4*>(&q_s[g + 8 * warp][c * 32 + qd * 8]) = x[c];
    }
    // New keys, each by the quad that loaded it; written to the cache by the block that owns its row.
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      if (!__any_sync(kFull, krow[t] >= 0)) continue;
      uint4 x[kChunks];
#pragma unroll
      for (int c = 0; c < kChunks; ++c) x[c] = kb[t][c];
      const int key = krow[t] >= 0 ? kbase + 8 * t + g : 0;
      norm_rope_quad<kChunks>(x, fresh.k_norm, fresh.eps, fresh.rope + int64_t{key} * (HD / 2), qd);
      if (krow[t] < 0) continue;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) kb[t][c] = x[c];
      if (writes_row(krow[t])) {
#pragma unroll
        for (int c = 0; c < kChunks; ++c)
          *reinterpret_cast<uint4*>(kc + slot[t] * k_stride + head_off + c * 32 + qd * 8) = x[c];
      }
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
#pragma unroll
      for (int h = 0; h < 2; ++h) qa[c][h] = *reinterpret_cast<const uint4*>(&q_s[g + 8 * h][c * 32 + qd * 8]);
  } else {
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
#pragma unroll
      for (int h = 0; h < 2; ++h) qa[c][h] = vok[h] && c * 32 + qd * 8 < hd ? load16(q_src(h, c * 32 + qd * 8)) : zero;
  }

  // Scores, the masked softmax over the warp's 16 keys and P (attention_key_tile.cuh).
  float sc[2][4] = {};
  key_tile_scores<kChunks>(qa, kb, sc);
  float m[2], l[2];
  key_tile_softmax(sc, kbase, qd, lo, hi, rsqrtf(static_cast<float>(hd)), m, l);
  uint32_t pa[4];
  key_tile_p(sc, pa);
  float acc[kDimTiles][4];  // P V (key_tile_pv starts each dim tile from zero)
  cp_async_wait<0>();
  __syncwarp();
  if constexpr (kFused) {  // new value rows this block owns go to the cache from the tile
    for_v_pieces([&](int kr, int part, const bf16*, bool, int row, int64_t sl) {
      if (row >= 0 && writes_row(row))
        *reinterpret_cast<uint4*>(vc + sl * v_stride + head_off + part * 8) =
            *reinterpret_cast<const uint4*>(&v_s[warp][kr][part * 8]);
    });
  }
#pragma unroll
  for (int np = 0; np < HD / 16; ++np) key_tile_pv(pa, &v_s[warp][0][0], HD + 8, np, acc[2 * np], acc[2 * np + 1]);
  __syncthreads();  // every warp has read its V tile: the merge data reuses that memory

  // The warps merge in warp order (a fixed order: batch-independent): the result starts as warp
  // 0's (m, l, acc) and merges warps 1, 2, 3 in turn. The loop form: each warp does that for a quarter
  // of the dims (warp q: dim tiles [q * kQ, q * kQ + kQ)), so every warp publishes its (m, l) and
  // the quarters the others merge. Else warps 1-3 publish everything and warp 0 merges.
  constexpr int kQ = kLoop ? kDimTiles / kWarps : kDimTiles;  // dim tiles this warp merges and writes
  const int nt0 = kLoop ? warp * kQ : 0;
  float a[kQ][4];
  if constexpr (kLoop) {
    float* ml = merge_s;                          // [kWarps][4][32]: m0, m1, l0, l1
    float* quarters = merge_s + kWarps * 4 * 32;  // [kWarps][kWarps - 1][kQ * 4][32]
    auto quarter_at = [&](int src, int q) {       // src's values of quarter q (q != src)
      return quarters + ((src * (kWarps - 1) + (q < src ? q : q - 1)) * kQ * 4) * 32;
    };
    ml[(warp * 4 + 0) * 32 + lane] = m[0], ml[(warp * 4 + 1) * 32 + lane] = m[1];
    ml[(warp * 4 + 2) * 32 + lane] = l[0], ml[(warp * 4 + 3) * 32 + lane] = l[1];
    float mine[kQ][4];  // this warp's own quarter (selected with constant indices: registers)
#pragma unroll
    for (int q = 0; q < kWarps; ++q) {
#pragma unroll
      for (int j = 0; j < kQ; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if (q == warp) mine[j][i] = acc[q * kQ + j][i];
          else quarter_at(warp, q)[(j * 4 + i) * 32 + lane] = acc[q * kQ + j][i];
        }
    }
    __syncthreads();
    auto value = [&](int src, int j, int i) {
      return src == warp ? mine[j][i] : quarter_at(src, warp)[(j * 4 + i) * 32 + lane];
    };
#pragma unroll
    for (int h = 0; h < 2; ++h) m[h] = ml[h * 32 + lane], l[h] = ml[(2 + h) * 32 + lane];
#pragma unroll
    for (int j = 0; j < kQ; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) a[j][i] = value(0, j, i);
    for (int w = 1; w < kWarps; ++w) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const MergeCoef c = merge_coef(m[h], ml[(w * 4 + h) * 32 + lane]);
        if (c.skip) continue;  // neither has a visible key
        l[h] = merged(l[h], ml[(w * 4 + 2 + h) * 32 + lane], c);
#pragma unroll
        for (int j = 0; j < kQ; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) a[j][2 * h + e] = merged(a[j][2 * h + e], value(w, j, 2 * h + e), c);
      }
    }
  } else {
    constexpr int kState = 4 + HD / 2;  // m and l of two vectors, then the accumulators
    auto other = reinterpret_cast<float(*)[kState][32]>(merge_s);
    if (warp > 0) {
      float(*o)[32] = other[warp - 1];
      o[0][lane] = m[0], o[1][lane] = m[1], o[2][lane] = l[0], o[3][lane] = l[1];
#pragma unroll
      for (int nt = 0; nt < kDimTiles; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[4 + nt * 4 + i][lane] = acc[nt][i];
    }
    __syncthreads();
    if (warp > 0) return;  // warp 0 merges and writes
#pragma unroll
    for (int nt = 0; nt < kDimTiles; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) a[nt][i] = acc[nt][i];
    for (int w = 0; w < kWarps - 1; ++w) {
      const float(*o)[32] = other[w];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const MergeCoef c = merge_coef(m[h], o[h][lane]);
        if (c.skip) continue;  // neither has a visible key
        l[h] = merged(l[h], o[2 + h][lane], c);
#pragma unroll
        for (int nt = 0; nt < kDimTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) a[nt][2 * h + e] = merged(a[nt][2 * h + e], o[4 + nt * 4 + 2 * h + e][lane], c);
      }
    }
  }

  // A vector with one split writes its output; otherwise its split's (m, l, acc) goes to the
  // combine, or (the loop form) merges into the running state (st_m, st_l in every warp's
  // registers, the warp's quarter of acc in st_acc), and the last split writes. A warp writes the
  // dim tiles it merged (spread: its quarter; else warp 0, all of them).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (!vok[h] || split >= vsplits[h]) continue;
    bf16* o = out + vrow[h] * out_stride + static_cast<int64_t>(vhead[h]) * hd;
    auto write_out = [&](auto value_of, float inv) {
#pragma unroll
      for (int j = 0; j < kQ; ++j) {
        const int d = (nt0 + j) * 8 + 2 * qd;
        if (d < hd)
          *reinterpret_cast<uint32_t*>(o + d) =
              pack_bf16(__fmul_rn(value_of(j, 2 * h), inv), __fmul_rn(value_of(j, 2 * h + 1), inv));
      }
    };
    if (kLoop && vsplits[h] > 1) {
      const MergeCoef c = merge_coef(st_m[h], m[h]);
      if (!c.skip) {
        st_l[h] = merged(st_l[h], l[h], c);
#pragma unroll
        for (int j = 0; j < kQ; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = st_acc[(warp * kQ * 4 + j * 4 + 2 * h + e) * 32 + lane];
            x = merged(x, a[j][2 * h + e], c);
          }
      }
      if (split == vsplits[h] - 1)
        write_out([&](int j, int k) { return st_acc[(warp * kQ * 4 + j * 4 + k) * 32 + lane]; }, inverse_of_sum(st_l[h]));
      continue;
    }
    if (vsplits[h] == 1) {
      write_out([&](int j, int k) { return a[j][k]; }, inverse_of_sum(l[h]));
      continue;
    }
    float* part =
        workspace + ((static_cast<int64_t>(vrow[h]) * shp.n_heads + vhead[h]) * max_splits + split) * (hd + 2);
    if (warp == 0 && qd == 0) part[0] = m[h], part[1] = l[h];
#pragma unroll
    for (int j = 0; j < kQ; ++j) {
      const int d = (nt0 + j) * 8 + 2 * qd;
      if (d < hd) part[2 + d] = a[j][2 * h], part[3 + d] = a[j][2 * h + 1];
    }
  }
}

// HD: head_dim rounded up to 64 or 128. `heads` query heads of a KV head's group per block
// (the group, or chunks of 16), 16 / heads rows per tile. kLoop: the block runs all its tile's
// splits (grid.y 1) and combines them itself.
template <int HD, bool kFused, bool kLoop>
__global__ void __launch_bounds__(kWarps * 32, kLoop ? 4 : 0)
    attention_mma_kernel(const bf16* q, int64_t q_stride, bf16* kc, int64_t k_stride, bf16* vc, int64_t v_stride,
                         AttnFresh fresh, const AttnRow* rows, const AttnTile* tiles, const int32_t* page_tables,
                         AttnShape shp, int heads, float* workspace, int max_splits, bf16* out, int64_t out_stride,
                         int release_early) {
  constexpr int kVRow = HD + 8;      // padded: the 8 rows an ldmatrix reads fall on different banks
  constexpr int kAccs = HD / 2;       // accumulators of a lane: HD / 8 tiles of 4
  // The warps' V tiles, then the merge data: every warp's (m, l) and the three quarters of its
  // accumulators that other warps merge (lane-minor: no bank conflicts), in one piece of shared
  // memory: 26 KB for heads of 128, so that two blocks of the product after it (released early)
  // fit an SM beside one of these.
  constexpr size_t kVBytes = sizeof(bf16) * kWarps * 16 * kVRow;
  constexpr size_t kMergeBytes = kLoop ? sizeof(float) * kWarps * (4 + (kWarps - 1) * kAccs / kWarps) * 32
                                      : sizeof(float) * (kWarps - 1) * (4 + kAccs) * 32;
  __shared__ __align__(16) unsigned char smem[kVBytes > kMergeBytes ? kVBytes : kMergeBytes];
  __shared__ __align__(16) bf16 q_s[kFused ? kVecs : 1][kVRow];  // the fused form's rotated queries
  __shared__ float st_acc[kLoop ? kAccs : 1][32];  // the loop form's running accumulators (a quarter per warp)
  auto v_s = reinterpret_cast<bf16(*)[16][kVRow]>(smem);
  auto merge_s = reinterpret_cast<float*>(smem);
  float st_m[2] = {-INFINITY, -INFINITY}, st_l[2] = {0.0f, 0.0f};  // the loop form's running (m, l), in every warp
  // A grid larger than the GPU releases the next kernel only when its blocks are done (below):
  // launched earlier, that kernel's blocks would take the SMs this one still needs for its later
  // blocks (a product then runs on part of the GPU: measured, plain batch 32 10.0 -> 12.7 ms).
  // A grid that the GPU holds at once releases it at the start: every block of this kernel is
  // placed by then, and the product after the combine streams its first weights meanwhile.
  // The fused form's predecessor is the q/k/v product itself: released after the wait
  // (release_early == 2), its successors start streaming when that product is done (released
  // before the wait they start sooner and slow it: plain batch 1 5.57 -> 5.72 ms on an H100).
  // The wait for the previous kernel comes inside the split (ready), after the work that needs
  // only the staged metadata; the end of the kernel waits again for blocks without a split.
  if (release_early == 1) pdl_release();
  auto ready = [&] {
    pdl_wait();
    if (release_early == 2) pdl_release();
  };

  const int g = threadIdx.x % 32 / 4;
  const int group = shp.n_heads / shp.n_kv_heads, chunks = (group + heads - 1) / heads;
  const int chunk = blockIdx.x % chunks, kv_head = (blockIdx.x / chunks) % shp.n_kv_heads;
  const AttnTile tile = tiles[blockIdx.x / chunks / shp.n_kv_heads];
  const int tile_rows = kVecs / heads;

  // This thread's two query vectors, g and g + 8 (vector i = row i / heads, head i % heads).
  int vrow[2], vhead[2], lo[2], hi[2], vsplits[2];
  int vpos[2];
  bool vok[2];
  Visible vis[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = g + 8 * h, ri = i / heads, hj = chunk * heads + i % heads;
    vok[h] = ri < tile_rows && ri < tile.n_rows && hj < group;
    vrow[h] = tile.first_row + (vok[h] ? ri : 0);
    vhead[h] = kv_head * group + hj;
    const AttnRow& rv = rows[vrow[h]];
    vpos[h] = rv.position;
    vis[h] = visible_keys(rv, shp.sliding_window);
    vsplits[h] = vok[h] ? max(n_splits_of(vis[h]), 1) : 0;  // a row with no keys still writes its zeros
  }
  auto run_split = [&](int split) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      lo[h] = max(vis[h].begin, split * kAttnSplitKeys);
      hi[h] = vok[h] ? min(vis[h].end, (split + 1) * kAttnSplitKeys) : lo[h];
    }
    attend_split<HD, kFused, kLoop>(q, q_stride, kc, k_stride, vc, v_stride, fresh, rows[tile.first_row],
                             chunk == 0 ? tile : AttnTile{0, 0}, page_tables, shp, kv_head, split, vrow, vhead, vpos,
                             lo, hi, vsplits, vok, workspace, max_splits, out, out_stride, v_s, merge_s, q_s,
                             st_m, st_l, &st_acc[0][0], ready);
  };
  if constexpr (kLoop) {
    // The state starts empty; each split merges into it in order.
    for (int i = threadIdx.x; i < kAccs * 32; i += kWarps * 32) (&st_acc[0][0])[i] = 0.0f;
    // The barrier also keeps a split's V tile from overwriting the previous split's merge data.
    for (int split = 0; __syncthreads_or(split < vsplits[0] || split < vsplits[1]); ++split) run_split(split);
  } else {
    // Blocks of splits that no vector of the tile has skip the work.
    const int split = blockIdx.y;
    if (__syncthreads_or(split < vsplits[0] || split < vsplits[1])) run_split(split);
  }

  pdl_wait();
  if (!release_early) pdl_release();
}

}  // namespace

namespace {
// (tiles x KV heads x head chunks, splits): splits is 1 for the loop form
dim3 grid_of(const AttnShape& shp, int n_tiles, int splits) {
  const int heads = attention_mma_heads(shp), group = shp.n_heads / shp.n_kv_heads;
  const int chunks = (group + heads - 1) / heads;
  return dim3(static_cast<unsigned>(n_tiles * shp.n_kv_heads * chunks), static_cast<unsigned>(splits));
}
}  // namespace

int attention_mma_heads(const AttnShape& shp) {
  if (shp.head_dim > 128) return 0;
  return std::min(shp.n_heads / shp.n_kv_heads, kVecs);
}

namespace {
// Partials of the split form beyond this size run in the loop form instead: at long context the
// 64-key splits' partials outgrow any workspace (DFlash batch 8 at 32768 keys of the 8B shape:
// 1.09 GB, more than the graphs' 1 GiB arena).
constexpr int64_t kMaxPartialBytes = int64_t{256} << 20;

// Whether a grid of `blocks` blocks a split (the non-fused kernel) runs its splits in a loop: when
// the blocks alone fill the GPU several times over (4 per SM: the DFlash verification and draft
// blocks of batch 32; batch 8 and plain batch 32 are slower in the loop) or the split form's
// partials would take more than kMaxPartialBytes, unless `form` forces a side.
bool loop_splits(int64_t blocks, int64_t partial_bytes, KernelForms::Splits form) {
  using Splits = KernelForms::Splits;
  if (form != Splits::by_rule) return form == Splits::loop;
  return blocks >= 4 * int64_t{sm_count()} || partial_bytes > kMaxPartialBytes;
}
}  // namespace

void launch_attention_mma(const Mat& q, const AttnFresh& fresh, const Mat& k_cache, const Mat& v_cache,
                          const AttnRow* rows, int n_rows, const AttnTile* tiles, int n_tiles, int splits,
                          const int32_t* page_tables, const AttnShape& shp, float* workspace, Mat out,
                          KernelForms::Splits form, bool& released_early, bool& combined, cudaStream_t s) {
  combined = attention_mma_combines_splits(shp, n_rows, n_tiles, splits, fresh.k != nullptr, form);
  const dim3 grid = grid_of(shp, n_tiles, combined ? 1 : splits);
  const int heads = attention_mma_heads(shp);
  auto run = [&](auto kernel) {
    released_early = attention_may_release_early(reinterpret_cast<const void*>(kernel), kWarps * 32, int64_t{grid.x} * grid.y);
    launch(kernel, grid, kWarps * 32, s, q.data, q.stride, k_cache.data, k_cache.stride, v_cache.data,
           v_cache.stride, fresh, rows, tiles, page_tables, shp, heads, workspace, splits, out.data, out.stride,
           released_early ? (fresh.k ? 2 : 1) : 0);
  };
  if (fresh.k) {
    if (shp.head_dim <= 64) run(attention_mma_kernel<64, true, false>);
    else run(attention_mma_kernel<128, true, false>);
  } else if (combined) {
    if (shp.head_dim <= 64) run(attention_mma_kernel<64, false, true>);
    else run(attention_mma_kernel<128, false, true>);
  } else {
    if (shp.head_dim <= 64) run(attention_mma_kernel<64, false, false>);
    else run(attention_mma_kernel<128, false, false>);
  }
}

bool attention_mma_combines_splits(const AttnShape& shp, int n_rows, int n_tiles, int splits, bool fused,
                                   KernelForms::Splits form) {
  // The partials are indexed by the call's rows, every one of them (attention_workspace_bytes).
  const int64_t partial_bytes =
      int64_t{n_rows} * shp.n_heads * splits * (shp.head_dim + 2) * int64_t{sizeof(float)};
  return attention_mma_heads(shp) > 0 && !fused && splits > 1 &&
         loop_splits(grid_of(shp, n_tiles, 1).x, partial_bytes, form);
}

bool attention_mma_fresh_in_one_wave(const AttnShape& shp, int n_tiles, int splits) {
  const dim3 grid = grid_of(shp, n_tiles, splits);
  const void* kernel = shp.head_dim <= 64 ? reinterpret_cast<const void*>(attention_mma_kernel<64, true, false>)
                                          : reinterpret_cast<const void*>(attention_mma_kernel<128, true, false>);
  return gpu_holds_grid(kernel, kWarps * 32, int64_t{grid.x} * grid.y);
}

}  // namespace dflash::cuda
