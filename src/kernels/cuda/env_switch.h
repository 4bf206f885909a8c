// The environment switches of the CUDA kernels (A/B timings: DFLASH_PDL=0,
// DFLASH_L2_HINT=256, ...): the value of one variable, "" when it is not set.
#pragma once

#include <cstdlib>
#include <string>

namespace dflash::cuda {

inline std::string env_switch(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

}  // namespace dflash::cuda
