// Qwen3.5's Gated DeltaNet (Backend::gated_delta_net) and the gates around its layers, in two
// kernels per layer: the causal convolution (one thread per channel and sequence: the
// convolution window of a channel is shared by the value heads of its key head, so it is updated
// apart from them), then the recurrence (one block per value head and sequence, the state
// [k_dim, v_dim] in registers for the whole segment). Both walk a segment's tape rows first,
// then its new rows, token by token: a row gives the same bits decoded alone, verified in a block
// or replayed from the tape. Roundings to bf16 follow transformers in bf16 (the convolution's
// output, beta, the core output and the gated norm's steps).
#include <cuda_bf16.h>

#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/gated_delta_net.h"
#include "kernels/cuda/pdl.cuh"

namespace dflash::cuda {
namespace {

constexpr int kConvThreads = 128;
constexpr int kRecThreads = 256;
constexpr int kMaxStatePerThread = 64;  // k_dim * v_dim <= 64 * 256 (with v_dim | 256)
constexpr int kMaxConvWindow = 15;

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Segment fields (GdnSegment packed as kSegFields ints).
__device__ __forceinline__ GdnSegment segment(const int32_t* segs, int i) {
  const int32_t* s = segs + i * kSegFields;
  return {s[0], s[1], s[2], s[3], s[4], s[5] != 0, s[6] != 0};
}

// Per channel c of [q|k|v] (c < conv_dim): the convolution of the tape rows then the new rows,
// SiLU, into x; channels conv_dim.. copy b and a. The window is stored back after the tape rows
// (commit = false: the new rows then go to the tape) or after all rows.
__global__ void gdn_conv_kernel(const bf16* proj, int64_t proj_stride, const bf16* conv_w, GdnShape p,
                                const int32_t* segs, float* conv_state, float* tape, int tape_rows, float* x,
                                int64_t x_stride) {
  pdl_begin();
  const GdnSegment seg = segment(segs, blockIdx.y);
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t C = p.conv_dim(), W = p.tape_width();
  if (c >= W) return;
  float* slot_tape = tape + seg.slot * (tape_rows * W);
  float* xr = x + seg.scratch_first * x_stride;
  if (c >= C) {  // b or a: from the tape, then from the projection
    const int64_t col = p.value_dim() + c;  // proj = [q|k|v | z | b | a]
    for (int t = 0; t < seg.replay; ++t) xr[t * x_stride + c] = slot_tape[t * W + c];
    for (int i = 0; i < seg.n_rows; ++i) {
      const float v = ld(proj + (seg.first_row + i) * proj_stride + col);
      xr[(seg.replay + i) * x_stride + c] = v;
      if (!seg.commit) slot_tape[i * W + c] = v;
    }
    return;
  }
  const int K = p.conv_kernel;
  float w[kMaxConvWindow + 1], win[kMaxConvWindow];
#pragma unroll
  for (int j = 0; j <= kMaxConvWindow; ++j) w[j] = j < K ? ld(conv_w + c * K + j) : 0.0f;
  float* cs = conv_state + seg.slot * ((K - 1) * C);
#pragma unroll
  for (int j = 0; j < kMaxConvWindow; ++j) win[j] = j < K - 1 && !seg.fresh ? cs[j * C + c] : 0.0f;
  auto step = [&](float raw, float* out) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxConvWindow; ++j)
      if (j < K - 1) acc += w[j] * win[j];
    acc += w[K - 1] * raw;
    *out = round_bf(silu(round_bf(acc)));
#pragma unroll
    for (int j = 0; j < kMaxConvWindow - 1; ++j)
      if (j + 1 < K - 1) win[j] = win[j + 1];
#pragma unroll
    for (int j = 0; j < kMaxConvWindow; ++j)
      if (j == K - 2) win[j] = raw;
  };
  auto store_window = [&] {
#pragma unroll
    for (int j = 0; j < kMaxConvWindow; ++j)
      if (j < K - 1) cs[j * C + c] = win[j];
  };
  for (int t = 0; t < seg.replay; ++t) step(slot_tape[t * W + c], xr + t * x_stride + c);
  if (!seg.commit) store_window();
  for (int i = 0; i < seg.n_rows; ++i) {
    const float raw = ld(proj + (seg.first_row + i) * proj_stride + c);
    step(raw, xr + (seg.replay + i) * x_stride + c);
    if (!seg.commit) slot_tape[i * W + c] = raw;
  }
  if (seg.commit) store_window();
}

// Sum over the block (kRecThreads threads), the same order for every call; every thread gets it.
__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float s = 0.0f;
#pragma unroll
  for (int w = 0; w < kRecThreads / 32; ++w) s += red[w];
  return s;
}

// One block per (value head, segment). Thread t holds state column j = t % v_dim, rows
// i = g, g + G, ... (g = t / v_dim, G = kRecThreads / v_dim).
__global__ void __launch_bounds__(kRecThreads)
    gdn_recurrent_kernel(const float* x, int64_t x_stride, const bf16* proj, int64_t proj_stride, GdnShape p,
                         const float* a_log, const float* dt_bias, const bf16* norm_w, float eps, const int32_t* segs,
                         float* state, bf16* out, int64_t out_stride) {
  pdl_begin();
  extern __shared__ float smem[];
  const int dk = p.k_dim, dv = p.v_dim, h = blockIdx.x, ratio = p.n_v_heads / p.n_k_heads;
  const GdnSegment seg = segment(segs, blockIdx.y);
  float* q = smem;              // [dk]
  float* k = q + dk;            // [dk]
  float* v = k + dk;            // [dv]
  float* delta = v + dv;        // [dv]
  const int G = kRecThreads / dv;
  float* part = delta + dv;     // [G][dv]
  float* red = part + G * dv;   // [kRecThreads / 32]
  float* scalars = red + kRecThreads / 32;  // beta, decay
  const int t = threadIdx.x, g = t / dv, j = t % dv;
  const bool holder = g < G;
  const int M = (dk + G - 1) / G;
  float* S_mem = state + seg.slot * (int64_t{p.n_v_heads} * dk * dv) + int64_t{h} * dk * dv;
  float S[kMaxStatePerThread];
#pragma unroll
  for (int m = 0; m < kMaxStatePerThread; ++m) {
    const int i = g + G * m;
    S[m] = holder && m < M && i < dk && !seg.fresh ? S_mem[int64_t{i} * dv + j] : 0.0f;
  }
  auto store_state = [&] {
#pragma unroll
    for (int m = 0; m < kMaxStatePerThread; ++m) {
      const int i = g + G * m;
      if (holder && m < M && i < dk) S_mem[int64_t{i} * dv + j] = S[m];
    }
  };
  const int64_t key_dim = int64_t{p.n_k_heads} * dk, C = p.conv_dim();
  const int kh = h / ratio;
  const float a_log_h = a_log[h], dt_bias_h = dt_bias[h], q_scale = rsqrtf(static_cast<float>(dk));
  const int total = seg.replay + seg.n_rows;
  if (!seg.commit && seg.replay == 0 && seg.fresh) store_state();  // zeros: the slot's committed state
  for (int r = 0; r < total; ++r) {
    const float* row = x + (seg.scratch_first + r) * x_stride;
    // q and k of the key head, L2-normalized (q also scaled); v of this head.
    const float qv = t < dk ? row[kh * dk + t] : 0.0f;
    const float kv = t < dk ? row[key_dim + kh * dk + t] : 0.0f;
    const float q_inv = rsqrtf(block_sum(qv * qv, red) + 1e-6f);
    const float k_inv = rsqrtf(block_sum(kv * kv, red) + 1e-6f);
    if (t < dk) {
      q[t] = qv * q_inv * q_scale;
      k[t] = kv * k_inv;
    }
    if (t < dv) v[t] = row[2 * key_dim + int64_t{h} * dv + t];
    if (t == 0) {
      scalars[0] = round_bf(sigmoid(row[C + h]));
      scalars[1] = expf(-expf(a_log_h) * softplus(row[C + p.n_v_heads + h] + dt_bias_h));
    }
    __syncthreads();
    const float beta = scalars[0], decay = scalars[1];
    float mem = 0.0f;
    if (holder) {
#pragma unroll
      for (int m = 0; m < kMaxStatePerThread; ++m) {
        const int i = g + G * m;
        if (m < M && i < dk) {
          S[m] *= decay;
          mem += S[m] * k[i];
        }
      }
      part[g * dv + j] = mem;
    }
    __syncthreads();
    if (t < dv) {
      float s = 0.0f;
      for (int gg = 0; gg < G; ++gg) s += part[gg * dv + t];
      delta[t] = (v[t] - s) * beta;
    }
    __syncthreads();
    const bool output = r >= seg.replay;
    float o = 0.0f;
    if (holder) {
      const float d = delta[j];
#pragma unroll
      for (int m = 0; m < kMaxStatePerThread; ++m) {
        const int i = g + G * m;
        if (m < M && i < dk) {
          S[m] += k[i] * d;
          o += S[m] * q[i];
        }
      }
      if (output) part[g * dv + j] = o;
    }
    if (r + 1 == seg.replay && !seg.commit) store_state();  // the committed state, before the new rows
    if (!output) {
      __syncthreads();
      continue;
    }
    __syncthreads();
    float core = 0.0f;
    if (t < dv) {
      for (int gg = 0; gg < G; ++gg) core += part[gg * dv + t];
      core = round_bf(core);
    }
    const float scale = rsqrtf(block_sum(t < dv ? core * core : 0.0f, red) / static_cast<float>(dv) + eps);
    if (t < dv) {
      const int64_t prow = seg.first_row + (r - seg.replay);
      const float z = ld(proj + prow * proj_stride + C + int64_t{h} * dv + t);
      const float normed = round_bf(ld(norm_w + t) * round_bf(core * scale));
      const float y = normed * silu(z);
      *reinterpret_cast<__nv_bfloat16*>(out + prow * out_stride + int64_t{h} * dv + t) = __float2bfloat16(y);
    }
    __syncthreads();
  }
  if (seg.commit) store_state();
}

__global__ void sigmoid_mul_kernel(bf16* x, int64_t x_stride, const bf16* gate, int64_t gate_stride, int64_t cols) {
  pdl_begin();
  const int64_t r = blockIdx.x;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    const float v = ld(x + r * x_stride + i) * round_bf(sigmoid(ld(gate + r * gate_stride + i)));
    *reinterpret_cast<__nv_bfloat16*>(x + r * x_stride + i) = __float2bfloat16(v);
  }
}

__global__ void add_sigmoid_scaled_kernel(bf16* acc, int64_t acc_stride, const bf16* y, int64_t y_stride,
                                          const bf16* gate, int64_t gate_stride, int64_t cols) {
  pdl_begin();
  const int64_t r = blockIdx.x;
  const float s = round_bf(sigmoid(ld(gate + r * gate_stride)));
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    const float v = ld(acc + r * acc_stride + i) + round_bf(s * ld(y + r * y_stride + i));
    *reinterpret_cast<__nv_bfloat16*>(acc + r * acc_stride + i) = __float2bfloat16(v);
  }
}

}  // namespace

bool gdn_shape_supported(const GdnShape& p) {
  return p.n_k_heads > 0 && p.n_v_heads % p.n_k_heads == 0 && p.v_dim <= kRecThreads && kRecThreads % p.v_dim == 0 &&
         p.k_dim <= kRecThreads && p.k_dim * p.v_dim <= kMaxStatePerThread * kRecThreads &&
         p.conv_kernel >= 2 && p.conv_kernel <= kMaxConvWindow + 1;
}

void launch_gated_delta_net(const Mat& proj, const bf16* conv_w, const float* a_log, const float* dt_bias,
                            const bf16* norm_w, float eps, const GdnShape& p, const int32_t* segs, int n_segs,
                            float* conv_state, float* state, float* tape, int tape_rows, float* x, int64_t x_stride,
                            Mat out, cudaStream_t s) {
  if (n_segs == 0) return;
  const unsigned conv_blocks = static_cast<unsigned>((p.tape_width() + kConvThreads - 1) / kConvThreads);
  launch(gdn_conv_kernel, dim3(conv_blocks, n_segs), kConvThreads, s, static_cast<const bf16*>(proj.data),
         proj.stride, conv_w, p, segs, conv_state, tape, tape_rows, x, x_stride);
  const int G = kRecThreads / p.v_dim;
  const size_t smem = sizeof(float) * (2 * p.k_dim + 2 * p.v_dim + G * p.v_dim + kRecThreads / 32 + 2);
  launch_smem(gdn_recurrent_kernel, dim3(p.n_v_heads, n_segs), kRecThreads, smem, s, static_cast<const float*>(x),
              x_stride, static_cast<const bf16*>(proj.data), proj.stride, p, a_log, dt_bias, norm_w, eps, segs, state,
              out.data, out.stride);
}

void launch_sigmoid_mul(Mat x, const Mat& gate, cudaStream_t s) {
  if (x.rows == 0) return;
  launch(sigmoid_mul_kernel, static_cast<unsigned>(x.rows), 256, s, x.data, x.stride,
         static_cast<const bf16*>(gate.data), gate.stride, x.cols);
}

void launch_add_sigmoid_scaled(Mat acc, const Mat& y, const Mat& gate, cudaStream_t s) {
  if (acc.rows == 0) return;
  launch(add_sigmoid_scaled_kernel, static_cast<unsigned>(acc.rows), 256, s, acc.data, acc.stride,
         static_cast<const bf16*>(y.data), y.stride, static_cast<const bf16*>(gate.data), gate.stride, acc.cols);
}

}  // namespace dflash::cuda
