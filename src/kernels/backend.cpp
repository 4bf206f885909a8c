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
