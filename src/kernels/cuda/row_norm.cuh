// RMSNorm of one row by one block of kRowThreads threads, the row held in
// registers: shared by the RMSNorm kernels and the products that normalize
// their own input (skinny_gemm.cu), so that both give the same bits.
#pragma once

#include <cstdint>
#include <initializer_list>

#include <cuda_bf16.h>

#include "kernels/cuda/device_math.cuh"

namespace dflash::cuda {

constexpr int kRowThreads = 256;
constexpr int kVecPerThread = 4;
constexpr int64_t kVecMaxCols = int64_t{kRowThreads} * 8 * kVecPerThread;

// Sums over the block of G values at once (blockDim.x a multiple of 32, at most 1024); every
// thread gets the results. Each value is reduced as block_sum reduces it (the same bits).
template <int G>
__device__ __forceinline__ void block_sums(float (&v)[G]) {
  __shared__ float partial[G][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
#pragma unroll
  for (int t = 0; t < G; ++t) {
    v[t] = warp_sum(v[t]);
    if (lane == 0) partial[t][warp] = v[t];
  }
  __syncthreads();
#pragma unroll
  for (int t = 0; t < G; ++t) v[t] = warp_sum(lane < n_warps ? partial[t][lane] : 0.0f);
  __syncthreads();  // partial[] may be reused by the next call
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
  float a[1] = {v};
  block_sums<1>(a);
  return a[0];
}

// Eight consecutive values of a row of bf16 (uint16_t) or float32, as floats; stores round
// to bf16 or keep float32.
__device__ __forceinline__ void load8(const uint16_t* p, float (&f)[8]) {
  unpack8(*reinterpret_cast<const uint4*>(p), f);
}
__device__ __forceinline__ void load8(const float* p, float (&f)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}
__device__ __forceinline__ void store8(uint16_t* p, const float (&f)[8]) {
  *reinterpret_cast<uint4*>(p) = pack8(f);
}
__device__ __forceinline__ void store8(float* p, const float (&f)[8]) {
  *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]);
  *reinterpret_cast<float4*>(p + 4) = make_float4(f[4], f[5], f[6], f[7]);
}

// v += delta's 8 values (a piece, packed bf16), rounded to bf16 when the residual stream R is.
template <typename R>
__device__ __forceinline__ void add_piece(float (&v)[8], const uint4& delta) {
  float dd[8];
  unpack8(delta, dd);
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = sizeof(R) == 4 ? v[e] + dd[e] : round_bf(v[e] + dd[e]);
}

// w * v * scale for a piece, rounded once to bf16 and packed.
__device__ __forceinline__ uint4 normalized_piece(const uint4& w, const float (&v)[8], float scale) {
  float wf[8], y[8];
  unpack8(w, wf);
#pragma unroll
  for (int e = 0; e < 8; ++e) y[e] = wf[e] * (v[e] * scale);
  return pack8(y);
}

// Rows t < n (n <= G) of `cols` values (cols % 8 == 0, cols <= kRowThreads * 8 * P, 16-byte
// aligned rows), all kRowThreads threads of the block taking part; row t of each operand starts
// t strides after its first row. The residual stream R is float32 (the model's) or bf16:
// v = res + delta (kAdd; rounded to bf16 when R is) or res, stored to res_out when that is set
// (it may be res: each thread loads its pieces before it stores them); then
// y = w * v * rsqrt(mean(v^2) + eps) in float32, rounded once, given to store(t, i, 8 values
// packed) for row t's 8-value piece i. With cap, v also goes there rounded to bf16. Each thread
// loads its pieces of all n rows before anything is added, reduced or stored, so the rows cost
// one round trip to memory together, and each row's sums are taken in one fixed order whatever
// G, P and n are (the same bits for a row normalized alone or with others).
template <int G, int P, bool kAdd, typename R, typename Store>
__device__ __forceinline__ void norm_rows(int n, const R* res, int64_t res_stride, const uint16_t* delta,
                                          int64_t delta_stride, R* res_out, int64_t res_out_stride, const uint16_t* w,
                                          float eps, int cols, Store store, uint16_t* cap = nullptr,
                                          int64_t cap_stride = 0) {
  const int n_vec = cols / 8;
  float v[G][P][8];
  uint4 dv[G][P], wv[P];
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int i = threadIdx.x + k * kRowThreads;
    if (i < n_vec) wv[k] = __ldg(reinterpret_cast<const uint4*>(w + 8 * i));
  }
#pragma unroll
  for (int t = 0; t < G; ++t) {
    if (t >= n) continue;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int i = threadIdx.x + k * kRowThreads;
      if (i >= n_vec) continue;
      load8(res + t * res_stride + 8 * i, v[t][k]);
      if constexpr (kAdd) dv[t][k] = *reinterpret_cast<const uint4*>(delta + t * delta_stride + 8 * i);
    }
  }
  float ss[G];
#pragma unroll
  for (int t = 0; t < G; ++t) {
    ss[t] = 0.0f;
    if (t >= n) continue;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int i = threadIdx.x + k * kRowThreads;
      if (i >= n_vec) continue;
      if constexpr (kAdd) add_piece<R>(v[t][k], dv[t][k]);
      if (res_out) store8(res_out + t * res_out_stride + 8 * i, v[t][k]);
      if (cap) store8(cap + t * cap_stride + 8 * i, v[t][k]);
#pragma unroll
      for (int e = 0; e < 8; ++e) ss[t] += v[t][k][e] * v[t][k][e];
    }
  }
  block_sums<G>(ss);
#pragma unroll
  for (int t = 0; t < G; ++t) {
    if (t >= n) continue;
    const float scale = rsqrtf(ss[t] / static_cast<float>(cols) + eps);
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int i = threadIdx.x + k * kRowThreads;
      if (i >= n_vec) continue;
      store(t, i, normalized_piece(wv[k], v[t][k], scale));
    }
  }
}

// One row (cols <= kVecMaxCols): norm_rows of a single row, store(i, 8 values packed).
template <bool kAdd, typename R, typename Store>
__device__ __forceinline__ void norm_row(const R* res, const uint16_t* delta, R* res_out, const uint16_t* w, float eps,
                                         int cols, Store store, uint16_t* cap = nullptr) {
  norm_rows<1, kVecPerThread, kAdd>(1, res, 0, delta, 0, res_out, 0, w, eps, cols,
                                    [&](int, int i, const uint4& y) { store(i, y); }, cap);
}

// norm_row in two parts, for a caller with other round trips to make while the row's loads are
// in flight (the ranks' words of a sum): load_row_pieces requests the weights and the residual
// row; norm_loaded_row adds delta's pieces, given in registers, and does norm_rows' arithmetic
// (the same bits as norm_row reading that delta from memory).
struct RowPieces {
  float v[kVecPerThread][8];  // the residual row, this thread's pieces threadIdx.x + k * kRowThreads
  uint4 w[kVecPerThread];     // the norm weights' pieces
};

template <typename R>
__device__ __forceinline__ void load_row_pieces(const R* res, const uint16_t* w, int cols, RowPieces& p) {
#pragma unroll
  for (int k = 0; k < kVecPerThread; ++k) {
    const int i = threadIdx.x + k * kRowThreads;
    if (i >= cols / 8) continue;
    p.w[k] = __ldg(reinterpret_cast<const uint4*>(w + 8 * i));
    load8(res + 8 * i, p.v[k]);
  }
}

template <typename R, typename Store>
__device__ __forceinline__ void norm_loaded_row(RowPieces& p, const uint4 (&delta)[kVecPerThread], R* res_out,
                                                float eps, int cols, Store store, uint16_t* cap) {
  float ss[1] = {0.0f};
#pragma unroll
  for (int k = 0; k < kVecPerThread; ++k) {
    const int i = threadIdx.x + k * kRowThreads;
    if (i >= cols / 8) continue;
    add_piece<R>(p.v[k], delta[k]);
    if (res_out) store8(res_out + 8 * i, p.v[k]);
    if (cap) store8(cap + 8 * i, p.v[k]);
#pragma unroll
    for (int e = 0; e < 8; ++e) ss[0] += p.v[k][e] * p.v[k][e];
  }
  block_sums<1>(ss);
  const float scale = rsqrtf(ss[0] / static_cast<float>(cols) + eps);
#pragma unroll
  for (int k = 0; k < kVecPerThread; ++k) {
    const int i = threadIdx.x + k * kRowThreads;
    if (i < cols / 8) store(i, normalized_piece(p.w[k], p.v[k], scale));
  }
}

// Rows of `cols` values fit norm_row: every row start of every operand 16-byte aligned.
inline bool rows_fit_registers(int64_t cols, std::initializer_list<int64_t> strides,
                               std::initializer_list<const void*> ptrs) {
  if (cols % 8 != 0 || cols > kVecMaxCols) return false;
  for (int64_t st : strides)
    if (st % 8 != 0) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

}  // namespace dflash::cuda
