// The small model pair shipped in models/: the default of generate (and serve).
#pragma once

#include <string>

namespace dflash::cli {

inline constexpr const char* kBundledTarget = "pycoder-16m";
inline constexpr const char* kBundledDraft = "pycoder-16m-dflash-b16";

// Directory of a bundled model: $DFLASH_MODELS_DIR, then models/ next to or
// one level above the binary, then the source tree it was built from. Throws
// Error listing the places searched when none has it.
std::string bundled_model_dir(const std::string& name);

}  // namespace dflash::cli
