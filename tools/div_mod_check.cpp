// Host check of div_mod (src/kernels/cuda/device_math.cuh): the same float operations (IEEE single
// precision, round to nearest; truncation toward zero as __float2int_rz) against integer division.
//   g++ -O2 -ffp-contract=off -o /tmp/div_mod_check tools/div_mod_check.cpp && /tmp/div_mod_check
// Every n < 2^24 for d < 64, every 7th for 64 <= d <= 5000 (about 1.3e10 cases, ~30 s).
#include <cstdio>

int main() {
  long bad = 0, checked = 0;
  for (int d = 1; d <= 5000; ++d) {
    const float inv = 1.0f / static_cast<float>(d);
    for (int n = 0; n < (1 << 24); n += (d < 64 ? 1 : 7)) {
      volatile float prod = static_cast<float>(n) * inv;
      int q = static_cast<int>(prod);
      int r = n - q * d;
      if (r < 0) --q, r += d;
      else if (r >= d) ++q, r -= d;
      ++checked;
      if ((q != n / d || r != n % d) && bad++ < 5) std::printf("wrong: n=%d d=%d q=%d r=%d\n", n, d, q, r);
    }
  }
  std::printf("checked %ld, wrong %ld\n", checked, bad);
  return bad != 0;
}
