// Public API of the engine: load a target (and optionally a DFlash draft) and
// generate for one sequence (greedy or sampled), plainly or with DFlash
// speculation: one request through the decode loop the serving engine runs
// (serving.h). The CLI includes only these two headers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/finish_reason.h"
#include "formats/model_config.h"

namespace dflash {

enum class SpeculativeMode { None, DFlash };

// Token choice; details and the random streams in engine/sampling.h.
struct SamplingParams {
  SamplingParams() = default;
  SamplingParams(float temperature_, int top_k_ = 0, float top_p_ = 1, uint64_t seed_ = 0)
      : temperature(temperature_), top_k(top_k_), top_p(top_p_), seed(seed_) {}
  float temperature = 0;  // 0: greedy
  int top_k = 0;          // 0: off
  float top_p = 1;        // 1: off
  uint64_t seed = 0;
  // Logits processing before temperature (engine/logits_processing.h), as vLLM applies it.
  float presence_penalty = 0, frequency_penalty = 0;  // per generated token present / per occurrence
  float repetition_penalty = 1;                       // tokens of the prompt or the output; 1: off
  std::vector<std::pair<int32_t, float>> logit_bias;  // added to the logit of a token id
  int min_tokens = 0;                                 // EOS ids are ruled out before this many tokens
  bool greedy() const { return temperature <= 0; }
  bool processes_logits() const {
    return presence_penalty != 0 || frequency_penalty != 0 || repetition_penalty != 1 || !logit_bias.empty() ||
           min_tokens > 0;
  }
};

// The log-probability of a chosen token and of the most likely tokens (most
// likely first, the lower id on ties), from the target's raw logits.
struct TokenLogprobs {
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;
};

// How DFlash verifies drafts when sampling (docs/algorithm.md section 5).
enum class SpecSampling {
  Match,      // draft by argmax; accept while the target's own sample equals the draft token
  Rejection,  // draft samples from q; accept with min(1, p/q), resample from max(0, p - q)
};

struct EngineOptions {
  std::string model_dir;
  std::string draft_dir;   // empty: no draft
  std::string device = "cpu";
  int page_size = 16;      // KV-cache page size in tokens
  int block_size = 0;      // DFlash block size; 0 = the draft's own
  bool batch_invariant = false;  // each row's result independent of the batch it is in (CUDA: slower at large batches)
  bool graphs = true;      // replay fixed-shape decoding steps as CUDA graphs (false: op by op)
  int tensor_parallel = 1;  // the target's ranks: CPU backends, or GPUs 0..N-1 with NCCL (model/tensor_parallel.h)
};

struct GenerateOptions {
  int max_tokens = 128;
  SpeculativeMode mode = SpeculativeMode::None;
  std::vector<int32_t> eos_ids;  // empty: the model's generation_config / config
  bool use_default_eos = true;   // false with empty eos_ids: never stop on a token
  SamplingParams sampling;       // greedy by default
  SpecSampling spec_sampling = SpecSampling::Match;
  int logprobs = -1;             // >= 0: each token's log-probability with this many top entries
};

struct GenerationStats {
  int n_prompt_tokens = 0;
  int n_generated = 0;
  int n_steps = 0;                     // target forwards after the prefill
  int block_size = 1;                  // 1 for plain decoding
  std::vector<int> acceptance_histogram;  // [i] = steps that produced i+1 tokens
  double tau = 1.0;                    // mean acceptance length
  // prefill_ms: steps with prompt chunks (up to the first token); decode_ms: the steps after.
  // Within decode_ms, draft_ms: drafts run apart from verification (rejection sampling); other
  // drafts run in one forward with their verification, whose time verify_ms counts.
  double prefill_ms = 0, decode_ms = 0, draft_ms = 0, verify_ms = 0, total_ms = 0;
  int64_t graph_replays = 0, graph_captures = 0;  // decoding forwards run as CUDA-graph replays, and captures
  double graph_capture_ms = 0;                    // within decode_ms: capturing those graphs
};

struct GenerationResult {
  std::vector<int32_t> tokens;  // generated ids (EOS included when it stopped there)
  std::vector<TokenLogprobs> logprobs;  // one per token when GenerateOptions::logprobs >= 0
  FinishReason stop_reason = FinishReason::Length;  // Eos, Length (max_tokens) or Context (max positions)
  GenerationStats stats;
};

class Engine {
 public:
  explicit Engine(const EngineOptions& opts);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Throws Error naming the problem for a bad request, or with the message of a failed step.
  GenerationResult generate(const std::vector<int32_t>& prompt, const GenerateOptions& opts);

  const ModelConfig& target_config() const;
  bool has_draft() const;
  const DraftConfig* draft_config() const;  // null without a draft
  int block_size() const;                   // effective DFlash block size
  const std::vector<int32_t>& default_eos_ids() const;
  const std::string& backend_name() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dflash
