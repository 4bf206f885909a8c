// `dflash inspect DIR`: configuration summary and tensor inventory.
#include <cstdio>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "formats/model_config.h"
#include "formats/safetensors.h"
#include "util/error.h"

namespace dflash::cli {

namespace {

std::string join(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return "[" + s + "]";
}

void print_layers(const ModelConfig& c) {
  std::printf("hidden_size:        %d\n", c.n_embd);
  std::printf("layers:             %d\n", c.n_layers);
  std::printf("heads (q / kv):     %d / %d, head_dim %d\n", c.n_heads, c.n_kv_heads, c.head_dim);
  std::printf("intermediate_size:  %d\n", c.n_ff);
  std::printf("rms_norm_eps:       %g\n", c.rms_norm_eps);
  std::printf("rope:               %s, theta %g", c.rope.type == RopeType::Llama3 ? "llama3" : "default", c.rope.theta);
  if (c.rope.type == RopeType::Llama3) {
    std::printf(" (factor %g, low %g, high %g, original %lld)", c.rope.factor, c.rope.low_freq_factor,
                c.rope.high_freq_factor, static_cast<long long>(c.rope.original_max_positions));
  }
  if (c.rope.partial_rotary_factor < 1) std::printf(", rotating %d of %d dims", c.rotary_dim(), c.head_dim);
  std::printf("\nmax positions:      %d\n", c.max_positions);
  bool any_window = false;
  for (int w : c.sliding_window) any_window |= w > 0;
  if (any_window) std::printf("sliding windows:    %s\n", join(c.sliding_window).c_str());
}

}  // namespace

Command add_inspect(CLI::App& app) {
  auto dir = std::make_shared<std::string>();
  app.add_option("dir", *dir, "checkpoint directory")->required();
  return [dir] {
    const nlohmann::json j = load_config_json(*dir);
    const std::string where = *dir + "/config.json";
    const bool is_draft = j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty() &&
                          j["architectures"][0].is_string() &&
                          is_draft_architecture(j["architectures"][0].get<std::string>());
    if (is_draft) {
      const DraftConfig d = parse_draft_config(j, where);
      std::printf("architecture:       %s (DFlash draft)\n", d.layers.architecture.c_str());
      print_layers(d.layers);
      std::printf("block size:         %d\n", d.block_size);
      std::printf("mask token id:      %d\n", d.mask_token_id);
      std::printf("target layers:      %s of %d\n", join(d.target_layer_ids).c_str(), d.n_target_layers);
    } else {
      const ModelConfig c = parse_model_config(j, where);
      std::printf("architecture:       %s\n", c.architecture.c_str());
      std::printf("vocab_size:         %d\n", c.n_vocab);
      print_layers(c);
      std::printf("q/k norm:           %s\n", c.qk_norm ? "yes" : "no");
      std::printf("attention bias:     %s, mlp bias: %s\n", c.attention_bias ? "yes" : "no", c.mlp_bias ? "yes" : "no");
      std::printf("tied embeddings:    %s\n", c.tie_embeddings ? "yes" : "no");
      if (!c.moe_layer.empty()) {
        std::vector<int> routed;
        for (int i = 0; i < c.n_layers; ++i)
          if (c.is_moe_layer(i)) routed.push_back(i);
        std::printf("experts:            top %d of %d, %d features each, weights %s\n", c.moe.top_k, c.moe.n_experts,
                    c.moe.n_ff, c.moe.norm_topk_prob ? "renormalized" : "as routed");
        std::printf("routed layers:      %zu of %d (%s)\n", routed.size(), c.n_layers, join(routed).c_str());
        if (c.moe.shared_n_ff > 0) std::printf("shared expert:      %d features, sigmoid-gated\n", c.moe.shared_n_ff);
      }
      if (c.hybrid()) {
        std::vector<int> attention;
        for (int i = 0; i < c.n_layers; ++i)
          if (!c.is_linear_layer(i)) attention.push_back(i);
        const LinearAttentionConfig& l = c.linear;
        std::printf("gated attention:    layers %s (output gate, zero-centred norms)\n", join(attention).c_str());
        std::printf("Gated DeltaNet:     %d layers, %d key / %d value heads of %d / %d, convolution %d\n",
                    c.n_layers - static_cast<int>(attention.size()), l.n_k_heads, l.n_v_heads, l.k_dim, l.v_dim,
                    l.conv_kernel);
      }
      const GenerationConfig g = load_generation_config(*dir);
      std::vector<int> eos(g.eos_token_ids.begin(), g.eos_token_ids.end());
      std::printf("eos token ids:      %s\n", join(eos).c_str());
    }
    const TensorStore store = TensorStore::open(*dir);
    std::printf("\n%-56s %-5s %-18s %12s\n", "tensor", "dtype", "shape", "bytes");
    for (const auto& t : store.all()) {
      std::printf("%-56s %-5s %-18s %12zu\n", t.name.c_str(), dtype_name(t.dtype), t.shape_str().c_str(), t.n_bytes);
    }
    std::printf("%zu tensors, %zu bytes (%.2f MB)\n", store.all().size(), store.total_bytes(), store.total_bytes() / 1e6);
    return 0;
  };
}

}  // namespace dflash::cli
