// DFlash speculative decoding for one sequence (DFLASH.md sections 3-5).
// Greedy output is identical to plain greedy decoding: every committed token is
// the target's own argmax, and the backends compute each row independently of
// the batch it is in. Sampled output with the match scheme is identical to plain
// sampling with the same seed; the rejection scheme keeps the target's distribution.
#include <algorithm>

#include "engine/sequence.h"
#include "engine/verification.h"
#include "util/error.h"

namespace dflash {

namespace {

// Appends draft context K/V for rows [0, n) of `captured` at positions s.. .
void project_context(DecodeContext& ctx, const Tensor& captured, int32_t n, int32_t s) {
  Sequence& seq = ctx.seq;
  check(seq.n_draft_ctx == s, "draft context out of step with the target cache");
  ForwardBatch b(ctx.draft_pages->page_size());
  b.add_sequence(std::vector<int32_t>(static_cast<size_t>(n), 0), s, seq.draft_pages);
  ctx.draft->project_context(captured.slice_rows(0, n), b, *ctx.draft_cache);
  seq.n_draft_ctx = s + n;
}

}  // namespace

void run_dflash(DecodeContext& ctx) {
  Sequence& seq = ctx.seq;
  auto& st = ctx.result.stats;
  const DraftConfig& dc = ctx.draft->config();
  const std::vector<int>& layer_ids = dc.target_layer_ids;
  const int page_size = ctx.target_pages.page_size();
  const int max_pos = ctx.target.config().max_positions;
  st.block_size = ctx.block_size;
  st.acceptance_histogram.assign(ctx.block_size, 0);

  // Prefill: target over the prompt, capturing context features for every token.
  auto t0 = Clock::now();
  const auto n_prompt = static_cast<int32_t>(seq.tokens.size());
  reserve_or_throw(ctx.target_pages, seq.target_pages, n_prompt);
  reserve_or_throw(*ctx.draft_pages, seq.draft_pages, n_prompt);
  ForwardBatch prefill(page_size);
  prefill.add_sequence(seq.tokens, 0, seq.target_pages);
  prefill.logit_rows = {n_prompt - 1};
  auto out = ctx.target.forward(prefill, ctx.target_cache, layer_ids);
  seq.n_cached = n_prompt;
  seq.pending = ctx.pick(out.logits, n_prompt);
  project_context(ctx, out.captured, n_prompt, 0);
  st.prefill_ms = ms_since(t0);
  ctx.emit(seq.pending);

  auto t1 = Clock::now();
  while (!ctx.done) {
    const int32_t s = seq.n_cached;
    if (s >= max_pos) {
      ctx.result.stop_reason = "context";
      break;
    }
    // Near the end of the context the block shrinks; B = 1 is a plain step.
    const int B = std::min(ctx.block_size, max_pos - s);
    reserve_or_throw(ctx.target_pages, seq.target_pages, s + B);
    reserve_or_throw(*ctx.draft_pages, seq.draft_pages, s + B);

    // Draft: block [t_s, M, ..., M] at positions s..s+B-1, bidirectional.
    auto td = Clock::now();
    std::vector<int32_t> block(static_cast<size_t>(B), dc.mask_token_id);
    block[0] = seq.pending;
    const SamplingParams* sp = &ctx.opts.sampling;
    DraftChoice draft;
    if (B > 1) {
      ForwardBatch db(ctx.draft_pages->page_size());
      db.add_sequence(block, s, seq.draft_pages, /*causal=*/false);
      for (int i = 1; i < B; ++i) db.logit_rows.push_back(i);
      Tensor logits;
      ctx.run_step("draft", db, [&] { logits = ctx.draft->forward_block(db, *ctx.draft_cache); });
      draft = std::move(choose_draft_tokens(ctx.be, logits, {{sp, 0, B - 1, s + 1}}, ctx.opts.spec_sampling)[0]);
    }
    const std::vector<int32_t>& drafted = draft.tokens;
    st.draft_ms += ms_since(td);

    // Verify: target over [t_s, d_1..d_{B-1}], causal, capturing features. With graphs the
    // step keeps one shape: the draft context of all B rows is projected in the same graph (rows
    // past the accepted ones are rewritten by the next step before any draft reads them).
    auto tv = Clock::now();
    std::copy(drafted.begin(), drafted.end(), block.begin() + 1);
    ForwardBatch vb(page_size);
    vb.add_sequence(block, s, seq.target_pages);
    for (int i = 0; i < B; ++i) vb.logit_rows.push_back(i);
    const bool project_all = ctx.graphs && ctx.graphs->on();
    ForwardBatch pb(ctx.draft_pages->page_size());
    if (project_all) {
      check(seq.n_draft_ctx == s, "draft context out of step with the target cache");
      pb.add_sequence(std::vector<int32_t>(static_cast<size_t>(B), 0), s, seq.draft_pages);
    }
    Tensor logits, captured;
    ctx.run_step("verify", vb, [&] {
      auto o = ctx.target.forward(vb, ctx.target_cache, layer_ids);
      logits = o.logits;
      captured = o.captured;
      if (project_all) ctx.draft->project_context(o.captured, pb, *ctx.draft_cache);
    });
    const BlockResult verdict = verify_blocks(ctx.be, logits, {{sp, 0, s + 1, &draft}}, ctx.opts.spec_sampling)[0];
    const int a = verdict.accepted;
    st.verify_ms += ms_since(tv);

    // Commit t_s, d_1..d_a; rows beyond a are dropped by not counting them.
    seq.tokens.insert(seq.tokens.end(), block.begin(), block.begin() + a + 1);
    seq.n_cached = s + a + 1;
    if (project_all) seq.n_draft_ctx = s + a + 1;
    else project_context(ctx, captured, a + 1, s);
    seq.pending = verdict.next;
    st.n_steps += 1;
    st.acceptance_histogram[a] += 1;
    for (int i = 0; i < a && !ctx.done; ++i) ctx.emit(drafted[i]);
    if (!ctx.done) ctx.emit(seq.pending);
  }
  st.decode_ms = ms_since(t1);
  long total = 0;
  for (int i = 0; i < ctx.block_size; ++i) total += static_cast<long>(i + 1) * st.acceptance_histogram[i];
  st.tau = st.n_steps ? static_cast<double>(total) / st.n_steps : 1.0;
}

}  // namespace dflash
