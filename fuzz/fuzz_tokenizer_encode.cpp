// Fuzz target: encode and decode arbitrary bytes with the real Qwen3
// tokenizer (path in DFLASH_FUZZ_TOKENIZER). Invalid UTF-8 must be rejected
// with dflash::Error; valid text must give in-range ids whose decoding is
// valid UTF-8, and streaming decoding must equal one-shot decoding.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"
#include "util/error.h"

namespace {

const dflash::Tokenizer& tokenizer() {
  static const std::unique_ptr<dflash::Tokenizer> tok = [] {
    const char* path = std::getenv("DFLASH_FUZZ_TOKENIZER");
    if (!path) {
      std::fprintf(stderr, "set DFLASH_FUZZ_TOKENIZER to a tokenizer directory\n");
      std::abort();
    }
    return std::make_unique<dflash::Tokenizer>(path);
  }();
  return *tok;
}

void check_decode(const dflash::Tokenizer& tok, const std::vector<int32_t>& ids) {
  const std::string text = tok.decode(ids);
  if (dflash::utf8::first_invalid(text) != std::string::npos) __builtin_trap();
  dflash::StreamDecoder sd(tok);
  std::string streamed;
  for (int32_t id : ids) {
    const std::string piece = sd.push(id);
    if (dflash::utf8::first_invalid(piece) != std::string::npos) __builtin_trap();
    streamed += piece;
  }
  streamed += sd.finish();
  if (streamed != text) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const dflash::Tokenizer& tok = tokenizer();
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const bool valid = dflash::utf8::first_invalid(bytes) == std::string::npos;
  try {
    const auto ids = tok.encode(bytes);
    if (!valid) __builtin_trap();  // invalid UTF-8 must not be accepted
    for (int32_t id : ids) {
      if (id < 0 || id >= tok.vocab_size()) __builtin_trap();
    }
    check_decode(tok, ids);
  } catch (const dflash::Error&) {
    if (valid) __builtin_trap();  // valid text must always encode
  }
  // The same bytes read as token ids (mostly byte tokens, which split characters).
  std::vector<int32_t> ids;
  for (size_t i = 0; i + 1 < size; i += 2) ids.push_back((data[i] | (data[i + 1] << 8)) % tok.vocab_size());
  check_decode(tok, ids);
  return 0;
}
