// out[M, N] = x[M, K] * w[N, K]^T for small M (decode, verification, draft
// blocks): memory-bound, so the kernel streams each weight once with 16-byte
// loads and feeds tensor cores (mma.sync m16n8k16, fp32 accumulation).
//
// The product is computed transposed, out^T = w * x^T: A = 16 weight rows,
// B = 8 tokens. Each thread loads 8 consecutive k of a weight row and of a
// token row; both operands use the same permutation of k inside a 32-wide
// chunk, which leaves the dot products unchanged.
//
// Reduction order: warp j of the block sums chunks j, j+8, j+16, ... in
// increasing order; the 8 warp partials are then added in warp order. This
// depends only on K, so a row's result is bit-identical for any M.
#include <cuda_bf16.h>

#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"

namespace dflash::cuda {
namespace {

constexpr int kWarps = 8;   // warps per block, splitting K
constexpr int kChunk = 32;  // k per chunk (4 threads x 8 elements)

__device__ __forceinline__ uint4 load_stream(const bf16* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void prefetch_l2(const bf16* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Output features of one block: RT tiles of 16, or 16 when a gate tile pairs with an up tile.
__host__ __device__ constexpr int features_per_block(int rt, bool swiglu) { return swiglu ? 16 : rt * 16; }

// MT: 8-token tiles (M <= 8 * MT); RT: 16-row weight tiles per block; U: chunks in flight per warp.
// kSwiglu (RT == 2): w = [gate; up] with N rows each; tile 0 takes gate rows, tile 1 the same
// up rows, and the block writes silu(gate) * up for its 16 features, rounded as the separate
// product and SwiGLU kernels round.
template <int MT, int RT, int U, bool kSwiglu>
__global__ void __launch_bounds__(kWarps * 32) skinny_gemm_kernel(const bf16* __restrict__ x, int64_t x_stride, int M,
                                                                  const bf16* __restrict__ w, int64_t w_stride, int N,
                                                                  int K, const bf16* __restrict__ bias,
                                                                  bf16* __restrict__ out, int64_t out_stride) {
  static_assert(!kSwiglu || RT == 2, "the SwiGLU form pairs one gate tile with one up tile");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * features_per_block(RT, kSwiglu);

  const bf16* wrow[RT][2];
  bool wok[RT][2];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t f = n0 + (kSwiglu ? 0 : rt * 16) + h * 8 + g;  // output feature
      wok[rt][h] = f < N;
      const int64_t r = kSwiglu && rt == 1 ? N + f : f;
      wrow[rt][h] = w + (wok[rt][h] ? r : 0) * w_stride + q * 8;
    }
  const int n_chunks = (K + kChunk - 1) / kChunk;
  // The weights need nothing from the previous kernel: their first chunks head for L2 before the wait.
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = warp + u * kWarps;
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (c < n_chunks && c * kChunk + q * 8 < K && wok[rt][h]) prefetch_l2(wrow[rt][h] + c * kChunk);
  }
  pdl_begin();

  const bf16* xrow[MT];
  bool xok[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int t = mt * 8 + g;
    xok[mt] = t < M;
    xrow[mt] = x + (xok[mt] ? t : 0) * x_stride + q * 8;
  }

  float acc[RT][MT][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[rt][mt][i] = 0.0f;

  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int c0 = warp; c0 < n_chunks; c0 += kWarps * U) {
    uint4 wv[U][RT][2], xv[U][MT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * kWarps;
      const int k = c * kChunk + q * 8;
      const bool ok = c < n_chunks && k < K;  // K % 8 == 0: a thread's 8 elements are all in or all out
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) wv[u][rt][h] = ok && wok[rt][h] ? load_stream(wrow[rt][h] + c * kChunk) : zero;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        xv[u][mt] = ok && xok[mt] ? __ldg(reinterpret_cast<const uint4*>(xrow[mt] + c * kChunk)) : zero;
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
          const uint4& lo = wv[u][rt][0];
          const uint4& hi = wv[u][rt][1];
          const uint32_t a0 = s ? lo.z : lo.x, a1 = s ? hi.z : hi.x, a2 = s ? lo.w : lo.y, a3 = s ? hi.w : hi.y;
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const uint4& b = xv[u][mt];
            mma_bf16(acc[rt][mt], a0, a1, a2, a3, s ? b.z : b.x, s ? b.w : b.y);
          }
        }
  }

  // Cross-warp reduction in warp order, then bias and the bf16 store.
  __shared__ float red[kWarps][RT][MT][4][32];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][rt][mt][i][lane] = acc[rt][mt][i];
  __syncthreads();
  constexpr int kElems = (kSwiglu ? 1 : RT) * MT * 4 * 32;
  for (int e = threadIdx.x; e < kElems; e += kWarps * 32) {
    const int l = e % 32, i = (e / 32) % 4, mt = (e / 128) % MT, rt = e / (128 * MT);
    const int64_t feature = n0 + rt * 16 + l / 4 + (i >= 2 ? 8 : 0);
    const int token = mt * 8 + (l % 4) * 2 + (i & 1);
    if (feature >= N || token >= M) continue;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kWarps; ++j) sum += red[j][rt][mt][i][l];
    if (bias) sum += __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(bias)[feature]);
    if constexpr (kSwiglu) {
      float up = 0.0f;
#pragma unroll
      for (int j = 0; j < kWarps; ++j) up += red[j][1][mt][i][l];
      if (bias) up += __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(bias)[N + feature]);
      const float gate = round_bf(sum);
      sum = round_bf(gate / (1.0f + expf(-gate))) * round_bf(up);
    }
    reinterpret_cast<__nv_bfloat16*>(out)[token * out_stride + feature] = __float2bfloat16(sum);
  }
}

template <int MT, int RT, bool kSwiglu>
void launch_tiles(const Mat& x, const Mat& w, const bf16* bias, Mat out, cudaStream_t s) {
  // Chunks in flight per warp (no spills; 8 instead of 4 for one-tile products measured the same).
  constexpr int U = MT == 1 && RT == 1 ? 8 : MT <= 2 ? 4 : 2;
  const int64_t n = kSwiglu ? out.cols : w.rows;  // output features
  constexpr int kPerBlock = features_per_block(RT, kSwiglu);
  const unsigned blocks = static_cast<unsigned>((n + kPerBlock - 1) / kPerBlock);
  launch(skinny_gemm_kernel<MT, RT, U, kSwiglu>, blocks, kWarps * 32, s, x.data, x.stride, static_cast<int>(x.rows),
         w.data, w.stride, static_cast<int>(n), static_cast<int>(w.cols), bias, out.data, out.stride);
}

template <int RT, bool kSwiglu = false>
void launch_rt(const Mat& x, const Mat& w, const bf16* bias, Mat out, cudaStream_t s) {
  switch ((x.rows + 7) / 8) {
    case 1: return launch_tiles<1, RT, kSwiglu>(x, w, bias, out, s);
    case 2: return launch_tiles<2, RT, kSwiglu>(x, w, bias, out, s);
    case 3: return launch_tiles<3, RT, kSwiglu>(x, w, bias, out, s);
    default: return launch_tiles<4, RT, kSwiglu>(x, w, bias, out, s);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool skinny_gemm_supported(const Mat& x, const Mat& w, const Mat& out) {
  return x.rows >= 1 && x.rows <= kSkinnyMaxRows && w.cols % 8 == 0 && x.stride % 8 == 0 && w.stride % 8 == 0 &&
         aligned16(x.data) && aligned16(w.data) && w.rows < (int64_t{1} << 31) && w.cols < (int64_t{1} << 31);
}

void launch_skinny_gemm(const Mat& x, const Mat& w, const bf16* bias, Mat out, int n_sms, cudaStream_t s) {
  // Two row tiles per block only when that still leaves two blocks per SM.
  if (w.rows >= int64_t{32} * 2 * n_sms) launch_rt<2>(x, w, bias, out, s);
  else launch_rt<1>(x, w, bias, out, s);
}

void launch_skinny_gemm_swiglu(const Mat& x, const Mat& w, const bf16* bias, Mat out, cudaStream_t s) {
  launch_rt<2, true>(x, w, bias, out, s);
}

}  // namespace dflash::cuda
