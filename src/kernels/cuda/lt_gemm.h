// out = x * w^T through cuBLASLt (bf16 in and out, fp32 accumulation) for
// shapes the skinny kernel does not take (prefill, large batches).
//
// The algorithm is chosen by cuBLASLt's heuristic once per shape, with the row count rounded up
// to a multiple of kRowBucket: every row count of a bucket takes the algorithm chosen for the
// bucket's largest (checked to run at the row count; else its own). Prompts of one bucket so share
// kernels. A cuBLASLt kernel's first launch in the process costs 2-3 ms of host time (H100, 8B
// shape: a fresh server's first 300-token prompt took 1.9x a later one's, three such gaps in its
// prefill), so after prepare() the first product of each shape also runs every bucket's
// algorithm once: a server's warm-up then launches every kernel a later prompt length can take.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <tuple>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"

namespace dflash::cuda {

class LtGemm {
 public:
  static constexpr int64_t kRowBucket = 64;

  LtGemm();
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  void run(const Mat& x, const Mat& w, Mat out, cudaStream_t stream);
  // From now on, the first product of each shape (outside a graph capture) first runs, on its own
  // operands, the algorithm of every row bucket up to max_rows (each distinct one once); a larger
  // max_rows later prepares every shape again.
  void prepare(int64_t max_rows) {
    if (max_rows > max_rows_) prepared_.clear();
    max_rows_ = std::max(max_rows_, max_rows);
  }

 private:
  // N, K, ld of x, w, out, and the alignment class of the three pointers: a product but its rows.
  using Shape = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int>;
  // The matrix layouts of a product of m rows (owned: destroyed with the object).
  struct Layouts {
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    Layouts(int64_t m, const Shape& s);
    Layouts(Layouts&& o) noexcept;
    Layouts(const Layouts&) = delete;
    Layouts& operator=(const Layouts&) = delete;
    ~Layouts();
    void release();
  };
  struct Plan {
    Layouts l;
    cublasLtMatmulAlgo_t algo{};
  };
  // The heuristic's algorithm for m rows of shape s; throws Error when it has none.
  cublasLtMatmulAlgo_t heuristic(int64_t m, const Shape& s, const Layouts& l) const;
  // The algorithm of m's row bucket, chosen on first use.
  const cublasLtMatmulAlgo_t& bucket_algo(int64_t m, const Shape& s);
  Plan& plan_for(int64_t m, const Shape& s);
  void launch(const Layouts& l, const cublasLtMatmulAlgo_t& algo, const Mat& x, const Mat& w, Mat out,
              cudaStream_t stream);
  void run_every_bucket(const Shape& s, const Plan& own, const Mat& x, const Mat& w, Mat out, cudaStream_t stream);

  cublasLtHandle_t handle_ = nullptr;
  cublasLtMatmulDesc_t op_ = nullptr;  // out^T = w^T (transposed) * x in column-major terms
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 32u << 20;
  std::map<std::pair<int64_t, Shape>, Plan> plans_;                    // by exact rows
  std::map<std::pair<int64_t, Shape>, cublasLtMatmulAlgo_t> algos_;  // by row bucket
  int64_t max_rows_ = 0;         // prepare()'s
  std::set<Shape> prepared_;     // shapes whose buckets' algorithms have run
};

}  // namespace dflash::cuda
