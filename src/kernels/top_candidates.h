// The entries of a logits row that a top-k sampling distribution can keep,
// selected where the logits are (the GPU backend selects on the device, so
// that a sampled step copies tens of entries per row to the host, not the
// whole vocabulary).
#pragma once

#include <cstdint>
#include <vector>

namespace dflash {

struct TopCandidates {
  std::vector<int32_t> ids;  // increasing
  std::vector<float> x;      // row[id] / temperature
};

// x = row / temperature (float division). With 0 < top_k < n: the entries whose x is >= the
// top_k-th largest x, ties with it included (Hugging Face's TopKLogitsWarper); otherwise every
// entry. NaN entries are never kept. Expected O(n): one pass with a heap of top_k values.
TopCandidates select_top_candidates(const float* row, int64_t n, float temperature, int top_k);

// select_top_candidates of a whole row from those of its parts (a vocabulary split over
// tensor-parallel ranks): `parts` are each part's selection with the same temperature and top_k,
// ids made the row's, parts in increasing id order. Exact: an entry at or above the row's top_k-th
// largest has fewer than top_k larger entries in its part, so its part kept it, and the top_k-th
// largest of the union is the row's.
TopCandidates merge_top_candidates(const std::vector<TopCandidates>& parts, int top_k);

}  // namespace dflash
