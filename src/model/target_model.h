// Qwen3 / Llama / Qwen3.5 decoder-only target (one code path: Llama has no q/k norm and
// may have biases and llama3 RoPE; Qwen3.5 mixes Gated DeltaNet layers in). Loads a Hugging
// Face directory as it is.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "formats/model_config.h"
#include "kernels/backend.h"
#include "model/decoder_layers.h"
#include "model/forward_batch.h"
#include "model/rank_group.h"

namespace dflash {

struct TargetWeights {
  Tensor embed;       // [n_vocab, n_embd]  model.embed_tokens
  std::vector<LayerWeights> layers;
  Tensor final_norm;  // [1, n_embd]  model.norm
  // [n_vocab, n_embd]  lm_head (shares embed's storage when tied); a tensor-parallel rank of an
  // untied model holds only lm_head_part's rows.
  Tensor lm_head;
  // The rows of lm_head the rank's logits come from: all of them, or its part of the vocabulary.
  Tensor lm_head_part;
};

class TargetModel {
 public:
  // With `tp` sharded: rank tp.rank's shard (tensor_parallel.h), whose forwards sum their layers'
  // outputs through `comm` with the other ranks' (which run theirs at the same time); config()
  // is then the rank's shape (its heads, KV heads and features).
  TargetModel(Backend& be, const std::string& dir, const TpRank& tp = {}, Communicator* comm = nullptr);
  // tensor_parallel > 1: this object is rank 0 of that many and owns the others (RankGroup: CPU
  // backends with a CPU `be`, else GPUs 1.. with NCCL, `be` being GPU 0's); forward, alloc_cache
  // and copy_state_slot act on every rank together.
  TargetModel(Backend& be, const std::string& dir, int tensor_parallel);
  ~TargetModel();

  struct Output {
    Tensor logits;    // [batch.logit_rows.size(), n_vocab]
    Tensor captured;  // [batch rows, capture_layers.size() * n_embd]; empty when none asked
  };
  // Runs the new rows of `batch` (their K/V are written to `cache`), returns the
  // logits of batch.logit_rows and the outputs of decoder layers `capture_layers`
  // (layer j's output = residual stream after layer j = HF hidden_states[j+1]).
  // With tensor parallelism every rank captures the same layers (their residual streams hold the
  // same bits), and each keeps its own copy (captured()) for its share of the draft's context.
  // argmax (I32 [logit rows]): the argmax of every logits row goes there instead (argmax_of), and
  // Output::logits stays empty. logit_parts (splits_vocabulary() only): no logits are gathered;
  // each rank keeps its part of them for top_candidates, and argmax, when given, comes from the
  // ranks' candidates at any number of rows.
  Output forward(const ForwardBatch& batch, KvCache& cache, const std::vector<int>& capture_layers = {},
                 Tensor* argmax = nullptr, bool logit_parts = false);
  // Whether the ranks hold parts of the vocabulary (tensor parallelism with lm_head split).
  bool splits_vocabulary() const;
  // Backend::top_candidates of rows of the last forward's logits, from the parts that a forward
  // with logit_parts kept: each rank selects in its part, rank 0 merges (merge_top_candidates).
  std::vector<TopCandidates> top_candidates(const std::vector<int32_t>& rows, const std::vector<float>& temperature,
                                            const std::vector<int32_t>& top_k);
  // This rank's captured layer outputs of its last forward (forward's Output::captured on rank 0).
  const Tensor& captured() const { return captured_; }
  int tensor_parallel() const;
  // Rank 0 of a tensor-parallel target: the other ranks (null with one rank) and its communicator.
  RankGroup* rank_group() const { return ranks_.get(); }
  Communicator* communicator() const { return comm_; }
  // Logits of `rows` of final-normed hidden states through lm_head (the draft's too): with the
  // vocabulary split, this rank's part, gathered from every rank (which all call it together).
  Tensor logits_of(const Tensor& normed, const std::vector<int32_t>& rows);
  // Up to this many rows a vocabulary split's logits are gathered rather than left in the ranks'
  // parts: they travel while the lm_head product runs (pushed, on GPUs), which cost less than
  // exchanging candidates after it. The 8B-shaped DFlash step at batch 1 (16 and 15 rows) took
  // 3.605 ms gathered, 3.628-3.646 exchanged; at batch 8 (128 and 120 rows) 6.68 and 6.29 ms; a
  // sampled serving sweep at 8 rows a step lost 2.5% with its parts and an argmax exchange (two
  // H200s). Sampled rows alone need no exchange: StepRunner keeps them in parts at any count.
  static constexpr size_t kGatheredMaxRows = 32;
  // ids (I32 [rows]) on rank 0 = Backend::argmax_ids of logits_of's rows (all ranks call it
  // together). With the vocabulary split and more than kGatheredMaxRows rows, from each rank's
  // best over its part, exchanged and chosen (Communicator::argmax_all): no logits are gathered,
  // and every rank gets the ids.
  void argmax_of(const Tensor& normed, const std::vector<int32_t>& rows, Tensor& ids);
  // Sums x (rank 0's, [rows, n_embd] in the activation type) with a tensor of its shape on every
  // other rank, as each layer does twice (bench-step times it). Nothing with one rank.
  void all_reduce_rows(Tensor& x);
  // Backend::prepare_products on every rank's backend (the draft shares them).
  void prepare_products(int64_t max_rows);

  // Hybrid targets also get n_state_slots recurrent states whose tapes hold tape_rows rows (the
  // largest verification block); attention layers alone get pages.
  KvCache alloc_cache(int n_pages, int page_size, int n_state_slots = 1, int tape_rows = 1);
  // Device bytes of one state slot of alloc_cache (0 for targets without recurrent layers).
  int64_t state_slot_bytes(int tape_rows) const;
  // Hybrid targets: state slot `to` = state slot `from` (convolution window and recurrent state;
  // the tape is not copied: the copy is of committed states).
  void copy_state_slot(KvCache& cache, int32_t from, int32_t to);
  // Weight bytes a decode step reads: every layer, the final norm and lm_head. With `routed`
  // (routed_experts()), a routed layer counts only the experts its rows went to.
  int64_t weight_bytes_per_step(const std::vector<int>* routed = nullptr) const;
  // Per layer, how many distinct experts the last forward routed rows to (0 for dense layers).
  // Synchronizes.
  std::vector<int> routed_experts();
  bool is_moe() const { return !cfg_.moe_layer.empty(); }
  bool is_hybrid() const { return cfg_.hybrid(); }
  const ModelConfig& config() const { return cfg_; }
  const TargetWeights& weights() const { return w_; }
  Backend& backend() const { return be_; }
  const std::string& dir() const { return dir_; }

 private:
  TargetModel(Backend& be, const std::string& dir, std::unique_ptr<RankGroup> ranks);
  // What a rank's forward computes from its final-normed rows: nothing, the logits (gathered with
  // the vocabulary split), their argmax, or this rank's part of them kept (and the argmax, if
  // asked, from the ranks' candidates).
  enum class Head { none, logits, argmax, parts };
  Output forward_own(const ForwardBatch& batch, KvCache& cache, const std::vector<int>& capture_layers, Head head,
                     Tensor* argmax = nullptr);
  KvCache alloc_own_cache(int n_pages, int page_size, int n_state_slots, int tape_rows);
  void copy_own_state_slot(KvCache& cache, int32_t from, int32_t to);
  // This rank's part of the logits of `rows` of final-normed hidden states.
  Tensor logits_part(const Tensor& normed, const std::vector<int32_t>& rows);
  // ids = the argmax of the rows whose parts the ranks hold (each rank's best, exchanged).
  void argmax_of_parts(const Tensor& part, Tensor& ids);

  Backend& be_;
  std::string dir_;
  Communicator* comm_;
  ModelConfig cfg_;
  TargetWeights w_;
  std::vector<float> inv_freq_;
  std::vector<Tensor> expert_rows_;  // per layer: Backend::moe's expert_rows of the last forward
  Tensor captured_;                  // the last forward's captured layer outputs
  Tensor logits_part_;               // the last forward's part of the logits (Head::parts)
  int64_t vocab_first_ = 0;          // the first id of the rank's part of the vocabulary
  int tp_rank_ = 0;
  std::unique_ptr<RankGroup> ranks_;  // tensor parallelism: ranks 1..; null for one rank
};

// Final step shared with the draft: logits of `rows` of the normed hidden states.
Tensor lm_head_rows(Backend& be, const Tensor& normed, const std::vector<int32_t>& rows, const Tensor& lm_head);

}  // namespace dflash
