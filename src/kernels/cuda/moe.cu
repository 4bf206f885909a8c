// Mixture-of-experts routing and combine (Backend::moe): the router's top-k per token, the
// token/expert pairs grouped by expert into the work items of the routed products
// (launch_skinny_gemm_routed, launch_moe_gemm), and the weighted sum of each token's expert outputs.
//
// Within an expert the order of its pairs is whatever the atomics give: a pair's product never
// depends on the other pairs of its tile (skinny_gemm.cu's reduction order), and each pair
// writes its own output row, so results do not depend on it.
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/moe_math.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/peer_collectives.h"
#include "kernels/cuda/peer_words.cuh"

namespace dflash::cuda {
namespace {

// A warp routes token t: pair j of the token is its j-th chosen expert in increasing index (the
// order of the sum in the combine). count (optional): each chosen expert's pairs, in shared memory.
template <int kPerLane>
__device__ __forceinline__ void route_row(const bf16* logits, int64_t stride, int t, int E, const MoeRouting& r,
                                          int* count) {
  const bf16* row = logits + t * stride;
  route_token<kPerLane>([&](int e) { return ld(row + e); }, E, r.top_k, r.norm, [&](int j, int e, float weight) {
    r.expert_of_pair[t * r.top_k + j] = e;
    r.weight_of_pair[t * r.top_k + j] = weight;
    if (count) atomicAdd(&count[e], 1);
  });
}

// Many tokens (prefill): a warp a token over as many blocks as it takes, before the one-block
// grouping below (one block routing 2048 tokens took 214 us on an H200).
constexpr int kRouteRowWarps = 8;
template <int kPerLane>
__global__ void __launch_bounds__(kRouteRowWarps * 32) moe_route_rows_kernel(const bf16* __restrict__ logits,
                                                                            int64_t stride, int M, int E,
                                                                            MoeRouting r) {
  pdl_begin();
  const int t = blockIdx.x * kRouteRowWarps + threadIdx.x / 32;
  if (t < M) route_row<kPerLane>(logits, stride, t, E, r, nullptr);
}

// One block routes the M rows of logits [M, E], a warp a token (routed: moe_route_rows_kernel
// did, the block only counts each expert's pairs), then groups the pairs. kPerLane: experts a
// lane looks after (E <= 32 * kPerLane).
template <int kPerLane>
__global__ void __launch_bounds__(1024) moe_route_kernel(const bf16* __restrict__ logits, int64_t stride, int M,
                                                         int E, MoeRouting r, bool routed) {
  __shared__ int count[kMoeMaxExperts], first[kMoeMaxExperts], first_item[kMoeMaxExperts];
  pdl_begin();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
  const int top_k = r.top_k;
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
  __syncthreads();
  if (routed) {
    for (int p = threadIdx.x; p < M * top_k; p += blockDim.x) atomicAdd(&count[r.expert_of_pair[p]], 1);
  } else {
    for (int t = warp; t < M; t += n_warps) route_row<kPerLane>(logits, stride, t, E, r, count);
  }
  __syncthreads();

  // Where each expert's pairs and work items begin: warp 0 scans the experts 32 at a time.
  const int tile_rows = r.tile_rows;
  if (warp == 0) {
    int pair = 0, item = 0;
    for (int e0 = 0; e0 < E; e0 += 32) {
      const int e = e0 + lane;
      const int n = e < E ? count[e] : 0, chunks = (n + tile_rows - 1) / tile_rows;
      int pairs_before = n, items_before = chunks;  // inclusive scans over the lanes
      for (int o = 1; o < 32; o *= 2) {
        const int p = __shfl_up_sync(kFull, pairs_before, o), i = __shfl_up_sync(kFull, items_before, o);
        if (lane >= o) pairs_before += p, items_before += i;
      }
      if (e < E) {
        first[e] = pair + pairs_before - n;
        first_item[e] = item + items_before - chunks;
      }
      pair += __shfl_sync(kFull, pairs_before, 31);
      item += __shfl_sync(kFull, items_before, 31);
    }
    if (lane == 0) *r.n_items = item, r.next_units[0] = 0, r.next_units[1] = 0;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    if (r.expert_rows) r.expert_rows[e] = count[e];
    for (int c = 0; c * tile_rows < count[e]; ++c) {
      int32_t* it = r.items + 3 * (first_item[e] + c);
      it[0] = e;
      it[1] = first[e] + c * tile_rows;
      it[2] = min(tile_rows, count[e] - c * tile_rows);
    }
  }
  __syncthreads();  // count[] becomes each expert's cursor below
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = first[e];
  __syncthreads();
  for (int p = threadIdx.x; p < M * top_k; p += blockDim.x) r.pairs[atomicAdd(&count[r.expert_of_pair[p]], 1)] = p;
}

// Two columns a thread: out[t][c] = sum_j weight[t, j] * y[t * top_k + j][c], j ascending.
// push (push.n_ranks > 1; out contiguous, cols even): each thread's two columns also go to the
// peers as one flagged word of a pushed exchange (peer_collectives.h).
constexpr int kCombineThreads = 256;
__global__ void __launch_bounds__(kCombineThreads) moe_combine_kernel(const bf16* __restrict__ y, int64_t y_stride,
                                                                      const float* __restrict__ weight_of_pair,
                                                                      int top_k, int64_t cols, bf16* __restrict__ out,
                                                                      int64_t out_stride, PeerPush push) {
  pdl_begin();
  const int t = blockIdx.y;
  const int64_t c = 2 * (int64_t{blockIdx.x} * kCombineThreads + threadIdx.x);
  if (c >= cols) return;
  float a = 0.0f, b = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    const int64_t pair = int64_t{t} * top_k + j;
    const float w = weight_of_pair[pair];
    const bf16* yr = y + pair * y_stride + c;
    a = fmaf(w, ld(yr), a);
    if (c + 1 < cols) b = fmaf(w, ld(yr + 1), b);
  }
  if (push.n_ranks > 1) {
    const __nv_bfloat162 ab = __floats2bfloat162_rn(a, b);
    const uint32_t word = *reinterpret_cast<const uint32_t*>(&ab);
    *reinterpret_cast<uint32_t*>(out + t * out_stride + c) = word;
    push_word(push, push_call(push), (t * cols + c) / 2, word);
    return;
  }
  auto* o = reinterpret_cast<__nv_bfloat16*>(out + t * out_stride + c);
  o[0] = __float2bfloat16(a);
  if (c + 1 < cols) o[1] = __float2bfloat16(b);
}

}  // namespace

void launch_moe_route(const Mat& logits, const MoeRouting& r, cudaStream_t s) {
  // A warp a token, up to 32 warps; the fewest experts a lane that cover E. More than 32 tokens:
  // the tokens first, a warp each over many blocks, then the one block groups the pairs (at 128
  // rows, the DFlash step of batch 8, the one block's warps routing 4 tokens each in turn took
  // 22 us a layer; H100, 12 layers of the 30B-A3B shape: that step 6.13 -> 5.90 ms).
  const int m = static_cast<int>(logits.rows), e = static_cast<int>(logits.cols);
  const bool rows_first = m > 32;
  const dim3 threads(32 * std::min(32, std::max(4, m)));
  auto go = [&](auto rows_kernel, auto kernel) {
    if (rows_first)
      launch(rows_kernel, dim3((m + kRouteRowWarps - 1) / kRouteRowWarps), dim3(kRouteRowWarps * 32), s, logits.data,
             logits.stride, m, e, r);
    launch(kernel, dim3(1), threads, s, logits.data, logits.stride, m, e, r, rows_first);
  };
  if (e <= 128) go(moe_route_rows_kernel<4>, moe_route_kernel<4>);
  else if (e <= 256) go(moe_route_rows_kernel<8>, moe_route_kernel<8>);
  else if (e <= 512) go(moe_route_rows_kernel<16>, moe_route_kernel<16>);
  else go(moe_route_rows_kernel<32>, moe_route_kernel<32>);
}

void launch_moe_combine(const Mat& y, const float* weight_of_pair, int top_k, Mat out, cudaStream_t s,
                        const PeerPush* push) {
  const unsigned col_blocks = static_cast<unsigned>((out.cols + 2 * kCombineThreads - 1) / (2 * kCombineThreads));
  launch(moe_combine_kernel, dim3(col_blocks, static_cast<unsigned>(out.rows)), dim3(kCombineThreads), s, y.data,
         y.stride, weight_of_pair, top_k, out.cols, out.data, out.stride, push ? *push : PeerPush{});
}

}  // namespace dflash::cuda
