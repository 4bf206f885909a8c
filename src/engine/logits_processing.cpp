#include "engine/logits_processing.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace dflash {

LogitsProcessor::LogitsProcessor(const SamplingParams& p, const std::unordered_set<int32_t>& eos,
                                 std::span<const int32_t> tokens, int32_t n_prompt)
    : p_(p), eos_(eos) {
  const auto np = std::min(static_cast<size_t>(std::max(n_prompt, 0)), tokens.size());
  if (p.repetition_penalty != 1) prompt_.insert(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(np));
  for (size_t i = np; i < tokens.size(); ++i) push(tokens[i]);
}

void LogitsProcessor::push(int32_t token) {
  ++output_[token];
  ++n_output_;
}

void LogitsProcessor::apply(float* row, int64_t n) const {
  auto in = [n](int32_t id) { return id >= 0 && id < n; };
  for (const auto& [id, bias] : p_.logit_bias)
    if (in(id)) row[id] += bias;
  if (n_output_ < p_.min_tokens)
    for (int32_t id : eos_)
      if (in(id)) row[id] = -std::numeric_limits<float>::infinity();
  if (p_.repetition_penalty != 1) {
    auto penalize = [&](int32_t id) {
      if (in(id)) row[id] = row[id] > 0 ? row[id] / p_.repetition_penalty : row[id] * p_.repetition_penalty;
    };
    for (int32_t id : prompt_) penalize(id);
    for (const auto& [id, count] : output_)
      if (!prompt_.count(id)) penalize(id);
  }
  if (p_.frequency_penalty != 0 || p_.presence_penalty != 0)
    for (const auto& [id, count] : output_)
      if (in(id)) row[id] -= p_.frequency_penalty * static_cast<float>(count) + p_.presence_penalty;
}

int32_t argmax(const float* row, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (row[i] > row[best]) best = i;
  return static_cast<int32_t>(best);
}

TokenLogprobs logprobs_of(const float* row, int64_t n, int32_t token, int top_n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, row[i]);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(row[i]) - mx);
  const double lse = mx + std::log(sum);
  auto lp = [&](int64_t i) { return static_cast<float>(row[i] - lse); };
  TokenLogprobs out;
  out.logprob = lp(token);
  if (top_n <= 0) return out;
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  const auto k = static_cast<std::ptrdiff_t>(std::min<int64_t>(top_n, n));
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                    [&](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
  for (std::ptrdiff_t i = 0; i < k; ++i) out.top.emplace_back(ids[static_cast<size_t>(i)], lp(ids[static_cast<size_t>(i)]));
  return out;
}

}  // namespace dflash
