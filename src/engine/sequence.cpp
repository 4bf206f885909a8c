#include "engine/sequence.h"

#include "engine/sampling.h"
#include "util/error.h"

namespace dflash {

void validate_request(const ModelConfig& c, const std::vector<int32_t>& prompt, int max_tokens,
                      const SamplingParams& sampling) {
  check(!prompt.empty(), "the prompt is empty");
  check(max_tokens > 0, "max_tokens must be positive, got ", max_tokens);
  validate(sampling);
  for (size_t i = 0; i < prompt.size(); ++i) {
    check(prompt[i] >= 0 && prompt[i] < c.n_vocab, "prompt token ", i, " (id ", prompt[i],
          ") is outside the vocabulary 0..", c.n_vocab - 1);
  }
  for (const auto& [id, bias] : sampling.logit_bias)
    check(id >= 0 && id < c.n_vocab, "logit_bias token ", id, " is outside the vocabulary 0..", c.n_vocab - 1);
  check(static_cast<int64_t>(prompt.size()) < c.max_positions, "the prompt has ", prompt.size(),
        " tokens; the model's context is ", c.max_positions);
}

}  // namespace dflash
