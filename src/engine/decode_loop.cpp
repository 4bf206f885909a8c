#include "engine/decode_loop.h"

#include <chrono>

#include "util/error.h"

namespace dflash {

namespace {

StepCaches alloc_caches(ModelSet& m, const LoopOptions& o) {
  check(o.n_pages > 0, "the KV cache needs at least one page");
  StepCaches c;
  // Hybrid targets: a state slot per running sequence and per snapshot, tapes as long as a
  // verification block.
  c.target = m.target->alloc_cache(o.n_pages, m.page_size, o.max_num_seqs + o.state_snapshots,
                                   o.speculative ? m.block_size : 1);
  if (o.speculative) c.draft = m.draft->alloc_cache(o.n_pages, m.page_size);
  return c;
}

}  // namespace

DecodeLoop::DecodeLoop(ModelSet& m, const LoopOptions& o)
    : m_(m),
      caches_((check(!o.speculative || m.draft, "DFlash decoding needs a draft model (--draft)"), alloc_caches(m, o))),
      sched_(o.n_pages, m.page_size, o.speculative, o.speculative ? m.block_size : 1, o.max_num_seqs,
             o.max_tokens_per_step, m.target->config().max_positions, m.target->is_hybrid(), o.state_snapshots),
      runner_(m, caches_, o.speculative, o.spec_sampling, o.graphs) {
  stats_.acceptance_histogram.assign(runner_.block(), 0);
  stats_.position_accepted.assign(std::max(runner_.block() - 1, 0), 0);
}

void DecodeLoop::reset_stats() {
  LoopStats fresh;
  fresh.acceptance_histogram.assign(stats_.acceptance_histogram.size(), 0);
  fresh.position_accepted.assign(stats_.position_accepted.size(), 0);
  stats_ = std::move(fresh);
}

int64_t DecodeLoop::kv_cache_bytes() const {
  int64_t n = 0;
  for (const KvCache* c : {&caches_.target, &caches_.draft}) {
    for (const auto& t : c->k) n += tensor_bytes(t);
    for (const auto& t : c->v) n += tensor_bytes(t);
    for (const auto* ts : {&c->recurrent.conv, &c->recurrent.state, &c->recurrent.tape})
      for (const auto& t : *ts) n += tensor_bytes(t);
  }
  return n;
}

void DecodeLoop::add(std::unique_ptr<Sequence> s) { sched_.add(std::move(s)); }

void DecodeLoop::finish(std::vector<Ended>& ended) {
  if (ended.empty()) return;
  stats_.n_finished += static_cast<int64_t>(ended.size());
  if (on_pages_freed) on_pages_freed();
  for (auto& e : ended) {
    TokenEvent ev;
    ev.tokens = std::move(e.tokens);
    ev.logprobs = std::move(e.logprobs);
    ev.finished = true;
    ev.finish_reason = e.reason;
    ev.error = std::move(e.error);
    ev.n_prompt_tokens = e.seq->n_prompt;
    e.seq->on_event(ev);
  }
  ended.clear();
}

bool DecodeLoop::cancel(uint64_t id) {
  auto s = sched_.remove(id);
  if (!s) return false;
  std::vector<Ended> ended;
  ended.push_back({std::move(s), FinishReason::Cancelled, {}, {}, {}});
  finish(ended);
  return true;
}

void DecodeLoop::cancel_all() {
  std::vector<Ended> ended;
  for (Sequence* s : sched_.all()) ended.push_back({sched_.remove(s->id), FinishReason::Cancelled, {}, {}, {}});
  finish(ended);
}

bool DecodeLoop::step() {
  const StepPlan plan = sched_.schedule();
  for (const auto& c : plan.state_copies) m_.target->copy_state_slot(caches_.target, c.from, c.to);
  if (plan.empty()) return false;
  const auto t0 = std::chrono::steady_clock::now();
  StepCounters c;
  c.acceptance_histogram.assign(stats_.acceptance_histogram.size(), 0);
  c.position_accepted.assign(stats_.position_accepted.size(), 0);
  std::vector<Ended> ended;
  Step st(m_.page_size);
  try {
    st = runner_.prepare(plan);
    runner_.execute(st);
    runner_.postprocess(st, c);
  } catch (const std::exception& e) {
    // A failed step ends the sequences that were in it, each with the error; the others go on.
    std::vector<Sequence*> in_step;
    for (const auto& p : plan.prefills) in_step.push_back(p.seq);
    for (const auto& d : plan.decodes) in_step.push_back(d.seq);
    for (Sequence* s : in_step)
      if (auto owned = sched_.remove(s->id)) ended.push_back({std::move(owned), FinishReason::Error, {}, e.what(), {}});
    finish(ended);
    return true;
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ++stats_.n_steps;
  if (plan.prefills.empty()) {
    stats_.decode_ms += ms;
    stats_.draft_ms += st.draft_ms;
    ++stats_.decode_steps;
  } else {
    stats_.prefill_ms += ms;
  }
  stats_.prompt_tokens += c.prompt_tokens;
  stats_.generated_tokens += c.generated_tokens;
  stats_.dflash_seq_steps += c.dflash_seq_steps;
  stats_.graph_steps += c.graph_replayed;
  for (size_t i = 0; i < c.acceptance_histogram.size(); ++i) stats_.acceptance_histogram[i] += c.acceptance_histogram[i];
  for (size_t i = 0; i < c.position_accepted.size(); ++i) stats_.position_accepted[i] += c.position_accepted[i];

  for (SeqStep& r : st.seqs) {
    if (r.finish) {
      const FinishReason why = *r.finish;
      ended.push_back({sched_.remove(r.seq->id), why, std::move(r.tokens), {}, std::move(r.logprobs)});
    } else if (!r.tokens.empty()) {
      TokenEvent e;
      e.tokens = std::move(r.tokens);
      e.logprobs = std::move(r.logprobs);
      e.n_prompt_tokens = r.seq->n_prompt;
      r.seq->on_event(e);
    }
  }
  finish(ended);
  return true;
}

}  // namespace dflash
