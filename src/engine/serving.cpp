#include "engine/serving.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <unordered_set>

#include "engine/model_set.h"
#include "engine/sampling.h"
#include "engine/scheduler.h"
#include "engine/step_runner.h"
#include "util/error.h"

namespace dflash {

struct ServingEngine::Impl {
  ServingOptions opts;
  ModelSet m;
  bool spec = false;
  int n_pages = 0;
  std::unique_ptr<StepRunner> runner;
  std::unique_ptr<Scheduler> sched;  // touched by the engine thread only

  mutable std::mutex mu;  // guards everything below
  std::condition_variable cv;
  bool stop = false;
  uint64_t next_id = 1;
  std::vector<std::unique_ptr<ServeSeq>> incoming;
  std::unordered_set<uint64_t> cancels;
  ServingStats stats;
  std::string backend_name;
  std::thread thread;

  explicit Impl(const ServingOptions& o) : opts(o), m(o.engine) {
    spec = o.mode == SpeculativeMode::DFlash && m.draft;
    const ModelConfig& c = m.target->config();
    const int block = spec ? m.block_size : 1;
    // Default capacity: every sequence can hold 4096 positions (or the whole context when shorter).
    const int per_seq = (std::min(c.max_positions, 4096) + block + m.page_size - 1) / m.page_size + 1;
    n_pages = o.kv_pages > 0 ? o.kv_pages : o.max_num_seqs * per_seq;
    int64_t free_b = 0, total_b = 0;
    if (o.gpu_memory_fraction > 0) {
      check(m.be->memory_info(free_b, total_b), "--gpu-memory-fraction needs a GPU; the ", m.be->name(),
            " backend sizes its KV cache with --kv-pages or --max-num-seqs");
      n_pages = static_cast<int>(static_cast<double>(free_b) * o.gpu_memory_fraction / static_cast<double>(page_bytes()));
      check(n_pages > 0, "--gpu-memory-fraction ", o.gpu_memory_fraction, " of ", free_b >> 20,
            " MiB free leaves no room for one KV page");
    }
    runner = std::make_unique<StepRunner>(m, spec, o.spec_sampling, n_pages);
    sched = std::make_unique<Scheduler>(n_pages, m.page_size, spec, block, o.max_num_seqs, o.max_tokens_per_step,
                                        c.max_positions);
    stats.kv_pages_total = n_pages;
    backend_name = m.be->name();
    stats.acceptance_histogram.assign(block, 0);
    stats.position_accepted.assign(std::max(block - 1, 0), 0);
    thread = std::thread([this] { loop(); });
  }

  ~Impl() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stop = true;
    }
    cv.notify_all();
    thread.join();
  }

  // Bytes of one page in both caches (activations are bf16 on GPUs, f32 on the CPU).
  int64_t page_bytes() const {
    const int64_t elt = m.be->name() == "cpu" ? 4 : 2;
    auto per = [&](const ModelConfig& c) { return int64_t{c.n_layers} * 2 * c.n_kv_heads * c.head_dim * elt; };
    int64_t b = per(m.target->config());
    if (spec) b += per(m.draft->config().layers);
    return b * m.page_size;
  }

  static void finish(ServeSeq& s, const std::string& reason, std::vector<int32_t> tokens = {}) {
    TokenEvent e;
    e.tokens = std::move(tokens);
    e.finished = true;
    e.finish_reason = reason;
    e.n_prompt_tokens = s.n_prompt;
    s.on_event(e);
  }

  // A finished sequence's pages are free before its client hears that it ended, so that a client
  // reading the metrics right after its last event sees them free.
  struct Ended {
    std::unique_ptr<ServeSeq> seq;
    std::string reason;
    std::vector<int32_t> tokens;
  };

  void publish_cache_stats() {  // caller holds mu
    stats.kv_pages_used = sched->pages_used();
    stats.kv_pages_cached = sched->pages_cached();
    stats.prefix_hit_pages = sched->prefix_hit_pages();
    stats.n_running = sched->n_running();
    stats.n_waiting = sched->n_waiting();
    stats.n_preempted = sched->n_preempted();
  }

  void end_all(std::vector<Ended>& ended) {
    {
      std::lock_guard<std::mutex> lk(mu);
      publish_cache_stats();
    }
    for (auto& e : ended) finish(*e.seq, e.reason, std::move(e.tokens));
    ended.clear();
  }

  void loop() {
    for (;;) {
      std::vector<std::unique_ptr<ServeSeq>> fresh;
      std::unordered_set<uint64_t> cancelled;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return stop || !incoming.empty() || !cancels.empty() || !sched->empty(); });
        if (stop) break;
        fresh.swap(incoming);
        cancelled.swap(cancels);
      }
      for (auto& s : fresh) sched->add(std::move(s));
      std::vector<Ended> ended;
      for (uint64_t id : cancelled) {
        if (auto s = sched->remove(id)) ended.push_back({std::move(s), "cancelled", {}});
      }
      end_all(ended);
      step();
      std::lock_guard<std::mutex> lk(mu);
      publish_cache_stats();
    }
    for (ServeSeq* s : sched->all()) finish(*s, "cancelled");
  }

  void step() {
    const StepPlan plan = sched->schedule();
    if (plan.prefills.empty() && plan.decodes.empty()) return;
    StepCounters c;
    c.acceptance_histogram.assign(stats.acceptance_histogram.size(), 0);
    c.position_accepted.assign(stats.position_accepted.size(), 0);
    std::vector<SeqOutput> outs;
    std::vector<Ended> ended;
    try {
      outs = runner->run(plan, *sched, c);
    } catch (const std::exception& e) {
      // A failed step ends the sequences that were in it; the others go on.
      std::vector<ServeSeq*> in_step(plan.decodes);
      for (const auto& p : plan.prefills) in_step.push_back(p.seq);
      for (ServeSeq* s : in_step) {
        const uint64_t id = s->id;
        if (auto owned = sched->remove(id)) ended.push_back({std::move(owned), std::string("error: ") + e.what(), {}});
      }
      end_all(ended);
      return;
    }
    for (auto& o : outs) {
      if (o.finish_reason.empty()) {
        if (!o.tokens.empty()) {
          TokenEvent e;
          e.tokens = std::move(o.tokens);
          e.n_prompt_tokens = o.seq->n_prompt;
          o.seq->on_event(e);
        }
        continue;
      }
      ended.push_back({sched->remove(o.seq->id), o.finish_reason, std::move(o.tokens)});
    }
    {
      std::lock_guard<std::mutex> lk(mu);
      stats.n_finished += static_cast<int64_t>(ended.size());
      stats.prompt_tokens += c.prompt_tokens;
      stats.generated_tokens += c.generated_tokens;
      stats.dflash_seq_steps += c.dflash_seq_steps;
      stats.graph_steps += c.graph_steps;
      ++stats.n_steps;
      for (size_t i = 0; i < c.acceptance_histogram.size(); ++i) stats.acceptance_histogram[i] += c.acceptance_histogram[i];
      for (size_t i = 0; i < c.position_accepted.size(); ++i) stats.position_accepted[i] += c.position_accepted[i];
    }
    end_all(ended);
  }
};

ServingEngine::ServingEngine(const ServingOptions& opts) : impl_(std::make_unique<Impl>(opts)) {}
ServingEngine::~ServingEngine() = default;

uint64_t ServingEngine::submit(RequestParams p, Callback on_event) {
  const ModelConfig& c = impl_->m.target->config();
  check(!p.prompt.empty(), "the prompt is empty");
  check(p.max_tokens > 0, "max_tokens must be positive, got ", p.max_tokens);
  validate(p.sampling);
  for (size_t i = 0; i < p.prompt.size(); ++i) {
    check(p.prompt[i] >= 0 && p.prompt[i] < c.n_vocab, "prompt token ", i, " (id ", p.prompt[i],
          ") is outside the vocabulary 0..", c.n_vocab - 1);
  }
  check(static_cast<int64_t>(p.prompt.size()) < c.max_positions, "the prompt has ", p.prompt.size(),
        " tokens; the model's context is ", c.max_positions);
  // A request must fit the cache on its own, or it could wait forever.
  const int block = impl_->spec ? impl_->m.block_size : 1;
  const int64_t positions =
      std::min<int64_t>(static_cast<int64_t>(p.prompt.size()) + p.max_tokens + block, c.max_positions);
  const int need = impl_->sched->pages_for(positions);
  check(need <= impl_->n_pages, "the request needs ", need, " KV pages (", p.prompt.size(), " prompt tokens + ",
        p.max_tokens, " max_tokens); the server has ", impl_->n_pages);
  auto s = std::make_unique<ServeSeq>();
  s->tokens = std::move(p.prompt);
  s->n_prompt = static_cast<int32_t>(s->tokens.size());
  s->max_tokens = p.max_tokens;
  s->eos.insert(impl_->m.eos_ids.begin(), impl_->m.eos_ids.end());
  s->eos.insert(p.extra_eos.begin(), p.extra_eos.end());
  s->sampling = p.sampling;
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
int64_t ServingEngine::kv_cache_bytes() const { return impl_->n_pages * impl_->page_bytes(); }

}  // namespace dflash
