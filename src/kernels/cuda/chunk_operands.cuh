// The skinny products' operands (skinny_gemm.cu, moe_token.cu): a warp's chunk is 32 k of 16-row
// weight tiles and 8-token tiles in shared memory, each row 4 pieces of 16 bytes (8 k) copied by
// cp.async. mma s (0, 1) of a chunk takes k 16 s .. 16 s + 15 (pieces 2 s and 2 s + 1) in the
// standard m16n8k16 fragment layout, which ldmatrix gives straight from shared memory: one
// instruction a weight operand instead of two 16-byte loads and the register moves that put
// {row g, row g + 8, row g, row g + 8} words into four consecutive registers. Piece p of row r
// sits at piece p ^ (r / 2 % 4), so that the 8 rows (64 bytes apart) an ldmatrix reads fall on
// different banks. Every kernel that must give the skinny kernel's bits takes these helpers: the
// k order inside an mma decides the rounding.
#pragma once

#include <cstdint>

#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.h"

namespace dflash::cuda {

// Where piece p of row r of a tile sits.
__device__ __forceinline__ int chunk_piece(int r, int p) { return p ^ ((r >> 1) & 3); }

// mma s's A operand from a 16-row weight tile: matrices (rows 0-7, piece 2 s), (rows 8-15, piece
// 2 s), (rows 0-7, piece 2 s + 1), (rows 8-15, piece 2 s + 1); lane l gives row l % 8 of matrix l / 8.
__device__ __forceinline__ void chunk_weights(uint32_t (&a)[4], const uint4 (*tile)[4], int s, int lane) {
  const int m = lane >> 3, r = 8 * (m & 1) + (lane & 7);
  ldmatrix_x4(a, &tile[r][chunk_piece(r, 2 * s + (m >> 1))]);
}

// Both mmas' B operands from an 8-token tile: b[2 s], b[2 s + 1] for mma s (matrix p: piece p).
__device__ __forceinline__ void chunk_tokens(uint32_t (&b)[4], const uint4 (*tile)[4], int lane) {
  const int r = lane & 7;
  ldmatrix_x4(b, &tile[r][chunk_piece(r, lane >> 3)]);
}

// The same from a token row in shared memory (unswizzled, chunk at k0): word lane % 4 of each
// piece, zero where `on` is false or the piece starts at K or past it (K % 8 == 0).
__device__ __forceinline__ void chunk_tokens_of_row(uint32_t (&b)[4], const bf16* row, int k0, int K, bool on,
                                                    int lane) {
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int k = k0 + 8 * p;
    b[p] = on && k < K ? *reinterpret_cast<const uint32_t*>(row + k + 2 * (lane & 3)) : 0u;
  }
}

// acc += the chunk's product: a[s] the weight operand of mma s, b the token operands.
__device__ __forceinline__ void chunk_mma(float (&acc)[4], const uint32_t (&a)[2][4], const uint32_t (&b)[4]) {
#pragma unroll
  for (int s = 0; s < 2; ++s) mma_bf16(acc, a[s][0], a[s][1], a[s][2], a[s][3], b[2 * s], b[2 * s + 1]);
}

}  // namespace dflash::cuda
