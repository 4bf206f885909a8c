#include "model/forward_batch.h"

#include "util/error.h"

namespace dflash {

int32_t ForwardBatch::add_sequence(const std::vector<int32_t>& tokens, int32_t n_past,
                                   const std::vector<int32_t>& page_table, bool causal) {
  const int32_t first = n_rows(), n = static_cast<int32_t>(tokens.size());
  const int64_t n_keys = int64_t{n_past} + n;
  check(int64_t{page_size} * static_cast<int64_t>(page_table.size()) >= n_keys, "forward batch: page table covers ",
        page_table.size() * page_size, " positions, needs ", n_keys);
  for (int32_t i = 0; i < n; ++i) {
    const int32_t pos = n_past + i;
    token_ids.push_back(tokens[i]);
    positions.push_back(pos);
    kv_slots.push_back(page_table[pos / page_size] * page_size + pos % page_size);
  }
  segments.push_back({first, n, static_cast<int32_t>(n_keys), page_table.data(), causal});
  return first;
}

}  // namespace dflash
