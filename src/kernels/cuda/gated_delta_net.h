// Launches of gated_delta_net.cu: Qwen3.5's Gated DeltaNet and the sigmoid gates of its layers.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

struct GdnShape {
  int n_k_heads, n_v_heads, k_dim, v_dim, conv_kernel;
  __host__ __device__ int64_t value_dim() const { return int64_t{n_v_heads} * v_dim; }
  __host__ __device__ int64_t conv_dim() const { return 2 * int64_t{n_k_heads} * k_dim + value_dim(); }
  __host__ __device__ int64_t tape_width() const { return conv_dim() + 2 * int64_t{n_v_heads}; }
};

// One sequence of a call (RecurrentSegment), staged as kSegFields ints in this order;
// scratch_first: its first row in the convolution's output (its tape rows, then its new rows).
struct GdnSegment {
  int32_t first_row, n_rows, slot, replay, scratch_first;
  bool fresh, commit;
};
constexpr int kSegFields = 7;

// Whether the kernels take this shape (k_dim <= 256, v_dim <= 1024, kernel 2..16).
bool gdn_shape_supported(const GdnShape& p);

// The chunked form (gdn_chunked.cu): committed segments of at least kGdnChunkMinRows rows (tape
// rows included) run the recurrence kGdnChunk rows at a time on tensor cores, when k_dim <= 128
// and rows need not be batch-invariant (a prompt's chunks depend on the other requests); the others
// walk their rows one by one. chunk_min_rows: kGdnChunkMinRows, or INT_MAX for no chunked form.
constexpr int kGdnChunk = 64;
constexpr int kGdnChunkMinRows = 64;
__host__ __device__ inline bool gdn_takes_chunks(const GdnSegment& s, int chunk_min_rows) {
  return s.commit && s.replay + s.n_rows >= chunk_min_rows;
}
int gdn_chunk_min_rows(const GdnShape& p, bool batch_invariant);
// Float columns per scratch row that the chunked form needs (0 when no segment of up to max_rows
// rows takes it).
int64_t gdn_chunk_scratch_cols(const GdnShape& p, int max_rows, int chunk_min_rows);
// On x as the convolution left it, for the chunked segments: q and k normalized, beta and the
// log-decay per row (gdn_prep_kernel, gated_delta_net.cu), then the chunks: state updated,
// core outputs written. t: scratch of gdn_chunk_scratch_cols columns, rows as x's.
void launch_gdn_chunked(float* x, int64_t x_stride, const GdnShape& p, const float* a_log, const float* dt_bias,
                        const int32_t* segs, int n_segs, int max_rows, int chunk_min_rows, float* t, int64_t t_stride,
                        float* state, Mat out, cudaStream_t s);

// proj [rows, conv_dim + value_dim + 2 n_v] -> out [rows, value_dim] (Backend::gated_delta_net);
// x: float scratch of sum(replay + n_rows) rows of tape_width columns; max_rows: a bound on a
// segment's replay + n_rows (the convolution's grid; fixed for graphs); chunk_scratch: the chunked
// form's (gdn_chunk_scratch_cols, rows as x's; null when it has none). The states (conv_state
// [slots, (kernel - 1) * conv_dim], state [slots, n_v * k_dim * v_dim], tape [slots, tape_rows *
// tape_width]) are float32.
void launch_gated_delta_net(const Mat& proj, const bf16* conv_w, const float* a_log, const float* dt_bias,
                            const bf16* norm_w, float eps, const GdnShape& p, const int32_t* segs, int n_segs,
                            float* conv_state, float* state, float* tape, int tape_rows, int max_rows, float* x,
                            int64_t x_stride, int chunk_min_rows, float* chunk_scratch, int64_t chunk_stride, Mat out,
                            cudaStream_t s);
// x *= sigmoid(gate), elementwise.
void launch_sigmoid_mul(Mat x, const Mat& gate, cudaStream_t s);
// acc[r] += sigmoid(gate[r, 0]) * y[r].
void launch_add_sigmoid_scaled(Mat acc, const Mat& y, const Mat& gate, cudaStream_t s);

}  // namespace dflash::cuda
