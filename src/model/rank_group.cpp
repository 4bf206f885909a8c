#include "model/rank_group.h"

#include "model/target_model.h"
#include "util/error.h"

namespace dflash {

RankGroup::RankGroup(const std::string& dir, int size) : group_(size), errors_(static_cast<size_t>(size)) {
  check(size >= 2, "a rank group needs at least two ranks");
  for (int r = 0; r < size; ++r) comms_.push_back(std::make_unique<HostCommunicator>(group_, r));
  for (int r = 1; r < size; ++r) {
    backends_.push_back(make_cpu_backend());
    models_.push_back(std::make_unique<TargetModel>(*backends_.back(), dir, TpRank{r, size}, comm(r)));
  }
  for (int r = 1; r < size; ++r) threads_.emplace_back([this, r] { worker(r); });
}

RankGroup::~RankGroup() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void RankGroup::worker(int rank) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* job = nullptr;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    std::exception_ptr error;
    try {
      (*job)(rank);
    } catch (const std::exception& e) {
      error = std::current_exception();
      group_.abort(cat("rank ", rank, ": ", e.what()));
    }
    std::lock_guard<std::mutex> lk(mu_);
    errors_[static_cast<size_t>(rank)] = error;
    if (--running_ == 0) cv_.notify_all();
  }
}

void RankGroup::run(const std::function<void(int)>& on_rank, const std::function<void()>& this_rank) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = &on_rank;
    running_ = size() - 1;
    for (auto& e : errors_) e = nullptr;
    ++generation_;
  }
  cv_.notify_all();
  try {
    this_rank();
  } catch (const std::exception& e) {
    errors_[0] = std::current_exception();
    group_.abort(cat("rank 0: ", e.what()));
  }
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return running_ == 0; });
  group_.reset();  // every rank is out of the group's reductions: ready for the next call
  for (const auto& e : errors_)
    if (e) std::rethrow_exception(e);
}

}  // namespace dflash
