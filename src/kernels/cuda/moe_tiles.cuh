// The launch shared by the routed tile products' two forms (moe_gemm.cu, moe_gemm_wgmma.cu): a
// block per work item (grid.y, up to max_items) and per kFeatures output features (grid.x: SwiGLU's
// output columns, else the weight's rows).
#pragma once

#include <atomic>
#include <cstdint>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"

namespace dflash::cuda {

// A block's work item (blockIdx.y): its pairs and its expert's weights. Waits for the routing
// kernel first (pdl_begin); false past the routing's items.
struct TileItem {
  int count;
  const int32_t* pairs;
  const bf16* w;
};
__device__ __forceinline__ bool tile_item(const RoutedRows& routed, const bf16* w, TileItem& item) {
  pdl_begin();
  if (static_cast<int>(blockIdx.y) >= *routed.n_items) return false;
  const int32_t* it = routed.items + 3 * blockIdx.y;
  item = TileItem{it[2], routed.pairs + it[1], w + it[0] * routed.w_step};
  return true;
}

using RoutedTileKernel = void (*)(const bf16*, int64_t, const bf16*, int64_t, int, int, bf16*, int64_t, RoutedRows);

template <int kFeatures, bool kSwiglu>
void launch_routed_tiles(RoutedTileKernel kernel, std::atomic<uint64_t>& configured, size_t smem, int threads,
                         const Mat& x, const Mat& w, Mat out, const RoutedRows& routed, int max_items, cudaStream_t s) {
  once_per_device(configured, [&] {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  });
  const int64_t n = kSwiglu ? out.cols : w.rows;
  const dim3 grid(static_cast<unsigned>((n + kFeatures - 1) / kFeatures), static_cast<unsigned>(max_items));
  launch_smem(kernel, grid, threads, smem, s, x.data, x.stride, w.data, w.stride, static_cast<int>(n),
              static_cast<int>(w.cols), out.data, out.stride, routed);
}

}  // namespace dflash::cuda
