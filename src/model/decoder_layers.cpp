#include "model/decoder_layers.h"

#include <utility>

#include "util/error.h"

namespace dflash {

std::vector<const TensorInfo*> qkv_parts(const TensorStore& s, const ModelConfig& c, const std::string& prefix, int i) {
  const std::string p = cat(prefix, "layers.", i, ".");
  const int64_t h = c.n_embd, q_dim = int64_t{c.n_heads} * c.head_dim, kv_dim = int64_t{c.n_kv_heads} * c.head_dim;
  return {&s.get(p + "self_attn.q_proj.weight", {q_dim, h}), &s.get(p + "self_attn.k_proj.weight", {kv_dim, h}),
          &s.get(p + "self_attn.v_proj.weight", {kv_dim, h})};
}

// A 3-D checkpoint tensor [n, rows, cols] seen as the 2-D [n * rows, cols] it is in memory.
static TensorInfo flattened(const TensorInfo& t) {
  TensorInfo f = t;
  f.shape = {t.shape[0] * t.shape[1], t.shape[2]};
  return f;
}

// A routed MLP: the router and every expert's weights, each kind stacked in one upload. Reads the
// hub's layout (mlp.experts.E.{gate,up,down}_proj.weight) and the stacked one transformers 5 keeps
// in memory (mlp.experts.gate_up_proj [E, 2 * ff, h], mlp.experts.down_proj [E, h, ff]).
static MoeWeights load_moe(Backend& be, const TensorStore& s, const ModelConfig& c, const std::string& p) {
  const MoeConfig& m = c.moe;
  const int64_t h = c.n_embd, ff = m.n_ff;
  MoeWeights w;
  w.n_experts = m.n_experts;
  w.top_k = m.top_k;
  w.n_ff = m.n_ff;
  w.norm_topk_prob = m.norm_topk_prob;
  w.router = be.upload({&s.get(p + "gate.weight", {m.n_experts, h})});
  if (s.find(p + "experts.gate_up_proj")) {
    const TensorInfo gate_up = flattened(s.get(p + "experts.gate_up_proj", {m.n_experts, 2 * ff, h}));
    const TensorInfo down = flattened(s.get(p + "experts.down_proj", {m.n_experts, h, ff}));
    w.gate_up = be.upload({&gate_up});
    w.down = be.upload({&down});
    return w;
  }
  std::vector<const TensorInfo*> gate_up, down;
  for (int e = 0; e < m.n_experts; ++e) {
    const std::string ep = cat(p, "experts.", e, ".");
    gate_up.push_back(&s.get(ep + "gate_proj.weight", {ff, h}));
    gate_up.push_back(&s.get(ep + "up_proj.weight", {ff, h}));
    down.push_back(&s.get(ep + "down_proj.weight", {h, ff}));
  }
  w.gate_up = be.upload(gate_up);
  w.down = be.upload(down);
  return w;
}

LayerWeights load_layer(Backend& be, const TensorStore& s, const ModelConfig& c, const std::string& prefix, int i,
                        const Tensor* qkv) {
  const std::string p = cat(prefix, "layers.", i, ".");
  const int64_t h = c.n_embd, q_dim = int64_t{c.n_heads} * c.head_dim, kv_dim = int64_t{c.n_kv_heads} * c.head_dim;
  LayerWeights w;
  w.attn_norm = be.upload({&s.get(p + "input_layernorm.weight", {h})});
  w.qkv = qkv ? *qkv : be.upload(qkv_parts(s, c, prefix, i));
  w.o = be.upload({&s.get(p + "self_attn.o_proj.weight", {h, q_dim})});
  if (c.attention_bias) {
    w.qkv_bias = be.upload({&s.get(p + "self_attn.q_proj.bias", {q_dim}), &s.get(p + "self_attn.k_proj.bias", {kv_dim}),
                            &s.get(p + "self_attn.v_proj.bias", {kv_dim})});
    w.o_bias = be.upload({&s.get(p + "self_attn.o_proj.bias", {h})});
  }
  if (c.qk_norm) {
    w.q_norm = be.upload({&s.get(p + "self_attn.q_norm.weight", {c.head_dim})});
    w.k_norm = be.upload({&s.get(p + "self_attn.k_norm.weight", {c.head_dim})});
  }
  w.mlp_norm = be.upload({&s.get(p + "post_attention_layernorm.weight", {h})});
  if (c.is_moe_layer(i)) {
    w.moe = load_moe(be, s, c, p + "mlp.");
    return w;
  }
  w.gate_up = be.upload({&s.get(p + "mlp.gate_proj.weight", {c.n_ff, h}), &s.get(p + "mlp.up_proj.weight", {c.n_ff, h})});
  w.down = be.upload({&s.get(p + "mlp.down_proj.weight", {h, c.n_ff})});
  if (c.mlp_bias) {
    w.gate_up_bias = be.upload({&s.get(p + "mlp.gate_proj.bias", {c.n_ff}), &s.get(p + "mlp.up_proj.bias", {c.n_ff})});
    w.down_bias = be.upload({&s.get(p + "mlp.down_proj.bias", {h})});
  }
  return w;
}

int64_t layer_bytes(const LayerWeights& w, int routed_experts) {
  int64_t n = 0;
  for (const Tensor* t : {&w.attn_norm, &w.qkv, &w.qkv_bias, &w.q_norm, &w.k_norm, &w.o, &w.o_bias, &w.mlp_norm,
                          &w.gate_up, &w.gate_up_bias, &w.down, &w.down_bias, &w.moe.router})
    n += tensor_bytes(*t);
  if (!w.moe.empty()) {
    const int64_t experts = tensor_bytes(w.moe.gate_up) + tensor_bytes(w.moe.down);
    n += routed_experts < 0 ? experts : experts / w.moe.n_experts * routed_experts;
  }
  return n;
}

static const Tensor* opt(const Tensor& t) { return t.empty() ? nullptr : &t; }

Tensor run_decoder_layers(Backend& be, const ModelConfig& c, const std::vector<LayerWeights>& layers,
                          const std::vector<float>& inv_freq, const Tensor& final_norm, Tensor& x,
                          const StackInputs& in) {
  check(!layers.empty(), "a decoder stack needs at least one layer");
  const int64_t n = x.rows, q_dim = int64_t{c.n_heads} * c.head_dim, kv_dim = int64_t{c.n_kv_heads} * c.head_dim;
  Tensor h = be.alloc(n, c.n_embd);
  Tensor qkv = be.alloc(n, q_dim + 2 * kv_dim);
  Tensor attn = be.alloc(n, q_dim);
  Tensor delta = be.alloc(n, c.n_embd);
  // Dense layers' MLP scratch (a stack of routed layers only has none).
  bool dense = false;
  for (const LayerWeights& w : layers) dense = dense || w.moe.empty();
  Tensor gate_up = dense ? be.alloc(n, 2 * int64_t{c.n_ff}) : Tensor{};
  Tensor act = dense ? be.alloc(n, c.n_ff) : Tensor{};
  MoeScratch moe_scratch;
  if (!c.moe_layer.empty()) {
    moe_scratch.act = be.alloc(n * c.moe.top_k, c.moe.n_ff);
    moe_scratch.y = be.alloc(n * c.moe.top_k, c.n_embd);
  }
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
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerWeights& w = layers[l];
    // delta holds the previous layer's MLP output, not yet added to the stream; the norm that adds
    // it also writes the previous layer's output to the features when that layer is captured.
    std::vector<Tensor> captures = l > 0 ? capture_slices(l - 1) : std::vector<Tensor>{};
    ResidualNorm attn_in{cur, l > 0 ? &delta : nullptr, l > 0 ? next : nullptr, &w.attn_norm, c.rms_norm_eps,
                         captures.empty() ? nullptr : &captures[0]};
    be.norm_matmul(attn_in, h, w.qkv, opt(w.qkv_bias), qkv);
    if (l > 0) {
      std::swap(cur, next);
      for (size_t i = 1; i < captures.size(); ++i) be.capture_rows(*cur, captures[i]);  // a layer listed twice
    }
    const AttentionParams ap{c.n_heads, c.n_kv_heads, c.head_dim, c.sliding_window[l], in.cache->page_size};
    be.qkv_attention(qkv, opt(w.q_norm), opt(w.k_norm), c.rms_norm_eps, inv_freq, *in.kv_slots, in.cache->k[l],
                     in.cache->v[l], *in.segments, *in.positions, ap, attn);
    be.matmul(attn, w.o, opt(w.o_bias), delta);
    ResidualNorm mlp_in{cur, &delta, next, &w.mlp_norm, c.rms_norm_eps};
    if (!w.moe.empty()) {
      be.norm_in(mlp_in, h);
      std::swap(cur, next);
      be.moe(h, w.moe, delta, in.expert_rows ? &(*in.expert_rows)[l] : nullptr, &moe_scratch);
      continue;
    }
    be.norm_matmul(mlp_in, h, w.gate_up, opt(w.gate_up_bias), act, &gate_up);
    std::swap(cur, next);
    be.matmul(act, w.down, opt(w.down_bias), delta);
  }
  be.add_rms_norm(*cur, delta, x, final_norm, c.rms_norm_eps, h);  // x is the last layer's output
  for (Tensor& slice : capture_slices(layers.size() - 1)) be.capture_rows(x, slice);
  return h;
}

}  // namespace dflash
