// The chat template of a Hugging Face tokenizer directory (chat_template.jinja,
// or "chat_template" in tokenizer_config.json) and the special-token strings
// it is rendered with, as transformers' apply_chat_template does.
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "formats/jinja/template.h"

namespace dflash {

class ChatTemplate {
 public:
  // Throws Error when the directory has no chat template or it does not parse.
  explicit ChatTemplate(const std::string& tokenizer_dir);
  // The special tokens of tokenizer_dir with the template of another file (serve --chat-template).
  ChatTemplate(const std::string& tokenizer_dir, const std::string& template_file);
  ChatTemplate(const std::string& source, nlohmann::ordered_json special_tokens);

  // `request`: {"messages": [...], "tools": [...]?, "add_generation_prompt": bool?,
  // other keys (e.g. "enable_thinking") become template variables}.
  std::string render(const nlohmann::ordered_json& request) const;

  const std::optional<std::string>& eos_token() const { return eos_; }
  // The template text (the server tells tool-call and reasoning formats from it).
  const std::string& source() const { return source_; }

 private:
  std::optional<jinja::Template> tmpl_;
  nlohmann::ordered_json special_;  // bos_token, eos_token, ... -> strings
  std::optional<std::string> eos_;
  std::string source_;
};

}  // namespace dflash
