// Why a sequence stopped generating. One vocabulary for the engine, generate
// and the server (which maps it to OpenAI's finish_reason strings).
#pragma once

namespace dflash {

enum class FinishReason {
  Eos,        // an end-of-sequence token (included in the output)
  Length,     // max_tokens reached
  Context,    // the model's context is full
  Cancelled,  // cancelled by the caller (a client that went away)
  Error,      // a step failed; the event carries the message
};

// "eos", "length", "context", "cancelled", "error" (generate --json's stop_reason).
inline const char* to_string(FinishReason r) {
  switch (r) {
    case FinishReason::Eos: return "eos";
    case FinishReason::Length: return "length";
    case FinishReason::Context: return "context";
    case FinishReason::Cancelled: return "cancelled";
    case FinishReason::Error: return "error";
  }
  return "error";
}

}  // namespace dflash
