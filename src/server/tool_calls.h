// Tool calls in a chat model's output, parsed into OpenAI's message.tool_calls
// as vLLM's "hermes" and "llama3_json" parsers do:
//
//   Hermes (Qwen3, Qwen2.5, ChatML models): <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
//     several per turn, with text around them; Qwen3.5 / Qwen3-Coder write the body as
//     <function=NAME><parameter=P>value</parameter>...</function> instead of JSON.
//   Llama3Json (Llama 3.1/3.2): the whole output is {"name": ..., "parameters": {...}}, or several
//     such objects separated by ';' (after <|python_tag|>, a special token the decoder skips).
//
// Text that only looks like a tool call (malformed JSON, a function not in the
// request's tools, an unclosed block) stays content. Streaming and one-shot
// parsing are the same: both go through push().
#pragma once

#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace dflash::server {

enum class ToolCallFormat { None, Hermes, Llama3Json };

// "auto" picks from the chat template's source: Llama3Json for templates that
// use <|python_tag|> or Llama's headers, else Hermes. Throws Error for unknown names.
ToolCallFormat parse_tool_call_format(const std::string& name, const std::string& template_source);

struct ToolCall {
  std::string id;         // set by the server ("call_...")
  std::string name;
  std::string arguments;  // a JSON object as text
};

class ToolCallParser {
 public:
  // `tools`: the request's tools list (their function names and parameter schemas).
  ToolCallParser(ToolCallFormat format, const nlohmann::json& tools);

  struct Output {
    std::string content;
    std::vector<ToolCall> calls;  // completed calls, in order
  };
  // Content and calls that can be sent after `text`. Text that may still become
  // a call is held back, and so is whitespace after a call (dropped if nothing else follows).
  Output push(std::string_view text);
  Output finish();
  int n_calls() const { return n_calls_; }

 private:
  Output push_hermes();
  std::vector<ToolCall> llama_calls(std::string_view text) const;
  bool parse_call(const nlohmann::json& j, ToolCall& out) const;
  bool parse_xml_call(std::string_view body, ToolCall& out) const;
  void add_content(Output& out, std::string_view text);

  ToolCallFormat format_;
  std::set<std::string> names_;
  nlohmann::json tools_;
  std::string held_;
  std::string pending_space_;  // whitespace after a call, sent only if text follows
  bool in_call_ = false, llama_json_ = false, started_ = false;
  int n_calls_ = 0;
};

}  // namespace dflash::server
