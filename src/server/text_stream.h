// Generated tokens -> text for one response: incremental detokenization (only
// complete UTF-8 characters) and stop strings matched across token boundaries.
// Text that could still be the start of a stop string is held back, and the
// stop string itself is never emitted.
#pragma once

#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace dflash::server {

class TextStream {
 public:
  // Stop strings are looked for from the min_tokens-th token on (vLLM's min_tokens).
  TextStream(const Tokenizer& tok, std::vector<std::string> stops, int min_tokens = 0);

  // Text that can be sent after `token`; empty while held back. After a stop
  // string is seen, stopped() is true and further tokens add nothing.
  std::string push(int32_t token);
  // The rest at the end of generation (nothing after a stop string).
  std::string finish();
  bool stopped() const { return stopped_; }

 private:
  std::string take_safe_prefix();

  StreamDecoder decoder_;
  std::vector<std::string> stops_;
  size_t max_stop_ = 0;
  int min_tokens_ = 0, n_tokens_ = 0;
  std::string held_;   // decoded, not yet sent
  bool stopped_ = false;
};

}  // namespace dflash::server
