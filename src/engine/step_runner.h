// Runs one scheduled step on the models: prefill chunks and decoding
// sequences share one target forward; with DFlash, a draft forward over every
// decoding sequence's block comes first, and the committed tokens' context is
// projected into the draft cache after verification. Each sequence accepts and
// rolls back on its own (rollback = not counting rejected rows as cached).
// Steps without prefill chunks, of up to 8 sequences each running a whole block,
// replay CUDA graphs (StepGraphs) keyed by the number of sequences and the key capacity.
#pragma once

#include <string>
#include <vector>

#include "engine/model_set.h"
#include "engine/scheduler.h"
#include "engine/step_graphs.h"

namespace dflash {

// What a step produced for one sequence.
struct SeqOutput {
  ServeSeq* seq;
  std::vector<int32_t> tokens;   // generated this step, in order
  std::string finish_reason;     // empty while it goes on: "stop" or "length"
};

struct StepCounters {
  int64_t prompt_tokens = 0, generated_tokens = 0, dflash_seq_steps = 0;
  std::vector<int64_t> acceptance_histogram;  // sized to the block by the caller
  std::vector<int64_t> position_accepted;
  int64_t graph_steps = 0;  // steps whose forwards ran as CUDA-graph replays
};

class StepRunner {
 public:
  StepRunner(ModelSet& m, bool speculative, SpecSampling scheme, int n_pages);
  std::vector<SeqOutput> run(const StepPlan& plan, const Scheduler& sched, StepCounters& counters);
  int block() const { return block_; }

 private:
  ModelSet& m_;
  bool spec_;
  SpecSampling scheme_;
  int block_;
  KvCache target_cache_, draft_cache_;
  StepGraphs graphs_;  // decode-only steps of a repeating shape run as graph replays
};

}  // namespace dflash
