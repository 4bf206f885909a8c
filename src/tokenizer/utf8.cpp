#include "tokenizer/utf8.h"

#include "util/error.h"

namespace dflash::utf8 {

namespace {

// Number of bytes of the longest prefix of s[i..] that could start a valid
// sequence (the "maximal subpart" of the Unicode standard), and whether it is complete.
struct Subpart {
  size_t len;
  bool complete;
  bool truncated = false;  // incomplete only because the input ended
};

Subpart subpart(std::string_view s, size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return {1, true};
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) need = 1;
  else if (b0 == 0xE0) need = 2, lo = 0xA0;
  else if (b0 >= 0xE1 && b0 <= 0xEC) need = 2;
  else if (b0 == 0xED) need = 2, hi = 0x9F;
  else if (b0 >= 0xEE && b0 <= 0xEF) need = 2;
  else if (b0 == 0xF0) need = 3, lo = 0x90;
  else if (b0 >= 0xF1 && b0 <= 0xF3) need = 3;
  else if (b0 == 0xF4) need = 3, hi = 0x8F;
  else return {1, false};
  size_t n = 1;
  for (size_t k = 0; k < need; ++k) {
    if (i + n >= s.size()) return {n, false, true};
    const auto b = static_cast<unsigned char>(s[i + n]);
    const bool ok = k == 0 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
    if (!ok) return {n, false};
    ++n;
  }
  return {n, true};
}

}  // namespace

size_t valid_sequence_length(std::string_view s, size_t i) {
  const Subpart p = subpart(s, i);
  return p.complete ? p.len : 0;
}

size_t first_invalid(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = valid_sequence_length(s, i);
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

void require_valid(std::string_view s, std::string_view what) {
  const size_t bad = first_invalid(s);
  check(bad == std::string_view::npos, what, " is not valid UTF-8 (byte ", bad, ")");
}

char32_t next(std::string_view s, size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return s[i++], b0;
  const size_t n = b0 >= 0xF0 ? 4 : b0 >= 0xE0 ? 3 : 2;
  char32_t cp = b0 & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += n;
  return cp;
}

void append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::u32string decode(std::string_view valid) {
  std::u32string out;
  out.reserve(valid.size());
  for (size_t i = 0; i < valid.size();) out += next(valid, i);
  return out;
}

std::string encode(std::u32string_view cps) {
  std::string out;
  out.reserve(cps.size());
  for (char32_t c : cps) append(out, c);
  return out;
}

std::string lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    const Subpart p = subpart(bytes, i);
    if (p.complete) out.append(bytes.substr(i, p.len));
    else out += "\xEF\xBF\xBD";
    i += p.len;
  }
  return out;
}

size_t stable_prefix(std::string_view bytes) {
  size_t i = 0;
  while (i < bytes.size()) {
    const Subpart p = subpart(bytes, i);
    if (p.truncated) return i;  // may still complete
    i += p.len;
  }
  return i;
}

}  // namespace dflash::utf8
