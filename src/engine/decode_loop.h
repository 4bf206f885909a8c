// The decode loop: sequences in, one scheduled step at a time, token events
// out. It owns the KV caches, the scheduler and the step runner. The serving
// engine drives it from its engine thread; Engine::generate drives it for one
// request on the caller's thread. Not thread-safe: one caller at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "engine/model_set.h"
#include "engine/scheduler.h"
#include "engine/step_runner.h"

namespace dflash {

struct LoopOptions {
  bool speculative = false;        // DFlash steps (the models must have a draft)
  SpecSampling spec_sampling = SpecSampling::Match;
  int n_pages = 0;                 // KV pages of each cache
  int max_num_seqs = 1;
  int max_tokens_per_step = 2048;  // rows per target forward (prefill chunks + decode/verify rows)
  bool graphs = true;              // fixed-shape steps as CUDA-graph replays
  int state_snapshots = 0;         // hybrid targets: recurrent states kept for the prefix cache (Scheduler)
};

// Running totals of the loop's steps.
struct LoopStats {
  int64_t n_steps = 0, n_finished = 0;
  int64_t prompt_tokens = 0, generated_tokens = 0;
  int64_t dflash_seq_steps = 0;              // one per sequence per DFlash step
  int64_t graph_steps = 0;                   // steps whose forward ran as a CUDA-graph replay
  std::vector<int64_t> acceptance_histogram;  // [a] = sequence-steps that accepted a drafts
  std::vector<int64_t> position_accepted;     // [i] = sequence-steps whose draft token i+1 was accepted
  // Host time of steps with prefill chunks and of decode-only steps; within the latter, drafts
  // run apart from their verification (rejection scheme).
  double prefill_ms = 0, decode_ms = 0, draft_ms = 0;
  int64_t decode_steps = 0;                  // steps without prefill chunks
};

class DecodeLoop {
 public:
  DecodeLoop(ModelSet& m, const LoopOptions& o);

  void add(std::unique_ptr<Sequence> s);
  // Ends a sequence (running or waiting) with Cancelled; false when there is none with that id.
  bool cancel(uint64_t id);
  void cancel_all();
  // Runs one step; false when there was nothing to run. Each sequence's events go to its callback:
  // tokens as they come, then one final event, after its pages are free (and after
  // `on_pages_freed`, when set, has run).
  bool step();
  bool idle() const { return sched_.empty(); }

  const LoopStats& stats() const { return stats_; }
  void reset_stats();  // counters back to zero (after a warm-up)
  const Scheduler& scheduler() const { return sched_; }
  const StepRunner& runner() const { return runner_; }
  int block() const { return runner_.block(); }
  int64_t kv_cache_bytes() const;  // both caches

  std::function<void()> on_pages_freed;

 private:
  struct Ended {
    std::unique_ptr<Sequence> seq;
    FinishReason reason;
    std::vector<int32_t> tokens;
    std::string error;
    std::vector<TokenLogprobs> logprobs;
  };
  void finish(std::vector<Ended>& ended);

  ModelSet& m_;
  StepCaches caches_;
  Scheduler sched_;
  StepRunner runner_;
  LoopStats stats_;
};

}  // namespace dflash
