// The routed MLP of a mixture-of-experts layer on the GPU: the router product, the routing
// (moe.cu), each touched expert's gate/up (SwiGLU) and down products streaming its weights once for
// its pairs (launch_skinny_gemm_routed), and the weighted sum per token; for a single token, the
// router product that normalizes its own input and two kernels that route the token themselves
// (moe_token.cu). No host round trip, fixed launch shapes: capturable in a graph.
#include <algorithm>
#include <cstdint>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/peer_collectives.h"

namespace dflash::cuda {

// Pairs an expert gets on average from which a step takes the tile products (moe_gemm.cu).
constexpr int kMoeWideMinPairs = 32;

namespace {
// Expert 0's gate/up [2 * ff, hidden] and down [hidden, ff]; expert e's follow e steps later.
struct ExpertViews {
  Mat gate_up, down;
};
ExpertViews expert_views(const MoeWeights& w, int64_t hidden) {
  const int64_t ff = w.n_ff;
  return {{static_cast<bf16*>(w.gate_up.data), 2 * ff, hidden, w.gate_up.stride},
          {static_cast<bf16*>(w.down.data), hidden, ff, w.down.stride}};
}
}  // namespace

void CudaBackend::moe(const Tensor& x, const MoeWeights& w, Tensor& out, Tensor* expert_rows, MoeScratch* scratch) {
  moe_to(x, w, out, expert_rows, scratch, nullptr);
}

void CudaBackend::moe_to(const Tensor& x, const MoeWeights& w, Tensor& out, Tensor* expert_rows, MoeScratch* scratch,
                         const PeerPush* push) {
  check_moe(x, w, out, expert_rows);
  require_bf16(x, "moe input");
  require_bf16(w.router, "moe router");
  require_bf16(w.gate_up, "moe gate_up");
  require_bf16(w.down, "moe down");
  check(w.n_experts <= kMoeMaxExperts && w.top_k <= 32, "cuda backend: moe supports up to ", kMoeMaxExperts,
        " experts and top_k 32, got ", w.n_experts, " and ", w.top_k);
  check(x.cols % 8 == 0 && w.n_ff % 8 == 0 && x.stride % 8 == 0 && out.stride % 8 == 0, "cuda backend: moe needs ",
        "hidden and expert sizes that are multiples of 8");
  check(!expert_rows || expert_rows->stride == 1, "cuda backend: expert_rows must be contiguous");
  const int64_t m = x.rows, pairs = m * w.top_k, h = x.cols, ff = w.n_ff;
  if (m == 0) return;

  Tensor logits = alloc(m, w.n_experts);
  matmul(x, w.router, nullptr, logits);
  // A token takes an expert at most once, so an expert has at most m pairs: the tile needs no
  // more rows than that. Wide steps (prefill: 32 or more pairs an expert on average) take the tile
  // products, whose bits differ from the skinny form's: never with --batch-invariant.
  auto items_of = [&](int64_t tile) { return std::min<int64_t>(w.n_experts, pairs) + (pairs + tile - 1) / tile; };
  const bool wide = !options_.batch_invariant && forms_.routed_tiles == KernelForms::RoutedTiles::by_rule &&
                    pairs >= int64_t{kMoeWideMinPairs} * w.n_experts && items_of(kMoeGemmPairs) <= 65535;
  // Items of up to 16 pairs from 9 rows to 256: an expert with more pairs streams its weights once
  // more per item, but the 32-pair forms' wider token tiles cost more than that where experts hold
  // a few pairs each (uniform routers; 8-pair items lost to 16 where a DFlash block's rows share
  // experts). Measured: bench/results/bench_step_h200_moe_item_pairs_ab.txt, bench_step_h200_moe_items_256_rows_ab.txt.
  const int tile = wide ? kMoeGemmPairs : m <= 8 ? 8 : m <= 256 ? 16 : 32;
  routed_tile_products_ += wide;
  const int max_items = static_cast<int>(items_of(tile));
  Tensor expert_of_pair = alloc_as(pairs, 1, DType::I32), weight_of_pair = alloc_as(pairs, 1, DType::F32);
  Tensor pair_list = alloc_as(pairs, 1, DType::I32), items = alloc_as(max_items, 3, DType::I32);
  Tensor n_items = alloc_as(1, 1, DType::I32), next_units = alloc_as(2, 1, DType::I32);
  Tensor counts = expert_rows ? *expert_rows : alloc_as(w.n_experts, 1, DType::I32);
  auto i32 = [](const Tensor& t) { return static_cast<int32_t*>(t.data); };
  const MoeRouting routing{w.top_k,     w.norm_topk_prob, tile,          i32(expert_of_pair),
                           static_cast<float*>(weight_of_pair.data),       i32(pair_list),
                           i32(items),  i32(n_items),     i32(next_units), i32(counts)};
  staging_.launch([&](cudaStream_t s) { launch_moe_route(mat(logits), routing, s); });

  if (scratch) {
    check(scratch->act.rows >= pairs && scratch->act.cols == ff && scratch->y.rows >= pairs && scratch->y.cols == h,
          "cuda backend: moe scratch too small for ", pairs, " pairs");
  }
  Tensor act = scratch ? scratch->act.slice_rows(0, pairs) : alloc(pairs, ff);
  Tensor y = scratch ? scratch->y.slice_rows(0, pairs) : alloc(pairs, h);
  RoutedRows rows{i32(items), i32(n_items), i32(pair_list), i32(next_units), w.top_k, 2 * ff * w.gate_up.stride};
  // The skinny routed form divides work units and pairs by a reciprocal, exact below 2^24 (div_mod).
  constexpr int64_t kExact = int64_t{1} << 24;
  check(wide || (int64_t{max_items} * (std::max(2 * ff, h) / 16 + 1) < kExact && pairs < kExact), "cuda backend: ",
        pairs, " routed pairs in ", max_items, " items are too many for the skinny routed products");
  const ExpertViews e = expert_views(w, h);
  const bool wgmma = forms_.tile_mma == KernelForms::TileMma::by_rule && moe_gemm_wgmma_built();
  auto tiles = wgmma ? launch_moe_gemm_wgmma : launch_moe_gemm;
  staging_.launch([&](cudaStream_t s) {
    if (wide) tiles(mat(x), e.gate_up, mat(act), rows, /*swiglu=*/true, max_items, s);
    else launch_skinny_gemm_routed(mat(x), e.gate_up, mat(act), rows, /*swiglu=*/true, tile, max_items, s);
  });
  rows.x_div = 1;
  rows.w_step = h * w.down.stride;
  // The skinny down products follow the gate/up ones, which waited for the routing before they
  // released: the down blocks request their first weights while the gate/up products finish
  // (H100, 30B-A3B shape, plain batch 1: 3.64 -> 3.50 ms a step).
  rows.next_unit = i32(next_units) + 1;
  rows.items_ready = true;
  staging_.launch([&](cudaStream_t s) {
    if (wide) tiles(mat(act), e.down, mat(y), rows, /*swiglu=*/false, max_items, s);
    else launch_skinny_gemm_routed(mat(act), e.down, mat(y), rows, /*swiglu=*/false, tile, max_items, s);
  });
  if (scratch && scratch->defer_sum && !push) {  // the next RMSNorm sums the experts' outputs as it reads them
    scratch->sum_deferred = true;
    scratch->weight_of_pair = weight_of_pair;
    scratch->top_k = w.top_k;
    return;
  }
  staging_.launch([&](cudaStream_t s) {
    launch_moe_combine(mat(y), static_cast<const float*>(weight_of_pair.data), w.top_k, mat(out), s, push);
  });
}

MoeSum moe_sum_of(const MoeScratch& s, int64_t rows) {
  return {mat(s.y.slice_rows(0, rows * s.top_k)), static_cast<const float*>(s.weight_of_pair.data), s.top_k};
}

void CudaBackend::finish_moe_sum(MoeScratch& ms, const Tensor& out) {
  check(ms.sum_deferred, "cuda backend: no routed MLP sum is deferred");
  require_bf16(out, "moe output");
  const MoeSum sum = moe_sum_of(ms, out.rows);
  staging_.launch([&](cudaStream_t s) { launch_moe_combine(sum.y, sum.weight_of_pair, sum.top_k, mat(out), s); });
  ms.sum_deferred = false;
}

// One token (decode at batch 1): three kernels instead of six (H100, 30B-A3B shape, plain batch
// 1: 3.53 -> 3.32 ms a step); other shapes take the steps.
void CudaBackend::norm_moe(const ResidualNorm& n, Tensor& h, const MoeWeights& w, Tensor& out, Tensor* expert_rows,
                           MoeScratch* scratch) {
  norm_moe_to(n, h, w, out, expert_rows, scratch, nullptr);
}

// At tensor parallelism each rank's routed MLP is its share of every expert's features: its
// output goes to the peers from the kernel that writes it, so the words travel while the other
// blocks still run, and the ranks' shares are added by the next norm (RankSum) or a summing kernel.
// Outputs over kPeerAllReduceMaxBytes (prefill chunks) are summed after the MLP by the all-reduce.
bool CudaBackend::norm_moe_pushing(const ResidualNorm& n, Tensor& h, const MoeWeights& w, Tensor& out,
                                   Tensor* expert_rows, MoeScratch* scratch, const PeerPush& push) {
  if (out.dtype != DType::BF16 || out.stride != out.cols || out.rows * out.cols * 2 > kPeerAllReduceMaxBytes ||
      !peer_push_fits(out.data, out.rows, out.cols, out.stride))
    return false;
  norm_moe_to(n, h, w, out, expert_rows, scratch, &push);
  ++pushed_products_;
  return true;
}

void CudaBackend::norm_moe_to(const ResidualNorm& n, Tensor& h, const MoeWeights& w, Tensor& out, Tensor* expert_rows,
                              MoeScratch* scratch, const PeerPush* push) {
  const RowNorm rn = row_norm(n);
  const int64_t hidden = n.residual->cols, ff = w.n_ff;
  const ExpertViews e = expert_views(w, hidden);
  const bool one_token = n.residual->rows == 1 && !n.capture && rn.residual && h.rows == 1 && h.cols == hidden &&
                         h.dtype == DType::BF16 && w.router.dtype == DType::BF16 &&
                         w.gate_up.dtype == DType::BF16 && w.down.dtype == DType::BF16 && w.router.cols == hidden &&
                         skinny_gemm_norm_supported(rn, 1, mat(w.router), false, props_.multiProcessorCount) &&
                         moe_token_supported(rn, e.gate_up, e.down, w.n_experts, w.top_k) &&
                         reinterpret_cast<uintptr_t>(h.data) % 16 == 0 &&
                         (!scratch || (scratch->act.rows >= w.top_k && scratch->act.cols == ff &&
                                       scratch->act.stride % 8 == 0 &&
                                       reinterpret_cast<uintptr_t>(scratch->act.data) % 16 == 0));
  if (!one_token) {
    norm_in(n, h);  // Backend::norm_moe's steps
    return moe_to(h, w, out, expert_rows, scratch, push);
  }
  finish_pending_sum(n);  // every kernel reads delta
  check_moe(h, w, out, expert_rows);
  require_bf16(out, "moe output");
  check(!expert_rows || expert_rows->stride == 1, "cuda backend: expert_rows must be contiguous");

  Tensor logits = alloc(1, w.n_experts);
  staging_.launch([&](cudaStream_t s) {
    launch_skinny_gemm_norm(rn, 1, mat(w.router), nullptr, mat(logits), false, props_.multiProcessorCount, s);
  });
  Tensor act = scratch ? scratch->act.slice_rows(0, w.top_k) : alloc(w.top_k, ff);
  const MoeTokenArgs args{w.n_experts, w.top_k, w.norm_topk_prob, 2 * ff * w.gate_up.stride, hidden * w.down.stride,
                          expert_rows ? static_cast<int32_t*>(expert_rows->data) : nullptr};
  staging_.launch(
      [&](cudaStream_t s) { launch_moe_token(rn, mat(logits), args, e.gate_up, e.down, mat(act), mat(h), mat(out), s, push); });
}

}  // namespace dflash::cuda
