#include "server/text_stream.h"

#include <algorithm>
#include <utility>

namespace dflash::server {

TextStream::TextStream(const Tokenizer& tok, std::vector<std::string> stops, int min_tokens)
    : decoder_(tok, /*skip_special_tokens=*/true), stops_(std::move(stops)), min_tokens_(min_tokens) {
  stops_.erase(std::remove(stops_.begin(), stops_.end(), std::string()), stops_.end());
  for (const auto& s : stops_) max_stop_ = std::max(max_stop_, s.size());
}

std::string TextStream::push(int32_t token) {
  if (stopped_) return {};
  held_ += decoder_.push(token);
  if (++n_tokens_ < min_tokens_) return std::exchange(held_, {});
  return take_safe_prefix();
}

std::string TextStream::finish() {
  if (stopped_) return {};
  held_ += decoder_.finish();
  std::string out = take_safe_prefix();
  if (!stopped_) out += std::exchange(held_, {});
  return out;
}

std::string TextStream::take_safe_prefix() {
  // The earliest stop string ends the text.
  size_t cut = std::string::npos;
  for (const auto& s : stops_) cut = std::min(cut, held_.find(s));
  if (cut != std::string::npos) {
    stopped_ = true;
    std::string out = held_.substr(0, cut);
    held_.clear();
    return out;
  }
  if (max_stop_ == 0) return std::exchange(held_, {});
  // Keep the last max_stop - 1 bytes (a stop string may begin there), cut at a character boundary.
  if (held_.size() < max_stop_) return {};
  size_t n = held_.size() - (max_stop_ - 1);
  while (n > 0 && (static_cast<unsigned char>(held_[n]) & 0xC0) == 0x80) --n;
  std::string out = held_.substr(0, n);
  held_.erase(0, n);
  return out;
}

}  // namespace dflash::server
