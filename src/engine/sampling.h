// Token choice from logits: greedy argmax, or a sample from the
// temperature / top-k / top-p distribution (applied in Hugging Face's order),
// and the two lossless speculative schemes of docs/algorithm.md section 5.
//
// Randomness is keyed by (seed, position, stream), not drawn from a running
// generator: the token at a position depends only on its distribution and the
// seed. So DFlash with the "match" scheme commits exactly the tokens plain
// sampling would, and a preempted and recomputed request continues identically.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "formats/model_config.h"
#include "kernels/backend.h"

namespace dflash {

// Throws Error naming the field when a value is out of range.
void validate(const SamplingParams& p);
// A model's default token choice, as Hugging Face's generate() takes it from
// generation_config.json: greedy unless do_sample, then temperature 1, top_k 50
// and top_p 1 where the file does not say otherwise.
SamplingParams default_sampling(const GenerationConfig& g);

SpecSampling parse_spec_sampling(const std::string& s);  // "match" | "rejection"

// Random streams per position.
enum RandomStream : int { kTargetSample = 0, kDraftSample = 1, kAcceptTest = 2, kResample = 3 };
// Uniform in [0, 1) from a counter-based hash of (seed, position, stream).
double uniform(uint64_t seed, int64_t position, int stream);

// A sampling distribution: probability p[i] for token ids[i] (increasing), zero for every other
// token (the candidates a top-k selection dropped).
struct TokenDist {
  std::vector<int32_t> ids;
  std::vector<float> p;
  float prob(int32_t id) const;  // 0 for a token that is not listed
};

// The sampling distribution of one logits row from its candidates (select_top_candidates or
// Backend::top_candidates with p's temperature and top_k): softmax over them, then top-p. It
// equals the dense computation over the whole row, since the dropped entries have probability
// zero there. Requires !p.greedy().
TokenDist distribution(const TopCandidates& c, const SamplingParams& p);
// Inverse-CDF sample in index order; u in [0, 1).
int32_t sample(const TokenDist& d, double u);

// One rejection-sampling verification of draft token d ~ q against the target's p.
struct Verdict {
  bool accepted;
  int32_t token;  // d when accepted, else the resampled token
};
Verdict verify_draft_token(const TokenDist& p, const TokenDist& q, int32_t d, double u_accept, double u_resample);

}  // namespace dflash
