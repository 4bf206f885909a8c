#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "util/error.h"

namespace dflash {

void validate(const SamplingParams& p) {
  check(std::isfinite(p.temperature) && p.temperature >= 0 && p.temperature <= 100,
        "temperature must be in 0..100, got ", p.temperature);
  check(p.top_k >= 0, "top_k must be 0 (off) or positive, got ", p.top_k);
  check(std::isfinite(p.top_p) && p.top_p > 0 && p.top_p <= 1, "top_p must be in (0, 1], got ", p.top_p);
  check(std::isfinite(p.presence_penalty) && std::isfinite(p.frequency_penalty), "penalties must be finite");
  check(std::isfinite(p.repetition_penalty) && p.repetition_penalty > 0, "repetition_penalty must be positive, got ",
        p.repetition_penalty);
  check(p.min_tokens >= 0, "min_tokens must not be negative, got ", p.min_tokens);
  for (const auto& [id, bias] : p.logit_bias) check(std::isfinite(bias), "logit_bias of token ", id, " is not finite");
}

SamplingParams default_sampling(const GenerationConfig& g) {
  SamplingParams p;
  if (!g.do_sample.value_or(false)) return p;
  p.temperature = static_cast<float>(g.temperature.value_or(1.0));
  p.top_k = g.top_k.value_or(50);
  p.top_p = static_cast<float>(g.top_p.value_or(1.0));
  return p;
}

SpecSampling parse_spec_sampling(const std::string& s) {
  if (s == "match") return SpecSampling::Match;
  if (s == "rejection") return SpecSampling::Rejection;
  throw Error(cat("unknown speculative sampling scheme '", s, "' (match | rejection)"));
}

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Keeps the most probable tokens while the mass before each is below top_p
// (Hugging Face's TopPLogitsWarper; among equal probabilities the lower id
// first), zeroing the rest; the kept ones are renormalized to sum to 1. A
// selection by mass, expected O(n): the kept set is found without sorting.
void apply_top_p(std::vector<float>& probs, float top_p) {
  std::vector<int32_t> idx;  // positions in increasing id order
  idx.reserve(probs.size());
  for (size_t i = 0; i < probs.size(); ++i)
    if (probs[i] > 0) idx.push_back(static_cast<int32_t>(i));
  // idx[0, lo) is kept; idx[lo, hi) is undecided; the rest is dropped.
  size_t lo = 0, hi = idx.size();
  double before = 0;  // mass of idx[0, lo), always < top_p
  uint64_t state = 0x2545f4914f6cdd1dull;
  while (hi - lo > 1) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const float pivot = probs[idx[lo + (state >> 33) % (hi - lo)]];
    auto gt_end = std::partition(idx.begin() + lo, idx.begin() + hi, [&](int32_t i) { return probs[i] > pivot; });
    auto eq_end = std::partition(gt_end, idx.begin() + hi, [&](int32_t i) { return probs[i] == pivot; });
    double gt = 0, eq = 0;
    for (auto it = idx.begin() + lo; it != gt_end; ++it) gt += probs[*it];
    for (auto it = gt_end; it != eq_end; ++it) eq += probs[*it];
    const auto g = static_cast<size_t>(gt_end - idx.begin()), e = static_cast<size_t>(eq_end - idx.begin());
    if (before + gt >= top_p) {
      hi = g;  // the crossing token is among the larger ones
    } else if (before + gt + eq >= top_p) {
      // It is among the ties: take them by id while the mass before stays below top_p.
      before += gt;
      std::sort(idx.begin() + g, idx.begin() + e);
      lo = g;
      while (lo < e && before < top_p) before += probs[idx[lo++]];
      hi = lo;
    } else {
      before += gt + eq;
      lo = e;
    }
  }
  const size_t kept = hi;  // hi - lo <= 1 here: a last undecided token is kept (the mass before it is < top_p)
  std::vector<float> out(probs.size(), 0.0f);
  double total = 0;
  for (size_t k = 0; k < kept; ++k) total += probs[idx[k]];
  for (size_t k = 0; k < kept; ++k) out[idx[k]] = static_cast<float>(probs[idx[k]] / total);
  probs.swap(out);
}

}  // namespace

double uniform(uint64_t seed, int64_t position, int stream) {
  const uint64_t h = splitmix64(splitmix64(seed ^ 0x5851f42d4c957f2dull) ^ (static_cast<uint64_t>(position) * 4 +
                                                                            static_cast<uint64_t>(stream)));
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

float TokenDist::prob(int32_t id) const {
  const auto it = std::lower_bound(ids.begin(), ids.end(), id);
  return it != ids.end() && *it == id ? p[static_cast<size_t>(it - ids.begin())] : 0.0f;
}

TokenDist distribution(const TopCandidates& c, const SamplingParams& p) {
  check(!p.greedy(), "internal: distribution() of a greedy request");
  float mx = -INFINITY;
  for (float v : c.x) mx = std::max(mx, v);
  check(std::isfinite(mx), "the logits are not finite");
  TokenDist d{c.ids, std::vector<float>(c.x.size())};
  double total = 0;
  for (size_t i = 0; i < c.x.size(); ++i) total += d.p[i] = std::exp(c.x[i] - mx);
  for (float& v : d.p) v = static_cast<float>(v / total);
  if (p.top_p < 1) apply_top_p(d.p, p.top_p);
  return d;
}

int32_t sample(const TokenDist& d, double u) {
  double total = 0;
  for (float v : d.p) total += v;
  const double target = u * total;
  double cum = 0;
  int32_t last = 0;
  for (size_t i = 0; i < d.p.size(); ++i) {
    if (d.p[i] <= 0) continue;
    cum += d.p[i];
    last = d.ids[i];
    if (cum > target) return last;
  }
  return last;  // rounding left the target at the very end
}

Verdict verify_draft_token(const TokenDist& p, const TokenDist& q, int32_t d, double u_accept, double u_resample) {
  // Accept with probability min(1, p(d) / q(d)); q(d) > 0 because d was drawn from q.
  if (u_accept * q.prob(d) < p.prob(d)) return {true, d};
  // The residual max(0, p - q) over the union of both supports, in id order.
  TokenDist residual;
  double total = 0;
  size_t i = 0, j = 0;
  while (i < p.ids.size()) {
    if (j < q.ids.size() && q.ids[j] < p.ids[i]) {
      ++j;  // p is zero there: no residual mass
      continue;
    }
    const float qi = j < q.ids.size() && q.ids[j] == p.ids[i] ? q.p[j++] : 0.0f;
    const float r = std::max(0.0f, p.p[i] - qi);
    residual.ids.push_back(p.ids[i++]);
    residual.p.push_back(r);
    total += r;
  }
  // p == q up to rounding: a rejection has probability ~0; sample from p itself.
  return {false, sample(total > 0 ? residual : p, u_resample)};
}

}  // namespace dflash
