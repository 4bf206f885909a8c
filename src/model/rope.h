// RoPE inverse frequencies, computed in float32 exactly as Hugging Face does
// (default and llama3 scaling), so that angles match the reference bit for bit.
#pragma once

#include <vector>

#include "formats/model_config.h"

namespace dflash {

std::vector<float> rope_inv_freq(const RopeConfig& rope, int head_dim);

}  // namespace dflash
