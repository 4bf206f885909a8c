// The CUDA backend's stream and what goes onto it: kernel launches, batch metadata, device
// memory, and CUDA graphs (capture, restage, replay; Backend's capture_graph, restage_graph and
// replay_graph say what they promise).
//
// Ops launch only through launch(): while a graph is restaged it skips the launch (the op's host
// side runs, to check its arguments and stage its metadata), and in a capture it records each
// launch with its decision value, which a restage must find again, launch for launch. Small
// integer arrays (ids, positions, slots, page tables) go through a pinned staging ring, so an
// upload never waits for the GPU unless the ring wraps; a graph has a ring of its own, copied to
// the device by its first node.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cuda/cuda_check.h"

namespace dflash::cuda {

class StagingRing;
struct CudaGraph;
struct Restage;
struct StreamOwner;

class GraphStaging {
 public:
  GraphStaging();
  ~GraphStaging();
  GraphStaging(const GraphStaging&) = delete;
  GraphStaging& operator=(const GraphStaging&) = delete;

  // Runs fn(stream), which queues one kernel (or a few, or a library call), then checks the
  // launch; skipped while a graph is restaged. `decision` is what the launch's form depends on
  // beyond the op's shapes (e.g. the attention's key count): a capture records it, and a restage
  // that meets another value, or another number of launches, does not match the capture.
  template <typename Fn>
  void launch(Fn&& fn, int64_t decision = 0) {
    note(decision);
    if (restage_) return;
    fn(stream_);
    CUDA_CHECK_LAUNCH();
  }

  // The stream for copies to and from the host and for waits, which graphs cannot hold: Error
  // naming `what` inside a capture or a restage. (Kernels go through launch.)
  cudaStream_t eager_stream(const char* what) const;

  // Copies batch metadata to the device (see the .cpp): the pointer is for this step's launches.
  const void* stage_bytes(const void* data, size_t bytes);
  const int32_t* stage(const std::vector<int32_t>& v) {
    return static_cast<const int32_t*>(stage_bytes(v.data(), v.size() * sizeof(int32_t)));
  }

  // Device memory of `bytes`, owned by the result: from the stream-ordered pool (freed on the
  // stream; a free during a capture waits until it ends), or inside a capture or restage a piece of
  // the graphs' arena, at the same offset on every restage. Null when the pool is out of memory.
  std::shared_ptr<void> device_memory(size_t bytes);
  // Scratch that ops need only during their own launches (attention partials): one piece per
  // capture or restage, grown when a later op needs more; null outside graphs (the caller's own).
  void* graph_scratch(int64_t bytes);

  // Capturing or restaging: temporaries come from the arena, nothing may synchronize.
  bool in_graph() const { return capturing_ || restage_; }

  std::shared_ptr<void> capture(const std::function<void()>& body, bool share_uploads);
  void replay(const std::shared_ptr<void>& graph);
  bool restage(const std::shared_ptr<void>& graph, const std::function<void()>& body);

 private:
  void note(int64_t decision);
  const void* restage_bytes(const void* data, size_t bytes);
  void* arena_piece(size_t bytes);
  void start_graph_body();

  std::shared_ptr<StreamOwner> owner_;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<StagingRing> ring_;   // eager steps' ring
  StagingRing* active_ring_ = nullptr;  // ring_, or the ring of the graph being captured
  // Recent uploads (contents -> device copy, index in the capture's uploads) of the active ring,
  // valid until it wraps: the positions and slots every layer passes are copied once per forward.
  std::vector<std::tuple<std::string, const void*, int>> recent_;
  uint64_t recent_wraps_ = 0;
  // Graph temporaries come from a bump arena so that replays reuse their addresses.
  void* arena_ = nullptr;
  size_t arena_size_ = 0, arena_offset_ = 0;
  void* scratch_ = nullptr;  // graph_scratch's piece of the arena
  int64_t scratch_bytes_ = 0;
  bool capturing_ = false;
  CudaGraph* capture_ = nullptr;  // the graph being captured
  bool share_uploads_ = true;     // its uploads of equal contents share one copy
  Restage* restage_ = nullptr;    // the restaging under way
};

}  // namespace dflash::cuda
