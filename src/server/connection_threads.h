// The HTTP server's threads: one per connection being served, started as connections come and
// kept for later ones. cpp-httplib serves a connection on one thread for as long as the client
// keeps it open (keep-alive included), so a fixed pool of N threads left every connection after
// the N-th waiting, not for a free engine slot but for another client to close: under a load of
// more clients than threads, the extra clients got no answer while the others kept sending, and
// /health waited too. Only past `max_threads` connections do new ones wait for a thread.
#pragma once

#include <httplib.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace dflash::server {

class ConnectionThreads : public httplib::TaskQueue {
 public:
  explicit ConnectionThreads(size_t max_threads) : max_threads_(max_threads) {}
  ~ConnectionThreads() override { shutdown(); }

  void enqueue(std::function<void()> fn) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      jobs_.push_back(std::move(fn));
      // Every waiting job needs a thread of its own: a job may hold its thread for minutes.
      if (!stopping_ && jobs_.size() > idle_ && threads_.size() < max_threads_) {
        try {
          threads_.emplace_back([this] { work(); });
        } catch (const std::system_error&) {
          // The system's thread limit: the job waits for a thread of the ones there are.
          if (threads_.empty()) throw;
        }
      }
    }
    cv_.notify_one();
  }

  // Called every 50 ms while shutdown() waits for the jobs: what ends the connections that are done
  // (a job runs until its client closes the connection, or the keep-alive timeout).
  std::function<void()> end_idle;

  void shutdown() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.notify_all();
    for (;;) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (running_ == 0 && jobs_.empty()) break;
      }
      if (end_idle) end_idle();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    for (std::thread& t : threads_) t.join();
  }

 private:
  void work() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        ++idle_;
        cv_.wait(lk, [&] { return stopping_ || !jobs_.empty(); });
        --idle_;
        if (jobs_.empty()) return;  // stopping, nothing left
        job = std::move(jobs_.front());
        jobs_.pop_front();
        ++running_;
      }
      job();
      std::lock_guard<std::mutex> lk(mu_);
      --running_;
    }
  }

  const size_t max_threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;  // grows under mu_ until stopping_; joined by shutdown()
  size_t idle_ = 0;                   // threads waiting for a job
  size_t running_ = 0;                // jobs being run
  bool stopping_ = false;
};

}  // namespace dflash::server
