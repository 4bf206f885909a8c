#include "engine/step_runner.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "util/error.h"

namespace dflash {

namespace {

std::vector<int32_t> zeros(int32_t n) { return std::vector<int32_t>(static_cast<size_t>(n), 0); }

// Whether a prompt's chunk is its last, whose final row chooses the first token.
bool chooses_token(const StepPlan::Prefill& p) {
  return p.seq->n_cached + p.n_tokens == static_cast<int32_t>(p.seq->tokens.size());
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

StepRunner::StepRunner(ModelSet& m, StepCaches& caches, bool speculative, SpecSampling scheme, bool graphs)
    : m_(m),
      caches_(caches),
      spec_(speculative),
      scheme_(scheme),
      block_(speculative ? m.block_size : 1),
      graphs_(*m.be, graphs, 32) {
  check(!speculative || m.draft, "DFlash decoding needs a draft model (--draft)");
}

Step StepRunner::prepare(const StepPlan& plan, bool force_fixed_shape) const {
  Step st(m_.page_size);
  const int32_t mask = spec_ ? m_.draft->config().mask_token_id : 0;
  // Greedy and match-scheme drafts are the draft's argmax: they stay on the device, and the draft
  // forward and the target forward run as one (one graph when fixed-shape). Rejection-scheme
  // drafts of sampled sequences are sampled on the host in between.
  for (const auto& d : plan.decodes)
    st.draft_on_device = st.draft_on_device && (scheme_ == SpecSampling::Match || d.seq->sampling.greedy());
  // What the step's sequences ask of its logits: whole rows (logits processing and
  // log-probabilities are on the host), the argmax alone, or top-k candidates.
  st.argmax_only = true;
  st.logit_parts = m_.target->splits_vocabulary();
  auto take = [&](const Sequence& s) {
    const bool on_device = !s.sampling.processes_logits() && s.logprobs < 0;
    st.argmax_only = st.argmax_only && on_device && s.sampling.greedy();
    st.logit_parts = st.logit_parts && on_device;
    st.parts_argmax = st.parts_argmax || s.sampling.greedy();
  };
  for (const auto& d : plan.decodes) take(*d.seq);
  for (const auto& p : plan.prefills)  // a prompt's chunk that chooses no token asks nothing of the logits
    if (chooses_token(p)) take(*p.seq);
  st.logit_parts = st.logit_parts && !st.argmax_only;
  bool whole_blocks = plan.prefills.empty() && !plan.decodes.empty();
  for (const auto& d : plan.decodes)
    whole_blocks = whole_blocks && d.n_rows == block_ && (!spec_ || d.seq->n_draft_ctx == d.seq->n_cached);
  check(!force_fixed_shape || whole_blocks, "internal: the step cannot take a fixed shape");
  // Larger batches change shape often (each a capture) and take longer to restage than to
  // launch (bench/results/graphs_h100.txt).
  st.fixed_shape = force_fixed_shape || (whole_blocks && plan.decodes.size() <= kMaxGraphSequences && graphs_.on());

  // One record per sequence, in target-row order: prefill chunks, then decodes.
  for (const auto& p : plan.prefills) {
    SeqStep r;
    r.seq = p.seq;
    r.prefill = true;
    r.n_rows = p.n_tokens;
    r.chooses = chooses_token(p);
    st.seqs.push_back(std::move(r));
  }
  for (const auto& d : plan.decodes) {
    SeqStep r;
    r.seq = d.seq;
    r.n_rows = d.n_rows;
    r.chooses = true;
    r.n_drafted = spec_ ? d.n_rows - 1 : 0;
    st.seqs.push_back(std::move(r));
  }

  ForwardBatch& db = st.draft_batch;
  ForwardBatch& tb = st.target_batch;
  for (SeqStep& r : st.seqs) {
    const Sequence& s = *r.seq;
    std::vector<int32_t> rows;
    if (r.prefill) {
      rows.assign(s.tokens.begin() + s.n_cached, s.tokens.begin() + s.n_cached + r.n_rows);
    } else {
      // [t, M, ..., M]: the draft's block; the target's until the drafted tokens replace the masks
      // (on the device, or in execute for drafts sampled on the host).
      rows.assign(static_cast<size_t>(r.n_rows), mask);
      rows[0] = s.pending;
    }
    if (r.n_drafted > 0) {
      const int32_t first = db.add_sequence(rows, s.n_cached, s.pages, /*causal=*/false);
      r.first_draft_logit = static_cast<int32_t>(db.logit_rows.size());
      for (int32_t j = 1; j < r.n_rows; ++j) db.logit_rows.push_back(first + j);
    }
    // Hybrid targets: a verification block stays on the tape until its accepted rows are known.
    r.first_row = tb.add_sequence(rows, s.n_cached, s.pages, true, {s.state_slot, s.state_replay, r.n_drafted == 0});
    r.first_logit = static_cast<int32_t>(tb.logit_rows.size());
    if (r.prefill) {
      if (r.chooses) tb.logit_rows.push_back(r.first_row + r.n_rows - 1);
      continue;
    }
    for (int32_t j = 0; j < r.n_rows; ++j) tb.logit_rows.push_back(r.first_row + j);
    for (int32_t j = 1; j <= r.n_drafted; ++j) st.device_rows.push_back(r.first_row + j);
    if (st.fixed_shape && spec_) st.project_batch.add_sequence(zeros(block_), s.n_cached, s.pages);
  }
  // Greedy rows among few would take their argmax from an exchange after the lm_head product,
  // which costs more than the logits gathered while it runs.
  st.logit_parts = st.logit_parts && (tb.logit_rows.size() > TargetModel::kGatheredMaxRows || !st.parts_argmax);
  st.parts_argmax = st.parts_argmax && st.logit_parts;
  return st;
}

void StepRunner::forward(Step& st) {
  const int64_t n_drafts = st.n_device_drafts();
  const auto n_logits = static_cast<int64_t>(st.target_batch.logit_rows.size());
  st.ids = m_.be->alloc_ids(n_drafts + n_logits);
  if (n_drafts > 0) {
    Tensor drafted = st.ids.slice_rows(0, n_drafts);
    m_.draft->forward_block_argmax(st.draft_batch, caches_.draft, drafted);
    st.target_batch.from_device = {drafted, st.device_rows};
  }
  static const std::vector<int> no_capture;
  Tensor argmax = st.ids.slice_rows(n_drafts, n_logits);
  auto out = m_.target->forward(st.target_batch, caches_.target, spec_ ? m_.draft->config().target_layer_ids : no_capture,
                                st.argmax_only || st.parts_argmax ? &argmax : nullptr, st.logit_parts);
  st.logits = out.logits;
  st.captured = out.captured;
  if (st.fixed_shape && spec_) m_.draft->project_context(out.captured, nullptr, st.project_batch, caches_.draft);
  if (!st.argmax_only && !st.logit_parts) m_.be->argmax_ids(st.logits, argmax);
}

void StepRunner::draft_apart(Step& st) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<DraftRows> rows;
  std::vector<SeqStep*> drafting;
  for (SeqStep& r : st.seqs) {
    if (r.n_drafted == 0) continue;
    rows.push_back({&r.seq->sampling, r.first_draft_logit, r.n_drafted, r.seq->n_cached + 1});
    drafting.push_back(&r);
  }
  if (drafting.empty()) return;
  Tensor logits;
  auto body = [&] { logits = m_.draft->forward_block(st.draft_batch, caches_.draft); };
  if (st.fixed_shape) graphs_.run(StepGraphs::shape_key("draft", {&st.draft_batch}), body);
  else body();
  auto choices = choose_draft_tokens(*m_.be, logits, rows, scheme_);
  for (size_t k = 0; k < drafting.size(); ++k) {
    SeqStep& r = *drafting[k];
    r.draft = std::move(choices[k]);
    std::copy(r.draft.tokens.begin(), r.draft.tokens.end(), st.target_batch.token_ids.begin() + r.first_row + 1);
  }
  st.draft_ms = ms_since(t0);
}

void StepRunner::execute(Step& st) {
  if (!st.draft_on_device) draft_apart(st);
  auto body = [&] { forward(st); };
  if (!st.fixed_shape) {
    body();
  } else {
    const int64_t replays = graphs_.replays();
    // The forwards with logits, with the argmax alone and with logits in parts are different graphs.
    const std::string kind = std::string(st.n_device_drafts() > 0 ? "dflash" : spec_ ? "verify" : "plain") +
                             (st.logit_parts ? "-parts" : "") + (st.argmax_only || st.parts_argmax ? "-argmax" : "");
    if (st.n_device_drafts() > 0) graphs_.run(StepGraphs::shape_key(kind.c_str(), {&st.draft_batch, &st.target_batch}), body);
    else graphs_.run(StepGraphs::shape_key(kind.c_str(), {&st.target_batch}), body);
    st.replayed = graphs_.replays() > replays;
  }
  st.host_ids = m_.be->ids_to_host(st.ids);
}

void StepRunner::emit(SeqStep& r, int32_t token, const TokenLogprobs* lp) const {
  if (r.finish) return;
  Sequence& s = *r.seq;
  r.tokens.push_back(token);
  if (lp) r.logprobs.push_back(*lp);
  ++s.n_generated;
  if (s.eos.count(token)) r.finish = FinishReason::Eos;
  else if (s.n_generated >= s.max_tokens) r.finish = FinishReason::Length;
}

void StepRunner::postprocess(Step& st, StepCounters& c) {
  const int64_t n_drafts = st.n_device_drafts();
  for (SeqStep& r : st.seqs) {
    if (n_drafts == 0 || r.n_drafted == 0) continue;
    const auto first = st.host_ids.begin() + r.first_draft_logit;
    r.draft.tokens.assign(first, first + r.n_drafted);
  }
  const std::vector<int32_t> argmax(st.host_ids.begin() + n_drafts, st.host_ids.end());
  std::vector<VerifyBlock> blocks;
  for (const SeqStep& r : st.seqs) {
    if (!r.chooses) continue;
    const Sequence& s = *r.seq;
    const int64_t position = r.prefill ? s.n_cached + r.n_rows : s.n_cached + 1;
    blocks.push_back({&s.sampling, r.first_logit, position, r.n_drafted > 0 ? &r.draft : nullptr, &s.tokens, s.n_prompt,
                      r.prefill ? -1 : s.pending, &s.eos, s.logprobs});
  }
  const SplitCandidates from_parts = [&](const std::vector<int32_t>& rows, const std::vector<float>& temperature,
                                        const std::vector<int32_t>& top_k) {
    return m_.target->top_candidates(rows, temperature, top_k);
  };
  // A step in parts without greedy rows computed no argmax.
  const bool argmax_known = !st.logit_parts || st.parts_argmax;
  const std::vector<BlockResult> results = verify_blocks(*m_.be, st.logits, blocks, scheme_,
                                                         argmax_known ? &argmax : nullptr,
                                                         st.logit_parts ? &from_parts : nullptr);

  // Commit. The draft context of the committed rows: projected in the forward already
  // (fixed-shape), else gathered from the captured features and projected here.
  ForwardBatch pb(m_.page_size);
  std::vector<int32_t> feature_rows;
  auto project = [&](Sequence& s, int32_t first_row, int32_t n) {
    if (!spec_) return;
    if (!st.fixed_shape) {
      pb.add_sequence(zeros(n), s.n_draft_ctx, s.pages);
      for (int32_t j = 0; j < n; ++j) feature_rows.push_back(first_row + j);
    }
    s.n_draft_ctx += n;
  };
  const int max_pos = m_.target->config().max_positions;
  size_t next_block = 0;
  for (SeqStep& r : st.seqs) {
    Sequence& s = *r.seq;
    s.state_replay = 0;  // folded in by this step's forward
    if (r.prefill) {
      project(s, r.first_row, r.n_rows);
      s.n_cached += r.n_rows;
      c.prompt_tokens += r.n_rows;
      if (!r.chooses) continue;
      const BlockResult& v = results[next_block++];
      s.pending = v.next;
      emit(r, s.pending, v.logprobs.empty() ? nullptr : &v.logprobs[0]);
    } else {
      // Commit t, d_1..d_a; the rows beyond a are dropped by not counting them.
      const BlockResult& v = results[next_block++];
      const int a = v.accepted;
      const auto& d = r.draft.tokens;
      s.tokens.push_back(s.pending);
      s.tokens.insert(s.tokens.end(), d.begin(), d.begin() + a);
      s.n_cached += a + 1;
      if (r.n_drafted > 0) s.state_replay = a + 1;  // t, d_1..d_a of the tape
      project(s, r.first_row, a + 1);
      auto lp = [&](int j) { return v.logprobs.empty() ? nullptr : &v.logprobs[static_cast<size_t>(j)]; };
      for (int j = 0; j < a; ++j) emit(r, d[static_cast<size_t>(j)], lp(j));
      s.pending = v.next;
      emit(r, s.pending, lp(a));
      if (spec_) {
        ++c.dflash_seq_steps;
        if (a < static_cast<int>(c.acceptance_histogram.size())) ++c.acceptance_histogram[a];
        for (int j = 0; j < a && j < static_cast<int>(c.position_accepted.size()); ++j) ++c.position_accepted[j];
      }
    }
    if (!r.finish && s.n_cached >= max_pos) r.finish = FinishReason::Context;
    c.generated_tokens += static_cast<int64_t>(r.tokens.size());
  }
  if (pb.n_rows() > 0) m_.draft->project_context(st.captured, &feature_rows, pb, caches_.draft);
  c.graph_replayed = c.graph_replayed || st.replayed;
}

}  // namespace dflash
