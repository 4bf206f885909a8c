// One engine step on the models, written once for plain and DFlash decoding
// and shared by serving, generate and bench-step (docs/algorithm.md sections 3-6):
//
//   prepare      the step's forward batches from the scheduler's plan, one
//                record per sequence (prefill chunks first, then decodes);
//   execute      the device work: with DFlash, the draft forward over every
//                decoding sequence's block [t, M, ..., M]; then one target
//                forward over prefill chunks and decode/verify rows, the argmax
//                of its logits rows (without the logits where no sequence needs
//                them), and one copy of the ids back;
//   postprocess  acceptance per sequence, commit (rollback = not counting
//                rejected rows as cached), the committed rows' context
//                projected into the draft cache, the tokens each sequence emits.
//
// Fixed-shape steps (decodes only, every sequence a whole block, at most
// kMaxGraphSequences) keep one shape from step to step: the draft context of
// all rows is projected inside the forward (rows past the accepted ones are
// rewritten by the next step before any draft reads them), and the forward
// replays a CUDA graph (StepGraphs).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "engine/finish_reason.h"
#include "engine/model_set.h"
#include "engine/scheduler.h"
#include "engine/sequence.h"
#include "engine/step_graphs.h"
#include "engine/verification.h"
#include "model/forward_batch.h"

namespace dflash {

// The KV caches a step writes: the target's and (DFlash) the draft's context cache, paged alike.
struct StepCaches {
  KvCache target, draft;
};

// One sequence's part of a step.
struct SeqStep {
  Sequence* seq = nullptr;
  bool prefill = false;
  int32_t n_rows = 0;           // prefill: the chunk's tokens; decode: 1 + n_drafted
  int32_t first_row = 0;        // its first row in the target batch
  bool chooses = false;         // chooses a token (every decode; the prefill chunk that ends the prompt)
  int32_t first_logit = 0;      // its first row among the target's logits rows
  int32_t n_drafted = 0;        // draft tokens d_1..d_n it verifies (0: a plain step)
  int32_t first_draft_logit = 0;  // d_1's row among the draft forward's logits rows
  DraftChoice draft;            // d_1..d_n once drafted (and q for the rejection scheme)
  // Filled by postprocess:
  std::vector<int32_t> tokens;  // emitted this step, in order
  std::vector<TokenLogprobs> logprobs;  // theirs, when the sequence asks
  std::optional<FinishReason> finish;  // set when the sequence ends with this step
};

struct Step {
  explicit Step(int page_size) : draft_batch(page_size), target_batch(page_size), project_batch(page_size) {}
  std::vector<SeqStep> seqs;
  ForwardBatch draft_batch;     // every drafting sequence's block, bidirectional
  ForwardBatch target_batch;    // prefill chunks, then decode/verify rows
  ForwardBatch project_batch;   // fixed-shape DFlash steps: every decode row's context
  bool fixed_shape = false;
  bool draft_on_device = true;  // drafts are the draft's argmax and reach the target on the device
  // Every sequence takes the target's argmax (greedy, no logits processing or log-probabilities):
  // the forward gives the argmax alone (TargetModel::argmax_of: with the vocabulary split and more
  // than 32 rows, no logits are gathered) and logits stays empty.
  bool argmax_only = false;
  // Otherwise, with the target's vocabulary split over tensor-parallel ranks and no sequence
  // choosing on the host (logits processing, log-probabilities), where the step has no greedy
  // sequence or more logits rows than TargetModel::kGatheredMaxRows: the logits stay in the
  // ranks' parts, the sampled rows' candidates come from them (TargetModel::top_candidates), the
  // greedy rows' argmax (when there are any, as parts_argmax says) from the ranks' candidates,
  // and logits stays empty.
  bool logit_parts = false, parts_argmax = false;
  std::vector<int32_t> device_rows;  // target rows whose tokens are drafted on the device, in draft-row order
  // Filled by execute:
  Tensor logits, captured, ids;  // ids: drafted tokens (when on the device), then the argmax of every logits row
  std::vector<int32_t> host_ids;
  double draft_ms = 0;          // a draft forward run apart (rejection scheme), with its token choice
  bool replayed = false;        // the forward ran as a CUDA-graph replay

  int64_t n_device_drafts() const { return draft_on_device ? static_cast<int64_t>(device_rows.size()) : 0; }
};

// Step totals for the engine's statistics.
struct StepCounters {
  int64_t prompt_tokens = 0, generated_tokens = 0, dflash_seq_steps = 0;
  std::vector<int64_t> acceptance_histogram;  // [a] = sequence-steps that accepted a drafts (sized by the caller)
  std::vector<int64_t> position_accepted;     // [i] = sequence-steps whose draft token i+1 was accepted
  bool graph_replayed = false;                // the forward ran as a CUDA-graph replay
};

class StepRunner {
 public:
  static constexpr size_t kMaxGraphSequences = 8;

  // speculative: DFlash steps (needs m.draft and caches.draft). graphs: fixed-shape forwards replay
  // CUDA graphs where the backend has them.
  StepRunner(ModelSet& m, StepCaches& caches, bool speculative, SpecSampling scheme, bool graphs);

  // fixed_shape: lay the step out as a fixed-shape step whatever the plan (bench-step: the
  // forward it times is the one graphs replay); the plan must then qualify.
  Step prepare(const StepPlan& plan, bool fixed_shape = false) const;
  // The step's device work: the forward below, through a graph where the step is fixed-shape,
  // after a separate draft forward for the rejection scheme; then the ids come back.
  void execute(Step& st);
  // The forward alone: no host round trip, capturable (bench-step times it).
  void forward(Step& st);
  // Acceptance, commit, draft context, emitted tokens; fills each record's tokens and finish.
  void postprocess(Step& st, StepCounters& c);

  bool speculative() const { return spec_; }
  int block() const { return block_; }
  const StepGraphs& graphs() const { return graphs_; }

 private:
  void draft_apart(Step& st);  // the rejection scheme's draft forward and host-side sampling
  void emit(SeqStep& r, int32_t token, const TokenLogprobs* lp) const;

  ModelSet& m_;
  StepCaches& caches_;
  bool spec_;
  SpecSampling scheme_;
  int block_;
  StepGraphs graphs_;
};

}  // namespace dflash
