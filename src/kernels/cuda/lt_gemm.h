// out = x * w^T through cuBLASLt (bf16 in and out, fp32 accumulation) for
// shapes the skinny kernel does not take (prefill, large batches). The
// algorithm for each shape and alignment is chosen once and reused.
#pragma once

#include <cstdint>
#include <map>
#include <tuple>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"

namespace dflash::cuda {

class LtGemm {
 public:
  LtGemm();
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  void run(const Mat& x, const Mat& w, Mat out, cudaStream_t stream);
  size_t n_plans() const { return plans_.size(); }
  size_t workspace_bytes() const { return workspace_bytes_; }

 private:
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  // M, N, K, ld of x, w, out, and the alignment class of the three pointers
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int>;
  Plan& plan_for(const Key& key);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 32u << 20;
  std::map<Key, Plan> plans_;
};

}  // namespace dflash::cuda
