// Top-k candidates of logits rows on the GPU (kernels/top_candidates.h): a block
// per row finds the top_k-th largest x = logit / temperature by a radix select
// over order-preserving 32-bit keys (11 + 11 + 10 bits: a histogram pass over
// the row, then two over the threshold bin's entries kept in shared memory),
// collects the entries at or above it and sorts them by id. Exact: the same
// float division and comparison as the host selection.
#include <cuda_bf16.h>

#include <climits>

#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"

namespace dflash::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kBoundaryCap = 3072;  // entries of the threshold's first-level bin held in shared memory
static_assert(kTopCandidatesCap == kThreads, "the final sort gives each thread one entry");

// Unsigned keys in the order of the floats; -0 counts as +0 (they compare equal).
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t u = __float_as_uint(x + 0.0f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// hist: counts of kPer * kThreads bins. The bin holding the k-th largest key (1 <= k <= total)
// and the count of keys in the bins above it, for every thread.
template <int kPer>
__device__ void find_bin(const uint32_t* hist, int k, int& bin, int& above) {
  constexpr int kBins = kPer * kThreads;
  __shared__ int warp_sums[32];
  __shared__ int found[2];
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  int local = 0;  // thread t owns bins kBins-1-kPer*t .. down to kBins-kPer*(t+1): the top first
#pragma unroll
  for (int i = 0; i < kPer; ++i) local += hist[kBins - 1 - (kPer * t + i)];
  int incl = local;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = warp_sums[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(kFull, w, o);
      if (lane >= o) w += v;
    }
    warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int excl = incl - local + (warp > 0 ? warp_sums[warp - 1] : 0);
  if (excl < k && excl + local >= k) {
    int cum = excl;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int b = kBins - 1 - (kPer * t + i);
      if (cum + static_cast<int>(hist[b]) >= k) {
        found[0] = b, found[1] = cum;
        break;
      }
      cum += static_cast<int>(hist[b]);
    }
  }
  __syncthreads();
  bin = found[0], above = found[1];
  __syncthreads();  // found and warp_sums are reused by the next call
}

__global__ void __launch_bounds__(kThreads)
    top_candidates_kernel(const bf16* x, int64_t stride, int64_t cols, const int32_t* rows, const float* temperature,
                          const int32_t* top_k, TopCandidatesRow* out) {
  __shared__ uint32_t hist[2048];
  __shared__ uint32_t bkey[kBoundaryCap];
  __shared__ int32_t bid[kBoundaryCap];
  __shared__ int32_t oid[kTopCandidatesCap];
  __shared__ float ox[kTopCandidatesCap];
  __shared__ int n_out, n_bnd, has_nan;
  pdl_begin();
  const int t = threadIdx.x;
  const bf16* row = x + static_cast<int64_t>(rows[blockIdx.x]) * stride;
  const float temp = temperature[blockIdx.x];
  const int k = top_k[blockIdx.x];
  TopCandidatesRow& o = out[blockIdx.x];
  const bool vec = reinterpret_cast<uintptr_t>(row) % 16 == 0;
  // f(i, x) for every entry of the row (x = logit / temperature, IEEE division as on the host).
  auto for_each = [&](auto f) {
    for (int64_t c = t * 8; c < cols; c += kThreads * 8) {
      float v[8];
      if (vec && c + 8 <= cols) {
        unpack8(*reinterpret_cast<const uint4*>(row + c), v);
      } else {
        for (int e = 0; e < 8; ++e) v[e] = c + e < cols ? ld(row + c + e) : 0.0f;
      }
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (c + e < cols) f(c + e, __fdiv_rn(v[e], temp));
    }
  };
  auto clear_hist = [&] {
    for (int i = t; i < 2048; i += kThreads) hist[i] = 0;
  };

  clear_hist();
  if (t == 0) n_out = 0, n_bnd = 0, has_nan = 0;
  __syncthreads();
  for_each([&](int64_t, float v) {
    if (isnan(v)) has_nan = 1;
    else atomicAdd(&hist[order_key(v) >> 21], 1u);
  });
  __syncthreads();
  if (has_nan) {  // the host selection handles NaN rows
    if (t == 0) o.count = -1;
    return;
  }
  int b1, above1;
  find_bin<2>(hist, k, b1, above1);

  // Entries above the threshold bin are kept (fewer than k); the bin's own go to shared memory.
  for_each([&](int64_t i, float v) {
    const uint32_t key = order_key(v);
    const int b = static_cast<int>(key >> 21);
    if (b > b1) {
      const int p = atomicAdd(&n_out, 1);
      oid[p] = static_cast<int32_t>(i), ox[p] = v;
    } else if (b == b1) {
      const int p = atomicAdd(&n_bnd, 1);
      if (p < kBoundaryCap) bkey[p] = key, bid[p] = static_cast<int32_t>(i);
    }
  });
  clear_hist();
  __syncthreads();
  const int m = n_bnd;
  if (m > kBoundaryCap) {
    if (t == 0) o.count = -1;
    return;
  }
  // The (k - above1)-th largest key of the bin, 11 then 10 more bits.
  for (int j = t; j < m; j += kThreads) atomicAdd(&hist[(bkey[j] >> 10) & 2047u], 1u);
  __syncthreads();
  int b2, above2;
  find_bin<2>(hist, k - above1, b2, above2);
  clear_hist();
  __syncthreads();
  for (int j = t; j < m; j += kThreads)
    if (static_cast<int>((bkey[j] >> 10) & 2047u) == b2) atomicAdd(&hist[bkey[j] & 1023u], 1u);
  __syncthreads();
  int b3, above3;
  find_bin<1>(hist, k - above1 - above2, b3, above3);
  const uint32_t threshold = (static_cast<uint32_t>(b1) << 21) | (static_cast<uint32_t>(b2) << 10) | b3;
  for (int j = t; j < m; j += kThreads) {
    if (bkey[j] < threshold) continue;
    const int p = atomicAdd(&n_out, 1);
    if (p < kTopCandidatesCap) oid[p] = bid[j], ox[p] = __fdiv_rn(ld(row + bid[j]), temp);
  }
  __syncthreads();
  const int n = n_out;
  if (n > kTopCandidatesCap) {  // too many ties with the threshold
    if (t == 0) o.count = -1;
    return;
  }
  // Bitonic sort by id, one entry per thread (padding sorts last).
  if (t >= n) oid[t] = INT_MAX;
  __syncthreads();
  for (int size = 2; size <= kTopCandidatesCap; size <<= 1)
    for (int half = size / 2; half > 0; half >>= 1) {
      const int j = t ^ half;
      if (j > t) {
        const bool up = (t & size) == 0;
        if ((oid[t] > oid[j]) == up) {
          const int32_t ti = oid[t];
          oid[t] = oid[j], oid[j] = ti;
          const float tx = ox[t];
          ox[t] = ox[j], ox[j] = tx;
        }
      }
      __syncthreads();
    }
  if (t < n) o.ids[t] = oid[t], o.x[t] = ox[t];
  if (t == 0) o.count = n;
}

}  // namespace

void launch_top_candidates(const Mat& x, const int32_t* rows, const float* temperature, const int32_t* top_k,
                           int n_rows, TopCandidatesRow* out, cudaStream_t s) {
  if (n_rows == 0) return;
  launch(top_candidates_kernel, n_rows, kThreads, s, x.data, x.stride, x.cols, rows, temperature, top_k, out);
}

}  // namespace dflash::cuda
