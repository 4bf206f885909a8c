// CPU backend vs the float64 PyTorch/transformers reference stored in
// tests/fixtures (written by tools/make_fixtures.py).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <limits>

#include "engine/engine.h"
#include "formats/safetensors.h"
#include "kernels/backend.h"
#include "model/dflash_draft.h"
#include "model/target_model.h"
#include "test_util.h"

namespace dflash {
namespace {

using test::fixture;
using test::max_rel_error;

constexpr double kTolerance = 1e-4;

std::vector<float> expected_tensor(const TensorStore& s, const std::string& name) {
  const TensorInfo& t = s.get(name);
  std::vector<float> v(static_cast<size_t>(t.n_elements()));
  convert_to_f32(t.dtype, t.data, v.data(), v.size());
  return v;
}

std::vector<int32_t> iota_rows(int n) {
  std::vector<int32_t> r(n);
  for (int i = 0; i < n; ++i) r[i] = i;
  return r;
}

class ReferenceTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    meta_ = test::read_json(fixture("expected/" + GetParam() + ".json"));
    expected_ = std::make_unique<TensorStore>(TensorStore::open(fixture("expected/" + GetParam() + ".safetensors")));
    be_ = make_cpu_backend();
    target_ = std::make_unique<TargetModel>(*be_, fixture(meta_["target"].get<std::string>()));
    ids_ = meta_["input_ids"].get<std::vector<int32_t>>();
  }
  void report(const std::string& what, double err) {
    std::printf("[%s] %s: max rel error %.3g\n", GetParam().c_str(), what.c_str(), err);
    EXPECT_LT(err, kTolerance) << what;
  }
  // The routed and hybrid targets' logits are held to 1e-5.
  double logits_tolerance() const {
    const std::string& n = GetParam();
    const bool held = n.find("moe") != std::string::npos || n.find("qwen3_5") != std::string::npos ||
                      n.find("qwen3_next") != std::string::npos;
    return held ? 1e-5 : kTolerance;
  }

  nlohmann::json meta_;
  std::unique_ptr<TensorStore> expected_;
  std::unique_ptr<Backend> be_;
  std::unique_ptr<TargetModel> target_;
  std::vector<int32_t> ids_;
};

TEST_P(ReferenceTest, LogitsAndEveryLayerOutputMatchTransformers) {
  const int n = static_cast<int>(ids_.size()), n_layers = target_->config().n_layers;
  KvCache cache = target_->alloc_cache(4, 16);
  std::vector<int32_t> pages = {2, 0, 3, 1};  // deliberately not in order
  ForwardBatch b(16);
  b.add_sequence(ids_, 0, pages, true, {0});
  b.logit_rows = iota_rows(n);
  std::vector<int> all_layers;
  for (int j = 0; j < n_layers; ++j) all_layers.push_back(j);
  auto out = target_->forward(b, cache, all_layers);
  const double logits_err = max_rel_error(be_->to_host(out.logits), expected_tensor(*expected_, "logits"));
  report("logits", logits_err);
  EXPECT_LT(logits_err, logits_tolerance());
  const auto captured = be_->to_host(out.captured);
  const int64_t h = target_->config().n_embd;
  for (int j = 0; j < n_layers; ++j) {
    std::vector<float> layer(static_cast<size_t>(n * h));
    for (int r = 0; r < n; ++r)
      std::copy_n(&captured[(r * n_layers + j) * h], h, &layer[r * h]);
    report("output of layer " + std::to_string(j), max_rel_error(layer, expected_tensor(*expected_, "layer_out." + std::to_string(j))));
  }
}

TEST_P(ReferenceTest, IncrementalDecodingEqualsFullForwardBitForBit) {
  const int n = static_cast<int>(ids_.size());
  KvCache full_cache = target_->alloc_cache(4, 4), inc_cache = target_->alloc_cache(4, 4);
  std::vector<int32_t> full_pages = {0, 1, 2, 3}, inc_pages = {3, 1, 0, 2};
  ForwardBatch full(4);
  full.add_sequence(ids_, 0, full_pages, true, {0});
  full.logit_rows = iota_rows(n);
  const auto full_logits = be_->to_host(target_->forward(full, full_cache).logits);
  const int64_t v = target_->config().n_vocab;

  const int n_prefill = 5;
  ForwardBatch pre(4);
  pre.add_sequence(std::vector<int32_t>(ids_.begin(), ids_.begin() + n_prefill), 0, inc_pages, true, {0});
  pre.logit_rows = iota_rows(n_prefill);
  auto logits = be_->to_host(target_->forward(pre, inc_cache).logits);
  for (int i = n_prefill; i < n; ++i) {
    ForwardBatch step(4);
    step.add_sequence({ids_[i]}, i, inc_pages, true, {0});
    step.logit_rows = {0};
    const auto row = be_->to_host(target_->forward(step, inc_cache).logits);
    logits.insert(logits.end(), row.begin(), row.end());
  }
  ASSERT_EQ(logits.size(), static_cast<size_t>(n * v));
  for (size_t i = 0; i < logits.size(); ++i) ASSERT_EQ(logits[i], full_logits[i]) << "element " << i;
}

TEST_P(ReferenceTest, DraftBlockLogitsMatchPyTorchReference) {
  DraftModel draft(*be_, fixture(meta_["draft"].get<std::string>()), *target_);
  const auto& layer_ids = draft.config().target_layer_ids;
  const int n = static_cast<int>(ids_.size());
  for (int block : {4, 16}) {
    KvCache tcache = target_->alloc_cache(4, 8), dcache = draft.alloc_cache(4, 8);
    std::vector<int32_t> pages = {1, 3, 0, 2};
    ForwardBatch b(8);
    b.add_sequence(ids_, 0, pages, true, {0});
    b.logit_rows = {n - 1};
    auto out = target_->forward(b, tcache, layer_ids);
    ASSERT_EQ(be_->argmax_rows(out.logits)[0], meta_["pending"].get<int>());
    ForwardBatch ctx(8);
    ctx.add_sequence(std::vector<int32_t>(n, 0), 0, pages);
    draft.project_context(out.captured, nullptr, ctx, dcache);
    std::vector<int32_t> tokens(block, draft.config().mask_token_id);
    tokens[0] = meta_["pending"].get<int>();
    ForwardBatch db(8);
    db.add_sequence(tokens, n, pages, /*causal=*/false);
    for (int i = 1; i < block; ++i) db.logit_rows.push_back(i);
    const auto logits = be_->to_host(draft.forward_block(db, dcache));
    report("draft logits, block " + std::to_string(block),
           max_rel_error(logits, expected_tensor(*expected_, "draft_logits.b" + std::to_string(block))));
  }
}

TEST_P(ReferenceTest, PlainGreedyMatchesReferenceTokens) {
  EngineOptions eo;
  eo.model_dir = fixture(meta_["target"].get<std::string>());
  Engine engine(eo);
  GenerateOptions go;
  go.max_tokens = meta_["max_new_tokens"].get<int>();
  go.eos_ids = meta_["eos_ids"].get<std::vector<int32_t>>();
  const auto prompts = meta_["prompts"].get<std::vector<std::vector<int32_t>>>();
  const auto greedy = meta_["greedy"].get<std::vector<std::vector<int32_t>>>();
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(engine.generate(prompts[i], go).tokens, greedy[i]) << "prompt " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ReferenceTest,
                         ::testing::Values("qwen3_gqa_tied", "qwen3_mha_untied_bf16", "llama_gqa4_bias_sharded",
                                           "qwen3_moe_tied", "qwen3_moe_untied_bf16", "qwen3_5_tied",
                                           "qwen3_5_moe_untied_bf16", "qwen3_next_untied"));

// Qwen3.5 and Qwen3-Next: 200 steps of transformers' own incremental decoding (its cache: prefill, then one
// token a step), logits within 1e-5 at every step; the state carries the whole way.
class HybridReferenceTest : public ReferenceTest {};

TEST_P(HybridReferenceTest, IncrementalDecodingMatchesTransformersFor200Steps) {
  const auto prompt = meta_["incremental_prompt"].get<std::vector<int32_t>>();
  const auto tokens = meta_["incremental_tokens"].get<std::vector<int32_t>>();
  const auto expected = expected_tensor(*expected_, "incremental_logits");
  const auto eos = meta_["eos_ids"].get<std::vector<int32_t>>();
  const int64_t v = target_->config().n_vocab;
  ASSERT_EQ(expected.size(), tokens.size() * static_cast<size_t>(v));
  const int page = 16, n_pages = static_cast<int>((prompt.size() + tokens.size()) / page + 1);
  KvCache cache = target_->alloc_cache(n_pages, page);
  std::vector<int32_t> pages(static_cast<size_t>(n_pages));
  for (int i = 0; i < n_pages; ++i) pages[static_cast<size_t>(i)] = n_pages - 1 - i;
  double worst = 0;
  int32_t n_past = 0;
  std::vector<int32_t> feed = prompt;
  for (size_t step = 0; step < tokens.size(); ++step) {
    ForwardBatch b(page);
    b.add_sequence(feed, n_past, pages, true, {0});
    b.logit_rows = {static_cast<int32_t>(feed.size()) - 1};
    const Tensor out = target_->forward(b, cache).logits;
    auto logits = be_->to_host(out);
    const std::vector<float> want(expected.begin() + static_cast<int64_t>(step) * v,
                                  expected.begin() + static_cast<int64_t>(step + 1) * v);
    worst = std::max(worst, max_rel_error(logits, want));
    // The reference generated with min_new_tokens = 200, which masks the EOS ids: its token is the
    // best of the others.
    for (int32_t e : eos) logits[static_cast<size_t>(e)] = -std::numeric_limits<float>::infinity();
    ASSERT_EQ(std::max_element(logits.begin(), logits.end()) - logits.begin(), tokens[step]) << "step " << step;
    n_past += static_cast<int32_t>(feed.size());
    feed = {tokens[step]};
  }
  report("logits over " + std::to_string(tokens.size()) + " incremental steps", worst);
  EXPECT_LT(worst, 1e-5);
}

// A kept state (TargetModel::copy_state_slot, as the prefix cache restores one) continues its
// sequence exactly as the slot it was copied from: the next token's logits are the same bits,
// and a slot holding another state's are not.
TEST_P(HybridReferenceTest, CopiedStateSlotContinuesBitForBit) {
  const auto prompt = meta_["incremental_prompt"].get<std::vector<int32_t>>();
  const int page = 16;
  KvCache cache = target_->alloc_cache(2, page, 3, 1);
  const std::vector<int32_t> pages = {1, 0};
  auto forward = [&](const std::vector<int32_t>& ids, int32_t n_past, int32_t slot) {
    ForwardBatch b(page);
    b.add_sequence(ids, n_past, pages, true, {slot});
    b.logit_rows = {static_cast<int32_t>(ids.size()) - 1};
    return be_->to_host(target_->forward(b, cache).logits);
  };
  const std::vector<int32_t> head(prompt.begin(), prompt.end() - 1), last = {prompt.back()};
  const auto n = static_cast<int32_t>(head.size());
  forward(head, 0, 0);
  forward(std::vector<int32_t>(head.begin(), head.begin() + 3), 0, 2);  // slot 2: the state after 3 tokens
  target_->copy_state_slot(cache, 0, 1);
  const auto from = forward(last, n, 0), copied = forward(last, n, 1), other = forward(last, n, 2);
  EXPECT_EQ(copied, from);
  EXPECT_NE(other, from);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HybridReferenceTest,
                         ::testing::Values("qwen3_5_tied", "qwen3_5_moe_untied_bf16", "qwen3_next_untied"));

}  // namespace
}  // namespace dflash
