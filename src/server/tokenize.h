// vLLM's /tokenize and /detokenize: a prompt (or chat messages rendered with
// the chat template) to token ids, and token ids back to text.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "server/openai_protocol.h"

namespace dflash::server {

// {"prompt": str, "add_special_tokens": bool = false} or {"messages": [...], "add_generation_prompt":
// bool = true, "tools"?, "chat_template_kwargs"?, "add_special_tokens": bool = false}; "return_token_strs".
// -> {"count", "max_model_len", "tokens", "token_strs"}. The default add_special_tokens is what the
// completion endpoints feed the model.
nlohmann::json tokenize_response(const std::string& body, const ProtocolContext& ctx);
// {"tokens": [ids]} -> {"prompt": text}
nlohmann::json detokenize_response(const std::string& body, const ProtocolContext& ctx);

}  // namespace dflash::server
