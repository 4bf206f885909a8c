#include "server/reasoning.h"

#include <algorithm>

namespace dflash::server {

namespace {

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

size_t skip_space(std::string_view s, size_t i = 0) {
  while (i < s.size() && is_space(s[i])) ++i;
  return i;
}

// Length of the longest suffix of `s` that is a proper prefix of `tag`.
size_t partial_tag(std::string_view s, std::string_view tag) {
  for (size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n)
    if (s.substr(s.size() - n) == tag.substr(0, n)) return n;
  return 0;
}

}  // namespace

bool prompt_opens_think(std::string_view prompt) {
  size_t end = prompt.size();
  while (end > 0 && is_space(prompt[end - 1])) --end;
  return prompt.substr(0, end).ends_with(kThinkOpen);
}

ReasoningSplitter::ReasoningSplitter(bool starts_in_reasoning)
    : state_(starts_in_reasoning ? State::Reasoning : State::Start) {}

ReasoningSplitter::Split ReasoningSplitter::push(std::string_view text) {
  held_ += text;
  Split out;
  for (;;) {
    if (state_ == State::Start) {
      // Leading whitespace, then "<think>" opens the block; anything else is content.
      const size_t i = skip_space(held_);
      const std::string_view rest = std::string_view(held_).substr(i);
      if (rest.starts_with(kThinkOpen)) {
        held_.erase(0, i + kThinkOpen.size());
        state_ = State::Reasoning;
        continue;
      }
      if (kThinkOpen.starts_with(rest)) return out;  // still undecided
      state_ = State::Content;
      content_started_ = true;
      continue;
    }
    if (state_ == State::Reasoning) {
      if (!reasoning_started_) {  // leading whitespace of the block is dropped
        held_.erase(0, skip_space(held_));
        if (held_.empty()) return out;
        reasoning_started_ = true;
      }
      const size_t close = held_.find(kThinkClose);
      if (close != std::string::npos) {
        std::string_view r = std::string_view(held_).substr(0, close);
        while (!r.empty() && is_space(r.back())) r.remove_suffix(1);
        out.reasoning += r;
        held_.erase(0, close + kThinkClose.size());
        state_ = State::Content;
        continue;
      }
      // Hold a partial "</think>" and the whitespace before it (trimmed if the block ends there).
      size_t keep = partial_tag(held_, kThinkClose);
      while (keep < held_.size() && is_space(held_[held_.size() - keep - 1])) ++keep;
      out.reasoning += held_.substr(0, held_.size() - keep);
      held_.erase(0, held_.size() - keep);
      return out;
    }
    // Content.
    if (!content_started_) {
      const size_t i = skip_space(held_);
      held_.erase(0, i);
      if (held_.empty()) return out;
      content_started_ = true;
    }
    out.content += held_;
    held_.clear();
    return out;
  }
}

ReasoningSplitter::Split ReasoningSplitter::finish() {
  Split out;
  if (state_ == State::Reasoning) {
    std::string_view r = held_;
    while (!r.empty() && is_space(r.back())) r.remove_suffix(1);
    out.reasoning = r;
  } else if (state_ == State::Start || content_started_) {
    out.content = held_;
  }
  held_.clear();
  return out;
}

}  // namespace dflash::server
