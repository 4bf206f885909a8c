// The tensor-core attention's arithmetic for 16 query vectors against one tile of 16 keys:
// scores, the masked softmax and P V. The decode kernel (attention_mma.cu) and the shared-keys
// form (attention_shared_keys.cu) both call these, so that a row gets the same bits from either.
//
// Fragments: lane (g, qd) holds query vectors g and g + 8 (qa[c][h]: 16 bytes, dims
// c * 32 + qd * 8 ..) and key rows 8t + g of the tile (kb[t][c], the same dims); Q and K use the
// same permutation of the dims inside each 32-dim chunk, which leaves the dot products unchanged.
#pragma once

#include <cuda_bf16.h>

#include <cmath>

#include "kernels/cuda/device_math.cuh"

namespace dflash::cuda {

// 16 bytes through the read-only path (queries: written by an earlier kernel).
__device__ __forceinline__ uint4 load16(const bf16* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// sc[t] += (vector g, keys 8t + 2qd + {0, 1}) and (vector g + 8, the same keys): one mma per
// chunk and half, in chunk order.
template <int kChunks>
__device__ __forceinline__ void key_tile_scores(const uint4 (&qa)[kChunks][2], const uint4 (&kb)[2][kChunks],
                                                float (&sc)[2][4]) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c)
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const uint32_t a0 = s ? qa[c][0].z : qa[c][0].x, a1 = s ? qa[c][1].z : qa[c][1].x;
      const uint32_t a2 = s ? qa[c][0].w : qa[c][0].y, a3 = s ? qa[c][1].w : qa[c][1].y;
#pragma unroll
      for (int t = 0; t < 2; ++t) mma_bf16(sc[t], a0, a1, a2, a3, s ? kb[t][c].z : kb[t][c].x, s ? kb[t][c].w : kb[t][c].y);
    }
}

// Masked softmax over the tile's keys kbase .. kbase + 15 per vector (h: g, g + 8; a quad of lanes
// holds a vector's keys): keys outside [lo[h], hi[h]) are masked. sc becomes P rounded to bf16;
// m, l: each vector's maximum (-inf without a visible key) and sum of the rounded P.
__device__ __forceinline__ void key_tile_softmax(float (&sc)[2][4], int kbase, int qd, const int (&lo)[2],
                                                 const int (&hi)[2], float scale, float (&m)[2], float (&l)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = kbase + 8 * t + 2 * qd + e;
        const float v = key >= lo[h] && key < hi[h] ? sc[t][2 * h + e] * scale : -INFINITY;
        sc[t][2 * h + e] = v;
        mx = fmaxf(mx, v);
      }
    mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
    float sum = 0.0f;
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = mx == -INFINITY ? 0.0f : round_bf(__expf(sc[t][2 * h + e] - mx));
        sc[t][2 * h + e] = p;
        sum += p;
      }
    sum += __shfl_xor_sync(kFull, sum, 1);
    sum += __shfl_xor_sync(kFull, sum, 2);
    m[h] = mx;
    l[h] = sum;
  }
}

// P's A fragment: the score tile's accumulator layout, packed to bf16.
__device__ __forceinline__ void key_tile_p(const float (&p)[2][4], uint32_t (&pa)[4]) {
  pa[0] = pack_bf16(p[0][0], p[0][1]), pa[1] = pack_bf16(p[0][2], p[0][3]);
  pa[2] = pack_bf16(p[1][0], p[1][1]), pa[3] = pack_bf16(p[1][2], p[1][3]);
}

// Dim tiles 2np and 2np + 1 of P V from zero: V's 16 rows in shared memory from `v` on, `row`
// elements apart, read transposed by ldmatrix.
__device__ __forceinline__ void key_tile_pv(const uint32_t (&pa)[4], const bf16* v, int row, int np, float (&d0)[4],
                                            float (&d1)[4]) {
  const int lane = threadIdx.x % 32;
  uint32_t b[4];
  ldmatrix_x4_trans(b, v + (lane % 8 + 8 * ((lane / 8) % 2)) * row + np * 16 + 8 * (lane / 16));
#pragma unroll
  for (int i = 0; i < 4; ++i) d0[i] = d1[i] = 0.0f;
  mma_bf16(d0, pa[0], pa[1], pa[2], pa[3], b[0], b[1]);
  mma_bf16(d1, pa[0], pa[1], pa[2], pa[3], b[2], b[3]);
}

}  // namespace dflash::cuda
