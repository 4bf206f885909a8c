// The routed tile products of a wide step (moe_gemm.cu's work: an item's expert and up to 128 of
// its pairs a block) with Hopper's warpgroup products, which read both operands from shared memory:
// no warp loads operand fragments, so the shared memory carries only the copies. Two warpgroups of
// 64 weight rows each (with SwiGLU 32 features, a thread's accumulator rows g and g + 8 being one
// feature's gate and up rows) x 128 pairs (two products of 64 pairs), stages of 64 k in the
// 128-byte swizzle (wgmma.cuh) filled by cp.async, three stages, a stage's products complete before
// its slot is refilled. H100, 12 layers of the 30B-A3B shape, against the mma.sync form: prefill of
// 2048 tokens 16.2-16.5 -> 13.8-13.9 ms, routed gate/up 558 -> 397 us and down 344 -> 267 us a
// layer; the swizzle is what makes it pay (without it, 8 x 16-byte core matrices: 912 and 562 us).
//
// Every product of an item runs for all 128 pairs: skipping the second half for short items made
// ptxas fence each product (C7519), which cost more than the half saved.
//
// A pair's result depends only on its own row and its expert (the k order is fixed): rows are
// batch-invariant within this form; its bits differ from the mma.sync form's and the skinny form's.
#include <cuda_bf16.h>

#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/moe_tiles.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace dflash::cuda {
namespace {

constexpr int kRows = 128, kPairs = 128, kStageK = 64, kStages = 3, kThreads = 256;
constexpr int kPieces = kStageK / 8;  // 16-byte pieces of a row a stage: one 128-byte swizzle row
struct Stage {
  uint4 a[kRows][kPieces];   // weight rows, piece c of row r at c ^ (r % 8)
  uint4 b[kPairs][kPieces];  // the pairs' input rows, likewise
};
constexpr size_t kSmem = sizeof(Stage) * kStages + 1024;  // and the ring's 1024-byte alignment

template <bool kSwiglu>
__global__ void __launch_bounds__(kThreads, 2) moe_gemm_wgmma_kernel(const bf16* __restrict__ x, int64_t x_stride,
                                                                     const bf16* __restrict__ w, int64_t w_stride,
                                                                     int N, int K, bf16* __restrict__ out,
                                                                     int64_t out_stride, RoutedRows routed) {
  DFLASH_DYNAMIC_SMEM(smem_raw);
  // The swizzle repeats every 1024 bytes of the address: the ring starts on such a boundary.
  Stage* ring = reinterpret_cast<Stage*>(smem_raw + (1024 - __cvta_generic_to_shared(smem_raw) % 1024) % 1024);
  TileItem item;
  if (!tile_item(routed, w, item)) return;
  const int count = item.count;
  const int32_t* pairs = item.pairs;
  const bf16* we = item.w;
  constexpr int kFeatures = kSwiglu ? kRows / 2 : kRows;
  const int64_t f0 = int64_t{blockIdx.x} * kFeatures;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  // This thread's copies: pieces p and p + 4 of rows (warp + 8 s) * 8 + lane % 8, s < 2, of the
  // weights and of the pairs (8 lanes fill one 128-byte line of shared memory).
  const int p = lane / 8, rr = lane % 8;
  const bf16* w_src[2];
  bool w_ok[2];
  int x_row[2];  // input rows, -1 past the item's pairs
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int a = (warp + 8 * s) * 8 + rr;  // operand row
    int64_t row;
    if constexpr (kSwiglu) {
      // Rows 16 q + [0, 8) of warpgroup v: gate rows of features v * 32 + q * 8 + [0, 8); rows
      // 16 q + [8, 16): their up rows.
      const int64_t f = f0 + (a / 64) * 32 + (a % 64) / 16 * 8 + a % 8;
      w_ok[s] = f < N;
      row = a % 16 < 8 ? f : N + f;
    } else {
      row = f0 + a;
      w_ok[s] = row < N;
    }
    w_src[s] = we + (w_ok[s] ? row : 0) * w_stride + p * 8;
    x_row[s] = a < count ? pairs[a] / routed.x_div : -1;
  }
  const int n_stages = (K + kStageK - 1) / kStageK;
  auto issue = [&](int c) {
    if (c < n_stages) {
      Stage& st = ring[c % kStages];
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = (warp + 8 * s) * 8 + rr, pc = p + 4 * h, k = c * kStageK + pc * 8;
          const bool wo = w_ok[s] && k < K, xo = x_row[s] >= 0 && k < K;  // K % 8 == 0: all in or out
          cp_async16(&st.a[r][pc ^ rr], wo ? w_src[s] + c * kStageK + 32 * h : we, wo);
          cp_async16(&st.b[r][pc ^ rr], xo ? x + int64_t{x_row[s]} * x_stride + k : x, xo);
        }
    }
    cp_async_commit();
  };

  const int v = warp / 4;  // warpgroup: operand rows 64 v + [0, 64)
  float d[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) d[i] = 0.0f;
#pragma unroll
  for (int c = 0; c < kStages - 1; ++c) issue(c);
  for (int c = 0; c < n_stages; ++c) {
    cp_async_wait<kStages - 2>();  // stage c has landed for this thread
    fence_proxy_async();
    __syncthreads();               // for every thread; the products of stage c - 1 are complete
    issue(c + kStages - 1);        // into stage c - 1's slot
    const Stage& st = ring[c % kStages];
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < kStageK / 16; ++s) {  // k16 step s: 32 bytes into the swizzled rows
      const uint64_t a = sw128_desc(reinterpret_cast<const char*>(&st.a[64 * v][0]) + 32 * s);
      wgmma_64x64<0>(d, a, sw128_desc(reinterpret_cast<const char*>(&st.b[0][0]) + 32 * s));
      wgmma_64x64<32>(d, a, sw128_desc(reinterpret_cast<const char*>(&st.b[64][0]) + 32 * s));
    }
    wgmma_commit_wait(d);
  }
  cp_async_wait<0>();

  // d[4 j + i]: operand row 16 q + g (+ 8 for i & 2) of the warpgroup, pair 8 j + 2 t (+ 1 for odd
  // i), where q is the warp within the warpgroup, g = lane / 4, t = lane % 4.
  const int q = warp % 4, g = lane / 4, t = lane % 4;
  auto* o = reinterpret_cast<__nv_bfloat16*>(out);
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int i = 0; i < (kSwiglu ? 2 : 4); ++i) {
      const int r = 8 * j + 2 * t + (i & 1);
      if (r >= count) continue;
      const int64_t row = pairs[r];
      int64_t f;
      float val;
      if constexpr (kSwiglu) {
        f = f0 + v * 32 + q * 8 + g;
        const float gate = d[4 * j + i], up = d[4 * j + 2 + i];
        val = gate / (1.0f + expf(-gate)) * up;  // float32 gate and up, rounded once
      } else {
        f = f0 + 64 * v + 16 * q + g + (i & 2 ? 8 : 0);
        val = d[4 * j + i];
      }
      if (f < N) o[row * out_stride + f] = __float2bfloat16(val);
    }
}

template <bool kSwiglu>
void launch_as(const Mat& x, const Mat& w, Mat out, const RoutedRows& routed, int max_items, cudaStream_t s) {
  static std::atomic<uint64_t> configured{0};
  launch_routed_tiles<kSwiglu ? kRows / 2 : kRows, kSwiglu>(moe_gemm_wgmma_kernel<kSwiglu>, configured, kSmem,
                                                           kThreads, x, w, out, routed, max_items, s);
}

}  // namespace

bool moe_gemm_wgmma_built() {
  // The kernels run sm_90a code on this device (an sm_90a build on an H100 or H200), not code of
  // another target in which the products trap.
  static const bool built = [] {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, moe_gemm_wgmma_kernel<true>) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return attr.binaryVersion == 90;
  }();
  return built;
}

void launch_moe_gemm_wgmma(const Mat& x, const Mat& w, Mat out, const RoutedRows& routed, bool swiglu,
                           int max_items, cudaStream_t s) {
  if (swiglu) launch_as<true>(x, w, out, routed, max_items, s);
  else launch_as<false>(x, w, out, routed, max_items, s);
}

}  // namespace dflash::cuda
