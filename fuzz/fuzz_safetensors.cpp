// Fuzz target: the safetensors header reader on a whole file image. Any input
// must parse or fail with dflash::Error; a parsed file's tensors must lie
// inside the data area, match their shape and dtype, and not overlap.
#include <cstdint>
#include <cstring>

#include "formats/safetensors.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto h = dflash::parse_safetensors(data, size, "fuzz.safetensors");
    uint64_t header_len = 0;
    std::memcpy(&header_len, data, 8);
    const uint8_t* area = data + 8 + header_len;
    for (size_t i = 0; i < h.tensors.size(); ++i) {
      const auto& t = h.tensors[i];
      if (t.data < area || t.data > data + size || t.n_bytes > static_cast<size_t>(data + size - t.data))
        __builtin_trap();
      uint64_t n = dflash::dtype_size(t.dtype);
      for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
      if (n != t.n_bytes) __builtin_trap();
      if (i > 0 && !(h.tensors[i - 1].name < t.name)) __builtin_trap();  // sorted, unique
    }
  } catch (const dflash::Error&) {
  }
  return 0;
}
