// Tensor parallelism on CPU ranks (threads of this process, HostGroup): every rank of a sharded
// target (dense, routed, Qwen3.5 and Qwen3-Next hybrids) gives the whole model's logits, prefill
// and decode, with the same bits on every rank; shapes that do not divide are refused by name.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/serving.h"
#include "kernels/backend.h"
#include "model/forward_batch.h"
#include "model/target_model.h"
#include "model/tensor_parallel.h"
#include "test_util.h"
#include "util/error.h"

namespace dflash {
namespace {

using test::fixture;

// Logits of a 9-token prefill, then of one decoded token after it.
std::vector<float> prefill_and_decode(Backend& be, TargetModel& m) {
  const std::vector<int32_t> ids = {5, 17, 200, 3, 99, 42, 7, 8, 1};
  KvCache cache = m.alloc_cache(2, 16);
  const std::vector<int32_t> pages = {1, 0};
  ForwardBatch b(16);
  b.add_sequence(ids, 0, pages, true, {0});
  for (int32_t r = 0; r < b.n_rows(); ++r) b.logit_rows.push_back(r);
  std::vector<float> out = be.to_host(m.forward(b, cache).logits);
  ForwardBatch d(16);
  d.add_sequence({77}, static_cast<int32_t>(ids.size()), pages, true, {0});
  d.logit_rows = {0};
  const std::vector<float> next = be.to_host(m.forward(d, cache).logits);
  out.insert(out.end(), next.begin(), next.end());
  return out;
}

// What run(backend, model) gives on every rank of a group of `size` over target `dir`.
std::vector<std::vector<float>> on_ranks(const std::string& dir, int size,
                                         const std::function<std::vector<float>(Backend&, TargetModel&)>& run) {
  HostGroup group(size);
  std::vector<std::vector<float>> logits(static_cast<size_t>(size));
  std::vector<std::exception_ptr> errors(static_cast<size_t>(size));
  std::vector<std::thread> ranks;
  for (int r = 0; r < size; ++r) {
    ranks.emplace_back([&, r] {
      try {
        auto be = make_cpu_backend();
        HostCommunicator comm(group, r);
        TargetModel m(*be, dir, {r, size}, &comm);
        logits[static_cast<size_t>(r)] = run(*be, m);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = std::current_exception();
        group.abort(e.what());
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return logits;
}

TEST(TensorParallel, EveryRankGivesTheWholeModelsLogits) {
  const struct {
    const char* target;
    int size;
  } cases[] = {{"qwen3_gqa_tied", 2},       {"llama_gqa4_bias_sharded", 2}, {"qwen3_mha_untied_bf16", 2},
               {"qwen3_mha_untied_bf16", 4}, {"qwen3_moe_tied", 2},          {"qwen3_moe_untied_bf16", 4},
               {"qwen3_5_tied", 2},          {"qwen3_5_moe_untied_bf16", 2}, {"qwen3_next_untied", 2},
               {"qwen3_gqa_tied", 4},        {"llama_gqa4_bias_sharded", 4}};  // 2 KV heads over 4 ranks: replicated
  for (const auto& c : cases) {
    const std::string dir = fixture(std::string("targets/") + c.target);
    auto be = make_cpu_backend();
    TargetModel whole(*be, dir);
    const std::vector<float> want = prefill_and_decode(*be, whole);
    const auto got = on_ranks(dir, c.size, prefill_and_decode);
    const double err = test::max_rel_error(got[0], want);
    std::printf("[%s] %d ranks: max rel error %.2e vs one\n", c.target, c.size, err);
    EXPECT_LT(err, 1e-5) << c.target << ", " << c.size << " ranks";
    for (int r = 1; r < c.size; ++r)
      EXPECT_EQ(got[static_cast<size_t>(r)], got[0]) << c.target << ": rank " << r << " differs from rank 0";
  }
}

// A forward that gives the argmax alone (TargetModel::forward's argmax) over a split vocabulary:
// the ids of argmax_rows over the gathered logits of the same forward, on rank 0 for up to 32 rows
// (the logits gathered), on every rank for more (each rank's candidates exchanged).
TEST(TensorParallel, TheArgmaxAloneIsTheGatheredLogitsArgmax) {
  for (const char* target : {"qwen3_mha_untied_bf16", "qwen3_gqa_tied"}) {
    for (int size : {2, 4}) {
      for (int rows : {9, 40}) {
        const auto got = on_ranks(fixture(std::string("targets/") + target), size, [&](Backend& be, TargetModel& m) {
          std::vector<int32_t> ids(static_cast<size_t>(rows));
          for (int i = 0; i < rows; ++i) ids[static_cast<size_t>(i)] = (37 * i + 11) % m.config().n_vocab;
          const std::vector<int32_t> pages = {0, 1, 2};
          ForwardBatch b(16);
          b.add_sequence(ids, 0, pages, true, {0});
          for (int32_t r = 0; r < b.n_rows(); ++r) b.logit_rows.push_back(r);
          KvCache first = m.alloc_cache(3, 16), second = m.alloc_cache(3, 16);
          const std::vector<int32_t> want = be.argmax_rows(m.forward(b, first).logits);
          Tensor argmax = be.alloc_ids(rows);
          const TargetModel::Output out = m.forward(b, second, {}, &argmax);
          EXPECT_TRUE(out.logits.empty());
          std::vector<float> result(want.begin(), want.end());  // the argmax of the logits, then the ids
          for (int32_t id : be.ids_to_host(argmax)) result.push_back(static_cast<float>(id));
          return result;
        });
        const std::string what = std::string(target) + ", " + std::to_string(size) + " ranks, " + std::to_string(rows) + " rows";
        const std::vector<float> want(got[0].begin(), got[0].begin() + rows), ids(got[0].begin() + rows, got[0].end());
        EXPECT_EQ(ids, want) << what;
        if (rows > 32) {
          for (int r = 1; r < size; ++r) EXPECT_EQ(got[static_cast<size_t>(r)], got[0]) << what << ", rank " << r;
        }
      }
    }
  }
}

// A rank that fails stops the others (they would wait for its partial sums forever): each throws
// an error that names the failure.
TEST(TensorParallel, AFailingRankStopsTheOthers) {
  const std::string dir = fixture("targets/qwen3_gqa_tied");
  HostGroup group(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        auto be = make_cpu_backend();
        HostCommunicator comm(group, r);
        TargetModel m(*be, dir, {r, 2}, &comm);
        KvCache cache = m.alloc_cache(2, r == 0 ? 16 : 8);  // rank 1's cache does not fit the batch
        const std::vector<int32_t> pages = {1, 0};
        ForwardBatch b(16);
        b.add_sequence({5, 17, 200}, 0, pages, true, {0});
        b.logit_rows = {2};
        m.forward(b, cache);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
        group.abort(e.what());
      }
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_NE(errors[1].find("page size"), std::string::npos) << errors[1];
  EXPECT_NE(errors[0].find("tensor parallel group stopped"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("page size"), std::string::npos) << errors[0];
}

// A fixture pair (expected/NAME.json) in an engine over one rank and in one over two, and its prompts.
struct OneAndTwoRanks {
  explicit OneAndTwoRanks(const std::string& name) {
    const auto meta = test::read_json(fixture("expected/" + name + ".json"));
    EngineOptions eo;
    eo.model_dir = fixture(meta["target"].get<std::string>());
    eo.draft_dir = fixture(meta["draft"].get<std::string>());
    one = std::make_unique<Engine>(eo);
    eo.tensor_parallel = 2;
    two = std::make_unique<Engine>(eo);
    prompts = meta["prompts"].get<std::vector<std::vector<int32_t>>>();
  }
  std::unique_ptr<Engine> one, two;
  std::vector<std::vector<int32_t>> prompts;
};

// The engine over a 2-rank target (rank 0 in the engine, rank 1 on its own thread): plain and
// DFlash greedy generation give the tokens of one rank, for a dense and a hybrid pair. The
// drafts are accepted as often as one rank's: the split draft (its context projected by both
// ranks) drafts as the whole one does, which equal tokens alone would not show.
TEST(TensorParallel, GenerationOverTwoRanksEqualsOneRank) {
  for (const char* name : {"trained_qwen3", "qwen3_5_tied"}) {
    const OneAndTwoRanks pair(name);
    Engine &one = *pair.one, &two = *pair.two;
    const auto& prompts = pair.prompts;
    for (SpeculativeMode mode : {SpeculativeMode::None, SpeculativeMode::DFlash}) {
      GenerateOptions go;
      go.max_tokens = 24;
      go.mode = mode;
      for (size_t i = 0; i < 5; ++i) {  // trained_qwen3's prompt 4: 34 context rows at once
        const auto got = two.generate(prompts[i], go), want = one.generate(prompts[i], go);
        const std::string what = std::string(name) + ", prompt " + std::to_string(i) +
                                 (mode == SpeculativeMode::DFlash ? ", DFlash" : ", plain");
        EXPECT_EQ(got.tokens, want.tokens) << what;
        EXPECT_EQ(got.stats.acceptance_histogram, want.stats.acceptance_histogram) << what;
        if (mode == SpeculativeMode::DFlash && std::string(name) == "trained_qwen3") {
          EXPECT_GT(want.stats.tau, 1.5) << what << ": a trained draft is accepted";
        }
      }
    }
  }
}

// Sampled generation over two ranks (one sequence, at most 16 rows a step, no greedy rows: each
// rank selects the candidates in its part of the logits, rank 0 merges them; the rejection
// scheme's drafts come from the draft's gathered logits): one rank's tokens, plain and DFlash
// (both schemes), with top-k and with every entry (top_k 0).
TEST(TensorParallel, SampledGenerationOverTwoRanksEqualsOneRank) {
  const OneAndTwoRanks pair("trained_qwen3");
  Engine &one = *pair.one, &two = *pair.two;
  const auto& prompts = pair.prompts;
  for (SpeculativeMode mode : {SpeculativeMode::None, SpeculativeMode::DFlash}) {
    for (SpecSampling scheme : {SpecSampling::Match, SpecSampling::Rejection}) {
      if (mode == SpeculativeMode::None && scheme == SpecSampling::Rejection) continue;
      for (int top_k : {20, 0}) {
        for (size_t i = 0; i < 3; ++i) {
          GenerateOptions go;
          go.max_tokens = 24;
          go.mode = mode;
          go.spec_sampling = scheme;
          go.sampling.temperature = 1.5f;  // a flat distribution: samples from both ranks' parts
          go.sampling.top_k = top_k;
          go.sampling.seed = 11 + i;
          const auto got = two.generate(prompts[i], go), want = one.generate(prompts[i], go);
          const std::string what = "prompt " + std::to_string(i) + ", top_k " + std::to_string(top_k) +
                                   (mode == SpeculativeMode::DFlash
                                        ? (scheme == SpecSampling::Match ? ", DFlash match" : ", DFlash rejection")
                                        : ", plain");
          EXPECT_EQ(got.tokens, want.tokens) << what;
          EXPECT_EQ(got.stats.acceptance_histogram, want.stats.acceptance_histogram) << what;
        }
      }
    }
  }
}

// An engine of one rank over a fixture pair, and serving options for the same pair over two ranks.
struct PairOverTwoRanks {
  explicit PairOverTwoRanks(const nlohmann::json& meta) {
    eo.model_dir = fixture(meta["target"].get<std::string>());
    eo.draft_dir = fixture(meta["draft"].get<std::string>());
    one = std::make_unique<Engine>(eo);
    so.engine = eo;
    so.engine.tensor_parallel = 2;
  }
  EngineOptions eo;
  ServingOptions so;
  std::unique_ptr<Engine> one;
};

// Serving over two ranks: a hybrid conversation's second turn starts from a kept state copied on
// every rank, and each turn equals one rank's generation: its tokens, and their log-probabilities
// to 1e-4 (a rank left with another state is off by far more, while its tokens may still agree).
TEST(TensorParallel, ServingOverTwoRanksKeepsStatesOnEveryRank) {
  const auto meta = test::read_json(fixture("expected/qwen3_5_tied.json"));
  PairOverTwoRanks pair(meta);
  Engine& one = *pair.one;
  ServingOptions so = pair.so;
  so.engine.page_size = 4;
  so.max_num_seqs = 2;
  ServingEngine server(so);
  const auto prompts = meta["prompts"].get<std::vector<std::vector<int32_t>>>();
  std::vector<int32_t> prompt = prompts[0];
  for (int turn = 0; turn < 2; ++turn) {
    prompt.insert(prompt.end(), prompts[static_cast<size_t>(turn + 1)].begin(), prompts[static_cast<size_t>(turn + 1)].end());
    std::mutex mu;
    std::condition_variable cv;
    std::vector<int32_t> got;
    std::vector<float> got_logprobs;
    bool done = false;
    RequestParams rp;
    rp.prompt = prompt;
    rp.max_tokens = 12;
    rp.logprobs = 0;
    server.submit(rp, [&](const TokenEvent& e) {
      std::lock_guard<std::mutex> lk(mu);
      got.insert(got.end(), e.tokens.begin(), e.tokens.end());
      for (const auto& l : e.logprobs) got_logprobs.push_back(l.logprob);
      done = done || e.finished;
      cv.notify_all();
    });
    std::unique_lock<std::mutex> lk(mu);
    ASSERT_TRUE(cv.wait_for(lk, std::chrono::minutes(2), [&] { return done; }));
    GenerateOptions go;
    go.max_tokens = 12;
    go.mode = SpeculativeMode::DFlash;
    go.logprobs = 0;
    const auto want = one.generate(prompt, go);
    EXPECT_EQ(got, want.tokens) << "turn " << turn;
    ASSERT_EQ(got_logprobs.size(), want.logprobs.size());
    for (size_t i = 0; i < got_logprobs.size(); ++i)
      EXPECT_NEAR(got_logprobs[i], want.logprobs[i].logprob, 1e-4) << "turn " << turn << ", token " << i;
    prompt.insert(prompt.end(), got.begin(), got.end());
  }
  EXPECT_GT(server.stats().prefix_hit_pages, 0);
  EXPECT_GT(server.stats().state_snapshots_taken, 0);
}

// Serving over two ranks with three DFlash sequences a step (48 verification and 45 draft rows):
// each sequence gives one rank's generation, and the drafts are accepted as often (more than
// min_tau tokens a sequence-step: a trained draft). All greedy, the step's argmax comes from the
// ranks' candidates (more than 32 rows); with sampled sequences, the logits stay in the ranks'
// parts, which give the sampled rows' top-k candidates (merged on rank 0) and any greedy rows'
// argmax.
void serve_three_sequences_over_two_ranks(const std::vector<SamplingParams>& sampling, double min_tau) {
  const auto meta = test::read_json(fixture("expected/trained_qwen3.json"));
  PairOverTwoRanks pair(meta);
  Engine& one = *pair.one;
  ServingOptions so = pair.so;
  so.max_num_seqs = 3;
  ServingEngine server(so);
  const auto prompts = meta["prompts"].get<std::vector<std::vector<int32_t>>>();
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::vector<int32_t>> got(3);
  int done = 0;
  for (size_t i = 0; i < 3; ++i) {
    RequestParams rp;
    rp.prompt = prompts[i];
    rp.max_tokens = 40;
    rp.ignore_eos = true;
    rp.sampling = sampling[i];
    server.submit(rp, [&, i](const TokenEvent& e) {
      std::lock_guard<std::mutex> lk(mu);
      got[i].insert(got[i].end(), e.tokens.begin(), e.tokens.end());
      done += e.finished;
      cv.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lk(mu);
    ASSERT_TRUE(cv.wait_for(lk, std::chrono::minutes(2), [&] { return done == 3; }));
  }
  std::vector<int64_t> want_histogram(server.stats().acceptance_histogram.size(), 0);
  for (size_t i = 0; i < 3; ++i) {
    GenerateOptions go;
    go.max_tokens = 40;
    go.use_default_eos = false;
    go.mode = SpeculativeMode::DFlash;
    go.sampling = sampling[i];
    const GenerationResult want = one.generate(prompts[i], go);
    EXPECT_EQ(got[i], want.tokens) << "prompt " << i << (sampling[i].greedy() ? ", greedy" : ", sampled");
    for (size_t a = 0; a < want.stats.acceptance_histogram.size() && a < want_histogram.size(); ++a)
      want_histogram[a] += want.stats.acceptance_histogram[a];
  }
  EXPECT_EQ(server.stats().acceptance_histogram, want_histogram);
  int64_t steps = 0, tokens = 0;
  for (size_t a = 0; a < want_histogram.size(); ++a) steps += want_histogram[a], tokens += (a + 1) * want_histogram[a];
  EXPECT_GT(static_cast<double>(tokens), min_tau * static_cast<double>(steps)) << "the trained draft is accepted";
}

TEST(TensorParallel, GreedyServingOfThreeSequencesEqualsOneRank) {
  serve_three_sequences_over_two_ranks(std::vector<SamplingParams>(3), 2.0);
}

TEST(TensorParallel, SampledServingBesideGreedyEqualsOneRank) {
  std::vector<SamplingParams> sampling(3);
  sampling[1].temperature = 0.7f, sampling[1].top_k = 20, sampling[1].seed = 5;
  sampling[2].temperature = 0.7f, sampling[2].top_p = 0.9f, sampling[2].seed = 6;  // every entry a candidate
  serve_three_sequences_over_two_ranks(sampling, 1.5);
}

// Sampled sequences alone: no argmax is exchanged, and the steps' ids carry none.
TEST(TensorParallel, SampledServingEqualsOneRank) {
  std::vector<SamplingParams> sampling(3);
  for (size_t i = 0; i < 3; ++i) {
    sampling[i].temperature = 0.7f;
    sampling[i].top_k = i == 2 ? 0 : 20;
    sampling[i].seed = 7 + i;
  }
  serve_three_sequences_over_two_ranks(sampling, 1.5);
}

TEST(TensorParallel, ShapesThatDoNotDivideAreRefused) {
  auto expect_refused = [](const char* target, int size, const std::string& what) {
    auto be = make_cpu_backend();
    HostGroup group(size);
    HostCommunicator comm(group, 0);
    try {
      TargetModel m(*be, fixture(std::string("targets/") + target), {0, size}, &comm);
      ADD_FAILURE() << target << " loaded as " << size << " ranks";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_refused("qwen3_gqa_tied", 3, "num_attention_heads");   // 4 heads
  expect_refused("qwen3_gqa_tied", 8, "num_attention_heads");   // fewer heads than ranks
  expect_refused("qwen3_moe_untied_bf16", 3, "num_attention_heads");
  expect_refused("qwen3_5_moe_untied_bf16", 4, "linear_num_key_heads");  // 2 key heads
}

}  // namespace
}  // namespace dflash
