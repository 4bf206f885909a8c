#include "engine/engine.h"

#include <algorithm>

#include "engine/model_set.h"
#include "engine/sampling.h"
#include "engine/sequence.h"
#include "kernels/backend.h"
#include "model/dflash_draft.h"
#include "model/target_model.h"
#include "util/error.h"

namespace dflash {

struct Engine::Impl {
  explicit Impl(const EngineOptions& o) : m(o), backend_name(m.be->name()) {}
  ModelSet m;
  std::string backend_name;
};

Engine::Engine(const EngineOptions& opts) : impl_(std::make_unique<Impl>(opts)) {}

Engine::~Engine() = default;

const ModelConfig& Engine::target_config() const { return impl_->m.target->config(); }
bool Engine::has_draft() const { return impl_->m.draft != nullptr; }
const DraftConfig* Engine::draft_config() const { return impl_->m.draft ? &impl_->m.draft->config() : nullptr; }
int Engine::block_size() const { return impl_->m.block_size; }
const std::vector<int32_t>& Engine::default_eos_ids() const { return impl_->m.eos_ids; }
const std::string& Engine::backend_name() const { return impl_->backend_name; }

GenerationResult Engine::generate(const std::vector<int32_t>& prompt, const GenerateOptions& opts) {
  const ModelConfig& cfg = impl_->m.target->config();
  check(!prompt.empty(), "the prompt is empty");
  check(opts.max_tokens > 0, "max_tokens must be positive, got ", opts.max_tokens);
  validate(opts.sampling);
  for (size_t i = 0; i < prompt.size(); ++i) {
    check(prompt[i] >= 0 && prompt[i] < cfg.n_vocab, "prompt token ", i, " (id ", prompt[i],
          ") is outside the vocabulary 0..", cfg.n_vocab - 1);
  }
  check(static_cast<int64_t>(prompt.size()) < cfg.max_positions, "the prompt has ", prompt.size(),
        " tokens; the model's context is ", cfg.max_positions);
  const bool spec = opts.mode == SpeculativeMode::DFlash;
  check(!spec || impl_->m.draft, "DFlash decoding needs a draft model (--draft)");

  // Size the caches for this request: prompt + output + one block of slack.
  const int page_size = impl_->m.page_size;
  const int64_t n_positions =
      std::min<int64_t>(static_cast<int64_t>(prompt.size()) + opts.max_tokens + impl_->m.block_size + 1, cfg.max_positions);
  const int n_pages = static_cast<int>((n_positions + page_size - 1) / page_size);
  KvCache target_cache = impl_->m.target->alloc_cache(n_pages, page_size);
  PagePool target_pages(n_pages, page_size);
  KvCache draft_cache;
  PagePool draft_pages(spec ? n_pages : 0, page_size);
  if (spec) draft_cache = impl_->m.draft->alloc_cache(n_pages, page_size);

  DecodeContext ctx{*impl_->m.be, *impl_->m.target, spec ? impl_->m.draft.get() : nullptr, target_cache,
                    spec ? &draft_cache : nullptr, target_pages, spec ? &draft_pages : nullptr, opts, {},
                    spec ? impl_->m.block_size : 1, {}, {}};
  const auto& eos = opts.eos_ids.empty() && opts.use_default_eos ? impl_->m.eos_ids : opts.eos_ids;
  ctx.eos.insert(eos.begin(), eos.end());
  ctx.seq.tokens = prompt;

  StepGraphs graphs(*impl_->m.be);  // per request: its graphs point into this request's caches
  ctx.graphs = &graphs;
  const auto t0 = Clock::now();
  if (spec) run_dflash(ctx);
  else run_plain(ctx);
  auto& st = ctx.result.stats;
  st.graph_replays = graphs.replays();
  st.graph_captures = graphs.captures();
  st.graph_capture_ms = graphs.capture_ms();
  st.total_ms = ms_since(t0);
  st.n_prompt_tokens = static_cast<int>(prompt.size());
  st.n_generated = static_cast<int>(ctx.result.tokens.size());
  return std::move(ctx.result);
}

}  // namespace dflash
