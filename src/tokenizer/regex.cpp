#include "tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "tokenizer/utf8.h"
#include "util/error.h"

namespace dflash {

namespace {

constexpr const char* kWhiteSpace =
    R"(\t\n\x{0B}\f\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

pcre2_code* code(void* p) { return static_cast<pcre2_code*>(p); }

}  // namespace

std::string oniguruma_compatible(const std::string& p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[++i];
      if (e == 's') {
        out += in_class ? std::string(kWhiteSpace) : cat("[", kWhiteSpace, "]");
      } else if (e == 'S') {
        check(!in_class, "pre_tokenizer regex: \\S inside a character class is not supported");
        out += cat("[^", kWhiteSpace, "]");
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (in_class && c == '[') {
      check(!(i + 1 < p.size() && p[i + 1] == ':'), "pre_tokenizer regex: POSIX classes are not supported");
      check(false, "pre_tokenizer regex: nested character classes are not supported");
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

Regex::Regex(const std::string& pattern) {
  const std::string p = oniguruma_compatible(pattern);
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre2_code* c = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(p.data()), p.size(), PCRE2_UTF | PCRE2_UCP, &err, &off,
                                nullptr);
  if (!c) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw Error(cat("pre_tokenizer regex does not compile at offset ", off, ": ", reinterpret_cast<char*>(msg)));
  }
  pcre2_jit_compile(c, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if JIT is unavailable
  code_ = c;
}

Regex::~Regex() { pcre2_code_free(code(code_)); }

void Regex::find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const {
  out.clear();
  thread_local struct Data {
    pcre2_match_data* md = pcre2_match_data_create(4, nullptr);
    ~Data() { pcre2_match_data_free(md); }
  } data;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;
  while (pos <= text.size()) {
    const int rc = pcre2_match(code(code_), subject, text.size(), pos, PCRE2_NO_UTF_CHECK, data.md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    check(rc >= 0, "pre_tokenizer regex: match failed (PCRE2 error ", rc, ")");
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data.md);
    const size_t b = ov[0], e = ov[1];
    if (e > b) {
      out.emplace_back(b, e);
      pos = e;
    } else {
      // Empty match: step over one character, as Oniguruma's iterator does.
      if (b >= text.size()) break;
      const size_t n = utf8::valid_sequence_length(text, b);
      pos = b + (n ? n : 1);
    }
  }
}

}  // namespace dflash
