// The serving engine: many concurrent requests decoded with continuous
// batching give exactly what one-at-a-time generation gives (plain and DFlash),
// also when KV pages run out and sequences are preempted and recomputed, and
// for sampled requests (equal to plain sampling with the same seed);
// cancellation frees pages; requests that can never run are refused.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "engine/engine.h"
#include "engine/page_pool.h"
#include "engine/serving.h"
#include "test_util.h"
#include "util/error.h"

namespace dflash {
namespace {

using test::fixture;

// Collects events per request and waits for all of them to finish.
struct Collector {
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, std::vector<int32_t>> tokens;
  std::map<uint64_t, std::vector<float>> logprobs;  // of the tokens, when the request asks
  std::map<uint64_t, FinishReason> reasons;
  int n_events = 0;

  ServingEngine::Callback callback_for(uint64_t* id_slot) {
    return [this, id_slot](const TokenEvent& e) {
      std::lock_guard<std::mutex> lk(mu);
      auto& t = tokens[*id_slot];
      t.insert(t.end(), e.tokens.begin(), e.tokens.end());
      for (const auto& l : e.logprobs) logprobs[*id_slot].push_back(l.logprob);
      ++n_events;
      if (e.finished) reasons[*id_slot] = e.finish_reason;
      cv.notify_all();
    };
  }
  void wait_for(size_t n_finished) {
    std::unique_lock<std::mutex> lk(mu);
    ASSERT_TRUE(cv.wait_for(lk, std::chrono::minutes(5), [&] { return reasons.size() >= n_finished; }))
        << "requests did not finish";
  }
};

// Serves one request and waits for its end: its tokens, and their log-probabilities when asked.
struct Served {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
};
Served serve_one(ServingEngine& server, const std::vector<int32_t>& prompt, int max_tokens, int logprobs = -1) {
  Collector col;
  uint64_t id = 0;
  RequestParams rp;
  rp.prompt = prompt;
  rp.max_tokens = max_tokens;
  rp.logprobs = logprobs;
  {
    std::lock_guard<std::mutex> lk(col.mu);
    id = server.submit(rp, col.callback_for(&id));
  }
  col.wait_for(1);
  return {col.tokens[id], col.logprobs[id]};
}

struct Pair {
  std::string target, draft;
  std::vector<std::vector<int32_t>> prompts;
};

Pair trained_pair(const std::string& name = "trained_qwen3") {
  const auto meta = test::read_json(fixture("expected/" + name + ".json"));
  return {fixture(meta["target"].get<std::string>()), fixture(meta["draft"].get<std::string>()),
          meta["prompts"].get<std::vector<std::vector<int32_t>>>()};
}

// Submits every prompt at once and compares with Engine::generate, prompt by prompt.
// Sampled requests (prompt i with seed sampling->seed + i) are compared with plain
// sampling under the match scheme (it commits exactly its tokens), and with
// one-at-a-time DFlash under the rejection scheme.
void expect_same_as_generate(const Pair& pair, SpeculativeMode mode, int max_tokens, int kv_pages,
                             int max_num_seqs, int64_t* n_preempted = nullptr,
                             const SamplingParams* sampling = nullptr, SpecSampling scheme = SpecSampling::Match) {
  EngineOptions eo;
  eo.model_dir = pair.target;
  eo.draft_dir = pair.draft;
  ServingOptions so;
  so.engine = eo;
  so.mode = mode;
  so.kv_pages = kv_pages;
  so.max_num_seqs = max_num_seqs;
  so.max_tokens_per_step = 64;  // prompts are prefilled in several chunks
  so.spec_sampling = scheme;
  ServingEngine server(so);
  Collector col;
  std::vector<uint64_t> ids(pair.prompts.size());
  {
    std::lock_guard<std::mutex> lk(col.mu);  // no event is recorded before its id is known
    for (size_t i = 0; i < pair.prompts.size(); ++i) {
      RequestParams rp;
      rp.prompt = pair.prompts[i];
      rp.max_tokens = max_tokens;
      if (sampling) {
        rp.sampling = *sampling;
        rp.sampling.seed += i;
      }
      ids[i] = server.submit(rp, col.callback_for(&ids[i]));
    }
  }
  col.wait_for(pair.prompts.size());
  Engine engine(eo);
  for (size_t i = 0; i < pair.prompts.size(); ++i) {
    GenerateOptions go;
    go.max_tokens = max_tokens;
    go.mode = sampling && scheme == SpecSampling::Match ? SpeculativeMode::None : mode;
    go.spec_sampling = scheme;
    if (sampling) {
      go.sampling = *sampling;
      go.sampling.seed += i;
    }
    const auto ref = engine.generate(pair.prompts[i], go);
    EXPECT_EQ(col.tokens[ids[i]], ref.tokens) << "prompt " << i;
    EXPECT_EQ(col.reasons[ids[i]], ref.stop_reason) << "prompt " << i;
  }
  const ServingStats st = server.stats();
  EXPECT_EQ(st.kv_pages_used, 0) << "pages left in use after every request finished";
  if (n_preempted) *n_preempted = st.n_preempted;
  if (mode == SpeculativeMode::DFlash) {
    EXPECT_GT(st.dflash_seq_steps, 0);
  }
}

TEST(Serving, ConcurrentPlainRequestsEqualOneAtATimeGeneration) {
  expect_same_as_generate(trained_pair(), SpeculativeMode::None, 40, 0, 8);
}

TEST(Serving, ConcurrentDFlashRequestsEqualOneAtATimeGeneration) {
  expect_same_as_generate(trained_pair(), SpeculativeMode::DFlash, 40, 0, 8);
}

TEST(Serving, PreemptionWhenPagesRunOutLosesNothing) {
  int64_t preempted = 0;
  // 20 prompts of ~24 tokens + 64 new + a block of 16: 7 pages each; 24 pages hold 3.
  expect_same_as_generate(trained_pair(), SpeculativeMode::DFlash, 64, 24, 20, &preempted);
  EXPECT_GT(preempted, 0) << "the test meant to exercise preemption did not preempt";
  expect_same_as_generate(trained_pair(), SpeculativeMode::None, 64, 12, 20, &preempted);
  EXPECT_GT(preempted, 0);
}

// Qwen3.5: every running sequence keeps its own Gated DeltaNet state (a slot), verification
// blocks fold in only their accepted rows, and a preempted sequence starts its state over.
// (Under the sanitizers, DFLASH_TEST_LIGHT, only the preempting run.)
TEST(Serving, HybridTargetRequestsEqualOneAtATimeAlsoWhenPreempted) {
  const bool light = std::getenv("DFLASH_TEST_LIGHT") && std::string(std::getenv("DFLASH_TEST_LIGHT")) == "1";
  int64_t preempted = 0;
  expect_same_as_generate(trained_pair("trained_qwen3_5"), SpeculativeMode::DFlash, 64, 24, 20, &preempted);
  EXPECT_GT(preempted, 0) << "the test meant to exercise preemption did not preempt";
  if (light) return;
  expect_same_as_generate(trained_pair("trained_qwen3_5"), SpeculativeMode::DFlash, 40, 0, 8);
  const SamplingParams sp{0.8f, 0, 0.95f, 4242};
  expect_same_as_generate(trained_pair("trained_qwen3_5"), SpeculativeMode::DFlash, 40, 0, 8, nullptr, &sp);
}

TEST(Serving, SampledDFlashRequestsEqualPlainSamplingAlsoWhenPreempted) {
  const SamplingParams sp{0.8f, 0, 0.95f, 4242};
  int64_t preempted = 0;
  expect_same_as_generate(trained_pair(), SpeculativeMode::DFlash, 64, 24, 20, &preempted, &sp);
  EXPECT_GT(preempted, 0);
  // Rejection sampling: batched steps give what one sequence alone gives (no preemption:
  // a recomputed prefill would sample a position that verification sampled before).
  expect_same_as_generate(trained_pair(), SpeculativeMode::DFlash, 40, 0, 8, nullptr, &sp, SpecSampling::Rejection);
}

TEST(Serving, RepeatedPrefixesComeFromThePrefixCache) {
  const Pair pair = trained_pair();
  EngineOptions eo;
  eo.model_dir = pair.target;
  eo.draft_dir = pair.draft;
  for (SpeculativeMode mode : {SpeculativeMode::None, SpeculativeMode::DFlash}) {
    ServingOptions so;
    so.engine = eo;
    so.engine.page_size = 4;
    so.mode = mode;
    ServingEngine server(so);
    Engine engine(eo);
    // A shared "system prompt" followed by different endings, one request after another.
    const std::vector<int32_t> system(pair.prompts[0].begin(), pair.prompts[0].end());
    int64_t hits_before = 0;
    for (size_t i = 1; i < 6; ++i) {
      std::vector<int32_t> prompt = system;
      prompt.insert(prompt.end(), pair.prompts[i].begin(), pair.prompts[i].end());
      const Served got = serve_one(server, prompt, 24);
      GenerateOptions go;
      go.max_tokens = 24;
      go.mode = mode;
      EXPECT_EQ(got.tokens, engine.generate(prompt, go).tokens) << "request " << i;
      const int64_t hits = server.stats().prefix_hit_pages;
      if (i > 1) {
        EXPECT_GE(hits - hits_before, static_cast<int64_t>(system.size() / 4)) << "request " << i;
      }
      hits_before = hits;
    }
    EXPECT_EQ(server.stats().kv_pages_used, 0);
    EXPECT_GT(server.stats().kv_pages_cached, 0);
  }
}

// Qwen3.5: a conversation's next turn maps the previous turns' pages and starts from a kept
// recurrent state (a snapshot at a page end), plain and DFlash, and equals generating it alone
// (its tokens, and their log-probabilities to 1e-5: a wrong state may leave the tokens alone); with
// no snapshots the prefix cache is off for the hybrid target and the output is the same.
TEST(Serving, HybridTurnsStartFromKeptStates) {
  // Random weights: every token depends on the whole state (the trained pair's tokens hardly do).
  const Pair pair = trained_pair("qwen3_5_tied");
  EngineOptions eo;
  eo.model_dir = pair.target;
  eo.draft_dir = pair.draft;
  Engine engine(eo);
  for (SpeculativeMode mode : {SpeculativeMode::None, SpeculativeMode::DFlash}) {
    for (int snapshots : {-1, 0}) {
      ServingOptions so;
      so.engine = eo;
      so.engine.page_size = 4;
      so.mode = mode;
      so.max_num_seqs = 4;
      so.state_snapshots = snapshots;
      ServingEngine server(so);
      std::vector<int32_t> history = pair.prompts[0];
      int64_t hits_before = 0;
      size_t last_prompt = 0;
      for (size_t turn = 1; turn < 5; ++turn) {
        std::vector<int32_t> prompt = history;
        prompt.insert(prompt.end(), pair.prompts[turn].begin(), pair.prompts[turn].end());
        const Served got = serve_one(server, prompt, 12, 0);
        GenerateOptions go;
        go.max_tokens = 12;
        go.mode = mode;
        go.logprobs = 0;
        const std::string what = cat(mode == SpeculativeMode::DFlash ? "DFlash" : "plain", ", snapshots ", snapshots,
                                     ", turn ", turn);
        const auto want = engine.generate(prompt, go);
        EXPECT_EQ(got.tokens, want.tokens) << what;
        ASSERT_EQ(got.logprobs.size(), want.logprobs.size()) << what;
        for (size_t i = 0; i < want.logprobs.size(); ++i)
          EXPECT_NEAR(got.logprobs[i], want.logprobs[i].logprob, 1e-5) << what << ", token " << i;
        const int64_t hits = server.stats().prefix_hit_pages;
        std::printf("[%s] %lld pages from the prefix cache, %lld states kept\n", what.c_str(),
                    static_cast<long long>(hits - hits_before),
                    static_cast<long long>(server.stats().state_snapshots_taken));
        // A state was kept at the last page end of the last turn's prompt, at least.
        if (snapshots != 0 && turn > 1) {
          EXPECT_GE(hits - hits_before, static_cast<int64_t>(last_prompt / 4)) << what;
        }
        if (snapshots == 0) {
          EXPECT_EQ(hits, 0) << what;
        }
        hits_before = hits;
        last_prompt = prompt.size();
        history = prompt;
        history.insert(history.end(), got.tokens.begin(), got.tokens.end());
      }
      const ServingStats st = server.stats();
      EXPECT_EQ(st.kv_pages_used, 0);
      if (snapshots != 0) {
        EXPECT_GT(st.state_snapshots_taken, 0);
      } else {
        EXPECT_EQ(st.state_snapshots_taken, 0);
      }
    }
  }
}

// State snapshots in the page pool: a prefix matches up to its last page with a snapshot; a
// sequence's new snapshot replaces its previous one; released snapshots are evicted least
// recently used first, never a running sequence's; a snapshot goes with its page.
TEST(PagePool, StateSnapshotsFollowTheirPages) {
  PagePool pool(10, 2, 2);
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6, 7}, b = {9, 8, 7, 6, 5};
  std::vector<int32_t> ta, tb;
  ASSERT_TRUE(pool.reserve(ta, 7));
  int32_t reg_a = 0, held_a = -1;
  uint64_t chain_a = 0;
  pool.register_full_pages(a, 4, ta, &reg_a, &chain_a);  // pages [1 2] [3 4]
  EXPECT_EQ(pool.claim_snapshot(chain_a, &held_a), 0);
  EXPECT_EQ(pool.claim_snapshot(chain_a, &held_a), -1);  // that chain has one
  std::vector<int32_t> t;
  int32_t snap = -2;
  EXPECT_EQ(pool.match_prefix(a, t, &snap), 4);
  EXPECT_EQ(snap, 0);
  pool.release(t);
  pool.register_full_pages(a, 6, ta, &reg_a, &chain_a);  // + [5 6]
  EXPECT_EQ(pool.claim_snapshot(chain_a, &held_a), 0);  // replaces its own
  EXPECT_EQ(pool.match_prefix(a, t, &snap), 6);
  EXPECT_EQ(snap, 0);
  pool.release(t);
  // B takes the other snapshot; a third chain finds both owned.
  ASSERT_TRUE(pool.reserve(tb, 5));
  int32_t reg_b = 0, held_b = -1, held_c = -1;
  uint64_t chain_b = 0;
  pool.register_full_pages(b, 2, tb, &reg_b, &chain_b);
  EXPECT_EQ(pool.claim_snapshot(chain_b, &held_b), 1);
  EXPECT_EQ(pool.claim_snapshot(12345, &held_c), -1);
  // A ends: its snapshot is cached, and the first to go when one is needed.
  pool.release(ta);
  pool.release_snapshot(&held_a);
  EXPECT_EQ(pool.match_prefix(a, t, &snap), 6);
  pool.release(t);
  EXPECT_EQ(pool.claim_snapshot(12345, &held_c), 0);
  EXPECT_EQ(pool.match_prefix(a, t, &snap), 0);  // A's pages are cached, its state is not
  EXPECT_EQ(snap, -1);
  EXPECT_TRUE(t.empty());
  // B ends; its pages are evicted for new ones, and its snapshot with them.
  pool.release(tb);
  pool.release_snapshot(&held_b);
  std::vector<int32_t> big;
  ASSERT_TRUE(pool.reserve(big, 20));  // every page: the cached ones are evicted
  EXPECT_EQ(pool.match_prefix(b, t, &snap), 0);
  EXPECT_EQ(snap, -1);
  int32_t held_d = -1;
  EXPECT_EQ(pool.claim_snapshot(777, &held_d), 1);  // B's snapshot was freed with its page
}

TEST(Serving, CancelFreesPagesAndBadRequestsAreRefused) {
  const Pair pair = trained_pair();
  ServingOptions so;
  so.engine.model_dir = pair.target;
  so.engine.draft_dir = pair.draft;
  ServingEngine server(so);
  Collector col;
  uint64_t id = 0;
  RequestParams rp;
  rp.prompt = pair.prompts[0];
  rp.max_tokens = 100000;  // would run to the end of the context
  {
    std::lock_guard<std::mutex> lk(col.mu);
    id = server.submit(rp, col.callback_for(&id));
  }
  {
    std::unique_lock<std::mutex> lk(col.mu);
    col.cv.wait(lk, [&] { return col.n_events > 0; });
  }
  server.cancel(id);
  col.wait_for(1);
  EXPECT_EQ(col.reasons[id], FinishReason::Cancelled);
  // Pages are free (and the metrics say so) by the time the client hears that its request ended.
  EXPECT_EQ(server.stats().kv_pages_used, 0);
  uint64_t short_id = 0;
  int64_t used_at_end = -1;
  rp.max_tokens = 5;
  {
    std::lock_guard<std::mutex> lk(col.mu);
    auto collect = col.callback_for(&short_id);
    short_id = server.submit(rp, [&, collect](const TokenEvent& e) {
      if (e.finished) used_at_end = server.stats().kv_pages_used;
      collect(e);
    });
  }
  col.wait_for(2);
  EXPECT_EQ(col.reasons[short_id], FinishReason::Length);
  EXPECT_EQ(used_at_end, 0);

  auto refused = [&](RequestParams p) {
    try {
      server.submit(p, [](const TokenEvent&) {});
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  RequestParams empty;
  EXPECT_NE(refused(empty).find("empty"), std::string::npos);
  RequestParams bad_id;
  bad_id.prompt = {1, 2, 100000};
  EXPECT_NE(refused(bad_id).find("outside the vocabulary"), std::string::npos);
  RequestParams zero;
  zero.prompt = {1, 2};
  zero.max_tokens = 0;
  EXPECT_NE(refused(zero).find("max_tokens"), std::string::npos);
  RequestParams too_long;
  too_long.prompt.assign(static_cast<size_t>(server.target_config().max_positions), 5);
  EXPECT_NE(refused(too_long).find("context"), std::string::npos);
}

// n > 1: choices submitted together, each with its own seed; the later ones wait for the first's
// prefill and map its prompt pages. Each equals one request alone with its seed, logits processing
// and log-probabilities included, plain and DFlash.
TEST(Serving, ChoicesShareThePromptsPagesAndEachEqualsItsSeedAlone) {
  const Pair pair = trained_pair();
  EngineOptions eo;
  eo.model_dir = pair.target;
  eo.draft_dir = pair.draft;
  eo.page_size = 4;
  std::vector<int32_t> prompt = pair.prompts[0];
  prompt.insert(prompt.end(), pair.prompts[1].begin(), pair.prompts[1].end());
  Engine engine(eo);
  for (SpeculativeMode mode : {SpeculativeMode::None, SpeculativeMode::DFlash}) {
    ServingOptions so;
    so.engine = eo;
    so.mode = mode;
    so.max_tokens_per_step = 16;  // the prompt takes several prefill steps
    ServingEngine server(so);
    Collector col;
    std::map<uint64_t, std::vector<TokenLogprobs>> logprobs;
    const int n = 4;
    std::vector<uint64_t> ids(n);
    RequestParams rp;
    rp.prompt = prompt;
    rp.max_tokens = 20;
    rp.logprobs = 2;
    rp.sampling = SamplingParams(0.9f, 0, 1.0f, 300);
    rp.sampling.presence_penalty = 0.7f;
    rp.sampling.logit_bias = {{3, 1.0f}};
    {
      std::lock_guard<std::mutex> lk(col.mu);
      for (int i = 0; i < n; ++i) {
        RequestParams c = rp;
        c.sampling.seed += static_cast<uint64_t>(i);
        c.share_prefix_with = i > 0 ? ids[0] : 0;
        auto collect = col.callback_for(&ids[static_cast<size_t>(i)]);
        ids[static_cast<size_t>(i)] = server.submit(c, [&, collect, slot = &ids[static_cast<size_t>(i)]](const TokenEvent& e) {
          logprobs[*slot].insert(logprobs[*slot].end(), e.logprobs.begin(), e.logprobs.end());
          collect(e);
        });
      }
    }
    col.wait_for(n);
    EXPECT_GE(server.stats().prefix_hit_pages, static_cast<int64_t>((n - 1) * (prompt.size() / 4 - 1)));
    std::set<std::vector<int32_t>> distinct;
    for (int i = 0; i < n; ++i) {
      GenerateOptions go;
      go.max_tokens = rp.max_tokens;
      go.mode = SpeculativeMode::None;
      go.sampling = rp.sampling;
      go.sampling.seed += static_cast<uint64_t>(i);
      go.logprobs = 2;
      const auto ref = engine.generate(prompt, go);
      const uint64_t id = ids[static_cast<size_t>(i)];
      EXPECT_EQ(col.tokens[id], ref.tokens) << "choice " << i;
      ASSERT_EQ(logprobs[id].size(), ref.logprobs.size());
      for (size_t k = 0; k < ref.logprobs.size(); ++k) {
        EXPECT_EQ(logprobs[id][k].logprob, ref.logprobs[k].logprob);
        EXPECT_EQ(logprobs[id][k].top, ref.logprobs[k].top);
      }
      distinct.insert(ref.tokens);
    }
    EXPECT_GT(distinct.size(), 1u) << "the choices' seeds should differ";
    EXPECT_EQ(server.stats().kv_pages_used, 0);
  }
}

TEST(Serving, IgnoreEosRunsToMaxTokens) {
  const Pair pair = trained_pair();
  ServingOptions so;
  so.engine.model_dir = pair.target;
  so.engine.draft_dir = pair.draft;
  ServingEngine server(so);
  Collector col;
  uint64_t id = 0;
  RequestParams rp;
  rp.prompt = pair.prompts[2];
  rp.max_tokens = 30;
  rp.extra_eos.assign(64, 0);
  for (int32_t t = 0; t < 64; ++t) rp.extra_eos[static_cast<size_t>(t)] = t;  // most tokens would end it
  rp.ignore_eos = true;
  {
    std::lock_guard<std::mutex> lk(col.mu);
    id = server.submit(rp, col.callback_for(&id));
  }
  col.wait_for(1);
  EXPECT_EQ(col.tokens[id].size(), 30u);
  EXPECT_EQ(col.reasons[id], FinishReason::Length);
}

// The default rows a step: 2048, or twice a full decoding step (sequences x block) when that is
// more, so that prompts still get rows while every sequence decodes; a given value stays.
TEST(Serving, StepRowsLeavePromptsRoomBesideAFullDecodingStep) {
  const Pair pair = trained_pair();
  ServingOptions so;
  so.engine.model_dir = pair.target;
  so.engine.draft_dir = pair.draft;
  so.kv_pages = 64;
  const int block = ServingEngine(so).block_size();
  ASSERT_GT(block, 1);
  EXPECT_EQ(ServingEngine(so).max_tokens_per_step(), 2048);  // 32 sequences
  so.max_num_seqs = 200;
  EXPECT_EQ(ServingEngine(so).max_tokens_per_step(), 2 * 200 * block);
  so.mode = SpeculativeMode::None;
  EXPECT_EQ(ServingEngine(so).max_tokens_per_step(), 2048);  // 200 rows
  so.max_tokens_per_step = 100;
  EXPECT_EQ(ServingEngine(so).max_tokens_per_step(), 100);
}

}  // namespace
}  // namespace dflash
