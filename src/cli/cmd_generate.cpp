// `dflash generate`: one prompt, greedy, plain or DFlash; text or JSON output.
#include <cstdio>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "engine/engine.h"
#include "util/error.h"

namespace dflash::cli {

namespace {

struct GenerateArgs {
  std::string model, draft, speculative, prompt_ids, device = "cpu";
  int max_tokens = 128, block_size = 0, page_size = 16;
  bool json = false;
};

// "1, 2,3" -> {1, 2, 3}; every item must be a whole non-negative integer.
std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    std::string item = s.substr(i, j - i);
    const auto b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    item = b == std::string::npos ? "" : item.substr(b, e - b + 1);
    check(!item.empty() && item.size() <= 10 && item.find_first_not_of("0123456789") == std::string::npos,
          "--prompt-ids: '", item, "' is not a token id (expected comma-separated non-negative integers)");
    const long long v = std::stoll(item);
    check(v <= INT32_MAX, "--prompt-ids: ", item, " is too large");
    ids.push_back(static_cast<int32_t>(v));
    i = j + 1;
  }
  return ids;
}

// The prompt as token ids. Text prompts (--prompt) will resolve here too once
// a tokenizer is loaded with the model.
std::vector<int32_t> resolve_prompt(const GenerateArgs& a) {
  check(!a.prompt_ids.empty(), "no prompt given (use --prompt-ids \"1,2,3\")");
  return parse_ids(a.prompt_ids);
}

void print_json(const GenerationResult& r) {
  const auto& st = r.stats;
  nlohmann::json j;
  j["tokens"] = r.tokens;
  j["n_steps"] = st.n_steps;
  j["tau"] = st.tau;
  j["acceptance_histogram"] = st.acceptance_histogram;
  j["block_size"] = st.block_size;
  j["stop_reason"] = r.stop_reason;
  j["n_prompt_tokens"] = st.n_prompt_tokens;
  j["timings_ms"] = {{"prefill", st.prefill_ms}, {"decode", st.decode_ms}, {"draft", st.draft_ms},
                     {"verify", st.verify_ms}, {"total", st.total_ms}};
  std::printf("%s\n", j.dump().c_str());
}

void print_text(const GenerationResult& r) {
  const auto& st = r.stats;
  std::string ids;
  for (size_t i = 0; i < r.tokens.size(); ++i) ids += (i ? "," : "") + std::to_string(r.tokens[i]);
  std::printf("%s\n", ids.c_str());
  const double tok_s = st.decode_ms > 0 ? 1000.0 * (st.n_generated - 1) / st.decode_ms : 0.0;
  std::fprintf(stderr,
               "[%d prompt + %d generated tokens, stop: %s] steps %d, tau %.2f, prefill %.1f ms, decode %.1f ms "
               "(draft %.1f, verify %.1f), %.1f tok/s\n",
               st.n_prompt_tokens, st.n_generated, r.stop_reason.c_str(), st.n_steps, st.tau, st.prefill_ms,
               st.decode_ms, st.draft_ms, st.verify_ms, tok_s);
}

}  // namespace

Command add_generate(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  app.add_option("--model", a->model, "target model directory (Hugging Face layout)")->required();
  app.add_option("--draft", a->draft, "DFlash draft directory; enables DFlash decoding by default");
  app.add_option("--speculative", a->speculative, "none | dflash (default: dflash when --draft is given)")
      ->check(CLI::IsMember({"none", "dflash"}));
  app.add_option("--prompt-ids", a->prompt_ids, "prompt as comma-separated token ids");
  app.add_option("--max-tokens", a->max_tokens, "maximum number of generated tokens")->check(CLI::Range(1, 1 << 24));
  app.add_option("--block-size", a->block_size, "DFlash block size (default: the draft's)")->check(CLI::Range(2, 256));
  app.add_option("--page-size", a->page_size, "KV-cache page size in tokens")->check(CLI::Range(1, 4096));
  app.add_option("--device", a->device, "cpu")->check(CLI::IsMember({"cpu"}));
  app.add_flag("--json", a->json, "print one JSON object with tokens and statistics");
  return [a] {
    const bool spec = a->speculative.empty() ? !a->draft.empty() : a->speculative == "dflash";
    check(!spec || !a->draft.empty(), "--speculative dflash needs --draft DIR");
    const std::vector<int32_t> prompt = resolve_prompt(*a);
    EngineOptions eo;
    eo.model_dir = a->model;
    eo.draft_dir = spec ? a->draft : "";
    eo.device = a->device;
    eo.page_size = a->page_size;
    eo.block_size = a->block_size;
    Engine engine(eo);
    GenerateOptions go;
    go.max_tokens = a->max_tokens;
    go.mode = spec ? SpeculativeMode::DFlash : SpeculativeMode::None;
    const GenerationResult r = engine.generate(prompt, go);
    if (a->json) print_json(r);
    else print_text(r);
    return 0;
  };
}

}  // namespace dflash::cli
