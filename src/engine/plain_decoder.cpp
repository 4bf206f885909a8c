// Plain decoding: prefill, then one target forward per token.
#include "engine/verification.h"
#include "engine/sequence.h"
#include "util/error.h"

namespace dflash {

bool DecodeContext::emit(int32_t token) {
  result.tokens.push_back(token);
  if (eos.count(token)) {
    result.stop_reason = "eos";
    done = true;
  } else if (static_cast<int>(result.tokens.size()) >= opts.max_tokens) {
    result.stop_reason = "length";
    done = true;
  }
  return done;
}

int32_t DecodeContext::pick(const Tensor& logits, int64_t position, const Tensor* argmax) {
  const std::vector<int32_t> known = argmax ? be.ids_to_host(*argmax) : std::vector<int32_t>{};
  return verify_blocks(be, logits, {{&opts.sampling, 0, position, nullptr}}, opts.spec_sampling,
                       argmax ? &known : nullptr)[0].next;
}

void DecodeContext::run_step(const char* kind, std::initializer_list<ForwardBatch*> batches,
                             const std::function<void()>& body) {
  if (!graphs || !graphs->on()) return body();
  graphs->run(StepGraphs::shape_key(kind, batches), body);
}

void reserve_or_throw(PagePool& pages, std::vector<int32_t>& table, int64_t n_positions) {
  check(pages.reserve(table, n_positions), "out of KV-cache pages for ", n_positions, " positions");
}

void run_plain(DecodeContext& ctx) {
  Sequence& seq = ctx.seq;
  auto& st = ctx.result.stats;
  const int page_size = ctx.target_pages.page_size();
  const int max_pos = ctx.target.config().max_positions;

  auto t0 = Clock::now();
  reserve_or_throw(ctx.target_pages, seq.target_pages, static_cast<int64_t>(seq.tokens.size()));
  ForwardBatch prefill(page_size);
  prefill.add_sequence(seq.tokens, 0, seq.target_pages);
  prefill.logit_rows = {prefill.n_rows() - 1};
  auto out = ctx.target.forward(prefill, ctx.target_cache);
  seq.n_cached = prefill.n_rows();
  seq.pending = ctx.pick(out.logits, seq.n_cached);
  st.prefill_ms = ms_since(t0);
  ctx.emit(seq.pending);

  auto t1 = Clock::now();
  while (!ctx.done) {
    if (seq.n_cached >= max_pos) {
      ctx.result.stop_reason = "context";
      break;
    }
    reserve_or_throw(ctx.target_pages, seq.target_pages, seq.n_cached + 1);
    ForwardBatch step(page_size);
    step.add_sequence({seq.pending}, seq.n_cached, seq.target_pages);
    step.logit_rows = {0};
    // Greedy steps take their token's argmax inside the step (one copy back, no separate launch).
    const bool greedy = ctx.opts.sampling.greedy();
    Tensor logits, argmax;
    ctx.run_step("plain", {&step}, [&] {
      logits = ctx.target.forward(step, ctx.target_cache).logits;
      if (!greedy) return;
      argmax = ctx.be.alloc_ids(1);
      ctx.be.argmax_ids(logits, argmax);
    });
    seq.tokens.push_back(seq.pending);
    seq.n_cached += 1;
    seq.pending = ctx.pick(logits, seq.n_cached, greedy ? &argmax : nullptr);
    st.n_steps += 1;
    ctx.emit(seq.pending);
  }
  st.decode_ms = ms_since(t1);
  st.block_size = 1;
  st.acceptance_histogram = {st.n_steps};
  st.tau = 1.0;
}

}  // namespace dflash
