#include "engine/step_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <string>

#include "engine/model_set.h"
#include "kernels/backend.h"
#include "model/dflash_draft.h"
#include "model/target_model.h"
#include "util/error.h"

namespace dflash {

namespace {

using Clock = std::chrono::steady_clock;

int64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;  // kB
  }
  return 0;
}

int64_t device_used(Backend& be) {
  int64_t free_b = 0, total_b = 0;
  return be.memory_info(free_b, total_b) ? total_b - free_b : -1;
}

int64_t kv_bytes(const KvCache& c) {
  int64_t n = 0;
  for (const auto& t : c.k) n += tensor_bytes(t);
  for (const auto& t : c.v) n += tensor_bytes(t);
  return n;
}

// Bytes of K and V that attention over n_keys positions reads in every layer of a stack.
int64_t kv_read_bytes(const ModelConfig& c, int64_t n_keys, DType dt) {
  return n_keys * c.n_layers * 2 * int64_t{c.n_kv_heads} * c.head_dim * static_cast<int64_t>(dtype_size(dt));
}

double median_ms(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// `batch` sequences with contiguous page ranges, each holding `context` cached positions.
struct Batch {
  std::vector<std::vector<int32_t>> tables;
  Batch(int batch, int64_t positions, int page_size) {
    const int n = static_cast<int>((positions + page_size - 1) / page_size);
    for (int b = 0; b < batch; ++b) {
      tables.emplace_back(n);
      for (int i = 0; i < n; ++i) tables.back()[i] = b * n + i;
    }
  }
  int n_pages() const { return static_cast<int>(tables.size() * tables[0].size()); }
};

template <typename Step>
double time_median_ms(Backend& be, int warmup, int iters, Step&& step) {
  for (int i = 0; i < warmup; ++i) step();
  be.synchronize();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    const auto s = Clock::now();
    step();
    be.synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - s).count());
  }
  return median_ms(ms);
}

// Times `op` alone: 20 back-to-back calls per timed run (one graph replay where available).
template <typename Op>
double kernel_us(Backend& be, Op&& op) {
  constexpr int kCalls = 20;
  auto run = [&] {
    for (int i = 0; i < kCalls; ++i) op();
  };
  if (!be.supports_graphs()) return time_median_ms(be, 1, 5, run) * 1e3 / kCalls;
  auto g = be.capture_graph(run);
  return time_median_ms(be, 2, 10, [&] { be.replay_graph(g); }) * 1e3 / kCalls;
}

void bench_kernels(Backend& be, TargetModel& target, int page_size, StepBenchReport& rep) {
  const ModelConfig& c = target.config();
  const LayerWeights& l0 = target.weights().layers[0];
  const std::pair<const char*, const Tensor*> weights[] = {
      {"qkv", &l0.qkv}, {"o", &l0.o}, {"gate_up", &l0.gate_up}, {"down", &l0.down}, {"lm_head", &target.weights().lm_head}};
  for (int m : {1, 16, 32, 128}) {  // decode, a verification block, batch 32, prefill
    for (const auto& [name, w] : weights) {
      Tensor x = be.alloc(m, w->cols), out = be.alloc(m, w->rows);
      be.fill_random(x, 7, 1.0f);
      KernelBenchRow r{std::string("matmul ") + name, m, 0, 0, 0, tensor_bytes(*w)};
      r.us = kernel_us(be, [&] { be.matmul(x, *w, nullptr, out); });
      r.gb_per_s = static_cast<double>(r.bytes) / (r.us * 1e-6) / 1e9;
      rep.kernels.push_back(r);
    }
  }
  const int64_t q_dim = int64_t{c.n_heads} * c.head_dim;
  for (int ctx : {512, 2048}) {
    Batch bt(1, ctx + 1, page_size);
    KvCache cache = target.alloc_cache(bt.n_pages(), page_size);
    be.fill_random(cache.k[0], 11, 1.0f);
    be.fill_random(cache.v[0], 12, 1.0f);
    ForwardBatch b(page_size);
    b.add_sequence({0}, ctx, bt.tables[0]);
    Tensor q = be.alloc(1, q_dim), out = be.alloc(1, q_dim);
    be.fill_random(q, 13, 1.0f);
    const AttentionParams ap{c.n_heads, c.n_kv_heads, c.head_dim, 0, page_size};
    KernelBenchRow r{"attention decode (one layer)", 1, ctx, 0, 0,
                     kv_read_bytes(c, ctx + 1, cache.k[0].dtype) / c.n_layers};
    r.us = kernel_us(be, [&] { be.attention(q, cache.k[0], cache.v[0], b.segments, b.positions, ap, out); });
    r.gb_per_s = static_cast<double>(r.bytes) / (r.us * 1e-6) / 1e9;
    rep.kernels.push_back(r);
  }
}

}  // namespace

StepBenchReport run_step_bench(const StepBenchOptions& o) {
  check(!o.batches.empty() && !o.contexts.empty(), "bench-step: give at least one batch size and one context");
  for (int b : o.batches) check(b >= 1 && b <= 1024, "bench-step: batch ", b, " is outside 1..1024");
  for (int c : o.contexts) check(c >= 1, "bench-step: context ", c, " must be positive");
  check(o.iters >= 1 && o.warmup >= 0, "bench-step: iterations must be positive");
  StepBenchReport rep;
  std::unique_ptr<Backend> be = make_backend(o.device);
  rep.device = be->name();
  rep.model = o.model_dir;
  rep.draft = o.draft_dir;
  rep.copy_gbps = be->measure_copy_gbps(int64_t{1} << (be->name() == "cpu" ? 28 : 30));
  be->synchronize();
  const int64_t used_before = device_used(*be);

  { std::ofstream("/proc/self/clear_refs") << "5"; }  // restart the RSS high-water mark for the load
  const auto t0 = Clock::now();
  TargetModel target(*be, o.model_dir);
  std::unique_ptr<DraftModel> draft;
  if (!o.draft_dir.empty()) draft = std::make_unique<DraftModel>(*be, o.draft_dir, target);
  be->synchronize();
  rep.load_s = std::chrono::duration<double>(Clock::now() - t0).count();
  rep.peak_rss_bytes = peak_rss_bytes();
  const ModelConfig& tc = target.config();
  const int B = draft ? (o.block_size > 0 ? o.block_size : draft->config().block_size) : 1;
  rep.weight_bytes = target.weight_bytes_per_step() + (draft ? draft->weight_bytes_per_step() : 0);
  const int64_t weights_resident = device_used(*be) - used_before;

  if (o.kernels) bench_kernels(*be, target, o.page_size, rep);
  std::vector<int> layer_ids = draft ? draft->config().target_layer_ids : std::vector<int>{};
  for (int ctx : o.contexts) {
    check(ctx + B < tc.max_positions, "bench-step: context ", ctx, " + block ", B, " exceeds the model's ",
          tc.max_positions, " positions");
    for (int batch : o.batches) {
      be->release_cached_memory();  // the previous row's KV pages
      Batch bt(batch, ctx + B, o.page_size);
      KvCache tcache = target.alloc_cache(bt.n_pages(), o.page_size);
      for (size_t l = 0; l < tcache.k.size(); ++l) {
        be->fill_random(tcache.k[l], 2 * l + 1, 1.0f);
        be->fill_random(tcache.v[l], 2 * l + 2, 1.0f);
      }
      KvCache dcache;
      if (draft) {
        dcache = draft->alloc_cache(bt.n_pages(), o.page_size);
        for (size_t l = 0; l < dcache.k.size(); ++l) {
          be->fill_random(dcache.k[l], 1000 + 2 * l, 1.0f);
          be->fill_random(dcache.v[l], 1001 + 2 * l, 1.0f);
        }
      }
      const int64_t kv_resident = kv_bytes(tcache) + kv_bytes(dcache);
      const DType kv_dtype = tcache.k[0].dtype;

      auto time_steps = [&](auto&& step) { return time_median_ms(*be, o.warmup, o.iters, step); };
      // Times a step as the decoders run it (body, then one copy of its ids back): op by op, as a
      // graph replay, and restaged then replayed; `restage_us` is the restaging alone.
      auto add_row = [&](const std::string& mode, int64_t bytes, const std::function<void()>& body, const Tensor& ids) {
        StepBenchRow r;
        r.ms_per_step_eager = time_steps([&] {
          body();
          be->ids_to_host(ids);
        });
        r.ms_per_step = r.ms_per_step_eager;
        if (be->supports_graphs()) {
          auto g = be->capture_graph(body);
          r.ms_per_step = time_steps([&] {
            be->replay_graph(g);
            be->ids_to_host(ids);
          });
          r.ms_per_step_restaged = time_steps([&] {
            check(be->restage_graph(g, body), "bench-step: the ", mode, " step no longer matches its graph");
            be->replay_graph(g);
            be->ids_to_host(ids);
          });
          r.restage_us = 1e3 * time_steps([&] { be->restage_graph(g, body); });
        }
        const double ms = r.ms_per_step;
        r.mode = mode;
        r.batch = batch;
        r.context = ctx;
        r.bytes_per_step = bytes;
        r.floor_ms = static_cast<double>(bytes) / (rep.copy_gbps * 1e9) * 1e3;
        r.fraction_of_floor = r.floor_ms / ms;
        r.gb_per_s = static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
        const int64_t used = device_used(*be);
        if (used >= 0) r.device_bytes_other = used - used_before - weights_resident - kv_resident;
        rep.rows.push_back(r);
      };

      // Plain: one token per sequence at position ctx, logits for every row.
      ForwardBatch plain(o.page_size);
      for (int b = 0; b < batch; ++b) plain.add_sequence({static_cast<int32_t>(b % tc.n_vocab)}, ctx, bt.tables[b]);
      for (int r = 0; r < batch; ++r) plain.logit_rows.push_back(r);
      // As the decoders run it: the argmax is taken in the step, one copy of the ids back.
      Tensor plain_ids;
      auto plain_body = [&] {
        plain_ids = be->alloc_ids(batch);
        be->argmax_ids(target.forward(plain, tcache).logits, plain_ids);
      };
      add_row("plain", target.weight_bytes_per_step() + batch * kv_read_bytes(tc, ctx + 1, kv_dtype), plain_body,
              plain_ids);

      if (!draft) continue;
      // DFlash: draft block [t, M..M] (bidirectional), verify B tokens with feature
      // capture, project the context of all B (every draft accepted: the most work).
      const DraftConfig& dc = draft->config();
      ForwardBatch dblock(o.page_size), verify(o.page_size), project(o.page_size);
      std::vector<int32_t> block(static_cast<size_t>(B), dc.mask_token_id);
      for (int b = 0; b < batch; ++b) {
        block[0] = b % tc.n_vocab;
        const int32_t first = dblock.add_sequence(block, ctx, bt.tables[b], /*causal=*/false);
        for (int i = 1; i < B; ++i) dblock.logit_rows.push_back(first + i);
        const int32_t vfirst = verify.add_sequence(block, ctx, bt.tables[b]);
        for (int i = 0; i < B; ++i) verify.logit_rows.push_back(vfirst + i);
        project.add_sequence(std::vector<int32_t>(static_cast<size_t>(B), 0), ctx, bt.tables[b]);
      }
      // As the decoders run it: one step whose drafted tokens (the draft's argmax) feed the
      // verification on the device, the target's argmax taken in the step, one copy back of both.
      std::vector<int32_t> drafted_rows;
      for (int32_t r : verify.logit_rows)
        if (r % B != 0) drafted_rows.push_back(r);
      const auto n_drafted = static_cast<int64_t>(dblock.logit_rows.size());
      const auto n_verified = static_cast<int64_t>(verify.logit_rows.size());
      Tensor dflash_ids;
      auto dflash_body = [&] {
        dflash_ids = be->alloc_ids(n_drafted + n_verified);
        Tensor drafted = dflash_ids.slice_rows(0, n_drafted), argmax = dflash_ids.slice_rows(n_drafted, n_verified);
        be->argmax_ids(draft->forward_block(dblock, dcache), drafted);
        verify.from_device = {drafted, drafted_rows};
        auto out = target.forward(verify, tcache, layer_ids);
        be->argmax_ids(out.logits, argmax);
        draft->project_context(out.captured, project, dcache);
      };
      const int64_t dflash_bytes = target.weight_bytes_per_step() + draft->weight_bytes_per_step() +
                                   batch * (kv_read_bytes(tc, ctx + B, kv_dtype) +
                                            kv_read_bytes(dc.layers, ctx + B, kv_dtype));
      add_row("dflash", dflash_bytes, dflash_body, dflash_ids);
    }
  }

  const int leak_steps = std::min(o.leak_check_steps, tc.max_positions - o.contexts[0] - 1);
  if (leak_steps > 0) {
    Batch bt(1, o.contexts[0] + leak_steps + 1, o.page_size);
    KvCache cache = target.alloc_cache(bt.n_pages(), o.page_size);
    int64_t before = -1;
    for (int i = 0; i < leak_steps; ++i) {
      if (i == std::min(10, leak_steps - 1)) {  // after the first steps have sized the allocator's pool
        be->synchronize();
        before = device_used(*be);
      }
      ForwardBatch step(o.page_size);
      step.add_sequence({i % tc.n_vocab}, o.contexts[0] + i, bt.tables[0]);
      step.logit_rows = {0};
      be->argmax_rows(target.forward(step, cache).logits);
    }
    be->synchronize();
    const int64_t after = device_used(*be);
    if (before >= 0) rep.leak_check_growth_bytes = after - before;
  }
  return rep;
}

}  // namespace dflash
