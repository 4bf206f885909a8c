// Losslessness: DFlash greedy output == plain greedy output, token for token,
// for several target/draft pairs, 20 prompts each, block sizes 4, 8 and 16;
// and a trained pair whose drafts are actually accepted.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "engine/engine.h"
#include "test_util.h"

namespace dflash {
namespace {

using test::fixture;

GenerationResult run(Engine& e, const std::vector<int32_t>& prompt, int max_tokens, const std::vector<int32_t>& eos,
                     SpeculativeMode mode) {
  GenerateOptions go;
  go.max_tokens = max_tokens;
  go.eos_ids = eos;
  go.mode = mode;
  return e.generate(prompt, go);
}

class LosslessTest : public ::testing::TestWithParam<std::string> {};

TEST_P(LosslessTest, DFlashEqualsPlainGreedyForBlockSizes4And8And16) {
  const auto meta = test::read_json(fixture("expected/" + GetParam() + ".json"));
  const auto prompts = meta["prompts"].get<std::vector<std::vector<int32_t>>>();
  const auto greedy = meta["greedy"].get<std::vector<std::vector<int32_t>>>();
  const auto eos = meta["eos_ids"].get<std::vector<int32_t>>();
  const int max_tokens = meta["max_new_tokens"].get<int>();
  ASSERT_GE(prompts.size(), 20u);
  for (int block : {4, 8, 16}) {
    EngineOptions eo;
    eo.model_dir = fixture(meta["target"].get<std::string>());
    eo.draft_dir = fixture(meta["draft"].get<std::string>());
    eo.block_size = block;
    eo.page_size = block == 8 ? 3 : 16;  // odd page sizes exercise page boundaries
    Engine engine(eo);
    long accepted = 0, steps = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const auto plain = run(engine, prompts[i], max_tokens, eos, SpeculativeMode::None);
      const auto spec = run(engine, prompts[i], max_tokens, eos, SpeculativeMode::DFlash);
      ASSERT_EQ(plain.tokens, greedy[i]) << "plain greedy differs from the reference, prompt " << i;
      ASSERT_EQ(spec.tokens, plain.tokens) << "DFlash output differs from plain greedy, block " << block << ", prompt "
                                           << i;
      const auto& hist = spec.stats.acceptance_histogram;
      for (size_t a = 0; a < hist.size(); ++a) accepted += static_cast<long>(a + 1) * hist[a];
      steps += spec.stats.n_steps;
    }
    const double tau = steps ? static_cast<double>(accepted) / steps : 0.0;
    std::printf("[%s] block %d: %zu prompts identical, tau %.3f over %ld steps\n", GetParam().c_str(), block,
                prompts.size(), tau, steps);
    const std::string key = "tau_b" + std::to_string(block);
    if (meta.contains(key)) {
      // The trained pair: drafts must be accepted, as often as in the PyTorch reference.
      const double ref_tau = meta[key].get<double>();
      std::printf("[%s] block %d: reference tau %.3f\n", GetParam().c_str(), block, ref_tau);
      EXPECT_GT(tau, 1.5);
      EXPECT_NEAR(tau, ref_tau, 0.02 * ref_tau);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Pairs, LosslessTest,
                         ::testing::Values("qwen3_gqa_tied", "qwen3_mha_untied_bf16", "llama_gqa4_bias_sharded",
                                           "trained_qwen3", "qwen3_moe_tied", "qwen3_moe_untied_bf16",
                                           "trained_qwen3_moe", "qwen3_5_tied", "qwen3_5_moe_untied_bf16",
                                           "trained_qwen3_5", "qwen3_next_untied"));

TEST(LosslessTest, TrainedPairAcceptanceLengthsMatchReference) {
  const auto meta = test::read_json(fixture("expected/trained_qwen3.json"));
  const auto prompts = meta["prompts"].get<std::vector<std::vector<int32_t>>>();
  const auto ref = meta["dflash_acceptance_b16"].get<std::vector<std::vector<int>>>();
  EngineOptions eo;
  eo.model_dir = fixture(meta["target"].get<std::string>());
  eo.draft_dir = fixture(meta["draft"].get<std::string>());
  Engine engine(eo);
  ASSERT_EQ(engine.block_size(), 16);
  int same = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto r = run(engine, prompts[i], meta["max_new_tokens"].get<int>(), meta["eos_ids"].get<std::vector<int32_t>>(),
                       SpeculativeMode::DFlash);
    std::vector<int> ref_hist(16, 0);
    for (int a : ref[i]) ref_hist[a - 1] += 1;
    same += r.stats.acceptance_histogram == ref_hist;
  }
  std::printf("trained pair: %d of %zu prompts have exactly the reference acceptance histogram\n", same, prompts.size());
  EXPECT_GE(same, static_cast<int>(prompts.size()) - 2);
}

}  // namespace
}  // namespace dflash

namespace dflash {
namespace {

// Near the end of the context the DFlash block shrinks; output still equals
// plain decoding and both stop for the same reason at the same token.
TEST(LosslessTest, ContextLimitShrinksTheBlock) {
  test::TempDir dir;
  const std::string src = fixture("targets/trained_qwen3");
  std::filesystem::copy_file(src + "/model.safetensors", dir.file("model.safetensors"));
  auto cfg = test::read_json(src + "/config.json");
  cfg["max_position_embeddings"] = 37;
  test::write_file(dir.file("config.json"), cfg.dump());
  EngineOptions eo;
  eo.model_dir = dir.path();
  eo.draft_dir = fixture("drafts/trained_qwen3_b16");
  Engine engine(eo);
  const auto prompts = test::read_json(fixture("expected/trained_qwen3.json"))["prompts"]
                           .get<std::vector<std::vector<int32_t>>>();
  for (const auto& prompt : prompts) {
    if (prompt.size() >= 37) continue;
    const auto plain = run(engine, prompt, 100, {}, SpeculativeMode::None);
    const auto spec = run(engine, prompt, 100, {}, SpeculativeMode::DFlash);
    EXPECT_EQ(plain.stop_reason, FinishReason::Context);
    EXPECT_EQ(spec.stop_reason, FinishReason::Context);
    EXPECT_EQ(plain.tokens.size(), 37 - prompt.size() + 1);
    EXPECT_EQ(spec.tokens, plain.tokens);
  }
}

}  // namespace
}  // namespace dflash
