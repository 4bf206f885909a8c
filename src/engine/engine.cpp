#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "engine/decode_loop.h"
#include "engine/model_set.h"
#include "engine/sequence.h"
#include "util/error.h"

namespace dflash {

struct Engine::Impl {
  explicit Impl(const EngineOptions& o) : opts(o), m(o), backend_name(m.be->name()) {}
  EngineOptions opts;
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
  const auto t0 = std::chrono::steady_clock::now();
  ModelSet& m = impl_->m;
  const ModelConfig& cfg = m.target->config();
  validate_request(cfg, prompt, opts.max_tokens, opts.sampling);
  const bool spec = opts.mode == SpeculativeMode::DFlash;
  check(!spec || m.draft, "DFlash decoding needs a draft model (--draft)");

  // A loop for this request alone: caches for prompt + output + one block of slack, and the
  // whole prompt in one prefill step.
  const int block = spec ? m.block_size : 1;
  const int64_t n_positions =
      std::min<int64_t>(static_cast<int64_t>(prompt.size()) + opts.max_tokens + block + 1, cfg.max_positions);
  LoopOptions lo;
  lo.speculative = spec;
  lo.spec_sampling = opts.spec_sampling;
  lo.n_pages = static_cast<int>((n_positions + m.page_size - 1) / m.page_size);
  lo.max_num_seqs = 1;
  lo.max_tokens_per_step = static_cast<int>(prompt.size()) + block;
  lo.graphs = impl_->opts.graphs;
  DecodeLoop loop(m, lo);

  GenerationResult result;
  std::optional<TokenEvent> last;
  auto s = std::make_unique<Sequence>();
  s->id = 1;
  s->tokens = prompt;
  s->n_prompt = static_cast<int32_t>(prompt.size());
  s->max_tokens = opts.max_tokens;
  const auto& eos = opts.eos_ids.empty() && opts.use_default_eos ? m.eos_ids : opts.eos_ids;
  s->eos.insert(eos.begin(), eos.end());
  s->sampling = opts.sampling;
  s->logprobs = opts.logprobs;
  s->on_event = [&](const TokenEvent& e) {
    result.tokens.insert(result.tokens.end(), e.tokens.begin(), e.tokens.end());
    result.logprobs.insert(result.logprobs.end(), e.logprobs.begin(), e.logprobs.end());
    if (e.finished) last = e;
  };
  loop.add(std::move(s));
  while (!last) check(loop.step(), "internal: the request could not be scheduled");
  if (last->finish_reason == FinishReason::Error) throw Error(last->error);
  result.stop_reason = last->finish_reason;

  const LoopStats& ls = loop.stats();
  const StepGraphs& graphs = loop.runner().graphs();
  auto& st = result.stats;
  st.n_prompt_tokens = static_cast<int>(prompt.size());
  st.n_generated = static_cast<int>(result.tokens.size());
  st.n_steps = static_cast<int>(ls.decode_steps);
  st.block_size = block;
  if (spec) {
    st.acceptance_histogram.assign(ls.acceptance_histogram.begin(), ls.acceptance_histogram.end());
    long produced = 0;
    for (size_t a = 0; a < st.acceptance_histogram.size(); ++a) produced += static_cast<long>(a + 1) * st.acceptance_histogram[a];
    st.tau = st.n_steps ? static_cast<double>(produced) / st.n_steps : 1.0;
  } else {
    st.acceptance_histogram = {st.n_steps};
    st.tau = 1.0;
  }
  st.prefill_ms = ls.prefill_ms;
  st.decode_ms = ls.decode_ms;
  st.draft_ms = ls.draft_ms;
  st.verify_ms = ls.decode_ms - ls.draft_ms;
  st.graph_replays = graphs.replays();
  st.graph_captures = graphs.captures();
  st.graph_capture_ms = graphs.capture_ms();
  st.total_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace dflash
