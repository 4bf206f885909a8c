// Validation of single request fields into engine settings: each throws
// ApiError (400) naming the field. Used by openai_protocol.cpp.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "server/tool_calls.h"

namespace dflash::server {

[[noreturn]] void bad_field(const std::string& param, const std::string& message);
double number_field(const nlohmann::json& b, const std::string& key);
// A number field in [lo, hi] (absent or null: no change).
void read_number(const nlohmann::json& b, const std::string& key, double lo, double hi, float& out);
// An integer field in [lo, hi] (absent or null: no change).
void read_int(const nlohmann::json& b, const std::string& key, int64_t lo, int64_t hi, int& out);
void read_bool(const nlohmann::json& b, const std::string& key, bool& out);

// presence_penalty, frequency_penalty, repetition_penalty, logit_bias (token ids < n_vocab).
void read_penalties(const nlohmann::json& b, int32_t n_vocab, SamplingParams& s);

// Log-probabilities asked for: completions' integer `logprobs`, or chat's `logprobs: true` with
// `top_logprobs`. -1: none.
int read_logprobs(const nlohmann::json& b, bool chat);

// What a chat request's tools ask of the output.
struct ToolUse {
  bool render = false;    // pass `tools` to the template
  bool parse = false;     // parse tool calls out of the output
  bool parallel = true;   // parallel_tool_calls
};
// tools, tool_choice ("none", "auto"; "required" and a named function need constrained decoding
// and are refused), parallel_tool_calls.
ToolUse read_tool_use(const nlohmann::json& b);

}  // namespace dflash::server
