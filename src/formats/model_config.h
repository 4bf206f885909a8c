// config.json of the supported checkpoints: Qwen3/Llama targets and DFlash
// drafts, plus generation_config.json. Every field is checked; an error names
// the file and the field.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace dflash {

enum class RopeType { Default, Llama3 };

struct RopeConfig {
  RopeType type = RopeType::Default;
  double theta = 10000.0;
  double partial_rotary_factor = 1.0;  // the leading head_dim * factor dimensions rotate (Qwen3.5: 0.25)
  // llama3 scaling only
  double factor = 1.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_max_positions = 8192;
};

// The routed MLP of a mixture-of-experts model (Qwen3-MoE): n_experts SwiGLU experts of
// n_ff features, top_k of them per token.
struct MoeConfig {
  int n_experts = 0;            // num_experts
  int top_k = 0;                // num_experts_per_tok
  int n_ff = 0;                 // moe_intermediate_size
  bool norm_topk_prob = false;  // the top_k weights renormalized to sum to 1
  int shared_n_ff = 0;          // Qwen3.5-MoE: a shared SwiGLU expert of this size, scaled by sigmoid(x . gate)
};

// Qwen3.5's Gated DeltaNet (linear attention) layers: a causal depthwise convolution over the
// q/k/v projection, then a recurrent state [n_v_heads, k_dim, v_dim] per sequence.
struct LinearAttentionConfig {
  int n_k_heads = 0;    // linear_num_key_heads
  int n_v_heads = 0;    // linear_num_value_heads (a multiple of n_k_heads)
  int k_dim = 0;        // linear_key_head_dim
  int v_dim = 0;        // linear_value_head_dim
  int conv_kernel = 0;  // linear_conv_kernel_dim
  int64_t key_dim() const { return int64_t{n_k_heads} * k_dim; }
  int64_t value_dim() const { return int64_t{n_v_heads} * v_dim; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }  // q, k, v channels
};

// The shape of a Qwen3/Llama decoder stack (target, or the layers of a draft).
struct ModelConfig {
  std::string architecture;     // "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM", "Qwen3_5ForCausalLM",
                                // "Qwen3_5MoeForCausalLM", their ...ForConditionalGeneration, "DFlashDraftModel"
  std::string weight_prefix = "model.";  // the decoder's tensor names start with this (multimodal: model.language_model.)
  int n_vocab = 0;
  int n_embd = 0;               // hidden_size
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int n_ff = 0;                 // intermediate_size
  float rms_norm_eps = 1e-6f;
  int max_positions = 0;
  RopeConfig rope;
  bool tie_embeddings = false;
  bool qk_norm = false;         // Qwen3 (and DFlash drafts): per-head RMSNorm on q and k
  bool attention_bias = false;  // Llama option: biases on q/k/v/o
  bool mlp_bias = false;        // Llama option: biases on gate/up/down
  std::vector<int> sliding_window;  // per layer; 0 = full attention
  MoeConfig moe;                // Qwen3-MoE only
  std::vector<bool> moe_layer;  // per layer: the MLP is routed (moe) rather than dense (n_ff)
  bool is_moe_layer(int i) const { return !moe_layer.empty() && moe_layer[static_cast<size_t>(i)]; }
  // Qwen3.5 hybrids: per layer, Gated DeltaNet (true) or gated full attention; empty for others.
  std::vector<bool> linear_layer;
  LinearAttentionConfig linear;
  bool attn_output_gate = false;     // q_proj gives [query | gate] per head; attention output *= sigmoid(gate)
  bool zero_centred_norms = false;   // every RMSNorm scales by (1 + weight) (not the linear attention's gated norm)
  bool is_linear_layer(int i) const { return !linear_layer.empty() && linear_layer[static_cast<size_t>(i)]; }
  bool hybrid() const { return !linear_layer.empty(); }
  int rotary_dim() const { return static_cast<int>(head_dim * rope.partial_rotary_factor); }
};

// DFlash draft: its decoder layers plus the fields that tie it to a target.
struct DraftConfig {
  ModelConfig layers;           // n_vocab may be 0 (the draft has no embedding)
  int block_size = 0;
  int n_target_layers = 0;
  int mask_token_id = -1;
  std::vector<int> target_layer_ids;
};

struct GenerationConfig {
  std::vector<int> eos_token_ids;
  std::optional<int> bos_token_id;
  std::optional<double> temperature, top_p;
  std::optional<int> top_k, max_new_tokens;
  std::optional<bool> do_sample;
};

bool is_draft_architecture(const std::string& arch);

// `where` names the source in messages (usually the file path).
ModelConfig parse_model_config(const nlohmann::json& j, const std::string& where);
DraftConfig parse_draft_config(const nlohmann::json& j, const std::string& where);
GenerationConfig parse_generation_config(const nlohmann::json& j, const std::string& where);

// Parses the text of a config file; invalid JSON throws Error naming `where`.
nlohmann::json parse_config_text(const std::string& text, const std::string& where);

// Read DIR/config.json (and DIR/generation_config.json; absent gives defaults).
nlohmann::json load_config_json(const std::string& dir);
ModelConfig load_model_config(const std::string& dir);
DraftConfig load_draft_config(const std::string& dir);
GenerationConfig load_generation_config(const std::string& dir);

// docs/algorithm.md section 1: L evenly spaced layers (round half to even, as Python).
std::vector<int> default_target_layer_ids(int n_target_layers, int n_draft_layers);

}  // namespace dflash
