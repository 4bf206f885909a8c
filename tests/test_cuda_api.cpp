// The API's token choice on the GPU (docs/algorithm.md section 5): with logits
// processing (penalties, logit_bias, min_tokens) DFlash output equals plain
// output, and the log-probabilities of DFlash (from the verification forward)
// equal plain decoding's within 1e-3; n choices sharing a prompt each equal
// their seed alone. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <condition_variable>
#include <map>
#include <mutex>

#include "engine/engine.h"
#include "engine/serving.h"
#include "kernels/backend.h"
#include "test_util.h"

namespace dflash {
namespace {

class CudaApi : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU here: GPU tests run on the device (scripts/device-test.sh)";
  }
};

EngineOptions bundled_pair(const std::string& device) {
  EngineOptions eo;
  eo.device = device;
  eo.model_dir = test::models_dir() + "/pycoder-16m";
  eo.draft_dir = test::models_dir() + "/pycoder-16m-dflash-b16";
  return eo;
}

std::vector<std::vector<int32_t>> prompts(size_t n) {
  const auto ref = test::read_json(test::fixture("expected/pycoder16m_humaneval.json"));
  std::vector<std::vector<int32_t>> out;
  for (const auto& row : ref["rows"])
    if (out.size() < n) out.push_back(row["prompt_ids"].get<std::vector<int32_t>>());
  return out;
}

TEST_F(CudaApi, LogitsProcessingAndLogprobsAreTheSameWithDFlashOnTheGpu) {
  Engine engine(bundled_pair("cuda"));
  const auto ps = prompts(8);
  double worst = 0;
  for (size_t i = 0; i < ps.size(); ++i) {
    GenerateOptions go;
    go.max_tokens = 48;
    go.logprobs = 5;
    go.sampling = SamplingParams(i % 2 ? 0.8f : 0.0f, i % 4 < 2 ? 20 : 0, 1.0f, 700 + i);
    go.sampling.presence_penalty = i % 3 == 0 ? 0.6f : 0.0f;
    go.sampling.frequency_penalty = i % 3 == 1 ? 0.4f : 0.0f;
    go.sampling.repetition_penalty = i % 3 == 2 ? 1.3f : 1.0f;
    go.sampling.logit_bias = {{static_cast<int32_t>(10 + i), 2.0f}};
    go.sampling.min_tokens = 8;
    go.mode = SpeculativeMode::None;
    const auto plain = engine.generate(ps[i], go);
    go.mode = SpeculativeMode::DFlash;
    const auto spec = engine.generate(ps[i], go);
    EXPECT_EQ(spec.tokens, plain.tokens) << "prompt " << i;
    ASSERT_EQ(spec.logprobs.size(), spec.tokens.size());
    for (size_t k = 0; k < std::min(spec.logprobs.size(), plain.logprobs.size()); ++k) {
      if (spec.tokens[k] != plain.tokens[k]) break;
      worst = std::max(worst, static_cast<double>(std::abs(spec.logprobs[k].logprob - plain.logprobs[k].logprob)));
      EXPECT_NEAR(spec.logprobs[k].logprob, plain.logprobs[k].logprob, 1e-3) << "prompt " << i << ", token " << k;
    }
  }
  std::printf("DFlash vs plain log-probabilities on the GPU: largest difference %.3g\n", worst);
}

// The GPU's log-probabilities track the CPU backend's (bf16 weights: within 0.1).
TEST_F(CudaApi, LogprobsTrackTheCpuBackend) {
  Engine gpu(bundled_pair("cuda")), cpu(bundled_pair("cpu"));
  GenerateOptions go;
  go.max_tokens = 16;
  go.logprobs = 0;
  go.mode = SpeculativeMode::None;
  for (const auto& p : prompts(4)) {
    const auto g = gpu.generate(p, go), c = cpu.generate(p, go);
    for (size_t k = 0; k < std::min(g.tokens.size(), c.tokens.size()) && g.tokens[k] == c.tokens[k]; ++k)
      EXPECT_NEAR(g.logprobs[k].logprob, c.logprobs[k].logprob, 0.1) << "token " << k;
  }
}

// Four DFlash choices are a 64-row forward: past 32 rows the GPU's rows are exact only in the
// batch-invariant mode (docs/algorithm.md section 4), which is what this test asks of it.
TEST_F(CudaApi, ChoicesSharingAPromptEqualTheirSeedsAlone) {
  EngineOptions eo = bundled_pair("cuda");
  eo.batch_invariant = true;
  ServingOptions so;
  so.engine = eo;
  ServingEngine server(so);
  Engine engine(eo);
  const auto prompt = prompts(1)[0];
  std::mutex mu;
  std::condition_variable cv;
  std::map<int, std::vector<int32_t>> got;
  int finished = 0;
  const int n = 4;
  uint64_t first = 0;
  RequestParams rp;
  rp.prompt = prompt;
  rp.max_tokens = 32;
  rp.sampling = SamplingParams(0.8f, 20, 0.95f, 11);
  rp.sampling.frequency_penalty = 0.5f;
  for (int i = 0; i < n; ++i) {
    RequestParams c = rp;
    c.sampling.seed += static_cast<uint64_t>(i);
    c.share_prefix_with = first;
    const uint64_t id = server.submit(c, [&, i](const TokenEvent& e) {
      std::lock_guard<std::mutex> lk(mu);
      got[i].insert(got[i].end(), e.tokens.begin(), e.tokens.end());
      if (e.finished) ++finished;
      cv.notify_all();
    });
    if (i == 0) first = id;
  }
  {
    std::unique_lock<std::mutex> lk(mu);
    ASSERT_TRUE(cv.wait_for(lk, std::chrono::minutes(2), [&] { return finished == n; }));
  }
  EXPECT_GT(server.stats().prefix_hit_pages, 0);
  for (int i = 0; i < n; ++i) {
    GenerateOptions go;
    go.max_tokens = rp.max_tokens;
    go.sampling = rp.sampling;
    go.sampling.seed += static_cast<uint64_t>(i);
    go.mode = SpeculativeMode::None;
    EXPECT_EQ(got[i], engine.generate(prompt, go).tokens) << "choice " << i;
  }
}

}  // namespace
}  // namespace dflash
