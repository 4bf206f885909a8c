// Per-sequence decoding state: committed tokens, cache lengths and page
// tables, the pending token and the output collected so far.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <unordered_set>
#include <vector>

#include "engine/engine.h"
#include "engine/page_pool.h"
#include "engine/step_graphs.h"
#include "kernels/backend.h"
#include "model/dflash_draft.h"
#include "model/target_model.h"

namespace dflash {

struct Sequence {
  std::vector<int32_t> tokens;         // prompt + committed tokens (tokens in the target cache)
  int32_t n_cached = 0;                // target KV entries valid: positions 0..n_cached-1
  int32_t n_draft_ctx = 0;             // draft context entries: positions 0..n_draft_ctx-1
  std::vector<int32_t> target_pages, draft_pages;
  int32_t pending = -1;                // sampled by the target, not yet run through it
};

// Everything one generate() call works with.
struct DecodeContext {
  Backend& be;
  TargetModel& target;
  DraftModel* draft;                   // null for plain decoding
  KvCache& target_cache;
  KvCache* draft_cache;
  PagePool& target_pages;
  PagePool* draft_pages;
  const GenerateOptions& opts;
  std::unordered_set<int32_t> eos;
  int block_size;
  Sequence seq;
  GenerationResult result;

  // Appends a generated token; true when generation must stop after it.
  bool emit(int32_t token);
  // The target's token choice (greedy or sampled) from one logits row, for the
  // token at `position`; `argmax`: the row's argmax on the device when the step computed it.
  int32_t pick(const Tensor& logits, int64_t position, const Tensor* argmax = nullptr);
  bool done = false;
  StepGraphs* graphs = nullptr;        // decoding forwards as graph replays (when on)

  // Runs a decoding step's forwards over `batches` (body reads them): through graphs, under
  // StepGraphs::shape_key(kind, batches), or eagerly.
  void run_step(const char* kind, std::initializer_list<ForwardBatch*> batches, const std::function<void()>& body);
};

using Clock = std::chrono::steady_clock;
inline double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Reserves pages so that `table` covers n_positions or throws (the caller sized the pool).
void reserve_or_throw(PagePool& pages, std::vector<int32_t>& table, int64_t n_positions);

void run_plain(DecodeContext& ctx);   // one token per target forward
void run_dflash(DecodeContext& ctx);  // DFlash speculative decoding (greedy or sampled)

}  // namespace dflash
