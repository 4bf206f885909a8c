// KV pages shared by the running sequences, with a prefix cache: a page whose
// tokens are all committed is registered under a hash chain of the tokens up
// to its end, so a later sequence with the same prefix (a system prompt, a
// preempted sequence coming back) maps the same page instead of recomputing
// it. Pages are reference-counted; registered pages nobody uses stay cached
// until a new page is needed (least recently released first). Bookkeeping only.
//
// One page id covers the same positions in the target cache and in the draft
// context cache, so both are cached together.
//
// Hybrid targets (Qwen3.5) also need the recurrent state at the end of a cached prefix: the pool
// keeps n_snapshots state snapshots, each the state right after the tokens of one registered
// page's hash chain, and a prefix matches only up to a page with a snapshot. A sequence holds
// at most one snapshot (its latest); snapshots outlive their sequence until the least recently
// used one makes room, and go with their page when it is evicted.
#pragma once

#include <cstdint>
#include <list>
#include <unordered_map>
#include <vector>

namespace dflash {

class PagePool {
 public:
  PagePool(int n_pages, int page_size, int n_snapshots = 0);

  // Grows `table` to cover n_positions; false (table unchanged) when pages run out.
  bool reserve(std::vector<int32_t>& table, int64_t n_positions);
  // Drops the table's references; registered pages become cached, others free.
  void release(std::vector<int32_t>& table);

  // Maps the longest cached prefix of `tokens` (whole pages, leaving at least one
  // token uncovered) into the empty `table`; returns the positions covered. With `snapshot`
  // (hybrid targets), the prefix ends at a page with a state snapshot, whose index goes there
  // (-1, and nothing mapped, when none does).
  int32_t match_prefix(const std::vector<int32_t>& tokens, std::vector<int32_t>& table, int32_t* snapshot = nullptr);
  // A snapshot index for the state after the page chain `chain` (registered), to be filled by the
  // caller now: the caller's previous one `*held` (-1: none; updated), else a free one, else the
  // least recently used unowned one. -1 when that chain has a snapshot already or none is left.
  int32_t claim_snapshot(uint64_t chain, int32_t* held);
  // The snapshot a finished or preempted sequence held stays cached for others (*held = -1).
  void release_snapshot(int32_t* held);
  // Registers the pages of `table` that tokens[0..n_committed) fill completely,
  // from page *n_registered on (updated); `chain` carries the hash of the pages before.
  void register_full_pages(const std::vector<int32_t>& tokens, int32_t n_committed, const std::vector<int32_t>& table,
                           int32_t* n_registered, uint64_t* chain);

  int n_pages() const { return n_pages_; }
  int page_size() const { return page_size_; }
  int n_in_use() const { return n_in_use_; }        // referenced by some sequence
  int n_cached() const { return static_cast<int>(lru_.size()); }  // unreferenced, kept for reuse
  int64_t n_hit_pages() const { return n_hit_pages_; }
  int n_snapshots() const { return static_cast<int>(snapshots_.size()); }

 private:
  struct Entry {
    uint64_t hash = 0;
    std::vector<int32_t> tokens;  // the page's tokens, checked on every hit
    bool registered = false;
  };
  uint64_t page_hash(uint64_t prev, const int32_t* tokens) const;
  int32_t take_page();  // from the free list, else evicts the least recently cached page; -1 when none
  void forget_snapshot(int32_t i);
  void touch_snapshot(int32_t i);

  int n_pages_, page_size_;
  std::vector<int32_t> free_;
  std::vector<int> refs_;
  std::vector<Entry> entries_;
  std::unordered_map<uint64_t, int32_t> by_hash_;
  std::list<int32_t> lru_;  // cached pages, oldest first
  std::vector<std::list<int32_t>::iterator> lru_pos_;
  int n_in_use_ = 0;
  int64_t n_hit_pages_ = 0;
  struct Snapshot {
    uint64_t chain = 0;
    bool valid = false;
    bool owned = false;  // some running sequence's latest
    std::list<int32_t>::iterator lru;
  };
  std::vector<Snapshot> snapshots_;
  std::unordered_map<uint64_t, int32_t> snapshot_of_;  // chain -> snapshot
  std::list<int32_t> snapshot_lru_;                    // valid, unowned snapshots, least recently used first
};

}  // namespace dflash
