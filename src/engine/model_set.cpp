#include "engine/model_set.h"

#include <nlohmann/json.hpp>

#include "util/error.h"

namespace dflash {

std::unique_ptr<Backend> make_backend(const std::string& device, const BackendOptions& opts) {
  if (device == "cpu") return make_cpu_backend(opts);
  if (device == "cuda") return make_cuda_backend(opts);
  if (device == "auto") return cuda_device_count() > 0 ? make_cuda_backend(opts) : make_cpu_backend(opts);
  throw Error(cat("unknown device '", device, "' (expected cpu, cuda or auto)"));
}

namespace {

// Refuses checkpoints whose bf16 weights cannot fit in the device's free memory. Over
// tensor_parallel GPUs, GPU 0 holds an N-th of the target's layers and lm_head, the embedding
// whole, and the draft (counted whole: its fc stays on GPU 0).
void check_fits(Backend& be, const std::string& model_dir, const std::string& draft_dir, int tensor_parallel) {
  int64_t free_bytes = 0, total_bytes = 0;
  if (!be.memory_info(free_bytes, total_bytes)) return;
  int64_t need = 0, whole = 0;
  for (const auto& dir : {model_dir, draft_dir}) {
    if (dir.empty()) continue;
    const TensorStore store = TensorStore::open(dir);
    for (const auto& t : store.all()) {
      const int64_t bytes = 2 * t.n_elements();
      whole += bytes;
      const bool split = dir == model_dir && (t.name.find("layers.") != std::string::npos || t.name == "lm_head.weight");
      need += split ? bytes / tensor_parallel : bytes;
    }
  }
  check(need < free_bytes, "the model does not fit: its weights need ", need / (1 << 20), " MiB in bf16",
        tensor_parallel > 1 ? cat(" on GPU 0 (", whole / (1 << 20), " MiB in all over ", tensor_parallel, " GPUs)") : "",
        ", the GPU has ", free_bytes / (1 << 20), " MiB free of ", total_bytes / (1 << 20), " MiB");
}

std::vector<int32_t> default_eos(const std::string& model_dir) {
  const GenerationConfig gen = load_generation_config(model_dir);
  if (!gen.eos_token_ids.empty()) return gen.eos_token_ids;
  const auto j = load_config_json(model_dir);
  if (!j.contains("eos_token_id") || j["eos_token_id"].is_null()) return {};
  return parse_generation_config(nlohmann::json{{"eos_token_id", j["eos_token_id"]}}, model_dir + "/config.json")
      .eos_token_ids;
}

}  // namespace

ModelSet::ModelSet(const EngineOptions& opts, std::unique_ptr<Backend> backend) {
  check(!opts.model_dir.empty(), "no model directory given");
  check(opts.page_size > 0 && opts.page_size <= 4096, "page size must be in 1..4096, got ", opts.page_size);
  page_size = opts.page_size;
  be = backend ? std::move(backend) : make_backend(opts.device, BackendOptions{opts.batch_invariant});
  check(opts.tensor_parallel >= 1 && opts.tensor_parallel <= 64, "tensor parallel size must be in 1..64, got ",
        opts.tensor_parallel);
  check_fits(*be, opts.model_dir, opts.draft_dir, opts.tensor_parallel);
  target = std::make_unique<TargetModel>(*be, opts.model_dir, opts.tensor_parallel);
  eos_ids = default_eos(opts.model_dir);
  if (!opts.draft_dir.empty()) {
    draft = std::make_unique<DraftModel>(*be, opts.draft_dir, *target);
    block_size = opts.block_size > 0 ? opts.block_size : draft->config().block_size;
    check(block_size >= 2 && block_size <= 256, "block size must be in 2..256, got ", block_size);
  }
}

}  // namespace dflash
