// Fuzz target: config.json and generation_config.json readers. Each input is
// read as a target config, a draft config and a generation config; each must
// give a consistent config or fail with dflash::Error.
#include <cmath>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "formats/model_config.h"
#include "util/error.h"

namespace {

void check_layers(const dflash::ModelConfig& c) {
  if (c.n_embd <= 0 || c.n_layers <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 || c.head_dim <= 0) __builtin_trap();
  // Every layer's MLP has a width: intermediate_size when dense, moe_intermediate_size when
  // routed (a Qwen3.5-MoE config routes every layer and has no intermediate_size).
  for (int i = 0; i < c.n_layers; ++i) {
    if ((c.is_moe_layer(i) ? c.moe.n_ff : c.n_ff) <= 0) __builtin_trap();
  }
  if (c.n_heads % c.n_kv_heads != 0 || c.head_dim % 2 != 0 || c.max_positions <= 0) __builtin_trap();
  if (static_cast<int>(c.sliding_window.size()) != c.n_layers) __builtin_trap();
  for (int w : c.sliding_window) {
    if (w < 0) __builtin_trap();
  }
  if (!(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps > 0)) __builtin_trap();
  if (!(std::isfinite(c.rope.theta) && c.rope.theta > 0)) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  nlohmann::json j;
  try {
    j = dflash::parse_config_text(text, "config.json");
  } catch (const dflash::Error&) {
    return 0;
  }
  try {
    const auto c = dflash::parse_model_config(j, "config.json");
    check_layers(c);
    if (c.n_vocab <= 0) __builtin_trap();
  } catch (const dflash::Error&) {
  }
  try {
    const auto d = dflash::parse_draft_config(j, "config.json");
    check_layers(d.layers);
    if (d.block_size < 2 || d.target_layer_ids.empty()) __builtin_trap();
    for (int id : d.target_layer_ids) {
      if (id < 0 || id >= d.n_target_layers) __builtin_trap();
    }
  } catch (const dflash::Error&) {
  }
  try {
    (void)dflash::parse_generation_config(j, "generation_config.json");
  } catch (const dflash::Error&) {
  }
  return 0;
}
