#include "engine/page_pool.h"

#include <algorithm>

#include "util/error.h"

namespace dflash {

PagePool::PagePool(int n_pages, int page_size, int n_snapshots)
    : n_pages_(n_pages),
      page_size_(page_size),
      refs_(n_pages, 0),
      entries_(n_pages),
      lru_pos_(n_pages),
      snapshots_(static_cast<size_t>(std::max(n_snapshots, 0))) {
  check(n_pages >= 0 && page_size > 0 && n_snapshots >= 0, "page pool: invalid sizes");
  for (int p = n_pages - 1; p >= 0; --p) free_.push_back(p);
}

uint64_t PagePool::page_hash(uint64_t prev, const int32_t* tokens) const {
  uint64_t h = prev ^ 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < page_size_; ++i) {
    h ^= static_cast<uint32_t>(tokens[i]);
    h *= 0x100000001b3ull;  // FNV-1a step over 32-bit tokens
    h ^= h >> 29;
  }
  return h;
}

int32_t PagePool::take_page() {
  int32_t p = -1;
  if (!free_.empty()) {
    p = free_.back();
    free_.pop_back();
  } else if (!lru_.empty()) {
    p = lru_.front();
    lru_.pop_front();
    by_hash_.erase(entries_[p].hash);
    if (auto s = snapshot_of_.find(entries_[p].hash); s != snapshot_of_.end()) forget_snapshot(s->second);
    entries_[p] = Entry{};
  } else {
    return -1;
  }
  refs_[p] = 1;
  ++n_in_use_;
  return p;
}

bool PagePool::reserve(std::vector<int32_t>& table, int64_t n_positions) {
  const int64_t needed = (n_positions + page_size_ - 1) / page_size_ - static_cast<int64_t>(table.size());
  if (needed <= 0) return true;
  if (needed > static_cast<int64_t>(free_.size() + lru_.size())) return false;
  for (int64_t i = 0; i < needed; ++i) table.push_back(take_page());
  return true;
}

void PagePool::release(std::vector<int32_t>& table) {
  for (auto it = table.rbegin(); it != table.rend(); ++it) {
    const int32_t p = *it;
    if (--refs_[p] > 0) continue;
    --n_in_use_;
    if (entries_[p].registered) {
      lru_pos_[p] = lru_.insert(lru_.end(), p);
    } else {
      free_.push_back(p);
    }
  }
  table.clear();
}

int32_t PagePool::match_prefix(const std::vector<int32_t>& tokens, std::vector<int32_t>& table, int32_t* snapshot) {
  check(table.empty(), "page pool: prefix matching needs an empty page table");
  std::vector<int32_t> hits;  // the cached pages that continue the prefix
  size_t n_use = 0;           // of which the match maps this many
  int32_t snap = -1;
  uint64_t h = 0;
  while (static_cast<int64_t>(hits.size() + 1) * page_size_ < static_cast<int64_t>(tokens.size())) {
    const int32_t* page_tokens = tokens.data() + static_cast<int64_t>(hits.size()) * page_size_;  // one stays to prefill
    h = page_hash(h, page_tokens);
    auto it = by_hash_.find(h);
    if (it == by_hash_.end()) break;
    const int32_t p = it->second;
    if (!std::equal(page_tokens, page_tokens + page_size_, entries_[p].tokens.begin())) break;
    hits.push_back(p);
    if (!snapshot) {
      n_use = hits.size();
    } else if (auto s = snapshot_of_.find(h); s != snapshot_of_.end()) {
      n_use = hits.size();
      snap = s->second;
    }
  }
  for (size_t i = 0; i < n_use; ++i) {
    const int32_t p = hits[i];
    if (refs_[p]++ == 0) {
      lru_.erase(lru_pos_[p]);
      ++n_in_use_;
    }
    table.push_back(p);
    ++n_hit_pages_;
  }
  if (snapshot) {
    *snapshot = snap;
    if (snap >= 0) touch_snapshot(snap);
  }
  return static_cast<int32_t>(n_use) * page_size_;
}

void PagePool::forget_snapshot(int32_t i) {
  Snapshot& s = snapshots_[static_cast<size_t>(i)];
  if (!s.valid) return;
  snapshot_of_.erase(s.chain);
  if (!s.owned) snapshot_lru_.erase(s.lru);
  s.valid = false;
}

void PagePool::touch_snapshot(int32_t i) {
  Snapshot& s = snapshots_[static_cast<size_t>(i)];
  if (!s.valid || s.owned) return;
  snapshot_lru_.erase(s.lru);
  s.lru = snapshot_lru_.insert(snapshot_lru_.end(), i);
}

int32_t PagePool::claim_snapshot(uint64_t chain, int32_t* held) {
  if (snapshots_.empty() || snapshot_of_.count(chain)) return -1;
  int32_t i = *held;
  if (i < 0) {
    for (size_t j = 0; j < snapshots_.size() && i < 0; ++j)
      if (!snapshots_[j].valid && !snapshots_[j].owned) i = static_cast<int32_t>(j);
  }
  if (i < 0 && !snapshot_lru_.empty()) i = snapshot_lru_.front();
  if (i < 0) return -1;  // every snapshot is some running sequence's latest
  forget_snapshot(i);
  Snapshot& s = snapshots_[static_cast<size_t>(i)];
  s.chain = chain;
  s.valid = true;
  s.owned = true;
  snapshot_of_[chain] = i;
  *held = i;
  return i;
}

void PagePool::release_snapshot(int32_t* held) {
  if (*held < 0) return;
  Snapshot& s = snapshots_[static_cast<size_t>(*held)];
  s.owned = false;
  if (s.valid) s.lru = snapshot_lru_.insert(snapshot_lru_.end(), *held);
  *held = -1;
}

void PagePool::register_full_pages(const std::vector<int32_t>& tokens, int32_t n_committed,
                                   const std::vector<int32_t>& table, int32_t* n_registered, uint64_t* chain) {
  while ((*n_registered + 1) * page_size_ <= n_committed && *n_registered < static_cast<int32_t>(table.size())) {
    const int32_t* page_tokens = tokens.data() + static_cast<int64_t>(*n_registered) * page_size_;
    *chain = page_hash(*chain, page_tokens);
    const int32_t p = table[*n_registered];
    if (!entries_[p].registered && !by_hash_.count(*chain)) {
      entries_[p] = {*chain, std::vector<int32_t>(page_tokens, page_tokens + page_size_), true};
      by_hash_[*chain] = p;
    }
    ++*n_registered;
  }
}

}  // namespace dflash
