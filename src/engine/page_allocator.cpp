#include "engine/page_allocator.h"

#include "util/error.h"

namespace dflash {

PageAllocator::PageAllocator(int n_pages, int page_size) : n_pages_(n_pages), page_size_(page_size) {
  check(n_pages >= 0 && page_size > 0, "page allocator: invalid sizes");
  for (int p = n_pages - 1; p >= 0; --p) free_.push_back(p);
}

bool PageAllocator::reserve(std::vector<int32_t>& table, int64_t n_positions) {
  const int64_t needed = (n_positions + page_size_ - 1) / page_size_ - static_cast<int64_t>(table.size());
  if (needed <= 0) return true;
  if (needed > static_cast<int64_t>(free_.size())) return false;
  for (int64_t i = 0; i < needed; ++i) {
    table.push_back(free_.back());
    free_.pop_back();
  }
  return true;
}

void PageAllocator::release(std::vector<int32_t>& table) {
  for (auto it = table.rbegin(); it != table.rend(); ++it) free_.push_back(*it);
  table.clear();
}

}  // namespace dflash
