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

}  // namespace dflash
