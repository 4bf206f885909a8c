// CUDA backend: bf16 weights, activations and KV cache; float32 arithmetic in
// every kernel. One stream; temporaries come from the stream-ordered memory
// pool. Small integer arrays (ids, positions, slots, page tables) go through a
// pinned staging ring, so an upload never waits for the GPU unless the ring wraps.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/env_switch.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/lt_gemm.h"

namespace dflash {
namespace {

using cuda::bf16;
using cuda::Mat;

Mat mat(const Tensor& t) { return {static_cast<bf16*>(t.data), t.rows, t.cols, t.stride}; }
// A residual-stream tensor (float32 or bf16) for the kernels.
cuda::Rows rows_of(const Tensor& t) { return {t.data, t.rows, t.cols, t.stride, t.dtype == DType::F32}; }

bool residual_dtype(const Tensor& t) { return t.dtype == DType::F32 || t.dtype == DType::BF16; }

void require_ids(const Tensor& t, const char* what) {
  check(t.dtype == DType::I32 && t.cols == 1 && t.stride == 1 && !t.empty(), "cuda backend: ", what,
        " must be a contiguous I32 tensor of one column");
}

void require_bf16(const Tensor& t, const char* what) {
  check(t.dtype == DType::BF16 && !t.empty(), "cuda backend: ", what, " must be a non-empty BF16 tensor");
}

// Owns the stream; kept alive by every allocation so that frees stay valid.
struct StreamOwner {
  cudaStream_t stream = nullptr;
  StreamOwner() { CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)); }
  ~StreamOwner() { cudaStreamDestroy(stream); }
  // A tensor released while the stream is captured (a step body reassigning a tensor that an
  // eager step allocated) is freed after the capture: a free queued inside it would become a
  // graph node for memory the graph does not own.
  bool capturing = false;
  std::vector<void*> deferred;
  void free(void* p) {
    if (capturing) deferred.push_back(p);
    else cudaFreeAsync(p, stream);
  }
  void end_capture() {
    capturing = false;
    for (void* p : deferred) cudaFreeAsync(p, stream);
    deferred.clear();
  }
};

class StagingRing {
 public:
  // for_graph: a graph's ring. Nothing wraps (replays read every piece again), and put only
  // writes the host side: the graph copies all of it to the device first on each replay.
  StagingRing(cudaStream_t s, size_t size, bool for_graph) : stream_(s), size_(size), for_graph_(for_graph) {
    CUDA_CHECK(cudaMallocHost(&host_, size_));
    CUDA_CHECK(cudaMalloc(&device_, size_));
  }
  ~StagingRing() {
    cudaFreeHost(host_);
    cudaFree(device_);
  }
  // Copies `bytes` to the device. The pointer stays valid until the ring wraps,
  // which waits for the stream, i.e. for every kernel that used the old contents.
  void* put(const void* data, size_t bytes) {
    const size_t need = (bytes + 255) / 256 * 256;
    check(need <= size_ / 4 || (for_graph_ && offset_ + need <= size_), "batch metadata of ", bytes,
          " bytes exceeds the staging ring");
    if (offset_ + need > size_) {
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      offset_ = 0;
      ++n_wraps_;
    }
    char* h = host(offset_);
    char* d = device(offset_);
    std::memcpy(h, data, bytes);
    if (!for_graph_) CUDA_CHECK(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, stream_));
    offset_ += need;
    return d;
  }

  uint64_t n_wraps() const { return n_wraps_; }
  size_t used() const { return offset_; }
  char* host(size_t offset) const { return static_cast<char*>(host_) + offset; }
  char* device(size_t offset) const { return static_cast<char*>(device_) + offset; }

 private:
  cudaStream_t stream_;
  size_t size_;
  bool for_graph_;
  void* host_ = nullptr;
  void* device_ = nullptr;
  size_t offset_ = 0;
  uint64_t n_wraps_ = 0;
};

// An instantiated graph, the ring its metadata comes from (copied to the device by the graph's
// first node), and what restage_graph checks a new step against: the capture's uploads in order
// and the launch decisions that depended on the batch.
struct CudaGraph {
  struct Upload {
    size_t offset = 0, bytes = 0;
    int same_as = -1;  // an earlier upload with equal contents at capture, whose copy this one shares
  };
  cudaGraphExec_t exec = nullptr;
  cudaEvent_t replayed = nullptr;  // after the last replay (the host side of the ring is free again)
  std::shared_ptr<StagingRing> ring;
  std::vector<Upload> uploads;
  std::vector<int64_t> launch_notes;
  ~CudaGraph() {
    if (exec) cudaGraphExecDestroy(exec);
    if (replayed) cudaEventDestroy(replayed);
  }
};

// What restage_graph is doing: which graph, how far through its uploads and notes, and whether
// the body still matches.
struct Restage {
  CudaGraph* graph = nullptr;
  size_t upload = 0, note = 0;
  bool matches = true;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend() {
    CUDA_CHECK(cudaSetDevice(0));
    CUDA_CHECK(cudaGetDeviceProperties(&props_, 0));
    // DFLASH_PDL=0 turns programmatic dependent launch off (A/B timing).
    cuda::set_pdl_enabled(props_.major >= 9 && cuda::env_switch("DFLASH_PDL") != "0");
    owner_ = std::make_shared<StreamOwner>();
    s_ = owner_->stream;
    cudaMemPool_t pool;
    CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
    uint64_t keep = UINT64_MAX;  // keep freed blocks for reuse instead of returning them at each sync
    CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    lt_ = std::make_unique<cuda::LtGemm>(s_);
    ring_ = std::make_shared<StagingRing>(s_, size_t{32} << 20, /*for_graph=*/false);
    active_ring_ = ring_.get();
    CUDA_CHECK(cudaMallocHost(&argmax_host_, sizeof(int32_t) * kArgmaxCap));
    const size_t argmax_bytes = sizeof(int32_t) * kArgmaxCap + cuda::argmax_workspace_bytes();
    CUDA_CHECK(cudaMalloc(&argmax_out_, argmax_bytes));
    CUDA_CHECK(cudaMemset(argmax_out_, 0, argmax_bytes));  // the workspace's row counters start at zero
  }
  ~CudaBackend() override {
    cudaStreamSynchronize(s_);
    for (auto& [k, p] : inv_freq_) cudaFree(p);
    for (auto& [f, tables] : rope_tables_)
      for (auto& [t, n] : tables) cudaFree(t);
    cudaFreeHost(argmax_host_);
    cudaFree(argmax_out_);
    cudaFreeHost(top_host_);
    cudaFree(top_out_);
  }

  bool supports_graphs() const override { return true; }

  std::shared_ptr<void> capture_graph(const std::function<void()>& body, bool share_uploads) override {
    check(!capturing_ && !restage_, "cuda backend: graph captures cannot nest");
    if (!arena_) {
      if (cudaMalloc(&arena_, size_t{1} << 30) != cudaSuccess) {
        cudaGetLastError();  // not left for the next launch check to report
        arena_ = nullptr;
        throw Error("out of GPU memory for the 1 GiB arena of CUDA graphs' temporaries");
      }
      arena_size_ = size_t{1} << 30;
    }
    auto g = std::make_shared<CudaGraph>();
    g->ring = std::make_shared<StagingRing>(s_, size_t{2} << 20, /*for_graph=*/true);
    CUDA_CHECK(cudaEventCreateWithFlags(&g->replayed, cudaEventDisableTiming));
    synchronize();
    active_ring_ = g->ring.get();
    capture_ = g.get();
    share_uploads_ = share_uploads;
    recent_.clear();
    capturing_ = true;
    arena_offset_ = 0;
    capture_ws_ = nullptr;
    capture_ws_bytes_ = 0;
    CUDA_CHECK(cudaStreamBeginCapture(s_, cudaStreamCaptureModeRelaxed));
    owner_->capturing = true;
    cudaGraph_t graph = nullptr;
    auto end_capture = [&] {
      capturing_ = false;
      capture_ = nullptr;
      active_ring_ = ring_.get();
      recent_.clear();
    };
    try {
      body();
    } catch (...) {
      cudaStreamEndCapture(s_, &graph);
      owner_->end_capture();
      if (graph) cudaGraphDestroy(graph);
      end_capture();
      throw;
    }
    end_capture();
    const cudaError_t ended = cudaStreamEndCapture(s_, &graph);
    owner_->end_capture();
    CUDA_CHECK(ended);
    std::unique_ptr<CUgraph_st, decltype(&cudaGraphDestroy)> owned(graph, &cudaGraphDestroy);
    if (g->ring->used() > 0) copy_ring_first(graph, *g->ring);
    CUDA_CHECK(cudaGraphInstantiate(&g->exec, graph, 0));
    return g;
  }

  void replay_graph(const std::shared_ptr<void>& graph) override {
    auto* g = static_cast<CudaGraph*>(graph.get());
    CUDA_CHECK(cudaGraphLaunch(g->exec, s_));
    CUDA_CHECK(cudaEventRecord(g->replayed, s_));
  }

  bool restage_graph(const std::shared_ptr<void>& graph, const std::function<void()>& body) override {
    check(!capturing_ && !restage_, "cuda backend: a graph cannot be restaged inside a capture");
    auto* g = static_cast<CudaGraph*>(graph.get());
    CUDA_CHECK(cudaEventSynchronize(g->replayed));  // its last replay has read the ring
    Restage r;
    r.graph = g;
    restage_ = &r;
    arena_offset_ = 0;
    capture_ws_ = nullptr;
    capture_ws_bytes_ = 0;
    try {
      body();
    } catch (...) {
      restage_ = nullptr;
      throw;
    }
    restage_ = nullptr;
    return r.matches && r.upload == g->uploads.size() && r.note == g->launch_notes.size();
  }
  std::string name() const override { return std::string("cuda (") + props_.name + ")"; }

  bool memory_info(int64_t& free_bytes, int64_t& total_bytes) override {
    size_t f = 0, t = 0;
    CUDA_CHECK(cudaMemGetInfo(&f, &t));
    free_bytes = static_cast<int64_t>(f);
    total_bytes = static_cast<int64_t>(t);
    return true;
  }

  void synchronize() override { CUDA_CHECK(cudaStreamSynchronize(s_)); }

  void release_cached_memory() override {
    synchronize();
    cudaMemPool_t pool;
    CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
    CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
  }

  double measure_copy_gbps(int64_t bytes) override {
    Tensor a = alloc(bytes / 2, 1), b = alloc(bytes / 2, 1);
    fill_random(a, 1, 1.0f);
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    std::vector<float> ms;
    for (int i = 0; i < 12; ++i) {
      CUDA_CHECK(cudaEventRecord(e0, s_));
      CUDA_CHECK(cudaMemcpyAsync(b.data, a.data, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, s_));
      CUDA_CHECK(cudaEventRecord(e1, s_));
      CUDA_CHECK(cudaEventSynchronize(e1));
      float t = 0;
      CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
      if (i >= 2) ms.push_back(t);  // two warm-up copies
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    std::sort(ms.begin(), ms.end());
    return 2.0 * static_cast<double>(bytes) / (ms[ms.size() / 2] * 1e-3) / 1e9;
  }

  void fill_random(Tensor& t, uint64_t seed, float scale) override {
    require_bf16(t, "fill_random target");
    check(t.contiguous(), "cuda backend: fill_random needs a contiguous tensor");
    cuda::launch_fill_random(static_cast<bf16*>(t.data), t.rows * t.cols, seed, scale, s_);
    CUDA_CHECK_LAUNCH();
  }

  Tensor alloc(int64_t rows, int64_t cols) override { return alloc_as(rows, cols, DType::BF16); }
  Tensor alloc_f32(int64_t rows, int64_t cols) override { return alloc_as(rows, cols, DType::F32); }

  Tensor alloc_as(int64_t rows, int64_t cols, DType dt) {
    check(rows >= 0 && cols >= 0, "cuda backend: negative tensor size");
    const size_t bytes = dtype_size(dt) * static_cast<size_t>(std::max<int64_t>(rows * cols, 1));
    if (graph_mode()) return arena_tensor(rows, cols, bytes, dt);
    void* p = nullptr;
    const cudaError_t err = cudaMallocAsync(&p, bytes, s_);
    if (err != cudaSuccess) {
      cudaGetLastError();
      size_t f = 0, t = 0;
      cudaMemGetInfo(&f, &t);
      throw Error(cat("out of GPU memory: cannot allocate ", bytes, " bytes (", rows, " x ", cols, " ",
                      dtype_name(dt), "); ", f, " of ", t, " bytes free"));
    }
    auto owner = owner_;
    Tensor tns;
    tns.storage = std::shared_ptr<void>(p, [owner](void* q) { owner->free(q); });
    tns.data = p;
    tns.dtype = dt;
    tns.rows = rows;
    tns.cols = cols;
    tns.stride = cols;
    return tns;
  }

  // Streams each part from its memory mapping; bf16 parts are copied as they
  // are, others are converted through a bounded host buffer.
  Tensor upload(const std::vector<const TensorInfo*>& parts) override {
    const UploadShape shape = upload_shape(parts);
    Tensor t = alloc(shape.rows, shape.cols);
    char* dst = static_cast<char*>(t.data);
    for (const auto* p : parts) {
      const auto n = static_cast<size_t>(p->n_elements());
      if (p->dtype == DType::BF16) {
        CUDA_CHECK(cudaMemcpyAsync(dst, p->data, n * sizeof(bf16), cudaMemcpyHostToDevice, s_));
      } else {
        constexpr size_t kChunk = size_t{1} << 22;
        std::vector<float> f(std::min(n, kChunk));
        std::vector<uint16_t> h(f.size());
        for (size_t i = 0; i < n; i += kChunk) {
          const size_t c = std::min(kChunk, n - i);
          convert_to_f32(p->dtype, p->data + i * dtype_size(p->dtype), f.data(), c);
          for (size_t j = 0; j < c; ++j) h[j] = f32_to_bf16(f[j]);
          CUDA_CHECK(cudaMemcpyAsync(dst + i * sizeof(bf16), h.data(), c * sizeof(bf16), cudaMemcpyHostToDevice, s_));
          CUDA_CHECK(cudaStreamSynchronize(s_));  // h is reused
        }
      }
      dst += n * sizeof(bf16);
    }
    CUDA_CHECK(cudaStreamSynchronize(s_));
    return t;
  }

  Tensor upload_host(const float* data, int64_t rows, int64_t cols) override {
    Tensor t = alloc(rows, cols);
    std::vector<uint16_t> h(static_cast<size_t>(rows * cols));
    for (size_t i = 0; i < h.size(); ++i) h[i] = f32_to_bf16(data[i]);
    CUDA_CHECK(cudaMemcpyAsync(t.data, h.data(), h.size() * sizeof(bf16), cudaMemcpyHostToDevice, s_));
    CUDA_CHECK(cudaStreamSynchronize(s_));
    return t;
  }

  Tensor upload_host_f32(const float* data, int64_t rows, int64_t cols) override {
    Tensor t = alloc_f32(rows, cols);
    CUDA_CHECK(cudaMemcpyAsync(t.data, data, sizeof(float) * rows * cols, cudaMemcpyHostToDevice, s_));
    CUDA_CHECK(cudaStreamSynchronize(s_));
    return t;
  }

  std::vector<float> to_host(const Tensor& t) override {
    if (t.dtype == DType::F32 && !t.empty()) {
      std::vector<float> out(static_cast<size_t>(t.rows * t.cols));
      CUDA_CHECK(cudaMemcpy2DAsync(out.data(), t.cols * sizeof(float), t.data, t.stride * sizeof(float),
                                   t.cols * sizeof(float), t.rows, cudaMemcpyDeviceToHost, s_));
      CUDA_CHECK(cudaStreamSynchronize(s_));
      return out;
    }
    require_bf16(t, "to_host input");
    std::vector<uint16_t> h(static_cast<size_t>(t.rows * t.cols));
    CUDA_CHECK(cudaMemcpy2DAsync(h.data(), t.cols * sizeof(bf16), t.data, t.stride * sizeof(bf16),
                                 t.cols * sizeof(bf16), t.rows, cudaMemcpyDeviceToHost, s_));
    CUDA_CHECK(cudaStreamSynchronize(s_));
    std::vector<float> out(h.size());
    for (size_t i = 0; i < h.size(); ++i) out[i] = bf16_to_f32(h[i]);
    return out;
  }

  KvCache alloc_kv(int n_layers, int n_pages, int page_size, int n_kv_heads, int head_dim) override {
    KvCache c;
    c.page_size = page_size;
    c.n_pages = n_pages;
    const int64_t rows = int64_t{n_pages} * page_size, cols = int64_t{n_kv_heads} * head_dim;
    for (int l = 0; l < n_layers; ++l) {
      c.k.push_back(alloc(rows, cols));
      c.v.push_back(alloc(rows, cols));
      CUDA_CHECK(cudaMemsetAsync(c.k.back().data, 0, sizeof(bf16) * rows * cols, s_));
      CUDA_CHECK(cudaMemsetAsync(c.v.back().data, 0, sizeof(bf16) * rows * cols, s_));
    }
    return c;
  }

  void embed(const Tensor& table, const std::vector<int32_t>& ids, Tensor& out,
             const DeviceTokens* from_device) override {
    require_bf16(table, "embedding table");
    for (int32_t id : ids) {
      check(id >= 0 && id < table.rows, "token id ", id, " is outside the vocabulary (0..", table.rows - 1, ")");
    }
    check(residual_dtype(out), "cuda backend: embed output must be F32 or BF16");
    const int32_t* d_ids = stage(ids);
    const int32_t* d_map = nullptr;
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
      d_map = stage(map);
    }
    if (skip_launch()) return;
    cuda::launch_embed(mat(table), d_ids, from_device ? static_cast<const int32_t*>(from_device->ids.data) : nullptr,
                       d_map, rows_of(out), s_);
    CUDA_CHECK_LAUNCH();
  }

  void matmul(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out) override {
    require_bf16(x, "matmul input");
    require_bf16(w, "matmul weight");
    check(x.cols == w.cols && out.rows == x.rows && out.cols == w.rows, "cuda backend: matmul shape mismatch");
    if (skip_launch()) return;
    if (in_skinny_slices(x, w, out, [&](const Tensor& xs, Tensor& os) {
          cuda::launch_skinny_gemm(mat(xs), mat(w), bias ? static_cast<const bf16*>(bias->data) : nullptr, mat(os),
                                   props_.multiProcessorCount, s_);
          CUDA_CHECK_LAUNCH();
        }))
      return;
    lt_->run(mat(x), mat(w), mat(out));
    if (bias) {
      cuda::launch_add_bias(mat(out), static_cast<const bf16*>(bias->data), s_);
      CUDA_CHECK_LAUNCH();
    }
  }

  void matmul_swiglu(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& gate_up, Tensor& out) override {
    require_bf16(x, "matmul input");
    require_bf16(w, "matmul weight");
    check(x.cols == w.cols && w.rows == 2 * out.cols && out.rows == x.rows,
          "cuda backend: matmul_swiglu shape mismatch");
    if (skip_launch()) return;
    if (!in_skinny_slices(x, w, out, [&](const Tensor& xs, Tensor& os) {
          cuda::launch_skinny_gemm_swiglu(mat(xs), mat(w), bias ? static_cast<const bf16*>(bias->data) : nullptr,
                                          mat(os), s_);
          CUDA_CHECK_LAUNCH();
        }))
      Backend::matmul_swiglu(x, w, bias, gate_up, out);
  }

  // Runs a product through the skinny kernel: whole when x has at most kSkinnyMaxRows rows, and
  // in slices of that many rows when rows must not depend on their batch (DFLASH_BATCH_INVARIANT=1:
  // every row then takes the skinny kernel's reduction order, at the price of reading the weights
  // once per slice). False when the product takes cuBLASLt instead.
  template <typename Launch>
  bool in_skinny_slices(const Tensor& x, const Tensor& w, Tensor& out, Launch&& launch) {
    if (cuda::skinny_gemm_supported(mat(x), mat(w), mat(out))) {
      launch(x, out);
      return true;
    }
    if (!batch_invariant_ || x.rows <= cuda::kSkinnyMaxRows ||
        !cuda::skinny_gemm_supported(mat(x.slice_rows(0, cuda::kSkinnyMaxRows)), mat(w), mat(out)))
      return false;
    for (int64_t r0 = 0; r0 < x.rows; r0 += cuda::kSkinnyMaxRows) {
      const int64_t n = std::min<int64_t>(cuda::kSkinnyMaxRows, x.rows - r0);
      Tensor os = out.slice_rows(r0, n);
      launch(x.slice_rows(r0, n), os);
    }
    return true;
  }

  // A few rows (decode): the product normalizes its own input, one kernel instead of two.
  void norm_matmul(const ResidualNorm& n, Tensor& h, const Tensor& w, const Tensor* bias, Tensor& out,
                   Tensor* gate_up) override {
    static const bool off = cuda::env_switch("DFLASH_FUSED_NORM") == "0";
    const cuda::RowNorm rn = row_norm(n);
    const bool shapes = n.residual->cols == w.cols && out.rows == n.residual->rows &&
                        w.dtype == DType::BF16 && (gate_up ? w.rows == 2 * out.cols : w.rows == out.cols);
    if (off || !rn.residual || !shapes ||
        !cuda::skinny_gemm_norm_supported(rn, n.residual->rows, mat(w), gate_up, props_.multiProcessorCount))
      return Backend::norm_matmul(n, h, w, bias, out, gate_up);
    if (skip_launch()) return;
    cuda::launch_skinny_gemm_norm(rn, n.residual->rows, mat(w), bias ? static_cast<const bf16*>(bias->data) : nullptr,
                                  mat(out), gate_up != nullptr, props_.multiProcessorCount, s_);
    CUDA_CHECK_LAUNCH();
    if (n.capture) capture_rows(*n.residual_out, *n.capture);
  }

  // The RMSNorm kernel writes the capture too (no gather after it).
  void norm_in(const ResidualNorm& n, Tensor& h) override {
    if (!n.delta || !n.capture) return Backend::norm_in(n, h);
    const Tensor &r = *n.residual, &ro = *n.residual_out, &c = *n.capture;
    check(residual_dtype(r) && ro.dtype == r.dtype,
          "cuda backend: add_rms_norm needs the residual and its output in one type (F32 or BF16)");
    require_bf16(*n.delta, "add_rms_norm delta");
    require_bf16(h, "add_rms_norm output");
    require_bf16(c, "layer-output capture");
    check(c.rows == r.rows && c.cols == r.cols, "cuda backend: layer-output capture shape mismatch");
    const bf16* w = static_cast<const bf16*>(n.weight->data);
    if (!cuda::add_rms_norm_captures(rows_of(r), mat(*n.delta), rows_of(ro), w, mat(h), mat(c)))
      return Backend::norm_in(n, h);
    if (skip_launch()) return;
    cuda::launch_add_rms_norm(rows_of(r), mat(*n.delta), rows_of(ro), w, n.eps, mat(h), s_, mat(c));
    CUDA_CHECK_LAUNCH();
  }

  // The kernels' view of a ResidualNorm; residual stays null when a tensor is not bf16 or the
  // shapes differ (the caller then takes the separate steps).
  static cuda::RowNorm row_norm(const ResidualNorm& n) {
    const Tensor& r = *n.residual;
    cuda::RowNorm rn;
    if (!residual_dtype(r) || n.weight->dtype != DType::BF16) return rn;
    if (n.delta) {
      const Tensor &d = *n.delta, &ro = *n.residual_out;
      if (d.dtype != DType::BF16 || ro.dtype != r.dtype || d.rows != r.rows || d.cols != r.cols ||
          ro.rows != r.rows || ro.cols != r.cols)
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

  void rms_norm(const Tensor& x, const Tensor& weight, float eps, Tensor& out) override {
    check(residual_dtype(x), "cuda backend: rms_norm input must be F32 or BF16");
    require_bf16(out, "rms_norm output");
    if (skip_launch()) return;
    cuda::launch_rms_norm(rows_of(x), static_cast<const bf16*>(weight.data), eps, mat(out), s_);
    CUDA_CHECK_LAUNCH();
  }

  void add_rms_norm(const Tensor& residual, const Tensor& delta, Tensor& residual_out, const Tensor& weight, float eps,
                    Tensor& out) override {
    check(residual_dtype(residual) && residual_out.dtype == residual.dtype,
          "cuda backend: add_rms_norm needs the residual and its output in one type (F32 or BF16)");
    require_bf16(delta, "add_rms_norm delta");
    require_bf16(out, "add_rms_norm output");
    if (skip_launch()) return;
    cuda::launch_add_rms_norm(rows_of(residual), mat(delta), rows_of(residual_out),
                              static_cast<const bf16*>(weight.data), eps, mat(out), s_);
    CUDA_CHECK_LAUNCH();
  }

  void head_norm_rope(Tensor& x, int n_heads, int head_dim, const Tensor* norm_weight, float eps,
                      const std::vector<int32_t>& positions, const std::vector<float>& inv_freq) override {
    check_rope(head_dim, inv_freq);
    const int32_t* d_positions = stage(positions);
    if (skip_launch()) return;
    cuda::launch_head_norm_rope(mat(x), n_heads, head_dim,
                                norm_weight ? static_cast<const bf16*>(norm_weight->data) : nullptr, eps,
                                d_positions, device_inv_freq(inv_freq), s_);
    CUDA_CHECK_LAUNCH();
  }

  void qkv_rope_kv_write(Tensor& qkv, int n_heads, int n_kv_heads, int head_dim, const Tensor* q_norm,
                         const Tensor* k_norm, float eps, const std::vector<int32_t>& positions,
                         const std::vector<float>& inv_freq, Tensor& k_cache, Tensor& v_cache,
                         const std::vector<int32_t>& slots) override {
    check_rope(head_dim, inv_freq);
    check(qkv.cols == int64_t{n_heads + 2 * n_kv_heads} * head_dim, "cuda backend: qkv shape mismatch");
    for (int32_t slot : slots) check(slot >= 0 && slot < k_cache.rows, "cuda backend: KV slot out of range");
    auto ptr = [](const Tensor* t) { return t ? static_cast<const bf16*>(t->data) : nullptr; };
    const int32_t* d_positions = stage(positions);
    const int32_t* d_slots = stage(slots);
    if (skip_launch()) return;
    cuda::launch_qkv_rope_kv_write(mat(qkv), n_heads, n_kv_heads, head_dim, ptr(q_norm), ptr(k_norm), eps,
                                   d_positions, device_inv_freq(inv_freq), mat(k_cache), mat(v_cache), d_slots,
                                   s_);
    CUDA_CHECK_LAUNCH();
  }

  void kv_rope_write_layers(Tensor& kv, int n_kv_heads, int head_dim, const std::vector<const Tensor*>& k_norms,
                            float eps, const std::vector<int32_t>& positions, const std::vector<float>& inv_freq,
                            std::vector<Tensor>& k_caches, std::vector<Tensor>& v_caches,
                            const std::vector<int32_t>& slots) override {
    const int64_t width = int64_t{2} * n_kv_heads * head_dim;
    check_kv_layers(kv, width, k_norms, k_caches, v_caches);
    const int n = static_cast<int>(k_caches.size());
    bool same_layout = n <= cuda::kMaxKvLayers;
    for (int l = 0; l < n && same_layout; ++l)
      same_layout = k_caches[l].stride == k_caches[0].stride && v_caches[l].stride == v_caches[0].stride &&
                    k_caches[l].rows == k_caches[0].rows && v_caches[l].rows == k_caches[0].rows;
    if (!same_layout)
      return Backend::kv_rope_write_layers(kv, n_kv_heads, head_dim, k_norms, eps, positions, inv_freq, k_caches,
                                           v_caches, slots);
    check_rope(head_dim, inv_freq);
    check(static_cast<int64_t>(positions.size()) == kv.rows && static_cast<int64_t>(slots.size()) == kv.rows,
          "cuda backend: one position and one slot per kv row");
    for (int32_t slot : slots) check(slot >= 0 && slot < k_caches[0].rows, "cuda backend: KV slot out of range");
    cuda::KvLayers layers;
    layers.n = n;
    layers.k_stride = k_caches[0].stride;
    layers.v_stride = v_caches[0].stride;
    for (int l = 0; l < n; ++l) {
      layers.k_norm[l] = k_norms[l] ? static_cast<const bf16*>(k_norms[l]->data) : nullptr;
      layers.k_cache[l] = static_cast<bf16*>(k_caches[l].data);
      layers.v_cache[l] = static_cast<bf16*>(v_caches[l].data);
    }
    const int32_t* d_positions = stage(positions);
    const int32_t* d_slots = stage(slots);
    if (skip_launch()) return;
    cuda::launch_kv_rope_write_layers(mat(kv), n_kv_heads, head_dim, layers, eps, d_positions,
                                      device_inv_freq(inv_freq), d_slots, s_);
    CUDA_CHECK_LAUNCH();
  }

  void matmul_row_groups(const Tensor& x, const Tensor& w, const RowGroups& g, Tensor& out) override {
    check_row_groups(x, w, g, out);
    require_bf16(x, "matmul input");
    require_bf16(w, "matmul weight");
    const cuda::Mat first = mat(w.slice_rows(g.first, g.rows));
    if (!cuda::skinny_gemm_groups_supported(mat(x), first, g.count)) return Backend::matmul_row_groups(x, w, g, out);
    if (skip_launch()) return;
    cuda::launch_skinny_gemm_groups(mat(x), first, g.count, g.step, mat(out), props_.multiProcessorCount, s_);
    CUDA_CHECK_LAUNCH();
  }

  void swiglu(const Tensor& gate_up, Tensor& out) override {
    check(gate_up.cols == 2 * out.cols, "cuda backend: swiglu shape mismatch");
    if (skip_launch()) return;
    cuda::launch_swiglu(mat(gate_up), mat(out), s_);
    CUDA_CHECK_LAUNCH();
  }

  void kv_write(const Tensor& k, const Tensor& v, Tensor& k_cache, Tensor& v_cache,
                const std::vector<int32_t>& slots) override {
    for (int32_t slot : slots) check(slot >= 0 && slot < k_cache.rows, "cuda backend: KV slot out of range");
    const int32_t* d_slots = stage(slots);
    if (skip_launch()) return;
    cuda::launch_kv_write(mat(k), mat(v), mat(k_cache), mat(v_cache), d_slots, s_);
    CUDA_CHECK_LAUNCH();
  }

  void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                 const std::vector<AttentionSegment>& segments, const std::vector<int32_t>& positions,
                 const AttentionParams& p, Tensor& out) override {
    run_attention(q, nullptr, k_cache, v_cache, segments, positions, p, out);
  }

  // The fused form (launch.h's AttnFresh) where the shape has it and the batch is laid out as
  // the contract says; the separate steps otherwise.
  void qkv_attention(Tensor& qkv, const Tensor* q_norm, const Tensor* k_norm, float eps,
                     const std::vector<float>& inv_freq, const std::vector<int32_t>& slots, Tensor& k_cache,
                     Tensor& v_cache, const std::vector<AttentionSegment>& segments,
                     const std::vector<int32_t>& positions, const AttentionParams& p, Tensor& out) override {
    static const bool off = cuda::env_switch("DFLASH_FUSED_QKV_ATTENTION") == "0";
    const int64_t q_dim = int64_t{p.n_heads} * p.head_dim, kv_dim = int64_t{p.n_kv_heads} * p.head_dim;
    const cuda::AttnShape shape{p.n_heads, p.n_kv_heads, p.head_dim, p.page_size, p.sliding_window};
    auto separate = [&] {
      note_launch(0);
      Backend::qkv_attention(qkv, q_norm, k_norm, eps, inv_freq, slots, k_cache, v_cache, segments, positions, p, out);
    };
    if (off || p.n_kv_heads <= 0 || p.n_heads % p.n_kv_heads != 0 || qkv.cols != q_dim + 2 * kv_dim ||
        static_cast<int>(inv_freq.size()) != p.head_dim / 2 ||
        !rows_are_last_keys(segments, positions, slots, p.page_size, qkv.rows))
      return separate();
    const int tile_rows = cuda::attention_rows_per_tile(shape);
    int n_tiles = 0, max_keys = 0;
    for (const auto& seg : segments) {
      n_tiles += (seg.n_rows + tile_rows - 1) / tile_rows;
      max_keys = std::max(max_keys, launch_keys(seg));
    }
    if (!cuda::attention_fresh_supported(shape, n_tiles, max_keys)) return separate();
    const float2* rope = rope_table(inv_freq, max_keys - 1);
    if (!rope) return separate();  // a capture needs a larger table than there is
    for (int32_t slot : slots) check(slot >= 0 && slot < k_cache.rows, "cuda backend: KV slot out of range");
    note_launch(1);
    auto ptr = [](const Tensor* t) { return t ? static_cast<const bf16*>(t->data) : nullptr; };
    const bf16* base = static_cast<const bf16*>(qkv.data);
    const cuda::AttnFresh fresh{base + q_dim, base + q_dim + kv_dim, qkv.stride, ptr(q_norm), ptr(k_norm), eps, rope};
    run_attention(qkv.slice_cols(0, q_dim), &fresh, k_cache, v_cache, segments, positions, p, out);
  }

  void gather_rows(const Tensor& src, const std::vector<int32_t>& rows, Tensor& out) override {
    for (int32_t r : rows) check(r >= 0 && r < src.rows, "cuda backend: gather row out of range");
    check(residual_dtype(src) && src.cols == out.cols && static_cast<int64_t>(rows.size()) == out.rows,
          "cuda backend: gather_rows shape mismatch");
    require_bf16(out, "gather_rows output");
    const int32_t* d_rows = stage(rows);
    if (skip_launch()) return;
    cuda::launch_gather_rows(rows_of(src), d_rows, mat(out), s_);
    CUDA_CHECK_LAUNCH();
  }

  std::vector<int32_t> argmax_rows(const Tensor& x) override {
    std::vector<int32_t> result;
    for (int64_t r0 = 0; r0 < x.rows; r0 += kArgmaxCap) {
      const int64_t n = std::min<int64_t>(kArgmaxCap, x.rows - r0);
      Tensor part = x.slice_rows(r0, n);
      check(!graph_mode(), "cuda backend: argmax synchronizes and cannot be captured");
      cuda::launch_argmax(mat(part), argmax_out_, argmax_out_ + kArgmaxCap, s_);
      CUDA_CHECK_LAUNCH();
      CUDA_CHECK(cudaMemcpyAsync(argmax_host_, argmax_out_, n * sizeof(int32_t), cudaMemcpyDeviceToHost, s_));
      CUDA_CHECK(cudaStreamSynchronize(s_));
      result.insert(result.end(), argmax_host_, argmax_host_ + n);
    }
    return result;
  }

  Tensor alloc_ids(int64_t n) override { return alloc_as(n, 1, DType::I32); }

  void argmax_ids(const Tensor& x, Tensor& ids) override {
    require_bf16(x, "argmax input");
    require_ids(ids, "argmax_ids output");
    check(ids.rows == x.rows, "cuda backend: argmax_ids needs one id per row of x");
    if (skip_launch()) return;
    for (int64_t r0 = 0; r0 < x.rows; r0 += kArgmaxCap) {
      const int64_t n = std::min<int64_t>(kArgmaxCap, x.rows - r0);
      cuda::launch_argmax(mat(x.slice_rows(r0, n)), static_cast<int32_t*>(ids.data) + r0, argmax_out_ + kArgmaxCap, s_);
      CUDA_CHECK_LAUNCH();
    }
  }

  std::vector<int32_t> ids_to_host(const Tensor& ids) override {
    check(!graph_mode(), "cuda backend: ids_to_host synchronizes and cannot be captured");
    require_ids(ids, "ids_to_host input");
    std::vector<int32_t> out(static_cast<size_t>(ids.rows));
    if (out.empty()) return out;
    for (int64_t r0 = 0; r0 < ids.rows; r0 += kArgmaxCap) {  // through pinned memory: a faster copy
      const int64_t n = std::min<int64_t>(kArgmaxCap, ids.rows - r0);
      CUDA_CHECK(cudaMemcpyAsync(argmax_host_, static_cast<const int32_t*>(ids.data) + r0, n * sizeof(int32_t),
                                 cudaMemcpyDeviceToHost, s_));
      CUDA_CHECK(cudaStreamSynchronize(s_));
      std::copy(argmax_host_, argmax_host_ + n, out.begin() + r0);
    }
    return out;
  }

  // With the device selection on (gpu_top_k_, the default), rows with 0 < top_k <= kTopCandidatesMaxK select
  // on the device and copy back their candidates; the others (and rows the kernel could not
  // finish) go through the host.
  std::vector<TopCandidates> select_candidates(const Tensor& logits, const std::vector<int32_t>& rows,
                                               const std::vector<float>& temperature,
                                               const std::vector<int32_t>& top_k) override {
    check(!graph_mode(), "cuda backend: top_candidates synchronizes and cannot be captured");
    require_bf16(logits, "top_candidates input");
    std::vector<TopCandidates> out(rows.size());
    std::vector<size_t> on_device, on_host;
    for (size_t i = 0; i < rows.size(); ++i) {
      const bool fits = gpu_top_k_ && top_k[i] > 0 && top_k[i] <= cuda::kTopCandidatesMaxK && top_k[i] < logits.cols &&
                        temperature[i] > 0;
      (fits ? on_device : on_host).push_back(i);
    }
    for (size_t c0 = 0; c0 < on_device.size(); c0 += kTopRowsPerCall) {
      const size_t n = std::min(kTopRowsPerCall, on_device.size() - c0);
      std::vector<int32_t> meta(3 * n);  // rows, top_k, temperature bits
      for (size_t j = 0; j < n; ++j) {
        const size_t i = on_device[c0 + j];
        meta[j] = rows[i];
        meta[n + j] = top_k[i];
        std::memcpy(&meta[2 * n + j], &temperature[i], sizeof(float));
      }
      const int32_t* d = stage(meta);
      if (!top_out_) {
        CUDA_CHECK(cudaMalloc(&top_out_, sizeof(cuda::TopCandidatesRow) * kTopRowsPerCall));
        CUDA_CHECK(cudaMallocHost(&top_host_, sizeof(cuda::TopCandidatesRow) * kTopRowsPerCall));
      }
      cuda::launch_top_candidates(mat(logits), d, reinterpret_cast<const float*>(d + 2 * n), d + n,
                                  static_cast<int>(n), top_out_, s_);
      CUDA_CHECK_LAUNCH();
      CUDA_CHECK(cudaMemcpyAsync(top_host_, top_out_, sizeof(cuda::TopCandidatesRow) * n, cudaMemcpyDeviceToHost, s_));
      CUDA_CHECK(cudaStreamSynchronize(s_));
      for (size_t j = 0; j < n; ++j) {
        const cuda::TopCandidatesRow& r = top_host_[j];
        const size_t i = on_device[c0 + j];
        if (r.count < 0) {
          on_host.push_back(i);
          continue;
        }
        out[i].ids.assign(r.ids, r.ids + r.count);
        out[i].x.assign(r.x, r.x + r.count);
      }
    }
    if (!on_host.empty()) {
      std::vector<int32_t> hr, hk;
      std::vector<float> ht;
      for (size_t i : on_host) hr.push_back(rows[i]), hk.push_back(top_k[i]), ht.push_back(temperature[i]);
      auto host = Backend::select_candidates(logits, hr, ht, hk);
      for (size_t j = 0; j < on_host.size(); ++j) out[on_host[j]] = std::move(host[j]);
    }
    return out;
  }

 private:
  static constexpr int64_t kArgmaxCap = cuda::kArgmaxMaxRows;
  static constexpr size_t kTopRowsPerCall = 64;

  // The keys a segment's launch is sized for (AttentionSegment::key_capacity).
  static int32_t launch_keys(const AttentionSegment& seg) { return std::max(seg.n_keys, seg.key_capacity); }

  // Whether each segment's rows are its last keys, in order, with the slots its page table gives.
  static bool rows_are_last_keys(const std::vector<AttentionSegment>& segments, const std::vector<int32_t>& positions,
                                 const std::vector<int32_t>& slots, int page_size, int64_t n_rows) {
    if (static_cast<int64_t>(positions.size()) != n_rows || static_cast<int64_t>(slots.size()) != n_rows) return false;
    for (const auto& seg : segments) {
      if (seg.n_rows < 0 || seg.n_keys < seg.n_rows || seg.first_row < 0 || seg.first_row + seg.n_rows > n_rows)
        return false;
      for (int32_t i = 0; i < seg.n_rows; ++i) {
        const int32_t pos = seg.n_keys - seg.n_rows + i, r = seg.first_row + i;
        if (positions[r] != pos || slots[r] != seg.page_table[pos / page_size] * page_size + pos % page_size)
          return false;
      }
    }
    return true;
  }

  // Attention of q's rows (with fresh: the fused form, q being qkv's query heads).
  void run_attention(const Tensor& q, const cuda::AttnFresh* fresh, const Tensor& k_cache, const Tensor& v_cache,
                     const std::vector<AttentionSegment>& segments, const std::vector<int32_t>& positions,
                     const AttentionParams& p, Tensor& out) {
    check(p.head_dim % 8 == 0 && p.head_dim <= 256, "cuda backend: head_dim ", p.head_dim,
          " is not supported (multiple of 8, <= 256)");
    check(p.n_kv_heads > 0 && p.n_heads % p.n_kv_heads == 0, "cuda backend: heads do not form GQA groups");
    const cuda::AttnShape shape{p.n_heads, p.n_kv_heads, p.head_dim, p.page_size, p.sliding_window};
    const int tile_rows = cuda::attention_rows_per_tile(shape);
    std::vector<cuda::AttnRow> rows(static_cast<size_t>(q.rows));
    std::vector<cuda::AttnTile> tiles;
    std::vector<int32_t> tables;
    int max_keys = 0;
    for (const auto& seg : segments) {
      const int n_table = (launch_keys(seg) + p.page_size - 1) / p.page_size;
      const auto offset = static_cast<int32_t>(tables.size());
      tables.insert(tables.end(), seg.page_table, seg.page_table + n_table);
      const int32_t fresh_begin = fresh ? seg.n_keys - seg.n_rows : std::numeric_limits<int32_t>::max();
      for (int32_t r = seg.first_row; r < seg.first_row + seg.n_rows; ++r) {
        rows[r] = {positions[r], seg.n_keys, seg.causal ? 1 : 0, offset, fresh_begin, seg.first_row};
      }
      for (int32_t r = seg.first_row; r < seg.first_row + seg.n_rows; r += tile_rows) {
        tiles.push_back({r, std::min(tile_rows, seg.first_row + seg.n_rows - r)});
      }
      max_keys = std::max(max_keys, launch_keys(seg));
    }
    if (tables.empty()) tables.push_back(0);
    if (tiles.empty()) tiles.push_back({0, 0});
    const int64_t ws = cuda::attention_workspace_bytes(static_cast<int>(q.rows), static_cast<int>(tiles.size()),
                                                       max_keys, shape, fresh != nullptr);
    float* workspace = static_cast<float*>(workspace_for(ws));
    const auto* d_rows = static_cast<const cuda::AttnRow*>(stage_bytes(rows.data(), rows.size() * sizeof(rows[0])));
    const auto* d_tiles =
        static_cast<const cuda::AttnTile*>(stage_bytes(tiles.data(), tiles.size() * sizeof(tiles[0])));
    const int32_t* d_tables = stage(tables);
    note_launch(max_keys);
    if (skip_launch()) return;
    if (fresh)
      cuda::launch_attention_fresh(mat(q), *fresh, mat(k_cache), mat(v_cache), d_rows, static_cast<int>(q.rows),
                                   d_tiles, static_cast<int>(tiles.size()), max_keys, d_tables, shape, workspace,
                                   mat(out), s_);
    else
      cuda::launch_attention(mat(q), mat(k_cache), mat(v_cache), d_rows, static_cast<int>(q.rows), d_tiles,
                             static_cast<int>(tiles.size()), max_keys, d_tables, shape, workspace, mat(out), s_);
    CUDA_CHECK_LAUNCH();
  }

  const int32_t* stage(const std::vector<int32_t>& v) {
    return static_cast<const int32_t*>(stage_bytes(v.data(), v.size() * sizeof(int32_t)));
  }

  // Copies batch metadata to the device once: a vector equal to one of the last
  // few staged (positions, slots, attention rows are the same for every layer)
  // reuses that copy, so a step holds one upload of each, not one per layer.
  // Inside a capture the graph records each upload; restaging writes the new contents in the
  // same places (launches skipped: the returned pointer is only for the launch).
  const void* stage_bytes(const void* data, size_t bytes) {
    if (bytes == 0) return nullptr;
    if (restage_) return restage_bytes(data, bytes);
    if (active_ring_->n_wraps() != recent_wraps_) {
      recent_.clear();
      recent_wraps_ = active_ring_->n_wraps();
    }
    const std::string key(static_cast<const char*>(data), bytes);
    for (const auto& [host, dev, index] : recent_) {
      if (host != key || (capture_ && !share_uploads_)) continue;
      if (capture_) capture_->uploads.push_back({capture_->uploads[index].offset, bytes, index});
      return dev;
    }
    const size_t offset = active_ring_->used();
    const void* d = active_ring_->put(data, bytes);
    if (active_ring_->n_wraps() != recent_wraps_) {  // this put wrapped: older entries are gone
      recent_.clear();
      recent_wraps_ = active_ring_->n_wraps();
    }
    int index = -1;
    if (capture_) {
      index = static_cast<int>(capture_->uploads.size());
      capture_->uploads.push_back({offset, bytes, -1});
    }
    if (recent_.size() >= 8) recent_.erase(recent_.begin());
    recent_.emplace_back(key, d, index);
    return d;
  }

  const void* restage_bytes(const void* data, size_t bytes) {
    Restage& r = *restage_;
    const auto& ups = r.graph->uploads;
    if (r.upload >= ups.size() || ups[r.upload].bytes != bytes) {
      r.matches = false;
      return nullptr;
    }
    const CudaGraph::Upload& u = ups[r.upload++];
    char* host = r.graph->ring->host(u.offset);
    if (u.same_as >= 0) r.matches = r.matches && std::memcmp(host, data, bytes) == 0;  // still one copy?
    else std::memcpy(host, data, bytes);
    return r.graph->ring->device(u.offset);
  }

  // A launch decision taken from the batch's contents (not only its shapes): a capture records
  // it, restaging requires the same.
  void note_launch(int64_t value) {
    if (capture_) capture_->launch_notes.push_back(value);
    if (!restage_) return;
    Restage& r = *restage_;
    const auto& notes = r.graph->launch_notes;
    r.matches = r.matches && r.note < notes.size() && notes[r.note] == value;
    ++r.note;
  }

  // Restaging runs the host side only.
  // The head size and RoPE table the rotating kernels take.
  static void check_rope(int head_dim, const std::vector<float>& inv_freq) {
    check(head_dim % 2 == 0 && head_dim <= 256, "cuda backend: head_dim ", head_dim, " is not supported (even, <= 256)");
    check(static_cast<int>(inv_freq.size()) == head_dim / 2, "cuda backend: rope table size mismatch");
  }
  bool skip_launch() const { return restage_ != nullptr; }
  bool graph_mode() const { return capturing_ || restage_; }

  // Makes a copy of the ring's used part (host to device) the graph's first node.
  static void copy_ring_first(cudaGraph_t graph, const StagingRing& ring) {
    size_t n = 0;
    CUDA_CHECK(cudaGraphGetRootNodes(graph, nullptr, &n));
    std::vector<cudaGraphNode_t> roots(n);
    CUDA_CHECK(cudaGraphGetRootNodes(graph, roots.data(), &n));
    cudaGraphNode_t copy = nullptr;
    CUDA_CHECK(cudaGraphAddMemcpyNode1D(&copy, graph, nullptr, 0, ring.device(0), ring.host(0), ring.used(),
                                        cudaMemcpyHostToDevice));
    const std::vector<cudaGraphNode_t> from(n, copy);
    if (n > 0) CUDA_CHECK(cudaGraphAddDependencies(graph, from.data(), roots.data(), nullptr, n));
  }

  Tensor arena_tensor(int64_t rows, int64_t cols, size_t bytes, DType dt = DType::BF16) {
    const size_t need = (bytes + 255) / 256 * 256;
    check(arena_offset_ + need <= arena_size_, "a CUDA graph needs more than the ", arena_size_ >> 20,
          " MiB of its temporary arena");
    Tensor t;
    t.data = static_cast<char*>(arena_) + arena_offset_;
    t.storage = std::shared_ptr<void>(t.data, [](void*) {});  // the arena lives as long as the backend
    t.dtype = dt;
    t.rows = rows;
    t.cols = cols;
    t.stride = cols;
    arena_offset_ += need;
    return t;
  }

  // Grow-only device buffers; previous contents are dead once the stream moves on.
  // Inside a capture, a fresh piece of the arena (graphs keep their own addresses).
  void* workspace_for(int64_t bytes) {
    if (bytes == 0) return nullptr;
    if (graph_mode()) {  // one piece per capture, grown when a later call needs more
      if (capture_ws_bytes_ < bytes) {
        capture_ws_ = arena_tensor(1, 1, static_cast<size_t>(bytes)).data;
        capture_ws_bytes_ = bytes;
      }
      return capture_ws_;
    }
    if (attn_ws_.empty() || attn_ws_.rows * 2 < bytes) attn_ws_ = alloc((bytes + 1) / 2, 1);
    return attn_ws_.data;
  }

  // The RoPE table (launch_rope_table) of inv_freq for positions 0..max_position: grown in
  // powers of two outside captures (a captured graph may still read an older table, so none
  // is freed); null inside a capture that needs more than there is.
  const float2* rope_table(const std::vector<float>& inv_freq, int max_position) {
    const float* f = device_inv_freq(inv_freq);
    auto& tables = rope_tables_[f];
    if (!tables.empty() && tables.back().second > max_position) return tables.back().first;
    if (graph_mode()) return nullptr;
    int n = 4096;
    while (n <= max_position) n *= 2;
    float2* t = nullptr;
    CUDA_CHECK(cudaMalloc(&t, sizeof(float2) * n * inv_freq.size()));
    cuda::launch_rope_table(t, n, static_cast<int>(inv_freq.size()), f, s_);
    CUDA_CHECK_LAUNCH();
    tables.emplace_back(t, n);
    return t;
  }

  const float* device_inv_freq(const std::vector<float>& f) {
    auto it = inv_freq_.find(f);
    if (it != inv_freq_.end()) return it->second;
    float* d = nullptr;
    CUDA_CHECK(cudaMalloc(&d, f.size() * sizeof(float)));
    CUDA_CHECK(cudaMemcpy(d, f.data(), f.size() * sizeof(float), cudaMemcpyHostToDevice));
    inv_freq_.emplace(f, d);
    return d;
  }

  cudaDeviceProp props_{};
  std::shared_ptr<StreamOwner> owner_;
  cudaStream_t s_ = nullptr;
  std::unique_ptr<cuda::LtGemm> lt_;
  std::shared_ptr<StagingRing> ring_;
  StagingRing* active_ring_ = nullptr;  // ring_, or the ring of the graph being captured
  // Top-k candidates selected on the device unless DFLASH_GPU_TOP_K=0 (the host selection, kept
  // for comparison: bench/results/sampling_gpu_h100.txt).
  bool gpu_top_k_ = cuda::env_switch("DFLASH_GPU_TOP_K") != "0";
  bool batch_invariant_ = cuda::env_switch("DFLASH_BATCH_INVARIANT") == "1";
  cuda::TopCandidatesRow* top_out_ = nullptr;   // top_candidates' results, device and pinned host
  cuda::TopCandidatesRow* top_host_ = nullptr;
  // Recent uploads (contents -> device copy, index in the capture's uploads) of the active
  // ring, valid until it wraps: the positions and slots every layer passes are copied once per
  // forward.
  std::vector<std::tuple<std::string, const void*, int>> recent_;
  uint64_t recent_wraps_ = 0;
  // Graph capture: temporaries come from a bump arena so that replays reuse their addresses.
  void* arena_ = nullptr;
  size_t arena_size_ = 0, arena_offset_ = 0;
  bool capturing_ = false;
  CudaGraph* capture_ = nullptr;  // the graph being captured
  bool share_uploads_ = true;     // its uploads of equal contents share one copy
  Restage* restage_ = nullptr;    // the restaging under way
  void* capture_ws_ = nullptr;
  int64_t capture_ws_bytes_ = 0;
  std::map<std::vector<float>, float*> inv_freq_;
  std::map<const float*, std::vector<std::pair<float2*, int>>> rope_tables_;  // per inv_freq: (table, positions)
  Tensor attn_ws_;
  int32_t* argmax_host_ = nullptr;
  int32_t* argmax_out_ = nullptr;  // kArgmaxCap results, then the argmax workspace
};

}  // namespace

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::unique_ptr<Backend> make_cuda_backend() {
  check(cuda_device_count() > 0, "no CUDA GPU is available (use --device cpu)");
  return std::make_unique<CudaBackend>();
}

}  // namespace dflash
