// One choice of a response, assembled from its tokens: text (stop strings
// applied), then reasoning split off, then tool calls parsed out of the
// content, plus the tokens' log-probabilities. A streaming response sends each
// delta; a non-streaming one sends what accumulated, which is the same.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "server/reasoning.h"
#include "server/text_stream.h"
#include "server/tool_calls.h"
#include "tokenizer/tokenizer.h"

namespace dflash::server {

struct OutputOptions {
  std::vector<std::string> stop;
  int min_tokens = 0;                 // stop strings are not matched before this many tokens
  bool reasoning = false;             // split <think> blocks into reasoning_content
  bool starts_in_reasoning = false;   // the prompt opened a think block
  ToolCallFormat tool_format = ToolCallFormat::None;
  nlohmann::json tools;               // the request's tools (names, schemas)
  bool parallel_tool_calls = true;    // false: the choice ends after its first call
  std::string call_id_prefix = "call_";  // tool call k of the choice gets id prefix + k
};

struct LogprobEntry {
  int32_t token = 0;
  TokenLogprobs lp;
};

struct ChoiceDelta {
  std::string reasoning, content;
  std::vector<ToolCall> calls;
  std::vector<LogprobEntry> logprobs;
  bool empty() const { return reasoning.empty() && content.empty() && calls.empty() && logprobs.empty(); }
};

void append_delta(ChoiceDelta& to, const ChoiceDelta& from);

class ChoiceOutput {
 public:
  ChoiceOutput(const Tokenizer& tok, const OutputOptions& o);

  // One generated token (and its log-probabilities when asked). Adds nothing once ended().
  ChoiceDelta push(int32_t token, const TokenLogprobs* lp);
  // The rest at the end of generation.
  ChoiceDelta finish();
  // Ended by a stop string or, without parallel tool calls, by the first call.
  bool ended() const { return text_.stopped() || call_ended_; }
  int n_calls() const { return tools_ ? tools_->n_calls() : 0; }

  // Everything sent so far, for a non-streaming response.
  const ChoiceDelta& total() const { return total_; }

 private:
  ChoiceDelta route(const std::string& text, bool at_end);
  void name_calls(ChoiceDelta& d) const;

  TextStream text_;
  std::unique_ptr<ReasoningSplitter> reasoning_;
  std::unique_ptr<ToolCallParser> tools_;
  bool parallel_;
  std::string id_prefix_;
  bool call_ended_ = false;
  ChoiceDelta total_;
};

}  // namespace dflash::server
