// Tensor parallelism, Megatron style: rank r of N holds heads [r*H/N, (r+1)*H/N) of every
// attention layer (their q/k/v rows and o_proj's columns; with fewer KV heads than ranks, the KV
// head they read, replicated), of every Gated DeltaNet layer its key
// heads' share with their value heads (projection rows, convolution channels, gates, out_proj's
// columns) and an N-th of every MLP's features, each routed expert's and the shared expert's
// included (gate/up rows, down_proj's columns; the router is whole, so every rank routes alike);
// embedding and norms are whole on every rank, lm_head's rows (the vocabulary) are split when they
// divide, the ranks' logits gathered. Each
// rank runs the ordinary forward over its shard; the attention's and the MLP's outputs, partial
// sums over the ranks' heads and features, are summed across ranks (Communicator) before they join
// the residual stream, which so stays the same on every rank.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "formats/model_config.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"

namespace dflash {

struct TpRank {
  int rank = 0, size = 1;
  bool sharded() const { return size > 1; }
};

// The shape one rank runs: heads, KV heads, linear-attention heads and MLP features divided by the
// group size. Error naming the field when one does not divide.
ModelConfig shard_config(const ModelConfig& full, const TpRank& tp, const std::string& where);

// Ranks that are threads of this process on CPU backends (tests, and the CPU's own tensor
// parallelism): every rank publishes its tensor, then each adds them up in rank order, so every
// rank holds the same bits. A rank that fails calls abort(): the others, waiting for it in a
// reduction or arriving at one later, throw Error naming the failure instead of waiting forever.
class HostGroup {
 public:
  explicit HostGroup(int size);
  int size() const { return size_; }
  void abort(const std::string& why);
  void reset();  // clears an abort; only while no rank is inside a reduction

 private:
  friend class HostCommunicator;
  void arrive_and_wait();  // a barrier of all ranks; throws once aborted
  int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::string aborted_;  // non-empty: why the group stopped
  std::vector<const Tensor*> published_;
};

class HostCommunicator final : public Communicator {
 public:
  HostCommunicator(HostGroup& group, int rank) : group_(group), rank_(rank) {}
  int size() const override { return group_.size(); }
  void all_reduce_sum(Backend& be, Tensor& t) override;
  void broadcast(Backend& be, Tensor& t) override;
  void all_gather(Backend& be, const Tensor& part, Tensor& all) override;

 private:
  HostGroup& group_;
  int rank_;
};

// Ranks on CPU backends of this process (HostGroup).
std::unique_ptr<RankDevices> make_host_rank_devices(int size);

}  // namespace dflash
