// The ranks of a tensor-parallel target beyond the first (TargetModel with tensor_parallel > 1):
// each on its own backend (CPU, or a GPU of its own) and thread, running rank 0's forwards over
// its own shard at the same time (they meet in the collectives of kernels/communicator.h). As
// rank 0's GraphPeers, the group captures, restages and replays its ranks' forwards with the
// graphs of rank 0's steps.
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "model/tensor_parallel.h"

namespace dflash {

class TargetModel;

class RankGroup final : public GraphPeers {
 public:
  // Starts loading ranks 1..size-1 of checkpoint `dir`, each on its thread (wait_loaded waits);
  // rank 0 is the caller's, with communicator comm(0).
  RankGroup(const std::string& dir, std::unique_ptr<RankDevices> devices);
  ~RankGroup() override;
  // Rethrows the first rank's load error (naming the rank).
  void wait_loaded();
  int size() const { return devices_->size(); }
  Communicator* comm(int rank) { return &devices_->comm(rank); }
  TargetModel& model(int rank) { return *models_[static_cast<size_t>(rank - 1)]; }  // 1..size-1
  Backend& backend(int rank) { return *backends_[static_cast<size_t>(rank - 1)]; }  // 1..size-1
  // Runs on_rank(r) for every rank r > 0 on its thread and this_rank() on the caller's, together;
  // a failure on any rank stops the others and is rethrown here (this rank's first). While rank
  // 0 captures or restages a graph, on_rank is captured or restaged on each rank's backend.
  void run(const std::function<void(int)>& on_rank, const std::function<void()>& this_rank);
  // A cache made on every rank together (alloc(r) on rank r's thread): rank 0's, holding the
  // others' in KvCache::ranks.
  KvCache alloc_caches(const std::function<KvCache(int)>& alloc);

  void begin_capture(bool share_uploads) override;
  std::shared_ptr<void> end_capture() override;
  void begin_restage(const std::shared_ptr<void>& graphs) override;
  bool end_restage() override;
  void cancel() override;
  void replay(const std::shared_ptr<void>& graphs, const std::function<void()>& own) override;

 private:
  struct PeerGraphs;  // per rank 1.., the graphs of the run calls of one rank-0 graph, in order
  enum class Phase { eager, capture, restage };
  void worker(int rank);
  // Spins until done() holds or a while has passed (only where the devices ask for it).
  void spin_until(const std::function<bool()>& done) const;

  std::string dir_;
  std::unique_ptr<RankDevices> devices_;
  std::vector<std::unique_ptr<Backend>> backends_;  // ranks 1.., made and destroyed on their threads
  std::vector<std::unique_ptr<TargetModel>> models_;
  std::mutex mu_;
  std::condition_variable cv_;
  int loading_ = 0;
  std::vector<std::exception_ptr> load_errors_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  // Read without the lock by threads spinning before they wait (RankDevices::spin_waits).
  std::atomic<uint64_t> posted_{0};  // generation_
  std::atomic<int> running_{0};
  bool stop_ = false;
  std::vector<std::exception_ptr> errors_;
  std::vector<std::thread> threads_;
  // Graphs (rank 0's thread only, but failed_ is set by the ranks').
  Phase phase_ = Phase::eager;
  bool share_uploads_ = true;
  std::shared_ptr<PeerGraphs> current_;
  size_t call_ = 0;
  std::atomic<bool> failed_{false};
};

}  // namespace dflash
