// Element types that checkpoints may hold, and conversions to float.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

namespace dflash {

enum class DType { F32, F16, BF16 };

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

// Converts n elements of type `t` at `src` (any alignment) to float.
void convert_to_f32(DType t, const void* src, float* dst, size_t n);

}  // namespace dflash
