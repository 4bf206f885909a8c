// DFlash draft (docs/algorithm.md sections 1-3): decoder layers with no embedding and
// no lm_head of their own (the target's are borrowed), a context projection
// fc + hidden_norm of captured target features, and a block forward with
// bidirectional attention over [cached context K/V] ++ [block K/V].
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "formats/model_config.h"
#include "model/decoder_layers.h"
#include "model/forward_batch.h"
#include "model/target_model.h"

namespace dflash {

struct DraftWeights {
  Tensor fc;           // [n_embd, n_ctx_layers * n_embd]; tensor parallelism: the rank's rows of it
  Tensor hidden_norm;  // [1, n_embd]
  Tensor final_norm;   // [1, n_embd]  norm
  std::vector<LayerWeights> layers;
  // Every layer's q/k/v weight in one allocation, layer after layer (layers[l].qkv are its slices),
  // so that the context's k/v rows of all layers are one product.
  Tensor qkv_all;
};

class DraftModel {
 public:
  // Checks that the draft fits `target` (hidden size, layer ids, mask token). With a
  // tensor-parallel target, the draft is split the same way (its heads and features, and fc's
  // output features: each rank projects its own copy of the captured layers into its columns of
  // the context, which the ranks gather) and this object, rank 0, owns the other ranks' drafts:
  // its forwards run on every rank (through the target's RankGroup).
  DraftModel(Backend& be, const std::string& dir, TargetModel& target);
  ~DraftModel();

  // Context projection, once per committed token: c = hidden_norm(fc(features)),
  // then per layer K = RoPE(k_norm(k_proj(c))), V = v_proj(c) written to `cache`
  // at batch.kv_slots. features: rows `rows` of `captured` (every row when rows is null), the
  // target's captured layer outputs [rows, n_ctx_layers * n_embd] of its last forward; the
  // other ranks of a tensor-parallel draft take the same rows of their target's copy.
  void project_context(const Tensor& captured, const std::vector<int32_t>* rows, const ForwardBatch& batch,
                       KvCache& cache);

  // Block forward: batch rows are the blocks [t_s, M, ..., M] added with
  // causal=false after each sequence's context. Their K/V go to the cache slots
  // after the context but the caller does not count them as cached. Returns the
  // logits of batch.logit_rows through the target's lm_head.
  Tensor forward_block(const ForwardBatch& batch, KvCache& cache);
  // The same forward with the argmax of every logits row into ids (I32 [logit rows]) instead
  // (TargetModel::argmax_of: with the vocabulary split, no logits are gathered).
  void forward_block_argmax(const ForwardBatch& batch, KvCache& cache, Tensor& ids);

  KvCache alloc_cache(int n_pages, int page_size);
  // Weight bytes a draft step reads: fc, norms, layers and the target's lm_head (this rank's).
  int64_t weight_bytes_per_step() const;
  // config().layers is the rank's shape (its heads and features).
  const DraftConfig& config() const { return cfg_; }
  const std::string& dir() const { return dir_; }

 private:
  // One rank of a tensor-parallel draft (`target` being that rank's target).
  DraftModel(Backend& be, const std::string& dir, TargetModel& target, const TpRank& tp, Communicator* comm);
  // This rank's projection of its captured rows (project_context).
  void project_own(const Tensor& captured, const std::vector<int32_t>* rows, const ForwardBatch& batch,
                   KvCache& cache);
  // The context's k/v rows of every layer from ctx = hidden_norm(fc(features)).
  void write_context(const Tensor& ctx, const ForwardBatch& batch, KvCache& cache);
  // The rank's block forward: the logits of its logits rows, or with argmax their argmax into
  // *argmax (and an empty tensor returned).
  Tensor forward_own(const ForwardBatch& batch, KvCache& cache, Tensor* argmax = nullptr);
  // on_rank(r) on every other rank with this_rank() here (RankGroup::run), after checking the batch.
  void run_on_ranks(const ForwardBatch& batch, KvCache& cache, const std::function<void(int)>& on_rank,
                    const std::function<void()>& this_rank);

  Backend& be_;
  std::string dir_;
  TargetModel& target_;
  DraftConfig cfg_;
  DraftWeights w_;
  std::vector<float> inv_freq_;
  Communicator* comm_ = nullptr;
  std::vector<std::unique_ptr<DraftModel>> ranks_;  // tensor parallelism: ranks 1..; empty for one rank
};

}  // namespace dflash
