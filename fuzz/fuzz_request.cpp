// Fuzz target: OpenAI request bodies through parse_completion_request, with the
// real Qwen3 tokenizer and its chat template (DFLASH_FUZZ_TOKENIZER). A body
// that names "messages" goes to chat completions, others to completions. Each
// must become a request that fits the context, or be refused with ApiError
// (400, or 404 for another model); any other exception or crash is a bug.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "formats/chat_template.h"
#include "server/openai_protocol.h"
#include "tokenizer/tokenizer.h"

namespace {

struct Setup {
  std::unique_ptr<dflash::Tokenizer> tok;
  std::unique_ptr<dflash::ChatTemplate> tmpl;
  dflash::server::ProtocolContext ctx;
};

const Setup& setup() {
  static const Setup s = [] {
    const char* dir = std::getenv("DFLASH_FUZZ_TOKENIZER");
    if (!dir) {
      std::fprintf(stderr, "set DFLASH_FUZZ_TOKENIZER to a tokenizer directory\n");
      std::abort();
    }
    Setup s;
    s.tok = std::make_unique<dflash::Tokenizer>(dir);
    s.tmpl = std::make_unique<dflash::ChatTemplate>(dir);
    s.ctx.tokenizer = s.tok.get();
    s.ctx.chat_template = s.tmpl.get();
    s.ctx.model_name = "fuzz-model";
    s.ctx.max_positions = 2048;  // small enough that long bodies reach the context checks
    if (s.tmpl->eos_token()) {
      if (auto id = s.tok->token_to_id(*s.tmpl->eos_token())) s.ctx.chat_eos.push_back(*id);
    }
    return s;
  }();
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Setup& s = setup();
  const std::string body(reinterpret_cast<const char*>(data), size);
  const bool chat = body.find("\"messages\"") != std::string::npos;
  try {
    const auto r = dflash::server::parse_completion_request(body, chat, s.ctx);
    const auto n = static_cast<int64_t>(r.prompt_ids.size());
    if (n == 0 || n >= s.ctx.max_positions) __builtin_trap();
    for (int32_t id : r.prompt_ids) {
      if (id < 0 || id >= s.tok->vocab_size()) __builtin_trap();
    }
    if (r.max_tokens <= 0 || n + r.max_tokens > s.ctx.max_positions) __builtin_trap();
    if (r.output.stop.size() > 16 || (r.include_usage && !r.stream)) __builtin_trap();
    for (const auto& stop : r.output.stop) {
      if (stop.empty()) __builtin_trap();
    }
    if (!(r.sampling.temperature >= 0 && r.sampling.temperature <= 2)) __builtin_trap();
    if (!(r.sampling.top_p > 0 && r.sampling.top_p <= 1) || r.sampling.top_k < 0) __builtin_trap();
  } catch (const dflash::server::ApiError& e) {
    if (e.status != 400 && e.status != 404) __builtin_trap();
  }
  return 0;
}
