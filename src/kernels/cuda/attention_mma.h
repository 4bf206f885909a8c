// The tensor-core attention kernel (attention_mma.cu), dispatched by launch_attention.
#pragma once

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

// Query heads per block of the tensor-core kernel (rows per tile: 16 / that), or 0 when the
// shape takes the per-row kernel (head_dim > 128).
int attention_mma_heads(const AttnShape& shape);

// Whether an attention grid of `blocks` blocks of `threads` may release its successor at its
// start: only when the GPU holds all its blocks at once (pdl.cuh; DFLASH_ATTN_EARLY_RELEASE=0
// turns it off, for A/B timings).
bool attention_may_release_early(const void* kernel, int threads, int64_t blocks);

// Partial results of rows with several splits go to `workspace` for the combine kernel.
// released_early: set to whether the kernel releases its successor at its start.
void launch_attention_mma(const Mat& q, const Mat& k_cache, const Mat& v_cache, const AttnRow* rows,
                          const AttnTile* tiles, int n_tiles, int splits, const int32_t* page_tables,
                          const AttnShape& shape, float* workspace, Mat out, bool& released_early,
                          cudaStream_t s);

}  // namespace dflash::cuda
