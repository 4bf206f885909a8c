// The engine on the GPU: target logits track the CPU reference, DFlash greedy
// output equals plain greedy output token for token (random pairs and the
// bundled pair, 20 prompts each), and so does sampled output with the match
// scheme (top-k candidates selected on the GPU). Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <random>

#include "engine/engine.h"
#include "kernels/backend.h"
#include "model/target_model.h"
#include "test_util.h"

namespace dflash {
namespace {

using test::fixture;

class CudaEngine : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU here: GPU tests run on the device (scripts/device-test.sh)";
  }
};

std::vector<float> prefill_logits(Backend& be, const std::string& dir, const std::vector<int32_t>& prompt) {
  TargetModel m(be, dir);
  KvCache cache = m.alloc_cache(8, 16);
  std::vector<int32_t> table{0, 1, 2, 3, 4, 5, 6, 7};
  ForwardBatch b(16);
  b.add_sequence(prompt, 0, table);
  for (int32_t r = 0; r < b.n_rows(); ++r) b.logit_rows.push_back(r);
  return be.to_host(m.forward(b, cache).logits);
}

TEST_F(CudaEngine, TargetLogitsTrackTheCpuBackend) {
  auto gpu = make_cuda_backend();
  auto cpu = make_cpu_backend();
  std::mt19937 rng(7);
  for (const char* name : {"qwen3_gqa_tied", "qwen3_mha_untied_bf16", "llama_gqa4_bias_sharded", "trained_qwen3"}) {
    const std::string dir = fixture(std::string("targets/") + name);
    std::vector<int32_t> prompt(100);
    for (auto& t : prompt) t = static_cast<int32_t>(rng() % 256);
    const double err = test::rel_l2_error(prefill_logits(*gpu, dir, prompt), prefill_logits(*cpu, dir, prompt));
    std::printf("[%s] prefill logits, 100 tokens: rel. L2 error %.2e vs the fp32 CPU backend\n", name, err);
    EXPECT_LE(err, 2e-2) << name;
  }
}

// Runs plain and DFlash greedy decoding on `prompts` and requires identical tokens.
double expect_lossless(Engine& engine, const std::vector<std::vector<int32_t>>& prompts, int max_tokens,
                       const std::vector<int32_t>& eos, const std::string& what) {
  long produced = 0, steps = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerateOptions go;
    go.max_tokens = max_tokens;
    go.eos_ids = eos;
    go.mode = SpeculativeMode::None;
    const auto plain = engine.generate(prompts[i], go);
    go.mode = SpeculativeMode::DFlash;
    const auto spec = engine.generate(prompts[i], go);
    EXPECT_EQ(spec.tokens, plain.tokens) << what << ": DFlash differs from plain greedy on the GPU, prompt " << i;
    for (size_t a = 0; a < spec.stats.acceptance_histogram.size(); ++a)
      produced += static_cast<long>(a + 1) * spec.stats.acceptance_histogram[a];
    steps += spec.stats.n_steps;
  }
  const double tau = steps ? static_cast<double>(produced) / steps : 0.0;
  std::printf("[%s] %zu prompts identical on the GPU, tau %.3f\n", what.c_str(), prompts.size(), tau);
  return tau;
}

TEST_F(CudaEngine, DFlashEqualsPlainGreedyForFixturePairs) {
  for (const char* name : {"qwen3_gqa_tied", "qwen3_mha_untied_bf16", "llama_gqa4_bias_sharded", "trained_qwen3"}) {
    const auto meta = test::read_json(fixture(std::string("expected/") + name + ".json"));
    EngineOptions eo;
    eo.device = "cuda";
    eo.model_dir = fixture(meta["target"].get<std::string>());
    eo.draft_dir = fixture(meta["draft"].get<std::string>());
    Engine engine(eo);
    expect_lossless(engine, meta["prompts"].get<std::vector<std::vector<int32_t>>>(), meta["max_new_tokens"].get<int>(),
                    meta["eos_ids"].get<std::vector<int32_t>>(), name);
  }
}

TEST_F(CudaEngine, DFlashEqualsPlainGreedyForTheBundledPair) {
  const auto ref = test::read_json(fixture("expected/pycoder16m_humaneval.json"));
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& row : ref["rows"]) prompts.push_back(row["prompt_ids"].get<std::vector<int32_t>>());
  for (size_t i = 0; prompts.size() < 20; ++i) {  // and prefixes of them, cut mid-line
    const auto& p = prompts[i];
    prompts.emplace_back(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(p.size() * 2 / 3));
  }
  EngineOptions eo;
  eo.device = "cuda";
  eo.model_dir = test::models_dir() + "/pycoder-16m";
  eo.draft_dir = test::models_dir() + "/pycoder-16m-dflash-b16";
  Engine engine(eo);
  const double tau = expect_lossless(engine, prompts, ref["max_tokens"].get<int>(), {}, "bundled pair");
  EXPECT_GT(tau, 3.0);
}

TEST_F(CudaEngine, DFlashMatchSchemeEqualsPlainSamplingWithTopKOnTheGpu) {
  setenv("DFLASH_GPU_TOP_K", "1", 1);  // top-k candidates selected on the device
  const auto ref = test::read_json(fixture("expected/pycoder16m_humaneval.json"));
  EngineOptions eo;
  eo.device = "cuda";
  eo.model_dir = test::models_dir() + "/pycoder-16m";
  eo.draft_dir = test::models_dir() + "/pycoder-16m-dflash-b16";
  Engine engine(eo);
  long steps = 0, produced = 0;
  int i = 0;
  for (const auto& row : ref["rows"]) {
    const auto prompt = row["prompt_ids"].get<std::vector<int32_t>>();
    GenerateOptions go;
    go.max_tokens = 64;
    // top-k on the device (20, 50), on the host (0: every token); with and without top-p.
    go.sampling = {i % 2 ? 0.6f : 1.0f, i % 3 == 0 ? 0 : i % 3 == 1 ? 20 : 50, i % 4 < 2 ? 0.95f : 1.0f,
                   static_cast<uint64_t>(500 + i)};
    go.mode = SpeculativeMode::None;
    const auto plain = engine.generate(prompt, go);
    go.mode = SpeculativeMode::DFlash;
    const auto spec = engine.generate(prompt, go);
    EXPECT_EQ(spec.tokens, plain.tokens) << "prompt " << i;
    steps += spec.stats.n_steps;
    produced += static_cast<long>(std::lround(spec.stats.tau * spec.stats.n_steps));
    ++i;
  }
  std::printf("[bundled pair] %d prompts sampled: DFlash (match) identical to plain sampling on the GPU, tau %.3f\n",
              i, steps ? static_cast<double>(produced) / steps : 0.0);
}

}  // namespace
}  // namespace dflash
