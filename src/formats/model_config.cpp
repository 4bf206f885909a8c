#include "formats/model_config.h"

#include <cmath>

#include <nlohmann/json.hpp>

#include "util/error.h"
#include "util/mapped_file.h"

namespace dflash {

using nlohmann::json;

namespace {

// Typed field access; every message names the source and the field.
class Fields {
 public:
  Fields(const json& j, std::string where) : j_(j), where_(std::move(where)) {
    check(j_.is_object(), where_, ": expected a JSON object");
  }
  bool has(const char* k) const { return j_.contains(k) && !j_[k].is_null(); }
  const json& raw(const char* k) const { return j_[k]; }

  int64_t integer(const char* k) const {
    check(has(k), where_, ": missing required field '", k, "'");
    return integer_value(j_[k], k);
  }
  int64_t integer(const char* k, int64_t dflt) const { return has(k) ? integer_value(j_[k], k) : dflt; }
  int64_t positive(const char* k) const {
    int64_t v = integer(k);
    check(v > 0, where_, ": field '", k, "' must be positive, got ", v);
    check(v <= (int64_t{1} << 30), where_, ": field '", k, "' is implausibly large: ", v);
    return v;
  }
  double number(const char* k) const {
    check(has(k), where_, ": missing required field '", k, "'");
    return number_value(j_[k], k);
  }
  double number(const char* k, double dflt) const { return has(k) ? number_value(j_[k], k) : dflt; }
  bool boolean(const char* k, bool dflt) const {
    if (!has(k)) return dflt;
    check(j_[k].is_boolean(), where_, ": field '", k, "' must be a boolean");
    return j_[k].get<bool>();
  }
  std::string string(const char* k) const {
    check(has(k), where_, ": missing required field '", k, "'");
    check(j_[k].is_string(), where_, ": field '", k, "' must be a string");
    return j_[k].get<std::string>();
  }
  std::vector<int> int_list(const char* k) const {  // an int or a list of ints
    const json& v = j_[k];
    std::vector<int> out;
    if (v.is_array()) {
      for (const auto& e : v) out.push_back(static_cast<int>(integer_value(e, k)));
    } else {
      out.push_back(static_cast<int>(integer_value(v, k)));
    }
    return out;
  }
  const std::string& where() const { return where_; }

 private:
  int64_t integer_value(const json& v, const char* k) const {
    check(v.is_number_integer(), where_, ": field '", k, "' must be an integer");
    return v.get<int64_t>();
  }
  double number_value(const json& v, const char* k) const {
    check(v.is_number(), where_, ": field '", k, "' must be a number");
    double d = v.get<double>();
    check(std::isfinite(d), where_, ": field '", k, "' must be finite");
    return d;
  }
  const json& j_;
  std::string where_;
};

// Accepts transformers 5 `rope_parameters` and the older `rope_theta` + `rope_scaling`.
RopeConfig parse_rope(const Fields& f) {
  RopeConfig r;
  const json* params = nullptr;
  std::string params_name;
  if (f.has("rope_parameters")) {
    params = &f.raw("rope_parameters");
    params_name = "rope_parameters";
  } else if (f.has("rope_scaling")) {
    params = &f.raw("rope_scaling");
    params_name = "rope_scaling";
  }
  r.theta = f.number("rope_theta", 10000.0);
  if (params) {
    Fields p(*params, cat(f.where(), ": ", params_name));
    r.theta = p.number("rope_theta", r.theta);
    std::string type = "default";
    if (p.has("rope_type")) type = p.string("rope_type");
    else if (p.has("type")) type = p.string("type");
    if (type == "llama3") {
      r.type = RopeType::Llama3;
      r.factor = p.number("factor");
      r.low_freq_factor = p.number("low_freq_factor");
      r.high_freq_factor = p.number("high_freq_factor");
      r.original_max_positions = p.integer("original_max_position_embeddings");
      check(r.factor > 0 && r.high_freq_factor > r.low_freq_factor && r.low_freq_factor > 0 &&
                r.original_max_positions > 0,
            p.where(), ": inconsistent llama3 scaling parameters");
    } else {
      check(type == "default", p.where(), ": unsupported rope type '", type, "' (supported: default, llama3)");
    }
  }
  // transformers reads the factor from rope_parameters; older configs have it at the top level.
  r.partial_rotary_factor = f.number("partial_rotary_factor", 1.0);
  if (params) r.partial_rotary_factor = Fields(*params, cat(f.where(), ": ", params_name)).number("partial_rotary_factor", r.partial_rotary_factor);
  check(r.partial_rotary_factor > 0 && r.partial_rotary_factor <= 1, f.where(),
        ": partial_rotary_factor must be in (0, 1], got ", r.partial_rotary_factor);
  check(r.theta > 0, f.where(), ": rope_theta must be positive");
  return r;
}

void parse_layers(const Fields& f, ModelConfig& c, bool dense_mlp = true) {
  c.n_embd = static_cast<int>(f.positive("hidden_size"));
  c.n_layers = static_cast<int>(f.positive("num_hidden_layers"));
  // Per-layer lists are sized from this before any weight is seen (2^30 asked for 4 GiB).
  check(c.n_layers <= 4096, f.where(), ": field 'num_hidden_layers' is implausibly large: ", c.n_layers);
  c.n_heads = static_cast<int>(f.positive("num_attention_heads"));
  c.n_kv_heads = f.has("num_key_value_heads") ? static_cast<int>(f.positive("num_key_value_heads")) : c.n_heads;
  check(c.n_heads % c.n_kv_heads == 0, f.where(), ": num_attention_heads (", c.n_heads,
        ") is not a multiple of num_key_value_heads (", c.n_kv_heads, ")");
  if (f.has("head_dim")) {
    c.head_dim = static_cast<int>(f.positive("head_dim"));
  } else {
    check(c.n_embd % c.n_heads == 0, f.where(), ": missing field 'head_dim' and hidden_size is not a multiple of heads");
    c.head_dim = c.n_embd / c.n_heads;
  }
  check(c.head_dim % 2 == 0, f.where(), ": head_dim must be even for RoPE, got ", c.head_dim);
  if (dense_mlp) c.n_ff = static_cast<int>(f.positive("intermediate_size"));
  c.rms_norm_eps = static_cast<float>(f.number("rms_norm_eps", 1e-6));
  check(c.rms_norm_eps > 0, f.where(), ": rms_norm_eps must be positive");
  c.max_positions = static_cast<int>(f.has("max_position_embeddings") ? f.positive("max_position_embeddings") : 32768);
  if (f.has("hidden_act")) {
    const auto act = f.string("hidden_act");
    check(act == "silu", f.where(), ": unsupported hidden_act '", act, "' (supported: silu)");
  }
  c.rope = parse_rope(f);
  c.sliding_window.assign(c.n_layers, 0);
}

// `layer_types`: one string per layer, checked.
std::vector<std::string> layer_types(const Fields& f, int n_layers) {
  const json& types = f.raw("layer_types");
  check(types.is_array() && static_cast<int>(types.size()) == n_layers, f.where(),
        ": field 'layer_types' must list one type per layer (", n_layers, ")");
  std::vector<std::string> out;
  for (const json& t : types) {
    check(t.is_string(), f.where(), ": field 'layer_types' must hold strings");
    out.push_back(t.get<std::string>());
  }
  return out;
}

// Per-layer sliding windows from `layer_types` + `sliding_window`.
void parse_windows(const Fields& f, ModelConfig& c) {
  if (!f.has("layer_types")) return;
  const std::vector<std::string> types = layer_types(f, c.n_layers);
  for (int i = 0; i < c.n_layers; ++i) {
    const std::string& t = types[static_cast<size_t>(i)];
    if (t == "sliding_attention") {
      c.sliding_window[i] = static_cast<int>(f.positive("sliding_window"));
    } else {
      check(t == "full_attention", f.where(), ": unsupported layer type '", t, "' in 'layer_types'");
    }
  }
}

// The experts of a routed MLP: how many, how many a token takes, their width.
void parse_experts(const Fields& f, MoeConfig& m) {
  // The hub's configs say num_experts; transformers 5 writes num_local_experts.
  const char* experts_key = f.has("num_experts") || !f.has("num_local_experts") ? "num_experts" : "num_local_experts";
  m.n_experts = static_cast<int>(f.positive(experts_key));
  check(m.n_experts <= 4096, f.where(), ": field '", experts_key, "' is implausibly large: ", m.n_experts);
  m.top_k = static_cast<int>(f.positive("num_experts_per_tok"));
  check(m.top_k <= m.n_experts && m.top_k <= 64, f.where(), ": field 'num_experts_per_tok' (", m.top_k,
        ") must be at most num_experts (", m.n_experts, ") and 64");
  m.n_ff = static_cast<int>(f.positive("moe_intermediate_size"));
}

// Which layers are routed: every decoder_sparse_step-th, except mlp_only_layers (Qwen3-MoE,
// Qwen3-Next).
void sparse_layers(const Fields& f, ModelConfig& c) {
  const int64_t step = f.integer("decoder_sparse_step", 1);
  check(step >= 1 && step <= c.n_layers, f.where(), ": field 'decoder_sparse_step' must be in 1..num_hidden_layers, got ",
        step);
  c.moe_layer.assign(static_cast<size_t>(c.n_layers), false);
  for (int i = 0; i < c.n_layers; ++i) c.moe_layer[static_cast<size_t>(i)] = (i + 1) % step == 0;
  if (f.has("mlp_only_layers")) {
    check(f.raw("mlp_only_layers").is_array(), f.where(), ": field 'mlp_only_layers' must be a list of layer indices");
    for (int i : f.int_list("mlp_only_layers")) {
      check(i >= 0 && i < c.n_layers, f.where(), ": mlp_only_layers entry ", i, " is outside 0..", c.n_layers - 1);
      c.moe_layer[static_cast<size_t>(i)] = false;
    }
  }
}

// Qwen3-MoE's routed MLP: which layers have it (decoder_sparse_step, mlp_only_layers) and its
// shape. Keys of MoE variants this engine does not implement are refused by name.
void parse_moe(const Fields& f, ModelConfig& c) {
  for (const char* k : {"shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"}) {
    check(!f.has(k) || (f.raw(k).is_number() && f.raw(k).get<double>() == 0), f.where(), ": field '", k,
          "': shared experts are not supported");
  }
  check(!f.boolean("use_sliding_window", false), f.where(), ": use_sliding_window=true is not supported for Qwen3-MoE targets");
  parse_experts(f, c.moe);
  c.moe.norm_topk_prob = f.boolean("norm_topk_prob", false);
  sparse_layers(f, c);
}

// Qwen3.5: which layers are Gated DeltaNet (layer_types, else every full_attention_interval-th
// layer is full attention) and their shape.
void parse_hybrid(const Fields& f, ModelConfig& c) {
  c.linear_layer.assign(static_cast<size_t>(c.n_layers), false);
  if (f.has("layer_types")) {
    const std::vector<std::string> types = layer_types(f, c.n_layers);
    for (int i = 0; i < c.n_layers; ++i) {
      const std::string& t = types[static_cast<size_t>(i)];
      check(t == "linear_attention" || t == "full_attention", f.where(), ": unsupported layer type '", t,
            "' in 'layer_types' (supported: linear_attention, full_attention)");
      c.linear_layer[static_cast<size_t>(i)] = t == "linear_attention";
    }
  } else {
    const int64_t interval = f.integer("full_attention_interval", 4);
    check(interval >= 1, f.where(), ": field 'full_attention_interval' must be positive");
    for (int i = 0; i < c.n_layers; ++i) c.linear_layer[static_cast<size_t>(i)] = (i + 1) % interval != 0;
  }
  LinearAttentionConfig& l = c.linear;
  l.n_k_heads = static_cast<int>(f.positive("linear_num_key_heads"));
  l.n_v_heads = static_cast<int>(f.positive("linear_num_value_heads"));
  l.k_dim = static_cast<int>(f.positive("linear_key_head_dim"));
  l.v_dim = static_cast<int>(f.positive("linear_value_head_dim"));
  l.conv_kernel = static_cast<int>(f.positive("linear_conv_kernel_dim"));
  check(l.n_v_heads % l.n_k_heads == 0, f.where(), ": linear_num_value_heads (", l.n_v_heads,
        ") is not a multiple of linear_num_key_heads (", l.n_k_heads, ")");
  check(l.conv_kernel >= 2 && l.conv_kernel <= 16, f.where(), ": linear_conv_kernel_dim must be in 2..16, got ",
        l.conv_kernel);
  check(l.k_dim <= 1024 && l.v_dim <= 1024, f.where(), ": linear attention head dims above 1024 are implausible");
  c.attn_output_gate = true;
  c.zero_centred_norms = true;
  c.qk_norm = true;
  const int rot = c.rotary_dim();
  check(rot >= 2 && rot % 2 == 0, f.where(), ": head_dim * partial_rotary_factor must be an even number >= 2, got ", rot);
}

// Qwen3.5-MoE: every layer routed (top-k always renormalized) plus a shared expert.
void parse_hybrid_moe(const Fields& f, ModelConfig& c) {
  MoeConfig& m = c.moe;
  parse_experts(f, m);
  m.norm_topk_prob = true;
  m.shared_n_ff = static_cast<int>(f.positive("shared_expert_intermediate_size"));
  c.moe_layer.assign(static_cast<size_t>(c.n_layers), true);
}

// Qwen3-Next: the Qwen3.5 layers (its linear attention's projections fused per key head, which
// the loader splits) with routed layers chosen as Qwen3-MoE chooses them, top-k renormalized
// when norm_topk_prob (default true), an optional shared expert, dense layers of
// intermediate_size. num_experts 0: every layer dense.
ModelConfig parse_qwen3_next(const Fields& f, const std::string& arch, const std::string& where) {
  ModelConfig c;
  c.architecture = arch;
  c.n_vocab = static_cast<int>(f.positive("vocab_size"));
  parse_layers(f, c, /*dense_mlp=*/false);
  c.tie_embeddings = f.boolean("tie_word_embeddings", false);
  check(!f.boolean("attention_bias", false), where, ": attention_bias=true is not supported for Qwen3-Next targets");
  parse_hybrid(f, c);
  const int64_t n_experts = f.integer("num_experts", 0);
  check(n_experts >= 0, where, ": field 'num_experts' must not be negative, got ", n_experts);
  if (n_experts > 0) {
    MoeConfig& m = c.moe;
    parse_experts(f, m);
    m.norm_topk_prob = f.boolean("norm_topk_prob", true);
    const int64_t shared = f.integer("shared_expert_intermediate_size", 0);
    check(shared >= 0 && shared <= (int64_t{1} << 20), where,
          ": field 'shared_expert_intermediate_size' must be in 0..2^20, got ", shared);
    m.shared_n_ff = static_cast<int>(shared);
    sparse_layers(f, c);
  }
  bool dense = false;
  for (int i = 0; i < c.n_layers; ++i) dense = dense || !c.is_moe_layer(i);
  if (dense) c.n_ff = static_cast<int>(f.positive("intermediate_size"));
  return c;
}

}  // namespace

bool is_draft_architecture(const std::string& arch) {
  return arch == "DFlashDraftModel" || arch == "Qwen3DFlashDraftModel";
}

static std::string first_architecture(const Fields& f) {
  check(f.has("architectures") && f.raw("architectures").is_array() && !f.raw("architectures").empty() &&
            f.raw("architectures")[0].is_string(),
        f.where(), ": missing required field 'architectures'");
  return f.raw("architectures")[0].get<std::string>();
}

static bool is_qwen3_5(const std::string& arch) {
  return arch == "Qwen3_5ForCausalLM" || arch == "Qwen3_5MoeForCausalLM" || arch == "Qwen3_5ForConditionalGeneration" ||
         arch == "Qwen3_5MoeForConditionalGeneration";
}

// Qwen3.5 and Qwen3.5-MoE text models, alone or inside the multimodal checkpoints (text_config;
// the language model's weights under model.language_model., the vision tower's ignored).
static ModelConfig parse_qwen3_5(const Fields& top, const std::string& arch, const std::string& where) {
  const bool wrapped = arch.find("ForConditionalGeneration") != std::string::npos;
  check(!wrapped || (top.has("text_config") && top.raw("text_config").is_object()), where,
        ": missing required field 'text_config'");
  const Fields f = wrapped ? Fields(top.raw("text_config"), where + ": text_config") : top;
  ModelConfig c;
  c.architecture = arch;
  if (wrapped) c.weight_prefix = "model.language_model.";
  c.n_vocab = static_cast<int>(f.positive("vocab_size"));
  const bool moe = arch.find("Moe") != std::string::npos;
  parse_layers(f, c, /*dense_mlp=*/!moe);  // MoE text configs have no dense MLP size
  c.tie_embeddings = top.boolean("tie_word_embeddings", f.boolean("tie_word_embeddings", false));
  c.attention_bias = f.boolean("attention_bias", false);
  check(!c.attention_bias, where, ": attention_bias=true is not supported for Qwen3.5 targets");
  parse_hybrid(f, c);
  if (moe) parse_hybrid_moe(f, c);
  return c;
}

ModelConfig parse_model_config(const json& j, const std::string& where) {
  Fields f(j, where);
  const std::string arch = first_architecture(f);
  if (is_qwen3_5(arch)) return parse_qwen3_5(f, arch, where);
  if (arch == "Qwen3NextForCausalLM") return parse_qwen3_next(f, arch, where);
  ModelConfig c;
  c.architecture = arch;
  const bool moe = c.architecture == "Qwen3MoeForCausalLM";
  const bool qwen3 = moe || c.architecture == "Qwen3ForCausalLM";
  const bool llama = c.architecture == "LlamaForCausalLM";
  check(qwen3 || llama, where, ": unsupported architecture '", c.architecture,
        "' (supported: Qwen3ForCausalLM, Qwen3MoeForCausalLM, LlamaForCausalLM, Qwen3_5ForCausalLM, "
        "Qwen3_5MoeForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration, "
        "Qwen3NextForCausalLM)");
  c.n_vocab = static_cast<int>(f.positive("vocab_size"));
  parse_layers(f, c);
  c.tie_embeddings = f.boolean("tie_word_embeddings", false);  // both families default to untied
  c.qk_norm = qwen3;
  c.attention_bias = f.boolean("attention_bias", false);
  c.mlp_bias = f.boolean("mlp_bias", false);
  if (moe) {
    parse_moe(f, c);
  } else if (qwen3) {
    check(!f.boolean("use_sliding_window", false), where, ": use_sliding_window=true is not supported for Qwen3 targets");
  } else {
    parse_windows(f, c);
  }
  return c;
}

std::vector<int> default_target_layer_ids(int n_target_layers, int n_draft_layers) {
  if (n_draft_layers == 1) return {n_target_layers / 2};
  std::vector<int> ids;
  for (int i = 0; i < n_draft_layers; ++i) {
    const double x = 1.0 + i * static_cast<double>(n_target_layers - 4) / (n_draft_layers - 1);
    ids.push_back(static_cast<int>(std::nearbyint(x)));  // default rounding mode: half to even
  }
  return ids;
}

DraftConfig parse_draft_config(const json& j, const std::string& where) {
  Fields f(j, where);
  DraftConfig d;
  d.layers.architecture = first_architecture(f);
  check(is_draft_architecture(d.layers.architecture), where, ": architecture '", d.layers.architecture,
        "' is not a DFlash draft (expected DFlashDraftModel)");
  parse_layers(f, d.layers);
  parse_windows(f, d.layers);
  d.layers.n_vocab = static_cast<int>(f.integer("vocab_size", 0));
  d.layers.qk_norm = true;
  d.block_size = static_cast<int>(f.positive("block_size"));
  check(d.block_size >= 2, where, ": block_size must be at least 2");
  d.n_target_layers = static_cast<int>(f.positive("num_target_layers"));
  check(f.has("dflash_config"), where, ": missing required field 'dflash_config'");
  Fields dc(f.raw("dflash_config"), where + ": dflash_config");
  d.mask_token_id = static_cast<int>(dc.integer("mask_token_id"));
  check(d.mask_token_id >= 0, where, ": dflash_config.mask_token_id must be non-negative");
  if (dc.has("target_layer_ids")) {
    check(dc.raw("target_layer_ids").is_array() && !dc.raw("target_layer_ids").empty(), where,
          ": dflash_config.target_layer_ids must be a non-empty list");
    d.target_layer_ids = dc.int_list("target_layer_ids");
  } else {
    d.target_layer_ids = default_target_layer_ids(d.n_target_layers, d.layers.n_layers);
  }
  for (int id : d.target_layer_ids) {
    check(id >= 0 && id < d.n_target_layers, where, ": target layer id ", id, " is outside 0..",
          d.n_target_layers - 1);
  }
  return d;
}

GenerationConfig parse_generation_config(const json& j, const std::string& where) {
  Fields f(j, where);
  GenerationConfig g;
  if (f.has("eos_token_id")) g.eos_token_ids = f.int_list("eos_token_id");
  if (f.has("bos_token_id")) g.bos_token_id = static_cast<int>(f.integer("bos_token_id"));
  if (f.has("temperature")) g.temperature = f.number("temperature");
  if (f.has("top_p")) g.top_p = f.number("top_p");
  if (f.has("top_k")) g.top_k = static_cast<int>(f.integer("top_k"));
  if (f.has("max_new_tokens")) g.max_new_tokens = static_cast<int>(f.integer("max_new_tokens"));
  if (f.has("do_sample")) g.do_sample = f.boolean("do_sample", false);
  return g;
}

json parse_config_text(const std::string& text, const std::string& where) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw Error(cat(where, ": invalid JSON: ", e.what()));
  }
}

static json parse_json_file(const std::string& path) { return parse_config_text(read_text_file(path), path); }

json load_config_json(const std::string& dir) {
  const std::string path = dir + "/config.json";
  check(file_exists(path), dir, ": no config.json (is this a Hugging Face model directory?)");
  return parse_json_file(path);
}

ModelConfig load_model_config(const std::string& dir) {
  return parse_model_config(load_config_json(dir), dir + "/config.json");
}

DraftConfig load_draft_config(const std::string& dir) {
  return parse_draft_config(load_config_json(dir), dir + "/config.json");
}

GenerationConfig load_generation_config(const std::string& dir) {
  const std::string path = dir + "/generation_config.json";
  if (!file_exists(path)) return {};
  return parse_generation_config(parse_json_file(path), path);
}

}  // namespace dflash
