// Qwen3.5's Gated DeltaNet (Backend::gated_delta_net) and the gates around its layers: the causal
// convolution (one thread per channel and sequence: the convolution window of a channel is shared
// by the value heads of its key head, so it is updated apart from them), the recurrence, the gated
// norm. The recurrence of decode rows, verification blocks and short prompts runs here, one warp
// per value head, 8 state columns and sequence, the state in registers for the whole segment: it
// walks a segment's tape rows first, then its new rows, token by token, so a row gives the same
// bits decoded alone, verified in a block or replayed from the tape. Long committed segments
// (prefill) take the chunked form (gdn_chunked.cu). Roundings to bf16 follow transformers in bf16
// (the convolution's output, beta, the core output and the gated norm's steps).
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/cuda/gdn_math.cuh"
#include "kernels/cuda/pdl.cuh"

namespace dflash::cuda {
namespace {

constexpr int kConvThreads = 128;
constexpr int kRecThreads = 128;   // 4 independent warps
constexpr int kCols = 8;           // state columns per warp
constexpr int kRowsPerLane = kGdnRowsPerLane;
constexpr int kMaxConvWindow = 15;
constexpr int kConvRows = 16;      // rows per block of the convolution

// A segment's raw input of channel c (of tape_width: [q|k|v] then b, a) at row t of its tape rows
// followed by its new rows; t < 0 reads the convolution window before them (zeros when fresh).
struct RawRows {
  const bf16* proj;
  int64_t proj_stride, C, W, value_dim;
  const float* window;  // the slot's (K - 1) x C window
  const float* tape;    // the slot's tape rows
  GdnSegment seg;
  int K;
  __device__ __forceinline__ float operator()(int t, int64_t c) const {
    if (t < 0) return seg.fresh ? 0.0f : window[(K - 1 + t) * C + c];
    if (t < seg.replay) return tape[t * W + c];
    return ld(proj + (seg.first_row + t - seg.replay) * proj_stride + (c < C ? c : value_dim + c));
  }
};

__device__ __forceinline__ RawRows raw_rows(const bf16* proj, int64_t proj_stride, const GdnShape& p,
                                            const GdnSegment& seg, const float* conv_state, const float* tape,
                                            int tape_rows) {
  const int64_t C = p.conv_dim(), W = p.tape_width();
  return {proj, proj_stride, C, W, p.value_dim(), conv_state + seg.slot * ((p.conv_kernel - 1) * C),
          tape + seg.slot * (tape_rows * W), seg, p.conv_kernel};
}

// x rows of a segment (its tape rows, then its new rows), kConvRows rows per blockIdx.z, one
// thread per channel: the causal convolution of q|k|v, SiLU; b and a copied. Rows are
// independent, so a prompt's rows convolve in parallel; the window and the tape change after
// (gdn_conv_state_kernel).
__global__ void gdn_conv_kernel(const bf16* proj, int64_t proj_stride, const bf16* conv_w, GdnShape p,
                                const int32_t* segs, const float* conv_state, const float* tape, int tape_rows,
                                float* x, int64_t x_stride) {
  pdl_begin();
  const GdnSegment seg = gdn_segment(segs, blockIdx.y);
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const RawRows raw = raw_rows(proj, proj_stride, p, seg, conv_state, tape, tape_rows);
  const int total = seg.replay + seg.n_rows, t0 = blockIdx.z * kConvRows, t1 = min(total, t0 + kConvRows);
  if (c >= raw.W || t0 >= total) return;
  float* xr = x + seg.scratch_first * x_stride;
  if (c >= raw.C) {
    for (int t = t0; t < t1; ++t) xr[t * x_stride + c] = raw(t, c);
    return;
  }
  const int K = p.conv_kernel;
  float w[kMaxConvWindow + 1];
#pragma unroll
  for (int j = 0; j <= kMaxConvWindow; ++j) w[j] = j < K ? ld(conv_w + c * K + j) : 0.0f;
  for (int t = t0; t < t1; ++t) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j <= kMaxConvWindow; ++j)
      if (j < K) acc += w[j] * raw(t - (K - 1) + j, c);
    xr[t * x_stride + c] = round_bf(gdn_silu(round_bf(acc)));
  }
}

// After gdn_conv_kernel, per segment and channel: the window becomes the last K - 1 raw inputs of
// the committed rows (the tape rows, and with commit the new rows too); without commit the new
// rows go to the tape (read before written: one thread per channel).
__global__ void gdn_conv_state_kernel(const bf16* proj, int64_t proj_stride, GdnShape p, const int32_t* segs,
                                      float* conv_state, float* tape, int tape_rows) {
  pdl_begin();
  const GdnSegment seg = gdn_segment(segs, blockIdx.y);
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const RawRows raw = raw_rows(proj, proj_stride, p, seg, conv_state, tape, tape_rows);
  if (c >= raw.W) return;
  if (c < raw.C) {
    const int K = p.conv_kernel, upto = seg.replay + (seg.commit ? seg.n_rows : 0);
    float win[kMaxConvWindow];
#pragma unroll
    for (int j = 0; j < kMaxConvWindow; ++j) win[j] = j < K - 1 ? raw(upto - (K - 1) + j, c) : 0.0f;
    float* cs = conv_state + seg.slot * ((K - 1) * raw.C);
#pragma unroll
    for (int j = 0; j < kMaxConvWindow; ++j)
      if (j < K - 1) cs[j * raw.C + c] = win[j];
  }
  if (seg.commit) return;
  float* slot_tape = tape + seg.slot * (tape_rows * raw.W);
  for (int i = 0; i < seg.n_rows; ++i) slot_tape[i * raw.W + c] = raw(seg.replay + i, c);
}

// A lane's kCols columns of a state row, together in memory: 16-byte accesses.
__device__ __forceinline__ void load_cols(const float* src, float* dst) {
#pragma unroll
  for (int c = 0; c < kCols; c += 4) {
    const float4 v = *reinterpret_cast<const float4*>(src + c);
    dst[c] = v.x, dst[c + 1] = v.y, dst[c + 2] = v.z, dst[c + 3] = v.w;
  }
}

__device__ __forceinline__ void store_cols(float* dst, const float* src) {
#pragma unroll
  for (int c = 0; c < kCols; c += 4) *reinterpret_cast<float4*>(dst + c) = make_float4(src[c], src[c + 1], src[c + 2], src[c + 3]);
}

// One warp per (value head, group of kCols state columns, segment), no block-level
// synchronization: lane l holds rows l, l + 32, ... of the group's columns of S [k_dim, v_dim]
// for the whole segment, and every sum over rows is a butterfly. Columns of S evolve
// independently (each needs only q, k, its v, beta and the decay), so a head's columns spread
// over several warps; the gated norm, which needs a head's whole output, runs after
// (gdn_gated_norm_kernel). out receives the core output rounded to bf16 (as transformers rounds it).
// Segments that take the chunked form are left to it.
__global__ void __launch_bounds__(kRecThreads)
    gdn_recurrent_kernel(const float* x, int64_t x_stride, GdnShape p, const float* a_log, const float* dt_bias,
                         const int32_t* segs, int chunk_min_rows, float* state, bf16* out, int64_t out_stride,
                         int n_items) {
  constexpr int kC = kCols;
  pdl_begin();
  const int item = blockIdx.x * (kRecThreads / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (item >= n_items) return;
  const GdnSegment seg = gdn_segment(segs, blockIdx.y);
  if (gdn_takes_chunks(seg, chunk_min_rows)) return;
  const int dk = p.k_dim, dv = p.v_dim, groups = (dv + kC - 1) / kC;
  const int h = item / groups, j0 = (item % groups) * kC, ratio = p.n_v_heads / p.n_k_heads, kh = h / ratio;
  float* S_mem = state + seg.slot * (int64_t{p.n_v_heads} * dk * dv) + int64_t{h} * dk * dv;
  // A lane's kC columns of a row lie together: one or two wide accesses when v_dim allows.
  const bool vec = dv % kC == 0;
  float S[kRowsPerLane][kC];
#pragma unroll
  for (int m = 0; m < kRowsPerLane; ++m) {
    const int i = lane + 32 * m;
    const float* src = S_mem + int64_t{i} * dv + j0;
    if (vec && i < dk && !seg.fresh) {
      load_cols(src, S[m]);
      continue;
    }
#pragma unroll
    for (int c = 0; c < kC; ++c) S[m][c] = i < dk && j0 + c < dv && !seg.fresh ? src[c] : 0.0f;
  }
  auto store_state = [&] {
#pragma unroll
    for (int m = 0; m < kRowsPerLane; ++m) {
      const int i = lane + 32 * m;
      float* dst = S_mem + int64_t{i} * dv + j0;
      if (vec && i < dk) {
        store_cols(dst, S[m]);
        continue;
      }
#pragma unroll
      for (int c = 0; c < kC; ++c)
        if (i < dk && j0 + c < dv) dst[c] = S[m][c];
    }
  };
  const int64_t key_dim = int64_t{p.n_k_heads} * dk, C = p.conv_dim();
  const float a_log_h = a_log[h], dt_bias_h = dt_bias[h], q_scale = rsqrtf(static_cast<float>(dk));
  const int total = seg.replay + seg.n_rows;
  if (!seg.commit && seg.replay == 0 && seg.fresh) store_state();  // zeros: the slot's committed state
  // Row r's inputs (q and k rows of this lane, the group's v, b, a), loaded one row ahead so that
  // their latency overlaps the previous row's arithmetic.
  struct Inputs {
    float q[kRowsPerLane], k[kRowsPerLane], v[kC], b, a;
  };
  auto load = [&](int r, Inputs& in) {
    const float* row = x + (seg.scratch_first + r) * x_stride;
#pragma unroll
    for (int m = 0; m < kRowsPerLane; ++m) {
      const int i = lane + 32 * m;
      in.q[m] = i < dk ? row[kh * dk + i] : 0.0f;
      in.k[m] = i < dk ? row[key_dim + kh * dk + i] : 0.0f;
    }
#pragma unroll
    for (int c = 0; c < kC; ++c) in.v[c] = j0 + c < dv ? row[2 * key_dim + int64_t{h} * dv + j0 + c] : 0.0f;
    in.b = row[C + h];
    in.a = row[C + p.n_v_heads + h];
  };
  Inputs next;
  if (total > 0) load(0, next);
  for (int r = 0; r < total; ++r) {
    const Inputs cur = next;
    if (r + 1 < total) load(r + 1, next);
    float q[kRowsPerLane], k[kRowsPerLane];
#pragma unroll
    for (int m = 0; m < kRowsPerLane; ++m) q[m] = cur.q[m], k[m] = cur.k[m];
    gdn_normalize_qk(q, k, q_scale);
    const float beta = gdn_beta(cur.b);
    const float decay = expf(gdn_log_decay(cur.a, a_log_h, dt_bias_h));
    float mem[kC], o[kC];
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      mem[c] = 0.0f;
#pragma unroll
      for (int m = 0; m < kRowsPerLane; ++m) {
        S[m][c] *= decay;
        mem[c] += S[m][c] * k[m];
      }
    }
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const float delta = (cur.v[c] - warp_sum(mem[c])) * beta;
      o[c] = 0.0f;
#pragma unroll
      for (int m = 0; m < kRowsPerLane; ++m) {
        S[m][c] += k[m] * delta;
        o[c] += S[m][c] * q[m];
      }
    }
    if (r + 1 == seg.replay && !seg.commit) store_state();  // the committed state, before the new rows
    if (r < seg.replay) continue;
    const int64_t prow = seg.first_row + (r - seg.replay);
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const float core = warp_sum(o[c]);
      if (lane == c && j0 + c < dv)
        *reinterpret_cast<__nv_bfloat16*>(out + prow * out_stride + int64_t{h} * dv + j0 + c) = __float2bfloat16(core);
    }
  }
  if (seg.commit) store_state();
}

// In place on the core output (one warp per row and value head): rmsnorm(o) * norm * gdn_silu(z)
// with transformers' roundings in bf16.
__global__ void gdn_gated_norm_kernel(bf16* out, int64_t out_stride, const bf16* proj, int64_t proj_stride,
                                      GdnShape p, const bf16* norm_w, float eps, int64_t n_items) {
  pdl_begin();
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (item >= n_items) return;
  const int lane = threadIdx.x % 32, dv = p.v_dim;
  const int64_t row = item / p.n_v_heads, h = item % p.n_v_heads;
  bf16* o = out + row * out_stride + h * dv;
  const bf16* z = proj + row * proj_stride + p.conv_dim() + h * dv;
  float ss = 0.0f;
  for (int j = lane; j < dv; j += 32) ss += ld(o + j) * ld(o + j);
  const float scale = rsqrtf(warp_sum(ss) / static_cast<float>(dv) + eps);
  for (int j = lane; j < dv; j += 32) {
    const float normed = round_bf(ld(norm_w + j) * round_bf(ld(o + j) * scale));
    *reinterpret_cast<__nv_bfloat16*>(o + j) = __float2bfloat16(normed * gdn_silu(ld(z + j)));
  }
}

__global__ void sigmoid_mul_kernel(bf16* x, int64_t x_stride, const bf16* gate, int64_t gate_stride, int64_t cols) {
  pdl_begin();
  const int64_t r = blockIdx.x;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    const float v = ld(x + r * x_stride + i) * round_bf(gdn_sigmoid(ld(gate + r * gate_stride + i)));
    *reinterpret_cast<__nv_bfloat16*>(x + r * x_stride + i) = __float2bfloat16(v);
  }
}

__global__ void add_sigmoid_scaled_kernel(bf16* acc, int64_t acc_stride, const bf16* y, int64_t y_stride,
                                          const bf16* gate, int64_t gate_stride, int64_t cols) {
  pdl_begin();
  const int64_t r = blockIdx.x;
  const float s = round_bf(gdn_sigmoid(ld(gate + r * gate_stride)));
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    const float v = ld(acc + r * acc_stride + i) + round_bf(s * ld(y + r * y_stride + i));
    *reinterpret_cast<__nv_bfloat16*>(acc + r * acc_stride + i) = __float2bfloat16(v);
  }
}

}  // namespace

bool gdn_shape_supported(const GdnShape& p) {
  return p.n_k_heads > 0 && p.n_v_heads % p.n_k_heads == 0 && p.k_dim <= 32 * kRowsPerLane && p.v_dim <= 1024 &&
         p.conv_kernel >= 2 && p.conv_kernel <= kMaxConvWindow + 1;
}

void launch_gated_delta_net(const Mat& proj, const bf16* conv_w, const float* a_log, const float* dt_bias,
                            const bf16* norm_w, float eps, const GdnShape& p, const int32_t* segs, int n_segs,
                            float* conv_state, float* state, float* tape, int tape_rows, int max_rows, float* x,
                            int64_t x_stride, int chunk_min_rows, float* chunk_scratch, int64_t chunk_stride, Mat out,
                            cudaStream_t s) {
  if (n_segs == 0) return;
  const unsigned conv_blocks = static_cast<unsigned>((p.tape_width() + kConvThreads - 1) / kConvThreads);
  const unsigned row_blocks = static_cast<unsigned>((max_rows + kConvRows - 1) / kConvRows);
  launch(gdn_conv_kernel, dim3(conv_blocks, n_segs, row_blocks), kConvThreads, s, static_cast<const bf16*>(proj.data),
         proj.stride, conv_w, p, segs, static_cast<const float*>(conv_state), static_cast<const float*>(tape),
         tape_rows, x, x_stride);
  launch(gdn_conv_state_kernel, dim3(conv_blocks, n_segs), kConvThreads, s, static_cast<const bf16*>(proj.data),
         proj.stride, p, segs, conv_state, tape, tape_rows);
  if (max_rows >= chunk_min_rows)
    launch_gdn_chunked(x, x_stride, p, a_log, dt_bias, segs, n_segs, max_rows, chunk_min_rows, chunk_scratch,
                       chunk_stride, state, out, s);
  const int warps = kRecThreads / 32;
  const int items = p.n_v_heads * ((p.v_dim + kCols - 1) / kCols);
  launch(gdn_recurrent_kernel, dim3((items + warps - 1) / warps, n_segs), kRecThreads, s, static_cast<const float*>(x),
         x_stride, p, a_log, dt_bias, segs, chunk_min_rows, state, out.data, out.stride, items);
  const int64_t norm_items = out.rows * p.n_v_heads;
  if (norm_items == 0) return;
  launch(gdn_gated_norm_kernel, static_cast<unsigned>((norm_items + 3) / 4), 128, s, out.data, out.stride,
         static_cast<const bf16*>(proj.data), proj.stride, p, norm_w, eps, norm_items);
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
