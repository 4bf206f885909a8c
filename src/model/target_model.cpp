#include "model/target_model.h"

#include "formats/safetensors.h"
#include "model/rope.h"
#include "util/error.h"

namespace dflash {

TargetModel::TargetModel(Backend& be, const std::string& dir, const TpRank& tp, Communicator* comm)
    : be_(be), dir_(dir), comm_(comm), cfg_(load_model_config(dir)) {
  check(!tp.sharded() || comm, "a tensor-parallel rank needs a communicator");
  const ModelConfig shard = shard_config(cfg_, tp, dir);  // refused here, before any weight is read
  check(!cfg_.hybrid() || be.has_gated_delta_net(), dir, ": ", cfg_.architecture, " has Gated DeltaNet layers, which the ",
        be.name(), " backend does not implement yet (use --device cpu)");
  const TensorStore store = TensorStore::open(dir);
  const int64_t v = cfg_.n_vocab, h = cfg_.n_embd;
  const std::string& prefix = cfg_.weight_prefix;
  w_.embed = be.upload({&store.get(prefix + "embed_tokens.weight", {v, h})});
  for (int i = 0; i < cfg_.n_layers; ++i) w_.layers.push_back(load_layer(be, store, cfg_, prefix, i, nullptr, tp));
  w_.final_norm = load_norm(be, store, cfg_, prefix + "norm.weight", h);
  // The vocabulary split over the ranks when it divides: rank r's logits (and its draft's) are
  // rows [r v/N, (r+1) v/N) of lm_head, the only ones an untied lm_head loads.
  const bool split = tp.sharded() && v % tp.size == 0;
  const int64_t part = split ? v / tp.size : v, first = split ? tp.rank * part : 0;
  if (cfg_.tie_embeddings) {
    w_.lm_head = w_.embed;
  } else {
    const TensorInfo& head = store.get("lm_head.weight", {v, h});
    const TensorInfo rows = split ? row_slice(head, first, part) : head;
    w_.lm_head = be.upload({&rows});
  }
  if (w_.lm_head.rows > part) w_.lm_head_part = w_.lm_head.slice_rows(first, part);
  else w_.lm_head_part = w_.lm_head;
  vocab_first_ = first;
  tp_rank_ = tp.rank;
  inv_freq_ = rope_inv_freq(cfg_.rope, cfg_.rotary_dim());
  cfg_ = shard;  // the rank's heads and features from here on
  expert_rows_.resize(w_.layers.size());
  for (size_t l = 0; l < w_.layers.size(); ++l)
    if (!w_.layers[l].moe.empty()) expert_rows_[l] = be.alloc_ids(cfg_.moe.n_experts);
}

namespace {

std::unique_ptr<RankGroup> make_rank_group(Backend& be, const std::string& dir, int tensor_parallel) {
  if (tensor_parallel <= 1) return nullptr;
  return std::make_unique<RankGroup>(dir, be.name() == "cpu" ? make_host_rank_devices(tensor_parallel)
                                                             : make_cuda_rank_devices(be, tensor_parallel));
}

}  // namespace

TargetModel::TargetModel(Backend& be, const std::string& dir, int tensor_parallel)
    : TargetModel(be, dir, make_rank_group(be, dir, tensor_parallel)) {}

// The other ranks load on their threads while this one loads here.
TargetModel::TargetModel(Backend& be, const std::string& dir, std::unique_ptr<RankGroup> ranks)
    : TargetModel(be, dir, TpRank{0, ranks ? ranks->size() : 1}, ranks ? ranks->comm(0) : nullptr) {
  if (!ranks) return;
  ranks->wait_loaded();
  ranks_ = std::move(ranks);
  be_.set_graph_peers(ranks_.get());
}

TargetModel::~TargetModel() {
  if (ranks_) be_.set_graph_peers(nullptr);
}

int TargetModel::tensor_parallel() const { return ranks_ ? ranks_->size() : 1; }

void TargetModel::prepare_products(int64_t max_rows) {
  if (!ranks_) return be_.prepare_products(max_rows);
  ranks_->run([&](int r) { ranks_->backend(r).prepare_products(max_rows); }, [&] { be_.prepare_products(max_rows); });
}

void TargetModel::all_reduce_rows(Tensor& x) {
  if (!ranks_) return;
  ranks_->run(
      [&](int r) {
        TargetModel& m = ranks_->model(r);
        Tensor t = m.be_.alloc(x.rows, x.cols);
        m.be_.fill_random(t, 1, 0.0f);
        m.comm_->all_reduce_sum(m.be_, t);
      },
      [&] { comm_->all_reduce_sum(be_, x); });
}

KvCache TargetModel::alloc_cache(int n_pages, int page_size, int n_state_slots, int tape_rows) {
  if (!ranks_) return alloc_own_cache(n_pages, page_size, n_state_slots, tape_rows);
  return ranks_->alloc_caches([&](int r) {
    return (r == 0 ? *this : ranks_->model(r)).alloc_own_cache(n_pages, page_size, n_state_slots, tape_rows);
  });
}

KvCache TargetModel::alloc_own_cache(int n_pages, int page_size, int n_state_slots, int tape_rows) {
  if (!cfg_.hybrid()) return be_.alloc_kv(cfg_.n_layers, n_pages, page_size, cfg_.n_kv_heads, cfg_.head_dim);
  check(n_state_slots >= 1 && tape_rows >= 1, "a hybrid target's cache needs state slots and tape rows");
  int n_attention = 0;
  for (int l = 0; l < cfg_.n_layers; ++l) n_attention += !cfg_.is_linear_layer(l);
  KvCache packed = be_.alloc_kv(n_attention, n_pages, page_size, cfg_.n_kv_heads, cfg_.head_dim);
  KvCache c;
  c.page_size = page_size;
  c.n_pages = n_pages;
  c.k.resize(static_cast<size_t>(cfg_.n_layers));
  c.v.resize(static_cast<size_t>(cfg_.n_layers));
  RecurrentCache& r = c.recurrent;
  r.n_slots = n_state_slots;
  r.tape_rows = tape_rows;
  r.conv.resize(static_cast<size_t>(cfg_.n_layers));
  r.state.resize(static_cast<size_t>(cfg_.n_layers));
  r.tape.resize(static_cast<size_t>(cfg_.n_layers));
  const LinearAttentionConfig& lc = cfg_.linear;
  const int64_t tape_width = lc.conv_dim() + 2 * int64_t{lc.n_v_heads};
  for (int l = 0, a = 0; l < cfg_.n_layers; ++l) {
    if (!cfg_.is_linear_layer(l)) {
      c.k[l] = packed.k[a];
      c.v[l] = packed.v[a++];
      continue;
    }
    r.conv[l] = be_.alloc_f32(n_state_slots, (lc.conv_kernel - 1) * lc.conv_dim());
    r.state[l] = be_.alloc_f32(n_state_slots, int64_t{lc.n_v_heads} * lc.k_dim * lc.v_dim);
    r.tape[l] = be_.alloc_f32(n_state_slots, tape_rows * tape_width);
  }
  return c;
}

int64_t TargetModel::state_slot_bytes(int tape_rows) const {
  if (!cfg_.hybrid()) return 0;
  const LinearAttentionConfig& lc = cfg_.linear;
  const int64_t per_layer = (lc.conv_kernel - 1) * lc.conv_dim() + int64_t{lc.n_v_heads} * lc.k_dim * lc.v_dim +
                            tape_rows * (lc.conv_dim() + 2 * int64_t{lc.n_v_heads});
  int n_linear = 0;
  for (int l = 0; l < cfg_.n_layers; ++l) n_linear += cfg_.is_linear_layer(l);
  return per_layer * n_linear * int64_t{sizeof(float)};
}

void TargetModel::copy_state_slot(KvCache& cache, int32_t from, int32_t to) {
  RecurrentCache& r = cache.recurrent;
  check(from >= 0 && from < r.n_slots && to >= 0 && to < r.n_slots, "state slot copy ", from, " -> ", to,
        " outside 0..", r.n_slots - 1);
  if (from == to) return;
  if (!ranks_) return copy_own_state_slot(cache, from, to);
  ranks_->run([&](int rank) { ranks_->model(rank).copy_state_slot(cache.ranks[static_cast<size_t>(rank - 1)], from, to); },
              [&] { copy_own_state_slot(cache, from, to); });
}

void TargetModel::copy_own_state_slot(KvCache& cache, int32_t from, int32_t to) {
  RecurrentCache& r = cache.recurrent;
  for (std::vector<Tensor>* part : {&r.conv, &r.state}) {
    for (Tensor& t : *part) {
      if (t.empty()) continue;
      Tensor dst = t.slice_rows(to, 1);
      be_.copy_rows(t.slice_rows(from, 1), dst);
    }
  }
}

int64_t TargetModel::weight_bytes_per_step(const std::vector<int>* routed) const {
  int64_t n = tensor_bytes(w_.final_norm) + tensor_bytes(w_.lm_head_part);
  for (size_t l = 0; l < w_.layers.size(); ++l) n += layer_bytes(w_.layers[l], routed ? (*routed)[l] : -1);
  return n;
}

std::vector<int> TargetModel::routed_experts() {
  std::vector<int> distinct(w_.layers.size(), 0);
  for (size_t l = 0; l < w_.layers.size(); ++l) {
    if (expert_rows_[l].empty()) continue;
    for (int32_t rows : be_.ids_to_host(expert_rows_[l])) distinct[l] += rows > 0;
  }
  return distinct;
}

// The rows of normed that logits are asked for; consecutive rows (a decode batch, a verification
// block) are a view: no gather.
static Tensor picked_rows(Backend& be, const Tensor& normed, const std::vector<int32_t>& rows) {
  bool consecutive = !rows.empty() && rows[0] >= 0 && rows.back() < normed.rows;
  for (size_t i = 1; consecutive && i < rows.size(); ++i) consecutive = rows[i] == rows[i - 1] + 1;
  if (consecutive) return normed.slice_rows(rows[0], static_cast<int64_t>(rows.size()));
  Tensor picked = be.alloc(static_cast<int64_t>(rows.size()), normed.cols);
  be.gather_rows(normed, rows, picked);
  return picked;
}

Tensor lm_head_rows(Backend& be, const Tensor& normed, const std::vector<int32_t>& rows, const Tensor& lm_head) {
  const Tensor picked = picked_rows(be, normed, rows);
  Tensor logits = be.alloc(picked.rows, lm_head.rows);
  if (picked.rows > 0) be.matmul(picked, lm_head, nullptr, logits);
  return logits;
}

TargetModel::Output TargetModel::forward(const ForwardBatch& batch, KvCache& cache,
                                         const std::vector<int>& capture_layers, Tensor* argmax, bool logit_parts) {
  check(!logit_parts || splits_vocabulary(), "internal: logits kept in parts without a vocabulary split");
  const Head head = logit_parts ? Head::parts : argmax ? Head::argmax : Head::logits;
  if (!ranks_) return forward_own(batch, cache, capture_layers, head, argmax);
  check(static_cast<int>(cache.ranks.size()) == tensor_parallel() - 1,
        "a tensor-parallel target's forward needs every rank's cache (TargetModel::alloc_cache)");
  Output out;
  // The other ranks compute logits (or argmax candidates) only for their part of the vocabulary;
  // token ids on rank 0's device reach theirs by broadcast.
  ranks_->run(
      [&](int r) {
        TargetModel& m = ranks_->model(r);
        KvCache& c = cache.ranks[static_cast<size_t>(r - 1)];
        const Head own_head = m.splits_vocabulary() ? head : Head::none;
        Tensor ids = argmax && own_head != Head::none ? m.be_.alloc_ids(argmax->rows) : Tensor{};
        Tensor* own_ids = ids.empty() ? nullptr : &ids;
        if (!batch.device_tokens()) {
          m.forward_own(batch, c, capture_layers, own_head, own_ids);
          return;
        }
        ForwardBatch own = batch;
        own.from_device.ids = m.be_.alloc_ids(batch.from_device.ids.rows);
        m.comm_->broadcast(m.be_, own.from_device.ids);
        m.forward_own(own, c, capture_layers, own_head, own_ids);
      },
      [&] {
        if (batch.device_tokens()) {
          Tensor ids = batch.from_device.ids;
          comm_->broadcast(be_, ids);
        }
        out = forward_own(batch, cache, capture_layers, head, argmax);
      });
  return out;
}

bool TargetModel::splits_vocabulary() const { return w_.lm_head_part.rows < cfg_.n_vocab; }

Tensor TargetModel::logits_of(const Tensor& normed, const std::vector<int32_t>& which) {
  if (!splits_vocabulary() || which.empty()) return lm_head_rows(be_, normed, which, w_.lm_head_part);
  const Tensor picked = picked_rows(be_, normed, which);
  Tensor logits = be_.alloc(picked.rows, cfg_.n_vocab);  // every rank's part of the vocabulary, side by side
  comm_->matmul_all_gather(be_, picked, w_.lm_head_part, logits);
  return logits;
}

void TargetModel::argmax_of(const Tensor& normed, const std::vector<int32_t>& which, Tensor& ids) {
  check(ids.rows == static_cast<int64_t>(which.size()), "argmax_of: ", ids.rows, " ids for ", which.size(), " rows");
  if (which.empty()) return;
  if (!splits_vocabulary() || which.size() <= kGatheredMaxRows) {
    const Tensor logits = logits_of(normed, which);
    if (tp_rank_ == 0) be_.argmax_ids(logits, ids);  // the other ranks' ids are not read
    return;
  }
  argmax_of_parts(logits_part(normed, which), ids);
}

Tensor TargetModel::logits_part(const Tensor& normed, const std::vector<int32_t>& rows) {
  const Tensor picked = picked_rows(be_, normed, rows);
  Tensor part = be_.alloc(picked.rows, w_.lm_head_part.rows);
  if (picked.rows > 0) be_.matmul(picked, w_.lm_head_part, nullptr, part);
  return part;
}

void TargetModel::argmax_of_parts(const Tensor& part, Tensor& ids) {
  if (part.rows == 0) return;
  Tensor cand = be_.alloc_f32(part.rows, 2);
  be_.argmax_candidates(part, vocab_first_, cand);
  comm_->argmax_all(be_, cand, ids);
}

std::vector<TopCandidates> TargetModel::top_candidates(const std::vector<int32_t>& rows,
                                                       const std::vector<float>& temperature,
                                                       const std::vector<int32_t>& top_k) {
  check(ranks_ && splits_vocabulary(), "internal: top candidates from parts without a vocabulary split");
  std::vector<std::vector<TopCandidates>> parts(static_cast<size_t>(tensor_parallel()));
  auto own = [&](TargetModel& m) {
    std::vector<TopCandidates> c = m.be_.top_candidates(m.logits_part_, rows, temperature, top_k);
    m.logits_part_ = Tensor{};  // read once: the step's memory is not held past its choice
    for (TopCandidates& r : c)
      for (int32_t& id : r.ids) id += static_cast<int32_t>(m.vocab_first_);
    parts[static_cast<size_t>(m.tp_rank_)] = std::move(c);
  };
  ranks_->run([&](int r) { own(ranks_->model(r)); }, [&] { own(*this); });
  std::vector<TopCandidates> out(rows.size());
  std::vector<TopCandidates> row_parts(parts.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    for (size_t r = 0; r < parts.size(); ++r) row_parts[r] = std::move(parts[r][i]);
    out[i] = merge_top_candidates(row_parts, top_k[i]);
  }
  return out;
}

TargetModel::Output TargetModel::forward_own(const ForwardBatch& batch, KvCache& cache,
                                             const std::vector<int>& capture_layers, Head head, Tensor* argmax) {
  for (int j : capture_layers) check(j >= 0 && j < cfg_.n_layers, "capture layer ", j, " is outside 0..", cfg_.n_layers - 1);
  for (int32_t p : batch.positions) {
    check(p < cfg_.max_positions, "position ", p, " exceeds the model's max_position_embeddings (", cfg_.max_positions, ")");
  }
  check(batch.page_size == cache.page_size, "forward batch page size differs from the cache's");
  const int64_t n = batch.n_rows();
  Output out;
  logits_part_ = Tensor{};  // a part the last step left unread is not kept beside this forward's
  Tensor x = be_.alloc_f32(n, cfg_.n_embd);  // the residual stream, float32
  be_.embed(w_.embed, batch.token_ids, x, batch.device_tokens());
  StackInputs in;
  in.positions = &batch.positions;
  in.kv_slots = &batch.kv_slots;
  in.segments = &batch.segments;
  in.cache = &cache;
  in.expert_rows = &expert_rows_;
  in.comm = comm_;
  if (cfg_.hybrid()) {
    check(batch.recurrent.size() == batch.segments.size(), "a hybrid target's forward needs a state slot per sequence");
    in.recurrent = &batch.recurrent;
  }
  if (!capture_layers.empty()) {
    out.captured = be_.alloc(n, static_cast<int64_t>(capture_layers.size()) * cfg_.n_embd);
    in.capture_layers = &capture_layers;
    in.captured = &out.captured;
  }
  Tensor normed = run_decoder_layers(be_, cfg_, w_.layers, inv_freq_, w_.final_norm, x, in);
  if (head == Head::logits) out.logits = logits_of(normed, batch.logit_rows);
  if (head == Head::argmax) argmax_of(normed, batch.logit_rows, *argmax);
  if (head == Head::parts) {
    logits_part_ = logits_part(normed, batch.logit_rows);
    if (argmax) argmax_of_parts(logits_part_, *argmax);
  }
  captured_ = out.captured;
  return out;
}

}  // namespace dflash
