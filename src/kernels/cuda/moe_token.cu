// The routed MLP of a single token (decode at batch 1), in two kernels after the router product
// instead of five kernels after it (RMSNorm, routing, gate/up, down, combine):
//  - gate/up: each block normalizes the token's row itself (before its wait: the router product
//    before it waited for the residual stream), routes the token from its router logits, then
//    streams its expert's gate and up rows for 16 features;
//  - down: each block routes the token again, before its wait (the logits are complete once the
//    gate/up kernel has released it), requests its first weights, then streams the rows of its 16
//    output features of every chosen expert and adds the experts' outputs in increasing index.
// The products use skinny_gemm.cu's operands (chunk_operands.cuh) and reduction order (warp j sums chunks j,
// j + 8, ...; the warps' partial sums added in warp order), the routing moe_math.cuh's and the
// weighted sum moe.cu's combine order, so the result is bit-identical to launch_moe_route +
// launch_skinny_gemm_routed + launch_moe_combine (H100 numbers in bench/results/README.md).
#include <cuda_bf16.h>

#include "kernels/cuda/chunk_operands.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/moe_math.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/peer_collectives.h"
#include "kernels/cuda/peer_words.cuh"
#include "kernels/cuda/row_norm.cuh"

namespace dflash::cuda {
namespace {

constexpr int kWarps = 8;   // warps per block, splitting K
constexpr int kChunk = 32;  // k per chunk
static_assert(kWarps * 32 == kRowThreads, "norm_rows needs the whole block");

// The token's chosen experts in increasing index, and their weights.
struct TokenRoute {
  int expert[kMoeTokenMaxTopK];
  float weight[kMoeTokenMaxTopK];
};

// Warp 0 routes the token into `route` (the caller syncs the block). The logits are read
// through L2: the down kernel reads them before its wait.
template <int kPerLane>
__device__ void route_one(const bf16* logits, const MoeTokenArgs& a, TokenRoute& route) {
  if (threadIdx.x >= 32) return;
  // Non-finite logits choose fewer experts: the others stay expert 0 with weight 0, so that no
  // block reads weights from an unset index.
  if (threadIdx.x < kMoeTokenMaxTopK) route.expert[threadIdx.x] = 0, route.weight[threadIdx.x] = 0.0f;
  __syncwarp();
  const auto* l = reinterpret_cast<const unsigned short*>(logits);
  route_token<kPerLane>([&](int e) { return __bfloat162float(__ushort_as_bfloat16(__ldcg(l + e))); }, a.n_experts,
                        a.top_k, a.norm_topk_prob, [&](int j, int e, float weight) {
                          route.expert[j] = e;
                          route.weight[j] = weight;
                        });
}

// How many of K's 32-k chunks warp w sums: chunks w, w + 8, ... (skinny_gemm.cu's split).
__device__ __forceinline__ int chunks_of_warp(int K, int w) {
  const int n_chunks = (K + kChunk - 1) / kChunk;
  return w < n_chunks ? (n_chunks - w + kWarps - 1) / kWarps : 0;
}

// Normalized rows in shared memory are padded by 16 bytes (fewer bank conflicts).
__host__ __device__ constexpr int64_t padded(int64_t k) { return k + 8; }

// Gate/up: block (x, j) computes features [16 x, 16 x + 16) of silu(gate) * up for the token's
// j-th chosen expert into act row j. Weights [gate; up] of N rows each per expert, w_step apart.
constexpr int kGateUpStages = 4;  // 64 KiB of ring a block: three blocks an SM
using GateUpStage = uint4[2][16][4];
template <int kPerLane, typename R>
__global__ void __launch_bounds__(kWarps * 32, 3) moe_token_gate_up_kernel(RowNorm norm, int K, const bf16* logits,
                                                                         MoeTokenArgs a, const bf16* __restrict__ w,
                                                                         int64_t w_stride, int64_t w_step, int N,
                                                                         bf16* __restrict__ act, int64_t act_stride,
                                                                         bf16* __restrict__ h_out) {
  constexpr int S = kGateUpStages;
  DFLASH_DYNAMIC_SMEM(smem_raw);
  __shared__ TokenRoute route;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  GateUpStage* ring = reinterpret_cast<GateUpStage*>(smem_raw) + warp * S;
  bf16* row = reinterpret_cast<bf16*>(smem_raw + sizeof(GateUpStage) * S * kWarps);

  // The residual stream and delta are complete: the router product waited for them before it
  // released this kernel.
  auto store = [&](int i, const uint4& y) { *reinterpret_cast<uint4*>(row + 8 * i) = y; };
  const R* res = static_cast<const R*>(norm.residual);
  if (norm.delta) norm_row<true>(res, norm.delta, static_cast<R*>(nullptr), norm.weight, norm.eps, K, store);
  else norm_row<false>(res, nullptr, static_cast<R*>(nullptr), norm.weight, norm.eps, K, store);
  pdl_begin();
  route_one<kPerLane>(logits, a, route);
  __syncthreads();  // the route and the row
  const bool first_block = blockIdx.x == 0 && blockIdx.y == 0;
  if (first_block && h_out)
    for (int i = threadIdx.x; i < K / 8; i += blockDim.x)
      reinterpret_cast<uint4*>(h_out)[i] = reinterpret_cast<const uint4*>(row)[i];
  if (first_block && a.expert_rows && warp == 0)
    for (int e = lane; e < a.n_experts; e += 32) {
      int chosen = 0;
      for (int j = 0; j < a.top_k; ++j) chosen |= route.expert[j] == e;
      a.expert_rows[e] = chosen;
    }

  const int j = blockIdx.y;
  const bf16* we = w + route.expert[j] * w_step;
  const int64_t n0 = int64_t{blockIdx.x} * 16;
  const uint64_t w_policy = evict_first_policy();
  const int n_mine = chunks_of_warp(K, warp);
  // Piece p4 of this lane is row n0 + g + 8 (p4 % 2) of tile p4 / 2 (+ N for up): one pointer (the
  // lane's gate row at the warp's first chunk) and offsets that are the same for every lane.
  const bf16* lane_w = we + (n0 + g) * w_stride + warp * kChunk + q * 8;
  auto issue = [&](int i) {
    if (i < n_mine) {
      const int k = (warp + i * kWarps) * kChunk + q * 8;
#pragma unroll
      for (int p4 = 0; p4 < 4; ++p4) {
        const int rt = p4 / 2, r = g + 8 * (p4 % 2);
        const bool ok = n0 + r < N && k < K;
        const bf16* src = lane_w + (8 * (p4 % 2) + (rt ? int64_t{N} : 0)) * w_stride + int64_t{i} * (kWarps * kChunk);
        cp_async16_evict_first(&ring[i % S][rt][r][chunk_piece(r, q)], ok ? src : we, ok, w_policy);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < S; ++i) issue(i);

  float acc[2][4] = {};
  for (int i = 0; i < n_mine; ++i) {
    cp_async_wait<S - 1>();
    __syncwarp();
    const GateUpStage& st = ring[i % S];
    uint32_t wa[2][2][4], xb[4];  // [gate, up][mma]
#pragma unroll
    for (int rt = 0; rt < 2; ++rt)
#pragma unroll
      for (int s = 0; s < 2; ++s) chunk_weights(wa[rt][s], st[rt], s, lane);
    chunk_tokens_of_row(xb, row, (warp + i * kWarps) * kChunk, K, g == 0, lane);
    __syncwarp();  // every lane has read the stage before it is refilled
    issue(i + S);
    chunk_mma(acc[0], wa[0], xb);
    chunk_mma(acc[1], wa[1], xb);
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring becomes the reduction
  auto& red = *reinterpret_cast<float(*)[kWarps][2][4][32]>(smem_raw);
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][t][i][lane] = acc[t][i];
  __syncthreads();
  // Token 0's values: lanes l with l % 4 == 0, accumulators 0 (feature l / 4) and 2 (l / 4 + 8).
  if (threadIdx.x < 16) {
    const int f = threadIdx.x, l = 4 * (f % 8), i = f < 8 ? 0 : 2;
    const int64_t feature = n0 + f;
    if (feature < N) {
      float gate = 0.0f, up = 0.0f;
#pragma unroll
      for (int ww = 0; ww < kWarps; ++ww) gate += red[ww][0][i][l];
#pragma unroll
      for (int ww = 0; ww < kWarps; ++ww) up += red[ww][1][i][l];
      const float y = gate / (1.0f + expf(-gate)) * up;  // float32 gate and up, rounded once
      reinterpret_cast<__nv_bfloat16*>(act)[j * act_stride + feature] = __float2bfloat16(y);
    }
  }
}

// Down and the weighted sum: block x computes output features [16 x, 16 x + 16) of the sum over
// the token's chosen experts j (increasing index) of weight_j * bf16(act_j * down_j^T), K = the
// experts' width. Two groups of 8 warps take the chosen experts in turn (group g: j = g, g + 2,
// ...); within a group, warp w sums chunks w, w + 8, ... of each of its experts, as in the other
// forms, so every expert's partial sums and their order are unchanged. 16 warps instead of 8
// halve each warp's sequence of dependent steps: one block of 8 warps an SM could not take its
// chunks as fast as they arrived (Nsight Compute, H100: 18.9 us alone, 1.38 TB/s).
// 128 KiB of ring (8 stages a warp, one block an SM) leave room for the next layer's q/k/v
// product to request its weights beside it; 64 or 192 KiB were slower (bench/results/README.md).
constexpr int kDownGroups = 2;
constexpr int kDownWarps = kWarps * kDownGroups;
constexpr int kDownStages = 8;
constexpr int kActLoads = 4;  // activation pieces a thread loads at once: 8 experts of 2048 features in one pass
using DownStage = uint4[16][4];
template <int kPerLane>
__global__ void __launch_bounds__(kDownWarps * 32) moe_token_down_kernel(const bf16* logits, MoeTokenArgs a,
                                                                          const bf16* __restrict__ act,
                                                                          int64_t act_stride, int K,
                                                                          const bf16* __restrict__ w, int64_t w_stride,
                                                                          int64_t w_step, int N,
                                                                          bf16* __restrict__ out, PeerPush push) {
  constexpr int S = kDownStages;
  DFLASH_DYNAMIC_SMEM(smem_raw);
  __shared__ TokenRoute route;
  __shared__ float red[kWarps][kMoeTokenMaxTopK][16];  // token 0's partial sums
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int group = warp / kWarps, kw = warp % kWarps;  // kw: the warp's place in the split of K
  DownStage* ring = reinterpret_cast<DownStage*>(smem_raw) + warp * S;
  bf16* rows = reinterpret_cast<bf16*>(smem_raw + sizeof(DownStage) * S * kDownWarps);  // [top_k][padded(K)]
  const int top_k = a.top_k;

  // The router product is complete: the gate/up kernel waited for it before it released this one.
  route_one<kPerLane>(logits, a, route);
  for (int i = threadIdx.x; i < kWarps * kMoeTokenMaxTopK * 16; i += blockDim.x) (&red[0][0][0])[i] = 0.0f;
  __syncthreads();

  const int64_t n0 = int64_t{blockIdx.x} * 16;
  const int n_mine = chunks_of_warp(K, kw);
  const int n_experts = (top_k - group + kDownGroups - 1) / kDownGroups;  // the group's: j = group + kDownGroups * e
  const int n_seq = n_mine * n_experts;
  // The next chunk to request: the group's expert `ie`, the warp's chunk `ic` of it, into ring slot `issued` % S.
  // Piece p2 of this lane is row n0 + g + 8 p2: one pointer an expert (the lane's first row at the warp's first
  // chunk, looked up when the expert changes) and offsets that are the same for every lane.
  int issued = 0, ie = 0, ic = 0;
  const uint64_t w_policy = evict_first_policy();
  const bool row_ok[2] = {n0 + g < N, n0 + g + 8 < N};
  const int64_t lane_offset = (n0 + g) * w_stride + kw * kChunk + q * 8;
  const bf16* lane_w = n_seq > 0 ? w + route.expert[group] * w_step + lane_offset : w;
  auto issue = [&] {
    if (issued < n_seq) {
      const int k = (kw + ic * kWarps) * kChunk + q * 8;
#pragma unroll
      for (int p2 = 0; p2 < 2; ++p2) {
        const bool ok = row_ok[p2] && k < K;
        const bf16* src = lane_w + 8 * p2 * w_stride + int64_t{ic} * (kWarps * kChunk);
        cp_async16_evict_first(&ring[issued % S][g + 8 * p2][chunk_piece(g + 8 * p2, q)], ok ? src : w, ok, w_policy);
      }
      if (++ic == n_mine) {
        ic = 0, ++ie;
        if (ie < n_experts) lane_w = w + route.expert[group + kDownGroups * ie] * w_step + lane_offset;
      }
    }
    ++issued;
    cp_async_commit();
  };
#pragma unroll
  for (int c = 0; c < S; ++c) issue();
  pdl_begin();
  // The experts' activations (the gate/up kernel's output) into shared memory, every load of a
  // thread before its stores: one round trip to L2, not one a piece (Nsight Compute: a fifth of
  // the kernel's stall samples waited on the second).
  const int pieces = K / 8, n_pieces = top_k * pieces;
  auto expert_of = [&](int i) { return i / pieces; };    // piece i: expert i / pieces,
  auto first_k = [&](int i) { return 8 * (i % pieces); };  // its k from 8 (i % pieces)
  for (int i0 = threadIdx.x; i0 < n_pieces; i0 += kActLoads * blockDim.x) {
    uint4 v[kActLoads];
#pragma unroll
    for (int u = 0; u < kActLoads; ++u) {
      const int i = i0 + u * blockDim.x;
      if (i < n_pieces) v[u] = *reinterpret_cast<const uint4*>(act + expert_of(i) * act_stride + first_k(i));
    }
#pragma unroll
    for (int u = 0; u < kActLoads; ++u) {
      const int i = i0 + u * blockDim.x;
      if (i < n_pieces) *reinterpret_cast<uint4*>(rows + expert_of(i) * padded(K) + first_k(i)) = v[u];
    }
  }
  __syncthreads();

  float acc[4] = {};
  int e = 0, i = 0;  // the chunk taken: the group's expert e, the warp's chunk i of it
  for (int c = 0; c < n_seq; ++c) {
    cp_async_wait<S - 1>();
    __syncwarp();
    const DownStage& st = ring[c % S];
    uint32_t wa[2][4], xb[4];
#pragma unroll
    for (int s = 0; s < 2; ++s) chunk_weights(wa[s], st, s, lane);
    const int j = group + kDownGroups * e;
    chunk_tokens_of_row(xb, rows + j * padded(K), (kw + i * kWarps) * kChunk, K, g == 0, lane);
    __syncwarp();
    issue();
    chunk_mma(acc, wa, xb);
    if (++i == n_mine) {  // expert j done: token 0's sums (lanes with q == 0) to the reduction
      if (q == 0) red[kw][j][g] = acc[0], red[kw][j][g + 8] = acc[2];
#pragma unroll
      for (int t = 0; t < 4; ++t) acc[t] = 0.0f;
      i = 0, ++e;
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  if (warp > 0) return;
  const int f = lane % 16;  // lanes 16-31 shadow 0-15 (every lane takes part in the shuffle)
  const int64_t feature = n0 + f;
  float sum = 0.0f;
  if (feature < N) {
    for (int j = 0; j < top_k; ++j) {
      float y = 0.0f;
#pragma unroll
      for (int ww = 0; ww < kWarps; ++ww) y += red[ww][j][f];
      sum = fmaf(route.weight[j], round_bf(y), sum);  // the expert's output in bf16, as the combine reads it
    }
  }
  if (push.n_ranks > 1) {  // N even: features f and f + 1 in one word, here and in the peers' inboxes
    const float next = __shfl_down_sync(kFull, sum, 1);
    if (lane < 16 && f % 2 == 0 && feature < N) {
      const __nv_bfloat162 word2 = __floats2bfloat162_rn(sum, next);
      const uint32_t word = *reinterpret_cast<const uint32_t*>(&word2);
      *reinterpret_cast<uint32_t*>(out + feature) = word;
      push_word(push, push_call(push), feature / 2, word);
    }
  } else if (lane < 16 && feature < N) {
    reinterpret_cast<__nv_bfloat16*>(out)[feature] = __float2bfloat16(sum);
  }
}

template <typename Kernel>
void allow_smem(Kernel kernel, std::atomic<uint64_t>& configured, size_t bytes) {
  once_per_device(configured, [&] {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  });
}

constexpr size_t kMaxSmem = 200 * 1024;
size_t gate_up_smem(int64_t k) { return sizeof(GateUpStage) * kGateUpStages * kWarps + sizeof(bf16) * padded(k); }
size_t down_smem(int top_k, int64_t ff) {
  return sizeof(DownStage) * kDownStages * kDownWarps + sizeof(bf16) * top_k * padded(ff);
}

template <int kPerLane>
void launch_per_lane(const RowNorm& n, const Mat& logits, const MoeTokenArgs& a, const Mat& gate_up, const Mat& down,
                     Mat act, Mat h_out, Mat out, cudaStream_t s, const PeerPush* push) {
  const int64_t k = gate_up.cols, ff = down.cols;
  auto gu = n.f32 ? moe_token_gate_up_kernel<kPerLane, float> : moe_token_gate_up_kernel<kPerLane, bf16>;
  static std::atomic<uint64_t> gu_configured{0}, gu_f32_configured{0}, down_configured{0};
  allow_smem(gu, n.f32 ? gu_f32_configured : gu_configured, kMaxSmem);
  const unsigned blocks = static_cast<unsigned>((ff + 15) / 16);
  launch_smem(gu, dim3(blocks, static_cast<unsigned>(a.top_k)), kWarps * 32, gate_up_smem(k), s, n,
              static_cast<int>(k), logits.data, a, gate_up.data, gate_up.stride, a.gate_up_step,
              static_cast<int>(ff), act.data, act.stride, h_out.data);
  auto dn = moe_token_down_kernel<kPerLane>;
  allow_smem(dn, down_configured, kMaxSmem);
  launch_smem(dn, dim3(static_cast<unsigned>((down.rows + 15) / 16)), kDownWarps * 32, down_smem(a.top_k, ff), s,
              logits.data, a, act.data, act.stride, static_cast<int>(ff), down.data, down.stride, a.down_step,
              static_cast<int>(down.rows), out.data, push ? *push : PeerPush{});
}

}  // namespace

bool moe_token_supported(const RowNorm& n, const Mat& gate_up, const Mat& down, int n_experts, int top_k) {
  const int64_t k = gate_up.cols, ff = down.cols;
  if (!n.residual || top_k < 1 || top_k > kMoeTokenMaxTopK || n_experts < top_k || n_experts > kMoeMaxExperts)
    return false;
  if (down.rows != k || ff % 8 != 0 || gate_up.stride % 8 != 0 || down.stride % 8 != 0 || !aligned16(gate_up.data) ||
      !aligned16(down.data))
    return false;
  if (!rows_fit_registers(k, {}, {n.residual, n.delta, n.weight})) return false;
  static const size_t optin = [] {  // what the device gives a block (H100: 227 KiB)
    int device = 0, bytes = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    return static_cast<size_t>(bytes);
  }();
  return kMaxSmem <= optin && gate_up_smem(k) <= kMaxSmem && down_smem(top_k, ff) <= kMaxSmem;
}

void launch_moe_token(const RowNorm& n, const Mat& logits, const MoeTokenArgs& a, const Mat& gate_up, const Mat& down,
                      Mat act, Mat h_out, Mat out, cudaStream_t s, const PeerPush* push) {
  RowNorm in = n;
  in.residual_out = nullptr;  // the router product stores residual + delta
  const int e = a.n_experts;
  if (e <= 128) launch_per_lane<4>(in, logits, a, gate_up, down, act, h_out, out, s, push);
  else if (e <= 256) launch_per_lane<8>(in, logits, a, gate_up, down, act, h_out, out, s, push);
  else if (e <= 512) launch_per_lane<16>(in, logits, a, gate_up, down, act, h_out, out, s, push);
  else launch_per_lane<32>(in, logits, a, gate_up, down, act, h_out, out, s, push);
}

}  // namespace dflash::cuda
