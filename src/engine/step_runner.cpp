#include "engine/step_runner.h"

#include <algorithm>
#include <functional>
#include <initializer_list>
#include <string>

#include "engine/verification.h"
#include "util/error.h"

namespace dflash {

StepRunner::StepRunner(ModelSet& m, bool speculative, SpecSampling scheme, int n_pages)
    : m_(m), spec_(speculative), scheme_(scheme), block_(speculative ? m.block_size : 1), graphs_(*m.be, 32) {
  check(!speculative || m.draft, "DFlash serving needs a draft model (--draft)");
  target_cache_ = m.target->alloc_cache(n_pages, m.page_size);
  if (spec_) draft_cache_ = m.draft->alloc_cache(n_pages, m.page_size);
}

namespace {

// Appends a generated token unless the sequence already finished; sets the finish reason.
void emit(SeqOutput& o, int32_t token) {
  if (!o.finish_reason.empty()) return;
  ServeSeq& s = *o.seq;
  o.tokens.push_back(token);
  ++s.n_generated;
  if (s.eos.count(token)) o.finish_reason = "stop";
  else if (s.n_generated >= s.max_tokens) o.finish_reason = "length";
}

}  // namespace

std::vector<SeqOutput> StepRunner::run(const StepPlan& plan, const Scheduler& sched, StepCounters& c) {
  const int page_size = m_.page_size;
  const int max_pos = m_.target->config().max_positions;
  std::vector<SeqOutput> outs;
  // A graph step keeps one shape: decodes only, whole blocks, and (DFlash) the draft context
  // of all rows projected inside the verification graph. At most kMaxGraphSequences: larger
  // batches change shape often (each a capture) and take longer to restage than to launch
  // (bench/results/graphs_h100.txt).
  constexpr size_t kMaxGraphSequences = 8;
  bool graphed = graphs_.on() && plan.prefills.empty() && !plan.decodes.empty() &&
                 plan.decodes.size() <= kMaxGraphSequences;
  const int64_t replays_before = graphs_.replays();
  for (const ServeSeq* s : plan.decodes)
    graphed = graphed && sched.rows_for(*s) == block_ && (!spec_ || s->n_draft_ctx == s->n_cached);
  auto run_forward = [&](const char* kind, std::initializer_list<ForwardBatch*> batches,
                         const std::function<void()>& body) {
    if (graphed) graphs_.run(StepGraphs::shape_key(kind, batches), body);
    else body();
  };
  // Greedy and match-scheme drafts are the draft's argmax: they stay on the device, and the
  // draft forward and the target forward run as one step (one graph when graphed).
  // Rejection-scheme drafts of sampled sequences are sampled on the host in between.
  bool draft_on_device = true;
  for (const ServeSeq* s : plan.decodes)
    draft_on_device = draft_on_device && (scheme_ == SpecSampling::Match || s->sampling.greedy());

  // 1. Draft blocks [t, M, ..., M] for the decoding sequences (DFlash only).
  std::vector<DraftChoice> drafted(plan.decodes.size());
  ForwardBatch db(page_size);
  std::vector<size_t> who;  // decoding sequences with a draft, in draft-row order
  std::vector<DraftRows> rows;
  if (spec_) {
    for (size_t i = 0; i < plan.decodes.size(); ++i) {
      const ServeSeq& s = *plan.decodes[i];
      const int B = sched.rows_for(s);
      if (B < 2) continue;
      std::vector<int32_t> block(static_cast<size_t>(B), m_.draft->config().mask_token_id);
      block[0] = s.pending;
      const int32_t first = db.add_sequence(block, s.n_cached, s.pages, /*causal=*/false);
      rows.push_back({&s.sampling, static_cast<int32_t>(db.logit_rows.size()), B - 1, s.n_cached + 1});
      for (int j = 1; j < B; ++j) db.logit_rows.push_back(first + j);
      who.push_back(i);
    }
    if (!who.empty() && !draft_on_device) {
      Tensor logits;
      run_forward("draft", {&db}, [&] { logits = m_.draft->forward_block(db, draft_cache_); });
      auto choices = choose_draft_tokens(*m_.be, logits, rows, scheme_);
      for (size_t k = 0; k < who.size(); ++k) drafted[who[k]] = std::move(choices[k]);
    }
  }

  // 2. One target forward: prefill chunks, then each decoding sequence's rows.
  // Each finished prefill and each decoding sequence is a block to verify (a prefill's has no draft).
  ForwardBatch tb(page_size);
  std::vector<int32_t> first_rows;
  std::vector<VerifyBlock> blocks;
  for (const auto& p : plan.prefills) {
    const ServeSeq& s = *p.seq;
    const std::vector<int32_t> chunk(s.tokens.begin() + s.n_cached, s.tokens.begin() + s.n_cached + p.n_tokens);
    const int32_t first = tb.add_sequence(chunk, s.n_cached, s.pages);
    first_rows.push_back(first);
    if (s.n_cached + p.n_tokens == static_cast<int32_t>(s.tokens.size())) {
      blocks.push_back({&s.sampling, static_cast<int32_t>(tb.logit_rows.size()), s.n_cached + p.n_tokens, nullptr});
      tb.logit_rows.push_back(first + p.n_tokens - 1);
    }
  }
  std::vector<int32_t> device_rows;  // target rows whose tokens are the draft's argmax, in draft-row order
  size_t next_drafted = 0;
  for (size_t i = 0; i < plan.decodes.size(); ++i) {
    const ServeSeq& s = *plan.decodes[i];
    const bool has_draft = next_drafted < who.size() && who[next_drafted] == i;
    const int n_drafted = has_draft ? rows[next_drafted++].n : 0;
    std::vector<int32_t> block{s.pending};
    if (!draft_on_device) block.insert(block.end(), drafted[i].tokens.begin(), drafted[i].tokens.end());
    else if (n_drafted > 0) block.resize(static_cast<size_t>(1 + n_drafted), m_.draft->config().mask_token_id);
    const int32_t first = tb.add_sequence(block, s.n_cached, s.pages);
    first_rows.push_back(first);
    if (draft_on_device)
      for (int j = 1; j <= n_drafted; ++j) device_rows.push_back(first + j);
    blocks.push_back({&s.sampling, static_cast<int32_t>(tb.logit_rows.size()), s.n_cached + 1, &drafted[i]});
    for (size_t j = 0; j < block.size(); ++j) tb.logit_rows.push_back(first + static_cast<int32_t>(j));
  }
  if (tb.n_rows() == 0) return outs;
  const std::vector<int> no_capture;
  ForwardBatch all_rows(page_size);  // graph steps: every decoding row's context, at n_cached..
  if (graphed && spec_)
    for (const ServeSeq* s : plan.decodes)
      all_rows.add_sequence(std::vector<int32_t>(static_cast<size_t>(block_), 0), s->n_cached, s->pages);
  // The step's token ids on the device: the drafted tokens (when drafted there), then the target's
  // argmax of its logits rows; one copy back for both.
  const int64_t n_device_drafts = draft_on_device ? static_cast<int64_t>(device_rows.size()) : 0;
  const auto n_logits = static_cast<int64_t>(tb.logit_rows.size());
  Tensor logits, captured, ids;
  auto body = [&] {
    ids = m_.be->alloc_ids(n_device_drafts + n_logits);
    if (n_device_drafts > 0) {
      Tensor d = ids.slice_rows(0, n_device_drafts);
      m_.be->argmax_ids(m_.draft->forward_block(db, draft_cache_), d);
      tb.from_device = {d, device_rows};
    }
    auto out = m_.target->forward(tb, target_cache_, spec_ ? m_.draft->config().target_layer_ids : no_capture);
    logits = out.logits;
    captured = out.captured;
    if (graphed && spec_) m_.draft->project_context(out.captured, all_rows, draft_cache_);
    Tensor a = ids.slice_rows(n_device_drafts, n_logits);
    m_.be->argmax_ids(logits, a);
  };
  if (n_device_drafts > 0) run_forward("dflash", {&db, &tb}, body);
  else run_forward(spec_ ? "verify" : "plain", {&tb}, body);
  const std::vector<int32_t> host_ids = m_.be->ids_to_host(ids);
  for (size_t k = 0; k < who.size() && n_device_drafts > 0; ++k) {
    const DraftRows& r = rows[k];
    drafted[who[k]].tokens.assign(host_ids.begin() + r.first_row, host_ids.begin() + r.first_row + r.n);
  }
  const std::vector<int32_t> argmax(host_ids.begin() + n_device_drafts, host_ids.end());
  const std::vector<BlockResult> results = verify_blocks(*m_.be, logits, blocks, scheme_, &argmax);

  // 3. Commit: prefill progress, acceptance per sequence; rows to project into the draft context.
  ForwardBatch pb(page_size);
  std::vector<int32_t> feature_rows;
  auto project = [&](ServeSeq& s, int32_t first_row, int32_t n) {
    if (!spec_) return;
    if (graphed) {  // projected in the graph already
      s.n_draft_ctx += n;
      return;
    }
    pb.add_sequence(std::vector<int32_t>(static_cast<size_t>(n), 0), s.n_draft_ctx, s.pages);
    for (int32_t r = 0; r < n; ++r) feature_rows.push_back(first_row + r);
    s.n_draft_ctx += n;
  };
  size_t next_block = 0, row_idx = 0;
  for (const auto& p : plan.prefills) {
    ServeSeq& s = *p.seq;
    project(s, first_rows[row_idx++], p.n_tokens);
    s.n_cached += p.n_tokens;
    c.prompt_tokens += p.n_tokens;
    if (s.n_cached < static_cast<int32_t>(s.tokens.size())) continue;
    SeqOutput o{&s, {}, {}};
    s.pending = results[next_block++].next;
    emit(o, s.pending);
    outs.push_back(std::move(o));
  }
  for (size_t i = 0; i < plan.decodes.size(); ++i) {
    ServeSeq& s = *plan.decodes[i];
    const auto& d = drafted[i].tokens;
    const int32_t s0 = s.n_cached;
    const BlockResult& r = results[next_block++];
    const int a = r.accepted;
    s.tokens.push_back(s.pending);
    s.tokens.insert(s.tokens.end(), d.begin(), d.begin() + a);
    s.n_cached = s0 + a + 1;
    project(s, first_rows[row_idx++], a + 1);
    SeqOutput o{&s, {}, {}};
    for (int j = 0; j < a; ++j) emit(o, d[j]);
    s.pending = r.next;
    emit(o, s.pending);
    if (spec_) {
      ++c.dflash_seq_steps;
      if (a < static_cast<int>(c.acceptance_histogram.size())) ++c.acceptance_histogram[a];
      for (int j = 0; j < a && j < static_cast<int>(c.position_accepted.size()); ++j) ++c.position_accepted[j];
    }
    outs.push_back(std::move(o));
  }
  if (spec_ && pb.n_rows() > 0) {
    Tensor features = m_.be->alloc(pb.n_rows(), captured.cols);
    m_.be->gather_rows(captured, feature_rows, features);
    m_.draft->project_context(features, pb, draft_cache_);
  }
  if (graphs_.replays() > replays_before) ++c.graph_steps;
  for (auto& o : outs) {
    c.generated_tokens += static_cast<int64_t>(o.tokens.size());
    if (o.finish_reason.empty() && o.seq->n_cached >= max_pos) o.finish_reason = "length";  // the context is full
  }
  return outs;
}

}  // namespace dflash
