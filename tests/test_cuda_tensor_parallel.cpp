// Tensor parallelism over two GPUs (NCCL): a 2-rank target's logits track one GPU's; DFlash
// greedy equals plain greedy over two GPUs token for token; generation over two GPUs gives one
// GPU's tokens on the trained pairs; serving with CUDA graphs (every rank's part captured,
// restaged and replayed with rank 0's) equals generation op by op; sampled tokens from the ranks'
// parts of the logits (served steps, and sequences alone) equal those of the whole logits.
// Skipped without two GPUs (scripts/device-test.sh STEPS=tp on a two-GPU kind).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#include <random>
#include <thread>

#include "engine/engine.h"
#include "engine/serving.h"
#include "engine_runs.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/cuda/kernel_forms.h"
#include "model/target_model.h"
#include "test_util.h"
#include "util/dtype.h"

namespace dflash {
namespace {

using test::fixture;

class CudaTensorParallel : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() < 2)
      GTEST_SKIP() << "needs two CUDA GPUs: tensor-parallel GPU tests run on a two-GPU device (scripts/device-test.sh)";
  }
};

// Every fixture pair whose shards the CUDA kernels take: the routed kernels need experts of a
// multiple of 8 features, which qwen3_5_moe_untied_bf16's (20) and qwen3_next_untied's (24) are
// not once halved.
const char* const kPairs[] = {"qwen3_gqa_tied", "llama_gqa4_bias_sharded", "trained_qwen3", "qwen3_moe_tied",
                              "trained_qwen3_moe", "qwen3_5_tied", "trained_qwen3_5"};

// Per case, each rank's inputs or outputs of a sequence of collectives.
using PerCase = std::vector<std::vector<float>>;

// rank(r, backend) on rank 1's thread (its backend made there) and on this one for rank 0; rank
// 1's failure is thrown here once both are done.
template <typename Rank>
void run_two_ranks(RankDevices& devices, Backend& be0, Rank&& rank) {
  std::exception_ptr error;
  std::thread one([&] {
    try {
      auto be1 = devices.make_backend(1);
      rank(1, *be1);
    } catch (...) {
      error = std::current_exception();
    }
  });
  rank(0, be0);
  one.join();
  if (error) std::rethrow_exception(error);
}

// Prefill logits of a 100-token prompt and of 3 decoded tokens after it.
std::vector<float> logits_of(Backend& be, TargetModel& m, const std::vector<int32_t>& prompt) {
  KvCache cache = m.alloc_cache(8, 16);
  const std::vector<int32_t> table{0, 1, 2, 3, 4, 5, 6, 7};
  ForwardBatch b(16);
  b.add_sequence(prompt, 0, table, true, {0});
  for (int32_t r = 0; r < b.n_rows(); ++r) b.logit_rows.push_back(r);
  std::vector<float> out = be.to_host(m.forward(b, cache).logits);
  for (int32_t t = 0; t < 3; ++t) {
    ForwardBatch d(16);
    d.add_sequence({7 + t}, static_cast<int32_t>(prompt.size()) + t, table, true, {0});
    d.logit_rows = {0};
    const auto next = be.to_host(m.forward(d, cache).logits);
    out.insert(out.end(), next.begin(), next.end());
  }
  return out;
}

// The ranks' partial sums are rounded to bf16 before the all-reduce adds them (one GPU rounds the
// whole sum once): the logits move by about as much as bf16 moves them anywhere, more where a
// token's routing flips between near-tied experts (H100 and H200 alike: dense 0.7e-2 to 1.1e-2,
// qwen3_5_tied 2.2e-2, trained_qwen3_5 2.6e-2, qwen3_moe_tied 3.1e-2, trained_qwen3_moe 5.0e-2).
TEST_F(CudaTensorParallel, LogitsOverTwoGpusTrackOneGpu) {
  auto be = make_cuda_backend();
  std::vector<int32_t> prompt(100);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 37 + 11) % 256);
  for (const char* name : kPairs) {
    const std::string dir = fixture(std::string("targets/") + name);
    std::vector<float> one, two;
    {
      TargetModel m(*be, dir);
      one = logits_of(*be, m, prompt);
    }
    {
      TargetModel m(*be, dir, 2);
      ASSERT_EQ(m.tensor_parallel(), 2);
      two = logits_of(*be, m, prompt);
    }
    const double err = test::rel_l2_error(two, one);
    std::printf("[%s] logits over 2 GPUs vs 1: rel. L2 error %.2e\n", name, err);
    const bool dense = std::string(name).find("moe") == std::string::npos;
    EXPECT_LE(err, dense ? 3e-2 : 7e-2) << name;
  }
}

TEST_F(CudaTensorParallel, DFlashEqualsPlainGreedyOverTwoGpus) {
  for (const char* name : kPairs) {
    const auto meta = test::read_json(fixture(std::string("expected/") + name + ".json"));
    EngineOptions eo;
    eo.device = "cuda";
    eo.tensor_parallel = 2;
    eo.model_dir = fixture(meta["target"].get<std::string>());
    eo.draft_dir = fixture(meta["draft"].get<std::string>());
    Engine engine(eo);
    test::expect_lossless(engine, meta["prompts"].get<std::vector<std::vector<int32_t>>>(),
                          meta["max_new_tokens"].get<int>(), meta["eos_ids"].get<std::vector<int32_t>>(),
                          std::string(name) + " over 2 GPUs");
  }
}

TEST_F(CudaTensorParallel, GenerationOverTwoGpusEqualsOneGpuOnTrainedPairs) {
  for (const char* name : {"trained_qwen3", "trained_qwen3_moe", "trained_qwen3_5"}) {
    const auto meta = test::read_json(fixture(std::string("expected/") + name + ".json"));
    EngineOptions eo;
    eo.device = "cuda";
    eo.model_dir = fixture(meta["target"].get<std::string>());
    eo.draft_dir = fixture(meta["draft"].get<std::string>());
    const auto prompts = meta["prompts"].get<std::vector<std::vector<int32_t>>>();
    const int max_tokens = meta["max_new_tokens"].get<int>();
    const auto one = test::generate_all(eo, SpeculativeMode::DFlash, prompts, max_tokens);
    eo.tensor_parallel = 2;
    const auto two = test::generate_all(eo, SpeculativeMode::DFlash, prompts, max_tokens);
    size_t same = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      same += two[i] == one[i];
      EXPECT_EQ(two[i], one[i]) << name << ", prompt " << i;
    }
    std::printf("[%s] over 2 GPUs: %zu of %zu prompts give one GPU's tokens\n", name, same, prompts.size());
  }
}

// Serving three DFlash sequences over two GPUs (48 verification rows a step), two of them sampled
// (top-k, and every entry) beside a greedy one, and generating sampled sequences alone (16 rows a
// step, plain and DFlash): the sampled rows' candidates come from each rank's part of the
// vocabulary, merged (no logits gathered), and give the tokens that the whole logits give
// (generation with log-probabilities gathers them and chooses on the host); batch-invariant, so
// that a row's logits do not depend on the rows beside it.
TEST_F(CudaTensorParallel, SampledServingFromTheRanksPartsEqualsTheWholeLogitsOverTwoGpus) {
  const auto meta = test::read_json(fixture("expected/trained_qwen3.json"));
  EngineOptions eo;
  eo.device = "cuda";
  eo.tensor_parallel = 2;
  eo.batch_invariant = true;
  eo.model_dir = fixture(meta["target"].get<std::string>());
  eo.draft_dir = fixture(meta["draft"].get<std::string>());
  const auto all = meta["prompts"].get<std::vector<std::vector<int32_t>>>();
  const std::vector<std::vector<int32_t>> prompts(all.begin(), all.begin() + 3);
  std::vector<SamplingParams> sampling(3);
  sampling[0].temperature = 1.5f, sampling[0].top_k = 20, sampling[0].seed = 3;
  sampling[1].temperature = 1.5f, sampling[1].seed = 4;  // every entry a candidate
  ServingOptions so;
  so.engine = eo;
  so.mode = SpeculativeMode::DFlash;
  so.max_num_seqs = 3;
  const auto got = test::serve_all(so, prompts, 40, nullptr, [&](size_t i, RequestParams& rp) {
    rp.sampling = sampling[i];
    rp.ignore_eos = true;
  });
  Engine engine(eo);
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerateOptions go;
    go.max_tokens = 40;
    go.use_default_eos = false;
    go.mode = SpeculativeMode::DFlash;
    go.sampling = sampling[i];
    go.logprobs = 0;
    EXPECT_EQ(got[i], engine.generate(prompts[i], go).tokens) << "prompt " << i;
  }
  for (SpeculativeMode mode : {SpeculativeMode::None, SpeculativeMode::DFlash}) {
    for (size_t i = 0; i < 2; ++i) {
      GenerateOptions go;
      go.max_tokens = 32;
      go.mode = mode;
      go.sampling = sampling[i];
      const auto parts = engine.generate(prompts[i], go);
      go.logprobs = 0;
      EXPECT_EQ(parts.tokens, engine.generate(prompts[i], go).tokens)
          << "prompt " << i << " alone" << (mode == SpeculativeMode::DFlash ? ", DFlash" : ", plain");
    }
  }
}

TEST_F(CudaTensorParallel, ServingWithGraphsOverTwoGpusEqualsGenerateOpByOp) {
  const auto prompts = test::bundled_prompts(8);
  EngineOptions eo = test::bundled_pair_on_gpu();
  eo.batch_invariant = true;
  eo.tensor_parallel = 2;
  for (auto mode : {SpeculativeMode::None, SpeculativeMode::DFlash}) {
    ServingStats st;
    const auto got = test::serve_all(eo, mode, mode == SpeculativeMode::None ? 8 : 2, prompts, 200, &st);
    const char* what = mode == SpeculativeMode::None ? "plain" : "dflash";
    EXPECT_GT(st.graph_steps, 0) << what;
    std::printf("[bundled pair over 2 GPUs] serving %s: %lld of %lld steps replayed graphs\n", what,
                static_cast<long long>(st.graph_steps), static_cast<long long>(st.n_steps));
    const auto expected = test::generate_all(eo, mode, prompts, 200);
    for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(got[i], expected[i]) << what << ", prompt " << i;
  }
}

// Two ranks run a sequence of collectives of changing kinds, types and sizes, through the peer
// kernels (up to their limits, whole and partial blocks, calls alternating halves of the inboxes)
// and through NCCL beyond them (sizes or rows not a multiple of 4 bytes, all-reduces over 2 MiB,
// gathers and broadcasts over 4 MiB or over what the GPU holds at once). Sums: every element is
// the float32 sum of the two bf16 values rounded once, the same on both ranks. Gathers: each row
// holds the ranks' rows side by side, in rank order. Broadcasts: rank 0's tensor, also in runs of
// broadcasts with nothing else between them (rank 0 then waits for nobody's data, only for the
// other rank to have finished the call that last used the inbox half). Argmax (a vocabulary
// split's, Communicator::argmax_all of each rank's Backend::argmax_candidates, through the peer
// kernel and through the fallback that gathers the candidates): every rank gets the argmax of the
// whole rows, the lower id on ties (ties across the ranks included; "f32" marks cases of few
// distinct values), 0 for rows with no value (-inf or NaN everywhere).
TEST_F(CudaTensorParallel, CollectivesGiveEveryRankTheSameWords) {
  enum Kind { kSum, kGather, kBroadcast, kArgmax, kArgmaxGathered };
  struct Case {
    Kind kind;
    int64_t rows, cols;
    bool f32;
  };
  std::vector<Case> cases = {{kSum, 1, 4096, false},      {kSum, 16, 4096, false},    {kSum, 3, 1000, false},
                             {kSum, 16, 4096, false},     {kSum, 64, 4096, false},    {kSum, 65, 4096, false},
                             {kSum, 1, 4096, false},      {kSum, 1, 3, false},        {kGather, 16, 75968, false},
                             {kGather, 1, 75968, false},  {kGather, 3, 5, true},      {kGather, 2, 7, false},
                             {kGather, 32, 75968, false}, {kGather, 1, 3, false},     {kBroadcast, 16, 4096, false},
                             {kBroadcast, 1, 16, true},   {kBroadcast, 1, 5, false},  {kBroadcast, 300, 4096, false},
                             {kBroadcast, 600, 4096, false}, {kSum, 256, 4096, false}, {kSum, 257, 4096, false},
                             {kSum, 256, 4096, false}};
  // Sizes that change from call to call, with nothing but the collectives between the ranks (each
  // rank only waits for its own copies): a call must never overwrite what a peer's previous call
  // is still reading, whatever the two sizes.
  for (int i = 0; i < 30; ++i)
    for (int64_t rows : {3, 2, 5, 1, 16}) cases.push_back({kSum, rows, 2048, false});
  for (int i = 0; i < 20; ++i)
    for (int64_t rows : {16, 1, 7}) cases.push_back({kBroadcast, rows, 4096, i % 2 == 1});
  for (int i = 0; i < 10; ++i) {
    cases.push_back({kGather, 16, 4096, false});
    cases.push_back({kBroadcast, 16, 1000, true});
    cases.push_back({kSum, 16, 4096, false});
  }
  for (int i = 0; i < 4; ++i)
    for (const Case& k : std::vector<Case>{{kArgmax, 16, 75968, false}, {kArgmax, 15, 75968, true},
                                           {kArgmax, 1, 75968, false}, {kArgmax, 5, 1000, true}, {kSum, 1, 4096, false},
                                           {kArgmaxGathered, 40, 75968, false}, {kArgmaxGathered, 7, 1000, true}})
      cases.push_back(k);

  auto be0 = make_cuda_backend();
  std::unique_ptr<RankDevices> devices = make_cuda_rank_devices(*be0, 2);
  PerCase inputs[2], outputs[2];
  auto rank = [&](int r, Backend& be) {
    for (size_t c = 0; c < cases.size(); ++c) {
      const Case& k = cases[c];
      std::mt19937 rng(static_cast<uint32_t>(100 * c + r));
      std::uniform_real_distribution<float> u(-4.0f, 4.0f);
      std::vector<float> x(static_cast<size_t>(k.rows * k.cols));
      for (float& v : x) v = u(rng);
      Communicator& comm = devices->comm(r);
      if (k.kind == kArgmax || k.kind == kArgmaxGathered) {
        std::uniform_int_distribution<int> few(-3, 3);
        if (k.f32) for (float& v : x) v = static_cast<float>(few(rng));
        const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
        if (k.rows > 2) {
          std::fill(x.begin() + k.cols, x.begin() + 2 * k.cols, -inf);                    // row 1: no value
          std::fill(x.begin() + 2 * k.cols, x.begin() + 3 * k.cols, r == 0 ? nan : -inf);  // row 2: none
        }
        Tensor t = be.upload_host(x.data(), k.rows, k.cols);  // bf16: the logits' type
        inputs[r].push_back(be.to_host(t));
        Tensor cand = be.alloc_f32(k.rows, 2), ids = be.alloc_ids(k.rows);
        be.argmax_candidates(t, r * k.cols, cand);
        if (k.kind == kArgmax) comm.argmax_all(be, cand, ids);
        else comm.Communicator::argmax_all(be, cand, ids);  // the fallback: candidates gathered, then chosen
        const std::vector<int32_t> got = be.ids_to_host(ids);
        outputs[r].emplace_back(got.begin(), got.end());
        continue;
      }
      Tensor t = k.f32 ? be.upload_host_f32(x.data(), k.rows, k.cols) : be.upload_host(x.data(), k.rows, k.cols);
      inputs[r].push_back(be.to_host(t));
      if (k.kind == kSum) {
        comm.all_reduce_sum(be, t);
        outputs[r].push_back(be.to_host(t));
      } else if (k.kind == kBroadcast) {
        comm.broadcast(be, t);
        outputs[r].push_back(be.to_host(t));
      } else {
        Tensor all = k.f32 ? be.alloc_f32(k.rows, 2 * k.cols) : be.alloc(k.rows, 2 * k.cols);
        comm.all_gather(be, t, all);
        outputs[r].push_back(be.to_host(all));
      }
    }
  };
  run_two_ranks(*devices, *be0, rank);
  for (size_t c = 0; c < cases.size(); ++c) {
    const Case& k = cases[c];
    const std::string what = ::testing::PrintToString(c) + " (" + std::to_string(k.rows) + " x " +
                             std::to_string(k.cols) + (k.f32 ? " f32" : " bf16") + ")";
    ASSERT_EQ(outputs[0][c], outputs[1][c]) << "case " << what << ": the ranks differ";
    const std::vector<float>& out = outputs[0][c];
    std::vector<float> want;
    if (k.kind == kSum) {
      for (size_t i = 0; i < inputs[0][c].size(); ++i)
        want.push_back(bf16_to_f32(f32_to_bf16(inputs[0][c][i] + inputs[1][c][i])));
    } else if (k.kind == kBroadcast) {
      want = inputs[0][c];
    } else if (k.kind == kArgmax || k.kind == kArgmaxGathered) {  // over rank 0's row, then rank 1's
      for (int64_t i = 0; i < k.rows; ++i) {
        float best = -std::numeric_limits<float>::max();
        int64_t best_i = -1;
        for (int r = 0; r < 2; ++r)
          for (int64_t j = 0; j < k.cols; ++j) {
            const float v = inputs[r][c][static_cast<size_t>(i * k.cols + j)];
            if (v > best || (v == best && best_i < 0)) best = v, best_i = r * k.cols + j;
          }
        want.push_back(static_cast<float>(best_i < 0 ? 0 : best_i));
      }
    } else {  // row i: rank 0's row i, then rank 1's
      for (int64_t i = 0; i < k.rows; ++i)
        for (int r = 0; r < 2; ++r)
          want.insert(want.end(), inputs[r][c].begin() + i * k.cols, inputs[r][c].begin() + (i + 1) * k.cols);
    }
    ASSERT_EQ(out.size(), want.size()) << "case " << what;
    size_t wrong = 0;
    for (size_t i = 0; i < out.size(); ++i) wrong += out[i] != want[i];
    EXPECT_EQ(wrong, 0u) << "case " << what;
  }
}

// Case c of a sum over two ranks: every element is the float32 sum of the ranks' own outputs
// rounded once, and on each rank the norm that took the deferred sum gave the undeferred norm's bits.
void expect_exact_sum(const PerCase (&own)[2], const PerCase (&summed)[2], const PerCase (&normed)[2],
                      const PerCase (&normed_deferred)[2], size_t c, const std::string& what) {
  size_t wrong = 0;
  for (size_t i = 0; i < own[0][c].size(); ++i)
    wrong += summed[0][c][i] != bf16_to_f32(f32_to_bf16(own[0][c][i] + own[1][c][i]));
  EXPECT_EQ(wrong, 0u) << "case " << what;
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(normed_deferred[r][c], normed[r][c]) << "case " << what << ", rank " << r << ": the deferred sum's norm";
}

// A product split along K, summed over two GPUs (Communicator::matmul_all_reduce): where the
// skinny kernel takes it, its blocks send their outputs to the peer as they finish and a small
// kernel adds them up. Every rank must get the float32 sum of the ranks' own products rounded once
// (what all_reduce_sum gives), whatever collectives come between; larger products take the
// product and all_reduce_sum. The sum left to the norm that reads it (RankSum: the RMSNorm kernel
// sums, or a summing kernel runs first) must give that norm's bits. Products split along N
// (Communicator::matmul_all_gather: a vocabulary split's logits) must give every rank all the
// parts side by side.
TEST_F(CudaTensorParallel, PushedProductsAreSummedAndGatheredExactly) {
  struct Case {
    int64_t rows, k, n;
    bool bias, pushed;
  };
  const std::vector<Case> shapes = {{1, 2048, 4096, false, true},  {16, 2048, 4096, false, true},
                                    {32, 1536, 4096, true, true},  {3, 512, 1000, true, true},
                                    {7, 256, 2048, false, true},   {40, 512, 4096, false, false},
                                    {32, 256, 70000, false, false}, {1, 6144, 4096, true, true},
                                    // rows of 5120 and 8192: the RMSNorm that adds the ranks' words with 3 and 4 pieces a thread
                                    {16, 512, 5120, false, true},  {9, 256, 8192, true, true}};
  std::vector<Case> cases;
  for (int round = 0; round < 3; ++round) cases.insert(cases.end(), shapes.begin(), shapes.end());
  auto be0 = make_cuda_backend();
  std::unique_ptr<RankDevices> devices = make_cuda_rank_devices(*be0, 2);
  PerCase own[2], summed[2], normed[2], normed_deferred[2];
  long long pushed[2] = {0, 0}, deferred[2] = {0, 0};
  // Products split along N whose parts every rank gathers (a vocabulary split's logits): rows, K, N
  // of a rank, and whether the parts fit the pushed exchange.
  struct Gather {
    int64_t rows, k, n;
    bool pushed;
  };
  const std::vector<Gather> gathers = {{16, 512, 75968, true}, {1, 2048, 1000, true}, {32, 256, 70000, false},
                                       {3, 1024, 4096, true},  {16, 512, 75968, true}, {40, 256, 4096, false}};
  PerCase own_part[2], gathered[2];
  auto rank = [&](int r, Backend& be) {
    Communicator& comm = devices->comm(r);
    const long long before = cuda::pushed_products(be);
    for (size_t c = 0; c < cases.size(); ++c) {
      const Case& k = cases[c];
      std::mt19937 rng(static_cast<uint32_t>(1000 * c + r));
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      auto random = [&](int64_t rows, int64_t cols) {
        std::vector<float> v(static_cast<size_t>(rows * cols));
        for (float& e : v) e = u(rng);
        return be.upload_host(v.data(), rows, cols);
      };
      const Tensor x = random(k.rows, k.k), w = random(k.n, k.k);
      const Tensor bias = random(1, k.n);
      const Tensor* b = k.bias && r == 0 ? &bias : nullptr;  // the output bias on rank 0 only
      Tensor y = be.alloc(k.rows, k.n), out = be.alloc(k.rows, k.n);
      be.matmul(x, w, b, y);
      own[r].push_back(be.to_host(y));
      comm.matmul_all_reduce(be, x, w, b, out);
      if (c % 3 == 1) {  // other collectives between the sums
        Tensor t = random(16, 4096);
        comm.all_reduce_sum(be, t);
        comm.broadcast(be, t);
      }
      summed[r].push_back(be.to_host(out));
      // The same sum deferred to a norm (norm_in: the RMSNorm kernel; norm_matmul: a normalizing
      // product up to 8 rows), against that norm of `out`.
      std::vector<float> rv(static_cast<size_t>(k.rows * k.n));
      for (float& e : rv) e = u(rng);
      const Tensor res = be.upload_host_f32(rv.data(), k.rows, k.n), norm_w = random(1, k.n);
      const Tensor w2 = random(64, k.n);
      Tensor res_out = be.alloc_f32(k.rows, k.n), h = be.alloc(k.rows, k.n), y2 = be.alloc(k.rows, 64);
      Tensor res_out_d = be.alloc_f32(k.rows, k.n), h_d = be.alloc(k.rows, k.n), y2_d = be.alloc(k.rows, 64);
      be.norm_matmul(ResidualNorm{&res, &out, &res_out, &norm_w, 1e-6f}, h, w2, nullptr, y2);
      std::vector<float> n0 = be.to_host(res_out), n1 = be.to_host(y2);
      n0.insert(n0.end(), n1.begin(), n1.end());
      normed[r].push_back(n0);
      Tensor out_d = be.alloc(k.rows, k.n);
      RankSum defer;
      comm.matmul_all_reduce(be, x, w, b, out_d, &defer);
      deferred[r] += defer.deferred;
      const ResidualNorm nd{&res, &out_d, &res_out_d, &norm_w, 1e-6f, nullptr, nullptr, &defer};
      if (c % 2 == 0) be.norm_in(nd, h_d), be.matmul(h_d, w2, nullptr, y2_d);
      else be.norm_matmul(nd, h_d, w2, nullptr, y2_d);
      EXPECT_FALSE(defer.deferred) << "case " << c << ": the norm left the sum over ranks deferred";
      std::vector<float> d0 = be.to_host(res_out_d), d1 = be.to_host(y2_d);
      d0.insert(d0.end(), d1.begin(), d1.end());
      normed_deferred[r].push_back(d0);
    }
    for (size_t g = 0; g < gathers.size(); ++g) {
      const Gather& k = gathers[g];
      std::mt19937 rng(static_cast<uint32_t>(7000 * g + r));
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      std::vector<float> xv(static_cast<size_t>(k.rows * k.k)), wv(static_cast<size_t>(k.n * k.k));
      for (float& e : xv) e = u(rng);
      for (float& e : wv) e = u(rng);
      const Tensor x = be.upload_host(xv.data(), k.rows, k.k), w = be.upload_host(wv.data(), k.n, k.k);
      Tensor y = be.alloc(k.rows, k.n), all = be.alloc(k.rows, 2 * k.n);
      be.matmul(x, w, nullptr, y);
      own_part[r].push_back(be.to_host(y));
      comm.matmul_all_gather(be, x, w, all);
      gathered[r].push_back(be.to_host(all));
      if (g % 2 == 0) {  // a sum between the exchanges
        Tensor out = be.alloc(k.rows, 4096);
        comm.matmul_all_reduce(be, x.slice_cols(0, 256), be.alloc(4096, 256), nullptr, out);
      }
    }
    pushed[r] = cuda::pushed_products(be) - before;
  };
  run_two_ranks(*devices, *be0, rank);
  long long want_pushed = 0, want_sums = 0;
  for (size_t c = 0; c < cases.size(); ++c) {
    const Case& k = cases[c];
    want_sums += k.pushed;
    want_pushed += k.pushed;
    const std::string what = ::testing::PrintToString(c) + " (" + std::to_string(k.rows) + " x " +
                             std::to_string(k.k) + " -> " + std::to_string(k.n) + ")";
    ASSERT_EQ(summed[0][c], summed[1][c]) << "case " << what << ": the ranks differ";
    ASSERT_EQ(summed[0][c].size(), own[0][c].size()) << "case " << what;
    expect_exact_sum(own, summed, normed, normed_deferred, c, what);
  }
  for (size_t g = 0; g < gathers.size(); ++g) {
    const Gather& k = gathers[g];
    want_pushed += k.pushed + (g % 2 == 0);  // the sums between the gathers are pushed (16 x 256 -> 4096)
    std::vector<float> want;
    for (int64_t i = 0; i < k.rows; ++i)
      for (int r = 0; r < 2; ++r)
        want.insert(want.end(), own_part[r][g].begin() + i * k.n, own_part[r][g].begin() + (i + 1) * k.n);
    for (int r = 0; r < 2; ++r)
      EXPECT_EQ(gathered[r][g], want) << "gather " << g << " (" << k.rows << " x " << k.n << "), rank " << r;
  }
  // Each pushed sum case ran two pushed products (summed at once, then deferred).
  EXPECT_EQ(pushed[0], want_pushed + want_sums) << "products that sent their outputs on rank 0";
  EXPECT_EQ(pushed[1], want_pushed + want_sums) << "products that sent their outputs on rank 1";
  EXPECT_EQ(deferred[0], want_sums) << "sums left to the norm on rank 0";
  EXPECT_EQ(deferred[1], want_sums) << "sums left to the norm on rank 1";
}

// A routed MLP split over two GPUs (Communicator::norm_moe_all_reduce: each rank holds its share
// of every expert's features, the router whole): the MLP's last kernel (the one-token down kernel
// at one row, else the combine) sends its output to the peer as its blocks finish; outputs over
// 512 KiB are summed by the all-reduce after the MLP. Every rank must get the float32 sum
// of the ranks' own outputs rounded once, and the sum left to the next norm (RankSum: the RMSNorm
// kernel, or a summing kernel before a normalizing product) that norm's bits.
TEST_F(CudaTensorParallel, PushedRoutedMlpIsSummedExactly) {
  struct Case {
    int64_t rows;
    int h, n_experts, top_k, ff;
    bool f32, pushed;
  };
  // 200 rows of 2048 (800 KB) are more than the MLP sends: the MLP, then the all-reduce's sum.
  const std::vector<Case> cases = {{1, 2048, 128, 8, 384, true, true},  {16, 2048, 128, 8, 384, true, true},
                                   {1, 256, 16, 4, 64, false, true},    {5, 512, 40, 6, 96, true, true},
                                   {200, 2048, 128, 8, 384, true, false}, {1, 2048, 128, 8, 384, true, true},
                                   {16, 512, 8, 2, 32, false, true}};
  auto be0 = make_cuda_backend();
  std::unique_ptr<RankDevices> devices = make_cuda_rank_devices(*be0, 2);
  PerCase own[2], summed[2], normed[2], normed_deferred[2];
  long long pushed[2] = {0, 0}, deferred[2] = {0, 0};
  auto rank = [&](int r, Backend& be) {
    Communicator& comm = devices->comm(r);
    const long long before = cuda::pushed_products(be);
    for (size_t c = 0; c < cases.size(); ++c) {
      const Case& k = cases[c];
      std::mt19937 shared(static_cast<uint32_t>(100 * c)), mine(static_cast<uint32_t>(100 * c + 1 + r));
      auto random = [&](std::mt19937& rng, int64_t rows, int64_t cols, float scale, bool f32 = false) {
        std::uniform_real_distribution<float> u(-scale, scale);
        std::vector<float> v(static_cast<size_t>(rows * cols));
        for (float& e : v) e = u(rng);
        return f32 ? be.upload_host_f32(v.data(), rows, cols) : be.upload_host(v.data(), rows, cols);
      };
      MoeWeights w;
      w.router = random(shared, k.n_experts, k.h, 6.0f / std::sqrt(static_cast<float>(k.h)));
      w.gate_up = random(mine, int64_t{k.n_experts} * 2 * k.ff, k.h, 1.7f / std::sqrt(static_cast<float>(k.h)));
      w.down = random(mine, int64_t{k.n_experts} * k.h, k.ff, 1.7f / std::sqrt(static_cast<float>(k.ff)));
      w.n_experts = k.n_experts, w.top_k = k.top_k, w.n_ff = k.ff, w.norm_topk_prob = true;
      const Tensor res = random(shared, k.rows, k.h, 3.0f, k.f32), delta = random(shared, k.rows, k.h, 1.0f);
      const Tensor norm_w = random(shared, 1, k.h, 1.0f);
      auto residual = [&] { return k.f32 ? be.alloc_f32(k.rows, k.h) : be.alloc(k.rows, k.h); };
      Tensor ro = residual(), h = be.alloc(k.rows, k.h), y = be.alloc(k.rows, k.h), out = be.alloc(k.rows, k.h);
      const ResidualNorm n{&res, &delta, &ro, &norm_w, 1e-6f};
      be.norm_moe(n, h, w, y);
      own[r].push_back(be.to_host(y));
      comm.norm_moe_all_reduce(be, n, h, w, out, nullptr, nullptr);
      summed[r].push_back(be.to_host(out));
      // The next norm of the sum (norm_in, or norm_matmul: a normalizing product up to 8 rows).
      const Tensor res2 = random(shared, k.rows, k.h, 3.0f, true), norm2_w = random(shared, 1, k.h, 1.0f);
      const Tensor w2 = random(shared, 64, k.h, 1.0f);
      auto next_norm = [&](const Tensor& d, RankSum* sum) {
        Tensor ro2 = be.alloc_f32(k.rows, k.h), h2 = be.alloc(k.rows, k.h), y2 = be.alloc(k.rows, 64);
        const ResidualNorm n2{&res2, &d, &ro2, &norm2_w, 1e-6f, nullptr, nullptr, sum};
        if (c % 2 == 0) be.norm_in(n2, h2), be.matmul(h2, w2, nullptr, y2);
        else be.norm_matmul(n2, h2, w2, nullptr, y2);
        std::vector<float> v = be.to_host(ro2), v2 = be.to_host(y2);
        v.insert(v.end(), v2.begin(), v2.end());
        return v;
      };
      normed[r].push_back(next_norm(out, nullptr));
      Tensor out_d = be.alloc(k.rows, k.h);
      RankSum defer;
      comm.norm_moe_all_reduce(be, n, h, w, out_d, nullptr, nullptr, &defer);
      deferred[r] += defer.deferred;
      normed_deferred[r].push_back(next_norm(out_d, &defer));
      EXPECT_FALSE(defer.deferred) << "case " << c << ": the norm left the sum over ranks deferred";
    }
    pushed[r] = cuda::pushed_products(be) - before;
  };
  run_two_ranks(*devices, *be0, rank);
  for (size_t c = 0; c < cases.size(); ++c) {
    const Case& k = cases[c];
    const std::string what = ::testing::PrintToString(c) + " (" + std::to_string(k.rows) + " rows, h " +
                             std::to_string(k.h) + ", top " + std::to_string(k.top_k) + " of " +
                             std::to_string(k.n_experts) + ")";
    ASSERT_EQ(summed[0][c], summed[1][c]) << "case " << what << ": the ranks differ";
    expect_exact_sum(own, summed, normed, normed_deferred, c, what);
  }
  long long n_pushed = 0;
  for (const Case& k : cases) n_pushed += k.pushed;
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(pushed[r], 2 * n_pushed) << "routed MLPs that sent their outputs on rank " << r;
    EXPECT_EQ(deferred[r], n_pushed) << "sums left to the norm on rank " << r;
  }
}

TEST_F(CudaTensorParallel, MoreRanksThanGpusAreRefused) {
  EngineOptions eo = test::bundled_pair_on_gpu();
  eo.tensor_parallel = cuda_device_count() + 1;
  try {
    Engine engine(eo);
    ADD_FAILURE() << "loaded over more GPUs than there are";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("GPUs"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dflash
