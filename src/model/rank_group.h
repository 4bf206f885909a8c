// The ranks of a tensor-parallel target beyond the first (TargetModel with tensor_parallel > 1):
// each on its own CPU backend and thread, running rank 0's forwards over its own shard at the same
// time (they meet in the all-reduces of tensor_parallel.h).
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels/backend.h"
#include "model/tensor_parallel.h"

namespace dflash {

class TargetModel;

class RankGroup {
 public:
  // Loads ranks 1..size-1 of checkpoint `dir`; rank 0 is the caller's, with communicator comm(0).
  RankGroup(const std::string& dir, int size);
  ~RankGroup();
  int size() const { return group_.size(); }
  Communicator* comm(int rank) { return comms_[static_cast<size_t>(rank)].get(); }
  TargetModel& model(int rank) { return *models_[static_cast<size_t>(rank - 1)]; }  // 1..size-1
  // Runs on_rank(r) for every rank r > 0 on its thread and this_rank() on the caller's, together;
  // a failure on any rank stops the others and is rethrown here (this rank's first), after which
  // the group is ready for the next call.
  void run(const std::function<void(int)>& on_rank, const std::function<void()>& this_rank);

 private:
  void worker(int rank);

  HostGroup group_;
  std::vector<std::unique_ptr<HostCommunicator>> comms_;
  std::vector<std::unique_ptr<Backend>> backends_;  // ranks 1..
  std::vector<std::unique_ptr<TargetModel>> models_;
  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int running_ = 0;
  bool stop_ = false;
  std::vector<std::exception_ptr> errors_;
  std::vector<std::thread> threads_;
};

}  // namespace dflash
