// The CUDA backend's device, memory, copies and token readback (argmax, top-k candidates).
#include "kernels/cuda/cuda_backend.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/cuda/cuda_check.h"

namespace dflash {
namespace cuda {
namespace {

// The backend's GPU becomes the constructing thread's current device, for good: every later call
// on the backend comes from that thread (a tensor-parallel rank's GPU is its thread's).
cudaDeviceProp select_device(int device) {
  const int n = cuda_device_count();
  check(device >= 0 && device < n, "CUDA device ", device, " does not exist (", n, " GPUs)");
  CUDA_CHECK(cudaSetDevice(device));
  cudaDeviceProp props{};
  CUDA_CHECK(cudaGetDeviceProperties(&props, device));
  return props;
}

}  // namespace

CudaBackend::CudaBackend(const BackendOptions& options) : options_(options), props_(select_device(options.device)) {
  set_pdl_enabled(props_.major >= 9);  // programmatic dependent launch where the device has it (pdl.cuh)
  cudaMemPool_t pool;
  CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, options_.device));
  uint64_t keep = UINT64_MAX;  // keep freed blocks for reuse instead of returning them at each sync
  CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  lt_ = std::make_unique<LtGemm>();
  CUDA_CHECK(cudaMallocHost(&argmax_host_, sizeof(int32_t) * kArgmaxCap));
  const size_t argmax_bytes = sizeof(int32_t) * kArgmaxCap + argmax_workspace_bytes();
  CUDA_CHECK(cudaMalloc(&argmax_out_, argmax_bytes));
  CUDA_CHECK(cudaMemset(argmax_out_, 0, argmax_bytes));  // the workspace's row counters start at zero
}

CudaBackend::~CudaBackend() {
  cudaDeviceSynchronize();
  for (auto& [k, p] : inv_freq_) cudaFree(p);
  for (auto& [f, tables] : rope_tables_)
    for (auto& [t, n] : tables) cudaFree(t);
  cudaFreeHost(argmax_host_);
  cudaFree(argmax_out_);
  cudaFreeHost(top_host_);
  cudaFree(top_out_);
}

bool CudaBackend::memory_info(int64_t& free_bytes, int64_t& total_bytes) {
  size_t f = 0, t = 0;
  CUDA_CHECK(cudaMemGetInfo(&f, &t));
  free_bytes = static_cast<int64_t>(f);
  total_bytes = static_cast<int64_t>(t);
  return true;
}

// Rank 0 of a tensor-parallel group: its graphs carry the other ranks' (RankGroup).
struct GroupGraph {
  std::shared_ptr<void> own, peers;
};

std::shared_ptr<void> CudaBackend::capture_graph(const std::function<void()>& body, bool share_uploads) {
  if (!peers_) return staging_.capture(body, share_uploads);
  peers_->begin_capture(share_uploads);
  auto g = std::make_shared<GroupGraph>();
  try {
    g->own = staging_.capture(body, share_uploads);
  } catch (...) {
    peers_->cancel();
    throw;
  }
  g->peers = peers_->end_capture();
  check(g->peers != nullptr, "cuda backend: another tensor-parallel rank could not capture its part of the graph");
  return g;
}

void CudaBackend::replay_graph(const std::shared_ptr<void>& graph) {
  if (!peers_) return staging_.replay(graph);
  const auto* g = static_cast<const GroupGraph*>(graph.get());
  peers_->replay(g->peers, [&] { staging_.replay(g->own); });
}

bool CudaBackend::restage_graph(const std::shared_ptr<void>& graph, const std::function<void()>& body) {
  if (!peers_) return staging_.restage(graph, body);
  const auto* g = static_cast<const GroupGraph*>(graph.get());
  peers_->begin_restage(g->peers);
  bool ok = false;
  try {
    ok = staging_.restage(g->own, body);
  } catch (...) {
    peers_->cancel();
    throw;
  }
  return peers_->end_restage() && ok;
}

void CudaBackend::synchronize() { CUDA_CHECK(cudaStreamSynchronize(staging_.eager_stream("synchronize"))); }

void CudaBackend::release_cached_memory() {
  synchronize();
  cudaMemPool_t pool;
  CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, options_.device));
  CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
}

double CudaBackend::measure_copy_gbps(int64_t bytes) {
  Tensor a = alloc(bytes / 2, 1), b = alloc(bytes / 2, 1);
  fill_random(a, 1, 1.0f);
  const cudaStream_t s = staging_.eager_stream("measure_copy_gbps");
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < 12; ++i) {
    CUDA_CHECK(cudaEventRecord(e0, s));
    CUDA_CHECK(cudaMemcpyAsync(b.data, a.data, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, s));
    CUDA_CHECK(cudaEventRecord(e1, s));
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

void CudaBackend::fill_random(Tensor& t, uint64_t seed, float scale) {
  require_bf16(t, "fill_random target");
  check(t.contiguous(), "cuda backend: fill_random needs a contiguous tensor");
  staging_.launch(
      [&](cudaStream_t s) { launch_fill_random(static_cast<bf16*>(t.data), t.rows * t.cols, seed, scale, s); });
}

Tensor CudaBackend::alloc_as(int64_t rows, int64_t cols, DType dt) {
  check(rows >= 0 && cols >= 0, "cuda backend: negative tensor size");
  const size_t bytes = dtype_size(dt) * static_cast<size_t>(std::max<int64_t>(rows * cols, 1));
  Tensor t;
  t.storage = staging_.device_memory(bytes);
  if (!t.storage) {
    size_t f = 0, total = 0;
    cudaMemGetInfo(&f, &total);
    throw Error(cat("out of GPU memory: cannot allocate ", bytes, " bytes (", rows, " x ", cols, " ", dtype_name(dt),
                    "); ", f, " of ", total, " bytes free"));
  }
  t.data = t.storage.get();
  t.dtype = dt;
  t.rows = rows;
  t.cols = cols;
  t.stride = cols;
  return t;
}

// Streams each part from its memory mapping; bf16 parts are copied as they are, others are
// converted through a bounded host buffer.
Tensor CudaBackend::upload(const std::vector<const TensorInfo*>& parts) {
  const UploadShape shape = upload_shape(parts);
  Tensor t = alloc(shape.rows, shape.cols);
  const cudaStream_t s = staging_.eager_stream("upload");
  char* dst = static_cast<char*>(t.data);
  for (const auto* p : parts) {
    const auto n = static_cast<size_t>(p->n_elements());
    if (p->dtype == DType::BF16) {
      CUDA_CHECK(cudaMemcpyAsync(dst, p->data, n * sizeof(bf16), cudaMemcpyHostToDevice, s));
    } else {
      constexpr size_t kChunk = size_t{1} << 22;
      std::vector<float> f(std::min(n, kChunk));
      std::vector<uint16_t> h(f.size());
      for (size_t i = 0; i < n; i += kChunk) {
        const size_t c = std::min(kChunk, n - i);
        convert_to_f32(p->dtype, p->data + i * dtype_size(p->dtype), f.data(), c);
        for (size_t j = 0; j < c; ++j) h[j] = f32_to_bf16(f[j]);
        CUDA_CHECK(cudaMemcpyAsync(dst + i * sizeof(bf16), h.data(), c * sizeof(bf16), cudaMemcpyHostToDevice, s));
        CUDA_CHECK(cudaStreamSynchronize(s));  // h is reused
      }
    }
    dst += n * sizeof(bf16);
  }
  CUDA_CHECK(cudaStreamSynchronize(s));
  return t;
}

Tensor CudaBackend::upload_host(const float* data, int64_t rows, int64_t cols) {
  Tensor t = alloc(rows, cols);
  const cudaStream_t s = staging_.eager_stream("upload_host");
  std::vector<uint16_t> h(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < h.size(); ++i) h[i] = f32_to_bf16(data[i]);
  CUDA_CHECK(cudaMemcpyAsync(t.data, h.data(), h.size() * sizeof(bf16), cudaMemcpyHostToDevice, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  return t;
}

Tensor CudaBackend::upload_host_f32(const float* data, int64_t rows, int64_t cols) {
  Tensor t = alloc_f32(rows, cols);
  const cudaStream_t s = staging_.eager_stream("upload_host_f32");
  CUDA_CHECK(cudaMemcpyAsync(t.data, data, sizeof(float) * rows * cols, cudaMemcpyHostToDevice, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  return t;
}

void CudaBackend::copy_rows(const Tensor& src, Tensor& dst) {
  check(src.dtype == dst.dtype && src.rows == dst.rows && src.cols == dst.cols, "cuda backend: copy_rows shape mismatch");
  if (src.rows == 0 || src.cols == 0) return;
  const size_t elt = dtype_size(src.dtype);
  const cudaStream_t s = staging_.eager_stream("copy_rows");
  CUDA_CHECK(cudaMemcpy2DAsync(dst.data, dst.stride * elt, src.data, src.stride * elt, src.cols * elt, src.rows,
                               cudaMemcpyDeviceToDevice, s));
}

std::vector<float> CudaBackend::to_host(const Tensor& t) {
  const cudaStream_t s = staging_.eager_stream("to_host");
  if (t.dtype == DType::F32 && !t.empty()) {
    std::vector<float> out(static_cast<size_t>(t.rows * t.cols));
    CUDA_CHECK(cudaMemcpy2DAsync(out.data(), t.cols * sizeof(float), t.data, t.stride * sizeof(float),
                                 t.cols * sizeof(float), t.rows, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    return out;
  }
  require_bf16(t, "to_host input");
  std::vector<uint16_t> h(static_cast<size_t>(t.rows * t.cols));
  CUDA_CHECK(cudaMemcpy2DAsync(h.data(), t.cols * sizeof(bf16), t.data, t.stride * sizeof(bf16),
                               t.cols * sizeof(bf16), t.rows, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<float> out(h.size());
  for (size_t i = 0; i < h.size(); ++i) out[i] = bf16_to_f32(h[i]);
  return out;
}

KvCache CudaBackend::alloc_kv(int n_layers, int n_pages, int page_size, int n_kv_heads, int head_dim) {
  KvCache c;
  c.page_size = page_size;
  c.n_pages = n_pages;
  const int64_t rows = int64_t{n_pages} * page_size, cols = int64_t{n_kv_heads} * head_dim;
  for (int l = 0; l < n_layers; ++l) {
    c.k.push_back(alloc(rows, cols));
    c.v.push_back(alloc(rows, cols));
    const cudaStream_t s = staging_.eager_stream("alloc_kv");
    CUDA_CHECK(cudaMemsetAsync(c.k.back().data, 0, sizeof(bf16) * rows * cols, s));
    CUDA_CHECK(cudaMemsetAsync(c.v.back().data, 0, sizeof(bf16) * rows * cols, s));
  }
  return c;
}

// Grow-only outside graphs; inside a capture or restage, the graph's own piece of the arena.
void* CudaBackend::workspace_for(int64_t bytes) {
  if (bytes == 0) return nullptr;
  if (staging_.in_graph()) return staging_.graph_scratch(bytes);
  if (attn_ws_.empty() || attn_ws_.rows * 2 < bytes) attn_ws_ = alloc((bytes + 1) / 2, 1);
  return attn_ws_.data;
}

// The RoPE table (launch_rope_table) of inv_freq for positions 0..max_position: grown in powers of
// two outside graphs (a captured graph may still read an older table, so none is freed); null
// inside a capture or restage that needs more than there is.
const float2* CudaBackend::rope_table(const std::vector<float>& inv_freq, int max_position) {
  const float* f = device_inv_freq(inv_freq);
  auto& tables = rope_tables_[f];
  if (!tables.empty() && tables.back().second > max_position) return tables.back().first;
  if (staging_.in_graph()) return nullptr;
  int n = 4096;
  while (n <= max_position) n *= 2;
  float2* t = nullptr;
  CUDA_CHECK(cudaMalloc(&t, sizeof(float2) * n * inv_freq.size()));
  staging_.launch([&](cudaStream_t s) { launch_rope_table(t, n, static_cast<int>(inv_freq.size()), f, s); });
  tables.emplace_back(t, n);
  return t;
}

const float* CudaBackend::device_inv_freq(const std::vector<float>& f) {
  auto it = inv_freq_.find(f);
  if (it != inv_freq_.end()) return it->second;
  float* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, f.size() * sizeof(float)));
  CUDA_CHECK(cudaMemcpy(d, f.data(), f.size() * sizeof(float), cudaMemcpyHostToDevice));
  inv_freq_.emplace(f, d);
  return d;
}

std::vector<int32_t> CudaBackend::argmax_rows(const Tensor& x) {
  std::vector<int32_t> result;
  for (int64_t r0 = 0; r0 < x.rows; r0 += kArgmaxCap) {
    const int64_t n = std::min<int64_t>(kArgmaxCap, x.rows - r0);
    Tensor part = x.slice_rows(r0, n);
    const cudaStream_t s = staging_.eager_stream("argmax");
    staging_.launch([&](cudaStream_t ls) { launch_argmax(mat(part), argmax_out_, argmax_out_ + kArgmaxCap, ls); });
    CUDA_CHECK(cudaMemcpyAsync(argmax_host_, argmax_out_, n * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    result.insert(result.end(), argmax_host_, argmax_host_ + n);
  }
  return result;
}

void CudaBackend::argmax_ids(const Tensor& x, Tensor& ids) {
  require_bf16(x, "argmax input");
  require_ids(ids, "argmax_ids output");
  check(ids.rows == x.rows, "cuda backend: argmax_ids needs one id per row of x");
  for (int64_t r0 = 0; r0 < x.rows; r0 += kArgmaxCap) {
    const int64_t n = std::min<int64_t>(kArgmaxCap, x.rows - r0);
    staging_.launch([&](cudaStream_t s) {
      launch_argmax(mat(x.slice_rows(r0, n)), static_cast<int32_t*>(ids.data) + r0, argmax_out_ + kArgmaxCap, s);
    });
  }
}

void CudaBackend::argmax_candidates(const Tensor& x, int64_t first_id, Tensor& cand) {
  require_bf16(x, "argmax_candidates input");
  check(cand.dtype == DType::F32 && cand.rows == x.rows && cand.cols == 2 && (cand.rows <= 1 || cand.stride == 2),
        "cuda backend: argmax_candidates needs contiguous F32 candidates [x.rows, 2]");
  check(first_id + x.cols <= (int64_t{1} << 24), "argmax candidates: ids beyond 2^24 are not exact in float32");
  for (int64_t r0 = 0; r0 < x.rows; r0 += kArgmaxCap) {
    const int64_t n = std::min<int64_t>(kArgmaxCap, x.rows - r0);
    staging_.launch([&](cudaStream_t s) {
      launch_argmax_candidates(mat(x.slice_rows(r0, n)), first_id, static_cast<float*>(cand.data) + 2 * r0,
                               argmax_out_ + kArgmaxCap, s);
    });
  }
}

void CudaBackend::argmax_of_candidates(const Tensor& all, Tensor& ids) {
  require_ids(ids, "argmax_of_candidates output");
  check(all.dtype == DType::F32 && all.cols % 2 == 0 && ids.rows == all.rows,
        "cuda backend: argmax_of_candidates needs F32 candidates [rows, 2 n] and an id per row");
  staging_.launch([&](cudaStream_t s) {
    launch_argmax_of_candidates(static_cast<const float*>(all.data), all.stride, all.rows,
                                static_cast<int>(all.cols / 2), static_cast<int32_t*>(ids.data), s);
  });
}

std::vector<int32_t> CudaBackend::ids_to_host(const Tensor& ids) {
  const cudaStream_t s = staging_.eager_stream("ids_to_host");
  require_ids(ids, "ids_to_host input");
  std::vector<int32_t> out(static_cast<size_t>(ids.rows));
  if (out.empty()) return out;
  for (int64_t r0 = 0; r0 < ids.rows; r0 += kArgmaxCap) {  // through pinned memory: a faster copy
    const int64_t n = std::min<int64_t>(kArgmaxCap, ids.rows - r0);
    CUDA_CHECK(cudaMemcpyAsync(argmax_host_, static_cast<const int32_t*>(ids.data) + r0, n * sizeof(int32_t),
                               cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    std::copy(argmax_host_, argmax_host_ + n, out.begin() + r0);
  }
  return out;
}

// Rows with 0 < top_k <= kTopCandidatesMaxK (and fewer than the row's entries, temperature > 0)
// select on the device and copy back their candidates; the others, and rows the kernel could not
// finish (ties past its capacity, NaN), go through the host selection.
std::vector<TopCandidates> CudaBackend::select_candidates(const Tensor& logits, const std::vector<int32_t>& rows,
                                                          const std::vector<float>& temperature,
                                                          const std::vector<int32_t>& top_k) {
  const cudaStream_t s = staging_.eager_stream("top_candidates");
  require_bf16(logits, "top_candidates input");
  std::vector<TopCandidates> out(rows.size());
  std::vector<size_t> on_device, on_host;
  for (size_t i = 0; i < rows.size(); ++i) {
    const bool fits = top_k[i] > 0 && top_k[i] <= kTopCandidatesMaxK && top_k[i] < logits.cols && temperature[i] > 0;
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
    const int32_t* d = staging_.stage(meta);
    if (!top_out_) {
      CUDA_CHECK(cudaMalloc(&top_out_, sizeof(TopCandidatesRow) * kTopRowsPerCall));
      CUDA_CHECK(cudaMallocHost(&top_host_, sizeof(TopCandidatesRow) * kTopRowsPerCall));
    }
    staging_.launch([&](cudaStream_t ls) {
      launch_top_candidates(mat(logits), d, reinterpret_cast<const float*>(d + 2 * n), d + n, static_cast<int>(n),
                            top_out_, ls);
    });
    CUDA_CHECK(cudaMemcpyAsync(top_host_, top_out_, sizeof(TopCandidatesRow) * n, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    for (size_t j = 0; j < n; ++j) {
      const TopCandidatesRow& r = top_host_[j];
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

void force_kernel_forms(Backend& cuda_backend, const KernelForms& forms) {
  auto* be = dynamic_cast<CudaBackend*>(&cuda_backend);
  check(be != nullptr, "force_kernel_forms: ", cuda_backend.name(), " is not the CUDA backend");
  be->force_forms(forms);
}

bool warpgroup_tile_products(const Backend& cuda_backend) {
  check(dynamic_cast<const CudaBackend*>(&cuda_backend) != nullptr, "warpgroup_tile_products: ", cuda_backend.name(),
        " is not the CUDA backend");
  return moe_gemm_wgmma_built();
}

long long routed_tile_products(const Backend& cuda_backend) {
  const auto* be = dynamic_cast<const CudaBackend*>(&cuda_backend);
  check(be != nullptr, "routed_tile_products: ", cuda_backend.name(), " is not the CUDA backend");
  return be->routed_tile_products();
}

long long pushed_products(const Backend& cuda_backend) {
  const auto* be = dynamic_cast<const CudaBackend*>(&cuda_backend);
  check(be != nullptr, "pushed_products: ", cuda_backend.name(), " is not the CUDA backend");
  return be->pushed_products();
}

}  // namespace cuda

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options) {
  check(cuda_device_count() > 0, "no CUDA GPU is available (use --device cpu)");
  return std::make_unique<cuda::CudaBackend>(options);
}

}  // namespace dflash
