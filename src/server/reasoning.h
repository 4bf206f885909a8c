// Splits a reasoning model's output into reasoning and content, as vLLM and
// SGLang return it (message.reasoning_content / delta.reasoning_content): the
// text of a leading <think>...</think> block is reasoning, the rest content.
// Streaming and one-shot splits are the same, since both go through push().
#pragma once

#include <string>
#include <string_view>

namespace dflash::server {

inline constexpr std::string_view kThinkOpen = "<think>", kThinkClose = "</think>";

// True when a rendered prompt leaves a think block open (templates that write
// "<think>\n" into the generation prompt): the output then starts as reasoning.
bool prompt_opens_think(std::string_view prompt);

class ReasoningSplitter {
 public:
  struct Split {
    std::string reasoning, content;
  };
  explicit ReasoningSplitter(bool starts_in_reasoning);
  // Text that can be sent after `text`; a possible partial tag, and whitespace
  // that may end the reasoning, are held back.
  Split push(std::string_view text);
  // The rest at the end of generation (an unclosed block stays reasoning).
  Split finish();

 private:
  enum class State { Start, Reasoning, Content };
  State state_;
  bool reasoning_started_ = false, content_started_ = false;  // leading whitespace of each is dropped
  std::string held_;
};

}  // namespace dflash::server
