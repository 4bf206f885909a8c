// Bookkeeping of KV-cache pages: a free list and per-sequence page tables.
// No device code: the cache memory itself belongs to the backend.
#pragma once

#include <cstdint>
#include <vector>

namespace dflash {

class PageAllocator {
 public:
  PageAllocator(int n_pages, int page_size);

  // Grows `table` until it covers n_positions; false (table unchanged) when
  // there are not enough free pages.
  bool reserve(std::vector<int32_t>& table, int64_t n_positions);
  // Returns every page of `table` to the free list and clears it.
  void release(std::vector<int32_t>& table);

  int n_free() const { return static_cast<int>(free_.size()); }
  int n_pages() const { return n_pages_; }
  int page_size() const { return page_size_; }

 private:
  int n_pages_, page_size_;
  std::vector<int32_t> free_;  // stack; lowest page ids are handed out first
};

}  // namespace dflash
