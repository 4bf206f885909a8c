#include "engine/engine.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "engine/sequence.h"
#include "kernels/backend.h"
#include "model/dflash_draft.h"
#include "model/target_model.h"
#include "util/error.h"

namespace dflash {

struct Engine::Impl {
  std::unique_ptr<Backend> be;
  std::unique_ptr<TargetModel> target;
  std::unique_ptr<DraftModel> draft;
  EngineOptions opts;
  std::string backend_name;
  std::vector<int32_t> eos_ids;
  int block_size = 0;
};

static std::unique_ptr<Backend> make_backend(const std::string& device) {
  if (device == "cpu") return make_cpu_backend();
  if (device == "cuda") return make_cuda_backend();
  if (device == "auto") return cuda_device_count() > 0 ? make_cuda_backend() : make_cpu_backend();
  throw Error(cat("unknown device '", device, "' (expected cpu, cuda or auto)"));
}

// Refuses checkpoints whose bf16 weights cannot fit in the device's free memory.
static void check_fits(Backend& be, const std::string& model_dir, const std::string& draft_dir) {
  int64_t free_bytes = 0, total_bytes = 0;
  if (!be.memory_info(free_bytes, total_bytes)) return;
  int64_t need = 0;
  for (const auto& dir : {model_dir, draft_dir}) {
    if (dir.empty()) continue;
    const TensorStore store = TensorStore::open(dir);
    for (const auto& t : store.all()) need += 2 * t.n_elements();
  }
  check(need < free_bytes, "the model does not fit: its weights need ", need / (1 << 20), " MiB in bf16, the GPU has ",
        free_bytes / (1 << 20), " MiB free of ", total_bytes / (1 << 20), " MiB");
}

Engine::Engine(const EngineOptions& opts) : impl_(std::make_unique<Impl>()) {
  check(!opts.model_dir.empty(), "no model directory given");
  check(opts.page_size > 0 && opts.page_size <= 4096, "page size must be in 1..4096, got ", opts.page_size);
  impl_->opts = opts;
  impl_->be = make_backend(opts.device);
  impl_->backend_name = impl_->be->name();
  check_fits(*impl_->be, opts.model_dir, opts.draft_dir);
  impl_->target = std::make_unique<TargetModel>(*impl_->be, opts.model_dir);
  const GenerationConfig gen = load_generation_config(opts.model_dir);
  impl_->eos_ids = gen.eos_token_ids;
  if (impl_->eos_ids.empty()) {
    const auto j = load_config_json(opts.model_dir);
    if (j.contains("eos_token_id") && !j["eos_token_id"].is_null()) {
      GenerationConfig from_cfg = parse_generation_config(
          nlohmann::json{{"eos_token_id", j["eos_token_id"]}}, opts.model_dir + "/config.json");
      impl_->eos_ids = from_cfg.eos_token_ids;
    }
  }
  if (!opts.draft_dir.empty()) {
    impl_->draft = std::make_unique<DraftModel>(*impl_->be, opts.draft_dir, *impl_->target);
    impl_->block_size = opts.block_size > 0 ? opts.block_size : impl_->draft->config().block_size;
    check(impl_->block_size >= 2 && impl_->block_size <= 256, "block size must be in 2..256, got ", impl_->block_size);
  }
}

Engine::~Engine() = default;

const ModelConfig& Engine::target_config() const { return impl_->target->config(); }
bool Engine::has_draft() const { return impl_->draft != nullptr; }
const DraftConfig* Engine::draft_config() const { return impl_->draft ? &impl_->draft->config() : nullptr; }
int Engine::block_size() const { return impl_->block_size; }
const std::vector<int32_t>& Engine::default_eos_ids() const { return impl_->eos_ids; }
const std::string& Engine::backend_name() const { return impl_->backend_name; }

GenerationResult Engine::generate(const std::vector<int32_t>& prompt, const GenerateOptions& opts) {
  const ModelConfig& cfg = impl_->target->config();
  check(!prompt.empty(), "the prompt is empty");
  check(opts.max_tokens > 0, "max_tokens must be positive, got ", opts.max_tokens);
  for (size_t i = 0; i < prompt.size(); ++i) {
    check(prompt[i] >= 0 && prompt[i] < cfg.n_vocab, "prompt token ", i, " (id ", prompt[i],
          ") is outside the vocabulary 0..", cfg.n_vocab - 1);
  }
  check(static_cast<int64_t>(prompt.size()) < cfg.max_positions, "the prompt has ", prompt.size(),
        " tokens; the model's context is ", cfg.max_positions);
  const bool spec = opts.mode == SpeculativeMode::DFlash;
  check(!spec || impl_->draft, "DFlash decoding needs a draft model (--draft)");

  // Size the caches for this request: prompt + output + one block of slack.
  const int page_size = impl_->opts.page_size;
  const int64_t n_positions =
      std::min<int64_t>(static_cast<int64_t>(prompt.size()) + opts.max_tokens + impl_->block_size + 1, cfg.max_positions);
  const int n_pages = static_cast<int>((n_positions + page_size - 1) / page_size);
  KvCache target_cache = impl_->target->alloc_cache(n_pages, page_size);
  PageAllocator target_pages(n_pages, page_size);
  KvCache draft_cache;
  PageAllocator draft_pages(spec ? n_pages : 0, page_size);
  if (spec) draft_cache = impl_->draft->alloc_cache(n_pages, page_size);

  DecodeContext ctx{*impl_->be, *impl_->target, spec ? impl_->draft.get() : nullptr, target_cache,
                    spec ? &draft_cache : nullptr, target_pages, spec ? &draft_pages : nullptr, opts, {},
                    spec ? impl_->block_size : 1, {}, {}};
  const auto& eos = opts.eos_ids.empty() && opts.use_default_eos ? impl_->eos_ids : opts.eos_ids;
  ctx.eos.insert(eos.begin(), eos.end());
  ctx.seq.tokens = prompt;

  const auto t0 = Clock::now();
  if (spec) run_dflash(ctx);
  else run_plain(ctx);
  auto& st = ctx.result.stats;
  st.total_ms = ms_since(t0);
  st.n_prompt_tokens = static_cast<int>(prompt.size());
  st.n_generated = static_cast<int>(ctx.result.tokens.size());
  return std::move(ctx.result);
}

}  // namespace dflash
