// A 2-D row-major array living on one backend's device. Copies share storage;
// views (row/column slices) keep the storage alive and carry a row stride.
#pragma once

#include <cstdint>
#include <memory>

#include "util/dtype.h"

namespace dflash {

struct Tensor {
  std::shared_ptr<void> storage;  // owner of the allocation (device memory for GPU backends)
  void* data = nullptr;           // first element of this view
  DType dtype = DType::F32;
  int64_t rows = 0, cols = 0;
  int64_t stride = 0;             // elements between consecutive rows

  bool empty() const { return data == nullptr; }
  bool contiguous() const { return stride == cols; }
  int64_t n_elements() const { return rows * cols; }

  float* f32() const { return static_cast<float*>(data); }
  float* row_f32(int64_t r) const { return f32() + r * stride; }

  Tensor slice_rows(int64_t first, int64_t n) const {
    Tensor t = *this;
    t.data = static_cast<char*>(data) + first * stride * static_cast<int64_t>(dtype_size(dtype));
    t.rows = n;
    return t;
  }
  Tensor slice_cols(int64_t first, int64_t n) const {
    Tensor t = *this;
    t.data = static_cast<char*>(data) + first * static_cast<int64_t>(dtype_size(dtype));
    t.cols = n;
    return t;
  }
};

}  // namespace dflash
