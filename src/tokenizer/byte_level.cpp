#include "tokenizer/byte_level.h"

#include "tokenizer/utf8.h"

namespace dflash::byte_level {

namespace {

struct Tables {
  std::array<char32_t, 256> to_char{};
  std::array<std::string, 256> to_utf8{};
  std::array<int, 256 + 68> from_char{};  // -1: not a byte character
  Tables() {
    from_char.fill(-1);
    // Printable Latin-1 bytes stand for themselves; the rest map to 256+k in order.
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_char[b] = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + extra++);
      utf8::append(to_utf8[b], to_char[b]);
      from_char[to_char[b]] = b;
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

char32_t char_of(unsigned char b) { return tables().to_char[b]; }

std::optional<unsigned char> byte_of(char32_t c) {
  if (c >= tables().from_char.size() || tables().from_char[c] < 0) return std::nullopt;
  return static_cast<unsigned char>(tables().from_char[c]);
}

std::string encode(std::string_view bytes) {
  const Tables& t = tables();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) out += t.to_utf8[static_cast<unsigned char>(c)];
  return out;
}

}  // namespace dflash::byte_level
