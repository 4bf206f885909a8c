// The routed products of a wide step (prefill): a tile product per work item, an expert and up
// to 128 of its pairs, instead of the skinny kernel's routed form, which streams an expert's
// weights once per 8-32 pairs and splits K over its warps. A block computes 128 weight rows
// (with SwiGLU: 64 gate rows and the same 64 up rows) for the item's pairs; its 8 warps split the
// rows and the pairs (2 x 4), the K loop runs through a 4-stage cp.async ring of 32-k chunks, and
// the mma.sync operands use a k-permuted 16-byte layout (no ldmatrix, no bank
// conflicts: a warp reads 8 consecutive 64-byte rows).
//
// A pair's result depends only on its own row and its expert (the k order is fixed), so rows are
// batch-invariant within this form; its bits differ from the skinny kernel's (another k order),
// so the backend takes it only for steps wide enough (see CudaBackend::moe) and never with
// --batch-invariant. On Hopper the warpgroup form (moe_gemm_wgmma.cu) takes its place.
#include <cuda_bf16.h>

#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/moe_tiles.cuh"
#include "kernels/cuda/pdl.cuh"

namespace dflash::cuda {
namespace {

constexpr int kRows = 128;   // weight rows of a block
constexpr int kPairs = 128;  // pairs of a block (an item's)
constexpr int kStages = 4;
constexpr int kThreads = 256;

struct TileStage {
  uint4 w[kRows][4];   // 32 k of each weight row
  uint4 x[kPairs][4];  // 32 k of each pair's input row
};

template <bool kSwiglu>
__global__ void __launch_bounds__(kThreads, 2) moe_gemm_kernel(const bf16* __restrict__ x, int64_t x_stride,
                                                               const bf16* __restrict__ w, int64_t w_stride, int N,
                                                               int K, bf16* __restrict__ out, int64_t out_stride,
                                                               RoutedRows routed) {
  DFLASH_DYNAMIC_SMEM(smem_raw);
  TileStage* ring = reinterpret_cast<TileStage*>(smem_raw);
  TileItem item;
  if (!tile_item(routed, w, item)) return;
  const int count = item.count;
  const int32_t* pairs = item.pairs;
  const bf16* we = item.w;
  constexpr int kFeatures = kSwiglu ? kRows / 2 : kRows;  // output features of a block
  const int64_t f0 = int64_t{blockIdx.x} * kFeatures;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;

  // This thread's two weight pieces and two input pieces of every stage: piece i = tid + 256 s
  // is row i / 4, 16 bytes i % 4 of the chunk.
  const bf16* w_src[2];
  const bf16* x_src[2];
  bool w_ok[2], x_ok[2];
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int i = tid + kThreads * s, r = i / 4, part = i % 4;
    int64_t row;
    if constexpr (kSwiglu) {
      const int64_t f = f0 + r % 64;
      w_ok[s] = f < N;
      row = r < 64 ? f : N + f;  // gate rows, then the same up rows
    } else {
      row = f0 + r;
      w_ok[s] = row < N;
    }
    w_src[s] = we + (w_ok[s] ? row : 0) * w_stride + part * 8;
    x_ok[s] = r < count;
    x_src[s] = x + (x_ok[s] ? int64_t{pairs[r]} / routed.x_div : 0) * x_stride + part * 8;
  }
  const int n_chunks = (K + 31) / 32;
  auto issue = [&](int c) {
    if (c < n_chunks) {
      TileStage& st = ring[c % kStages];
      const int k0 = c * 32;
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const int i = tid + kThreads * s, r = i / 4, part = i % 4;
        const bool in_k = k0 + part * 8 < K;  // K % 8 == 0: a piece is all in or all out
        cp_async16(&st.w[r][part], w_ok[s] && in_k ? w_src[s] + k0 : we, w_ok[s] && in_k);
        cp_async16(&st.x[r][part], x_ok[s] && in_k ? x_src[s] + k0 : x, x_ok[s] && in_k);
      }
    }
    cp_async_commit();
  };

  // Warp (wm, wn): weight rows of tiles t (16 each) and pairs wn * 32 + 8 j + [0, 8).
  const int wm = warp % 2, wn = warp / 2;
  auto tile_row = [&](int t) { return kSwiglu ? (t < 2 ? 0 : 64) + wm * 32 + 16 * (t % 2) : wm * 64 + 16 * t; };
  float acc[4][4][4] = {};
#pragma unroll
  for (int c = 0; c < kStages - 1; ++c) issue(c);
  for (int c = 0; c < n_chunks; ++c) {
    cp_async_wait<kStages - 2>();  // chunk c has landed
    __syncthreads();               // for every thread; and every thread is done with chunk c - 1
    issue(c + kStages - 1);        // into chunk c - 1's stage
    if (wn * 32 >= count) continue;  // none of this warp's pairs exist (a short item)
    const TileStage& st = ring[c % kStages];
    uint4 b[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) b[j] = st.x[wn * 32 + 8 * j + g][q];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const uint4 lo = st.w[tile_row(t) + g][q], hi = st.w[tile_row(t) + g + 8][q];
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (wn * 32 + 8 * j < count)  // the same for the whole warp
            mma_bf16(acc[t][j], s ? lo.z : lo.x, s ? hi.z : hi.x, s ? lo.w : lo.y, s ? hi.w : hi.y,
                     s ? b[j].z : b[j].x, s ? b[j].w : b[j].y);
    }
  }
  cp_async_wait<0>();

  // acc[t][j][i]: weight row tile_row(t) + g (+ 8 for i >= 2), pair wn * 32 + 8 j + 2 q (+ 1 for odd i).
  auto* o = reinterpret_cast<__nv_bfloat16*>(out);
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = wn * 32 + 8 * j + 2 * q + (i & 1);
      if (r >= count) continue;
      const int64_t row = pairs[r];
#pragma unroll
      for (int t = 0; t < (kSwiglu ? 2 : 4); ++t) {
        const int64_t f = f0 + (kSwiglu ? wm * 32 : wm * 64) + 16 * t + g + (i >= 2 ? 8 : 0);
        if (f >= N) continue;
        float v = acc[t][j][i];
        if constexpr (kSwiglu) v = v / (1.0f + expf(-v)) * acc[t + 2][j][i];  // float32 gate and up, rounded once
        o[row * out_stride + f] = __float2bfloat16(v);
      }
    }
}

template <bool kSwiglu>
void launch_as(const Mat& x, const Mat& w, Mat out, const RoutedRows& routed, int max_items, cudaStream_t s) {
  static std::atomic<uint64_t> configured{0};
  launch_routed_tiles<kSwiglu ? kRows / 2 : kRows, kSwiglu>(moe_gemm_kernel<kSwiglu>, configured,
                                                           sizeof(TileStage) * kStages, kThreads, x, w, out, routed,
                                                           max_items, s);
}

}  // namespace

void launch_moe_gemm(const Mat& x, const Mat& w, Mat out, const RoutedRows& routed, bool swiglu, int max_items,
                     cudaStream_t s) {
  if (swiglu) launch_as<true>(x, w, out, routed, max_items, s);
  else launch_as<false>(x, w, out, routed, max_items, s);
}

}  // namespace dflash::cuda
