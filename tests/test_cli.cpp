// The dflash binary as a user runs it: JSON output, inspect, and bad input
// that must end with a message on stderr and a small exit status.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "test_util.h"
#include "tokenizer/tokenizer.h"

namespace dflash {
namespace {

using test::fixture;

struct RunResult {
  int status;
  std::string out, err;
};

// Runs the binary with `input` on stdin.
RunResult run_cli_input(const std::string& args, const std::string& input) {
  test::TempDir dir;
  test::write_file(dir.file("in"), input);
  const std::string cmd = std::string(DFLASH_BINARY) + " " + args + " 2>" + dir.file("err") + " <" + dir.file("in");
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st), out, read_text_file(dir.file("err"))};
}

RunResult run_cli(const std::string& args) { return run_cli_input(args, ""); }

std::string qwen3_tokenizer() { return std::string(DFLASH_GENERATED_FIXTURES) + "/qwen3"; }

TEST(Cli, TokenizeTextAndJsonl) {
  const auto one = run_cli("tokenize --tokenizer " + qwen3_tokenizer() + " --text 'Hello world!'");
  ASSERT_EQ(one.status, 0) << one.err;
  EXPECT_EQ(one.out, "[9707,1879,0]\n");
  const auto many = run_cli_input("tokenize --tokenizer " + qwen3_tokenizer() + " --jsonl",
                                  "\"Hello world!\"\n\"<|im_start|>user\\n\"\n\"\"\n");
  ASSERT_EQ(many.status, 0) << many.err;
  EXPECT_EQ(many.out, "[9707,1879,0]\n[151644,872,198]\n[]\n");
  const auto bad = run_cli_input("tokenize --tokenizer " + qwen3_tokenizer() + " --jsonl", "\"ok\"\n{\"not\": 1}\n");
  EXPECT_EQ(bad.status, 1);
  EXPECT_EQ(bad.out, "[562]\n");
  EXPECT_NE(bad.err.find("stdin line 2: expected a JSON string"), std::string::npos) << bad.err;
  const auto invalid = run_cli_input("tokenize --tokenizer " + qwen3_tokenizer() + " --jsonl", "\"\\udc00\"\n");
  EXPECT_EQ(invalid.status, 1);
  const auto none = run_cli("tokenize --tokenizer /nonexistent --text x");
  EXPECT_EQ(none.status, 1);
  EXPECT_NE(none.err.find("not found"), std::string::npos) << none.err;
}

TEST(Cli, ChatTemplateJsonl) {
  const auto r = run_cli_input(
      "chat-template --tokenizer " + qwen3_tokenizer() + " --jsonl",
      R"({"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": true, "enable_thinking": false})"
      "\n");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out).get<std::string>(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  const auto bad = run_cli_input("chat-template --tokenizer " + qwen3_tokenizer() + " --jsonl", "{\"messages\": 3}\n");
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.err.find("stdin line 1"), std::string::npos) << bad.err;
}

// The trained fixture target (vocabulary 256) with a byte-level tokenizer whose
// id for byte b is b, and a ChatML template.
void make_text_model(const test::TempDir& dir) {
  for (const char* f : {"config.json", "model.safetensors", "generation_config.json"}) {
    const std::string src = fixture(std::string("targets/trained_qwen3/") + f);
    if (std::filesystem::exists(src)) std::filesystem::copy_file(src, dir.file(f));
  }
  nlohmann::json vocab = nlohmann::json::object();
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const char32_t c = printable ? b : 256 + extra++;
    std::string u;
    if (c < 0x80) u += static_cast<char>(c);
    else u += static_cast<char>(0xC0 | (c >> 6)), u += static_cast<char>(0x80 | (c & 0x3F));
    vocab[u] = b;
  }
  const nlohmann::json tok = {{"normalizer", nullptr},
                              {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
                              {"decoder", {{"type", "ByteLevel"}}},
                              {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
  test::write_file(dir.file("tokenizer.json"), tok.dump());
  const nlohmann::json cfg = {
      {"chat_template",
       "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|a|>{% endif %}"},
      {"eos_token", "|"}};
  test::write_file(dir.file("tokenizer_config.json"), cfg.dump());
}

TEST(Cli, GenerateFromTextAndChat) {
  test::TempDir model;
  make_text_model(model);
  const std::string base = "generate --model " + model.path() + " --max-tokens 12 --json ";
  const auto text = run_cli(base + "--prompt 'abc'");
  ASSERT_EQ(text.status, 0) << text.err;
  const auto ids = run_cli(base + "--prompt-ids 97,98,99");
  ASSERT_EQ(ids.status, 0) << ids.err;
  const auto jt = nlohmann::json::parse(text.out), ji = nlohmann::json::parse(ids.out);
  EXPECT_EQ(jt["tokens"], ji["tokens"]);
  EXPECT_EQ(jt["n_prompt_tokens"], 3);
  ASSERT_TRUE(jt.contains("text"));
  EXPECT_FALSE(ji.contains("text"));
  const Tokenizer tok(model.path());
  EXPECT_EQ(jt["text"], tok.decode(jt["tokens"].get<std::vector<int32_t>>()));
  // --chat renders the template: "<|user|>abc<|a|>" is 16 bytes; '|' (124) ends the turn.
  const auto chat = run_cli(base + "--chat 'abc'");
  ASSERT_EQ(chat.status, 0) << chat.err;
  const auto jc = nlohmann::json::parse(chat.out);
  EXPECT_EQ(jc["n_prompt_tokens"], 16);
  const auto toks = jc["tokens"].get<std::vector<int>>();
  for (size_t i = 0; i + 1 < toks.size(); ++i) EXPECT_NE(toks[i], 124);
  const auto both = run_cli(base + "--prompt a --prompt-ids 1");
  EXPECT_EQ(both.status, 1);
  EXPECT_NE(both.err.find("only one of"), std::string::npos) << both.err;
  const auto no_tok = run_cli("generate --model " + fixture("targets/trained_qwen3") + " --prompt x");
  EXPECT_EQ(no_tok.status, 1);
  EXPECT_NE(no_tok.err.find("tokenizer"), std::string::npos) << no_tok.err;
}

TEST(Cli, GenerateDefaultsToTheBundledPair) {
  const auto r = run_cli("generate --prompt 'def add(a, b):' --max-tokens 24 --json");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["block_size"], 16);  // DFlash with the bundled draft
  EXPECT_EQ(j["tokens"].size(), 24u);
  EXPECT_TRUE(j["text"].is_string());
  const auto plain = run_cli("generate --prompt 'def add(a, b):' --max-tokens 24 --json --speculative none");
  ASSERT_EQ(plain.status, 0) << plain.err;
  const auto jp = nlohmann::json::parse(plain.out);
  EXPECT_EQ(jp["block_size"], 1);
  EXPECT_EQ(jp["tokens"], j["tokens"]);
  const auto text = run_cli("generate --prompt 'import os' --max-tokens 8");
  ASSERT_EQ(text.status, 0) << text.err;
  EXPECT_NE(text.err.find("tau"), std::string::npos) << text.err;
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

// --tensor-parallel on the command line: the CPU backend's ranks give the reference tokens (plain
// and DFlash); a split that does not divide is refused naming the field.
TEST(Cli, GenerateOverTensorParallelRanks) {
  const auto meta = test::read_json(fixture("expected/trained_qwen3.json"));
  const auto prompt = meta["prompts"][1].get<std::vector<int>>();
  std::string ids;
  for (size_t i = 0; i < prompt.size(); ++i) ids += (i ? "," : "") + std::to_string(prompt[i]);
  const std::string base = "generate --device cpu --model " + fixture("targets/trained_qwen3") + " --prompt-ids " +
                           ids + " --max-tokens 24 --json --tensor-parallel ";
  const auto expected = meta["greedy"][1].get<std::vector<int>>();
  for (const std::string& extra : {std::string(), " --draft " + fixture("drafts/trained_qwen3_b16")}) {
    const auto r = run_cli(base + "2" + extra);
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(nlohmann::json::parse(r.out)["tokens"].get<std::vector<int>>(),
              std::vector<int>(expected.begin(), expected.begin() + 24))
        << extra;
  }
  const auto bad = run_cli(base + "3");  // 4 attention heads
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.err.find("num_attention_heads"), std::string::npos) << bad.err;
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
      {"serve --device cpu --port 0 --gpu-memory-fraction 0.5" + model, "--gpu-memory-fraction needs a GPU"},
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

// bench-step on a routed target: the floor counts the experts the step's rows went to (per layer,
// 0 for the dense layer), and whole prefills are chunked as the server chunks them.
TEST(Cli, BenchStepOfARoutedTargetCountsRoutedExpertsAndPrefills) {
  test::TempDir dir;
  const auto r = run_cli("bench-step --device cpu --model " + fixture("targets/qwen3_moe_tied") + " --draft " +
                         fixture("drafts/qwen3_moe_tied_l1") +
                         " --batch 1,3 --context 40 --iters 2 --warmup 1 --skip-kernels --leak-check-steps 0"
                         " --prefill 50 --prefill-batch 1,2 --max-tokens-per-step 64 --json " + dir.file("rows.json"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("experts/layer"), std::string::npos) << r.out;
  const auto rows = test::read_json(dir.file("rows.json"));
  int decode_rows = 0, prefill_rows = 0;
  for (const auto& row : rows) {
    if (row["mode"] == "prefill") {
      ++prefill_rows;
      // 2 prompts of 50 tokens in steps of at most 64 rows: 2 steps.
      EXPECT_EQ(row["steps"].get<int>(), row["batch"].get<int>() == 1 ? 1 : 2) << row.dump();
      EXPECT_GT(row["tokens_per_s"].get<double>(), 0);
      continue;
    }
    ++decode_rows;
    const auto routed = row["routed_experts_per_layer"].get<std::vector<int>>();
    ASSERT_EQ(routed.size(), 4u);
    EXPECT_EQ(routed[1], 0);  // mlp_only_layers: [1]
    const int rows_routed = row["batch"].get<int>() * (row["mode"] == "dflash" ? 16 : 1);
    for (int l : {0, 2, 3}) {
      EXPECT_GE(routed[l], 2) << row.dump();  // top 2 of 8
      EXPECT_LE(routed[l], std::min(8, 2 * rows_routed)) << row.dump();
    }
    EXPECT_GT(row["bytes_per_step"].get<int64_t>(), 0);
  }
  EXPECT_EQ(decode_rows, 4);
  EXPECT_EQ(prefill_rows, 2);
}

}  // namespace
}  // namespace dflash
