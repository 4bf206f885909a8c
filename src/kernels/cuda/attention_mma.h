// The tensor-core attention kernel (attention_mma.cu), dispatched by launch_attention.
#pragma once

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

// Query heads per block of the tensor-core kernel (rows per tile: 16 / that), or 0 when the
// shape takes the per-row kernel (head_dim > 128).
int attention_mma_heads(const AttnShape& shape);

// Whether an attention grid of `blocks` blocks of `threads` may release its successor at its
// start: only when the GPU holds all its blocks at once (pdl.cuh).
bool attention_may_release_early(const void* kernel, int threads, int64_t blocks);

// Whether the fused form's grid for n_tiles tiles fits the GPU at once: it repeats the query
// rotation in every split, which pays (against a kernel less) only while the grid is one wave.
bool attention_mma_fresh_in_one_wave(const AttnShape& shape, int n_tiles, int splits);

// Whether the tensor-core kernel takes its loop form for this call: one block runs a tile's
// `splits` splits and combines them, so no partials go through the workspace (`form`: the rule,
// or a side forced by KernelForms).
bool attention_mma_combines_splits(const AttnShape& shape, int n_rows, int n_tiles, int splits, bool fused,
                                   KernelForms::Splits form);

// Partial results of rows with several splits go to `workspace` for the combine kernel, unless
// the kernel combined them itself (`combined`: large grids, the loop form). released_early:
// set to whether the kernel releases its successor at its start. With fresh.k, the fused form
// (launch.h's AttnFresh; head_dim 64 or 128).
void launch_attention_mma(const Mat& q, const AttnFresh& fresh, const Mat& k_cache, const Mat& v_cache,
                          const AttnRow* rows, int n_rows, const AttnTile* tiles, int n_tiles, int splits,
                          const int32_t* page_tables, const AttnShape& shape, float* workspace, Mat out,
                          KernelForms::Splits form, bool& released_early, bool& combined, cudaStream_t s);

// The shared-keys form (attention_shared_keys.cu): a block per (run of tiles, KV head, head
// chunk), a warp per tile (most_tiles: the longest run's); the same bits as launch_attention_mma.
// head_dim <= 128.
void launch_attention_shared_keys(const Mat& q, const Mat& k_cache, const Mat& v_cache, const AttnRow* rows,
                                  const AttnTile* tiles, const AttnTile* runs, int n_runs, int most_tiles,
                                  const int32_t* page_tables, const AttnShape& shape, Mat out, cudaStream_t s);

}  // namespace dflash::cuda
