// A loaded target (and optional DFlash draft) on one backend, with the
// settings both the one-shot Engine and the serving engine need.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "kernels/backend.h"
#include "model/dflash_draft.h"
#include "model/target_model.h"

namespace dflash {

struct ModelSet {
  std::unique_ptr<Backend> be;
  std::unique_ptr<TargetModel> target;
  std::unique_ptr<DraftModel> draft;  // null without --draft
  std::vector<int32_t> eos_ids;       // generation_config.json, else config.json
  int block_size = 0;                 // effective DFlash block size (0 without a draft)
  int page_size = 16;

  // Validates the options, picks the backend (unless given one), checks the weights fit and loads
  // both checkpoints.
  explicit ModelSet(const EngineOptions& opts, std::unique_ptr<Backend> backend = nullptr);
};

// device: "cpu", "cuda" or "auto" (the GPU when one is present).
std::unique_ptr<Backend> make_backend(const std::string& device, const BackendOptions& opts = {});

}  // namespace dflash
