#include "model/rope.h"

#include <cmath>
#include <numbers>

namespace dflash {

std::vector<float> rope_inv_freq(const RopeConfig& rope, int head_dim) {
  std::vector<float> inv(head_dim / 2);
  const float base = static_cast<float>(rope.theta);
  for (int i = 0; i < head_dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv[i] = 1.0f / std::pow(base, exponent);
  }
  if (rope.type == RopeType::Llama3) {
    const float factor = static_cast<float>(rope.factor);
    const float low = static_cast<float>(rope.low_freq_factor), high = static_cast<float>(rope.high_freq_factor);
    const float old_len = static_cast<float>(rope.original_max_positions);
    const float low_freq_wavelen = old_len / low, high_freq_wavelen = old_len / high;
    for (float& f : inv) {
      const float wavelen = 2.0f * std::numbers::pi_v<float> / f;
      float scaled = wavelen > low_freq_wavelen ? f / factor : f;
      if (!(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen)) {
        const float smooth = (old_len / wavelen - low) / (high - low);
        scaled = (1.0f - smooth) * scaled / factor + smooth * scaled;
      }
      f = scaled;
    }
  }
  return inv;
}

}  // namespace dflash
