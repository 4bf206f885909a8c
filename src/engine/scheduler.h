// Continuous-batching bookkeeping, no device code: which sequences run in the
// next step, how many prompt tokens each prefills, which are preempted when KV
// pages run out (their pages are freed and their tokens recomputed later, so no
// request is lost).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "engine/page_pool.h"
#include "engine/sequence.h"

namespace dflash {

// One step: prefill chunks and decode (or DFlash verify) sequences.
struct StepPlan {
  struct Prefill {
    Sequence* seq;
    int32_t n_tokens;            // tokens[n_cached .. n_cached + n_tokens)
  };
  struct Decode {
    Sequence* seq;
    int32_t n_rows;              // the block (1 for plain, fewer near the context end)
  };
  std::vector<Prefill> prefills;
  std::vector<Decode> decodes;
  // Hybrid targets: recurrent state slots to copy, in this order, before the step's forwards
  // (a running sequence's state into a snapshot, then snapshots into newly admitted sequences).
  struct StateCopy {
    int32_t from, to;
  };
  std::vector<StateCopy> state_copies;
  bool empty() const { return prefills.empty() && decodes.empty(); }
};

class Scheduler {
 public:
  // block: rows a decoding sequence needs per step (DFlash block size, 1 for plain). recurrent:
  // the target keeps a state per sequence (hybrid models): each running sequence gets a slot
  // 0..max_num_seqs-1, and a cached prefix needs the state at its end: state_snapshots slots
  // from max_num_seqs on hold states at page ends (PagePool). A sequence's state is kept when its
  // committed tokens end at a page (prefill chunks are cut at a page end for it); with none, the
  // prefix cache is off for hybrid targets.
  Scheduler(int n_pages, int page_size, bool with_draft, int block, int max_num_seqs, int max_tokens_per_step,
            int max_positions, bool recurrent = false, int state_snapshots = 0);

  void add(std::unique_ptr<Sequence> seq);        // to the back of the waiting queue
  // Plans the next step; may preempt running sequences (moved to the waiting front).
  StepPlan schedule();
  // Removes a finished sequence (running or waiting) and frees its pages.
  std::unique_ptr<Sequence> remove(uint64_t id);
  std::vector<Sequence*> all();                    // running then waiting

  int pages_used() const { return pool_.n_in_use(); }
  int pages_cached() const { return pool_.n_cached(); }
  int64_t prefix_hit_pages() const { return pool_.n_hit_pages(); }
  int64_t state_snapshots_taken() const { return n_snapshots_taken_; }
  int n_pages() const { return pool_.n_pages(); }
  int n_running() const { return static_cast<int>(running_.size()); }
  int n_waiting() const { return static_cast<int>(waiting_.size()); }
  int64_t n_preempted() const { return n_preempted_; }
  bool empty() const { return running_.empty() && waiting_.empty(); }
  // Pages one sequence of n_positions needs; compared with n_pages() at submit.
  int pages_for(int64_t n_positions) const;

 private:
  int rows_for(const Sequence& s) const;  // decode rows of `s` this step
  bool reserve(Sequence& s, int64_t n_positions);
  void release(Sequence& s);
  bool admit(Sequence& s, StepPlan& plan);  // maps its cached prefix and reserves the rest, or changes nothing
  void preempt(Sequence& s);
  // Sequence `id` is waiting or prefilling (a sequence sharing its prompt waits for its pages).
  bool prompt_pending(uint64_t id) const;

  PagePool pool_;
  bool with_draft_;
  int block_, max_num_seqs_, max_tokens_per_step_, max_positions_;
  std::vector<std::unique_ptr<Sequence>> running_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  int64_t next_order_ = 0, n_preempted_ = 0;
  bool recurrent_;
  bool snapshots_;  // hybrid target with state snapshots: the prefix cache is on
  std::vector<int32_t> free_slots_;
  int64_t n_snapshots_taken_ = 0;
};

}  // namespace dflash
