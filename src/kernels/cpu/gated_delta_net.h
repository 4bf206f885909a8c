// The CPU reference of Backend::gated_delta_net (Qwen3.5's linear attention): float32, token by
// token, so a row's result is the same whether it is decoded alone, verified in a block or replayed.
#pragma once

#include <vector>

#include "kernels/backend.h"

namespace dflash {

void cpu_gated_delta_net(const Tensor& proj, const LinearAttentionWeights& w, const LinearAttentionParams& p,
                         RecurrentCache& cache, int layer, const std::vector<RecurrentSegment>& segments, Tensor& out);

}  // namespace dflash
