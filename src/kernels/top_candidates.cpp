#include "kernels/top_candidates.h"

#include <algorithm>
#include <cmath>
#include <functional>

namespace dflash {

TopCandidates select_top_candidates(const float* row, int64_t n, float temperature, int top_k) {
  float threshold = -INFINITY;
  if (top_k > 0 && top_k < n) {
    // A min-heap of the top_k largest values seen; most entries fail the comparison with its top.
    std::vector<float> heap;
    heap.reserve(static_cast<size_t>(top_k));
    for (int64_t i = 0; i < n; ++i) {
      const float x = row[i] / temperature;
      if (std::isnan(x)) continue;
      if (heap.size() < static_cast<size_t>(top_k)) {
        heap.push_back(x);
        std::push_heap(heap.begin(), heap.end(), std::greater<float>());
      } else if (x > heap.front()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
        heap.back() = x;
        std::push_heap(heap.begin(), heap.end(), std::greater<float>());
      }
    }
    if (heap.size() == static_cast<size_t>(top_k)) threshold = heap.front();
  }
  TopCandidates c;
  if (threshold == -INFINITY) {  // every entry but NaN
    c.ids.reserve(static_cast<size_t>(n));
    c.x.reserve(static_cast<size_t>(n));
  }
  for (int64_t i = 0; i < n; ++i) {
    const float x = row[i] / temperature;
    if (x >= threshold) {  // false for NaN
      c.ids.push_back(static_cast<int32_t>(i));
      c.x.push_back(x);
    }
  }
  return c;
}

TopCandidates merge_top_candidates(const std::vector<TopCandidates>& parts, int top_k) {
  TopCandidates all;
  for (const TopCandidates& p : parts) {
    all.ids.insert(all.ids.end(), p.ids.begin(), p.ids.end());
    all.x.insert(all.x.end(), p.x.begin(), p.x.end());
  }
  if (top_k <= 0 || all.x.size() <= static_cast<size_t>(top_k)) return all;
  std::vector<float> x = all.x;
  std::nth_element(x.begin(), x.begin() + (top_k - 1), x.end(), std::greater<float>());
  const float threshold = x[static_cast<size_t>(top_k - 1)];
  TopCandidates kept;
  for (size_t i = 0; i < all.ids.size(); ++i) {
    if (all.x[i] < threshold) continue;
    kept.ids.push_back(all.ids[i]);
    kept.x.push_back(all.x[i]);
  }
  return kept;
}

}  // namespace dflash
