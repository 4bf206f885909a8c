#include "model/decoder_layers.h"

#include <cstring>
#include <utility>

#include "util/error.h"

namespace dflash {


// A 3-D checkpoint tensor [n, rows, cols] seen as the 2-D [n * rows, cols] it is in memory.
static TensorInfo flattened(const TensorInfo& t) {
  TensorInfo f = t;
  f.shape = {t.shape[0] * t.shape[1], t.shape[2]};
  return f;
}

TensorInfo row_slice(const TensorInfo& t, int64_t first, int64_t n) {
  TensorInfo f = t;
  const size_t row_bytes = static_cast<size_t>(t.shape[1]) * dtype_size(t.dtype);
  f.data = t.data + static_cast<size_t>(first) * row_bytes;
  f.shape = {n, t.shape[1]};
  f.n_bytes = static_cast<size_t>(n) * row_bytes;
  return f;
}

// Columns first..first+n of every row of a 2-D checkpoint tensor (or elements of a 1-D one),
// copied into a buffer that `keep` owns.
static TensorInfo col_slice(const TensorInfo& t, int64_t first, int64_t n, std::vector<std::vector<uint8_t>>& keep) {
  const size_t elt = dtype_size(t.dtype);
  const int64_t rows = t.shape.size() == 2 ? t.shape[0] : 1, cols = t.shape.back();
  auto& buf = keep.emplace_back(static_cast<size_t>(rows * n) * elt);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(buf.data() + static_cast<size_t>(r * n) * elt, t.data + static_cast<size_t>(r * cols + first) * elt,
                static_cast<size_t>(n) * elt);
  TensorInfo f = t;
  f.data = buf.data();
  f.shape = t.shape.size() == 2 ? std::vector<int64_t>{rows, n} : std::vector<int64_t>{n};
  f.n_bytes = buf.size();
  return f;
}

// A 1-D checkpoint tensor as float32 on the device.
static Tensor upload_f32(Backend& be, const TensorInfo& t) {
  std::vector<float> w(static_cast<size_t>(t.n_elements()));
  convert_to_f32(t.dtype, t.data, w.data(), w.size());
  return be.upload_host_f32(w.data(), 1, static_cast<int64_t>(w.size()));
}

// Qwen3.5's zero-centred norms scale by 1 + weight: added in float32 as transformers does, then
// held in the activation type (exact on the CPU; rounded to bf16 on the GPU, whose norm kernels
// read bf16 weights).
Tensor load_norm(Backend& be, const TensorStore& s, const ModelConfig& c, const std::string& name, int64_t n) {
  const TensorInfo& t = s.get(name, {n});
  if (!c.zero_centred_norms) return be.upload({&t});
  std::vector<float> w(static_cast<size_t>(n));
  convert_to_f32(t.dtype, t.data, w.data(), w.size());
  for (float& x : w) x += 1.0f;
  return be.upload_host(w.data(), 1, n);
}

namespace {
// The rank's share of n things (heads, features): [first, first + count); all of them unsharded.
struct Share {
  int64_t first, count;
};
}  // namespace

static Share share_of(int64_t n, const TpRank& tp) { return {tp.rank * (n / tp.size), n / tp.size}; }

// A rank's KV heads: its share, or with fewer KV heads than ranks the one its query heads read
// (replicated on size / n ranks; shard_config).
static Share kv_share_of(int64_t n, const TpRank& tp) {
  if (n % tp.size == 0) return share_of(n, tp);
  return {tp.rank / (tp.size / n), 1};
}

// Rows [sh.first, sh.first + sh.count) times `unit` of a 2-D checkpoint tensor.
static TensorInfo rows_of(const TensorInfo& t, Share sh, int64_t unit = 1) {
  return row_slice(t, sh.first * unit, sh.count * unit);
}

// Columns [sh.first, sh.first + sh.count) of a 2-D tensor (elements of a 1-D one); the tensor
// itself when that is all of them, else a copy that `keep` owns.
static TensorInfo cols_of(const TensorInfo& t, Share sh, std::vector<std::vector<uint8_t>>& keep) {
  return sh.first == 0 && sh.count == t.shape.back() ? t : col_slice(t, sh.first, sh.count, keep);
}

std::vector<TensorInfo> qkv_parts(const TensorStore& s, const ModelConfig& c, const std::string& prefix, int i,
                                  const TpRank& tp) {
  const std::string p = cat(prefix, "layers.", i, ".");
  const int64_t h = c.n_embd, d = c.head_dim, q_dim = int64_t{c.n_heads} * d, kv_dim = int64_t{c.n_kv_heads} * d;
  const Share heads = share_of(c.n_heads, tp), kv = kv_share_of(c.n_kv_heads, tp);
  return {rows_of(s.get(p + "self_attn.q_proj.weight", {q_dim, h}), heads, d),
          rows_of(s.get(p + "self_attn.k_proj.weight", {kv_dim, h}), kv, d),
          rows_of(s.get(p + "self_attn.v_proj.weight", {kv_dim, h}), kv, d)};
}

// Uploads parts held by value, in order.
static Tensor upload_all(Backend& be, const std::vector<TensorInfo>& parts) {
  std::vector<const TensorInfo*> ptrs;
  for (const TensorInfo& t : parts) ptrs.push_back(&t);
  return be.upload(ptrs);
}

// The attention: q/k/v rows of the rank's heads (Qwen3.5's gated attention: q_proj holds
// [query | gate] per head; the q/k/v weight takes the query rows, k_proj, v_proj, then the gate
// rows, so that q, k, v lie where attention expects them), o_proj's columns of those heads, q/k
// norms; the output bias on rank 0 only (the ranks' outputs are summed).
static void load_attention(Backend& be, const TensorStore& s, const ModelConfig& c, const std::string& p,
                           const TpRank& tp, const Tensor* qkv, LayerWeights& w) {
  const int64_t h = c.n_embd, d = c.head_dim, q_dim = int64_t{c.n_heads} * d, kv_dim = int64_t{c.n_kv_heads} * d;
  const Share heads = share_of(c.n_heads, tp), kv = kv_share_of(c.n_kv_heads, tp);
  std::vector<std::vector<uint8_t>> keep;
  const TensorInfo& k = s.get(p + "self_attn.k_proj.weight", {kv_dim, h});
  const TensorInfo& v = s.get(p + "self_attn.v_proj.weight", {kv_dim, h});
  if (c.attn_output_gate) {
    const TensorInfo& q = s.get(p + "self_attn.q_proj.weight", {2 * q_dim, h});
    std::vector<TensorInfo> parts;
    for (int64_t head = heads.first; head < heads.first + heads.count; ++head) parts.push_back(row_slice(q, 2 * head * d, d));
    parts.push_back(rows_of(k, kv, d));
    parts.push_back(rows_of(v, kv, d));
    for (int64_t head = heads.first; head < heads.first + heads.count; ++head)
      parts.push_back(row_slice(q, (2 * head + 1) * d, d));
    w.qkv = upload_all(be, parts);
  } else {
    const TensorInfo& q = s.get(p + "self_attn.q_proj.weight", {q_dim, h});
    w.qkv = qkv ? *qkv : upload_all(be, {rows_of(q, heads, d), rows_of(k, kv, d), rows_of(v, kv, d)});
  }
  w.o = upload_all(be, {cols_of(s.get(p + "self_attn.o_proj.weight", {h, q_dim}), {heads.first * d, heads.count * d}, keep)});
  if (c.attention_bias) {
    w.qkv_bias = upload_all(be, {cols_of(s.get(p + "self_attn.q_proj.bias", {q_dim}), {heads.first * d, heads.count * d}, keep),
                                 cols_of(s.get(p + "self_attn.k_proj.bias", {kv_dim}), {kv.first * d, kv.count * d}, keep),
                                 cols_of(s.get(p + "self_attn.v_proj.bias", {kv_dim}), {kv.first * d, kv.count * d}, keep)});
    if (tp.rank == 0) w.o_bias = be.upload({&s.get(p + "self_attn.o_proj.bias", {h})});
  }
  if (c.qk_norm) {
    w.q_norm = load_norm(be, s, c, p + "self_attn.q_norm.weight", c.head_dim);
    w.k_norm = load_norm(be, s, c, p + "self_attn.k_norm.weight", c.head_dim);
  }
}

// Qwen3-Next's fused projections in Qwen3.5's order [q | k | v | z | b | a] (each part all heads,
// head-major), for key heads kh (and their value heads). in_proj_qkvz holds per key head g its q
// (k_dim rows), k (k_dim), then v and z of its r = n_v_heads / n_k_heads value heads (r * v_dim rows
// each); in_proj_ba per key head the b rows of its value heads, then their a rows.
static std::vector<TensorInfo> fused_linear_in(const TensorInfo& qkvz, const TensorInfo& ba,
                                               const LinearAttentionConfig& l, Share kh) {
  const int64_t dk = l.k_dim, r = l.n_v_heads / l.n_k_heads, rv = r * l.v_dim;
  const int64_t group = 2 * dk + 2 * rv;
  // Part by part: (tensor, rows of a key head's group, offset in the group, rows).
  const struct { const TensorInfo* t; int64_t group, offset, rows; } parts[] = {
      {&qkvz, group, 0, dk}, {&qkvz, group, dk, dk}, {&qkvz, group, 2 * dk, rv},
      {&qkvz, group, 2 * dk + rv, rv}, {&ba, 2 * r, 0, r}, {&ba, 2 * r, r, r}};
  std::vector<TensorInfo> slices;
  for (const auto& part : parts)
    for (int64_t g = kh.first; g < kh.first + kh.count; ++g)
      slices.push_back(row_slice(*part.t, g * part.group + part.offset, part.rows));
  return slices;
}

// Qwen3.5's Gated DeltaNet for the rank's key heads and their value heads: the input projections
// as one weight, their convolution channels, gates, the norm, out_proj's columns.
static void load_linear_attention(Backend& be, const TensorStore& s, const ModelConfig& c, const std::string& p,
                                  const TpRank& tp, LayerWeights& w) {
  const LinearAttentionConfig& l = c.linear;
  const int64_t h = c.n_embd, conv_dim = l.conv_dim(), key_dim = l.key_dim(), value_dim = l.value_dim();
  const int64_t nv = l.n_v_heads, dk = l.k_dim, dv = l.v_dim;
  const Share kh = share_of(l.n_k_heads, tp), vh = share_of(nv, tp);
  std::vector<std::vector<uint8_t>> keep;
  const std::string a = p + "linear_attn.";
  // Channel rows of [q | k | v] (in_proj_qkv, conv1d) that the rank's heads read.
  auto channels = [&](const TensorInfo& t) {
    return std::vector<TensorInfo>{row_slice(t, kh.first * dk, kh.count * dk),
                                   row_slice(t, key_dim + kh.first * dk, kh.count * dk),
                                   row_slice(t, 2 * key_dim + vh.first * dv, vh.count * dv)};
  };
  if (s.find(a + "in_proj_qkvz.weight")) {
    w.linear_in = upload_all(be, fused_linear_in(s.get(a + "in_proj_qkvz.weight", {conv_dim + value_dim, h}),
                                                 s.get(a + "in_proj_ba.weight", {2 * nv, h}), l, kh));
  } else {
    std::vector<TensorInfo> parts = channels(s.get(a + "in_proj_qkv.weight", {conv_dim, h}));
    parts.push_back(rows_of(s.get(a + "in_proj_z.weight", {value_dim, h}), vh, dv));
    parts.push_back(rows_of(s.get(a + "in_proj_b.weight", {nv, h}), vh));
    parts.push_back(rows_of(s.get(a + "in_proj_a.weight", {nv, h}), vh));
    w.linear_in = upload_all(be, parts);
  }
  w.linear.conv = upload_all(be, channels(flattened(s.get(a + "conv1d.weight", {conv_dim, 1, l.conv_kernel}))));
  w.linear.a_log = upload_f32(be, cols_of(s.get(a + "A_log", {nv}), vh, keep));
  w.linear.dt_bias = upload_f32(be, cols_of(s.get(a + "dt_bias", {nv}), vh, keep));
  w.linear.norm = be.upload({&s.get(a + "norm.weight", {l.v_dim})});
  w.linear_out = upload_all(be, {cols_of(s.get(a + "out_proj.weight", {h, value_dim}), {vh.first * dv, vh.count * dv}, keep)});
}

// A SwiGLU MLP `p` (gate_proj, up_proj, down_proj) of n_ff features: the rank's features' gate/up
// rows and down columns.
static void load_swiglu(Backend& be, const TensorStore& s, const std::string& p, int64_t h, int64_t n_ff,
                        const TpRank& tp, Tensor& gate_up, Tensor& down) {
  const Share f = share_of(n_ff, tp);
  std::vector<std::vector<uint8_t>> keep;
  gate_up = upload_all(be, {rows_of(s.get(p + "gate_proj.weight", {n_ff, h}), f),
                            rows_of(s.get(p + "up_proj.weight", {n_ff, h}), f)});
  down = upload_all(be, {cols_of(s.get(p + "down_proj.weight", {h, n_ff}), f, keep)});
}

// A routed MLP: the router and every expert's weights (the rank's share of each expert's
// features), each kind stacked in one upload. Reads the hub's layout
// (mlp.experts.E.{gate,up,down}_proj.weight) and the stacked one transformers 5 keeps in memory
// (mlp.experts.gate_up_proj [E, 2 * ff, h], mlp.experts.down_proj [E, h, ff]).
static MoeWeights load_moe(Backend& be, const TensorStore& s, const ModelConfig& c, const std::string& p,
                           const TpRank& tp) {
  const MoeConfig& m = c.moe;
  const int64_t h = c.n_embd, ff = m.n_ff;
  const Share f = share_of(ff, tp);
  MoeWeights w;
  w.n_experts = m.n_experts;
  w.top_k = m.top_k;
  w.n_ff = static_cast<int>(f.count);
  w.norm_topk_prob = m.norm_topk_prob;
  w.router = be.upload({&s.get(p + "gate.weight", {m.n_experts, h})});
  std::vector<std::vector<uint8_t>> keep;
  std::vector<TensorInfo> gate_up, down;
  if (s.find(p + "experts.gate_up_proj")) {
    const TensorInfo all_gate_up = flattened(s.get(p + "experts.gate_up_proj", {m.n_experts, 2 * ff, h}));
    const TensorInfo all_down = flattened(s.get(p + "experts.down_proj", {m.n_experts, h, ff}));
    if (!tp.sharded()) {
      w.gate_up = be.upload({&all_gate_up});
      w.down = be.upload({&all_down});
      return w;
    }
    for (int64_t e = 0; e < m.n_experts; ++e) {
      gate_up.push_back(row_slice(all_gate_up, e * 2 * ff + f.first, f.count));
      gate_up.push_back(row_slice(all_gate_up, e * 2 * ff + ff + f.first, f.count));
      down.push_back(cols_of(row_slice(all_down, e * h, h), f, keep));
    }
  } else {
    for (int e = 0; e < m.n_experts; ++e) {
      const std::string ep = cat(p, "experts.", e, ".");
      gate_up.push_back(rows_of(s.get(ep + "gate_proj.weight", {ff, h}), f));
      gate_up.push_back(rows_of(s.get(ep + "up_proj.weight", {ff, h}), f));
      down.push_back(cols_of(s.get(ep + "down_proj.weight", {h, ff}), f, keep));
    }
  }
  w.gate_up = upload_all(be, gate_up);
  w.down = upload_all(be, down);
  return w;
}

LayerWeights load_layer(Backend& be, const TensorStore& s, const ModelConfig& c, const std::string& prefix, int i,
                        const Tensor* qkv, const TpRank& tp) {
  const std::string p = cat(prefix, "layers.", i, ".");
  const int64_t h = c.n_embd;
  if (tp.sharded()) (void)shard_config(c, tp, p);  // the shapes divide
  LayerWeights w;
  w.attn_norm = load_norm(be, s, c, p + "input_layernorm.weight", h);
  w.mlp_norm = load_norm(be, s, c, p + "post_attention_layernorm.weight", h);
  if (c.is_linear_layer(i)) load_linear_attention(be, s, c, p, tp, w);
  else load_attention(be, s, c, p, tp, qkv, w);
  if (!c.is_moe_layer(i)) {
    load_swiglu(be, s, p + "mlp.", h, c.n_ff, tp, w.gate_up, w.down);
    if (c.mlp_bias) {
      const Share f = share_of(c.n_ff, tp);
      std::vector<std::vector<uint8_t>> keep;
      w.gate_up_bias = upload_all(be, {cols_of(s.get(p + "mlp.gate_proj.bias", {c.n_ff}), f, keep),
                                       cols_of(s.get(p + "mlp.up_proj.bias", {c.n_ff}), f, keep)});
      if (tp.rank == 0) w.down_bias = be.upload({&s.get(p + "mlp.down_proj.bias", {h})});
    }
    return w;
  }
  w.moe = load_moe(be, s, c, p + "mlp.", tp);
  if (c.moe.shared_n_ff == 0) return w;  // Qwen3-MoE has none, Qwen3-Next may have none
  load_swiglu(be, s, p + "mlp.shared_expert.", h, c.moe.shared_n_ff, tp, w.shared_gate_up, w.shared_down);
  w.shared_gate = be.upload({&s.get(p + "mlp.shared_expert_gate.weight", {1, h})});
  return w;
}

int64_t layer_bytes(const LayerWeights& w, int routed_experts) {
  int64_t n = 0;
  for (const Tensor* t : {&w.attn_norm, &w.qkv, &w.qkv_bias, &w.q_norm, &w.k_norm, &w.o, &w.o_bias, &w.mlp_norm,
                          &w.gate_up, &w.gate_up_bias, &w.down, &w.down_bias, &w.moe.router, &w.linear_in,
                          &w.linear.conv, &w.linear.a_log, &w.linear.dt_bias, &w.linear.norm, &w.linear_out,
                          &w.shared_gate_up, &w.shared_down, &w.shared_gate})
    n += tensor_bytes(*t);
  if (!w.moe.empty()) {
    const int64_t experts = tensor_bytes(w.moe.gate_up) + tensor_bytes(w.moe.down);
    n += routed_experts < 0 ? experts : experts / w.moe.n_experts * routed_experts;
  }
  return n;
}

static const Tensor* opt(const Tensor& t) { return t.empty() ? nullptr : &t; }

// Scratch of the layer kinds a stack holds, sized for its rows.
struct StackScratch {
  Tensor h, qkv, attn, delta, gate_up, act;
  Tensor proj, core, gdn;                    // Gated DeltaNet layers
  Tensor shared_gate_up, shared_act, shared_y, shared_gate;  // shared experts
  MoeScratch moe;
};

static StackScratch stack_scratch(Backend& be, const ModelConfig& c, const std::vector<LayerWeights>& layers,
                                  const StackInputs& in, int64_t n) {
  const int64_t q_dim = int64_t{c.n_heads} * c.head_dim, kv_dim = int64_t{c.n_kv_heads} * c.head_dim;
  bool attention = false, linear = false, dense = false, shared = false;
  for (const LayerWeights& w : layers) {
    attention = attention || !w.qkv.empty();
    linear = linear || w.is_linear();
    dense = dense || w.moe.empty();
    shared = shared || !w.shared_gate.empty();
  }
  StackScratch t;
  t.h = be.alloc(n, c.n_embd);
  t.delta = be.alloc(n, c.n_embd);
  if (attention) {
    t.qkv = be.alloc(n, q_dim + 2 * kv_dim + (c.attn_output_gate ? q_dim : 0));
    t.attn = be.alloc(n, q_dim);
  }
  if (linear) {
    const LinearAttentionConfig& l = c.linear;
    t.proj = be.alloc(n, l.conv_dim() + l.value_dim() + 2 * l.n_v_heads);
    t.core = be.alloc(n, l.value_dim());
    if (in.recurrent && in.cache)
      t.gdn = be.alloc_f32(n + static_cast<int64_t>(in.recurrent->size()) * in.cache->recurrent.tape_rows,
                           l.conv_dim() + 2 * l.n_v_heads);
  }
  if (dense) {  // dense layers' MLP scratch (a stack of routed layers only has none)
    t.gate_up = be.alloc(n, 2 * int64_t{c.n_ff});
    t.act = be.alloc(n, c.n_ff);
  }
  if (!c.moe_layer.empty()) {
    t.moe.act = be.alloc(n * c.moe.top_k, c.moe.n_ff);
    t.moe.y = be.alloc(n * c.moe.top_k, c.n_embd);
  }
  if (shared) {
    t.shared_gate_up = be.alloc(n, 2 * int64_t{c.moe.shared_n_ff});
    t.shared_act = be.alloc(n, c.moe.shared_n_ff);
    t.shared_y = be.alloc(n, c.n_embd);
    t.shared_gate = be.alloc(n, 1);
  }
  return t;
}

// out = x * w^T (+ bias), summed over the ranks when w's columns are split among them; with defer
// (out goes only to the ResidualNorm that names it), the sum may be left to that norm's kernel.
static void split_k_matmul(Backend& be, const StackInputs& in, const Tensor& x, const Tensor& w, const Tensor* bias,
                           Tensor& out, RankSum* defer) {
  check(!defer || !defer->deferred, "a deferred sum over the ranks was never read");
  if (in.comm) in.comm->matmul_all_reduce(be, x, w, bias, out, defer);
  else be.matmul(x, w, bias, out);
}

// A layer's token mixer from its normalized input t.h into t.delta: attention over the paged
// cache (Qwen3.5: times the sigmoid of its gate) or Gated DeltaNet over the sequences' states.
static void token_mixer(Backend& be, const ModelConfig& c, const LayerWeights& w, size_t l, const StackInputs& in,
                        StackScratch& t, RankSum* defer) {
  if (w.is_linear()) {
    const LinearAttentionConfig& lc = c.linear;
    check(in.recurrent, "a Gated DeltaNet layer needs each sequence's recurrent state (ForwardBatch::recurrent)");
    const LinearAttentionParams lp{lc.n_k_heads, lc.n_v_heads, lc.k_dim, lc.v_dim, lc.conv_kernel, c.rms_norm_eps};
    be.gated_delta_net(t.proj, w.linear, lp, in.cache->recurrent, static_cast<int>(l), *in.recurrent, t.core,
                       t.gdn.empty() ? nullptr : &t.gdn);
    split_k_matmul(be, in, t.core, w.linear_out, nullptr, t.delta, defer);  // the ranks' heads' shares
    return;
  }
  const int64_t q_dim = int64_t{c.n_heads} * c.head_dim, kv_dim = int64_t{c.n_kv_heads} * c.head_dim;
  const AttentionParams ap{c.n_heads, c.n_kv_heads, c.head_dim, c.sliding_window[l], in.cache->page_size};
  Tensor qkv = c.attn_output_gate ? t.qkv.slice_cols(0, q_dim + 2 * kv_dim) : t.qkv;
  be.qkv_attention(qkv, opt(w.q_norm), opt(w.k_norm), c.rms_norm_eps, *in.inv_freq, *in.kv_slots, in.cache->k[l],
                   in.cache->v[l], *in.segments, *in.positions, ap, t.attn);
  if (c.attn_output_gate) be.sigmoid_mul(t.attn, t.qkv.slice_cols(q_dim + 2 * kv_dim, q_dim));
  split_k_matmul(be, in, t.attn, w.o, opt(w.o_bias), t.delta, defer);  // the ranks' heads' shares
}

Tensor run_decoder_layers(Backend& be, const ModelConfig& c, const std::vector<LayerWeights>& layers,
                          const std::vector<float>& inv_freq, const Tensor& final_norm, Tensor& x,
                          const StackInputs& in_) {
  check(!layers.empty(), "a decoder stack needs at least one layer");
  StackInputs in = in_;
  in.inv_freq = &inv_freq;
  const int64_t n = x.rows;
  StackScratch t = stack_scratch(be, c, layers, in, n);
  Tensor& h = t.h;
  Tensor& delta = t.delta;
  // The residual stream (float32: the layers' outputs add up unrounded) alternates between x
  // and x2: a product that normalizes its own input reads one while it stores residual + delta
  // to the other.
  Tensor x2 = be.alloc_f32(n, c.n_embd);
  Tensor* cur = &x;
  Tensor* next = &x2;
  // Layer-output capture: the features' column slices that layer l's output goes to.
  auto capture_slices = [&](size_t l) {
    std::vector<Tensor> slices;
    if (!in.capture_layers) return slices;
    for (size_t k_idx = 0; k_idx < in.capture_layers->size(); ++k_idx)
      if ((*in.capture_layers)[k_idx] == static_cast<int>(l))
        slices.push_back(in.captured->slice_cols(static_cast<int64_t>(k_idx) * c.n_embd, c.n_embd));
    return slices;
  };
  // A routed MLP's output whose weighted sum the backend left to the next layer's norm.
  MoeScratch* pending_sum = nullptr;
  // delta's sum over the ranks, when the communicator left it to the norm that reads delta.
  RankSum rank_sum;
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerWeights& w = layers[l];
    // delta holds the previous layer's MLP output, not yet added to the stream; the norm that adds
    // it also writes the previous layer's output to the features when that layer is captured.
    std::vector<Tensor> captures = l > 0 ? capture_slices(l - 1) : std::vector<Tensor>{};
    ResidualNorm attn_in{cur, l > 0 ? &delta : nullptr, l > 0 ? next : nullptr, &w.attn_norm, c.rms_norm_eps,
                         captures.empty() ? nullptr : &captures[0], pending_sum, &rank_sum};
    if (w.is_linear()) be.norm_matmul(attn_in, h, w.linear_in, nullptr, t.proj);
    else be.norm_matmul(attn_in, h, w.qkv, opt(w.qkv_bias), t.qkv);
    pending_sum = nullptr;
    if (l > 0) {
      std::swap(cur, next);
      for (size_t i = 1; i < captures.size(); ++i) be.capture_rows(*cur, captures[i]);  // a layer listed twice
    }
    token_mixer(be, c, w, l, in, t, &rank_sum);
    ResidualNorm mlp_in{cur, &delta, next, &w.mlp_norm, c.rms_norm_eps, nullptr, nullptr, &rank_sum};
    if (!w.moe.empty()) {
      Tensor* expert_rows = in.expert_rows ? &(*in.expert_rows)[l] : nullptr;
      const bool last = l + 1 == layers.size();
      if (in.comm && w.shared_gate.empty()) {
        // The ranks' shares of every expert's features, summed by the next layer's norm (the last
        // layer's output goes to add_rms_norm below, which takes no deferred sum).
        in.comm->norm_moe_all_reduce(be, mlp_in, h, w.moe, delta, expert_rows, &t.moe, last ? nullptr : &rank_sum);
        std::swap(cur, next);
        continue;
      }
      // The output goes only to the next layer's norm unless it is summed over ranks, gets the
      // shared expert, or is the last layer's.
      t.moe.defer_sum = !in.comm && w.shared_gate.empty() && !last;
      be.norm_moe(mlp_in, h, w.moe, delta, expert_rows, &t.moe);
      t.moe.defer_sum = false;
      if (t.moe.sum_deferred) pending_sum = &t.moe;
      std::swap(cur, next);
      if (!w.shared_gate.empty()) {  // Qwen3.5-MoE: + sigmoid(h . gate) * shared_expert(h)
        be.matmul_swiglu(h, w.shared_gate_up, nullptr, t.shared_gate_up, t.shared_act);
        be.matmul(t.shared_act, w.shared_down, nullptr, t.shared_y);
        be.matmul(h, w.shared_gate, nullptr, t.shared_gate);
        be.add_sigmoid_scaled(delta, t.shared_y, t.shared_gate);
      }
      if (in.comm) in.comm->all_reduce_sum(be, delta);  // the ranks' shares of every expert's features
      continue;
    }
    be.norm_matmul(mlp_in, h, w.gate_up, opt(w.gate_up_bias), t.act, &t.gate_up);
    std::swap(cur, next);
    // The last layer's output goes to add_rms_norm below, which takes no deferred sum.
    split_k_matmul(be, in, t.act, w.down, opt(w.down_bias), delta, l + 1 < layers.size() ? &rank_sum : nullptr);
  }
  check(!rank_sum.deferred, "a deferred sum over the ranks was never read");
  be.add_rms_norm(*cur, delta, x, final_norm, c.rms_norm_eps, h);  // x is the last layer's output
  for (Tensor& slice : capture_slices(layers.size() - 1)) be.capture_rows(x, slice);
  return h;
}

}  // namespace dflash
