// Token choice: sampling distributions against direct references on fresh
// random logits, the inverse-CDF sampler, the rejection-sampling verdict (its
// output must be distributed as the target's p), and DFlash with sampling:
// the match scheme gives exactly plain sampling's tokens for the same seed; the
// rejection scheme keeps the target's distribution and accepts drafts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <cstdlib>

#include "engine/engine.h"
#include "engine/logits_processing.h"
#include "engine/sampling.h"
#include "test_util.h"
#include "util/error.h"

namespace dflash {
namespace {

std::vector<float> random_logits(int n, std::mt19937& rng, float scale = 3.0f) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = nd(rng);
  return x;
}

// A whole row's distribution (candidates selected on the host), and the same as a dense vector.
TokenDist dist(const std::vector<float>& logits, const SamplingParams& p) {
  return distribution(select_top_candidates(logits.data(), static_cast<int64_t>(logits.size()), p.temperature, p.top_k),
                      p);
}
std::vector<float> dense(const TokenDist& d, size_t n) {
  std::vector<float> out(n, 0.0f);
  for (size_t i = 0; i < d.ids.size(); ++i) out[static_cast<size_t>(d.ids[i])] = d.p[i];
  return out;
}
std::vector<float> dense_dist(const std::vector<float>& logits, const SamplingParams& p) {
  return dense(dist(logits, p), logits.size());
}

// Softmax in double, then Hugging Face's warpers written out directly: top-k by
// the k-th largest value, top-p by sorting ascending and dropping the tokens
// whose cumulative probability is <= 1 - top_p. `margin` is how close a
// cumulative sum came to that threshold: below ~1e-6 float and double
// arithmetic may legitimately disagree about the last token.
std::vector<double> reference(const std::vector<float>& logits, const SamplingParams& p, double* margin) {
  *margin = 1.0;
  const size_t n = logits.size();
  std::vector<double> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<double>(logits[i]) / p.temperature;
  if (p.top_k > 0 && p.top_k < static_cast<int>(n)) {
    std::vector<double> s(x);
    std::sort(s.rbegin(), s.rend());
    for (double& v : x)
      if (v < s[static_cast<size_t>(p.top_k - 1)]) v = -INFINITY;
  }
  auto softmax = [](std::vector<double>& v) {
    const double mx = *std::max_element(v.begin(), v.end());
    double t = 0;
    for (double& e : v) t += e = std::exp(e - mx);
    for (double& e : v) e /= t;
  };
  softmax(x);
  if (p.top_p < 1) {
    std::vector<size_t> idx(n);
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return x[a] < x[b]; });
    double cum = 0;
    std::vector<bool> drop(n, false);
    for (size_t k = 0; k + 1 < n; ++k) {  // the most likely token always stays
      cum += x[idx[k]];
      *margin = std::min(*margin, std::abs(cum - (1.0 - p.top_p)));
      if (cum <= 1.0 - p.top_p) drop[idx[k]] = true;
    }
    double t = 0;
    for (size_t i = 0; i < n; ++i) t += drop[i] ? 0 : x[i];
    for (size_t i = 0; i < n; ++i) x[i] = drop[i] ? 0 : x[i] / t;
  }
  return x;
}

TEST(Sampling, DistributionsMatchTheWarpersOnRandomLogits) {
  std::mt19937 rng(std::random_device{}());
  const SamplingParams settings[] = {{1.0f, 0, 1.0f, 0}, {0.7f, 0, 1.0f, 0}, {1.3f, 40, 1.0f, 0},
                                     {0.6f, 20, 0.95f, 0}, {1.0f, 0, 0.5f, 0}, {0.9f, 1, 1.0f, 0},
                                     {2.0f, 0, 0.999f, 0}};
  for (int n : {2, 7, 1000, 8192}) {
    for (const auto& p : settings) {
      const auto logits = random_logits(n, rng);
      const auto got = dense_dist(logits, p);
      double margin = 0;
      const auto want = reference(logits, p, &margin);
      if (margin < 1e-6) continue;  // too close to call in float
      double err = 0, total = 0;
      int kept = 0, want_kept = 0;
      for (int i = 0; i < n; ++i) {
        err = std::max(err, std::abs(got[static_cast<size_t>(i)] - want[static_cast<size_t>(i)]));
        total += got[static_cast<size_t>(i)];
        kept += got[static_cast<size_t>(i)] > 0;
        want_kept += want[static_cast<size_t>(i)] > 0;
      }
      EXPECT_LT(err, 1e-5) << "n " << n << " T " << p.temperature << " k " << p.top_k << " p " << p.top_p;
      EXPECT_NEAR(total, 1.0, 1e-4);
      EXPECT_EQ(kept, want_kept) << "n " << n << " T " << p.temperature << " k " << p.top_k << " p " << p.top_p;
    }
  }
}

TEST(Sampling, TopCandidatesAreTheTopKWithTiesAndNoNaN) {
  std::mt19937 rng(std::random_device{}());
  for (int n : {1, 5, 100, 5000}) {
    for (int trial = 0; trial < 4; ++trial) {
      auto logits = random_logits(n, rng);
      for (float& v : logits) v = std::round(v * 2) / 2;  // many ties
      if (n > 4) logits[1] = -INFINITY, logits[3] = NAN;
      const float t = trial == 0 ? 1.0f : trial == 1 ? 0.6f : 1.7f;
      for (int k : {0, 1, 3, 20, n - 1, n, n + 5}) {
        const TopCandidates got = select_top_candidates(logits.data(), n, t, k);
        std::vector<float> sorted;
        for (float v : logits)
          if (!std::isnan(v)) sorted.push_back(v / t);
        std::sort(sorted.rbegin(), sorted.rend());
        const float thr = k > 0 && k < n && k <= static_cast<int>(sorted.size()) ? sorted[static_cast<size_t>(k - 1)]
                                                                                  : -INFINITY;
        std::vector<int32_t> want;
        for (int i = 0; i < n; ++i)
          if (logits[static_cast<size_t>(i)] / t >= thr) want.push_back(i);
        ASSERT_EQ(got.ids, want) << "n " << n << " k " << k << " T " << t;
        for (size_t i = 0; i < want.size(); ++i)
          EXPECT_EQ(got.x[i], logits[static_cast<size_t>(want[i])] / t);
      }
    }
  }
}

// A row split into parts (tensor-parallel ranks' vocabularies): the parts' selections merged are
// the whole row's, ties at the threshold spread over the parts included.
TEST(Sampling, TopCandidatesOfPartsMergeIntoTheRowsSelection) {
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  for (int n : {7, 100, 5000}) {
    for (int trial = 0; trial < 6; ++trial) {
      auto logits = random_logits(n, rng);
      for (float& v : logits) v = std::round(v * 2) / 2;  // many ties
      if (trial == 3)
        for (int i = 0; i < n; i += 2) logits[static_cast<size_t>(i)] = NAN;  // fewer finite entries than k
      if (trial == 4)  // -inf in every part, more of it than finite entries: the k-th largest is -inf
        for (int i = 0; i < n; ++i)
          if (i % 4 != 0) logits[static_cast<size_t>(i)] = -INFINITY;
      if (trial == 5)  // a first part of NaN alone
        for (int i = 0; i < (n + 1) / 2; ++i) logits[static_cast<size_t>(i)] = NAN;
      logits[1] = -INFINITY;
      const float t = trial == 1 ? 0.6f : 1.0f;
      for (int n_parts : {2, 3, 4}) {
        for (int k : {-1, 0, 1, 3, 20, n / 2, n - 1, n}) {
          std::vector<TopCandidates> parts;
          for (int p = 0; p < n_parts; ++p) {
            const int lo = n * p / n_parts, hi = n * (p + 1) / n_parts;
            TopCandidates c = select_top_candidates(logits.data() + lo, hi - lo, t, k);
            for (int32_t& id : c.ids) id += lo;
            parts.push_back(std::move(c));
          }
          const TopCandidates want = select_top_candidates(logits.data(), n, t, k);
          const TopCandidates got = merge_top_candidates(parts, k);
          const std::string what = "seed " + std::to_string(seed) + ", n " + std::to_string(n) + ", parts " +
                                   std::to_string(n_parts) + ", k " + std::to_string(k) + ", trial " +
                                   std::to_string(trial);
          ASSERT_EQ(got.ids, want.ids) << what;
          ASSERT_EQ(got.x, want.x) << what;
        }
      }
    }
  }
}

TEST(Sampling, TopPOnTiesAndTinyNuclei) {
  // Ten equal logits, top_p 0.35: tokens are kept while the mass before them is below 0.35.
  const std::vector<float> flat(10, 1.0f);
  auto p = dense_dist(flat, {1.0f, 0, 0.35f, 0});
  for (int i = 0; i < 10; ++i) EXPECT_FLOAT_EQ(p[static_cast<size_t>(i)], i < 4 ? 0.25f : 0.0f) << i;
  // A tiny top_p keeps exactly the most likely token.
  std::mt19937 rng(std::random_device{}());
  const auto logits = random_logits(5000, rng);
  p = dense_dist(logits, {1.0f, 0, 1e-6f, 0});
  const auto best = std::max_element(logits.begin(), logits.end()) - logits.begin();
  EXPECT_FLOAT_EQ(p[static_cast<size_t>(best)], 1.0f);
}

TEST(Sampling, InverseCdfSamplesFollowTheDistribution) {
  std::mt19937 rng(std::random_device{}());
  const auto logits = random_logits(50, rng, 1.5f);
  const TokenDist d = dist(logits, {1.0f, 0, 1.0f, 0});
  const auto p = dense(d, 50);
  // Stratified u: the counts are exact up to one per token.
  const int n = 100000;
  std::vector<int> count(50, 0);
  for (int i = 0; i < n; ++i) ++count[static_cast<size_t>(sample(d, (i + 0.5) / n))];
  for (size_t t = 0; t < 50; ++t) EXPECT_NEAR(count[t], p[t] * n, 1.5) << "token " << t;
  // The counter-based uniforms are uniform and differ between seeds, positions and streams.
  double mean = 0;
  for (int i = 0; i < n; ++i) mean += uniform(7, i, kTargetSample);
  EXPECT_NEAR(mean / n, 0.5, 0.01);
  EXPECT_NE(uniform(7, 10, kTargetSample), uniform(8, 10, kTargetSample));
  EXPECT_NE(uniform(7, 10, kTargetSample), uniform(7, 11, kTargetSample));
  EXPECT_NE(uniform(7, 10, kTargetSample), uniform(7, 10, kAcceptTest));
  EXPECT_EQ(uniform(7, 10, kResample), uniform(7, 10, kResample));
}

TEST(Sampling, RejectionVerdictsAreDistributedAsTheTarget) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 4; ++trial) {
    const int v = 8;
    const auto lp = random_logits(v, rng, 1.0f), lq = random_logits(v, rng, 1.0f);
    // Trials 2 and 3: top-k gives p and q different supports.
    const TokenDist pd = dist(lp, {1.0f, trial >= 2 ? 5 : 0, trial % 2 ? 0.8f : 1.0f, 0});
    const TokenDist qd = dist(lq, {1.0f, trial >= 2 ? 4 : 0, 1.0f, 0});
    const auto p = dense(pd, v), q = dense(qd, v);
    const int n = 200000;
    std::vector<int> count(v, 0);
    int accepted = 0;
    const uint64_t seed = rng();
    for (int i = 0; i < n; ++i) {
      const int32_t d = sample(qd, uniform(seed, i, kDraftSample));
      const Verdict r = verify_draft_token(pd, qd, d, uniform(seed, i, kAcceptTest), uniform(seed, i, kResample));
      ++count[static_cast<size_t>(r.token)];
      accepted += r.accepted;
    }
    // Expected acceptance: sum_x min(p, q).
    double overlap = 0;
    for (int t = 0; t < v; ++t) overlap += std::min(p[static_cast<size_t>(t)], q[static_cast<size_t>(t)]);
    EXPECT_NEAR(static_cast<double>(accepted) / n, overlap, 0.01);
    for (size_t t = 0; t < static_cast<size_t>(v); ++t)
      EXPECT_NEAR(static_cast<double>(count[t]) / n, p[t], 0.006) << "trial " << trial << " token " << t;
  }
}

TEST(Sampling, SettingsAreCheckedAndModelDefaultsFollowGenerationConfig) {
  EXPECT_THROW(validate({-1.0f, 0, 1.0f, 0}), Error);
  EXPECT_THROW(validate({1.0f, -2, 1.0f, 0}), Error);
  EXPECT_THROW(validate({1.0f, 0, 0.0f, 0}), Error);
  EXPECT_THROW(validate({NAN, 0, 1.0f, 0}), Error);
  EXPECT_THROW(parse_spec_sampling("typical"), Error);
  GenerationConfig g;
  EXPECT_TRUE(default_sampling(g).greedy());
  g.do_sample = true;
  g.temperature = 0.6;
  g.top_p = 0.95;
  SamplingParams p = default_sampling(g);
  EXPECT_FLOAT_EQ(p.temperature, 0.6f);
  EXPECT_EQ(p.top_k, 50);
  EXPECT_FLOAT_EQ(p.top_p, 0.95f);
}

GenerationResult run(Engine& e, const std::vector<int32_t>& prompt, int max_tokens, SpeculativeMode mode,
                     const SamplingParams& sp, SpecSampling scheme = SpecSampling::Match) {
  GenerateOptions go;
  go.max_tokens = max_tokens;
  go.mode = mode;
  go.sampling = sp;
  go.spec_sampling = scheme;
  return e.generate(prompt, go);
}

Engine trained_engine() {
  const auto meta = test::read_json(test::fixture("expected/trained_qwen3.json"));
  EngineOptions eo;
  eo.model_dir = test::fixture(meta["target"].get<std::string>());
  eo.draft_dir = test::fixture(meta["draft"].get<std::string>());
  return Engine(eo);
}

std::vector<std::vector<int32_t>> trained_prompts() {
  return test::read_json(test::fixture("expected/trained_qwen3.json"))["prompts"].get<std::vector<std::vector<int32_t>>>();
}

TEST(SampledDecoding, MatchSchemeGivesPlainSamplingsTokensForTheSameSeed) {
  Engine engine = trained_engine();
  const auto prompts = trained_prompts();
  long steps = 0, produced = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const SamplingParams sp{i % 3 == 0 ? 1.0f : 0.7f, i % 2 ? 20 : 0, i % 4 == 1 ? 0.9f : 1.0f, 1000 + i};
    const auto plain = run(engine, prompts[i], 40, SpeculativeMode::None, sp);
    const auto spec = run(engine, prompts[i], 40, SpeculativeMode::DFlash, sp);
    ASSERT_EQ(spec.tokens, plain.tokens) << "prompt " << i;
    const auto again = run(engine, prompts[i], 40, SpeculativeMode::None, sp);
    ASSERT_EQ(again.tokens, plain.tokens) << "sampling is not reproducible for a seed, prompt " << i;
    steps += spec.stats.n_steps;
    produced += static_cast<long>(std::lround(spec.stats.tau * spec.stats.n_steps));
  }
  const double tau = static_cast<double>(produced) / static_cast<double>(steps);
  std::printf("match scheme: %zu prompts identical to plain sampling, tau %.3f\n", prompts.size(), tau);
  EXPECT_GT(tau, 1.2) << "sampled drafts are (almost) never accepted";
  // Different seeds give different text somewhere.
  const SamplingParams a{1.0f, 0, 1.0f, 1}, b{1.0f, 0, 1.0f, 2};
  int differ = 0;
  for (const auto& pr : prompts) differ += run(engine, pr, 16, SpeculativeMode::None, a).tokens !=
                                          run(engine, pr, 16, SpeculativeMode::None, b).tokens;
  EXPECT_GT(differ, 0);
}

// Per output position, how often each token appears over `runs` seeds.
std::vector<std::map<int32_t, int>> marginals(Engine& e, const std::vector<int32_t>& prompt, int n,
                                              SpeculativeMode mode, SpecSampling scheme, int runs, uint64_t seed0) {
  std::vector<std::map<int32_t, int>> h(static_cast<size_t>(n));
  for (int s = 0; s < runs; ++s) {
    const auto t = run(e, prompt, n, mode, {0.8f, 0, 1.0f, seed0 + static_cast<uint64_t>(s)}, scheme).tokens;
    for (size_t j = 0; j < t.size() && j < h.size(); ++j) ++h[j][t[j]];
  }
  return h;
}

double total_variation(const std::map<int32_t, int>& x, const std::map<int32_t, int>& y, int runs) {
  std::map<int32_t, double> d;
  for (const auto& [k, c] : x) d[k] += static_cast<double>(c) / runs;
  for (const auto& [k, c] : y) d[k] -= static_cast<double>(c) / runs;
  double t = 0;
  for (const auto& [k, v] : d) t += std::abs(v);
  return t / 2;
}

TEST(SampledDecoding, RejectionSchemeKeepsTheTargetsDistribution) {
  Engine engine = trained_engine();
  const auto prompts = trained_prompts();
  // Tokens 2..4 of each continuation come from verified drafts (token 1 from the
  // prefill). Over 1000 seeds at temperature 0.8, their per-position
  // distributions must be as close to plain sampling's as a second plain run is.
  const int runs = std::getenv("DFLASH_TEST_LIGHT") && std::string(std::getenv("DFLASH_TEST_LIGHT")) == "1" ? 300 : 1000;
  const int n = 4;
  const std::vector<int32_t> prompt(prompts[0].begin(), prompts[0].begin() + std::min<size_t>(8, prompts[0].size()));
  const auto plain = marginals(engine, prompt, n, SpeculativeMode::None, SpecSampling::Match, runs, 1);
  const auto plain2 = marginals(engine, prompt, n, SpeculativeMode::None, SpecSampling::Match, runs, 1000001);
  const auto rej = marginals(engine, prompt, n, SpeculativeMode::DFlash, SpecSampling::Rejection, runs, 2000001);
  for (size_t j = 1; j < static_cast<size_t>(n); ++j) {
    const double noise = total_variation(plain[j], plain2[j], runs), dist = total_variation(plain[j], rej[j], runs);
    std::printf("rejection scheme, token %zu: TV to plain %.3f (plain vs plain %.3f), %zu distinct tokens\n", j + 1,
                dist, noise, plain[j].size());
    EXPECT_LT(dist, std::max(0.1, 2.0 * noise)) << "token " << j + 1;
  }
  // And it accepts drafts.
  long steps = 0;
  double tau_sum = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto r = run(engine, prompts[i], 40, SpeculativeMode::DFlash, {1.0f, 0, 1.0f, 77 + i}, SpecSampling::Rejection);
    tau_sum += r.stats.tau * r.stats.n_steps;
    steps += r.stats.n_steps;
  }
  std::printf("rejection scheme: tau %.3f\n", tau_sum / static_cast<double>(steps));
  EXPECT_GT(tau_sum / static_cast<double>(steps), 1.2);
}

TEST(LogitsProcessing, BiasMinTokensAndPenaltiesInVllmsOrder) {
  SamplingParams p;
  p.logit_bias = {{1, 2.0f}, {4, -1.0f}};
  p.min_tokens = 4;
  p.repetition_penalty = 2.0f;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  const std::unordered_set<int32_t> eos = {5};
  // Prompt {0, 1}; outputs so far {2, 2}; then the pending token 3.
  const std::vector<int32_t> tokens = {0, 1, 2, 2};
  LogitsProcessor proc(p, eos, tokens, 2);
  proc.push(3);
  std::vector<float> row = {1.0f, -1.0f, 3.0f, -2.0f, 0.5f, 7.0f, 1.5f};
  proc.apply(row.data(), static_cast<int64_t>(row.size()));
  EXPECT_FLOAT_EQ(row[0], 0.5f);                        // prompt token, positive: halved
  EXPECT_FLOAT_EQ(row[1], (-1.0f + 2.0f) / 2.0f);       // biased to 1, then halved
  EXPECT_FLOAT_EQ(row[2], 3.0f / 2.0f - 2 * 0.5f - 0.25f);  // output twice
  EXPECT_FLOAT_EQ(row[3], -2.0f * 2.0f - 0.5f - 0.25f);     // output once, negative: doubled
  EXPECT_FLOAT_EQ(row[4], -0.5f);                       // bias only
  EXPECT_EQ(row[5], -INFINITY);                         // EOS: only 3 of min_tokens 4 generated
  EXPECT_FLOAT_EQ(row[6], 1.5f);
  proc.push(6);  // the 4th output: EOS allowed again
  std::vector<float> row2 = {0, 0, 0, 0, 0, 7.0f, 0};
  proc.apply(row2.data(), 7);
  EXPECT_FLOAT_EQ(row2[5], 7.0f);
}

TEST(LogitsProcessing, LogprobsAreTheLogSoftmaxWithTheTopEntries) {
  const std::vector<float> row = {1.0f, 3.0f, 3.0f, -2.0f, 0.0f};
  double z = 0;
  for (float v : row) z += std::exp(static_cast<double>(v));
  const TokenLogprobs lp = logprobs_of(row.data(), 5, 4, 3);
  EXPECT_NEAR(lp.logprob, -std::log(z), 1e-6);
  ASSERT_EQ(lp.top.size(), 3u);
  EXPECT_EQ(lp.top[0].first, 1);  // ties: the lower id first
  EXPECT_EQ(lp.top[1].first, 2);
  EXPECT_EQ(lp.top[2].first, 0);
  EXPECT_NEAR(lp.top[2].second, 1.0 - std::log(z), 1e-6);
  EXPECT_EQ(argmax(row.data(), 5), 1);
}

GenerationResult run_with(Engine& e, const std::vector<int32_t>& prompt, SpeculativeMode mode, const GenerateOptions& base,
                          SpecSampling scheme = SpecSampling::Match) {
  GenerateOptions go = base;
  go.mode = mode;
  go.spec_sampling = scheme;
  return e.generate(prompt, go);
}

// Each processing setting, greedy and sampled: DFlash gives plain decoding's tokens and, exactly
// (the CPU backend's rows are batch-independent), its log-probabilities.
TEST(SampledDecoding, LogitsProcessingAndLogprobsAreTheSameWithDFlash) {
  Engine engine = trained_engine();
  const auto prompts = trained_prompts();
  GenerateOptions base;
  base.max_tokens = 32;
  base.logprobs = 5;
  const auto reference = run_with(engine, prompts[0], SpeculativeMode::None, base);
  const int32_t frequent = reference.tokens[3];
  std::vector<std::pair<std::string, SamplingParams>> settings;
  auto add = [&](const std::string& name, auto set) {
    for (float t : {0.0f, 0.8f}) {
      SamplingParams p(t, t > 0 ? 20 : 0, 1.0f, 99);
      set(p);
      settings.emplace_back(name + (t > 0 ? " sampled" : " greedy"), p);
    }
  };
  add("presence", [](SamplingParams& p) { p.presence_penalty = 1.5f; });
  add("frequency", [](SamplingParams& p) { p.frequency_penalty = 0.8f; });
  add("repetition", [](SamplingParams& p) { p.repetition_penalty = 1.6f; });
  add("logit_bias", [&](SamplingParams& p) { p.logit_bias = {{frequent, -3.0f}, {7, 1.5f}}; });
  add("min_tokens", [&](SamplingParams& p) { p.min_tokens = 12; });
  add("all", [&](SamplingParams& p) {
    p.presence_penalty = 0.5f;
    p.frequency_penalty = -0.3f;
    p.repetition_penalty = 1.2f;
    p.logit_bias = {{frequent, 2.0f}};
    p.min_tokens = 5;
  });
  int changed = 0;
  for (const auto& [name, sp] : settings) {
    for (size_t i = 0; i < 4; ++i) {
      GenerateOptions go = base;
      go.sampling = sp;
      if (name.starts_with("min_tokens")) go.eos_ids = {frequent};  // a token the model writes early
      const auto plain = run_with(engine, prompts[i], SpeculativeMode::None, go);
      const auto spec = run_with(engine, prompts[i], SpeculativeMode::DFlash, go);
      ASSERT_EQ(spec.tokens, plain.tokens) << name << ", prompt " << i;
      ASSERT_EQ(spec.logprobs.size(), spec.tokens.size()) << name;
      for (size_t k = 0; k < plain.logprobs.size(); ++k) {
        ASSERT_EQ(spec.logprobs[k].logprob, plain.logprobs[k].logprob) << name << ", prompt " << i << ", token " << k;
        ASSERT_EQ(spec.logprobs[k].top, plain.logprobs[k].top) << name << ", prompt " << i << ", token " << k;
        ASSERT_EQ(plain.logprobs[k].top.size(), 5u);
      }
      if (name.starts_with("min_tokens")) {
        const auto first_eos = std::find(plain.tokens.begin(), plain.tokens.end(), frequent);
        EXPECT_TRUE(first_eos == plain.tokens.end() || first_eos - plain.tokens.begin() >= 11) << name;
      }
      GenerateOptions bare = go;
      bare.sampling = SamplingParams(sp.temperature, sp.top_k, sp.top_p, sp.seed);
      changed += run_with(engine, prompts[i], SpeculativeMode::None, bare).tokens != plain.tokens;
    }
  }
  EXPECT_GT(changed, static_cast<int>(settings.size()));  // the settings do change the output
  // Greedy log-probabilities: the chosen token is the top entry.
  for (size_t k = 0; k < reference.tokens.size(); ++k) {
    EXPECT_EQ(reference.logprobs[k].top[0].first, reference.tokens[k]);
    EXPECT_EQ(reference.logprobs[k].top[0].second, reference.logprobs[k].logprob);
    EXPECT_LE(reference.logprobs[k].logprob, 0.0f);
  }
}

// A bias of +100 makes one token certain: every scheme must then write only it (the resample of
// the rejection scheme included, which draws from the processed distribution).
TEST(SampledDecoding, AForcingLogitBiasHoldsInEveryScheme) {
  Engine engine = trained_engine();
  const auto prompts = trained_prompts();
  GenerateOptions go;
  go.max_tokens = 24;
  go.use_default_eos = false;
  for (float t : {0.0f, 1.0f}) {
    go.sampling = SamplingParams(t, 0, 1.0f, 5);
    go.sampling.logit_bias = {{11, 100.0f}};
    for (SpecSampling scheme : {SpecSampling::Match, SpecSampling::Rejection}) {
      for (SpeculativeMode mode : {SpeculativeMode::None, SpeculativeMode::DFlash}) {
        const auto r = run_with(engine, prompts[1], mode, go, scheme);
        EXPECT_EQ(r.tokens, std::vector<int32_t>(24, 11)) << "temperature " << t;
      }
    }
  }
}

}  // namespace
}  // namespace dflash
