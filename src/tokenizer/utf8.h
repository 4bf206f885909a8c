// UTF-8 helpers shared by the tokenizer and the template engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dflash::utf8 {

// Length of the valid UTF-8 sequence starting at s[i], or 0 if the bytes there
// are not a complete, valid sequence (overlong, surrogate, > U+10FFFF, truncated).
size_t valid_sequence_length(std::string_view s, size_t i);

// Byte offset of the first invalid byte, or npos when the whole string is valid.
size_t first_invalid(std::string_view s);

// Throws Error naming `what` and the byte offset when `s` is not valid UTF-8.
void require_valid(std::string_view s, std::string_view what);

// Decodes one code point of valid UTF-8 at s[i]; advances i.
char32_t next(std::string_view s, size_t& i);

void append(std::string& out, char32_t cp);
std::u32string decode(std::string_view valid);
std::string encode(std::u32string_view cps);

// Bytes -> text the way Rust's String::from_utf8_lossy does: every maximal
// invalid subpart becomes one U+FFFD.
std::string lossy(std::string_view bytes);

// Length of the longest prefix of `bytes` that lossy-decodes the same whatever
// bytes follow: everything except a trailing, still-completable partial sequence.
size_t stable_prefix(std::string_view bytes);

}  // namespace dflash::utf8
