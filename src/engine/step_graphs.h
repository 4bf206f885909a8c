// Decoding steps as CUDA-graph replays. A step body (model forwards, no host
// round trips) is captured once per key, the shape of the step: rows per
// sequence and the key capacity its attention is launched for. Later steps with
// that key stage their batch metadata into the graph (Backend::restage_graph)
// and replay it instead of launching op by op. A key runs eagerly until it has
// come kCaptureAfter times (a capture costs milliseconds, a replay saves a
// fraction of one: short-lived shapes, like a serving batch of one size for a
// few steps, are not worth it). Backends without graphs, and graphs turned
// off (--no-graphs), run every body eagerly.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "kernels/backend.h"
#include "model/forward_batch.h"

namespace dflash {

class StepGraphs {
 public:
  StepGraphs(Backend& be, bool enabled, size_t max_graphs = 16, int capture_after = kCaptureAfter);
  static constexpr int kCaptureAfter = 8;
  bool on() const { return on_; }

  // Key capacity shared by the steps of one graph: n_keys rounded up to kKeyGranule (the
  // attention launches for up to that many keys; blocks past a row's keys do no work).
  static constexpr int32_t kKeyGranule = 256;
  static int32_t key_capacity(int32_t n_keys) { return (n_keys + kKeyGranule - 1) / kKeyGranule * kKeyGranule; }

  // Sizes the batches' attention for the key capacity of their longest sequence and returns the
  // key of a step (`kind`, e.g. "verify") over them (a DFlash step: its draft and verification).
  static std::string shape_key(const char* kind, std::initializer_list<ForwardBatch*> batches);

  // Runs body once: as a replay of the graph of `key` (captured now if there is none), or
  // eagerly when graphs are off. Tensors the body assigns stay valid until the next run.
  void run(const std::string& key, const std::function<void()>& body);

  int64_t captures() const { return captures_; }
  double capture_ms() const { return capture_ms_; }  // host time spent capturing and instantiating
  int64_t replays() const { return replays_; }

 private:
  Backend& be_;
  bool on_;
  size_t max_graphs_;
  std::list<std::pair<std::string, std::shared_ptr<void>>> graphs_;  // most recently used first
  int capture_after_;
  std::unordered_map<std::string, int> uses_;  // eager runs of keys without a graph
  std::unordered_set<std::string> eager_;      // keys whose capture failed
  int64_t captures_ = 0, replays_ = 0;
  double capture_ms_ = 0;
};

}  // namespace dflash
