#include "model/forward_batch.h"

#include "util/error.h"

namespace dflash {

int32_t ForwardBatch::add_sequence(const std::vector<int32_t>& tokens, int32_t n_past,
                                   const std::vector<int32_t>& page_table, bool causal, StateUse state) {
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
  if (state.slot >= 0) recurrent.push_back({first, n, state.slot, n_past == 0, state.replay, state.commit});
  return first;
}

void ForwardBatch::set_key_capacity(int32_t keys) {
  for (auto& seg : segments) {
    check(keys >= seg.n_keys, "forward batch: key capacity ", keys, " is below a sequence's ", seg.n_keys, " keys");
    const int32_t have = (seg.n_keys + page_size - 1) / page_size, need = (keys + page_size - 1) / page_size;
    auto table = std::make_shared<std::vector<int32_t>>(seg.page_table, seg.page_table + have);
    table->resize(static_cast<size_t>(need), 0);
    seg.page_table = table->data();
    seg.key_capacity = keys;
    padded_tables_.push_back(std::move(table));
  }
}

}  // namespace dflash
