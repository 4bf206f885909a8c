#include "kernels/backend.h"

#include "util/error.h"

namespace dflash {

UploadShape upload_shape(const std::vector<const TensorInfo*>& parts) {
  check(!parts.empty(), "upload of nothing");
  const bool vectors = parts[0]->shape.size() == 1;
  UploadShape s;
  s.cols = vectors ? 0 : parts[0]->shape.back();
  for (const auto* p : parts) {
    check((p->shape.size() == 1) == vectors && (vectors || (p->shape.size() == 2 && p->shape[1] == s.cols)),
          p->file, ": tensor '", p->name, "' with shape ", p->shape_str(), " cannot be stacked with '",
          parts[0]->name, "'");
    if (vectors) s.cols += p->n_elements();
    else s.rows += p->shape[0];
  }
  if (vectors) s.rows = 1;
  return s;
}

void Backend::check_row_groups(const Tensor& x, const Tensor& w, const RowGroups& g, const Tensor& out) {
  check(g.count >= 1 && g.rows >= 1 && g.first >= 0 && (g.count == 1 || g.step >= g.rows), "row groups: ", g.count,
        " groups of ", g.rows, " rows from row ", g.first, ", ", g.step, " apart, are not valid");
  check(g.first + (g.count - 1) * g.step + g.rows <= w.rows, "row groups: the last group ends past the weight's ",
        w.rows, " rows");
  check(x.cols == w.cols && out.rows == x.rows && out.cols == g.count * g.rows, "row groups: product shape mismatch");
}

void Backend::check_moe(const Tensor& x, const MoeWeights& w, const Tensor& out, const Tensor* expert_rows) {
  const int64_t e = w.n_experts, ff = w.n_ff;
  check(e >= 1 && w.top_k >= 1 && w.top_k <= e && ff >= 1, "moe: ", w.top_k, " of ", e, " experts of ", ff,
        " features is not a valid shape");
  check(w.router.rows == e && w.router.cols == x.cols && w.gate_up.rows == e * 2 * ff && w.gate_up.cols == x.cols &&
            w.down.rows == e * x.cols && w.down.cols == ff,
        "moe: weight shapes do not match ", e, " experts of ", ff, " features over ", x.cols, " inputs");
  check(out.rows == x.rows && out.cols == x.cols, "moe: output shape mismatch");
  check(!expert_rows || (expert_rows->dtype == DType::I32 && expert_rows->rows == e && expert_rows->cols == 1),
        "moe: expert_rows must be an I32 tensor [n_experts, 1]");
}

void Backend::check_kv_layers(const Tensor& kv, int64_t width, const std::vector<const Tensor*>& k_norms,
                              const std::vector<Tensor>& k_caches, const std::vector<Tensor>& v_caches) {
  check(!k_caches.empty() && k_norms.size() == k_caches.size() && v_caches.size() == k_caches.size(),
        "kv layers: one k norm, k cache and v cache per layer");
  check(kv.cols == static_cast<int64_t>(k_caches.size()) * width, "kv layers: ", kv.cols, " columns for ",
        k_caches.size(), " layers of ", width);
}

std::vector<TopCandidates> Backend::top_candidates(const Tensor& logits, const std::vector<int32_t>& rows,
                                                   const std::vector<float>& temperature,
                                                   const std::vector<int32_t>& top_k) {
  check(temperature.size() == rows.size() && top_k.size() == rows.size(), "top_candidates: one setting per row");
  for (int32_t r : rows) check(r >= 0 && r < logits.rows, "top_candidates: row ", r, " out of range");
  if (rows.empty()) return {};
  return select_candidates(logits, rows, temperature, top_k);
}

std::vector<TopCandidates> Backend::select_candidates(const Tensor& logits, const std::vector<int32_t>& rows,
                                                      const std::vector<float>& temperature,
                                                      const std::vector<int32_t>& top_k) {
  Tensor picked = alloc(static_cast<int64_t>(rows.size()), logits.cols);
  gather_rows(logits, rows, picked);
  const std::vector<float> host = to_host(picked);
  std::vector<TopCandidates> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i)
    out[i] = select_top_candidates(host.data() + static_cast<int64_t>(i) * logits.cols, logits.cols, temperature[i],
                                   top_k[i]);
  return out;
}

}  // namespace dflash
