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

}  // namespace dflash
