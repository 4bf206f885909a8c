#include "model/dflash_draft.h"

#include "model/rope.h"
#include "util/error.h"

namespace dflash {

DraftModel::DraftModel(Backend& be, const std::string& dir, TargetModel& target)
    : DraftModel(be, dir, target, TpRank{0, target.tensor_parallel()}, target.communicator()) {
  RankGroup* group = target.rank_group();
  if (!group) return;
  ranks_.resize(static_cast<size_t>(group->size() - 1));
  group->run(
      [&](int r) {
        ranks_[static_cast<size_t>(r - 1)] = std::unique_ptr<DraftModel>(
            new DraftModel(group->backend(r), dir, group->model(r), TpRank{r, group->size()}, group->comm(r)));
      },
      [] {});
}

DraftModel::DraftModel(Backend& be, const std::string& dir, TargetModel& target, const TpRank& tp, Communicator* comm)
    : be_(be), dir_(dir), target_(target), cfg_(load_draft_config(dir)), comm_(comm) {
  const ModelConfig& t = target.config();
  const ModelConfig& c = cfg_.layers;
  const std::string where = dir + "/config.json";
  check(c.n_embd == t.n_embd, where, ": draft hidden_size ", c.n_embd, " differs from the target's ", t.n_embd);
  check(cfg_.n_target_layers == t.n_layers, where, ": num_target_layers is ", cfg_.n_target_layers,
        " but the target has ", t.n_layers, " layers");
  check(cfg_.mask_token_id < t.n_vocab, where, ": mask_token_id ", cfg_.mask_token_id,
        " is outside the target vocabulary (", t.n_vocab, ")");
  const ModelConfig shard = shard_config(c, tp, where);  // refused here, before any weight is read
  const TensorStore store = TensorStore::open(dir);
  const int64_t h = c.n_embd, n_ctx = static_cast<int64_t>(cfg_.target_layer_ids.size());
  // fc's output features split over the ranks when they divide (the context's columns, gathered).
  const TensorInfo& fc = store.get("fc.weight", {h, n_ctx * h});
  const bool split_fc = tp.sharded() && h % tp.size == 0;
  const TensorInfo fc_rows = split_fc ? row_slice(fc, tp.rank * (h / tp.size), h / tp.size) : fc;
  w_.fc = be.upload({&fc_rows});
  w_.hidden_norm = be.upload({&store.get("hidden_norm.weight", {h})});
  w_.final_norm = be.upload({&store.get("norm.weight", {h})});
  std::vector<TensorInfo> qkv;
  for (int i = 0; i < c.n_layers; ++i)
    for (const TensorInfo& part : qkv_parts(store, c, "", i, tp)) qkv.push_back(part);
  std::vector<const TensorInfo*> qkv_ptrs;
  for (const TensorInfo& part : qkv) qkv_ptrs.push_back(&part);
  w_.qkv_all = be.upload(qkv_ptrs);
  const int64_t per_layer = w_.qkv_all.rows / c.n_layers;
  for (int i = 0; i < c.n_layers; ++i) {
    const Tensor layer_qkv = w_.qkv_all.slice_rows(i * per_layer, per_layer);
    w_.layers.push_back(load_layer(be, store, c, "", i, &layer_qkv, tp));
  }
  inv_freq_ = rope_inv_freq(c.rope, c.head_dim);
  cfg_.layers = shard;  // the rank's heads and features from here on
}

DraftModel::~DraftModel() = default;

int64_t DraftModel::weight_bytes_per_step() const {
  int64_t n = tensor_bytes(w_.fc) + tensor_bytes(w_.hidden_norm) + tensor_bytes(w_.final_norm) +
              tensor_bytes(target_.weights().lm_head_part);
  for (const auto& l : w_.layers) n += layer_bytes(l);
  return n;
}

KvCache DraftModel::alloc_cache(int n_pages, int page_size) {
  const ModelConfig& c = cfg_.layers;
  auto own = [&] { return be_.alloc_kv(c.n_layers, n_pages, page_size, c.n_kv_heads, c.head_dim); };
  if (ranks_.empty()) return own();
  return target_.rank_group()->alloc_caches(
      [&](int r) { return r == 0 ? own() : ranks_[static_cast<size_t>(r - 1)]->alloc_cache(n_pages, page_size); });
}

void DraftModel::project_context(const Tensor& captured, const std::vector<int32_t>* rows, const ForwardBatch& batch,
                                 KvCache& cache) {
  if (batch.n_rows() == 0) return;
  if (ranks_.empty()) return project_own(captured, rows, batch, cache);
  check(static_cast<int>(cache.ranks.size()) == static_cast<int>(ranks_.size()),
        "a tensor-parallel draft's context needs every rank's cache (DraftModel::alloc_cache)");
  target_.rank_group()->run(
      [&](int r) {
        DraftModel& d = *ranks_[static_cast<size_t>(r - 1)];
        const Tensor& own = d.target_.captured();
        check(own.rows == captured.rows && own.cols == captured.cols, "draft context: rank ", r,
              "'s captured layers are not those of the target's last forward that rank 0 projects");
        d.project_own(own, rows, batch, cache.ranks[static_cast<size_t>(r - 1)]);
      },
      [&] { project_own(captured, rows, batch, cache); });
}

void DraftModel::project_own(const Tensor& captured, const std::vector<int32_t>* rows, const ForwardBatch& batch,
                             KvCache& cache) {
  const ModelConfig& c = cfg_.layers;
  const int64_t n = batch.n_rows();
  check(captured.cols == w_.fc.cols, "draft context: the target captured ", captured.cols / c.n_embd,
        " layers' outputs, the draft reads ", w_.fc.cols / c.n_embd);
  Tensor features = captured;
  if (rows) {
    features = be_.alloc(static_cast<int64_t>(rows->size()), captured.cols);
    be_.gather_rows(captured, *rows, features);
  }
  check(features.rows == n, "draft context: ", features.rows, " feature rows for ", n, " context rows");
  Tensor projected = be_.alloc(n, c.n_embd);
  if (w_.fc.rows == c.n_embd) be_.matmul(features, w_.fc, nullptr, projected);
  else comm_->matmul_all_gather(be_, features, w_.fc, projected);  // the ranks' columns side by side
  Tensor ctx = be_.alloc(n, c.n_embd);
  be_.rms_norm(projected, w_.hidden_norm, c.rms_norm_eps, ctx);
  write_context(ctx, batch, cache);
}

void DraftModel::write_context(const Tensor& ctx, const ForwardBatch& batch, KvCache& cache) {
  const ModelConfig& c = cfg_.layers;
  const int64_t n = batch.n_rows(), q_dim = int64_t{c.n_heads} * c.head_dim, kv_dim = int64_t{c.n_kv_heads} * c.head_dim;
  if (w_.layers[0].qkv_bias.empty()) {
    // Every layer's k/v rows in one product, then one k norm + RoPE + cache write for all layers.
    const int n_layers = static_cast<int>(w_.layers.size());
    Tensor kv = be_.alloc(n, n_layers * 2 * kv_dim);
    be_.matmul_row_groups(ctx, w_.qkv_all, RowGroups{q_dim, 2 * kv_dim, q_dim + 2 * kv_dim, n_layers}, kv);
    std::vector<const Tensor*> k_norms;
    for (const LayerWeights& w : w_.layers) k_norms.push_back(w.k_norm.empty() ? nullptr : &w.k_norm);
    be_.kv_rope_write_layers(kv, c.n_kv_heads, c.head_dim, k_norms, c.rms_norm_eps, batch.positions, inv_freq_, cache.k,
                             cache.v, batch.kv_slots);
    return;
  }
  Tensor kv = be_.alloc(n, 2 * kv_dim);
  for (size_t l = 0; l < w_.layers.size(); ++l) {
    const LayerWeights& w = w_.layers[l];
    const Tensor kv_bias = w.qkv_bias.empty() ? Tensor{} : w.qkv_bias.slice_cols(q_dim, 2 * kv_dim);
    be_.matmul(ctx, w.kv_rows(c), kv_bias.empty() ? nullptr : &kv_bias, kv);
    // kv = [k | v]: the attention-input step with no query heads (k norm, RoPE, cache write).
    be_.qkv_rope_kv_write(kv, 0, c.n_kv_heads, c.head_dim, nullptr, w.k_norm.empty() ? nullptr : &w.k_norm,
                          c.rms_norm_eps, batch.positions, inv_freq_, cache.k[l], cache.v[l], batch.kv_slots);
  }
}

Tensor DraftModel::forward_block(const ForwardBatch& batch, KvCache& cache) {
  if (ranks_.empty()) return forward_own(batch, cache);
  Tensor logits;
  run_on_ranks(
      batch, cache,
      [&](int r) { ranks_[static_cast<size_t>(r - 1)]->forward_own(batch, cache.ranks[static_cast<size_t>(r - 1)]); },
      [&] { logits = forward_own(batch, cache); });
  return logits;
}

void DraftModel::forward_block_argmax(const ForwardBatch& batch, KvCache& cache, Tensor& ids) {
  if (ranks_.empty()) {
    forward_own(batch, cache, &ids);
    return;
  }
  run_on_ranks(
      batch, cache,
      [&](int r) {
        DraftModel& d = *ranks_[static_cast<size_t>(r - 1)];
        Tensor own = d.be_.alloc_ids(ids.rows);
        d.forward_own(batch, cache.ranks[static_cast<size_t>(r - 1)], &own);
      },
      [&] { forward_own(batch, cache, &ids); });
}

void DraftModel::run_on_ranks(const ForwardBatch& batch, KvCache& cache, const std::function<void(int)>& on_rank,
                              const std::function<void()>& this_rank) {
  check(!batch.device_tokens(), "a tensor-parallel draft takes its block's tokens from the host");
  check(static_cast<int>(cache.ranks.size()) == static_cast<int>(ranks_.size()),
        "a tensor-parallel draft's forward needs every rank's cache (DraftModel::alloc_cache)");
  target_.rank_group()->run(on_rank, this_rank);
}

Tensor DraftModel::forward_own(const ForwardBatch& batch, KvCache& cache, Tensor* argmax) {
  const ModelConfig& c = cfg_.layers;
  Tensor x = be_.alloc_f32(batch.n_rows(), c.n_embd);  // the residual stream, float32
  be_.embed(target_.weights().embed, batch.token_ids, x, batch.device_tokens());
  StackInputs in;
  in.positions = &batch.positions;
  in.kv_slots = &batch.kv_slots;
  in.segments = &batch.segments;
  in.cache = &cache;
  in.comm = comm_;
  Tensor normed = run_decoder_layers(be_, c, w_.layers, inv_freq_, w_.final_norm, x, in);
  if (!argmax) return target_.logits_of(normed, batch.logit_rows);
  target_.argmax_of(normed, batch.logit_rows, *argmax);
  return {};
}

}  // namespace dflash
