// Checkpoints whose tensors do not fit their config: each gives an error
// naming the tensor (missing, wrong shape, missing untied lm_head).
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>

#include <nlohmann/json.hpp>

#include "formats/safetensors.h"
#include "model/forward_batch.h"
#include "model/target_model.h"
#include "util/error.h"
#include "test_util.h"

namespace dflash {
namespace {

using nlohmann::json;

// Copies the fixture checkpoint `name` into `dir`, letting `edit` drop (return
// false) or reshape tensors, and `edit_config` change config.json.
void copy_checkpoint(const std::string& name, const test::TempDir& dir,
                     const std::function<bool(const std::string&, std::vector<int64_t>&, size_t&)>& edit,
                     const std::function<void(json&)>& edit_config = {}) {
  const std::string src = test::fixture("targets/" + name);
  const TensorStore store = TensorStore::open(src);
  json header = json::object();
  std::string data;
  for (const auto& t : store.all()) {
    std::vector<int64_t> shape = t.shape;
    size_t n_bytes = t.n_bytes;
    if (!edit(t.name, shape, n_bytes)) continue;
    const size_t begin = data.size();
    data.append(reinterpret_cast<const char*>(t.data), std::min(n_bytes, t.n_bytes));
    data.resize(begin + n_bytes);
    header[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", shape}, {"data_offsets", {begin, data.size()}}};
  }
  test::write_file(dir.file("model.safetensors"), test::safetensors_bytes(header.dump(), data));
  json cfg = test::read_json(src + "/config.json");
  if (edit_config) edit_config(cfg);
  test::write_file(dir.file("config.json"), cfg.dump());
}

void expect_load_error(const test::TempDir& dir, const std::vector<std::string>& parts) {
  auto be = make_cpu_backend();
  try {
    TargetModel m(*be, dir.path());
    FAIL() << "checkpoint loaded";
  } catch (const Error& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

TEST(ModelLoading, UnchangedCopyLoads) {
  test::TempDir dir;
  copy_checkpoint("qwen3_gqa_tied", dir, [](auto&, auto&, auto&) { return true; });
  auto be = make_cpu_backend();
  EXPECT_NO_THROW(TargetModel(*be, dir.path()));
}

TEST(ModelLoading, MissingTensorIsNamed) {
  test::TempDir dir;
  copy_checkpoint("qwen3_gqa_tied", dir, [](const std::string& n, auto&, auto&) {
    return n != "model.layers.2.mlp.down_proj.weight";
  });
  expect_load_error(dir, {"missing tensor 'model.layers.2.mlp.down_proj.weight'"});
}

TEST(ModelLoading, WrongShapeIsNamed) {
  test::TempDir dir;
  copy_checkpoint("qwen3_gqa_tied", dir, [](const std::string& n, std::vector<int64_t>& shape, size_t& bytes) {
    if (n == "model.layers.1.self_attn.k_proj.weight") {
      shape[0] += 1;  // one more row than num_key_value_heads * head_dim
      bytes += shape[1] * 4;
    }
    return true;
  });
  expect_load_error(dir, {"model.layers.1.self_attn.k_proj.weight", "[33, 64]", "expected [32, 64]"});
}

TEST(ModelLoading, UntiedConfigNeedsLmHead) {
  test::TempDir dir;
  copy_checkpoint("qwen3_gqa_tied", dir, [](auto&, auto&, auto&) { return true; },
                  [](json& cfg) { cfg["tie_word_embeddings"] = false; });
  expect_load_error(dir, {"missing tensor 'lm_head.weight'"});
}

TEST(ModelLoading, ConfigThatDisagreesWithTensors) {
  test::TempDir dir;
  copy_checkpoint("qwen3_gqa_tied", dir, [](auto&, auto&, auto&) { return true; },
                  [](json& cfg) { cfg["intermediate_size"] = 100; });
  expect_load_error(dir, {"mlp.gate_proj.weight", "expected [100, 64]"});
}

TEST(ModelLoading, MissingExpertIsNamed) {
  test::TempDir dir;
  copy_checkpoint("qwen3_moe_tied", dir, [](const std::string& n, auto&, auto&) {
    return n != "model.layers.2.mlp.experts.5.up_proj.weight";
  });
  expect_load_error(dir, {"missing tensor 'model.layers.2.mlp.experts.5.up_proj.weight'"});
}

TEST(ModelLoading, RoutedLayerListedAsDenseIsNamed) {
  // mlp_only_layers says layer 2 is dense, but the checkpoint has experts there.
  test::TempDir dir;
  copy_checkpoint("qwen3_moe_tied", dir, [](auto&, auto&, auto&) { return true; },
                  [](json& cfg) { cfg["mlp_only_layers"] = {1, 2}; });
  expect_load_error(dir, {"missing tensor 'model.layers.2.mlp.gate_proj.weight'"});
}

std::vector<float> prefill_logits(const std::string& dir, const std::vector<int32_t>& ids) {
  auto be = make_cpu_backend();
  TargetModel m(*be, dir);
  KvCache cache = m.alloc_cache(2, 16);
  std::vector<int32_t> pages = {1, 0};
  ForwardBatch b(16);
  b.add_sequence(ids, 0, pages, true, {0});
  for (int32_t r = 0; r < b.n_rows(); ++r) b.logit_rows.push_back(r);
  return be->to_host(m.forward(b, cache).logits);
}

// Qwen3_5ForConditionalGeneration as transformers writes it (language model under
// model.language_model., a vision tower) gives the text model's logits exactly.
TEST(ModelLoading, MultimodalQwen3_5LoadsItsLanguageModel) {
  const std::vector<int32_t> ids = {5, 17, 200, 3, 99, 41, 7};
  const auto text = prefill_logits(test::fixture("targets/qwen3_5_tied"), ids);
  const auto wrapped = prefill_logits(test::fixture("targets/qwen3_5_vl_tied"), ids);
  EXPECT_EQ(text, wrapped);
}

TEST(ModelLoading, MissingLinearAttentionTensorIsNamed) {
  test::TempDir dir;
  copy_checkpoint("qwen3_5_tied", dir, [](const std::string& n, auto&, auto&) {
    return n != "model.layers.2.linear_attn.A_log";
  });
  expect_load_error(dir, {"missing tensor 'model.layers.2.linear_attn.A_log'"});
  test::TempDir wrong;
  copy_checkpoint("qwen3_5_tied", wrong, [](auto&, auto&, auto&) { return true; },
                  [](json& cfg) { cfg["linear_conv_kernel_dim"] = 3; });
  expect_load_error(wrong, {"model.layers.0.linear_attn.conv1d.weight", "expected [96, 1, 3]"});
}

// The experts stacked as transformers 5 holds them in memory (mlp.experts.gate_up_proj
// [E, 2 * ff, h], mlp.experts.down_proj [E, h, ff]) load to the same model as the per-expert files.
TEST(ModelLoading, StackedExpertsEqualPerExpertTensors) {
  const std::string src = test::fixture("targets/qwen3_moe_tied");
  const TensorStore store = TensorStore::open(src);
  const json cfg = test::read_json(src + "/config.json");
  const int n_experts = cfg.value("num_local_experts", cfg.value("num_experts", 0));
  json header = json::object();
  std::string data;
  auto add = [&](const std::string& name, const TensorInfo& like, std::vector<int64_t> shape,
                 const std::vector<const TensorInfo*>& parts) {
    const size_t begin = data.size();
    for (const TensorInfo* p : parts) data.append(reinterpret_cast<const char*>(p->data), p->n_bytes);
    header[name] = {{"dtype", dtype_name(like.dtype)}, {"shape", shape}, {"data_offsets", {begin, data.size()}}};
  };
  int stacked_layers = 0;
  for (const auto& t : store.all()) {
    const auto at = t.name.find(".mlp.experts.");
    if (at == std::string::npos) {
      add(t.name, t, t.shape, {&t});
      continue;
    }
    if (t.name.find(".experts.0.gate_proj.") == std::string::npos) continue;  // one stacked pair per layer
    const std::string p = t.name.substr(0, at) + ".mlp.experts.";
    std::vector<const TensorInfo*> gate_up, down;
    for (int e = 0; e < n_experts; ++e) {
      gate_up.push_back(&store.get(p + std::to_string(e) + ".gate_proj.weight"));
      gate_up.push_back(&store.get(p + std::to_string(e) + ".up_proj.weight"));
      down.push_back(&store.get(p + std::to_string(e) + ".down_proj.weight"));
    }
    add(p + "gate_up_proj", t, {n_experts, 2 * t.shape[0], t.shape[1]}, gate_up);
    add(p + "down_proj", t, {n_experts, t.shape[1], t.shape[0]}, down);
    ++stacked_layers;
  }
  ASSERT_GE(stacked_layers, 2);
  test::TempDir dir;
  test::write_file(dir.file("model.safetensors"), test::safetensors_bytes(header.dump(), data));
  test::write_file(dir.file("config.json"), cfg.dump());
  const std::vector<int32_t> ids = {5, 17, 200, 3, 99, 42, 7};
  EXPECT_EQ(prefill_logits(dir.path(), ids), prefill_logits(src, ids));
}

// Qwen3-Next's fused linear-attention projections: in_proj_qkvz holds per key head g its q, k, then
// the v and z rows of its value heads; in_proj_ba per key head the b rows of its value heads, then
// their a rows. Qwen3.5's separate projections regrouped so (and the config renamed) load to the
// same model: the same logits, bit for bit.
TEST(ModelLoading, FusedQwen3NextProjectionsEqualQwen3_5Separate) {
  const std::string src = test::fixture("targets/qwen3_5_tied");
  const TensorStore store = TensorStore::open(src);
  json cfg = test::read_json(src + "/config.json");
  const int64_t nk = cfg["linear_num_key_heads"], nv = cfg["linear_num_value_heads"];
  const int64_t dk = cfg["linear_key_head_dim"], dv = cfg["linear_value_head_dim"], r = nv / nk;
  ASSERT_GT(r, 1);  // the interleaving of value heads is exercised
  json header = json::object();
  std::string data;
  // Rows [first, first + n) of `t`.
  auto rows = [&](const TensorInfo& t, int64_t first, int64_t n) {
    const size_t row_bytes = static_cast<size_t>(t.shape[1]) * dtype_size(t.dtype);
    data.append(reinterpret_cast<const char*>(t.data) + first * row_bytes, n * row_bytes);
  };
  auto close = [&](const std::string& name, const TensorInfo& like, int64_t n_rows, size_t begin) {
    header[name] = {{"dtype", dtype_name(like.dtype)}, {"shape", {n_rows, like.shape[1]}},
                    {"data_offsets", {begin, data.size()}}};
  };
  int fused = 0;
  for (const auto& t : store.all()) {
    const auto at = t.name.find("linear_attn.in_proj_");
    if (at == std::string::npos) {
      const size_t begin = data.size();
      data.append(reinterpret_cast<const char*>(t.data), t.n_bytes);
      header[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {begin, data.size()}}};
      continue;
    }
    if (t.name.substr(at) != "linear_attn.in_proj_qkv.weight") continue;  // one fused pair per layer
    const std::string p = t.name.substr(0, at) + "linear_attn.";
    const TensorInfo &z = store.get(p + "in_proj_z.weight"), &b = store.get(p + "in_proj_b.weight"),
                     &a = store.get(p + "in_proj_a.weight");
    size_t begin = data.size();
    for (int64_t g = 0; g < nk; ++g) {
      rows(t, g * dk, dk);                          // q
      rows(t, nk * dk + g * dk, dk);                // k
      rows(t, 2 * nk * dk + g * r * dv, r * dv);    // v of value heads g * r ..
      rows(z, g * r * dv, r * dv);                  // z of the same heads
    }
    close(p + "in_proj_qkvz.weight", t, 2 * nk * dk + 2 * nv * dv, begin);
    begin = data.size();
    for (int64_t g = 0; g < nk; ++g) {
      rows(b, g * r, r);
      rows(a, g * r, r);
    }
    close(p + "in_proj_ba.weight", b, 2 * nv, begin);
    ++fused;
  }
  ASSERT_GE(fused, 2);
  cfg["architectures"] = {"Qwen3NextForCausalLM"};
  cfg["model_type"] = "qwen3_next";
  test::TempDir dir;
  test::write_file(dir.file("model.safetensors"), test::safetensors_bytes(header.dump(), data));
  test::write_file(dir.file("config.json"), cfg.dump());
  const std::vector<int32_t> ids = {5, 17, 200, 3, 99, 42, 7, 8, 1};
  EXPECT_EQ(prefill_logits(dir.path(), ids), prefill_logits(src, ids));
}

}  // namespace
}  // namespace dflash
