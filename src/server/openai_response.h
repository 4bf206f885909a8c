// The JSON of OpenAI responses and stream chunks: choices with text or a chat
// message (content, reasoning_content, tool_calls), log-probabilities in the
// completions and the chat layouts, and usage.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/choice_output.h"
#include "tokenizer/tokenizer.h"

namespace dflash::server {

struct Usage {
  int prompt_tokens = 0, completion_tokens = 0;
};
nlohmann::json usage_json(const Usage& u);

// What every body of one response shares.
struct ResponseHead {
  bool chat = false;
  std::string id, model;
  int64_t created = 0;
  int logprobs = -1;          // top entries per token; -1: no log-probabilities
  const Tokenizer* tokenizer = nullptr;
};

// One finished choice of a non-streaming response.
struct FinishedChoice {
  const ChoiceDelta* output;
  std::string finish_reason;  // "stop", "length" or "tool_calls"
};
nlohmann::json completion_response(const ResponseHead& h, const std::vector<FinishedChoice>& choices, const Usage& u);

// Stream state of one choice.
struct ChunkState {
  bool first = true;       // the next chat chunk carries the assistant role
  int n_calls_sent = 0;    // tool calls in earlier chunks (their stream indexes)
  size_t text_offset = 0;  // completions: running text offset of the log-probabilities
};
// The stream chunks of choice `index` for a delta: its text and log-probabilities, then each
// tool call as OpenAI streams it (id, type and name first, then the arguments in pieces).
// finish_reason empty = null. A delta with nothing to send gives no chunk unless it finishes.
std::vector<nlohmann::json> completion_chunks(const ResponseHead& h, int index, const ChoiceDelta& d,
                                              const std::string& finish_reason, ChunkState& state);
nlohmann::json usage_chunk(const ResponseHead& h, const Usage& u);

}  // namespace dflash::server
