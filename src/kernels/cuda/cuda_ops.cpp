// The CUDA backend's row ops and products: embeddings, products (skinny kernel or cuBLASLt),
// RMSNorm, RoPE and cache writes, row gathers. Each checks its arguments, stages its metadata and
// launches through GraphStaging::launch.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/peer_collectives.h"

namespace dflash::cuda {
namespace {

// The head size and RoPE table the rotating kernels take.
void check_rope(int head_dim, const std::vector<float>& inv_freq) {
  check(head_dim % 2 == 0 && head_dim <= 256, "cuda backend: head_dim ", head_dim, " is not supported (even, <= 256)");
  check(!inv_freq.empty() && static_cast<int>(inv_freq.size()) <= head_dim / 2, "cuda backend: rope table size mismatch");
}

void check_slots(const std::vector<int32_t>& slots, const Tensor& cache) {
  for (int32_t slot : slots) check(slot >= 0 && slot < cache.rows, "cuda backend: KV slot out of range");
}

}  // namespace

RowNorm row_norm(const ResidualNorm& n) {
  const Tensor& r = *n.residual;
  RowNorm rn;
  if (!residual_dtype(r) || n.weight->dtype != DType::BF16) return rn;
  if (n.delta) {
    const Tensor &d = *n.delta, &ro = *n.residual_out;
    if (d.dtype != DType::BF16 || ro.dtype != r.dtype || d.rows != r.rows || d.cols != r.cols || ro.rows != r.rows ||
        ro.cols != r.cols)
      return rn;
    rn.delta = static_cast<const bf16*>(d.data);
    rn.delta_stride = d.stride;
    rn.residual_out = ro.data;
    rn.residual_out_stride = ro.stride;
  }
  rn.residual = r.data;
  rn.residual_stride = r.stride;
  rn.f32 = r.dtype == DType::F32;
  rn.weight = static_cast<const bf16*>(n.weight->data);
  rn.eps = n.eps;
  return rn;
}

void CudaBackend::embed(const Tensor& table, const std::vector<int32_t>& ids, Tensor& out,
                        const DeviceTokens* from_device) {
  require_bf16(table, "embedding table");
  for (int32_t id : ids) {
    check(id >= 0 && id < table.rows, "token id ", id, " is outside the vocabulary (0..", table.rows - 1, ")");
  }
  check(residual_dtype(out), "cuda backend: embed output must be F32 or BF16");
  const int32_t* d_ids = staging_.stage(ids);
  const int32_t* d_map = nullptr;
  const int32_t* dev_ids = nullptr;
  if (from_device) {
    require_ids(from_device->ids, "device tokens");
    check(from_device->ids.rows == static_cast<int64_t>(from_device->rows.size()),
          "cuda backend: device tokens and their rows differ in number");
    std::vector<int32_t> map(ids.size(), -1);  // row -> index into the device ids
    for (size_t i = 0; i < from_device->rows.size(); ++i) {
      const int32_t r = from_device->rows[i];
      check(r >= 0 && r < static_cast<int32_t>(ids.size()), "cuda backend: device token row out of range");
      map[static_cast<size_t>(r)] = static_cast<int32_t>(i);
    }
    d_map = staging_.stage(map);
    dev_ids = static_cast<const int32_t*>(from_device->ids.data);
  }
  staging_.launch([&](cudaStream_t s) { launch_embed(mat(table), d_ids, dev_ids, d_map, rows_of(out), s); });
}

void CudaBackend::matmul(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out) {
  require_bf16(x, "matmul input");
  require_bf16(w, "matmul weight");
  check(x.cols == w.cols && out.rows == x.rows && out.cols == w.rows, "cuda backend: matmul shape mismatch");
  if (in_skinny_slices(x, w, out, [&](const Tensor& xs, Tensor& os) {
        staging_.launch([&](cudaStream_t s) {
          launch_skinny_gemm(mat(xs), mat(w), bf16_or_null(bias), mat(os), props_.multiProcessorCount,
                             forms_.skinny_wide, s);
        });
      }))
    return;
  staging_.launch([&](cudaStream_t s) { lt_->run(mat(x), mat(w), mat(out), s); });
  if (bias) staging_.launch([&](cudaStream_t s) { launch_add_bias(mat(out), bf16_or_null(bias), s); });
}

bool CudaBackend::matmul_pushing(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out,
                                 const PeerPush& push) {
  require_bf16(x, "matmul input");
  require_bf16(w, "matmul weight");
  check(x.cols == w.cols && out.rows == x.rows && out.cols == w.rows, "cuda backend: matmul shape mismatch");
  if (!skinny_gemm_supported(mat(x), mat(w), mat(out))) return false;
  staging_.launch([&](cudaStream_t s) {
    launch_skinny_gemm_pushed(mat(x), mat(w), bf16_or_null(bias), mat(out), props_.multiProcessorCount,
                              forms_.skinny_wide, push, s);
  });
  ++pushed_products_;
  return true;
}

void CudaBackend::matmul_swiglu(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& gate_up, Tensor& out) {
  require_bf16(x, "matmul input");
  require_bf16(w, "matmul weight");
  check(x.cols == w.cols && w.rows == 2 * out.cols && out.rows == x.rows, "cuda backend: matmul_swiglu shape mismatch");
  if (!in_skinny_slices(x, w, out, [&](const Tensor& xs, Tensor& os) {
        staging_.launch(
            [&](cudaStream_t s) { launch_skinny_gemm_swiglu(mat(xs), mat(w), bf16_or_null(bias), mat(os), s); });
      }))
    Backend::matmul_swiglu(x, w, bias, gate_up, out);
}

// Runs a product through the skinny kernel: whole when x has at most kSkinnyMaxRows rows, and in
// slices of that many rows when rows must not depend on their batch (options_.batch_invariant:
// every row then takes the skinny kernel's reduction order, at the price of reading the weights
// once per slice). False when the product takes cuBLASLt instead.
template <typename Launch>
bool CudaBackend::in_skinny_slices(const Tensor& x, const Tensor& w, Tensor& out, Launch&& launch) {
  if (skinny_gemm_supported(mat(x), mat(w), mat(out))) {
    launch(x, out);
    return true;
  }
  if (!options_.batch_invariant || x.rows <= kSkinnyMaxRows ||
      !skinny_gemm_supported(mat(x.slice_rows(0, kSkinnyMaxRows)), mat(w), mat(out)))
    return false;
  for (int64_t r0 = 0; r0 < x.rows; r0 += kSkinnyMaxRows) {
    const int64_t n = std::min<int64_t>(kSkinnyMaxRows, x.rows - r0);
    Tensor os = out.slice_rows(r0, n);
    launch(x.slice_rows(r0, n), os);
  }
  return true;
}

// A few rows (decode): the product normalizes its own input, one kernel instead of two (H100,
// plain batch 1: 6.17 -> 6.10 ms a step). Other shapes take the RMSNorm kernel and the product.
void CudaBackend::norm_matmul(const ResidualNorm& n, Tensor& h, const Tensor& w, const Tensor* bias, Tensor& out,
                              Tensor* gate_up) {
  const RowNorm rn = row_norm(n);
  const bool shapes = n.residual->cols == w.cols && out.rows == n.residual->rows && w.dtype == DType::BF16 &&
                      (gate_up ? w.rows == 2 * out.cols : w.rows == out.cols);
  if (!rn.residual || !shapes ||
      !skinny_gemm_norm_supported(rn, n.residual->rows, mat(w), gate_up, props_.multiProcessorCount))
    return Backend::norm_matmul(n, h, w, bias, out, gate_up);
  finish_pending_sum(n);  // every block reads delta
  staging_.launch([&](cudaStream_t s) {
    launch_skinny_gemm_norm(rn, n.residual->rows, mat(w), bf16_or_null(bias), mat(out), gate_up != nullptr,
                            props_.multiProcessorCount, s);
  });
  if (n.capture) capture_rows(*n.residual_out, *n.capture);
}

// The RMSNorm kernel writes the capture too (no gather after it), and a routed MLP's deferred
// sum (no combine kernel before it).
void CudaBackend::norm_in(const ResidualNorm& n, Tensor& h) {
  if (n.rank_sum && n.rank_sum->deferred && n.delta && !(n.moe_sum && n.moe_sum->sum_deferred)) {
    // The pushed sum over the ranks in the RMSNorm kernel: no summing kernel before it.
    const Tensor &r = *n.residual, &ro = *n.residual_out, &d = *n.delta;
    const Mat c = n.capture ? mat(*n.capture) : Mat{nullptr, 0, 0, 0};
    const bf16* w = static_cast<const bf16*>(n.weight->data);
    if (row_norm(n).residual && h.dtype == DType::BF16 && h.rows == r.rows && h.cols == r.cols &&
        d.stride == d.cols && d.cols % 8 == 0 &&
        (!n.capture || (n.capture->dtype == DType::BF16 && n.capture->rows == r.rows && n.capture->cols == r.cols)) &&
        add_rms_norm_captures(rows_of(r), mat(d), rows_of(ro), w, mat(h), c)) {
      const auto* push = static_cast<const PeerPush*>(n.rank_sum->exchange);
      staging_.launch([&](cudaStream_t s) {
        launch_add_rms_norm(rows_of(r), mat(d), rows_of(ro), w, n.eps, mat(h), s, c, nullptr, push);
      });
      n.rank_sum->deferred = false;
      return;
    }
    finish_pending_sum(n);
  }
  if (n.moe_sum && n.moe_sum->sum_deferred && n.delta) {
    // row_norm checks the residual, delta, its output and the weight (types and shapes).
    const Tensor &r = *n.residual, &ro = *n.residual_out, &d = *n.delta;
    const Mat c = n.capture ? mat(*n.capture) : Mat{nullptr, 0, 0, 0};
    const bf16* w = static_cast<const bf16*>(n.weight->data);
    const MoeSum sum = moe_sum_of(*n.moe_sum, d.rows);
    if (row_norm(n).residual && h.dtype == DType::BF16 && h.rows == r.rows && h.cols == r.cols &&
        (!n.capture || (n.capture->dtype == DType::BF16 && n.capture->rows == r.rows && n.capture->cols == r.cols)) &&
        sum.y.cols == d.cols && sum.y.stride % 8 == 0 && reinterpret_cast<uintptr_t>(sum.y.data) % 16 == 0 &&
        add_rms_norm_captures(rows_of(r), mat(d), rows_of(ro), w, mat(h), c)) {
      staging_.launch(
          [&](cudaStream_t s) { launch_add_rms_norm(rows_of(r), mat(d), rows_of(ro), w, n.eps, mat(h), s, c, &sum); });
      n.moe_sum->sum_deferred = false;
      return;
    }
    finish_pending_sum(n);
  }
  if (!n.delta || !n.capture) return Backend::norm_in(n, h);
  const Tensor &r = *n.residual, &ro = *n.residual_out, &c = *n.capture;
  check(residual_dtype(r) && ro.dtype == r.dtype,
        "cuda backend: add_rms_norm needs the residual and its output in one type (F32 or BF16)");
  require_bf16(*n.delta, "add_rms_norm delta");
  require_bf16(h, "add_rms_norm output");
  require_bf16(c, "layer-output capture");
  check(c.rows == r.rows && c.cols == r.cols, "cuda backend: layer-output capture shape mismatch");
  const bf16* w = static_cast<const bf16*>(n.weight->data);
  if (!add_rms_norm_captures(rows_of(r), mat(*n.delta), rows_of(ro), w, mat(h), mat(c))) return Backend::norm_in(n, h);
  staging_.launch([&](cudaStream_t s) {
    launch_add_rms_norm(rows_of(r), mat(*n.delta), rows_of(ro), w, n.eps, mat(h), s, mat(c));
  });
}

void CudaBackend::finish_rank_sum(RankSum& s, const Tensor& out) {
  check(s.deferred && s.exchange, "cuda backend: no sum over ranks is deferred");
  require_bf16(out, "sum over ranks");
  const auto* push = static_cast<const PeerPush*>(s.exchange);
  staging_.launch([&](cudaStream_t st) {
    launch_peer_pushed_sum(*push, static_cast<bf16*>(out.data), out.rows * out.cols, st);
  });
  s.deferred = false;
}

void CudaBackend::rms_norm(const Tensor& x, const Tensor& weight, float eps, Tensor& out) {
  check(residual_dtype(x), "cuda backend: rms_norm input must be F32 or BF16");
  require_bf16(out, "rms_norm output");
  staging_.launch(
      [&](cudaStream_t s) { launch_rms_norm(rows_of(x), static_cast<const bf16*>(weight.data), eps, mat(out), s); });
}

void CudaBackend::add_rms_norm(const Tensor& residual, const Tensor& delta, Tensor& residual_out, const Tensor& weight,
                               float eps, Tensor& out) {
  check(residual_dtype(residual) && residual_out.dtype == residual.dtype,
        "cuda backend: add_rms_norm needs the residual and its output in one type (F32 or BF16)");
  require_bf16(delta, "add_rms_norm delta");
  require_bf16(out, "add_rms_norm output");
  staging_.launch([&](cudaStream_t s) {
    launch_add_rms_norm(rows_of(residual), mat(delta), rows_of(residual_out), static_cast<const bf16*>(weight.data),
                        eps, mat(out), s);
  });
}

void CudaBackend::head_norm_rope(Tensor& x, int n_heads, int head_dim, const Tensor* norm_weight, float eps,
                                 const std::vector<int32_t>& positions, const std::vector<float>& inv_freq) {
  check_rope(head_dim, inv_freq);
  const int32_t* d_positions = staging_.stage(positions);
  staging_.launch([&](cudaStream_t s) {
    launch_head_norm_rope(mat(x), n_heads, head_dim, bf16_or_null(norm_weight), eps, d_positions,
                          device_inv_freq(inv_freq), static_cast<int>(inv_freq.size()), s);
  });
}

void CudaBackend::qkv_rope_kv_write(Tensor& qkv, int n_heads, int n_kv_heads, int head_dim, const Tensor* q_norm,
                                    const Tensor* k_norm, float eps, const std::vector<int32_t>& positions,
                                    const std::vector<float>& inv_freq, Tensor& k_cache, Tensor& v_cache,
                                    const std::vector<int32_t>& slots) {
  check_rope(head_dim, inv_freq);
  check(qkv.cols == int64_t{n_heads + 2 * n_kv_heads} * head_dim, "cuda backend: qkv shape mismatch");
  check_slots(slots, k_cache);
  const int32_t* d_positions = staging_.stage(positions);
  const int32_t* d_slots = staging_.stage(slots);
  staging_.launch([&](cudaStream_t s) {
    launch_qkv_rope_kv_write(mat(qkv), n_heads, n_kv_heads, head_dim, bf16_or_null(q_norm), bf16_or_null(k_norm), eps,
                             d_positions, device_inv_freq(inv_freq), static_cast<int>(inv_freq.size()), mat(k_cache),
                             mat(v_cache), d_slots, s);
  });
}

void CudaBackend::kv_rope_write_layers(Tensor& kv, int n_kv_heads, int head_dim,
                                       const std::vector<const Tensor*>& k_norms, float eps,
                                       const std::vector<int32_t>& positions, const std::vector<float>& inv_freq,
                                       std::vector<Tensor>& k_caches, std::vector<Tensor>& v_caches,
                                       const std::vector<int32_t>& slots) {
  const int64_t width = int64_t{2} * n_kv_heads * head_dim;
  check_kv_layers(kv, width, k_norms, k_caches, v_caches);
  const int n = static_cast<int>(k_caches.size());
  bool same_layout = n <= kMaxKvLayers;
  for (int l = 0; l < n && same_layout; ++l)
    same_layout = k_caches[l].stride == k_caches[0].stride && v_caches[l].stride == v_caches[0].stride &&
                  k_caches[l].rows == k_caches[0].rows && v_caches[l].rows == k_caches[0].rows;
  if (!same_layout)
    return Backend::kv_rope_write_layers(kv, n_kv_heads, head_dim, k_norms, eps, positions, inv_freq, k_caches,
                                         v_caches, slots);
  check_rope(head_dim, inv_freq);
  check(static_cast<int>(inv_freq.size()) * 2 == head_dim, "cuda backend: kv_rope_write_layers rotates whole heads");
  check(static_cast<int64_t>(positions.size()) == kv.rows && static_cast<int64_t>(slots.size()) == kv.rows,
        "cuda backend: one position and one slot per kv row");
  check_slots(slots, k_caches[0]);
  KvLayers layers;
  layers.n = n;
  layers.k_stride = k_caches[0].stride;
  layers.v_stride = v_caches[0].stride;
  for (int l = 0; l < n; ++l) {
    layers.k_norm[l] = bf16_or_null(k_norms[l]);
    layers.k_cache[l] = static_cast<bf16*>(k_caches[l].data);
    layers.v_cache[l] = static_cast<bf16*>(v_caches[l].data);
  }
  const int32_t* d_positions = staging_.stage(positions);
  const int32_t* d_slots = staging_.stage(slots);
  staging_.launch([&](cudaStream_t s) {
    launch_kv_rope_write_layers(mat(kv), n_kv_heads, head_dim, layers, eps, d_positions, device_inv_freq(inv_freq),
                                d_slots, s);
  });
}

void CudaBackend::matmul_row_groups(const Tensor& x, const Tensor& w, const RowGroups& g, Tensor& out) {
  check_row_groups(x, w, g, out);
  require_bf16(x, "matmul input");
  require_bf16(w, "matmul weight");
  const Mat first = mat(w.slice_rows(g.first, g.rows));
  if (!skinny_gemm_groups_supported(mat(x), first, g.count)) return Backend::matmul_row_groups(x, w, g, out);
  staging_.launch([&](cudaStream_t s) {
    launch_skinny_gemm_groups(mat(x), first, g.count, g.step, mat(out), props_.multiProcessorCount, forms_.skinny_wide,
                              s);
  });
}

void CudaBackend::swiglu(const Tensor& gate_up, Tensor& out) {
  check(gate_up.cols == 2 * out.cols, "cuda backend: swiglu shape mismatch");
  staging_.launch([&](cudaStream_t s) { launch_swiglu(mat(gate_up), mat(out), s); });
}

void CudaBackend::kv_write(const Tensor& k, const Tensor& v, Tensor& k_cache, Tensor& v_cache,
                           const std::vector<int32_t>& slots) {
  check_slots(slots, k_cache);
  const int32_t* d_slots = staging_.stage(slots);
  staging_.launch([&](cudaStream_t s) { launch_kv_write(mat(k), mat(v), mat(k_cache), mat(v_cache), d_slots, s); });
}

void CudaBackend::gather_rows(const Tensor& src, const std::vector<int32_t>& rows, Tensor& out) {
  for (int32_t r : rows) check(r >= 0 && r < src.rows, "cuda backend: gather row out of range");
  check(residual_dtype(src) && src.cols == out.cols && static_cast<int64_t>(rows.size()) == out.rows,
        "cuda backend: gather_rows shape mismatch");
  require_bf16(out, "gather_rows output");
  const int32_t* d_rows = staging_.stage(rows);
  staging_.launch([&](cudaStream_t s) { launch_gather_rows(rows_of(src), d_rows, mat(out), s); });
}

}  // namespace dflash::cuda
