// Fuzz target: tokenizer.json loading. Any input must load or fail with
// dflash::Error; a tokenizer that loads must encode and decode cleanly.
#include <cstdint>
#include <string>

#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view json(reinterpret_cast<const char*>(data), size);
  try {
    const dflash::Tokenizer tok(json, "fuzz");
    for (const char* text : {"Hello world! 123", "  tabs\tand\nnewlines\r\n", "\xC3\xA9t\xC3\xA9 \xF0\x9F\x98\x80"}) {
      const auto ids = tok.encode(text, true);
      const std::string back = tok.decode(ids);
      if (dflash::utf8::first_invalid(back) != std::string::npos) __builtin_trap();
    }
  } catch (const dflash::Error&) {
  }
  return 0;
}
