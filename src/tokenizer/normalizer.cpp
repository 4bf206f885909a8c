#include "tokenizer/normalizer.h"

#include <cstdlib>
#include <vector>

#include <utf8proc.h>

#include "util/error.h"

namespace dflash {

namespace {

bool is_ascii(const std::string& s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  }
  return true;
}

class UnicodeForm : public Normalizer {
 public:
  UnicodeForm(std::string name, int options) : name_(std::move(name)), options_(options) {}
  std::string normalize(std::string text) const override {
    if (is_ascii(text)) return text;  // every form leaves ASCII unchanged
    utf8proc_uint8_t* out = nullptr;
    const auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                static_cast<utf8proc_ssize_t>(text.size()), &out,
                                static_cast<utf8proc_option_t>(options_));
    check(n >= 0, "normalizer ", name_, ": ", utf8proc_errmsg(n));
    std::string r(reinterpret_cast<char*>(out), static_cast<size_t>(n));
    std::free(out);
    return r;
  }

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
