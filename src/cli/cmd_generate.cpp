// `dflash generate`: one prompt, greedy or sampled, plain or DFlash; text or JSON output.
#include <cstdio>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/bundled_models.h"
#include "cli/commands.h"
#include "engine/engine.h"
#include "engine/sampling.h"
#include "formats/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"
#include "util/mapped_file.h"

namespace dflash::cli {

namespace {

struct GenerateArgs {
  std::string model, draft, speculative, prompt_ids, prompt, prompt_file, chat, device = "auto";
  int max_tokens = 128, block_size = 0, page_size = 16;
  bool json = false, enable_thinking = false, ignore_eos = false, batch_invariant = false, no_graphs = false;
  int tensor_parallel = 1;
  SamplingParams sampling;
  std::string spec_sampling = "match";
};

// The prompt as ids, plus the tokenizer when the prompt was text.
struct Prompt {
  std::vector<int32_t> ids;
  std::unique_ptr<Tokenizer> tokenizer;
  std::vector<int32_t> extra_eos;  // the chat template's end-of-turn token
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

Prompt resolve_prompt(GenerateArgs a) {
  if (!a.prompt_file.empty()) {
    check(a.prompt.empty(), "give only one of --prompt and --prompt-file");
    a.prompt = read_text_file(a.prompt_file);
    check(!a.prompt.empty(), "--prompt-file ", a.prompt_file, " is empty");
  }
  const int given = !a.prompt_ids.empty() + !a.prompt.empty() + !a.chat.empty();
  check(given == 1, given ? "give only one of --prompt, --chat and --prompt-ids"
                          : "no prompt given (use --prompt TEXT, --chat TEXT or --prompt-ids \"1,2,3\")");
  Prompt p;
  if (!a.prompt_ids.empty()) {
    p.ids = parse_ids(a.prompt_ids);
    return p;
  }
  p.tokenizer = std::make_unique<Tokenizer>(a.model);
  std::string text = a.prompt;
  if (!a.chat.empty()) {
    const ChatTemplate tmpl(a.model);
    nlohmann::ordered_json req = {{"messages", {{{"role", "user"}, {"content", a.chat}}}},
                                  {"add_generation_prompt", true},
                                  {"enable_thinking", a.enable_thinking}};
    text = tmpl.render(req);
    if (tmpl.eos_token()) {
      if (auto id = p.tokenizer->token_to_id(*tmpl.eos_token())) p.extra_eos.push_back(*id);
    }
  }
  p.ids = p.tokenizer->encode(text);
  check(!p.ids.empty(), "the prompt is empty after tokenization");
  return p;
}

void print_json(const GenerationResult& r, const Tokenizer* tok) {
  const auto& st = r.stats;
  nlohmann::json j;
  j["tokens"] = r.tokens;
  if (tok) j["text"] = tok->decode(r.tokens, /*skip_special_tokens=*/true);
  j["n_steps"] = st.n_steps;
  j["tau"] = st.tau;
  j["acceptance_histogram"] = st.acceptance_histogram;
  j["graph_replays"] = st.graph_replays;
  j["graph_captures"] = st.graph_captures;
  j["graph_capture_ms"] = st.graph_capture_ms;
  j["block_size"] = st.block_size;
  j["stop_reason"] = to_string(r.stop_reason);
  j["n_prompt_tokens"] = st.n_prompt_tokens;
  j["timings_ms"] = {{"prefill", st.prefill_ms}, {"decode", st.decode_ms}, {"draft", st.draft_ms},
                     {"verify", st.verify_ms}, {"total", st.total_ms}};
  std::printf("%s\n", j.dump().c_str());
}

void print_text(const GenerationResult& r, const Tokenizer* tok) {
  const auto& st = r.stats;
  if (tok) {
    std::printf("%s\n", tok->decode(r.tokens, /*skip_special_tokens=*/true).c_str());
  } else {
    std::string ids;
    for (size_t i = 0; i < r.tokens.size(); ++i) ids += (i ? "," : "") + std::to_string(r.tokens[i]);
    std::printf("%s\n", ids.c_str());
  }
  const double tok_s = st.decode_ms > 0 ? 1000.0 * (st.n_generated - 1) / st.decode_ms : 0.0;
  std::fprintf(stderr,
               "[%d prompt + %d generated tokens, stop: %s] steps %d, tau %.2f, prefill %.1f ms, decode %.1f ms "
               "(draft %.1f, verify %.1f), %.1f tok/s\n",
               st.n_prompt_tokens, st.n_generated, to_string(r.stop_reason), st.n_steps, st.tau, st.prefill_ms,
               st.decode_ms, st.draft_ms, st.verify_ms, tok_s);
}

}  // namespace

Command add_generate(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  app.add_option("--model", a->model,
                 std::string("target model directory (Hugging Face layout); default: the bundled ") + kBundledTarget +
                     " with its DFlash draft");
  app.add_option("--draft", a->draft, "DFlash draft directory; enables DFlash decoding by default");
  app.add_option("--speculative", a->speculative, "none | dflash (default: dflash when a draft is used)")
      ->check(CLI::IsMember({"none", "dflash"}));
  app.add_option("--prompt", a->prompt, "prompt text, tokenized with the model directory's tokenizer.json");
  app.add_option("--prompt-file", a->prompt_file, "prompt text read from a file (as --prompt)");
  app.add_option("--chat", a->chat, "a user message, rendered with the model's chat template, then tokenized");
  app.add_flag("--enable-thinking", a->enable_thinking, "with --chat: let the model think (enable_thinking=true)");
  app.add_option("--prompt-ids", a->prompt_ids, "prompt as comma-separated token ids");
  app.add_option("--max-tokens", a->max_tokens, "maximum number of generated tokens")->check(CLI::Range(1, 1 << 24));
  app.add_option("--block-size", a->block_size, "DFlash block size (default: the draft's)")->check(CLI::Range(2, 256));
  app.add_option("--page-size", a->page_size, "KV-cache page size in tokens")->check(CLI::Range(1, 4096));
  app.add_option("--device", a->device, "cpu, cuda, or auto (the GPU when one is present)")->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  app.add_option("--temperature", a->sampling.temperature, "sampling temperature; 0 (default) is greedy")
      ->check(CLI::Range(0.0, 100.0));
  app.add_option("--top-k", a->sampling.top_k, "keep the k most likely tokens when sampling (0: all)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--top-p", a->sampling.top_p, "nucleus sampling: keep the most likely tokens up to this mass")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--seed", a->sampling.seed, "random seed for sampling");
  app.add_option("--spec-sampling", a->spec_sampling,
                 "how DFlash verifies sampled drafts: match (draft argmax, accept while the target's sample agrees; "
                 "output equals plain sampling with the same seed) or rejection (speculative rejection sampling)")
      ->check(CLI::IsMember({"match", "rejection"}));
  app.add_flag("--ignore-eos", a->ignore_eos, "do not stop at end-of-sequence tokens (fixed-length runs for timing)");
  app.add_flag("--json", a->json, "print one JSON object with tokens and statistics");
  add_backend_flags(app, a->batch_invariant, a->no_graphs, a->tensor_parallel);
  return [a] {
    if (a->model.empty()) {
      a->model = bundled_model_dir(kBundledTarget);
      if (a->draft.empty()) a->draft = bundled_model_dir(kBundledDraft);
    }
    const bool spec = a->speculative.empty() ? !a->draft.empty() : a->speculative == "dflash";
    check(!spec || !a->draft.empty(), "--speculative dflash needs --draft DIR");
    const Prompt prompt = resolve_prompt(*a);
    EngineOptions eo;
    eo.model_dir = a->model;
    eo.draft_dir = spec ? a->draft : "";
    eo.device = a->device;
    eo.page_size = a->page_size;
    eo.block_size = a->block_size;
    eo.batch_invariant = a->batch_invariant;
    eo.tensor_parallel = a->tensor_parallel;
    eo.graphs = !a->no_graphs;
    Engine engine(eo);
    GenerateOptions go;
    go.max_tokens = a->max_tokens;
    go.mode = spec ? SpeculativeMode::DFlash : SpeculativeMode::None;
    go.sampling = a->sampling;
    go.spec_sampling = parse_spec_sampling(a->spec_sampling);
    if (a->ignore_eos) {
      go.use_default_eos = false;  // and no eos_ids: always max_tokens (or the context's end)
    } else if (!prompt.extra_eos.empty()) {
      go.eos_ids = engine.default_eos_ids();
      go.eos_ids.insert(go.eos_ids.end(), prompt.extra_eos.begin(), prompt.extra_eos.end());
    }
    for (int32_t id : prompt.ids) {
      check(prompt.tokenizer == nullptr || id < engine.target_config().n_vocab, "the tokenizer gives id ", id,
            " but the model's vocabulary has ", engine.target_config().n_vocab, " entries");
    }
    const GenerationResult r = engine.generate(prompt.ids, go);
    if (a->json) print_json(r, prompt.tokenizer.get());
    else print_text(r, prompt.tokenizer.get());
    return 0;
  };
}

}  // namespace dflash::cli
