// Checkpoints whose tensors do not fit their config: each gives an error
// naming the tensor (missing, wrong shape, missing untied lm_head).
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>

#include <nlohmann/json.hpp>

#include "formats/safetensors.h"
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

}  // namespace
}  // namespace dflash
