// The OpenAI-compatible request and response formats: validation of
// /v1/completions and /v1/chat/completions bodies into a prompt and decoding
// settings, and the JSON of responses, stream chunks and errors.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "formats/chat_template.h"
#include "server/choice_output.h"
#include "tokenizer/tokenizer.h"

namespace dflash::server {

// A request the server refuses: HTTP status and OpenAI's error fields.
struct ApiError : std::runtime_error {
  int status;
  std::string type, param;
  ApiError(int status_, const std::string& message, std::string param_ = {},
           std::string type_ = "invalid_request_error")
      : std::runtime_error(message), status(status_), type(std::move(type_)), param(std::move(param_)) {}
};

std::string error_json(const std::string& message, const std::string& type, const std::string& param);

// What requests are checked against.
struct ProtocolContext {
  const Tokenizer* tokenizer = nullptr;
  const ChatTemplate* chat_template = nullptr;  // null: chat completions are refused
  std::string model_name;
  int max_positions = 0;                        // the model's context
  std::vector<int32_t> chat_eos;                // the chat template's end-of-turn token
  SamplingParams default_sampling;              // for fields a request leaves out (generation_config.json)
  ToolCallFormat tool_format = ToolCallFormat::Hermes;  // how chat requests with tools get their calls parsed
  bool reasoning = false;                       // split <think> blocks into reasoning_content
};

inline constexpr int kMaxChoices = 16, kMaxLogprobs = 20;

struct CompletionRequest {
  bool chat = false;
  std::vector<int32_t> prompt_ids;
  int max_tokens = 16;
  int n = 1;                                    // choices; choice i samples with seed + i
  int logprobs = -1;                            // top entries per token (0: the chosen token's only); -1: none
  bool ignore_eos = false;
  bool stream = false, include_usage = false;
  std::vector<int32_t> extra_eos;
  SamplingParams sampling;                      // seed meaningful only when has_seed
  bool has_seed = false;
  OutputOptions output;                         // stop strings, reasoning and tool-call parsing
};

// Requests with tool JSON schemas nest about 10 levels; 128 leaves ample room.
inline constexpr size_t kMaxJsonDepth = 128;

// True when arrays and objects in `text` nest deeper than `limit`, measured
// before a document is built: unbounded nesting overflows the stack in every
// recursive walk of a tree (copies, comparisons, dump, template values).
// Brackets inside strings (escapes included) do not count; no recursion.
bool json_depth_exceeds(std::string_view text, size_t limit);

// A request body as a JSON object; ApiError (400) for bad UTF-8, JSON or nesting.
nlohmann::ordered_json parse_body(const std::string& body);
// The prompt text of a chat body (`messages`, `chat_template_kwargs`, and `tools` when with_tools).
std::string render_chat(const nlohmann::ordered_json& b, const ProtocolContext& ctx, bool with_tools,
                        bool add_generation_prompt);

// Throws ApiError (400) naming the field for anything malformed or unsupported,
// 404 for another model's name.
CompletionRequest parse_completion_request(const std::string& body, bool chat, const ProtocolContext& ctx);

// OpenAI's finish_reason for how the engine ended a request: "stop" (EOS) or
// "length" (max_tokens, or the context is full). Cancelled (the client left)
// and Error (answered with an error instead) have none.
std::optional<std::string> finish_reason_text(FinishReason r);

}  // namespace dflash::server
