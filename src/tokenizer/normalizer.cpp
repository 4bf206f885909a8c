#include "tokenizer/normalizer.h"

#include <cstdlib>
#include <iterator>
#include <vector>

#include <utf8proc.h>

#include "tokenizer/utf8.h"
#include "util/error.h"

namespace dflash {

namespace {

bool is_ascii(const std::string& s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  }
  return true;
}

struct Range {
  char32_t lo, hi;
};
constexpr Range kUnicode9[] = {
#include "tokenizer/unicode9_assigned.inc"
};

// HF `tokenizers` normalizes with Unicode 9.0 data: a character assigned
// later has no decomposition and combining class 0 there, so it is a starter
// that never composes. Splitting the text at such characters and normalizing
// the pieces with current data gives the same result.
bool assigned_in_unicode9(char32_t c) {
  size_t lo = 0, hi = std::size(kUnicode9);
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (kUnicode9[mid].hi < c) lo = mid + 1;
    else hi = mid;
  }
  return lo < std::size(kUnicode9) && kUnicode9[lo].lo <= c;
}

class UnicodeForm : public Normalizer {
 public:
  UnicodeForm(std::string name, int options) : name_(std::move(name)), options_(options) {}
  std::string normalize(std::string text) const override {
    if (is_ascii(text)) return text;  // every form leaves ASCII unchanged
    std::string out;
    size_t seg = 0, i = 0;
    while (i < text.size()) {
      const size_t at = i;
      const char32_t c = utf8::next(text, i);
      if (c < 0x300 || assigned_in_unicode9(c)) continue;
      map(std::string_view(text).substr(seg, at - seg), out);
      out.append(text, at, i - at);
      seg = i;
    }
    if (seg == 0) {
      std::string r;
      map(text, r);
      return r;
    }
    map(std::string_view(text).substr(seg), out);
    return out;
  }

 private:
  void map(std::string_view s, std::string& out) const {
    if (s.empty()) return;
    utf8proc_uint8_t* buf = nullptr;
    const auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                static_cast<utf8proc_ssize_t>(s.size()), &buf, static_cast<utf8proc_option_t>(options_));
    check(n >= 0, "normalizer ", name_, ": ", utf8proc_errmsg(n));
    out.append(reinterpret_cast<char*>(buf), static_cast<size_t>(n));
    std::free(buf);
  }

 public:

 private:
  std::string name_;
  int options_;
};

class Lowercase : public Normalizer {
 public:
  std::string normalize(std::string text) const override {
    std::string out;
    out.reserve(text.size());
    utf8proc_ssize_t i = 0;
    const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(text.data());
    while (i < static_cast<utf8proc_ssize_t>(text.size())) {
      utf8proc_int32_t cp;
      const auto n = utf8proc_iterate(p + i, static_cast<utf8proc_ssize_t>(text.size()) - i, &cp);
      check(n > 0, "normalizer Lowercase: invalid UTF-8");
      utf8proc_uint8_t buf[4];
      const auto m = utf8proc_encode_char(utf8proc_tolower(cp), buf);
      out.append(reinterpret_cast<char*>(buf), static_cast<size_t>(m));
      i += n;
    }
    return out;
  }
};

class Sequence : public Normalizer {
 public:
  explicit Sequence(std::vector<std::unique_ptr<Normalizer>> parts) : parts_(std::move(parts)) {}
  std::string normalize(std::string text) const override {
    for (const auto& p : parts_) text = p->normalize(std::move(text));
    return text;
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

}  // namespace

std::unique_ptr<Normalizer> Normalizer::from_json(const nlohmann::json& j) {
  if (j.is_null()) return nullptr;
  check(j.is_object() && j.contains("type") && j["type"].is_string(), "normalizer: expected an object with a \"type\"");
  const std::string type = j["type"];
  const int base = UTF8PROC_STABLE;
  if (type == "NFC") return std::make_unique<UnicodeForm>(type, base | UTF8PROC_COMPOSE);
  if (type == "NFD") return std::make_unique<UnicodeForm>(type, base | UTF8PROC_DECOMPOSE);
  if (type == "NFKC") return std::make_unique<UnicodeForm>(type, base | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
  if (type == "NFKD") return std::make_unique<UnicodeForm>(type, base | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
  if (type == "Lowercase") return std::make_unique<Lowercase>();
  if (type == "Sequence") {
    check(j.contains("normalizers") && j["normalizers"].is_array(), "normalizer Sequence: missing \"normalizers\" list");
    std::vector<std::unique_ptr<Normalizer>> parts;
    for (const auto& p : j["normalizers"]) {
      auto n = from_json(p);
      if (n) parts.push_back(std::move(n));
    }
    return std::make_unique<Sequence>(std::move(parts));
  }
  throw Error(cat("normalizer \"", type, "\" is not supported (supported: NFC, NFD, NFKC, NFKD, Lowercase, Sequence)"));
}

}  // namespace dflash
