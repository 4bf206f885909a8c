// One request's decoding state, the record the scheduler and the step share:
// committed tokens, cache lengths, its page table, the pending token, what it
// has emitted and when it must stop.
#pragma once

#include <cstdint>
#include <unordered_set>
#include <vector>

#include "engine/engine.h"
#include "engine/serving.h"

namespace dflash {

struct Sequence {
  uint64_t id = 0;
  ServingEngine::Callback on_event;  // tokens and the final event, on the engine thread
  std::vector<int32_t> tokens;   // prompt + generated tokens already fed or to feed (pending excluded)
  int32_t n_prompt = 0;
  int32_t n_cached = 0;          // target KV valid for positions 0..n_cached-1
  int32_t n_draft_ctx = 0;       // draft context KV valid for 0..n_draft_ctx-1
  std::vector<int32_t> pages;    // page table, the same for the target and the draft context cache
  int32_t n_registered = 0;      // leading pages registered in the prefix cache
  uint64_t chain = 0;            // hash chain of those pages
  int32_t pending = -1;          // chosen and emitted, not yet in the cache; -1 while prefilling
  int n_generated = 0;           // tokens emitted
  int max_tokens = 0;
  std::unordered_set<int32_t> eos;
  SamplingParams sampling;
  int logprobs = -1;             // >= 0: log-probabilities of emitted tokens, with this many top entries
  uint64_t share_prefix_with = 0;  // admitted only once that sequence's prompt is cached (n > 1)
  int64_t admit_order = 0;       // larger = admitted later (preempted first)
  // Hybrid targets (Qwen3.5): the sequence's Gated DeltaNet state slot while it runs, and how many
  // rows of its last verification block (accepted ones) its next target forward folds in first.
  int32_t state_slot = -1;
  int32_t state_replay = 0;
  int32_t snapshot = -1;         // its latest state snapshot in the prefix cache (PagePool index), -1: none

  bool prefilling() const { return pending < 0; }
};

// Checks a request against the model before it is queued: Error naming the problem for an empty
// prompt, ids outside the vocabulary, a prompt beyond the context, max_tokens <= 0, bad sampling.
void validate_request(const ModelConfig& c, const std::vector<int32_t>& prompt, int max_tokens,
                      const SamplingParams& sampling);

}  // namespace dflash
