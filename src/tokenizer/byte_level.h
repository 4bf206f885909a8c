// The GPT-2 byte <-> printable-character map used by byte-level BPE.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>

namespace dflash::byte_level {

// Code point that stands for byte b.
char32_t char_of(unsigned char b);

// Byte that code point c stands for, if any.
std::optional<unsigned char> byte_of(char32_t c);

// Each byte of `bytes` replaced by its character, UTF-8 encoded.
std::string encode(std::string_view bytes);

// The GPT-2 split pattern that ByteLevel uses when use_regex is true.
inline constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

}  // namespace dflash::byte_level
