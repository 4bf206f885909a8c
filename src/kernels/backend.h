// The compute interface that models are written against. A backend owns
// device memory and implements each operation; the CPU backend is the
// reference (fp32), a GPU backend implements the same table.
//
// Conventions: weights are [out_features, in_features] as in Hugging Face;
// activations are [rows, features]; `positions` and `slots` hold one entry per
// row. Operations may run asynchronously; `to_host`/`argmax` synchronize.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <memory>
#include <string>
#include <vector>

#include "formats/safetensors.h"
#include "kernels/tensor.h"
#include "kernels/top_candidates.h"
#include "util/error.h"

namespace dflash {

class GraphPeers;
struct MoeScratch;

// Per-sequence state of Gated DeltaNet layers (Qwen3.5), one slot per running sequence. The state
// of a slot covers its sequence's committed rows; the tape holds the rows of its last forward that
// were not committed (a verification block), to be folded in once the accepted count is known.
struct RecurrentCache {
  int n_slots = 0;
  int tape_rows = 0;          // rows a slot's tape holds (the largest verification block)
  std::vector<Tensor> conv;   // per layer (empty: attention layers): F32 [n_slots, (conv_kernel - 1) * conv_dim]
  std::vector<Tensor> state;  // F32 [n_slots, n_v_heads * k_dim * v_dim], [head][k][v]
  std::vector<Tensor> tape;   // F32 [n_slots, tape_rows * (conv_dim + 2 * n_v_heads)]: rows' [q|k|v, b, a] projections
};

// Keys/values of one decoder stack, paged: physical slot = page * page_size + offset.
struct KvCache {
  int page_size = 0;
  int n_pages = 0;
  std::vector<Tensor> k, v;  // per layer: [n_pages * page_size, n_kv_heads * head_dim] (empty: linear-attention layers)
  RecurrentCache recurrent;  // hybrid models only
  std::vector<KvCache> ranks;  // a tensor-parallel target's ranks 1.. (TargetModel)
};

// One sequence's rows in a Gated DeltaNet call.
struct RecurrentSegment {
  int32_t first_row = 0, n_rows = 0;
  int32_t slot = 0;
  bool fresh = false;   // the sequence's first rows: its state starts from zeros
  int32_t replay = 0;   // first fold this many rows of the slot's tape into its state
  bool commit = true;   // fold this call's rows in too; false: the state stays before them and they go to the tape
};

// A Gated DeltaNet layer's own weights besides its projections.
struct LinearAttentionWeights {
  Tensor conv;     // [conv_dim, conv_kernel]  conv1d.weight, depthwise, causal
  Tensor a_log;    // [1, n_v_heads]  A_log (float32)
  Tensor dt_bias;  // [1, n_v_heads]  (float32)
  Tensor norm;     // [1, v_dim]  the gated RMSNorm's weight (scales by weight)
};

struct LinearAttentionParams {
  int n_k_heads = 0, n_v_heads = 0, k_dim = 0, v_dim = 0, conv_kernel = 0;
  float eps = 0.0f;  // the gated RMSNorm's
  int64_t conv_dim() const { return 2 * int64_t{n_k_heads} * k_dim + int64_t{n_v_heads} * v_dim; }
  int64_t tape_width() const { return conv_dim() + 2 * int64_t{n_v_heads}; }
};

// One sequence's rows in a batched attention call.
struct AttentionSegment {
  int32_t first_row = 0, n_rows = 0;
  int32_t n_keys = 0;                  // keys at logical positions 0..n_keys-1 are in the cache
  const int32_t* page_table = nullptr; // logical page -> physical page
  bool causal = true;                  // false: every query sees every key (DFlash draft block)
  // Launch as if for this many keys (0 or <= n_keys: n_keys), so that one CUDA graph serves the
  // steps while n_keys grows; page_table then covers key_capacity positions.
  int32_t key_capacity = 0;
};

struct AttentionParams {
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;
  int sliding_window = 0;  // 0 = none; else key visible iff q_pos - k_pos < window
  int page_size = 0;
};

// Token ids that live on the device (an I32 tensor of one column, e.g. the draft's argmax): row
// rows[i] of an embedding takes ids[i] instead of its host id, so that a forward can feed the next
// one without a trip to the host.
struct DeviceTokens {
  Tensor ids;
  std::vector<int32_t> rows;
};

// A sum over tensor-parallel ranks that the communicator left to the kernel reading its output
// (Communicator::matmul_all_reduce, ResidualNorm::rank_sum): until then the output holds this
// rank's share only. `exchange` is the backend's own description of where the shares are.
struct RankSum {
  bool deferred = false;
  const void* exchange = nullptr;
};

// The normalized input of a layer's product: with delta, residual_out = residual + delta and
// h = rmsnorm(residual_out) * weight (residual_out must not be residual: a fused product reads
// one while it writes the other); without, h = rmsnorm(residual) * weight.
struct ResidualNorm {
  const Tensor* residual = nullptr;
  const Tensor* delta = nullptr;
  Tensor* residual_out = nullptr;
  const Tensor* weight = nullptr;
  float eps = 0.0f;
  // With delta: residual_out's rows also go here, rounded to the activation type (gather_rows'
  // result; e.g. a column slice of the target's captured layer outputs).
  Tensor* capture = nullptr;
  // delta is a routed MLP's output whose sum the backend deferred (MoeScratch::sum_deferred): it
  // is written first, by the kernel that reads it or by finish_moe_sum.
  MoeScratch* moe_sum = nullptr;
  // delta is this rank's share of a sum over the ranks that the communicator deferred (RankSum):
  // it is summed first, by the kernel that reads it or by finish_rank_sum.
  RankSum* rank_sum = nullptr;
};

// Row groups of a weight: `count` groups of `rows` rows, group g starting at row first + g * step.
struct RowGroups {
  int64_t first = 0, rows = 0, step = 0;
  int count = 0;
};

// The routed MLP of a mixture-of-experts layer (Qwen3-MoE): a router and n_experts SwiGLU
// experts, each kind of weight of every expert stacked in one tensor.
struct MoeWeights {
  Tensor router;   // [n_experts, n_embd]  mlp.gate
  Tensor gate_up;  // [n_experts * 2 * n_ff, n_embd]: expert e's gate_proj rows, then its up_proj rows, from row e * 2 * n_ff
  Tensor down;     // [n_experts * n_embd, n_ff]: expert e's down_proj from row e * n_embd
  int n_experts = 0, top_k = 0, n_ff = 0;
  bool norm_topk_prob = false;
  bool empty() const { return router.empty(); }
};

// Working memory of Backend::moe for up to `rows` rows: act [rows * top_k, n_ff] and y [rows *
// top_k, n_embd] from alloc (a graph's temporaries are not reused within it, so a stack of routed
// layers shares one).
struct MoeScratch {
  Tensor act, y;
  // Set by the caller: the output goes only to the next ResidualNorm (ResidualNorm::moe_sum), so
  // the backend may leave the weighted sum of the experts' outputs to the kernel that reads it.
  bool defer_sum = false;
  // Set by the backend when it did: the output is not written yet; its row t is the sum over
  // j < top_k, in order, of weight_of_pair[t * top_k + j] * y[t * top_k + j].
  bool sum_deferred = false;
  Tensor weight_of_pair;
  int top_k = 0;
};

// Shape of an upload: checkpoint tensors stacked along rows (2-D, same column
// count) or 1-D tensors concatenated into one row. Throws Error naming the
// tensors when they cannot be stacked.
struct UploadShape {
  int64_t rows = 0, cols = 0;
};
UploadShape upload_shape(const std::vector<const TensorInfo*>& parts);

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // Free and total device memory; false when the backend has no such limit (CPU).
  virtual bool memory_info(int64_t& free_bytes, int64_t& total_bytes) { return false; }
  // CUDA graphs: the operations `body` issues are recorded, not run, and
  // replay_graph runs them again with the same inputs and addresses (temporaries
  // of a capture come from an arena shared by all graphs, so a graph's outputs
  // are valid until the next replay of any graph). Not all backends have them.
  virtual bool supports_graphs() const { return false; }
  // share_uploads = false: metadata uploads with equal contents get a copy each (restaging then
  // never finds two that no longer agree).
  virtual std::shared_ptr<void> capture_graph(const std::function<void()>& body, bool share_uploads = true) {
    throw std::logic_error("this backend has no graphs");
  }
  virtual void replay_graph(const std::shared_ptr<void>& graph) {}
  // New batch metadata (token ids, positions, slots, page tables, rows) for a graph's next replay:
  // runs `body` again on the host only (arguments checked, metadata staged, nothing launched).
  // False when body no longer matches the capture (other launch shapes, or two uploads that were
  // equal at capture and shared one copy now differ): capture it again then.
  virtual bool restage_graph(const std::shared_ptr<void>& graph, const std::function<void()>& body) { return false; }
  // Rank 0 of a tensor-parallel group: the other ranks, whose graphs go with this backend's
  // (kernels/communicator.h); null to detach. Backends without graphs ignore it.
  virtual void set_graph_peers(GraphPeers* peers) {}
  // Waits until every queued operation has finished (for timing).
  virtual void synchronize() {}
  // Returns memory cached by the allocator but unused to the device (memory reports).
  virtual void release_cached_memory() {}
  // From now on, the first product of each shape also does, ahead, what the first product of any
  // row count up to max_rows would do (choosing and launching its kernels), so that after a
  // server's warm-up a prompt of a length not seen yet starts as fast as later ones.
  virtual void prepare_products(int64_t max_rows) {}
  // Device-to-device copy bandwidth in GB/s over a `bytes` buffer, counting bytes read plus written.
  virtual double measure_copy_gbps(int64_t bytes) = 0;

  // Memory. Contents of new tensors are unspecified. alloc gives the backend's activation type;
  // alloc_f32 float32, for the residual stream (backends computing in float32 give alloc's).
  virtual Tensor alloc(int64_t rows, int64_t cols) = 0;
  virtual Tensor alloc_f32(int64_t rows, int64_t cols) { return alloc(rows, cols); }
  // Uploads checkpoint tensors stacked along rows (2-D, same column count), or
  // 1-D tensors concatenated into a single row; one tensor gives a plain copy.
  virtual Tensor upload(const std::vector<const TensorInfo*>& parts) = 0;
  virtual Tensor upload_host(const float* data, int64_t rows, int64_t cols) = 0;
  virtual Tensor upload_host_f32(const float* data, int64_t rows, int64_t cols) { return upload_host(data, rows, cols); }
  virtual std::vector<float> to_host(const Tensor& t) = 0;
  virtual KvCache alloc_kv(int n_layers, int n_pages, int page_size, int n_kv_heads, int head_dim) = 0;

  // Fills t with uniform random values in [-scale, scale) (benchmarks: caches that are not all zeros).
  virtual void fill_random(Tensor& t, uint64_t seed, float scale) = 0;

  // out[r] = table[ids[r]], where rows listed in `from_device` take their ids from it instead.
  // Device ids outside the table (only a bug could make them) read row 0.
  virtual void embed(const Tensor& table, const std::vector<int32_t>& ids, Tensor& out,
                     const DeviceTokens* from_device = nullptr) = 0;
  // out = x * w^T (+ bias broadcast over rows)
  virtual void matmul(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out) = 0;
  // out = rmsnorm(x) * weight, per row
  virtual void rms_norm(const Tensor& x, const Tensor& weight, float eps, Tensor& out) = 0;
  // residual_out = residual + delta; out = rmsnorm(residual_out) * weight (residual_out may be residual)
  virtual void add_rms_norm(const Tensor& residual, const Tensor& delta, Tensor& residual_out, const Tensor& weight,
                            float eps, Tensor& out) = 0;
  // In place on x [rows, n_heads*head_dim]: optional per-head RMSNorm (norm_weight
  // may be null), then rotate-half RoPE with angle position * inv_freq[i].
  virtual void head_norm_rope(Tensor& x, int n_heads, int head_dim, const Tensor* norm_weight, float eps,
                              const std::vector<int32_t>& positions, const std::vector<float>& inv_freq) = 0;
  // out = silu(gate_up[:, :n]) * gate_up[:, n:], n = out.cols
  virtual void swiglu(const Tensor& gate_up, Tensor& out) = 0;
  // The MLP's first half: out = swiglu(x * w^T + bias), w = [gate; up]. `gate_up` is scratch of
  // [x.rows, w.rows] that a backend may skip; a fused form may keep gate and up in float32
  // (no rounding to the activation type in between).
  virtual void matmul_swiglu(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& gate_up, Tensor& out) {
    matmul(x, w, bias, gate_up);
    swiglu(gate_up, out);
  }
  // A product whose input is normalized from the residual stream: h = norm_in(n) (below), then
  // out = h * w^T + bias, or, with gate_up scratch, out = the MLP's first half (matmul_swiglu).
  // A backend may fuse the steps (then h is not written); the result must be bit-identical.
  virtual void norm_matmul(const ResidualNorm& n, Tensor& h, const Tensor& w, const Tensor* bias, Tensor& out,
                           Tensor* gate_up = nullptr) {
    norm_in(n, h);
    if (gate_up) matmul_swiglu(h, w, bias, *gate_up, out);
    else matmul(h, w, bias, out);
  }
  virtual void norm_in(const ResidualNorm& n, Tensor& h) {
    finish_pending_sum(n);
    if (n.delta) {
      add_rms_norm(*n.residual, *n.delta, *n.residual_out, *n.weight, n.eps, h);
      if (n.capture) capture_rows(*n.residual_out, *n.capture);
    } else {
      rms_norm(*n.residual, *n.weight, n.eps, h);
    }
  }
  // out = src rows 0, 1, ... (gather_rows of every row)
  void capture_rows(const Tensor& src, Tensor& out) {
    std::vector<int32_t> rows(static_cast<size_t>(src.rows));
    for (size_t r = 0; r < rows.size(); ++r) rows[r] = static_cast<int32_t>(r);
    gather_rows(src, rows, out);
  }
  // cache rows slots[r] <- k[r], v[r]
  virtual void kv_write(const Tensor& k, const Tensor& v, Tensor& k_cache, Tensor& v_cache,
                        const std::vector<int32_t>& slots) = 0;
  // A layer's attention inputs from qkv = [q heads | k heads | v heads]: q and k
  // get head_norm_rope in place, then k and v go to cache rows slots[r]. Backends
  // may fuse the three steps; the result must be bit-identical to them.
  virtual void qkv_rope_kv_write(Tensor& qkv, int n_heads, int n_kv_heads, int head_dim, const Tensor* q_norm,
                                 const Tensor* k_norm, float eps, const std::vector<int32_t>& positions,
                                 const std::vector<float>& inv_freq, Tensor& k_cache, Tensor& v_cache,
                                 const std::vector<int32_t>& slots) {
    const int64_t q_dim = int64_t{n_heads} * head_dim, kv_dim = int64_t{n_kv_heads} * head_dim;
    Tensor q = qkv.slice_cols(0, q_dim), k = qkv.slice_cols(q_dim, kv_dim), v = qkv.slice_cols(q_dim + kv_dim, kv_dim);
    head_norm_rope(q, n_heads, head_dim, q_norm, eps, positions, inv_freq);
    head_norm_rope(k, n_kv_heads, head_dim, k_norm, eps, positions, inv_freq);
    kv_write(k, v, k_cache, v_cache, slots);
  }
  // out[:, g * groups.rows + j] = x * w[groups.first + g * groups.step + j]^T: the products of
  // several row groups of one weight at once (the draft's k/v rows of every layer, which lie in
  // one allocation of its q/k/v weights).
  virtual void matmul_row_groups(const Tensor& x, const Tensor& w, const RowGroups& groups, Tensor& out) {
    check_row_groups(x, w, groups, out);
    for (int g = 0; g < groups.count; ++g) {
      Tensor og = out.slice_cols(g * groups.rows, groups.rows);
      matmul(x, w.slice_rows(groups.first + g * groups.step, groups.rows), nullptr, og);
    }
  }
  // Several layers' k/v rows: kv = [k | v] of layer 0, [k | v] of layer 1, ... (as many as k_caches):
  // per layer, qkv_rope_kv_write with no query heads (k_norms[l] may be null) into its cache.
  virtual void kv_rope_write_layers(Tensor& kv, int n_kv_heads, int head_dim, const std::vector<const Tensor*>& k_norms,
                                    float eps, const std::vector<int32_t>& positions, const std::vector<float>& inv_freq,
                                    std::vector<Tensor>& k_caches, std::vector<Tensor>& v_caches,
                                    const std::vector<int32_t>& slots) {
    const int64_t width = int64_t{2} * n_kv_heads * head_dim;
    check_kv_layers(kv, width, k_norms, k_caches, v_caches);
    for (size_t l = 0; l < k_caches.size(); ++l) {
      Tensor layer = kv.slice_cols(static_cast<int64_t>(l) * width, width);
      qkv_rope_kv_write(layer, 0, n_kv_heads, head_dim, nullptr, k_norms[l], eps, positions, inv_freq, k_caches[l],
                        v_caches[l], slots);
    }
  }
  // out[r] = softmax(q[r] K^T / sqrt(d)) V over the keys each segment allows.
  virtual void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                         const std::vector<AttentionSegment>& segments, const std::vector<int32_t>& positions,
                         const AttentionParams& params, Tensor& out) = 0;
  // A layer's attention straight from its q/k/v product: qkv_rope_kv_write then attention of
  // qkv's query heads into out. Each segment's rows must be its last n_rows keys (positions
  // n_keys - n_rows, ..., n_keys - 1, slots[r] their cache rows). Backends may fuse the steps
  // (the result must be bit-identical to them); qkv's contents are unspecified afterwards.
  virtual void qkv_attention(Tensor& qkv, const Tensor* q_norm, const Tensor* k_norm, float eps,
                             const std::vector<float>& inv_freq, const std::vector<int32_t>& slots, Tensor& k_cache,
                             Tensor& v_cache, const std::vector<AttentionSegment>& segments,
                             const std::vector<int32_t>& positions, const AttentionParams& p, Tensor& out) {
    qkv_rope_kv_write(qkv, p.n_heads, p.n_kv_heads, p.head_dim, q_norm, k_norm, eps, positions, inv_freq, k_cache,
                      v_cache, slots);
    attention(qkv.slice_cols(0, int64_t{p.n_heads} * p.head_dim), k_cache, v_cache, segments, positions, p, out);
  }
  // The routed MLP, per row r of x (its normalized input): p = softmax(x[r] * router^T) in float32
  // (the router's logits rounded to the activation type first); its top_k experts (larger p first,
  // the lower index on ties) with weights p, divided by their sum with norm_topk_prob; then
  // out[r] = sum over those experts in increasing expert index of weight * down_e(swiglu(gate_up_e(x[r]))).
  // A row's result never depends on the other rows of the call. expert_rows (optional, I32
  // [n_experts, 1]) receives how many rows each expert was given. scratch (optional, see
  // MoeScratch) is working memory a caller running many layers allocates once.
  virtual void moe(const Tensor& x, const MoeWeights& w, Tensor& out, Tensor* expert_rows = nullptr,
                   MoeScratch* scratch = nullptr) = 0;
  // The routed MLP of a normalized input: h = norm_in(n), then moe(h, ...). A backend may fuse
  // the steps; h is written either way, and the result must be bit-identical.
  virtual void norm_moe(const ResidualNorm& n, Tensor& h, const MoeWeights& w, Tensor& out,
                        Tensor* expert_rows = nullptr, MoeScratch* scratch = nullptr) {
    norm_in(n, h);
    moe(h, w, out, expert_rows, scratch);
  }
  // Writes out = the sum that moe left deferred in s (MoeScratch::sum_deferred), which it clears.
  // Only backends that defer it implement this.
  virtual void finish_moe_sum(MoeScratch& s, const Tensor& /*out*/) {
    s.sum_deferred = false;
    throw std::logic_error("finish_moe_sum: this backend never defers a routed MLP's sum");
  }
  // Writes out = the sum over the ranks that a communicator left deferred in s (RankSum), which
  // it clears. Only backends whose communicators defer it implement this.
  virtual void finish_rank_sum(RankSum& s, const Tensor& /*out*/) {
    s.deferred = false;
    throw std::logic_error("finish_rank_sum: no communicator of this backend defers a sum over ranks");
  }
  // n's delta written, when it is a routed MLP's output or a sum over ranks that is still deferred.
  void finish_pending_sum(const ResidualNorm& n) {
    if (n.moe_sum && n.moe_sum->sum_deferred) finish_moe_sum(*n.moe_sum, *n.delta);
    if (n.rank_sum && n.rank_sum->deferred) finish_rank_sum(*n.rank_sum, *n.delta);
  }
  // Qwen3.5's Gated DeltaNet over proj = [q|k|v (conv_dim) | z (value_dim) | b (n_v) | a (n_v)] per
  // row (the layer's input projections), per segment on its slot of `cache` (layer `layer`):
  // fresh zeroes the slot; replay folds that many tape rows in; then each row r: the causal
  // depthwise convolution of q|k|v over the previous conv_kernel - 1 rows, SiLU, q and k
  // L2-normalized (q also scaled by k_dim^-1/2), beta = sigmoid(b), g = -exp(A_log) *
  // softplus(a + dt_bias); per value head h (key head h / (n_v / n_k)): S = exp(g) S,
  // S += k (beta (v - S^T k))^T, o = S^T q; out[r] = rmsnorm(o) * norm * silu(z) per head.
  // commit=false leaves the slot as it was after the replay and puts the rows on its tape.
  // scratch (optional): F32 working memory of proj.rows + segments * tape_rows rows of
  // tape_width() columns, which a caller running many layers allocates once.
  virtual bool has_gated_delta_net() const { return false; }
  virtual void gated_delta_net(const Tensor& proj, const LinearAttentionWeights& w, const LinearAttentionParams& p,
                               RecurrentCache& cache, int layer, const std::vector<RecurrentSegment>& segments,
                               Tensor& out, Tensor* scratch = nullptr) {
    throw Error(name() + " backend: Gated DeltaNet (Qwen3.5) layers are not implemented");
  }
  // x *= sigmoid(gate), elementwise (gated attention output).
  virtual void sigmoid_mul(Tensor& x, const Tensor& gate) {
    throw Error(name() + " backend: gated attention (Qwen3.5) is not implemented");
  }
  // acc[r] += sigmoid(gate[r]) * y[r], gate [rows, 1] (Qwen3.5-MoE's shared expert).
  virtual void add_sigmoid_scaled(Tensor& acc, const Tensor& y, const Tensor& gate) {
    throw Error(name() + " backend: shared experts (Qwen3.5-MoE) are not implemented");
  }
  // out[i] = src[rows[i]]  (out may be a column slice of a wider tensor)
  virtual void gather_rows(const Tensor& src, const std::vector<int32_t>& rows, Tensor& out) = 0;
  // dst = src, element for element (same dtype and shape; strides may differ). Not inside graphs.
  virtual void copy_rows(const Tensor& src, Tensor& dst) = 0;
  // Index of the largest value per row (first on ties).
  virtual std::vector<int32_t> argmax_rows(const Tensor& x) = 0;
  // Token ids on the device: alloc_ids gives an I32 tensor [n, 1]; argmax_ids queues
  // ids[r] = argmax_rows(x)[r] (no synchronization: capturable); ids_to_host copies them back.
  virtual Tensor alloc_ids(int64_t n) = 0;
  virtual void argmax_ids(const Tensor& x, Tensor& ids) = 0;
  // The argmax of rows split by columns (a vocabulary split over tensor-parallel ranks), in two
  // halves. argmax_candidates: row r of cand (F32 [x.rows, 2]) = (the largest value of x's row r,
  // first_id + its column) as argmax_ids picks it, or (NaN, 0) where argmax_ids would fall back to
  // column 0 for want of a value. argmax_of_candidates: ids[r] = the id that argmax_ids of the whole
  // row gives, from row r of `all` (F32 [rows, 2 n]: every part's candidates side by side, parts in
  // column order). Ids are exact in float32 (below 2^24).
  virtual void argmax_candidates(const Tensor& x, int64_t first_id, Tensor& cand) = 0;
  virtual void argmax_of_candidates(const Tensor& all, Tensor& ids) = 0;
  virtual std::vector<int32_t> ids_to_host(const Tensor& ids) = 0;
  // Per listed row i of `logits`: select_top_candidates(row rows[i], temperature[i] (> 0),
  // top_k[i]) (kernels/top_candidates.h). Checks the arguments, then select_candidates.
  std::vector<TopCandidates> top_candidates(const Tensor& logits, const std::vector<int32_t>& rows,
                                            const std::vector<float>& temperature, const std::vector<int32_t>& top_k);

 protected:
  // Argument checks of matmul_row_groups and kv_rope_write_layers (Error naming the mismatch).
  static void check_row_groups(const Tensor& x, const Tensor& w, const RowGroups& groups, const Tensor& out);
  static void check_moe(const Tensor& x, const MoeWeights& w, const Tensor& out, const Tensor* expert_rows);
  static void check_kv_layers(const Tensor& kv, int64_t width, const std::vector<const Tensor*>& k_norms,
                              const std::vector<Tensor>& k_caches, const std::vector<Tensor>& v_caches);
  // top_candidates for checked, non-empty arguments. This one copies the rows to the host and
  // selects there.
  virtual std::vector<TopCandidates> select_candidates(const Tensor& logits, const std::vector<int32_t>& rows,
                                                       const std::vector<float>& temperature,
                                                       const std::vector<int32_t>& top_k);
};

struct BackendOptions {
  // Every row's result independent of the rows batched with it, at some cost (the CUDA backend
  // then runs products of more than 32 rows as 32-row slices of its skinny kernel, reading the
  // weights once per slice, instead of through cuBLASLt). The CPU backend always is.
  bool batch_invariant = false;
  int device = 0;  // the GPU (CUDA backend)
};

std::unique_ptr<Backend> make_cpu_backend(const BackendOptions& = {});
// Throws Error when this build has no CUDA backend or no GPU is present.
std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& = {});
int cuda_device_count();  // 0 in builds without CUDA

}  // namespace dflash
