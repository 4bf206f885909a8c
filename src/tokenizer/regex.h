// A compiled PCRE2 pattern (UTF + Unicode properties, JIT) with the match
// semantics of the Oniguruma patterns in tokenizer.json files.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dflash {

class Regex {
 public:
  explicit Regex(const std::string& pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Non-overlapping matches [begin, end) in `text` (valid UTF-8), left to right.
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const;

 private:
  void* code_ = nullptr;  // pcre2_code_8
};

// Rewrites \s and \S to the Unicode White_Space set, which is what Oniguruma
// matches (PCRE2's own \s differs, e.g. at U+180E and U+0085).
std::string oniguruma_compatible(const std::string& pattern);

}  // namespace dflash
