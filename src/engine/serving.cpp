#include "engine/serving.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <unordered_set>

#include "engine/decode_loop.h"
#include "engine/model_set.h"
#include "engine/sequence.h"
#include "util/error.h"

namespace dflash {

namespace {

// Hybrid targets' state snapshots (ServingOptions::state_snapshots). By default a quarter of the
// running sequences' slots: a state is large (about 151 MB at the Qwen3.5-27B shape), and a kept
// one is worth most for the conversations that come back soon.
int plan_snapshots(const ServingOptions& o, const ModelSet& m) {
  if (!m.target->is_hybrid()) return 0;
  return o.state_snapshots < 0 ? std::max(1, o.max_num_seqs / 4) : o.state_snapshots;
}

// KV pages of each cache: --kv-pages, else a fraction of the free device memory (less the hybrid
// targets' state slots), else enough for every sequence to hold 4096 positions (or the whole
// context when shorter).
int plan_pages(const ServingOptions& o, ModelSet& m, bool spec) {
  const ModelConfig& c = m.target->config();
  const int block = spec ? m.block_size : 1;
  if (o.kv_pages > 0) return o.kv_pages;
  if (o.gpu_memory_fraction <= 0) {
    const int per_seq = (std::min(c.max_positions, 4096) + block + m.page_size - 1) / m.page_size + 1;
    return o.max_num_seqs * per_seq;
  }
  int64_t free_b = 0, total_b = 0;
  check(m.be->memory_info(free_b, total_b), "--gpu-memory-fraction needs a GPU; the ", m.be->name(),
        " backend sizes its KV cache with --kv-pages or --max-num-seqs");
  // Bytes of one page in both caches (activations are bf16 on GPUs, f32 on the CPU).
  const int64_t elt = m.be->name() == "cpu" ? 4 : 2;
  auto per = [&](const ModelConfig& mc) { return int64_t{mc.n_layers} * 2 * mc.n_kv_heads * mc.head_dim * elt; };
  const int64_t page_bytes = (per(c) + (spec ? per(m.draft->config().layers) : 0)) * m.page_size;
  const int64_t state_b = (o.max_num_seqs + plan_snapshots(o, m)) * m.target->state_slot_bytes(block);
  const double budget = static_cast<double>(free_b) * o.gpu_memory_fraction - static_cast<double>(state_b);
  const int n = static_cast<int>(std::max(budget, 0.0) / static_cast<double>(page_bytes));
  check(n > 0, "--gpu-memory-fraction ", o.gpu_memory_fraction, " of ", free_b >> 20, " MiB free leaves no room for one KV page",
        state_b > 0 ? cat(" beside ", state_b >> 20, " MiB of recurrent states") : std::string());
  return n;
}

}  // namespace

struct ServingEngine::Impl {
  ServingOptions opts;
  ModelSet m;
  bool spec = false;
  int n_pages = 0;
  std::unique_ptr<DecodeLoop> loop;  // touched by the engine thread only

  mutable std::mutex mu;  // guards everything below
  std::condition_variable cv;
  bool stop = false;
  uint64_t next_id = 1;
  std::vector<std::unique_ptr<Sequence>> incoming;
  std::unordered_set<uint64_t> cancels;
  ServingStats stats;
  std::string backend_name;
  std::thread thread;

  explicit Impl(const ServingOptions& o) : opts(o), m(o.engine) {
    check(o.mode == SpeculativeMode::None || m.draft, "DFlash serving needs a draft model (--draft)");
    spec = o.mode == SpeculativeMode::DFlash;
    n_pages = plan_pages(o, m, spec);
    // DFlash steps take `block` rows a sequence: 128 sequences of 16 filled 2048 rows, and prompts
    // that came last waited for sequences to end (H100, 8B shape, 128 clients at once: largest
    // time to first token 4.5 s at 2048 rows, 0.65 s at 4096;
    // bench/results/serving_gpu_h100_qwen3-8b-shape_step_rows_c128.txt).
    if (opts.max_tokens_per_step <= 0) opts.max_tokens_per_step = std::max(2048, 2 * o.max_num_seqs * block_size());
    LoopOptions lo;
    lo.speculative = spec;
    lo.spec_sampling = o.spec_sampling;
    lo.n_pages = n_pages;
    lo.max_num_seqs = o.max_num_seqs;
    lo.max_tokens_per_step = opts.max_tokens_per_step;
    lo.graphs = o.engine.graphs;
    lo.state_snapshots = plan_snapshots(o, m);
    loop = std::make_unique<DecodeLoop>(m, lo);
    // A finished sequence's pages are free before its client hears that it ended, so that a
    // client reading the metrics right after its last event sees them free.
    loop->on_pages_freed = [this] {
      std::lock_guard<std::mutex> lk(mu);
      publish();
    };
    backend_name = m.be->name();
    if (backend_name != "cpu") warm_up();
    publish();
    thread = std::thread([this] { run(); });
  }

  ~Impl() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stop = true;
    }
    cv.notify_all();
    thread.join();
  }

  // A few requests before the first client's: kernels load (lazily, on first launch), workspaces
  // grow and the step graphs of one sequence are captured. Prompts of one chunk and of 1000, 500,
  // 200 and 40 tokens, each with a few decode steps and tokens of its own: prompts that shared
  // the first one's tokens hit the prefix cache and prefilled a page each, so only one prefill
  // size was warm (H100, 8B shape, a fresh server's first 512-token prompt: 29.9 -> 22.5 ms, later
  // ones 14.9). The counters start from zero after it. Their products also run the kernels of
  // every row count a step can have (prepare_products, lt_gemm.h).
  void warm_up() {
    const ModelConfig& c = m.target->config();
    m.target->prepare_products(opts.max_tokens_per_step);
    const int longest = std::min(opts.max_tokens_per_step, c.max_positions - 2 * std::max(block_size(), 1) - 8);
    int k = 0;
    for (int n : {longest, 1000, 500, 200, 40}) {
      ++k;
      if (n < 1 || n > longest || loop->scheduler().pages_for(n + 8 + block_size()) > n_pages) continue;
      auto s = std::make_unique<Sequence>();
      for (int i = 0; i < n; ++i) s->tokens.push_back(static_cast<int32_t>((int64_t{i} * 7919 + 13 * k) % c.n_vocab));
      s->n_prompt = n;
      s->max_tokens = 4;
      s->on_event = [](const TokenEvent&) {};
      loop->add(std::move(s));
      while (!loop->idle()) loop->step();
    }
    loop->reset_stats();
  }

  int block_size() const { return spec ? m.block_size : 1; }

  void publish() {  // caller holds mu (or the engine thread is not running yet)
    const Scheduler& s = loop->scheduler();
    const LoopStats& l = loop->stats();
    stats.kv_pages_total = n_pages;
    stats.kv_pages_used = s.pages_used();
    stats.kv_pages_cached = s.pages_cached();
    stats.prefix_hit_pages = s.prefix_hit_pages();
    stats.state_snapshots_taken = s.state_snapshots_taken();
    stats.n_running = s.n_running();
    stats.n_waiting = s.n_waiting();
    stats.n_preempted = s.n_preempted();
    stats.n_finished = l.n_finished;
    stats.prompt_tokens = l.prompt_tokens;
    stats.generated_tokens = l.generated_tokens;
    stats.n_steps = l.n_steps;
    stats.dflash_seq_steps = l.dflash_seq_steps;
    stats.graph_steps = l.graph_steps;
    stats.acceptance_histogram = l.acceptance_histogram;
    stats.position_accepted = l.position_accepted;
  }

  void run() {
    for (;;) {
      std::vector<std::unique_ptr<Sequence>> fresh;
      std::unordered_set<uint64_t> cancelled;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return stop || !incoming.empty() || !cancels.empty() || !loop->idle(); });
        if (stop) break;
        fresh.swap(incoming);
        cancelled.swap(cancels);
      }
      for (auto& s : fresh) loop->add(std::move(s));
      for (uint64_t id : cancelled) loop->cancel(id);
      loop->step();
      std::lock_guard<std::mutex> lk(mu);
      publish();
    }
    loop->cancel_all();
  }
};

ServingEngine::ServingEngine(const ServingOptions& opts) : impl_(std::make_unique<Impl>(opts)) {}
ServingEngine::~ServingEngine() = default;

uint64_t ServingEngine::submit(RequestParams p, Callback on_event) {
  const ModelConfig& c = impl_->m.target->config();
  validate_request(c, p.prompt, p.max_tokens, p.sampling);
  // A request must fit the cache on its own, or it could wait forever.
  const int64_t positions =
      std::min<int64_t>(static_cast<int64_t>(p.prompt.size()) + p.max_tokens + block_size(), c.max_positions);
  const int need = impl_->loop->scheduler().pages_for(positions);
  check(need <= impl_->n_pages, "the request needs ", need, " KV pages (", p.prompt.size(), " prompt tokens + ",
        p.max_tokens, " max_tokens); the server has ", impl_->n_pages);
  auto s = std::make_unique<Sequence>();
  s->tokens = std::move(p.prompt);
  s->n_prompt = static_cast<int32_t>(s->tokens.size());
  s->max_tokens = p.max_tokens;
  if (!p.ignore_eos) {
    s->eos.insert(impl_->m.eos_ids.begin(), impl_->m.eos_ids.end());
    s->eos.insert(p.extra_eos.begin(), p.extra_eos.end());
  }
  s->sampling = p.sampling;
  s->logprobs = p.logprobs;
  s->share_prefix_with = p.share_prefix_with;
  s->on_event = std::move(on_event);
  uint64_t id;
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    id = s->id = impl_->next_id++;
    impl_->incoming.push_back(std::move(s));
  }
  impl_->cv.notify_all();
  return id;
}

void ServingEngine::cancel(uint64_t id) {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->cancels.insert(id);
  }
  impl_->cv.notify_all();
}

ServingStats ServingEngine::stats() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->stats;
}

const ModelConfig& ServingEngine::target_config() const { return impl_->m.target->config(); }
int ServingEngine::block_size() const { return impl_->spec ? impl_->m.block_size : 1; }
bool ServingEngine::speculative() const { return impl_->spec; }
const std::string& ServingEngine::backend_name() const { return impl_->backend_name; }
int ServingEngine::max_num_seqs() const { return impl_->opts.max_num_seqs; }
int ServingEngine::max_tokens_per_step() const { return impl_->opts.max_tokens_per_step; }
int64_t ServingEngine::kv_cache_bytes() const { return impl_->loop->kv_cache_bytes(); }

}  // namespace dflash
