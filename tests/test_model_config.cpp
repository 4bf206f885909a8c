// config.json / generation_config.json parsing, including every error path
// that names a field, and the default DFlash target-layer rule.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "formats/model_config.h"
#include "model/dflash_draft.h"
#include "model/target_model.h"
#include "util/error.h"
#include "test_util.h"

namespace dflash {
namespace {

using nlohmann::json;
using test::fixture;

json qwen3_8b_legacy() {  // the real Qwen3-8B config.json fields (transformers 4.x spelling)
  return json::parse(R"({
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
    "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true,
    "use_sliding_window": false, "vocab_size": 151936})");
}

void expect_error(const json& j, const std::string& part, bool draft = false) {
  try {
    if (draft) parse_draft_config(j, "cfg.json");
    else parse_model_config(j, "cfg.json");
    FAIL() << "no error, expected one mentioning " << part;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cfg.json"), std::string::npos) << e.what();
  }
}

TEST(ModelConfig, Qwen3_8BLegacySpelling) {
  const ModelConfig c = parse_model_config(qwen3_8b_legacy(), "cfg.json");
  EXPECT_EQ(c.n_embd, 4096);
  EXPECT_EQ(c.n_layers, 36);
  EXPECT_EQ(c.n_heads, 32);
  EXPECT_EQ(c.n_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.n_ff, 12288);
  EXPECT_EQ(c.n_vocab, 151936);
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.tie_embeddings);
}

TEST(ModelConfig, Transformers5RopeParametersAndLlama3) {
  const ModelConfig c = load_model_config(fixture("targets/llama_gqa4_bias_sharded"));
  EXPECT_EQ(c.architecture, "LlamaForCausalLM");
  EXPECT_FALSE(c.qk_norm);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_EQ(c.rope.type, RopeType::Llama3);
  EXPECT_DOUBLE_EQ(c.rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(c.rope.factor, 8.0);
  EXPECT_EQ(c.rope.original_max_positions, 64);
  EXPECT_EQ(c.head_dim, 8);  // derived: hidden_size / num_attention_heads
  const ModelConfig q = load_model_config(fixture("targets/qwen3_gqa_tied"));
  EXPECT_TRUE(q.tie_embeddings);
  EXPECT_DOUBLE_EQ(q.rope.theta, 10000.0);
}

TEST(ModelConfig, LegacyLlama3RopeScaling) {
  json j = qwen3_8b_legacy();
  j["architectures"] = {"LlamaForCausalLM"};
  j["rope_scaling"] = {{"type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  const ModelConfig c = parse_model_config(j, "cfg.json");
  EXPECT_EQ(c.rope.type, RopeType::Llama3);
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
}

TEST(ModelConfig, ErrorsNameTheField) {
  auto without = [](const char* k) { json j = qwen3_8b_legacy(); j.erase(k); return j; };
  auto with = [](const char* k, json v) { json j = qwen3_8b_legacy(); j[k] = v; return j; };
  expect_error(without("hidden_size"), "'hidden_size'");
  expect_error(without("num_hidden_layers"), "'num_hidden_layers'");
  expect_error(without("vocab_size"), "'vocab_size'");
  expect_error(without("intermediate_size"), "'intermediate_size'");
  expect_error(without("architectures"), "'architectures'");
  expect_error(with("hidden_size", "4096"), "'hidden_size' must be an integer");
  expect_error(with("hidden_size", 0), "'hidden_size' must be positive");
  expect_error(with("hidden_size", 40.5), "'hidden_size' must be an integer");
  expect_error(with("rms_norm_eps", "x"), "'rms_norm_eps' must be a number");
  expect_error(with("tie_word_embeddings", 1), "'tie_word_embeddings' must be a boolean");
  expect_error(with("num_key_value_heads", 7), "not a multiple");
  expect_error(with("head_dim", 127), "even");
  expect_error(with("architectures", {"GPT2LMHeadModel"}), "unsupported architecture 'GPT2LMHeadModel'");
  expect_error(with("hidden_act", "gelu"), "unsupported hidden_act");
  expect_error(with("rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}), "unsupported rope type 'yarn'");
  expect_error(with("rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}}), "'low_freq_factor'");
  expect_error(with("use_sliding_window", true), "use_sliding_window");
  expect_error(json::array(), "expected a JSON object");
}

json qwen3_30b_a3b() {  // the published Qwen3-30B-A3B config.json fields
  return json::parse(R"({
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": true, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": false, "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "sliding_window": null, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
}

TEST(ModelConfig, Qwen3MoeRoutedLayers) {
  const ModelConfig c = parse_model_config(qwen3_30b_a3b(), "cfg.json");
  EXPECT_EQ(c.moe.n_experts, 128);
  EXPECT_EQ(c.moe.top_k, 8);
  EXPECT_EQ(c.moe.n_ff, 768);
  EXPECT_TRUE(c.moe.norm_topk_prob);
  EXPECT_EQ(c.n_ff, 6144);
  EXPECT_TRUE(c.qk_norm);
  ASSERT_EQ(c.moe_layer.size(), 48u);
  for (int i = 0; i < 48; ++i) EXPECT_TRUE(c.is_moe_layer(i)) << i;

  // decoder_sparse_step 2: layers 1, 3, 5, ... are routed; mlp_only_layers keeps 3 dense.
  json j = qwen3_30b_a3b();
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  j["norm_topk_prob"] = false;
  const ModelConfig d = parse_model_config(j, "cfg.json");
  EXPECT_FALSE(d.moe.norm_topk_prob);
  for (int i = 0; i < 48; ++i) EXPECT_EQ(d.is_moe_layer(i), i % 2 == 1 && i != 3) << i;

  // transformers 5 writes num_local_experts.
  json t5 = qwen3_30b_a3b();
  t5.erase("num_experts");
  t5["num_local_experts"] = 64;
  EXPECT_EQ(parse_model_config(t5, "cfg.json").moe.n_experts, 64);

  // A dense Qwen3 has no routed layers.
  EXPECT_FALSE(parse_model_config(qwen3_8b_legacy(), "cfg.json").is_moe_layer(0));
}

TEST(ModelConfig, Qwen3MoeErrorsNameTheKey) {
  auto with = [](const char* k, json v) {
    json j = qwen3_30b_a3b();
    if (v.is_null()) j.erase(k);
    else j[k] = v;
    return j;
  };
  expect_error(with("shared_expert_intermediate_size", 5632), "shared_expert_intermediate_size");
  expect_error(with("num_experts", nullptr), "num_experts");
  expect_error(with("num_experts_per_tok", 129), "num_experts_per_tok");
  expect_error(with("num_experts_per_tok", 0), "num_experts_per_tok");
  expect_error(with("moe_intermediate_size", nullptr), "moe_intermediate_size");
  expect_error(with("decoder_sparse_step", 0), "decoder_sparse_step");
  expect_error(with("mlp_only_layers", json::array({48})), "mlp_only_layers");
  expect_error(with("mlp_only_layers", "0"), "mlp_only_layers");
  expect_error(with("norm_topk_prob", 1), "norm_topk_prob");
  expect_error(with("use_sliding_window", true), "use_sliding_window");
  // A shared expert of size 0 is no shared expert.
  EXPECT_NO_THROW(parse_model_config(with("shared_expert_intermediate_size", 0), "cfg.json"));
}

// A Qwen3.5-27B-shaped multimodal config (the text model under text_config, as the hub has it).
json qwen3_5_multimodal() {
  return json::parse(R"({
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": false,
    "vision_config": {"depth": 27, "hidden_size": 1152},
    "text_config": {"model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408,
      "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
      "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
      "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
      "rms_norm_eps": 1e-06, "vocab_size": 248320, "max_position_embeddings": 262144, "hidden_act": "silu",
      "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                          "mrope_section": [11, 11, 10], "mrope_interleaved": true}}})");
}

TEST(ModelConfig, Qwen3_5HybridLayersFromTheMultimodalWrapper) {
  const ModelConfig c = parse_model_config(qwen3_5_multimodal(), "cfg.json");
  EXPECT_EQ(c.weight_prefix, "model.language_model.");
  EXPECT_TRUE(c.hybrid());
  int linear = 0;
  for (int i = 0; i < c.n_layers; ++i) linear += c.is_linear_layer(i);
  EXPECT_EQ(linear, 48);
  EXPECT_FALSE(c.is_linear_layer(3));
  EXPECT_TRUE(c.is_linear_layer(4));
  EXPECT_EQ(c.rotary_dim(), 64);
  EXPECT_EQ(c.linear.conv_dim(), 2 * 16 * 128 + 48 * 128);
  EXPECT_TRUE(c.attn_output_gate && c.zero_centred_norms && c.qk_norm);
  EXPECT_TRUE(c.moe_layer.empty());
  // The MoE text model: every layer routed plus a shared expert, top-k renormalized.
  json moe = qwen3_5_multimodal()["text_config"];
  moe.erase("intermediate_size");
  moe.update(json::parse(R"({"architectures": ["Qwen3_5MoeForCausalLM"], "num_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512})"));
  const ModelConfig m = parse_model_config(moe, "cfg.json");
  EXPECT_EQ(m.weight_prefix, "model.");
  EXPECT_TRUE(m.is_moe_layer(0) && m.is_moe_layer(63));
  EXPECT_TRUE(m.moe.norm_topk_prob);
  EXPECT_EQ(m.moe.shared_n_ff, 512);
}

TEST(ModelConfig, Qwen3_5ErrorsNameTheField) {
  auto with = [](const char* k, json v) {
    json j = qwen3_5_multimodal();
    if (v.is_null()) j["text_config"].erase(k);
    else j["text_config"][k] = v;
    return j;
  };
  expect_error(with("linear_num_value_heads", nullptr), "linear_num_value_heads");
  expect_error(with("linear_num_value_heads", 40), "linear_num_value_heads");
  expect_error(with("linear_conv_kernel_dim", 0), "linear_conv_kernel_dim");
  expect_error(with("layer_types", json::array({"linear_attention"})), "layer_types");
  json bad_type = json::array();
  for (int i = 0; i < 64; ++i) bad_type.push_back(i == 5 ? "mamba" : "full_attention");
  expect_error(with("layer_types", bad_type), "mamba");
  json rope = qwen3_5_multimodal()["text_config"]["rope_parameters"];
  rope["partial_rotary_factor"] = 1.5;
  expect_error(with("rope_parameters", rope), "partial_rotary_factor");
  json no_text = qwen3_5_multimodal();
  no_text.erase("text_config");
  expect_error(no_text, "text_config");
}

// Qwen3-Next-80B-A3B's config as the hub has it (flat: rope_theta and partial_rotary_factor at the
// top, full_attention_interval).
json qwen3_next() {
  return json::parse(R"({
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
    "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "norm_topk_prob": true, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "rope_theta": 10000000, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
    "vocab_size": 151936, "max_position_embeddings": 262144, "hidden_act": "silu", "tie_word_embeddings": false})");
}

TEST(ModelConfig, Qwen3NextLayers) {
  const ModelConfig c = parse_model_config(qwen3_next(), "cfg.json");
  EXPECT_EQ(c.weight_prefix, "model.");
  EXPECT_TRUE(c.hybrid() && c.attn_output_gate && c.zero_centred_norms && c.qk_norm);
  EXPECT_TRUE(c.is_linear_layer(0) && !c.is_linear_layer(3) && c.is_linear_layer(46) && !c.is_linear_layer(47));
  EXPECT_EQ(c.rotary_dim(), 64);
  EXPECT_TRUE(c.is_moe_layer(0) && c.is_moe_layer(47));
  EXPECT_TRUE(c.moe.norm_topk_prob);
  EXPECT_EQ(c.moe.shared_n_ff, 512);
  EXPECT_EQ(c.moe.top_k, 10);
  // Dense layers where decoder_sparse_step and mlp_only_layers say so; the top-k as configured.
  json j = qwen3_next();
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {5};
  j["norm_topk_prob"] = false;
  j["shared_expert_intermediate_size"] = 0;
  const ModelConfig d = parse_model_config(j, "cfg.json");
  EXPECT_FALSE(d.is_moe_layer(0));
  EXPECT_TRUE(d.is_moe_layer(1) && d.is_moe_layer(3));
  EXPECT_FALSE(d.is_moe_layer(5));
  EXPECT_EQ(d.n_ff, 5120);
  EXPECT_FALSE(d.moe.norm_topk_prob);
  EXPECT_EQ(d.moe.shared_n_ff, 0);
  // No experts: every layer dense.
  j = qwen3_next();
  j["num_experts"] = 0;
  EXPECT_TRUE(parse_model_config(j, "cfg.json").moe_layer.empty());
}

TEST(ModelConfig, Qwen3NextErrorsNameTheField) {
  json j = qwen3_next();
  j["mlp_only_layers"] = {2};
  j.erase("intermediate_size");
  expect_error(j, "intermediate_size");  // a dense layer needs it
  j = qwen3_next();
  j["num_experts"] = -1;
  expect_error(j, "num_experts");
  j = qwen3_next();
  j["shared_expert_intermediate_size"] = -4;
  expect_error(j, "shared_expert_intermediate_size");
  j = qwen3_next();
  j["attention_bias"] = true;
  expect_error(j, "attention_bias");
  j = qwen3_next();
  j.erase("linear_key_head_dim");
  expect_error(j, "linear_key_head_dim");
}

TEST(DraftConfig, DefaultTargetLayerIdsRoundHalfToEven) {
  EXPECT_EQ(default_target_layer_ids(36, 5), (std::vector<int>{1, 9, 17, 25, 33}));
  EXPECT_EQ(default_target_layer_ids(36, 1), (std::vector<int>{18}));
  EXPECT_EQ(default_target_layer_ids(9, 3), (std::vector<int>{1, 4, 6}));  // 3.5 -> 4
  EXPECT_EQ(default_target_layer_ids(7, 3), (std::vector<int>{1, 2, 4}));  // 2.5 -> 2
  EXPECT_EQ(default_target_layer_ids(6, 2), (std::vector<int>{1, 3}));
}

TEST(DraftConfig, FixturesAndZLabShape) {
  const DraftConfig d = load_draft_config(fixture("drafts/llama_l2_window"));
  EXPECT_EQ(d.block_size, 8);
  EXPECT_EQ(d.mask_token_id, 255);
  EXPECT_EQ(d.target_layer_ids, (std::vector<int>{0, 2}));
  EXPECT_EQ(d.layers.sliding_window, (std::vector<int>{5, 0}));
  const DraftConfig t = load_draft_config(fixture("drafts/trained_qwen3_b16"));
  EXPECT_EQ(t.target_layer_ids, (std::vector<int>{1, 3}));  // default rule, 6 target layers
  json z = qwen3_8b_legacy();
  z["architectures"] = {"DFlashDraftModel"};
  z["num_hidden_layers"] = 5;
  z["block_size"] = 16;
  z["num_target_layers"] = 36;
  z["dflash_config"] = {{"mask_token_id", 151669}};
  const DraftConfig zd = parse_draft_config(z, "cfg.json");
  EXPECT_EQ(zd.target_layer_ids, (std::vector<int>{1, 9, 17, 25, 33}));
  EXPECT_EQ(zd.mask_token_id, 151669);
  z.erase("dflash_config");
  expect_error(z, "'dflash_config'", true);
  z["dflash_config"] = {{"mask_token_id", 1}, {"target_layer_ids", {1, 40}}};
  expect_error(z, "target layer id 40", true);
  z["dflash_config"] = {{"target_layer_ids", {1}}};
  expect_error(z, "'mask_token_id'", true);
  z["dflash_config"] = {{"mask_token_id", 1}};
  z.erase("block_size");
  expect_error(z, "'block_size'", true);
  expect_error(qwen3_8b_legacy(), "not a DFlash draft", true);
}

TEST(DraftConfig, DraftMustFitItsTarget) {
  auto be = make_cpu_backend();
  TargetModel target(*be, fixture("targets/qwen3_gqa_tied"));
  try {
    DraftModel d(*be, fixture("drafts/llama_l2_window"), target);
    FAIL() << "a draft for another target was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_target_layers"), std::string::npos) << e.what();
  }
}

TEST(GenerationConfig, EosIntOrList) {
  EXPECT_EQ(parse_generation_config(json{{"eos_token_id", 7}}, "g").eos_token_ids, (std::vector<int>{7}));
  EXPECT_EQ(parse_generation_config(json{{"eos_token_id", {1, 2}}, {"bos_token_id", 3}}, "g").eos_token_ids,
            (std::vector<int>{1, 2}));
  EXPECT_THROW(parse_generation_config(json{{"eos_token_id", "x"}}, "g"), Error);
  EXPECT_EQ(load_generation_config(fixture("targets/qwen3_gqa_tied")).eos_token_ids, (std::vector<int>{0}));
}

}  // namespace
}  // namespace dflash
