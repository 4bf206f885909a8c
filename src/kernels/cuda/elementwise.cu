// Row-wise and element-wise kernels. Each computes in float32 and rounds once,
// when it stores a bf16 result; the residual stream may be float32 (Rows), so
// that the sum of the layers' outputs is not rounded after every layer.
#include <cuda_bf16.h>

#include <algorithm>
#include <cfloat>
#include <stdexcept>

#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/peer_collectives.h"
#include "kernels/cuda/peer_words.cuh"
#include "kernels/cuda/rope_math.cuh"
#include "kernels/cuda/row_norm.cuh"

namespace dflash::cuda {
namespace {

using bf = __nv_bfloat16;

__device__ __forceinline__ void st(bf16* p, float v) { *reinterpret_cast<bf*>(p) = __float2bfloat16(v); }
__device__ __forceinline__ void st(float* p, float v) { *p = v; }

// dst[0, cols) = src[0, cols) by the block (bf16 -> float exactly, float -> bf16 rounded to
// nearest, as st() does). Where both rows allow 16-byte pieces, each thread loads up to
// kVecPerThread pieces of 8 before it stores them: a row costs about one round trip to memory
// (element by element, every store waited for the next load: H100, 16 rows of 4096, 11 us).
template <typename S, typename D>
__device__ __forceinline__ void copy_row(const S* __restrict__ src, D* __restrict__ dst, int64_t cols) {
  if (cols % 8 != 0 || !aligned16(src) || !aligned16(dst)) {
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) st(dst + i, ld(src + i));
    return;
  }
  const int64_t n_vec = cols / 8;
  for (int64_t base = threadIdx.x; base < n_vec; base += int64_t{blockDim.x} * kVecPerThread) {
    float v[kVecPerThread][8];
#pragma unroll
    for (int k = 0; k < kVecPerThread; ++k) {
      const int64_t i = base + int64_t{k} * blockDim.x;
      if (i < n_vec) load8(src + 8 * i, v[k]);
    }
#pragma unroll
    for (int k = 0; k < kVecPerThread; ++k) {
      const int64_t i = base + int64_t{k} * blockDim.x;
      if (i < n_vec) store8(dst + 8 * i, v[k]);
    }
  }
}

// R: the residual stream's element type (bf16 or float) in the kernels below.
template <typename R>
__global__ void embed_kernel(const bf16* table, int64_t table_stride, int64_t table_rows, const int32_t* ids,
                             const int32_t* dev_ids, const int32_t* map, int64_t cols, R* out, int64_t out_stride) {
  pdl_begin();
  const int64_t r = blockIdx.x;
  int64_t id = ids[r];
  if (map && map[r] >= 0) {
    id = dev_ids[map[r]];
    if (id < 0 || id >= table_rows) id = 0;
  }
  copy_row(table + id * table_stride, out + r * out_stride, cols);
}

template <typename R>
__global__ void gather_kernel(const R* src, int64_t src_stride, const int32_t* rows, int64_t cols, bf16* out,
                              int64_t out_stride) {
  pdl_begin();
  const int64_t r = blockIdx.x;
  copy_row(src + rows[r] * src_stride, out + r * out_stride, cols);
}

template <typename R>
__global__ void rms_norm_kernel(const R* x, int64_t x_stride, const bf16* w, float eps, int64_t cols, bf16* out,
                                int64_t out_stride) {
  pdl_begin();
  const R* xr = x + blockIdx.x * x_stride;
  bf16* o = out + blockIdx.x * out_stride;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    const float v = ld(xr + i);
    ss += v * v;
  }
  const float scale = rsqrtf(block_sum(ss) / static_cast<float>(cols) + eps);
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) st(o + i, ld(w + i) * (ld(xr + i) * scale));
}

template <typename R>
__global__ void add_rms_norm_kernel(const R* res, int64_t res_stride, const bf16* delta, int64_t delta_stride,
                                    R* res_out, int64_t res_out_stride, const bf16* w, float eps, int64_t cols,
                                    bf16* out, int64_t out_stride) {
  pdl_begin();
  const R* r = res + blockIdx.x * res_stride;
  const bf16* d = delta + blockIdx.x * delta_stride;
  R* ro = res_out + blockIdx.x * res_out_stride;
  bf16* o = out + blockIdx.x * out_stride;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    st(ro + i, ld(r + i) + ld(d + i));
    const float v = ld(ro + i);  // as stored (rounded when R is bf16)
    ss += v * v;
  }
  const float scale = rsqrtf(block_sum(ss) / static_cast<float>(cols) + eps);
  // Each thread re-reads only the elements it wrote above.
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) st(o + i, ld(w + i) * (ld(ro + i) * scale));
}

// The same two norms for rows that fit in registers (norm_row's conditions).
// kAdd: residual + delta goes to res_out (may be res) and is normalized; else res is.
//
// It lets the next kernel be scheduled before its own wait: the product after it (gate/up,
// q/k/v) is launched while the product before it still runs, and streams its first weights as
// soon as the SMs have room, instead of after that product is done and the norm has started. It
// waits for the norm to finish all the same. H100, bench-step at context 512: the DFlash step
// 7.70 -> 7.52 ms at batch 1, plain batch 8 6.34 -> 6.23 ms, batch 1 unchanged (its norms are
// inside the products).
// With sum.y (kAdd): delta's row is first written as the routed MLP's weighted sum (MoeSum), each
// thread storing the pieces that norm_row then has it read back: no combine kernel before it.
// With push.n_ranks > 1 (kAdd, delta contiguous): delta holds this rank's share of a sum over the
// ranks whose products pushed theirs (launch_peer_pushed_sum's arithmetic and bits, done here).
template <bool kAdd, typename R>
__global__ void __launch_bounds__(kRowThreads)
    rms_norm_vec_kernel(const R* res, int64_t res_stride, const bf16* delta, int64_t delta_stride, R* res_out,
                        int64_t res_out_stride, const bf16* w, float eps, int cols, bf16* out, int64_t out_stride,
                        bf16* cap, int64_t cap_stride, MoeSum sum, PeerPush push) {
  pdl_release();
  pdl_begin();
  const int64_t r = blockIdx.x;
  if (kAdd && push.n_ranks > 1) {
    // The row's weights, residual and this rank's share are requested before the call's number
    // (one round trip for all of them), and the row is normalized from registers.
    RowPieces row;
    load_row_pieces(res + r * res_stride, w, cols, row);
    auto* d = reinterpret_cast<uint4*>(const_cast<bf16*>(delta + r * delta_stride));
    const int n_vec = cols / 8;  // norm_row's pieces of 8 values (4 words); this thread's: threadIdx.x + k * kRowThreads
    uint4 own[kVecPerThread];
#pragma unroll
    for (int k = 0; k < kVecPerThread; ++k)
      if (threadIdx.x + k * kRowThreads < n_vec) own[k] = d[threadIdx.x + k * kRowThreads];
    const ReceivedCall rc = receive_pushed_call(push);
    const uint32_t flag = static_cast<uint32_t>(rc.call);
    const int64_t first = static_cast<int64_t>(rc.call & 1) * kPushMaxWords + r * cols / 2;  // the row's first word
    float acc[kVecPerThread][8] = {};
    for (int q = 0; q < push.n_ranks; ++q) {
      uint4 got[kVecPerThread][2];  // two 16-byte halves of a piece; every load in flight before any wait
      const uint4* from = reinterpret_cast<const uint4*>(push.from[q] + first);
#pragma unroll
      for (int k = 0; k < kVecPerThread; ++k) {
        const int i = threadIdx.x + k * kRowThreads;
        if (i >= n_vec) continue;
        if (q == push.rank) {
          got[k][0] = {own[k].x, flag, own[k].y, flag};
          got[k][1] = {own[k].z, flag, own[k].w, flag};
        } else {
          got[k][0] = load_volatile16(from + 2 * i);
          got[k][1] = load_volatile16(from + 2 * i + 1);
        }
      }
#pragma unroll
      for (int k = 0; k < kVecPerThread; ++k) {
        const int i = threadIdx.x + k * kRowThreads;
        if (i >= n_vec) continue;
        got[k][0] = poll_piece(from + 2 * i, got[k][0], flag, push.stop);
        got[k][1] = poll_piece(from + 2 * i + 1, got[k][1], flag, push.stop);
        const uint32_t ws[4] = {got[k][0].x, got[k][0].z, got[k][1].x, got[k][1].z};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ws[e]));
          acc[k][2 * e] += x.x;
          acc[k][2 * e + 1] += x.y;
        }
      }
    }
    uint4 sum[kVecPerThread];
#pragma unroll
    for (int k = 0; k < kVecPerThread; ++k) {
      const int i = threadIdx.x + k * kRowThreads;
      sum[k] = pack8(acc[k]);
      if (i < n_vec) d[i] = sum[k];
    }
    bf16* o = out + r * out_stride;
    norm_loaded_row(row, sum, res_out + r * res_out_stride, eps, cols,
                    [&](int i, const uint4& y) { *reinterpret_cast<uint4*>(o + 8 * i) = y; },
                    cap ? cap + r * cap_stride : nullptr);
    received_call_done(push, rc);
    return;
  }
  if (kAdd && sum.y.data) {
    auto* d = const_cast<bf16*>(delta + r * delta_stride);
    const float* wp = sum.weight_of_pair + r * sum.top_k;
    for (int i = threadIdx.x; i < cols / 8; i += kRowThreads) {  // norm_row's pieces of this thread
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int j = 0; j < sum.top_k; ++j) {
        float y[8];
        load8(sum.y.data + (r * sum.top_k + j) * sum.y.stride + 8 * i, y);
        const float wj = wp[j];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = fmaf(wj, y[e], acc[e]);
      }
      store8(d + 8 * i, acc);
    }
  }
  bf16* o = out + r * out_stride;
  norm_row<kAdd>(res + r * res_stride, kAdd ? delta + r * delta_stride : nullptr,
                 kAdd ? res_out + r * res_out_stride : nullptr, w, eps, cols,
                 [&](int i, const uint4& y) { *reinterpret_cast<uint4*>(o + 8 * i) = y; },
                 cap ? cap + r * cap_stride : nullptr);
}

// One warp per (row, head); lane l owns the rotation pairs (i, i + half) for i = l, l + 32, ...
constexpr int kMaxPairsPerLane = 4;  // head_dim <= 256

// One warp normalizes and rotates one head of head_dim values read from src:
// lane l owns the rotation pairs (i, i + half) for i = l, l + 32, ... (half = head_dim / 2, or
// less with partial rotary: the dimensions from 2 * half on are only normalized). The
// result goes to dst (may alias src) and, when dst2 is set, also to dst2. The
// sum of squares goes in rope_math.cuh's order: lane l sums piece l.
__device__ __forceinline__ void norm_rope_head(const bf16* src, bf16* dst, bf16* dst2, int head_dim, int half,
                                               const bf16* norm_w, float eps, float pos, const float* inv_freq,
                                               int lane) {
  float a[kMaxPairsPerLane], b[kMaxPairsPerLane];
#pragma unroll
  for (int p = 0; p < kMaxPairsPerLane; ++p) {
    const int i = lane + 32 * p;
    a[p] = i < half ? ld(src + i) : 0.0f;
    b[p] = i < half ? ld(src + i + half) : 0.0f;
  }
  float scale = 1.0f;
  if (norm_w) {
    float piece[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) piece[j] = 8 * lane + j < head_dim ? ld(src + 8 * lane + j) : 0.0f;
    const float mine = piece_sumsq(piece, 8);  // zeros past the head add nothing
    float part = 0.0f;
#pragma unroll
    for (int c = 0; c < 8; ++c) {  // pieces c * 4 + lane % 4, in increasing order
      const float v = __shfl_sync(kFull, mine, 4 * c + lane % 4);
      if (8 * (4 * c + lane % 4) < head_dim) part = __fadd_rn(part, v);
    }
    scale = head_norm_scale(quad_sum_of_parts(part), head_dim, eps);
  }
#pragma unroll
  for (int p = 0; p < kMaxPairsPerLane; ++p) {
    const int i = lane + 32 * p;
    if (i >= half) continue;
    float cs, sn;
    rope_cos_sin(pos, inv_freq[i], cs, sn);
    norm_rotate_pair(a[p], b[p], norm_w != nullptr, norm_w ? ld(norm_w + i) : 0.0f,
                     norm_w ? ld(norm_w + i + half) : 0.0f, scale, cs, sn);
    st(dst + i, a[p]);
    st(dst + i + half, b[p]);
    if (dst2) {
      st(dst2 + i, a[p]);
      st(dst2 + i + half, b[p]);
    }
  }
  for (int i = 2 * half + lane; i < head_dim; i += 32) {  // partial rotary: the rest is only normalized
    float v = ld(src + i);
    if (norm_w) v = __fmul_rn(ld(norm_w + i), __fmul_rn(v, scale));
    st(dst + i, v);
    if (dst2) st(dst2 + i, v);
  }
}

// One warp per (row, head).
__global__ void head_norm_rope_kernel(bf16* x, int64_t stride, int n_heads, int head_dim, int half, const bf16* norm_w,
                                      float eps, const int32_t* positions, const float* inv_freq, int64_t n_items) {
  pdl_begin();
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (item >= n_items) return;
  const int64_t row = item / n_heads;
  bf16* v = x + row * stride + (item % n_heads) * head_dim;
  norm_rope_head(v, v, nullptr, head_dim, half, norm_w, eps, static_cast<float>(positions[row]), inv_freq,
                 threadIdx.x % 32);
}

// One warp per (row, q or k head): q heads as head_norm_rope_kernel; a k head
// is normalized, rotated and written to the cache together with its v head.
__global__ void qkv_rope_kv_write_kernel(bf16* qkv, int64_t stride, int n_heads, int n_kv_heads, int head_dim,
                                         int half, const bf16* q_norm, const bf16* k_norm, float eps, const int32_t* positions,
                                         const float* inv_freq, bf16* kc, int64_t kc_stride, bf16* vc,
                                         int64_t vc_stride, const int32_t* slots, int64_t n_items) {
  pdl_begin();
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (item >= n_items) return;
  const int lane = threadIdx.x % 32, per_row = n_heads + n_kv_heads;
  const int64_t row = item / per_row;
  const int head = static_cast<int>(item % per_row);
  const float pos = static_cast<float>(positions[row]);
  bf16* x = qkv + row * stride;
  if (head < n_heads) {
    bf16* v = x + static_cast<int64_t>(head) * head_dim;
    norm_rope_head(v, v, nullptr, head_dim, half, q_norm, eps, pos, inv_freq, lane);
    return;
  }
  const int kvh = head - n_heads;
  const int64_t slot = slots[row], q_dim = static_cast<int64_t>(n_heads) * head_dim,
                kv_dim = static_cast<int64_t>(n_kv_heads) * head_dim, off = static_cast<int64_t>(kvh) * head_dim;
  bf16* k = x + q_dim + off;
  norm_rope_head(k, k, kc + slot * kc_stride + off, head_dim, half, k_norm, eps, pos, inv_freq, lane);
  const bf16* v = x + q_dim + kv_dim + off;
  for (int i = lane; i < head_dim; i += 32) vc[slot * vc_stride + off + i] = v[i];
}

// qkv_rope_kv_write_kernel's key and value work for several layers (blockIdx.y: the layer), from
// kv = [k | v] per layer.
__global__ void kv_rope_write_layers_kernel(bf16* kv, int64_t stride, int n_kv_heads, int head_dim, KvLayers layers,
                                            float eps, const int32_t* positions, const float* inv_freq,
                                            const int32_t* slots, int64_t n_items) {
  pdl_begin();
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (item >= n_items) return;
  const int lane = threadIdx.x % 32, l = blockIdx.y;
  const int64_t row = item / n_kv_heads, kv_dim = static_cast<int64_t>(n_kv_heads) * head_dim;
  const int64_t off = static_cast<int64_t>(item % n_kv_heads) * head_dim, slot = slots[row];
  bf16* k = kv + row * stride + l * 2 * kv_dim + off;
  norm_rope_head(k, k, layers.k_cache[l] + slot * layers.k_stride + off, head_dim, head_dim / 2, layers.k_norm[l], eps,
                 static_cast<float>(positions[row]), inv_freq, lane);
  const bf16* v = k + kv_dim;
  for (int i = lane; i < head_dim; i += 32) layers.v_cache[l][slot * layers.v_stride + off + i] = v[i];
}

// table[p * half + i] = (cos, sin) of position p's rotation of pair i.
__global__ void rope_table_kernel(float2* table, int64_t n, int half, const float* inv_freq) {
  pdl_begin();
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float cs, sn;
    rope_cos_sin(static_cast<float>(e / half), inv_freq[e % half], cs, sn);
    table[e] = make_float2(cs, sn);
  }
}

__global__ void swiglu_kernel(const bf16* gu, int64_t gu_stride, int64_t n, bf16* out, int64_t out_stride) {
  pdl_begin();
  const int64_t r = blockIdx.y;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = ld(gu + r * gu_stride + i), u = ld(gu + r * gu_stride + n + i);
    st(out + r * out_stride + i, g / (1.0f + expf(-g)) * u);
  }
}

__global__ void kv_write_kernel(const bf16* k, int64_t k_stride, const bf16* v, int64_t v_stride, int64_t cols,
                                bf16* kc, int64_t kc_stride, bf16* vc, int64_t vc_stride, const int32_t* slots) {
  pdl_begin();
  const int64_t r = blockIdx.x, slot = slots[r];
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    kc[slot * kc_stride + i] = k[r * k_stride + i];
    vc[slot * vc_stride + i] = v[r * v_stride + i];
  }
}

// Row r's slice s of the argmax: the block's best (value, lowest index) goes to
// part[r][s]; the last block of a row to finish (counted in counters[r], which it
// resets for the next call) reduces the slices. The winner is the row's largest
// value at its lowest index whatever the order, so the result is deterministic.
__device__ __forceinline__ void keep_better(float& best, int64_t& best_i, float v, int64_t i) {
  if (v > best || (v == best && i < best_i)) best = v, best_i = i;
}

__device__ void block_best(float& best, int64_t& best_i) {
  __shared__ float sv[32];
  __shared__ int64_t si[32];
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFull, best, o);
    const int64_t oi = __shfl_xor_sync(kFull, best_i, o);
    keep_better(best, best_i, ov, oi);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) sv[warp] = best, si[warp] = best_i;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) keep_better(best, best_i, sv[w], si[w]);
}

// cand (instead of out): the row's (value, first_id + column) as float32, (NaN, 0) for no value.
__global__ void argmax_kernel(const bf16* x, int64_t stride, int64_t cols, float* part_v, int64_t* part_i,
                              unsigned* counters, int32_t* out, float* cand, int64_t first_id) {
  pdl_begin();
  const int64_t row = blockIdx.y;
  const int n_slices = gridDim.x;
  const int64_t per = ((cols + n_slices - 1) / n_slices + 7) / 8 * 8;
  const int64_t lo = blockIdx.x * per, hi = lo + per < cols ? lo + per : cols;
  const bf16* r = x + row * stride;
  const bool vec = reinterpret_cast<uintptr_t>(r) % 16 == 0;  // lo is a multiple of 8
  float best = -FLT_MAX;
  int64_t best_i = cols;  // NaN-only rows fall back to index 0 below
  // kLoads pieces of 8 values a thread are requested together, then compared (one trip to memory
  // for a slice of up to kLoads * 8 * blockDim.x values); the winner does not depend on the order.
  constexpr int kLoads = 4;
  const int64_t step = int64_t{blockDim.x} * 8;
  for (int64_t c0 = lo + threadIdx.x * 8; c0 < hi; c0 += kLoads * step) {
    uint4 raw[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int64_t c = c0 + u * step;
      if (vec && c + 8 <= hi) raw[u] = *reinterpret_cast<const uint4*>(r + c);
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int64_t c = c0 + u * step;
      if (vec && c + 8 <= hi) {
        float f[8];
        unpack8(raw[u], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) keep_better(best, best_i, f[e], c + e);
      } else {
        for (int64_t i = c; i < c + 8 && i < hi; ++i) keep_better(best, best_i, ld(r + i), i);
      }
    }
  }
  block_best(best, best_i);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    part_v[row * n_slices + blockIdx.x] = best;
    part_i[row * n_slices + blockIdx.x] = best_i;
    __threadfence();
    last = atomicAdd(&counters[row], 1u) == static_cast<unsigned>(n_slices - 1);
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  best = -FLT_MAX;
  best_i = cols;
  for (int sl = threadIdx.x; sl < n_slices; sl += blockDim.x)
    keep_better(best, best_i, __ldcg(part_v + row * n_slices + sl), __ldcg(part_i + row * n_slices + sl));
  block_best(best, best_i);
  if (threadIdx.x == 0) {
    if (cand) {
      cand[2 * row] = best_i < cols ? best : __int_as_float(0x7fffffff);
      cand[2 * row + 1] = best_i < cols ? static_cast<float>(first_id + best_i) : 0.0f;
    } else {
      out[row] = static_cast<int32_t>(best_i < cols ? best_i : 0);
    }
    counters[row] = 0;
  }
}

// ids[r] = the id of the best of row r's n_parts candidates (argmax_kernel's cand), parts in
// order: the largest value at its lowest id, as argmax_kernel over the whole row; 0 for none.
__global__ void argmax_of_candidates_kernel(const float* all, int64_t stride, int64_t rows, int n_parts, int32_t* ids) {
  pdl_begin();
  const int64_t r = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float best = -FLT_MAX;
  int64_t best_i = INT64_MAX;
  for (int k = 0; k < n_parts; ++k)
    keep_better(best, best_i, all[r * stride + 2 * k], static_cast<int64_t>(all[r * stride + 2 * k + 1]));
  ids[r] = static_cast<int32_t>(best_i != INT64_MAX ? best_i : 0);
}

__global__ void add_bias_kernel(bf16* out, int64_t stride, int64_t cols, const bf16* bias) {
  pdl_begin();
  const int64_t r = blockIdx.y;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < cols;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    st(out + r * stride + i, ld(out + r * stride + i) + ld(bias + i));
}

__global__ void f32_to_bf16_kernel(const float* src, bf16* dst, int64_t n) {
  pdl_begin();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    st(dst + i, src[i]);
}

__global__ void fill_random_kernel(bf16* dst, int64_t n, uint64_t seed, float scale) {
  pdl_begin();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(i + 1);  // splitmix64
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    st(dst + i, (2.0f * u - 1.0f) * scale);
  }
}

unsigned grid_for(int64_t n, int threads, unsigned cap = 4096) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > cap ? cap : b));
}

}  // namespace

void set_pdl_enabled(bool on) { g_pdl_enabled = on; }

void launch_embed(const Mat& table, const int32_t* ids, const int32_t* dev_ids, const int32_t* map, Rows out,
                  cudaStream_t s) {
  if (out.rows == 0) return;
  if (out.f32)
    launch(embed_kernel<float>, out.rows, kRowThreads, s, table.data, table.stride, table.rows, ids, dev_ids, map,
           table.cols, static_cast<float*>(out.data), out.stride);
  else
    launch(embed_kernel<bf16>, out.rows, kRowThreads, s, table.data, table.stride, table.rows, ids, dev_ids, map,
           table.cols, static_cast<bf16*>(out.data), out.stride);
}

void launch_gather_rows(const Rows& src, const int32_t* rows, Mat out, cudaStream_t s) {
  if (out.rows == 0) return;
  if (src.f32)
    launch(gather_kernel<float>, out.rows, kRowThreads, s, static_cast<const float*>(src.data), src.stride, rows,
           src.cols, out.data, out.stride);
  else
    launch(gather_kernel<bf16>, out.rows, kRowThreads, s, static_cast<const bf16*>(src.data), src.stride, rows,
           src.cols, out.data, out.stride);
}

template <typename R>
void rms_norm_as(const Rows& x, const bf16* w, float eps, Mat out, cudaStream_t s) {
  const R* xd = static_cast<const R*>(x.data);
  if (rows_fit_registers(x.cols, {x.stride, out.stride}, {x.data, w, out.data})) {
    launch(rms_norm_vec_kernel<false, R>, x.rows, kRowThreads, s, xd, x.stride, static_cast<const bf16*>(nullptr),
           int64_t{0}, static_cast<R*>(nullptr), int64_t{0}, w, eps, static_cast<int>(x.cols), out.data, out.stride,
           static_cast<bf16*>(nullptr), int64_t{0}, MoeSum{}, PeerPush{});
    return;
  }
  launch(rms_norm_kernel<R>, x.rows, kRowThreads, s, xd, x.stride, w, eps, x.cols, out.data, out.stride);
}

void launch_rms_norm(const Rows& x, const bf16* w, float eps, Mat out, cudaStream_t s) {
  if (x.rows == 0) return;
  if (x.f32) rms_norm_as<float>(x, w, eps, out, s);
  else rms_norm_as<bf16>(x, w, eps, out, s);
}

// Whether the rows take the one-pass kernel (rms_norm_vec_kernel), which also writes a capture.
bool add_rms_norm_captures(const Rows& residual, const Mat& delta, const Rows& residual_out, const bf16* w,
                           const Mat& out, const Mat& capture) {
  return rows_fit_registers(residual.cols, {residual.stride, delta.stride, residual_out.stride, out.stride, capture.stride},
                            {residual.data, delta.data, residual_out.data, w, out.data, capture.data});
}

template <typename R>
void add_rms_norm_as(const Rows& residual, const Mat& delta, Rows residual_out, const bf16* w, float eps, Mat out,
                     const Mat& capture, const MoeSum* sum, const PeerPush* rank_sum, cudaStream_t s) {
  const R* rd = static_cast<const R*>(residual.data);
  R* rod = static_cast<R*>(residual_out.data);
  if (add_rms_norm_captures(residual, delta, residual_out, w, out, capture)) {
    launch(rms_norm_vec_kernel<true, R>, residual.rows, kRowThreads, s, rd, residual.stride, delta.data, delta.stride,
           rod, residual_out.stride, w, eps, static_cast<int>(residual.cols), out.data, out.stride, capture.data,
           capture.stride, sum ? *sum : MoeSum{}, rank_sum ? *rank_sum : PeerPush{});
    return;
  }
  if (rank_sum) throw std::logic_error("add_rms_norm: a sum over ranks needs the one-pass kernel (add_rms_norm_captures)");
  if (sum) throw std::logic_error("add_rms_norm: a routed MLP's sum needs the one-pass kernel (add_rms_norm_captures)");
  if (capture.data) throw std::logic_error("add_rms_norm: a capture needs the one-pass kernel (add_rms_norm_captures)");
  launch(add_rms_norm_kernel<R>, residual.rows, kRowThreads, s, rd, residual.stride, delta.data, delta.stride, rod,
         residual_out.stride, w, eps, residual.cols, out.data, out.stride);
}

void launch_add_rms_norm(const Rows& residual, const Mat& delta, Rows residual_out, const bf16* w, float eps, Mat out,
                         cudaStream_t s, const Mat& capture, const MoeSum* sum, const PeerPush* rank_sum) {
  if (residual.rows == 0) return;
  if (residual.f32) add_rms_norm_as<float>(residual, delta, residual_out, w, eps, out, capture, sum, rank_sum, s);
  else add_rms_norm_as<bf16>(residual, delta, residual_out, w, eps, out, capture, sum, rank_sum, s);
}

void launch_head_norm_rope(Mat x, int n_heads, int head_dim, const bf16* norm_w, float eps, const int32_t* positions,
                           const float* inv_freq, int rot_half, cudaStream_t s) {
  const int64_t n_items = x.rows * n_heads;
  if (n_items == 0) return;
  constexpr int kWarps = 4;
  launch(head_norm_rope_kernel, static_cast<unsigned>((n_items + kWarps - 1) / kWarps), 32 * kWarps, s,
         x.data, x.stride, n_heads, head_dim, rot_half, norm_w, eps, positions, inv_freq, n_items);
}

void launch_qkv_rope_kv_write(Mat qkv, int n_heads, int n_kv_heads, int head_dim, const bf16* q_norm,
                              const bf16* k_norm, float eps, const int32_t* positions, const float* inv_freq,
                              int rot_half, Mat k_cache, Mat v_cache, const int32_t* slots, cudaStream_t s) {
  const int64_t n_items = qkv.rows * (n_heads + n_kv_heads);
  if (n_items == 0) return;
  constexpr int kWarps = 4;
  launch(qkv_rope_kv_write_kernel, static_cast<unsigned>((n_items + kWarps - 1) / kWarps), 32 * kWarps, s,
         qkv.data, qkv.stride, n_heads, n_kv_heads, head_dim, rot_half, q_norm, k_norm, eps, positions, inv_freq,
         k_cache.data, k_cache.stride, v_cache.data, v_cache.stride, slots, n_items);
}

void launch_kv_rope_write_layers(Mat kv, int n_kv_heads, int head_dim, const KvLayers& layers, float eps,
                                 const int32_t* positions, const float* inv_freq, const int32_t* slots, cudaStream_t s) {
  const int64_t n_items = kv.rows * n_kv_heads;
  if (n_items == 0 || layers.n == 0) return;
  constexpr int kWarps = 4;
  launch(kv_rope_write_layers_kernel, dim3(static_cast<unsigned>((n_items + kWarps - 1) / kWarps), layers.n),
         32 * kWarps, s, kv.data, kv.stride, n_kv_heads, head_dim, layers, eps, positions, inv_freq, slots, n_items);
}

void launch_rope_table(float2* table, int n_positions, int half, const float* inv_freq, cudaStream_t s) {
  const int64_t n = int64_t{n_positions} * half;
  if (n == 0) return;
  launch(rope_table_kernel, grid_for(n, 256, 4096), 256, s, table, n, half, inv_freq);
}

// Row-indexed grids put rows on gridDim.y (at most 65535 per launch).
constexpr int64_t kMaxGridRows = 65535;

void launch_swiglu(const Mat& gate_up, Mat out, cudaStream_t s) {
  for (int64_t r0 = 0; r0 < out.rows; r0 += kMaxGridRows) {
    const int64_t n = out.rows - r0 < kMaxGridRows ? out.rows - r0 : kMaxGridRows;
    launch(swiglu_kernel, dim3(grid_for(out.cols, 256, 64), static_cast<unsigned>(n)), 256, s,
           gate_up.data + r0 * gate_up.stride, gate_up.stride, out.cols, out.data + r0 * out.stride, out.stride);
  }
}

void launch_kv_write(const Mat& k, const Mat& v, Mat k_cache, Mat v_cache, const int32_t* slots, cudaStream_t s) {
  if (k.rows == 0) return;
  launch(kv_write_kernel, k.rows, 128, s, k.data, k.stride, v.data, v.stride, k.cols, k_cache.data, k_cache.stride,
         v_cache.data, v_cache.stride, slots);
}

int64_t argmax_workspace_bytes() {
  return kArgmaxMaxRows * (sizeof(unsigned) + kArgmaxSlices * (sizeof(int64_t) + sizeof(float)));
}

namespace {
// argmax_kernel into out, or (out null) into cand.
void launch_argmax_kernel(const Mat& x, int32_t* out, float* cand, int64_t first_id, void* workspace, cudaStream_t s) {
  if (x.rows == 0) return;
  // The same layout for every call: the row counters stay where the last call left them (zero).
  auto* counters = static_cast<unsigned*>(workspace);
  auto* part_i = reinterpret_cast<int64_t*>(counters + kArgmaxMaxRows);
  auto* part_v = reinterpret_cast<float*>(part_i + kArgmaxMaxRows * kArgmaxSlices);
  // Rows of a few thousand values need no more than one block each.
  const int slices = static_cast<int>(std::min<int64_t>(kArgmaxSlices, (x.cols + 2047) / 2048));
  launch(argmax_kernel, dim3(slices, static_cast<unsigned>(x.rows)), 256, s, x.data, x.stride, x.cols, part_v,
         part_i, counters, out, cand, first_id);
}
}  // namespace

void launch_argmax(const Mat& x, int32_t* out, void* workspace, cudaStream_t s) {
  launch_argmax_kernel(x, out, nullptr, 0, workspace, s);
}

void launch_argmax_candidates(const Mat& x, int64_t first_id, float* cand, void* workspace, cudaStream_t s) {
  launch_argmax_kernel(x, nullptr, cand, first_id, workspace, s);
}

void launch_argmax_of_candidates(const float* all, int64_t stride, int64_t rows, int n_parts, int32_t* ids,
                                 cudaStream_t s) {
  if (rows == 0) return;
  launch(argmax_of_candidates_kernel, static_cast<unsigned>((rows + 127) / 128), 128, s, all, stride, rows, n_parts,
         ids);
}

void launch_add_bias(Mat out, const bf16* bias, cudaStream_t s) {
  for (int64_t r0 = 0; r0 < out.rows; r0 += kMaxGridRows) {
    const int64_t n = out.rows - r0 < kMaxGridRows ? out.rows - r0 : kMaxGridRows;
    launch(add_bias_kernel, dim3(grid_for(out.cols, 256, 64), static_cast<unsigned>(n)), 256, s,
           out.data + r0 * out.stride, out.stride, out.cols, bias);
  }
}

void launch_f32_to_bf16(const float* src, bf16* dst, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  launch(f32_to_bf16_kernel, grid_for(n, 256), 256, s, src, dst, n);
}

void launch_fill_random(bf16* dst, int64_t n, uint64_t seed, float scale, cudaStream_t s) {
  if (n == 0) return;
  launch(fill_random_kernel, grid_for(n, 256), 256, s, dst, n, seed, scale);
}

}  // namespace dflash::cuda
