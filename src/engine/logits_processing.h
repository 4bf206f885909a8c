// Logits rows on the host: the request's logits processing (logit_bias,
// min_tokens, repetition / frequency / presence penalties), token choice from
// a processed row, and log-probabilities (docs/algorithm.md section 5).
//
// A row is processed from the tokens it follows (prompt and output so far), so
// the same row gives the same processed row in plain decoding, in a DFlash
// block (after the pending and the drafted tokens before it) and after a
// preemption: DFlash output with processing equals plain output.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "engine/engine.h"

namespace dflash {

// Processes rows in vLLM's order: logit_bias added; while fewer than min_tokens tokens are
// generated, EOS ids set to -inf; repetition_penalty on tokens of the prompt or the output (a
// positive logit divided by it, a negative one multiplied); then each output token's logit lowered
// by frequency_penalty per occurrence and presence_penalty once.
class LogitsProcessor {
 public:
  // tokens: the committed tokens, the first n_prompt of them the prompt.
  LogitsProcessor(const SamplingParams& p, const std::unordered_set<int32_t>& eos, std::span<const int32_t> tokens,
                  int32_t n_prompt);
  void push(int32_t token);  // a further output token (the pending token, a drafted token)
  void apply(float* row, int64_t n_vocab) const;

 private:
  const SamplingParams& p_;
  const std::unordered_set<int32_t>& eos_;
  std::unordered_set<int32_t> prompt_;        // repetition penalty only
  std::unordered_map<int32_t, int> output_;   // output token -> occurrences
  int n_output_ = 0;
};

// Lowest id among the largest values.
int32_t argmax(const float* row, int64_t n);
// Log-softmax of the row at `token`, and its `top_n` largest entries (larger first, lower id on ties).
TokenLogprobs logprobs_of(const float* row, int64_t n, int32_t token, int top_n);

}  // namespace dflash
