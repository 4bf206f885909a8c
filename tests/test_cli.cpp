// The dflash binary as a user runs it: JSON output, inspect, and bad input
// that must end with a message on stderr and a small exit status.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace dflash {
namespace {

using test::fixture;

struct RunResult {
  int status;
  std::string out, err;
};

RunResult run_cli(const std::string& args) {
  test::TempDir dir;
  const std::string cmd = std::string(DFLASH_BINARY) + " " + args + " 2>" + dir.file("err") + " </dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st), out, read_text_file(dir.file("err"))};
}

TEST(Cli, GenerateJsonPlainAndDFlash) {
  const auto meta = test::read_json(fixture("expected/trained_qwen3.json"));
  const auto prompt = meta["prompts"][0].get<std::vector<int>>();
  std::string ids;
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (i) ids += ',';
    ids += std::to_string(prompt[i]);
  }
  const std::string base = "generate --model " + fixture("targets/trained_qwen3") + " --prompt-ids " + ids +
                           " --max-tokens 40 --json";
  const auto plain = run_cli(base);
  ASSERT_EQ(plain.status, 0) << plain.err;
  const auto spec = run_cli(base + " --draft " + fixture("drafts/trained_qwen3_b16"));
  ASSERT_EQ(spec.status, 0) << spec.err;
  const auto forced_plain = run_cli(base + " --draft " + fixture("drafts/trained_qwen3_b16") + " --speculative none");
  ASSERT_EQ(forced_plain.status, 0) << forced_plain.err;
  const auto jp = nlohmann::json::parse(plain.out), js = nlohmann::json::parse(spec.out),
             jn = nlohmann::json::parse(forced_plain.out);
  EXPECT_EQ(jp["tokens"], js["tokens"]);
  EXPECT_EQ(jp["tokens"].size(), 40u);
  EXPECT_EQ(jp["tau"].get<double>(), 1.0);
  EXPECT_EQ(jn["tau"].get<double>(), 1.0);
  EXPECT_GT(js["tau"].get<double>(), 1.5);
  EXPECT_EQ(js["acceptance_histogram"].size(), 16u);
  for (const char* k : {"prefill", "draft", "verify", "total"}) EXPECT_TRUE(js["timings_ms"].contains(k)) << k;
  const auto expected = meta["greedy"][0].get<std::vector<int>>();
  EXPECT_EQ(jp["tokens"].get<std::vector<int>>(), std::vector<int>(expected.begin(), expected.begin() + 40));
}

TEST(Cli, InspectTargetAndDraft) {
  const auto t = run_cli("inspect " + fixture("targets/llama_gqa4_bias_sharded"));
  ASSERT_EQ(t.status, 0) << t.err;
  EXPECT_NE(t.out.find("LlamaForCausalLM"), std::string::npos);
  EXPECT_NE(t.out.find("llama3"), std::string::npos);
  EXPECT_NE(t.out.find("model.layers.0.self_attn.q_proj.bias"), std::string::npos);
  const auto d = run_cli("inspect " + fixture("drafts/trained_qwen3_b16"));
  ASSERT_EQ(d.status, 0) << d.err;
  EXPECT_NE(d.out.find("block size:         16"), std::string::npos) << d.out;
  EXPECT_NE(d.out.find("mask token id:      255"), std::string::npos);
  EXPECT_NE(d.out.find("[1, 3] of 6"), std::string::npos);
}

TEST(Cli, BadInputGivesOneClearMessage) {
  test::TempDir empty;
  const std::string model = " --model " + fixture("targets/qwen3_gqa_tied");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"generate --model " + empty.path() + " --prompt-ids 1", "no config.json"},
      {"generate" + model + " --prompt-ids 1,x,3", "'x' is not a token id"},
      {"generate" + model + " --prompt-ids 1,99999", "outside the vocabulary"},
      {"generate" + model + " --prompt-ids ''", "no prompt given"},
      {"generate" + model + " --prompt-ids 1,,2", "'' is not a token id"},
      {"generate" + model, "no prompt given"},
      {"generate" + model + " --prompt-ids 1 --speculative dflash", "needs --draft"},
      {"generate" + model + " --prompt-ids 1 --draft " + fixture("drafts/llama_l2_window"), "num_target_layers"},
      {"generate" + model + " --prompt-ids 1 --draft " + empty.path(), "no config.json"},
      {"inspect " + empty.path(), "no config.json"},
  };
  for (const auto& [args, message] : cases) {
    const auto r = run_cli(args);
    EXPECT_EQ(r.status, 1) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << args << "\nstderr: " << r.err;
    EXPECT_EQ(r.err.find("terminate"), std::string::npos) << r.err;
  }
  const auto usage = run_cli("generate --max-tokens 0 --model x");
  EXPECT_EQ(usage.status, 2) << usage.err;
  EXPECT_EQ(run_cli("frobnicate").status, 2);
}

}  // namespace
}  // namespace dflash
