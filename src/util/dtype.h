// Element types that checkpoints may hold, and conversions to float.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

namespace dflash {

// I32: token ids kept on a device (never a checkpoint tensor's type: parse_dtype rejects it).
enum class DType { F32, F16, BF16, I32 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);                          // safetensors spelling: "F32", ...
std::optional<DType> parse_dtype(const std::string& s);  // nullopt for unsupported types

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float f16_to_f32(uint16_t h);

// Rounds to the nearest bfloat16, ties to even (NaN stays NaN).
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Converts n elements of type `t` at `src` (any alignment) to float.
void convert_to_f32(DType t, const void* src, float* dst, size_t n);

}  // namespace dflash
