#include "kernels/cuda/graph_staging.h"

#include <cstring>

#include "util/error.h"

namespace dflash::cuda {

// Owns the stream; kept alive by every allocation so that frees stay valid.
struct StreamOwner {
  cudaStream_t stream = nullptr;
  int device = current_device();
  StreamOwner() { CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)); }
  ~StreamOwner() {
    DeviceGuard on(device);
    cudaStreamDestroy(stream);
  }
  // A tensor released while the stream is captured (a step body reassigning a tensor that an
  // eager step allocated) is freed after the capture: a free queued inside it would become a
  // graph node for memory the graph does not own.
  bool capturing = false;
  std::vector<void*> deferred;
  void free(void* p) {
    if (capturing) {
      deferred.push_back(p);
      return;
    }
    DeviceGuard on(device);
    cudaFreeAsync(p, stream);
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
    DeviceGuard on(device_id_);
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
  int device_id_ = current_device();
  size_t size_;
  bool for_graph_;
  void* host_ = nullptr;
  void* device_ = nullptr;
  size_t offset_ = 0;
  uint64_t n_wraps_ = 0;
};

// An instantiated graph, the ring its metadata comes from (copied to the device by the graph's
// first node), and what restage checks a new step against: the capture's uploads in order and
// its launches' decisions.
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
  int device = current_device();
  ~CudaGraph() {
    DeviceGuard on(device);
    if (exec) cudaGraphExecDestroy(exec);
    if (replayed) cudaEventDestroy(replayed);
  }
};

// What restage is doing: which graph, how far through its uploads and launches, and whether the
// body still matches.
struct Restage {
  CudaGraph* graph = nullptr;
  size_t upload = 0, note = 0;
  bool matches = true;
};

namespace {

constexpr size_t kEagerRingBytes = size_t{32} << 20, kGraphRingBytes = size_t{2} << 20;
constexpr size_t kArenaBytes = size_t{1} << 30;

// Makes a copy of the ring's used part (host to device) the graph's first node.
void copy_ring_first(cudaGraph_t graph, const StagingRing& ring) {
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

}  // namespace

GraphStaging::GraphStaging() : owner_(std::make_shared<StreamOwner>()), stream_(owner_->stream) {
  ring_ = std::make_shared<StagingRing>(stream_, kEagerRingBytes, /*for_graph=*/false);
  active_ring_ = ring_.get();
}

GraphStaging::~GraphStaging() {
  cudaStreamSynchronize(stream_);
  if (arena_) cudaFree(arena_);
}

cudaStream_t GraphStaging::eager_stream(const char* what) const {
  check(!in_graph(), "cuda backend: ", what, " waits for the GPU and cannot run inside a CUDA graph");
  return stream_;
}

void GraphStaging::note(int64_t decision) {
  if (capture_) capture_->launch_notes.push_back(decision);
  if (!restage_) return;
  Restage& r = *restage_;
  const auto& notes = r.graph->launch_notes;
  r.matches = r.matches && r.note < notes.size() && notes[r.note] == decision;
  ++r.note;
}

// Copies batch metadata to the device once: a vector equal to one of the last few staged
// (positions, slots, attention rows are the same for every layer) reuses that copy, so a step
// holds one upload of each, not one per layer. Inside a capture the graph records each upload;
// restaging writes the new contents in the same places (launches skipped: the returned pointer
// is only for the launch).
const void* GraphStaging::stage_bytes(const void* data, size_t bytes) {
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

const void* GraphStaging::restage_bytes(const void* data, size_t bytes) {
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

std::shared_ptr<void> GraphStaging::device_memory(size_t bytes) {
  if (in_graph()) return std::shared_ptr<void>(arena_piece(bytes), [](void*) {});  // the arena outlives it
  void* p = nullptr;
  if (cudaMallocAsync(&p, bytes, stream_) != cudaSuccess) {
    cudaGetLastError();  // not left for the next launch check to report
    return nullptr;
  }
  auto owner = owner_;
  return std::shared_ptr<void>(p, [owner](void* q) { owner->free(q); });
}

void* GraphStaging::arena_piece(size_t bytes) {
  const size_t need = (bytes + 255) / 256 * 256;
  check(arena_offset_ + need <= arena_size_, "a CUDA graph needs more than the ", arena_size_ >> 20,
        " MiB of its temporary arena");
  void* p = static_cast<char*>(arena_) + arena_offset_;
  arena_offset_ += need;
  return p;
}

void* GraphStaging::graph_scratch(int64_t bytes) {
  if (!in_graph() || bytes == 0) return nullptr;
  if (scratch_bytes_ < bytes) {
    scratch_ = arena_piece(static_cast<size_t>(bytes));
    scratch_bytes_ = bytes;
  }
  return scratch_;
}

// A body's temporaries start at the arena's beginning, the same for its capture and restages.
void GraphStaging::start_graph_body() {
  arena_offset_ = 0;
  scratch_ = nullptr;
  scratch_bytes_ = 0;
}

std::shared_ptr<void> GraphStaging::capture(const std::function<void()>& body, bool share_uploads) {
  check(!capturing_ && !restage_, "cuda backend: graph captures cannot nest");
  if (!arena_) {
    if (cudaMalloc(&arena_, kArenaBytes) != cudaSuccess) {
      cudaGetLastError();  // not left for the next launch check to report
      arena_ = nullptr;
      throw Error("out of GPU memory for the 1 GiB arena of CUDA graphs' temporaries");
    }
    arena_size_ = kArenaBytes;
  }
  auto g = std::make_shared<CudaGraph>();
  g->ring = std::make_shared<StagingRing>(stream_, kGraphRingBytes, /*for_graph=*/true);
  CUDA_CHECK(cudaEventCreateWithFlags(&g->replayed, cudaEventDisableTiming));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  active_ring_ = g->ring.get();
  capture_ = g.get();
  share_uploads_ = share_uploads;
  recent_.clear();
  capturing_ = true;
  start_graph_body();
  auto end_capture = [&] {
    capturing_ = false;
    capture_ = nullptr;
    active_ring_ = ring_.get();
    recent_.clear();
  };
  const cudaError_t began = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed);
  if (began != cudaSuccess) end_capture();
  CUDA_CHECK(began);
  owner_->capturing = true;
  cudaGraph_t graph = nullptr;
  try {
    body();
  } catch (...) {
    cudaStreamEndCapture(stream_, &graph);
    owner_->end_capture();
    if (graph) cudaGraphDestroy(graph);
    end_capture();
    throw;
  }
  end_capture();
  const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
  owner_->end_capture();
  CUDA_CHECK(ended);
  std::unique_ptr<CUgraph_st, decltype(&cudaGraphDestroy)> owned(graph, &cudaGraphDestroy);
  if (g->ring->used() > 0) copy_ring_first(graph, *g->ring);
  CUDA_CHECK(cudaGraphInstantiate(&g->exec, graph, 0));
  return g;
}

void GraphStaging::replay(const std::shared_ptr<void>& graph) {
  auto* g = static_cast<CudaGraph*>(graph.get());
  CUDA_CHECK(cudaGraphLaunch(g->exec, stream_));
  CUDA_CHECK(cudaEventRecord(g->replayed, stream_));
}

bool GraphStaging::restage(const std::shared_ptr<void>& graph, const std::function<void()>& body) {
  check(!capturing_ && !restage_, "cuda backend: a graph cannot be restaged inside a capture");
  auto* g = static_cast<CudaGraph*>(graph.get());
  CUDA_CHECK(cudaEventSynchronize(g->replayed));  // its last replay has read the ring
  Restage r;
  r.graph = g;
  restage_ = &r;
  start_graph_body();
  try {
    body();
  } catch (...) {
    restage_ = nullptr;
    throw;
  }
  restage_ = nullptr;
  return r.matches && r.upload == g->uploads.size() && r.note == g->launch_notes.size();
}

}  // namespace dflash::cuda
