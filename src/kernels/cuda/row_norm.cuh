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

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int n_warps = blockDim.x / 32;
  v = lane < n_warps ? partial[lane] : 0.0f;
  v = warp_sum(v);
  __syncthreads();  // partial[] may be reused by the next call
  return v;
}

__device__ __forceinline__ void unpack8(const uint4& raw, float (&f)[8]) {
  const auto* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __bfloat1622float2(h2[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 raw;
  auto* h2 = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h2[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return raw;
}

// One row of `cols` values (cols % 8 == 0, cols <= kVecMaxCols, 16-byte aligned rows), all
// kRowThreads threads of the block taking part: v = res + delta rounded to bf16 (kAdd) or res,
// stored to res_out when that is set (it may be res: each thread loads its pieces before it
// stores them); then y = w * round(v * rsqrt(mean(v^2) + eps)), given to store(i, 8 values
// packed) for the 8-value piece i. Each thread loads all its pieces before anything is stored,
// so a row costs one round trip to memory.
template <bool kAdd, typename Store>
__device__ __forceinline__ void norm_row(const uint16_t* res, const uint16_t* delta, uint16_t* res_out,
                                         const uint16_t* w, float eps, int cols, Store store) {
  const int n_vec = cols / 8;
  uint4 xv[kVecPerThread], dv[kVecPerThread], wv[kVecPerThread];
#pragma unroll
  for (int k = 0; k < kVecPerThread; ++k) {
    const int i = threadIdx.x + k * kRowThreads;
    if (i >= n_vec) continue;
    xv[k] = *reinterpret_cast<const uint4*>(res + 8 * i);
    if constexpr (kAdd) dv[k] = *reinterpret_cast<const uint4*>(delta + 8 * i);
    wv[k] = __ldg(reinterpret_cast<const uint4*>(w + 8 * i));
  }
  float v[kVecPerThread][8];
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < kVecPerThread; ++k) {
    const int i = threadIdx.x + k * kRowThreads;
    if (i >= n_vec) continue;
    unpack8(xv[k], v[k]);
    if constexpr (kAdd) {
      float dd[8];
      unpack8(dv[k], dd);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[k][e] = round_bf(v[k][e] + dd[e]);
    }
    if (res_out) *reinterpret_cast<uint4*>(res_out + 8 * i) = pack8(v[k]);
#pragma unroll
    for (int e = 0; e < 8; ++e) ss += v[k][e] * v[k][e];
  }
  const float scale = rsqrtf(block_sum(ss) / static_cast<float>(cols) + eps);
#pragma unroll
  for (int k = 0; k < kVecPerThread; ++k) {
    const int i = threadIdx.x + k * kRowThreads;
    if (i >= n_vec) continue;
    float wf[8], y[8];
    unpack8(wv[k], wf);
#pragma unroll
    for (int e = 0; e < 8; ++e) y[e] = wf[e] * round_bf(v[k][e] * scale);
    store(i, pack8(y));
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
