#include "model/rank_group.h"

#include <chrono>

#include "model/target_model.h"
#include "util/error.h"

namespace dflash {

namespace {

// Longer than a decoding step, so that a rank's thread is awake when the next step's call comes
// (measured on two H100s: 60 us a step were the threads' wake-ups); an idle group sleeps after it.
constexpr auto kSpin = std::chrono::milliseconds(20);

std::string what_of(const std::exception_ptr& e) {
  if (!e) return {};
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace

struct RankGroup::PeerGraphs {
  std::vector<std::vector<std::shared_ptr<void>>> of_rank;  // [rank - 1][run call]
};

RankGroup::RankGroup(const std::string& dir, std::unique_ptr<RankDevices> devices)
    : dir_(dir), devices_(std::move(devices)) {
  const int n = devices_->size();
  check(n >= 2, "a rank group needs at least two ranks");
  backends_.resize(static_cast<size_t>(n - 1));
  models_.resize(static_cast<size_t>(n - 1));
  load_errors_.resize(static_cast<size_t>(n));
  errors_.resize(static_cast<size_t>(n));
  loading_ = n - 1;
  for (int r = 1; r < n; ++r) threads_.emplace_back([this, r] { worker(r); });
}

RankGroup::~RankGroup() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void RankGroup::wait_loaded() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return loading_ == 0; });
  for (const auto& e : load_errors_)
    if (e) std::rethrow_exception(e);
}

void RankGroup::worker(int rank) {
  const size_t i = static_cast<size_t>(rank - 1);
  try {
    backends_[i] = devices_->make_backend(rank);
    models_[i] = std::make_unique<TargetModel>(*backends_[i], dir_, TpRank{rank, size()}, comm(rank));
  } catch (const std::exception& e) {
    load_errors_[static_cast<size_t>(rank)] = std::make_exception_ptr(Error(cat("tensor-parallel rank ", rank, ": ", e.what())));
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    --loading_;
  }
  cv_.notify_all();
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* job = nullptr;
    spin_until([&] { return posted_.load(std::memory_order_acquire) != seen; });
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) break;
      seen = generation_;
      job = job_;
    }
    std::exception_ptr error;
    try {
      (*job)(rank);
    } catch (const std::exception& e) {
      error = std::current_exception();
      devices_->abort(cat("rank ", rank, ": ", e.what()));
    }
    std::lock_guard<std::mutex> lk(mu_);
    errors_[static_cast<size_t>(rank)] = error;
    if (--running_ == 0) cv_.notify_all();
  }
  models_[i].reset();  // a GPU's memory is freed on the thread whose device it is
  backends_[i].reset();
}

void RankGroup::run(const std::function<void(int)>& on_rank, const std::function<void()>& this_rank) {
  const size_t call = call_++;
  std::function<void(int)> job;
  if (phase_ == Phase::capture) {
    job = [&](int r) {
      try {
        auto g = backend(r).capture_graph([&] { on_rank(r); }, share_uploads_);
        current_->of_rank[static_cast<size_t>(r - 1)].push_back(std::move(g));
      } catch (const Error&) {
        failed_ = true;  // rank 0's capture is refused with it (end_capture), and the step runs eagerly
      }
    };
  } else if (phase_ == Phase::restage) {
    job = [&](int r) {
      const auto& graphs = current_->of_rank[static_cast<size_t>(r - 1)];
      if (call >= graphs.size() || !backend(r).restage_graph(graphs[call], [&] { on_rank(r); })) failed_ = true;
    };
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = job ? &job : &on_rank;
    running_ = size() - 1;
    for (auto& e : errors_) e = nullptr;
    ++generation_;
    posted_.store(generation_, std::memory_order_release);
  }
  cv_.notify_all();
  try {
    this_rank();
  } catch (const std::exception& e) {
    errors_[0] = std::current_exception();
    devices_->abort(cat("rank 0: ", e.what()));
  }
  spin_until([&] { return running_.load(std::memory_order_acquire) == 0; });
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return running_ == 0; });
  // Every rank is out of the group's collectives. Ranks that all failed alike (a check of the
  // batch every rank makes) leave the group usable.
  bool alike = true;
  for (const auto& e : errors_) alike = alike && what_of(e) == what_of(errors_[0]);
  devices_->reset(alike);
  for (const auto& e : errors_)
    if (e) std::rethrow_exception(e);
}

void RankGroup::spin_until(const std::function<bool()>& done) const {
  if (!devices_->spin_waits()) return;
  const auto until = std::chrono::steady_clock::now() + kSpin;
  while (!done() && std::chrono::steady_clock::now() < until) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();  // yields the core's pipeline to a sibling hyperthread while spinning
#endif
  }
}

KvCache RankGroup::alloc_caches(const std::function<KvCache(int)>& alloc) {
  KvCache cache;
  std::vector<KvCache> others(static_cast<size_t>(size() - 1));
  run([&](int r) { others[static_cast<size_t>(r - 1)] = alloc(r); }, [&] { cache = alloc(0); });
  cache.ranks = std::move(others);
  return cache;
}

void RankGroup::begin_capture(bool share_uploads) {
  phase_ = Phase::capture;
  share_uploads_ = share_uploads;
  current_ = std::make_shared<PeerGraphs>();
  current_->of_rank.resize(static_cast<size_t>(size() - 1));
  call_ = 0;
  failed_ = false;
}

std::shared_ptr<void> RankGroup::end_capture() {
  phase_ = Phase::eager;
  std::shared_ptr<PeerGraphs> g = std::move(current_);
  current_.reset();
  if (failed_) return nullptr;
  return g;
}

void RankGroup::begin_restage(const std::shared_ptr<void>& graphs) {
  phase_ = Phase::restage;
  current_ = std::static_pointer_cast<PeerGraphs>(graphs);
  call_ = 0;
  failed_ = false;
}

bool RankGroup::end_restage() {
  phase_ = Phase::eager;
  bool ok = !failed_;
  for (const auto& graphs : current_->of_rank) ok = ok && graphs.size() == call_;
  current_.reset();
  return ok;
}

void RankGroup::cancel() {
  phase_ = Phase::eager;
  current_.reset();
}

void RankGroup::replay(const std::shared_ptr<void>& graphs, const std::function<void()>& own) {
  const auto* g = static_cast<const PeerGraphs*>(graphs.get());
  run(
      [&](int r) {
        for (const auto& graph : g->of_rank[static_cast<size_t>(r - 1)]) backend(r).replay_graph(graph);
      },
      own);
}

}  // namespace dflash
