// DFlash token choice for a batch of blocks (docs/algorithm.md sections 3-5): the
// draft tokens from a draft forward's logits, then each block's acceptance and
// next pending token from the target forward that verified it. Greedy blocks
// compare argmaxes; sampled blocks use the match or the rejection scheme.
#pragma once

#include <cstdint>
#include <functional>
#include <unordered_set>
#include <vector>

#include "engine/sampling.h"

namespace dflash {

// A sequence's rows in a draft forward: rows [first_row, first_row + n) choose
// the tokens at positions position .. position + n - 1.
struct DraftRows {
  const SamplingParams* params;  // null: greedy
  int32_t first_row = 0, n = 0;
  int64_t position = 0;
};

struct DraftChoice {
  std::vector<int32_t> tokens;          // d_1..d_n
  std::vector<TokenDist> q;             // their draft distributions (rejection scheme only, else empty)
};

std::vector<DraftChoice> choose_draft_tokens(Backend& be, const Tensor& logits, const std::vector<DraftRows>& seqs,
                                             SpecSampling scheme);

// A sequence's rows in a verifying target forward: row first_row + i follows
// the pending token and drafted[0..i-1], so it chooses the token at position + i.
// With no drafted tokens it is a plain step (or the end of a prefill).
struct VerifyBlock {
  const SamplingParams* params;  // null: greedy
  int32_t first_row = 0;
  int64_t position = 0;
  const DraftChoice* draft = nullptr;  // null: nothing drafted
  // What its rows follow, for logits processing (params->processes_logits()) and log-probabilities:
  // the committed tokens (the first n_prompt the prompt), then the pending token (-1: none, the end
  // of a prefill), then the drafted tokens before each row. Such blocks are chosen on the host.
  const std::vector<int32_t>* history = nullptr;
  int32_t n_prompt = 0;
  int32_t pending = -1;
  const std::unordered_set<int32_t>* eos = nullptr;  // for min_tokens
  int logprobs = -1;  // >= 0: log-probabilities of the chosen tokens, with this many top entries
};

struct BlockResult {
  int accepted = 0;    // leading draft tokens committed
  int32_t next = -1;   // the new pending token
  std::vector<TokenLogprobs> logprobs;  // of d_1..d_accepted and next, when the block asks
};

// Backend::top_candidates of rows of logits that no one tensor holds (TargetModel::top_candidates:
// each tensor-parallel rank's part of the vocabulary).
using SplitCandidates = std::function<std::vector<TopCandidates>(
    const std::vector<int32_t>& rows, const std::vector<float>& temperature, const std::vector<int32_t>& top_k)>;

// `argmax`: the logits rows' argmax when the step computed it already (one per row), else null.
// `split`: where sampled rows' candidates come from when the step kept its logits in parts
// (`logits` then empty; blocks chosen on the host need whole logits).
std::vector<BlockResult> verify_blocks(Backend& be, const Tensor& logits, const std::vector<VerifyBlock>& blocks,
                                       SpecSampling scheme, const std::vector<int32_t>* argmax = nullptr,
                                       const SplitCandidates* split = nullptr);

}  // namespace dflash
