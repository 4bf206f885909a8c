#include "kernels/cuda/lt_gemm.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace dflash::cuda {

namespace {
// Largest power of two (<= 256) that divides the address.
int alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  int al = 256;
  while (al > 2 && a % al) al /= 2;
  return al;
}

int64_t bucket_rows(int64_t m) { return (m + LtGemm::kRowBucket - 1) / LtGemm::kRowBucket * LtGemm::kRowBucket; }
}  // namespace

LtGemm::LtGemm() {
  CUBLAS_CHECK(cublasLtCreate(&handle_));
  CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
}

LtGemm::~LtGemm() {
  plans_.clear();
  cublasLtMatmulDescDestroy(op_);
  cudaFree(workspace_);
  cublasLtDestroy(handle_);
}

// Column-major view: out^T[n x m] = (w as k x n)^T * (x as k x m).
LtGemm::Layouts::Layouts(int64_t m, const Shape& s) {
  const auto [n, k, ldx, ldw, ldo, al_x, al_w, al_o] = s;
  try {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, k, n, ldw));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, k, m, ldx));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d, CUDA_R_16BF, n, m, ldo));
  } catch (...) {
    release();
    throw;
  }
}

LtGemm::Layouts::Layouts(Layouts&& o) noexcept : a(o.a), b(o.b), d(o.d) { o.a = o.b = o.d = nullptr; }

LtGemm::Layouts::~Layouts() { release(); }

void LtGemm::Layouts::release() {
  for (cublasLtMatrixLayout_t l : {a, b, d})
    if (l) cublasLtMatrixLayoutDestroy(l);
  a = b = d = nullptr;
}

cublasLtMatmulAlgo_t LtGemm::heuristic(int64_t m, const Shape& s, const Layouts& l) const {
  const auto [n, k, ldx, ldw, ldo, al_x, al_w, al_o] = s;
  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = workspace_bytes_;
  const uint32_t aw = al_w, ax = al_x, ao = al_o;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aw, sizeof(aw));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ax, sizeof(ax));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ao, sizeof(ao));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ao, sizeof(ao));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle_, op_, l.a, l.b, l.d, l.d, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    throw Error(cat("cuBLASLt has no algorithm for a ", m, "x", k, " by ", n, "x", k, " bf16 product"));
  }
  return result.algo;
}

const cublasLtMatmulAlgo_t& LtGemm::bucket_algo(int64_t m, const Shape& s) {
  const std::pair<int64_t, Shape> key{bucket_rows(m), s};
  auto it = algos_.find(key);
  if (it != algos_.end()) return it->second;
  return algos_.emplace(key, heuristic(key.first, s, Layouts(key.first, s))).first->second;
}

LtGemm::Plan& LtGemm::plan_for(int64_t m, const Shape& s) {
  auto it = plans_.find({m, s});
  if (it != plans_.end()) return it->second;
  Plan p{Layouts(m, s), bucket_algo(m, s)};
  cublasLtMatmulHeuristicResult_t check{};
  if (cublasLtMatmulAlgoCheck(handle_, op_, p.l.a, p.l.b, p.l.d, p.l.d, &p.algo, &check) != CUBLAS_STATUS_SUCCESS ||
      check.workspaceSize > workspace_bytes_)
    p.algo = heuristic(m, s, p.l);  // the bucket's algorithm does not take these rows
  return plans_.emplace(std::pair{m, s}, std::move(p)).first->second;
}

void LtGemm::launch(const Layouts& l, const cublasLtMatmulAlgo_t& algo, const Mat& x, const Mat& w, Mat out,
                    cudaStream_t stream) {
  const float one = 1.0f, zero = 0.0f;
  CUBLAS_CHECK(cublasLtMatmul(handle_, op_, &one, w.data, l.a, x.data, l.b, &zero, out.data, l.d, out.data, l.d, &algo,
                              workspace_, workspace_bytes_, stream));
}

// Bucket b's algorithm runs as a product of b rows would run it where b <= rows (an algorithm
// chosen for a few rows may not take many: split-K needs workspace by rows), else on these rows
// where it takes them. Best effort: a bucket that fails is left to its first use. The product's
// own launch follows on the same stream and overwrites out.
void LtGemm::run_every_bucket(const Shape& s, const Plan& own, const Mat& x, const Mat& w, Mat out,
                              cudaStream_t stream) {
  prepared_.insert(s);
  std::vector<cublasLtMatmulAlgo_t> ran{own.algo};
  for (int64_t b = kRowBucket; b < max_rows_ + kRowBucket; b += kRowBucket) {
    try {
      const Plan* p = b <= x.rows ? &plan_for(b, s) : &own;
      cublasLtMatmulAlgo_t algo = b <= x.rows ? p->algo : bucket_algo(b, s);
      if (std::any_of(ran.begin(), ran.end(), [&](const auto& a) { return std::memcmp(&a, &algo, sizeof(a)) == 0; }))
        continue;
      ran.push_back(algo);
      cublasLtMatmulHeuristicResult_t check{};
      if (b > x.rows && (cublasLtMatmulAlgoCheck(handle_, op_, own.l.a, own.l.b, own.l.d, own.l.d, &algo, &check) !=
                             CUBLAS_STATUS_SUCCESS ||
                         check.workspaceSize > workspace_bytes_))
        continue;
      launch(p->l, algo, x, w, out, stream);
    } catch (const Error&) {
    }
  }
}

void LtGemm::run(const Mat& x, const Mat& w, Mat out, cudaStream_t stream) {
  if (x.rows == 0 || w.rows == 0) return;
  const Shape s{w.rows, x.cols, x.stride, w.stride, out.stride,
                alignment_of(x.data), alignment_of(w.data), alignment_of(out.data)};
  Plan& p = plan_for(x.rows, s);
  if (max_rows_ > 0 && !prepared_.count(s)) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture == cudaStreamCaptureStatusNone) run_every_bucket(s, p, x, w, out, stream);
  }
  launch(p.l, p.algo, x, w, out, stream);
}

}  // namespace dflash::cuda
