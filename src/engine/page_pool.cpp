#include "engine/page_pool.h"

#include "util/error.h"

namespace dflash {

PagePool::PagePool(int n_pages, int page_size)
    : n_pages_(n_pages), page_size_(page_size), refs_(n_pages, 0), entries_(n_pages), lru_pos_(n_pages) {
  check(n_pages >= 0 && page_size > 0, "page pool: invalid sizes");
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

int32_t PagePool::match_prefix(const std::vector<int32_t>& tokens, std::vector<int32_t>& table) {
  check(table.empty(), "page pool: prefix matching needs an empty page table");
  uint64_t h = 0;
  int32_t covered = 0;
  while (covered + page_size_ < static_cast<int32_t>(tokens.size())) {  // one token must stay to prefill
    const int32_t* page_tokens = tokens.data() + covered;
    h = page_hash(h, page_tokens);
    auto it = by_hash_.find(h);
    if (it == by_hash_.end()) break;
    const int32_t p = it->second;
    if (!std::equal(page_tokens, page_tokens + page_size_, entries_[p].tokens.begin())) break;
    if (refs_[p]++ == 0) {
      lru_.erase(lru_pos_[p]);
      ++n_in_use_;
    }
    table.push_back(p);
    covered += page_size_;
    ++n_hit_pages_;
  }
  return covered;
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
