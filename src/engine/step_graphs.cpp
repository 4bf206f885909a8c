#include "engine/step_graphs.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "util/error.h"

namespace dflash {

StepGraphs::StepGraphs(Backend& be, bool enabled, size_t max_graphs, int capture_after)
    : be_(be), on_(enabled && be.supports_graphs()), max_graphs_(max_graphs), capture_after_(capture_after) {}

std::string StepGraphs::shape_key(const char* kind, std::initializer_list<ForwardBatch*> batches) {
  int32_t keys = 0;
  for (const ForwardBatch* b : batches)
    for (const auto& seg : b->segments) keys = std::max(keys, seg.n_keys);
  const int32_t capacity = key_capacity(keys);
  std::string key = kind;
  for (ForwardBatch* b : batches) {
    b->set_key_capacity(capacity);
    key += cat(": ", b->segments.size(), " sequences, ", b->n_rows(), " rows");
  }
  return cat(key, ", ", capacity, " keys");
}

void StepGraphs::run(const std::string& key, const std::function<void()>& body) {
  if (!on_ || eager_.count(key)) return body();
  auto it = graphs_.begin();
  while (it != graphs_.end() && it->first != key) ++it;
  bool share_uploads = true;
  if (it != graphs_.end()) {
    graphs_.splice(graphs_.begin(), graphs_, it);  // most recently used first
    if (be_.restage_graph(graphs_.front().second, body)) {
      be_.replay_graph(graphs_.front().second);
      ++replays_;
      return;
    }
    // Two uploads that were equal at capture differ now (or a launch decision changed):
    // capture again, each upload with its own copy.
    graphs_.pop_front();
    share_uploads = false;
  } else {
    if (uses_.size() > 4096) uses_.clear();  // bounded: counts of shapes that came and went
    if (++uses_[key] < capture_after_) return body();
    uses_.erase(key);
  }
  std::shared_ptr<void> graph;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    graph = be_.capture_graph(body, share_uploads);
  } catch (const Error&) {
    eager_.insert(key);  // e.g. more metadata than a graph's ring holds; a real input error recurs below
    return body();
  }
  capture_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ++captures_;
  graphs_.emplace_front(key, graph);
  if (graphs_.size() > max_graphs_) graphs_.pop_back();
  be_.replay_graph(graph);
  ++replays_;
}

}  // namespace dflash
