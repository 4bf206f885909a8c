// Engine runs shared by the GPU tests: the bundled pair on the GPU, DFlash-equals-plain checks,
// serving a set of prompts, one-at-a-time generation.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/serving.h"
#include "test_util.h"

namespace dflash::test {

inline EngineOptions bundled_pair_on_gpu() {
  EngineOptions eo;
  eo.device = "cuda";
  eo.model_dir = test::models_dir() + "/pycoder-16m";
  eo.draft_dir = test::models_dir() + "/pycoder-16m-dflash-b16";
  return eo;
}

// Runs plain and DFlash greedy decoding on `prompts` and requires identical tokens.
inline double expect_lossless(Engine& engine, const std::vector<std::vector<int32_t>>& prompts, int max_tokens,
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

// Serves `prompts` (greedy, max_tokens each, unless `adjust` changes request i) with so's settings;
// tokens per prompt.
inline std::vector<std::vector<int32_t>> serve_all(const ServingOptions& so,
                                                   const std::vector<std::vector<int32_t>>& prompts, int max_tokens,
                                                   ServingStats* stats = nullptr,
                                                   const std::function<void(size_t, RequestParams&)>& adjust = {}) {
  ServingEngine server(so);
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::vector<int32_t>> got(prompts.size());
  size_t finished = 0;
  {
    std::lock_guard<std::mutex> lk(mu);
    for (size_t i = 0; i < prompts.size(); ++i) {
      RequestParams rp;
      rp.prompt = prompts[i];
      rp.max_tokens = max_tokens;
      if (adjust) adjust(i, rp);
      server.submit(rp, [&, i](const TokenEvent& e) {
        std::lock_guard<std::mutex> l(mu);
        got[i].insert(got[i].end(), e.tokens.begin(), e.tokens.end());
        if (e.finished) ++finished;
        cv.notify_all();
      });
    }
  }
  std::unique_lock<std::mutex> lk(mu);
  EXPECT_TRUE(cv.wait_for(lk, std::chrono::minutes(5), [&] { return finished == prompts.size(); }));
  if (stats) *stats = server.stats();
  return got;
}

// The same with up to max_num_seqs at once and the other settings left as they are.
inline std::vector<std::vector<int32_t>> serve_all(const EngineOptions& eo, SpeculativeMode mode, int max_num_seqs,
                                                   const std::vector<std::vector<int32_t>>& prompts, int max_tokens,
                                                   ServingStats* stats = nullptr) {
  ServingOptions so;
  so.engine = eo;
  so.mode = mode;
  so.max_num_seqs = max_num_seqs;
  return serve_all(so, prompts, max_tokens, stats);
}

inline std::vector<std::vector<int32_t>> bundled_prompts(size_t n) {
  const auto ref = test::read_json(fixture("expected/pycoder16m_humaneval.json"));
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& row : ref["rows"])
    if (prompts.size() < n) prompts.push_back(row["prompt_ids"].get<std::vector<int32_t>>());
  return prompts;
}

// Greedy one-at-a-time generation, op by op.
inline std::vector<std::vector<int32_t>> generate_all(EngineOptions eo, SpeculativeMode mode,
                                               const std::vector<std::vector<int32_t>>& prompts, int max_tokens) {
  eo.graphs = false;
  Engine engine(eo);
  std::vector<std::vector<int32_t>> out;
  for (const auto& p : prompts) {
    GenerateOptions go;
    go.max_tokens = max_tokens;
    go.mode = mode;
    out.push_back(engine.generate(p, go).tokens);
  }
  return out;
}

}  // namespace dflash::test
