#include "engine/verification.h"

#include <algorithm>

#include "engine/logits_processing.h"
#include "util/error.h"

namespace dflash {

namespace {

bool sampled(const SamplingParams* p) { return p && !p->greedy(); }

int n_drafted(const VerifyBlock& b) { return b.draft ? static_cast<int>(b.draft->tokens.size()) : 0; }

bool on_host(const VerifyBlock& b) {
  check(b.history || !(b.params && b.params->processes_logits()), "internal: logits processing without a history");
  return b.history && ((b.params && b.params->processes_logits()) || b.logprobs >= 0);
}

// One block chosen on the host: its rows copied back, each processed after the tokens before it,
// then the same choice as on the device path (argmax, the match scheme or rejection sampling).
BlockResult verify_on_host(Backend& be, const Tensor& logits, const VerifyBlock& b, SpecSampling scheme) {
  static const SamplingParams kGreedy;
  static const std::unordered_set<int32_t> kNoEos;
  const SamplingParams& sp = b.params ? *b.params : kGreedy;
  const int nd = n_drafted(b);
  const int64_t n = logits.cols;
  const std::vector<float> rows = be.to_host(logits.slice_rows(b.first_row, nd + 1));
  LogitsProcessor proc(sp, b.eos ? *b.eos : kNoEos, *b.history, b.n_prompt);
  if (b.pending >= 0) proc.push(b.pending);
  const bool rejection = scheme == SpecSampling::Rejection && nd > 0 && !sp.greedy();
  check(!rejection || b.draft->q.size() == static_cast<size_t>(nd), "internal: rejection sampling without draft distributions");
  std::vector<float> row(static_cast<size_t>(n));
  BlockResult r;
  for (;; ++r.accepted) {
    const int j = r.accepted;
    const float* raw = rows.data() + static_cast<int64_t>(j) * n;
    std::copy(raw, raw + n, row.begin());
    proc.apply(row.data(), n);
    const int64_t pos = b.position + j;
    int32_t g = 0;
    bool accepted = false;
    if (sp.greedy()) {
      g = argmax(row.data(), n);
      accepted = j < nd && b.draft->tokens[static_cast<size_t>(j)] == g;
    } else {
      const TokenDist p = distribution(select_top_candidates(row.data(), n, sp.temperature, sp.top_k), sp);
      if (rejection && j < nd) {
        const Verdict v = verify_draft_token(p, b.draft->q[static_cast<size_t>(j)], b.draft->tokens[static_cast<size_t>(j)],
                                             uniform(sp.seed, pos, kAcceptTest), uniform(sp.seed, pos, kResample));
        g = v.token;
        accepted = v.accepted;
      } else {
        g = sample(p, uniform(sp.seed, pos, kTargetSample));
        accepted = !rejection && j < nd && b.draft->tokens[static_cast<size_t>(j)] == g;
      }
    }
    if (b.logprobs >= 0) r.logprobs.push_back(logprobs_of(raw, n, g, b.logprobs));
    if (!accepted) {
      r.next = g;
      return r;
    }
    proc.push(g);
  }
}

// The candidates of the listed logits rows (top-k selected where the logits are, one call),
// with their distributions computed on demand.
class CandidateRows {
 public:
  CandidateRows(Backend& be, const Tensor& logits, const std::vector<int32_t>& rows,
                const std::vector<const SamplingParams*>& params, const SplitCandidates* split = nullptr) {
    std::vector<float> temperature;
    std::vector<int32_t> top_k;
    for (const SamplingParams* p : params) {
      temperature.push_back(p->temperature);
      top_k.push_back(p->top_k);
    }
    if (rows.empty()) return;
    rows_ = split ? (*split)(rows, temperature, top_k) : be.top_candidates(logits, rows, temperature, top_k);
  }
  // Distribution of the k-th listed row.
  TokenDist distribution(size_t k, const SamplingParams& p) const { return dflash::distribution(rows_[k], p); }

 private:
  std::vector<TopCandidates> rows_;
};

}  // namespace

std::vector<DraftChoice> choose_draft_tokens(Backend& be, const Tensor& logits, const std::vector<DraftRows>& seqs,
                                             SpecSampling scheme) {
  // Greedy and match-scheme rows take the draft's argmax; rejection-scheme rows sample from q.
  auto samples = [&](const DraftRows& s) { return scheme == SpecSampling::Rejection && sampled(s.params); };
  std::vector<int32_t> rows;
  std::vector<const SamplingParams*> params;
  bool need_argmax = false;
  for (const auto& s : seqs) {
    if (!samples(s)) need_argmax = true;
    else
      for (int j = 0; j < s.n; ++j) {
        rows.push_back(s.first_row + j);
        params.push_back(s.params);
      }
  }
  const std::vector<int32_t> argmax = need_argmax ? be.argmax_rows(logits) : std::vector<int32_t>{};
  const CandidateRows cands(be, logits, rows, params);
  std::vector<DraftChoice> out(seqs.size());
  size_t k = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const DraftRows& s = seqs[i];
    for (int j = 0; j < s.n; ++j) {
      if (!samples(s)) {
        out[i].tokens.push_back(argmax[static_cast<size_t>(s.first_row + j)]);
        continue;
      }
      TokenDist q = cands.distribution(k++, *s.params);
      out[i].tokens.push_back(sample(q, uniform(s.params->seed, s.position + j, kDraftSample)));
      out[i].q.push_back(std::move(q));
    }
  }
  return out;
}

std::vector<BlockResult> verify_blocks(Backend& be, const Tensor& logits, const std::vector<VerifyBlock>& blocks,
                                       SpecSampling scheme, const std::vector<int32_t>* known_argmax,
                                       const SplitCandidates* split) {
  std::vector<int32_t> rows;
  std::vector<const SamplingParams*> params;
  std::vector<size_t> first_cand(blocks.size(), 0);  // index of each sampled block's first row in `rows`
  bool need_argmax = false;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const VerifyBlock& b = blocks[i];
    if (on_host(b)) continue;
    if (!sampled(b.params)) {
      need_argmax = true;
      continue;
    }
    first_cand[i] = rows.size();
    for (int j = 0; j <= n_drafted(b); ++j) {
      rows.push_back(b.first_row + j);
      params.push_back(b.params);
    }
  }
  // A step whose every block takes the argmax may come without logits (StepRunner: argmax_only),
  // and one with its logits in parts (split) takes the sampled rows' candidates from them.
  bool need_logits = (!rows.empty() && !split) || (need_argmax && !known_argmax);
  for (const VerifyBlock& b : blocks) need_logits = need_logits || on_host(b);
  check(!need_logits || !logits.empty(), "internal: the step's choices need logits, and it has none");
  check(!known_argmax || logits.empty() || static_cast<int64_t>(known_argmax->size()) == logits.rows,
        "internal: the step's argmax has ", known_argmax ? known_argmax->size() : 0, " rows, its logits ", logits.rows);
  const std::vector<int32_t> argmax =
      known_argmax ? *known_argmax : need_argmax ? be.argmax_rows(logits) : std::vector<int32_t>{};
  const CandidateRows cands(be, logits, rows, params, split);

  std::vector<BlockResult> out(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    const VerifyBlock& b = blocks[i];
    if (on_host(b)) {
      out[i] = verify_on_host(be, logits, b, scheme);
      continue;
    }
    const int nd = n_drafted(b);
    const int32_t* d = nd ? b.draft->tokens.data() : nullptr;
    BlockResult& r = out[i];
    if (!sampled(b.params)) {
      // Greedy: accept while the draft token is the target's argmax.
      const int32_t* g = &argmax[static_cast<size_t>(b.first_row)];
      while (r.accepted < nd && d[r.accepted] == g[r.accepted]) ++r.accepted;
      r.next = g[r.accepted];
      continue;
    }
    const SamplingParams& sp = *b.params;
    auto p = [&](int j) { return cands.distribution(first_cand[i] + static_cast<size_t>(j), sp); };
    if (scheme == SpecSampling::Rejection && nd > 0) {
      check(b.draft->q.size() == static_cast<size_t>(nd), "internal: rejection sampling without draft distributions");
      for (; r.accepted < nd; ++r.accepted) {
        const int64_t pos = b.position + r.accepted;
        const Verdict v = verify_draft_token(p(r.accepted), b.draft->q[static_cast<size_t>(r.accepted)],
                                             d[r.accepted], uniform(sp.seed, pos, kAcceptTest),
                                             uniform(sp.seed, pos, kResample));
        if (!v.accepted) {
          r.next = v.token;
          break;
        }
      }
      if (r.accepted == nd) r.next = sample(p(nd), uniform(sp.seed, b.position + nd, kTargetSample));
      continue;
    }
    // Match: the target samples each position as plain decoding would; accept while the draft agrees.
    for (;; ++r.accepted) {
      const int32_t g = sample(p(r.accepted), uniform(sp.seed, b.position + r.accepted, kTargetSample));
      if (r.accepted < nd && d[r.accepted] == g) continue;
      r.next = g;
      break;
    }
  }
  return out;
}

}  // namespace dflash
