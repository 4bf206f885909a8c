#include "engine/step_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <string>

#include "engine/model_set.h"
#include "engine/sequence.h"
#include "engine/step_runner.h"
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

int attention_layers(const ModelConfig& c) {
  int n = 0;
  for (int l = 0; l < c.n_layers; ++l) n += !c.is_linear_layer(l);
  return n;
}

// Bytes of K and V that attention over n_keys positions reads in every attention layer of a stack.
int64_t kv_read_bytes(const ModelConfig& c, int64_t n_keys, DType dt) {
  return n_keys * attention_layers(c) * 2 * int64_t{c.n_kv_heads} * c.head_dim * static_cast<int64_t>(dtype_size(dt));
}

// Bytes of one sequence's Gated DeltaNet states (recurrent and convolution, float32) that a step
// reads and writes back: hybrid targets only.
int64_t state_bytes_per_step(const ModelConfig& c) {
  const LinearAttentionConfig& l = c.linear;
  const int64_t per_layer = 4 * (int64_t{l.n_v_heads} * l.k_dim * l.v_dim + (l.conv_kernel - 1) * l.conv_dim());
  return 2 * per_layer * (c.n_layers - attention_layers(c));
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

// A Gated DeltaNet layer's recurrence alone (convolution, state, gated norm; layer 0's weights)
// over one sequence of m rows, and a gated attention layer's prefill attention over m rows: what a
// hybrid target's prefill spends beside its products.
void bench_gated_delta_net(Backend& be, TargetModel& target, int page_size, StepBenchReport& rep) {
  const ModelConfig& c = target.config();
  const LinearAttentionConfig& lc = c.linear;
  const LinearAttentionParams lp{lc.n_k_heads, lc.n_v_heads, lc.k_dim, lc.v_dim, lc.conv_kernel, c.rms_norm_eps};
  const LayerWeights& w = target.weights().layers[0];
  const int64_t state_bytes = 4 * int64_t{lc.n_v_heads} * lc.k_dim * lc.v_dim;
  for (int m : {1, 16, 512, 4096}) {
    KvCache cache = target.alloc_cache((m + page_size - 1) / page_size, page_size, 1, 16);
    Tensor proj = be.alloc(m, w.linear_in.rows), out = be.alloc(m, lc.value_dim());
    // The working memory outside the timed graph (it holds 20 calls, whose temporaries add up).
    Tensor scratch = be.alloc_f32(m + cache.recurrent.tape_rows, lc.conv_dim() + 2 * int64_t{lc.n_v_heads});
    be.fill_random(proj, 21, 1.0f);
    const std::vector<RecurrentSegment> segs{{0, m, 0, /*fresh=*/true, 0, /*commit=*/true}};
    KernelBenchRow r{"gated delta net (one layer)", m, 0, 0, 0, 2 * state_bytes};
    r.us = kernel_us(be, [&] { be.gated_delta_net(proj, w.linear, lp, cache.recurrent, 0, segs, out, &scratch); });
    r.gb_per_s = static_cast<double>(r.bytes) / (r.us * 1e-6) / 1e9;
    rep.kernels.push_back(r);
    if (m < 512) continue;
    size_t l = 0;  // the first attention layer
    while (cache.k[l].empty()) ++l;
    be.fill_random(cache.k[l], 11, 1.0f);
    be.fill_random(cache.v[l], 12, 1.0f);
    std::vector<int32_t> table(static_cast<size_t>((m + page_size - 1) / page_size));
    for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i);
    ForwardBatch b(page_size);
    b.add_sequence(std::vector<int32_t>(static_cast<size_t>(m), 0), 0, table);
    const int64_t q_dim = int64_t{c.n_heads} * c.head_dim;
    Tensor q = be.alloc(m, q_dim), o = be.alloc(m, q_dim);
    be.fill_random(q, 13, 1.0f);
    const AttentionParams ap{c.n_heads, c.n_kv_heads, c.head_dim, 0, page_size};
    KernelBenchRow a{"attention prefill (one layer)", m, m, 0, 0, 0};
    // Timed op by op: a head_dim the prefill tile kernel lacks (256) takes the decode kernel,
    // whose split partials come from the graph arena once per call.
    a.us = time_median_ms(be, 1, 5, [&] { be.attention(q, cache.k[l], cache.v[l], b.segments, b.positions, ap, o); }) * 1e3;
    rep.kernels.push_back(a);
  }
}

void bench_kernels(Backend& be, TargetModel& target, int page_size, StepBenchReport& rep) {
  const ModelConfig& c = target.config();
  const LayerWeights& l0 = target.weights().layers[0];
  const std::pair<const char*, const Tensor*> weights[] = {
      {"qkv", &l0.qkv},         {"o", &l0.o},
      {"linear_in", &l0.linear_in}, {"linear_out", &l0.linear_out},  // Gated DeltaNet layers
      {"gate_up", &l0.gate_up}, {"down", &l0.down}, {"lm_head", &target.weights().lm_head}};
  for (int m : {1, 16, 32, 128}) {  // decode, a verification block, batch 32, prefill
    for (const auto& [name, w] : weights) {
      if (w->empty()) continue;  // a routed layer's dense MLP
      Tensor x = be.alloc(m, w->cols), out = be.alloc(m, w->rows);
      be.fill_random(x, 7, 1.0f);
      KernelBenchRow r{std::string("matmul ") + name, m, 0, 0, 0, tensor_bytes(*w)};
      r.us = kernel_us(be, [&] { be.matmul(x, *w, nullptr, out); });
      r.gb_per_s = static_cast<double>(r.bytes) / (r.us * 1e-6) / 1e9;
      rep.kernels.push_back(r);
    }
    if (!l0.moe.empty()) {  // the routed MLP: router, the experts its rows go to, combine
      Tensor x = be.alloc(m, c.n_embd), out = be.alloc(m, c.n_embd), counts = be.alloc_ids(l0.moe.n_experts);
      be.fill_random(x, 7, 1.0f);
      KernelBenchRow r{"moe", m, 0, 0, 0, 0};
      r.us = kernel_us(be, [&] { be.moe(x, l0.moe, out, &counts); });
      int routed = 0;
      for (int32_t n : be.ids_to_host(counts)) routed += n > 0;
      r.bytes = tensor_bytes(l0.moe.router) +
                (tensor_bytes(l0.moe.gate_up) + tensor_bytes(l0.moe.down)) / l0.moe.n_experts * routed;
      r.gb_per_s = static_cast<double>(r.bytes) / (r.us * 1e-6) / 1e9;
      rep.kernels.push_back(r);
    }
  }
  if (target.tensor_parallel() > 1) {  // each layer sums its mixer's and its MLP's outputs across the ranks
    for (int m : {1, 16, 32, 128, 2048}) {
      Tensor x = be.alloc(m, c.n_embd);
      be.fill_random(x, 7, 0.0f);
      KernelBenchRow r{cat("all-reduce (", target.tensor_parallel(), " ranks)"), m, 0, 0, 0, tensor_bytes(x)};
      r.us = kernel_us(be, [&] { target.all_reduce_rows(x); });
      r.gb_per_s = static_cast<double>(r.bytes) / (r.us * 1e-6) / 1e9;
      rep.kernels.push_back(r);
    }
  }
  if (l0.is_linear()) bench_gated_delta_net(be, target, page_size, rep);
  const int64_t q_dim = int64_t{c.n_heads} * c.head_dim;
  for (int ctx : {512, 2048}) {
    Batch bt(1, ctx + 1, page_size);
    KvCache cache = target.alloc_cache(bt.n_pages(), page_size);
    size_t l = 0;  // the first attention layer (hybrids begin with linear-attention layers)
    while (cache.k[l].empty()) ++l;
    be.fill_random(cache.k[l], 11, 1.0f);
    be.fill_random(cache.v[l], 12, 1.0f);
    ForwardBatch b(page_size);
    b.add_sequence({0}, ctx, bt.tables[0]);
    Tensor q = be.alloc(1, q_dim), out = be.alloc(1, q_dim);
    be.fill_random(q, 13, 1.0f);
    const AttentionParams ap{c.n_heads, c.n_kv_heads, c.head_dim, 0, page_size};
    KernelBenchRow r{"attention decode (one layer)", 1, ctx, 0, 0,
                     kv_read_bytes(c, ctx + 1, cache.k[l].dtype) / attention_layers(c)};
    r.us = kernel_us(be, [&] { be.attention(q, cache.k[l], cache.v[l], b.segments, b.positions, ap, out); });
    r.gb_per_s = static_cast<double>(r.bytes) / (r.us * 1e-6) / 1e9;
    rep.kernels.push_back(r);
  }
}

// The product rate the device reaches on a large product (TFLOP/s): 8192 x 8192 x 4096 (a CPU:
// 512 x 512 x 512).
double matmul_tflops(Backend& be) {
  const bool cpu = be.name() == "cpu";
  const int64_t m = cpu ? 512 : 8192, n = cpu ? 512 : 8192, k = cpu ? 512 : 4096;
  Tensor x = be.alloc(m, k), w = be.alloc(n, k), out = be.alloc(m, n);
  be.fill_random(x, 21, 1.0f);
  be.fill_random(w, 22, 0.02f);
  const double ms = time_median_ms(be, 2, 10, [&] { be.matmul(x, w, nullptr, out); });
  return 2.0 * m * n * k / (ms * 1e-3) / 1e12;
}

// Floating-point work of prefilling `prompt` tokens of one sequence on the target: every product a
// token's row goes through (of a routed layer: its router and top_k experts; logits of the last
// row only) and causal attention (q.k and p.v over the keys at or before each row).
double prefill_flop(const TargetModel& t, int64_t prompt) {
  const ModelConfig& c = t.config();
  const int64_t h = c.n_embd, q = int64_t{c.n_heads} * c.head_dim, kv = int64_t{c.n_kv_heads} * c.head_dim;
  double per_token = 0;
  for (int l = 0; l < c.n_layers; ++l) {
    per_token += static_cast<double>(h) * (q + 2 * kv) + static_cast<double>(q) * h;
    per_token += c.is_moe_layer(l) ? static_cast<double>(h) * (c.moe.n_experts + 3.0 * c.moe.top_k * c.moe.n_ff)
                                   : 3.0 * h * c.n_ff;
  }
  const double attention = 2.0 * 2.0 * q * c.n_layers * (static_cast<double>(prompt) * (prompt + 1) / 2);
  return 2.0 * per_token * prompt + attention + 2.0 * static_cast<double>(h) * c.n_vocab;
}

}  // namespace

StepBenchReport run_step_bench(const StepBenchOptions& o) {
  check(!o.batches.empty() && !o.contexts.empty(), "bench-step: give at least one batch size and one context");
  for (int b : o.batches) check(b >= 1 && b <= 1024, "bench-step: batch ", b, " is outside 1..1024");
  for (int c : o.contexts) check(c >= 1, "bench-step: context ", c, " must be positive");
  check(o.iters >= 1 && o.warmup >= 0, "bench-step: iterations must be positive");
  StepBenchReport rep;
  EngineOptions eo;
  eo.model_dir = o.model_dir;
  eo.draft_dir = o.draft_dir;
  eo.device = o.device;
  eo.page_size = o.page_size;
  eo.block_size = o.block_size;
  eo.batch_invariant = o.batch_invariant;
  eo.tensor_parallel = o.tensor_parallel;
  std::unique_ptr<Backend> be = make_backend(eo.device, BackendOptions{eo.batch_invariant});
  rep.device = be->name();
  rep.model = o.model_dir;
  rep.draft = o.draft_dir;
  rep.copy_gbps = be->measure_copy_gbps(int64_t{1} << (be->name() == "cpu" ? 28 : 30));
  be->synchronize();
  const int64_t used_before = device_used(*be);

  { std::ofstream("/proc/self/clear_refs") << "5"; }  // restart the RSS high-water mark for the load
  const auto t0 = Clock::now();
  ModelSet m(eo, std::move(be));
  Backend& dev = *m.be;
  dev.synchronize();
  rep.load_s = std::chrono::duration<double>(Clock::now() - t0).count();
  rep.peak_rss_bytes = peak_rss_bytes();
  TargetModel& target = *m.target;
  DraftModel* draft = m.draft.get();
  const ModelConfig& tc = target.config();
  const int B = draft ? m.block_size : 1;
  rep.weight_bytes = target.weight_bytes_per_step() + (draft ? draft->weight_bytes_per_step() : 0);
  const int64_t weights_resident = device_used(dev) - used_before;

  if (o.kernels) bench_kernels(dev, target, o.page_size, rep);
  for (int ctx : o.contexts) {
    check(ctx + B < tc.max_positions, "bench-step: context ", ctx, " + block ", B, " exceeds the model's ",
          tc.max_positions, " positions");
    for (int batch : o.batches) {
      dev.release_cached_memory();  // the previous row's KV pages
      Batch bt(batch, ctx + B, o.page_size);
      StepCaches caches;
      caches.target = target.alloc_cache(bt.n_pages(), o.page_size, batch, B);
      for (size_t l = 0; l < caches.target.k.size(); ++l) {
        if (caches.target.k[l].empty()) continue;  // a linear-attention layer
        dev.fill_random(caches.target.k[l], 2 * l + 1, 1.0f);
        dev.fill_random(caches.target.v[l], 2 * l + 2, 1.0f);
      }
      if (draft) {
        caches.draft = draft->alloc_cache(bt.n_pages(), o.page_size);
        for (size_t l = 0; l < caches.draft.k.size(); ++l) {
          dev.fill_random(caches.draft.k[l], 1000 + 2 * l, 1.0f);
          dev.fill_random(caches.draft.v[l], 1001 + 2 * l, 1.0f);
        }
      }
      const int64_t kv_resident = kv_bytes(caches.target) + kv_bytes(caches.draft);
      DType kv_dtype = DType::BF16;
      for (const Tensor& k : caches.target.k)
        if (!k.empty()) kv_dtype = k.dtype;
      // `batch` sequences with `ctx` tokens cached (and, with a draft, their context), pending
      // token b, each taking whole steps: the decode loop's records, as the scheduler plans them.
      std::vector<Sequence> seqs(static_cast<size_t>(batch));
      for (int b = 0; b < batch; ++b) {
        Sequence& s = seqs[static_cast<size_t>(b)];
        s.tokens.assign(static_cast<size_t>(ctx), 0);
        s.n_prompt = s.n_cached = s.n_draft_ctx = ctx;
        s.pages = bt.tables[static_cast<size_t>(b)];
        s.pending = b % tc.n_vocab;
        s.max_tokens = 1 << 30;
        s.state_slot = target.is_hybrid() ? b : -1;
      }
      auto plan_of = [&](int rows) {
        StepPlan plan;
        for (auto& s : seqs) plan.decodes.push_back({&s, rows});
        return plan;
      };

      auto time_steps = [&](auto&& step) { return time_median_ms(dev, o.warmup, o.iters, step); };
      // Times the step's forward as the decode loop runs it (the forward, then one copy of its ids
      // back): op by op, as a graph replay, and restaged then replayed; `restage_us` is the
      // restaging alone. The step is laid out with a fixed shape (what graphs replay).
      // bytes_of(routed): the bytes the step must read, given how many experts each routed layer's
      // rows went to in the step's last target forward (null for a dense target).
      using BytesOf = std::function<int64_t(const std::vector<int>*)>;
      auto add_row = [&](const std::string& mode, const BytesOf& bytes_of, StepRunner& runner, int rows) {
        Step st = runner.prepare(plan_of(rows), /*fixed_shape=*/true);
        const std::function<void()> body = [&] { runner.forward(st); };
        StepBenchRow r;
        r.ms_per_step_eager = time_steps([&] {
          body();
          dev.ids_to_host(st.ids);
        });
        r.ms_per_step = r.ms_per_step_eager;
        if (dev.supports_graphs()) {
          auto g = dev.capture_graph(body);
          r.ms_per_step = time_steps([&] {
            dev.replay_graph(g);
            dev.ids_to_host(st.ids);
          });
          r.ms_per_step_restaged = time_steps([&] {
            check(dev.restage_graph(g, body), "bench-step: the ", mode, " step no longer matches its graph");
            dev.replay_graph(g);
            dev.ids_to_host(st.ids);
          });
          r.restage_us = 1e3 * time_steps([&] { dev.restage_graph(g, body); });
        }
        const double ms = r.ms_per_step;
        if (target.is_moe()) r.routed_experts = target.routed_experts();
        const int64_t bytes = bytes_of(target.is_moe() ? &r.routed_experts : nullptr);
        r.mode = mode;
        r.batch = batch;
        r.context = ctx;
        r.bytes_per_step = bytes;
        r.floor_ms = static_cast<double>(bytes) / (rep.copy_gbps * 1e9) * 1e3;
        r.fraction_of_floor = r.floor_ms / ms;
        r.gb_per_s = static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
        const int64_t used = device_used(dev);
        if (used >= 0) r.device_bytes_other = used - used_before - weights_resident - kv_resident;
        rep.rows.push_back(r);
      };

      // Plain: one token per sequence at position ctx, logits and argmax for every row.
      StepRunner plain(m, caches, /*speculative=*/false, SpecSampling::Match, /*graphs=*/false);
      add_row("plain",
              [&](const std::vector<int>* routed) {
                return target.weight_bytes_per_step(routed) +
                       batch * (kv_read_bytes(tc, ctx + 1, kv_dtype) + state_bytes_per_step(tc));
              },
              plain, 1);
      if (!draft) continue;
      // DFlash: draft block [t, M..M] (bidirectional), its argmax feeding the verification of B
      // rows on the device, feature capture, the context of all B rows projected (every draft
      // accepted: the most work).
      StepRunner dflash(m, caches, /*speculative=*/true, SpecSampling::Match, /*graphs=*/false);
      add_row("dflash",
              [&](const std::vector<int>* routed) {
                return target.weight_bytes_per_step(routed) + draft->weight_bytes_per_step() +
                       batch * (kv_read_bytes(tc, ctx + B, kv_dtype) + state_bytes_per_step(tc) +
                                kv_read_bytes(draft->config().layers, ctx + B, kv_dtype));
              },
              dflash, B);
    }
  }

  if (!o.prefills.empty()) {
    rep.matmul_tflops = matmul_tflops(dev);
    for (int prompt : o.prefills) {
      for (int batch : o.prefill_batches) {
        dev.release_cached_memory();
        Batch bt(batch, prompt + 1, o.page_size);
        StepCaches caches;
        caches.target = target.alloc_cache(bt.n_pages(), o.page_size, batch, B);
        if (draft) caches.draft = draft->alloc_cache(bt.n_pages(), o.page_size);
        StepRunner runner(m, caches, /*speculative=*/draft != nullptr, SpecSampling::Match, /*graphs=*/false);
        std::vector<Sequence> seqs(static_cast<size_t>(batch));
        int steps = 0;
        // The whole prefill of every prompt, chunked as the scheduler does: earlier sequences first,
        // at most max_tokens_per_step rows a step.
        auto prefill_all = [&] {
          for (int b = 0; b < batch; ++b) {
            Sequence& s = seqs[static_cast<size_t>(b)];
            s = Sequence{};
            s.tokens.resize(static_cast<size_t>(prompt));
            for (int i = 0; i < prompt; ++i) s.tokens[static_cast<size_t>(i)] = (7 * i + 13 * b + 3) % tc.n_vocab;
            s.n_prompt = prompt;
            s.pages = bt.tables[static_cast<size_t>(b)];
            s.max_tokens = 1;
            s.state_slot = target.is_hybrid() ? b : -1;
          }
          steps = 0;
          for (size_t next = 0; next < seqs.size();) {
            StepPlan plan;
            int room = o.max_tokens_per_step;
            for (size_t b = next; b < seqs.size() && room > 0; ++b) {
              Sequence& s = seqs[b];
              const int n = std::min(room, s.n_prompt - s.n_cached);
              plan.prefills.push_back({&s, n});
              room -= n;
            }
            Step st = runner.prepare(plan);
            runner.execute(st);
            StepCounters counters;
            runner.postprocess(st, counters);
            ++steps;
            while (next < seqs.size() && seqs[next].n_cached == seqs[next].n_prompt) ++next;
          }
        };
        PrefillBenchRow r;
        r.batch = batch;
        r.prompt = prompt;
        r.ms = time_median_ms(dev, 1, std::max(3, std::min(o.iters, 10)), prefill_all);
        r.steps = steps;
        r.tokens_per_s = static_cast<double>(batch) * prompt / (r.ms * 1e-3);
        r.tflop = batch * prefill_flop(target, prompt) / 1e12;
        r.fraction_of_matmul = r.tflop / (r.ms * 1e-3) / rep.matmul_tflops;
        rep.prefills.push_back(r);
      }
    }
  }

  // Plain decoding of one sequence for leak_check_steps steps, the whole loop (prepare, execute,
  // postprocess) op by op, watching device memory.
  const int leak_steps = std::min(o.leak_check_steps, tc.max_positions - o.contexts[0] - 1);
  if (leak_steps > 0) {
    Batch bt(1, o.contexts[0] + leak_steps + 1, o.page_size);
    StepCaches caches;
    caches.target = target.alloc_cache(bt.n_pages(), o.page_size);
    StepRunner runner(m, caches, /*speculative=*/false, SpecSampling::Match, /*graphs=*/false);
    Sequence s;
    s.state_slot = target.is_hybrid() ? 0 : -1;
    s.tokens.assign(static_cast<size_t>(o.contexts[0]), 0);
    s.n_prompt = s.n_cached = o.contexts[0];
    s.pages = bt.tables[0];
    s.pending = 0;
    s.max_tokens = 1 << 30;
    StepPlan plan;
    plan.decodes.push_back({&s, 1});
    int64_t before = -1;
    for (int i = 0; i < leak_steps; ++i) {
      if (i == std::min(10, leak_steps - 1)) {  // after the first steps have sized the allocator's pool
        dev.synchronize();
        before = device_used(dev);
      }
      Step st = runner.prepare(plan);
      runner.execute(st);
      StepCounters c;
      runner.postprocess(st, c);
    }
    dev.synchronize();
    const int64_t after = device_used(dev);
    if (before >= 0) rep.leak_check_growth_bytes = after - before;
  }
  return rep;
}

}  // namespace dflash
