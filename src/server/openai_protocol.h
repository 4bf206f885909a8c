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
};

struct CompletionRequest {
  bool chat = false;
  std::vector<int32_t> prompt_ids;
  int max_tokens = 16;
  std::vector<std::string> stop;
  bool stream = false, include_usage = false;
  std::vector<int32_t> extra_eos;
  SamplingParams sampling;                      // seed meaningful only when has_seed
  bool has_seed = false;
};

// Requests with tool JSON schemas nest about 10 levels; 128 leaves ample room.
inline constexpr size_t kMaxJsonDepth = 128;

// True when arrays and objects in `text` nest deeper than `limit`, measured
// before a document is built: unbounded nesting overflows the stack in every
// recursive walk of a tree (copies, comparisons, dump, template values).
// Brackets inside strings (escapes included) do not count; no recursion.
bool json_depth_exceeds(std::string_view text, size_t limit);

// Throws ApiError (400) naming the field for anything malformed or unsupported,
// 404 for another model's name.
CompletionRequest parse_completion_request(const std::string& body, bool chat, const ProtocolContext& ctx);

// OpenAI's finish_reason for how the engine ended a request: "stop" (EOS) or
// "length" (max_tokens, or the context is full). Cancelled (the client left)
// and Error (answered with an error instead) have none.
std::optional<std::string> finish_reason_text(FinishReason r);

// Response bodies. `id` like "cmpl-12"; finish_reason "stop" or "length".
struct Usage {
  int prompt_tokens = 0, completion_tokens = 0;
};
nlohmann::json usage_json(const Usage& u);
nlohmann::json completion_response(bool chat, const std::string& id, const std::string& model, int64_t created,
                                   const std::string& text, const std::string& finish_reason, const Usage& u);
// A stream chunk; `first` adds the assistant role (chat), finish_reason empty = null.
nlohmann::json completion_chunk(bool chat, const std::string& id, const std::string& model, int64_t created,
                                const std::string& text, const std::string& finish_reason, bool first);
nlohmann::json usage_chunk(bool chat, const std::string& id, const std::string& model, int64_t created, const Usage& u);

}  // namespace dflash::server
