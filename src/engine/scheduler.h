// Continuous-batching bookkeeping, no device code: which sequences run in the
// next step, how many prompt tokens each prefills, which are preempted when KV
// pages run out (their pages are freed and their tokens recomputed later, so no
// request is lost).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <unordered_set>
#include <vector>

#include "engine/page_pool.h"
#include "engine/serving.h"

namespace dflash {

struct ServeSeq {
  uint64_t id = 0;
  ServingEngine::Callback on_event;
  std::vector<int32_t> tokens;   // prompt + generated tokens already fed or to feed (pending excluded)
  int32_t n_prompt = 0;
  int32_t n_cached = 0;          // target KV valid for positions 0..n_cached-1
  int32_t n_draft_ctx = 0;       // draft context KV valid for 0..n_draft_ctx-1
  std::vector<int32_t> pages;    // page table, the same for the target and the draft context cache
  int32_t n_registered = 0;      // leading pages registered in the prefix cache
  uint64_t chain = 0;            // hash chain of those pages
  int32_t pending = -1;          // sampled and sent, not yet in the cache; -1 while prefilling
  int n_generated = 0;           // tokens sent to the client
  int max_tokens = 0;
  std::unordered_set<int32_t> eos;
  SamplingParams sampling;
  int64_t admit_order = 0;       // larger = admitted later (preempted first)

  bool prefilling() const { return pending < 0; }
};

// One step: prefill chunks and decode (or DFlash verify) sequences.
struct StepPlan {
  struct Prefill {
    ServeSeq* seq;
    int32_t n_tokens;            // tokens[n_cached .. n_cached + n_tokens)
  };
  std::vector<Prefill> prefills;
  std::vector<ServeSeq*> decodes;  // each runs `block` rows (1 for plain, fewer near the context end)
};

class Scheduler {
 public:
  // block: rows a decoding sequence needs per step (DFlash block size, 1 for plain).
  Scheduler(int n_pages, int page_size, bool with_draft, int block, int max_num_seqs, int max_tokens_per_step,
            int max_positions);

  void add(std::unique_ptr<ServeSeq> seq);        // to the back of the waiting queue
  // Plans the next step; may preempt running sequences (moved to the waiting front).
  StepPlan schedule();
  // Removes a finished sequence (running or waiting) and frees its pages.
  std::unique_ptr<ServeSeq> remove(uint64_t id);
  std::vector<ServeSeq*> all();                    // running then waiting

  int rows_for(const ServeSeq& s) const;           // decode rows of `s` this step
  int pages_used() const { return pool_.n_in_use(); }
  int pages_cached() const { return pool_.n_cached(); }
  int64_t prefix_hit_pages() const { return pool_.n_hit_pages(); }
  int n_pages() const { return pool_.n_pages(); }
  int n_running() const { return static_cast<int>(running_.size()); }
  int n_waiting() const { return static_cast<int>(waiting_.size()); }
  int64_t n_preempted() const { return n_preempted_; }
  bool empty() const { return running_.empty() && waiting_.empty(); }
  // Pages one sequence of n_positions needs; compared with n_pages() at submit.
  int pages_for(int64_t n_positions) const;

 private:
  bool reserve(ServeSeq& s, int64_t n_positions);
  void release(ServeSeq& s);
  bool admit(ServeSeq& s);  // maps its cached prefix and reserves the rest, or changes nothing
  void preempt(ServeSeq& s);

  PagePool pool_;
  bool with_draft_;
  int block_, max_num_seqs_, max_tokens_per_step_, max_positions_;
  std::vector<std::unique_ptr<ServeSeq>> running_;
  std::deque<std::unique_ptr<ServeSeq>> waiting_;
  int64_t next_order_ = 0, n_preempted_ = 0;
};

}  // namespace dflash
