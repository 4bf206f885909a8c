#include "engine/scheduler.h"

#include <algorithm>

#include "util/error.h"

namespace dflash {

Scheduler::Scheduler(int n_pages, int page_size, bool with_draft, int block, int max_num_seqs, int max_tokens_per_step,
                     int max_positions, bool recurrent, int state_snapshots)
    : pool_(n_pages, page_size, recurrent ? state_snapshots : 0),
      with_draft_(with_draft),
      block_(block),
      max_num_seqs_(max_num_seqs),
      max_tokens_per_step_(max_tokens_per_step),
      max_positions_(max_positions),
      recurrent_(recurrent),
      snapshots_(recurrent && state_snapshots > 0) {
  if (recurrent_)
    for (int32_t slot = max_num_seqs - 1; slot >= 0; --slot) free_slots_.push_back(slot);
  check(max_num_seqs >= 1, "max_num_seqs must be at least 1");
  check(max_tokens_per_step >= block, "max_tokens_per_step (", max_tokens_per_step, ") must be at least the block size (",
        block, ")");
}

int Scheduler::pages_for(int64_t n_positions) const {
  return static_cast<int>((n_positions + pool_.page_size() - 1) / pool_.page_size());
}

int Scheduler::rows_for(const Sequence& s) const { return std::max(1, std::min(block_, max_positions_ - s.n_cached)); }

bool Scheduler::reserve(Sequence& s, int64_t n_positions) { return pool_.reserve(s.pages, n_positions); }

void Scheduler::release(Sequence& s) {
  pool_.release(s.pages);
  s.n_registered = 0;
  s.chain = 0;
  if (s.state_slot >= 0) free_slots_.push_back(s.state_slot);
  s.state_slot = -1;
  s.state_replay = 0;
  pool_.release_snapshot(&s.snapshot);
}

bool Scheduler::admit(Sequence& s, StepPlan& plan) {
  int32_t snapshot = -1;
  const int32_t covered = !recurrent_  ? pool_.match_prefix(s.tokens, s.pages)
                          : snapshots_ ? pool_.match_prefix(s.tokens, s.pages, &snapshot)
                                       : 0;
  if (!reserve(s, std::min<int64_t>(static_cast<int64_t>(s.tokens.size()) + block_, max_positions_))) {
    pool_.release(s.pages);
    return false;
  }
  s.n_cached = s.n_draft_ctx = covered;
  if (recurrent_) {
    check(!free_slots_.empty(), "internal: no free state slot for a running sequence");
    s.state_slot = free_slots_.back();
    free_slots_.pop_back();
    s.state_replay = 0;
    if (snapshot >= 0) plan.state_copies.push_back({max_num_seqs_ + snapshot, s.state_slot});
  }
  return true;
}

void Scheduler::preempt(Sequence& s) {
  release(s);
  if (s.pending >= 0) s.tokens.push_back(s.pending);  // sent already; recomputed with the rest
  s.pending = -1;
  s.n_cached = s.n_draft_ctx = 0;
  ++n_preempted_;
  auto it = std::find_if(running_.begin(), running_.end(), [&](const auto& p) { return p.get() == &s; });
  waiting_.push_front(std::move(*it));
  running_.erase(it);
}

void Scheduler::add(std::unique_ptr<Sequence> seq) { waiting_.push_back(std::move(seq)); }

StepPlan Scheduler::schedule() {
  StepPlan plan;
  // Pages completed by the last step join the prefix cache (with a draft, once its context covers
  // them too); a hybrid target's state is kept when the committed tokens end at such a page (a
  // pending replay means the state lags behind them).
  for (auto& s : running_) {
    if (recurrent_ && !snapshots_) break;
    const int32_t committed = with_draft_ ? std::min(s->n_cached, s->n_draft_ctx) : s->n_cached;
    pool_.register_full_pages(s->tokens, committed, s->pages, &s->n_registered, &s->chain);
    if (!snapshots_ || s->state_replay != 0 || committed != s->n_cached || s->n_cached == 0 ||
        int64_t{s->n_registered} * pool_.page_size() != s->n_cached)
      continue;
    const int32_t i = pool_.claim_snapshot(s->chain, &s->snapshot);
    if (i < 0) continue;
    plan.state_copies.push_back({s->state_slot, max_num_seqs_ + i});
    ++n_snapshots_taken_;
  }
  // Decoding sequences need room for this step's rows; the most recently admitted
  // sequence gives its pages back until they fit (it may be the one asking).
  for (size_t i = 0; i < running_.size();) {
    Sequence& s = *running_[i];
    if (s.prefilling() || reserve(s, int64_t{s.n_cached} + rows_for(s))) {
      ++i;
      continue;
    }
    auto newest = std::max_element(running_.begin(), running_.end(),
                                   [](const auto& a, const auto& b) { return a->admit_order < b->admit_order; });
    preempt(**newest);
  }
  int budget = max_tokens_per_step_;
  for (auto& s : running_) {
    if (s->prefilling()) continue;
    plan.decodes.push_back({s.get(), rows_for(*s)});
    budget -= rows_for(*s);
  }
  // Prefill: sequences already admitted first, then new ones in arrival order.
  auto add_prefill = [&](Sequence& s) {
    int32_t n = std::min<int32_t>(static_cast<int32_t>(s.tokens.size()) - s.n_cached, budget);
    // With state snapshots a chunk ends at a page end when it can, so that the state there is kept;
    // the rest of the page comes next step.
    const int32_t end = s.n_cached + n, page_end = end / pool_.page_size() * pool_.page_size();
    if (snapshots_ && page_end > s.n_cached) n = page_end - s.n_cached;
    plan.prefills.push_back({&s, n});
    budget -= n;
  };
  for (auto& s : running_) {
    if (s->prefilling() && budget > 0) add_prefill(*s);
  }
  while (!waiting_.empty() && static_cast<int>(running_.size()) < max_num_seqs_ && budget > 0) {
    Sequence& s = *waiting_.front();
    if (s.share_prefix_with && prompt_pending(s.share_prefix_with)) break;  // its pages are about to be cached
    if (!admit(s, plan)) break;  // first come, first served
    s.admit_order = next_order_++;
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
    add_prefill(s);
  }
  return plan;
}

bool Scheduler::prompt_pending(uint64_t id) const {
  for (const auto& s : running_)
    if (s->id == id) return s->prefilling();
  for (const auto& s : waiting_)
    if (s->id == id) return true;
  return false;  // finished or cancelled
}

std::unique_ptr<Sequence> Scheduler::remove(uint64_t id) {
  std::unique_ptr<Sequence> out;
  auto take = [&](auto& list) {
    auto it = std::find_if(list.begin(), list.end(), [&](const auto& p) { return p->id == id; });
    if (it == list.end()) return false;
    out = std::move(*it);
    list.erase(it);
    return true;
  };
  if (take(running_) || take(waiting_)) release(*out);
  return out;
}

std::vector<Sequence*> Scheduler::all() {
  std::vector<Sequence*> v;
  for (auto& s : running_) v.push_back(s.get());
  for (auto& s : waiting_) v.push_back(s.get());
  return v;
}

}  // namespace dflash
