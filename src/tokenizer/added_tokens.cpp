#include "tokenizer/added_tokens.h"

#include <utf8proc.h>

#include "tokenizer/utf8.h"
#include "util/error.h"

namespace dflash {

namespace {

bool flag(const nlohmann::json& j, const char* key, bool def) {
  if (!j.contains(key) || j[key].is_null()) return def;
  check(j[key].is_boolean(), "added_tokens: \"", key, "\" must be true or false");
  return j[key];
}

// Rust's char::is_alphanumeric() || '_' : the "word" test of single_word tokens.
bool is_word_char(char32_t c) {
  if (c == '_') return true;
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO) ||
         (cat >= UTF8PROC_CATEGORY_ND && cat <= UTF8PROC_CATEGORY_NO);
}

bool is_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

char32_t last_char(std::string_view s, size_t end) {
  size_t b = end - 1;
  while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
  return utf8::next(s, b);
}

}  // namespace

AddedToken AddedToken::from_json(const nlohmann::json& j) {
  check(j.is_object() && j.contains("id") && j["id"].is_number_integer() && j.contains("content") &&
            j["content"].is_string(),
        "added_tokens: each entry needs an integer \"id\" and a string \"content\"");
  AddedToken t;
  const auto id = j["id"].get<int64_t>();
  check(id >= 0 && id < (1 << 24), "added_tokens: id ", id, " is out of range");
  t.id = static_cast<int32_t>(id);
  t.content = j["content"];
  check(!t.content.empty(), "added_tokens: token ", id, " has empty content");
  utf8::require_valid(t.content, cat("added token ", id));
  t.single_word = flag(j, "single_word", false);
  t.lstrip = flag(j, "lstrip", false);
  t.rstrip = flag(j, "rstrip", false);
  t.normalized = flag(j, "normalized", true);
  t.special = flag(j, "special", false);
  return t;
}

void AddedTokenMatcher::build(const std::vector<const AddedToken*>& tokens, const std::vector<std::string>& contents) {
  tokens_ = tokens;
  trie_.assign(1, Node{});
  for (size_t k = 0; k < tokens.size(); ++k) {
    int node = 0;
    for (unsigned char c : contents[k]) {
      auto it = trie_[node].next.find(c);
      if (it == trie_[node].next.end()) {
        trie_.push_back(Node{});
        it = trie_[node].next.emplace(c, static_cast<int>(trie_.size() - 1)).first;
      }
      node = it->second;
    }
    if (trie_[node].token < 0) trie_[node].token = static_cast<int>(k);  // first of equal contents wins
  }
}

void AddedTokenMatcher::split(std::string_view text, std::vector<TextSpan>& out) const {
  out.clear();
  size_t start_offset = 0;
  size_t i = 0;
  const auto& root = trie_[0].next;
  while (i < text.size()) {
    // Leftmost-longest: the first position with any match, the longest match there.
    if (!root.count(static_cast<unsigned char>(text[i]))) {
      ++i;
      continue;
    }
    int node = 0, best = -1;
    size_t best_end = 0;
    for (size_t j = i; j < text.size(); ++j) {
      const auto it = trie_[node].next.find(static_cast<unsigned char>(text[j]));
      if (it == trie_[node].next.end()) break;
      node = it->second;
      if (trie_[node].token >= 0) best = trie_[node].token, best_end = j + 1;
    }
    if (best < 0) {
      ++i;
      continue;
    }
    const AddedToken& t = *tokens_[best];
    size_t start = i, stop = best_end;
    i = best_end;  // the matcher resumes after the raw match
    if (t.single_word) {
      const bool start_ok = start == 0 || !is_word_char(last_char(text, start));
      size_t k = stop;
      const bool stop_ok = stop == text.size() || !is_word_char(utf8::next(text, k));
      if (!start_ok || !stop_ok) continue;
    }
    if (t.lstrip) {
      size_t b = start;
      while (b > 0 && is_space(last_char(text, b))) {
        --b;
        while (b > 0 && (static_cast<unsigned char>(text[b]) & 0xC0) == 0x80) --b;
      }
      start = std::max(b, start_offset);
    }
    if (t.rstrip) {
      size_t k = stop;
      while (k < text.size()) {
        size_t n = k;
        if (!is_space(utf8::next(text, n))) break;
        k = n;
      }
      stop = k;
      i = std::max(i, stop);  // never match inside the stripped spaces
    }
    if (start_offset < start) out.push_back({start_offset, start, -1});
    out.push_back({start, stop, t.id});
    start_offset = stop;
  }
  if (start_offset < text.size()) out.push_back({start_offset, text.size(), -1});
}

}  // namespace dflash
