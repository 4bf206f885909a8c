// Public API of the serving engine: many requests decoded together with
// continuous batching (plain or DFlash), on one engine thread. The HTTP server
// includes only this header and engine.h.
//
// Threading: submit() and cancel() may be called from any thread; events are
// delivered on the engine thread, in order per request, and must not block.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/finish_reason.h"

namespace dflash {

struct ServingOptions {
  EngineOptions engine;           // model, draft, device, page size, block size
  SpeculativeMode mode = SpeculativeMode::DFlash;  // None when there is no draft
  SpecSampling spec_sampling = SpecSampling::Match;  // how sampled requests verify drafts
  int max_num_seqs = 32;          // sequences decoded together
  int kv_pages = 0;               // KV pages per cache (target and draft); 0: enough for max_num_seqs full contexts, capped
  // Rows per target forward (prefill chunks + decode/verify rows). 0: 2048, or twice a full decoding
  // step (max_num_seqs x block) when that is more, so that prompts still get rows beside it.
  int max_tokens_per_step = 0;
  double gpu_memory_fraction = 0; // > 0: size kv_pages to this fraction of the device memory free after loading
  int state_snapshots = -1;       // hybrid targets: recurrent states kept for the prefix cache (-1: max_num_seqs / 4, at least 1; 0: none)
};

struct RequestParams {
  std::vector<int32_t> prompt;
  int max_tokens = 16;
  std::vector<int32_t> extra_eos;  // besides the model's default EOS ids (e.g. a chat template's end of turn)
  SamplingParams sampling;         // greedy by default
  bool ignore_eos = false;         // no token ends the request (max_tokens or the context does)
  int logprobs = -1;               // >= 0: each token's log-probability and this many top entries
  // A request submitted just before with the same prompt (n > 1): this one is admitted after that
  // one's prefill, so that it maps the prompt's pages from the prefix cache. 0: none.
  uint64_t share_prefix_with = 0;
};

struct TokenEvent {
  std::vector<int32_t> tokens;     // newly generated tokens (may be empty on the final event)
  std::vector<TokenLogprobs> logprobs;  // one per token when the request asks (RequestParams::logprobs)
  bool finished = false;
  FinishReason finish_reason = FinishReason::Eos;  // meaningful when finished
  std::string error;               // finish_reason == Error: what failed
  int n_prompt_tokens = 0;
};

struct ServingStats {
  int kv_pages_total = 0, kv_pages_used = 0;  // target cache (the draft cache mirrors it)
  int kv_pages_cached = 0;                     // free, but holding a cached prefix
  int64_t prefix_hit_pages = 0;                // pages mapped from the prefix cache instead of recomputed
  int64_t state_snapshots_taken = 0;           // hybrid targets: recurrent states kept for the prefix cache
  int n_running = 0, n_waiting = 0;
  int64_t n_finished = 0, n_preempted = 0;
  int64_t prompt_tokens = 0, generated_tokens = 0, n_steps = 0;
  int64_t dflash_seq_steps = 0;                // one per sequence per DFlash step
  int64_t graph_steps = 0;                     // steps run as CUDA-graph replays
  std::vector<int64_t> acceptance_histogram;   // [i] = sequence-steps that produced i+1 tokens
  std::vector<int64_t> position_accepted;      // [i] = sequence-steps whose draft token i+1 was accepted
};

class ServingEngine {
 public:
  using Callback = std::function<void(const TokenEvent&)>;

  explicit ServingEngine(const ServingOptions& opts);  // loads the models and starts the engine thread
  ~ServingEngine();                                     // stops it; unfinished requests are cancelled
  ServingEngine(const ServingEngine&) = delete;
  ServingEngine& operator=(const ServingEngine&) = delete;

  // Queues a request; throws Error (nothing queued) when it can never run:
  // empty prompt, ids outside the vocabulary, prompt beyond the context, max_tokens <= 0.
  uint64_t submit(RequestParams params, Callback on_event);
  // Finishes the request at the next step (reason "cancelled") and frees its pages; no-op when finished.
  void cancel(uint64_t id);

  ServingStats stats() const;
  const ModelConfig& target_config() const;
  int block_size() const;  // 1 for plain serving
  bool speculative() const;
  const std::string& backend_name() const;
  int max_num_seqs() const;
  int max_tokens_per_step() const;
  int64_t kv_cache_bytes() const;  // both caches

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dflash
