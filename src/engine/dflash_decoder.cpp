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

  // Greedy and match-scheme drafts are the draft's argmax: they stay on the device, and the
  // draft and the verification run as one step (one graph), with one copy back of the drafted
  // tokens and the target's argmax. Rejection-scheme drafts are sampled on the host in between.
  const bool greedy = ctx.opts.sampling.greedy();
  const bool draft_on_device = greedy || ctx.opts.spec_sampling == SpecSampling::Match;
  const SamplingParams* sp = &ctx.opts.sampling;
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

    // Draft: block [t_s, M, ..., M] at positions s..s+B-1, bidirectional. Verify: the target over
    // [t_s, d_1..d_{B-1}], causal, capturing features. With graphs the step keeps one shape: the
    // draft context of all B rows is projected in the same graph (rows past the accepted ones are
    // rewritten by the next step before any draft reads them).
    std::vector<int32_t> block(static_cast<size_t>(B), dc.mask_token_id);
    block[0] = seq.pending;
    ForwardBatch db(ctx.draft_pages->page_size());
    if (B > 1) {
      db.add_sequence(block, s, seq.draft_pages, /*causal=*/false);
      for (int i = 1; i < B; ++i) db.logit_rows.push_back(i);
    }
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
    auto verify = [&] {
      auto o = ctx.target.forward(vb, ctx.target_cache, layer_ids);
      logits = o.logits;
      captured = o.captured;
      if (project_all) ctx.draft->project_context(o.captured, pb, *ctx.draft_cache);
    };
    DraftChoice draft;
    std::vector<int32_t> argmax;  // the target's, when greedy
    const auto td = Clock::now();
    auto tv = td;
    if (draft_on_device) {
      Tensor ids;  // d_1..d_{B-1}, then the target's argmax of the B rows
      ctx.run_step("dflash", {&db, &vb}, [&] {
        ids = ctx.be.alloc_ids(2 * B - 1);
        if (B > 1) {
          Tensor drafted = ids.slice_rows(0, B - 1);
          ctx.be.argmax_ids(ctx.draft->forward_block(db, *ctx.draft_cache), drafted);
          vb.from_device = {drafted, std::vector<int32_t>(vb.logit_rows.begin() + 1, vb.logit_rows.end())};
        }
        verify();
        Tensor target_argmax = ids.slice_rows(B - 1, B);
        if (greedy) ctx.be.argmax_ids(logits, target_argmax);
      });
      const std::vector<int32_t> host = ctx.be.ids_to_host(greedy ? ids : ids.slice_rows(0, B - 1));
      draft.tokens.assign(host.begin(), host.begin() + B - 1);
      if (greedy) argmax.assign(host.begin() + B - 1, host.end());
    } else {
      if (B > 1) {
        Tensor draft_logits;
        ctx.run_step("draft", {&db}, [&] { draft_logits = ctx.draft->forward_block(db, *ctx.draft_cache); });
        draft = std::move(choose_draft_tokens(ctx.be, draft_logits, {{sp, 0, B - 1, s + 1}}, ctx.opts.spec_sampling)[0]);
      }
      st.draft_ms += ms_since(td);
      tv = Clock::now();
      std::copy(draft.tokens.begin(), draft.tokens.end(), vb.token_ids.begin() + 1);
      ctx.run_step("verify", {&vb}, verify);
    }
    std::copy(draft.tokens.begin(), draft.tokens.end(), block.begin() + 1);
    const std::vector<int32_t>& drafted = draft.tokens;
    const BlockResult verdict = verify_blocks(ctx.be, logits, {{sp, 0, s + 1, &draft}}, ctx.opts.spec_sampling,
                                              greedy ? &argmax : nullptr)[0];
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
