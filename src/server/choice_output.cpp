#include "server/choice_output.h"

namespace dflash::server {

void append_delta(ChoiceDelta& to, const ChoiceDelta& d) {
  to.reasoning += d.reasoning;
  to.content += d.content;
  to.calls.insert(to.calls.end(), d.calls.begin(), d.calls.end());
  to.logprobs.insert(to.logprobs.end(), d.logprobs.begin(), d.logprobs.end());
}

ChoiceOutput::ChoiceOutput(const Tokenizer& tok, const OutputOptions& o)
    : text_(tok, o.stop, o.min_tokens), parallel_(o.parallel_tool_calls), id_prefix_(o.call_id_prefix) {
  if (o.reasoning) reasoning_ = std::make_unique<ReasoningSplitter>(o.starts_in_reasoning);
  if (o.tool_format != ToolCallFormat::None) tools_ = std::make_unique<ToolCallParser>(o.tool_format, o.tools);
}

ChoiceDelta ChoiceOutput::route(const std::string& text, bool at_end) {
  ChoiceDelta d;
  std::string content = text;
  if (reasoning_) {
    ReasoningSplitter::Split s = reasoning_->push(text);
    if (at_end) {
      ReasoningSplitter::Split rest = reasoning_->finish();
      s.reasoning += rest.reasoning;
      s.content += rest.content;
    }
    d.reasoning = std::move(s.reasoning);
    content = std::move(s.content);
  }
  if (!tools_) {
    d.content = std::move(content);
    return d;
  }
  ToolCallParser::Output t = tools_->push(content);
  if (at_end) {
    ToolCallParser::Output rest = tools_->finish();
    t.content += rest.content;
    t.calls.insert(t.calls.end(), rest.calls.begin(), rest.calls.end());
  }
  d.content = std::move(t.content);
  d.calls = std::move(t.calls);
  if (!parallel_ && !d.calls.empty()) {
    d.calls.resize(1);
    if (!at_end) call_ended_ = true;  // the engine request is stopped here
  }
  return d;
}

ChoiceDelta ChoiceOutput::push(int32_t token, const TokenLogprobs* lp) {
  if (ended()) return {};
  ChoiceDelta d = route(text_.push(token), false);
  if (lp) d.logprobs.push_back({token, *lp});
  if (call_ended_) {  // what follows the first call is dropped
    ChoiceDelta rest = route(text_.finish(), true);
    rest.calls.clear();
    rest.content.clear();
    append_delta(d, rest);
  }
  name_calls(d);
  append_delta(total_, d);
  return d;
}

void ChoiceOutput::name_calls(ChoiceDelta& d) const {
  for (size_t k = 0; k < d.calls.size(); ++k) d.calls[k].id = id_prefix_ + std::to_string(total_.calls.size() + k);
}

ChoiceDelta ChoiceOutput::finish() {
  if (call_ended_) return {};
  ChoiceDelta d = route(text_.finish(), true);
  if (!parallel_ && total_.calls.size() + d.calls.size() > 1) d.calls.resize(total_.calls.empty() ? 1 : 0);
  name_calls(d);
  append_delta(total_, d);
  return d;
}

}  // namespace dflash::server
