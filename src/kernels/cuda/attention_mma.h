// The tensor-core attention kernel (attention_mma.cu), dispatched by launch_attention.
#pragma once

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

// Query heads per block of the tensor-core kernel (rows per tile: 16 / that), or 0 when the
// shape takes the per-row kernel (head_dim > 128).
int attention_mma_heads(const AttnShape& shape);

// Partial results of rows with several splits go to `workspace` for the combine kernel.
void launch_attention_mma(const Mat& q, const Mat& k_cache, const Mat& v_cache, const AttnRow* rows,
                          const AttnTile* tiles, int n_tiles, int splits, const int32_t* page_tables,
                          const AttnShape& shape, float* workspace, Mat out, cudaStream_t s);

}  // namespace dflash::cuda
