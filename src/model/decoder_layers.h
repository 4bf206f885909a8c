// The decoder layer shared by Qwen3/Llama/Qwen3.5 targets and DFlash drafts:
// pre-norm attention (fused qkv, optional q/k norm, RoPE, GQA over a paged
// KV cache; Qwen3.5: partial RoPE and a sigmoid output gate) or Qwen3.5's Gated
// DeltaNet, then a SwiGLU or routed MLP, with fused residual-add + RMSNorm.
#pragma once

#include <string>
#include <vector>

#include "formats/model_config.h"
#include "formats/safetensors.h"
#include "kernels/backend.h"
#include "model/tensor_parallel.h"

namespace dflash {

struct LayerWeights {
  Tensor attn_norm;  // [1, n_embd]  input_layernorm (zero-centred norms: 1 + weight, float32, here and below)
  Tensor qkv;        // [(n_heads + 2*n_kv_heads) * head_dim, n_embd]  q_proj ++ k_proj ++ v_proj; with an output
                     // gate, the gate heads' rows of q_proj follow as n_heads * head_dim more rows
  Tensor qkv_bias;   // [1, (n_heads + 2*n_kv_heads) * head_dim] or empty
  Tensor q_norm;     // [1, head_dim] or empty (Llama)
  Tensor k_norm;     // [1, head_dim] or empty (Llama)
  Tensor o;          // [n_embd, n_heads * head_dim]
  Tensor o_bias;     // [1, n_embd] or empty
  Tensor mlp_norm;   // [1, n_embd]  post_attention_layernorm
  MoeWeights moe;    // a routed layer's experts (Qwen3-MoE); empty: the dense MLP below
  Tensor gate_up;    // [2 * n_ff, n_embd]  gate_proj ++ up_proj
  Tensor gate_up_bias;  // [1, 2 * n_ff] or empty
  Tensor down;       // [n_embd, n_ff]
  Tensor down_bias;  // [1, n_embd] or empty
  // Qwen3.5 Gated DeltaNet layers (instead of qkv, q_norm, k_norm, o):
  Tensor linear_in;   // [conv_dim + value_dim + 2 * n_v_heads, n_embd]  in_proj_qkv ++ in_proj_z ++ in_proj_b ++ in_proj_a
  LinearAttentionWeights linear;
  Tensor linear_out;  // [n_embd, value_dim]  out_proj
  // Qwen3.5-MoE's shared expert beside the routed ones:
  Tensor shared_gate_up;  // [2 * shared_n_ff, n_embd]
  Tensor shared_down;     // [n_embd, shared_n_ff]
  Tensor shared_gate;     // [1, n_embd]  shared_expert_gate
  bool is_linear() const { return !linear_in.empty(); }

  // Rows of `qkv` that produce K and V: [2 * n_kv_heads * head_dim, n_embd].
  Tensor kv_rows(const ModelConfig& c) const {
    return qkv.slice_rows(int64_t{c.n_heads} * c.head_dim, int64_t{2} * c.n_kv_heads * c.head_dim);
  }
};

// Bytes of a tensor's elements (0 when empty).
inline int64_t tensor_bytes(const Tensor& t) { return t.empty() ? 0 : t.rows * t.cols * static_cast<int64_t>(dtype_size(t.dtype)); }
// Bytes of every weight of the layer; with `routed_experts`, a routed layer counts only that many
// of its experts: what one forward over it must read.
int64_t layer_bytes(const LayerWeights& w, int routed_experts = -1);

// A norm weight [1, n] as the model applies it (zero-centred norms: 1 + weight, in float32).
Tensor load_norm(Backend& be, const TensorStore& store, const ModelConfig& c, const std::string& name, int64_t n);

// Loads layer `i` with tensor names `prefix`layers.i.*, checking every shape.
// The q/k/v weight parts of layer i, in the order they stack (q_proj, k_proj, v_proj),
// shape-checked: rank tp.rank's rows of them (views of the checkpoint).
std::vector<TensorInfo> qkv_parts(const TensorStore& store, const ModelConfig& c, const std::string& prefix, int i,
                                  const TpRank& tp = {});
// Uploads layer i; with `qkv`, that tensor (already uploaded, e.g. a slice of several layers'
// weights in one allocation: qkv_parts with the same `tp`) is its q/k/v weight. With `tp` sharded, rank tp.rank's shard of it
// (tensor_parallel.h; `c` is the whole model's config, the shapes checked are the checkpoint's).
LayerWeights load_layer(Backend& be, const TensorStore& store, const ModelConfig& c, const std::string& prefix, int i,
                        const Tensor* qkv = nullptr, const TpRank& tp = {});

// Per-call inputs of the decoder stack.
struct StackInputs {
  const std::vector<int32_t>* positions = nullptr;  // one per row
  const std::vector<int32_t>* kv_slots = nullptr;   // physical cache slot per row
  const std::vector<AttentionSegment>* segments = nullptr;
  KvCache* cache = nullptr;
  // Optional: after layer j (j in capture_layers), copy the residual stream
  // into captured.slice_cols(k * n_embd, n_embd) where k is j's index in the list.
  const std::vector<int>* capture_layers = nullptr;
  Tensor* captured = nullptr;
  // Optional, per layer: where a routed layer records how many rows each expert got
  // (Backend::moe's expert_rows; empty tensors for dense layers).
  std::vector<Tensor>* expert_rows = nullptr;
  // Hybrid models: each sequence's Gated DeltaNet state use (ForwardBatch::recurrent).
  const std::vector<RecurrentSegment>* recurrent = nullptr;
  const std::vector<float>* inv_freq = nullptr;  // set by run_decoder_layers
  // Tensor-parallel ranks: the attention's and the MLP's outputs are summed across them.
  Communicator* comm = nullptr;
};

// Rows first..first+n of a 2-D checkpoint tensor (a view of its mapping).
TensorInfo row_slice(const TensorInfo& t, int64_t first, int64_t n);

// Runs all layers over `x` [rows, n_embd] (the residual stream, from Backend::alloc_f32, updated in place)
// and returns final_norm(x).
Tensor run_decoder_layers(Backend& be, const ModelConfig& c, const std::vector<LayerWeights>& layers,
                          const std::vector<float>& inv_freq, const Tensor& final_norm, Tensor& x,
                          const StackInputs& in);

}  // namespace dflash
