// What tensor parallelism (model/tensor_parallel.h) needs of the devices it runs on: collectives
// between the ranks, a backend per rank, and graphs that span the ranks.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "kernels/backend.h"

namespace dflash {

// Collectives of one rank of a group; every rank calls the same ones in the same order.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int size() const = 0;  // ranks in the group
  // t = the sum of every rank's t, the same bits on every rank.
  virtual void all_reduce_sum(Backend& be, Tensor& t) = 0;
  // out = the sum of every rank's x * w^T (+ bias): a product split along K, whose shares are added
  // as all_reduce_sum adds them (the same bits). A communicator may send the shares while the
  // product runs. With defer (out goes only to the ResidualNorm that names it as rank_sum), it may
  // also leave the sum to the kernel that reads out (defer->deferred says whether it did).
  virtual void matmul_all_reduce(Backend& be, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out,
                                 RankSum* /*defer*/ = nullptr) {
    be.matmul(x, w, bias, out);
    all_reduce_sum(be, out);
  }
  // out = the routed MLP of n (Backend::norm_moe) summed over the ranks, each of which holds its
  // share of every expert's features; added as all_reduce_sum adds them. A communicator may send
  // the shares while the MLP's last kernel runs, and leave the sum as matmul_all_reduce does.
  virtual void norm_moe_all_reduce(Backend& be, const ResidualNorm& n, Tensor& h, const MoeWeights& w, Tensor& out,
                                   Tensor* expert_rows, MoeScratch* scratch, RankSum* /*defer*/ = nullptr) {
    be.norm_moe(n, h, w, out, expert_rows, scratch);
    all_reduce_sum(be, out);
  }
  // t = rank 0's t (same shape on every rank).
  virtual void broadcast(Backend& be, Tensor& t) = 0;
  // all [part.rows, size * part.cols]: row i holds row i of every rank's part side by side, rank
  // r's at columns r * part.cols (a vocabulary split's logits into whole rows).
  virtual void all_gather(Backend& be, const Tensor& part, Tensor& all) = 0;
  // ids (I32 [rows], on every rank) = the argmax of rows split by columns over the ranks, from each
  // rank's cand (Backend::argmax_candidates of its part, in rank order of columns). A communicator
  // may exchange and choose in one step.
  virtual void argmax_all(Backend& be, const Tensor& cand, Tensor& ids) {
    Tensor all = be.alloc_f32(cand.rows, size() * cand.cols);
    all_gather(be, cand, all);
    be.argmax_of_candidates(all, ids);
  }
  // all_gather of every rank's x * w^T (a product split along N). A communicator may send the
  // parts while the products run.
  virtual void matmul_all_gather(Backend& be, const Tensor& x, const Tensor& w, Tensor& all) {
    Tensor part = be.alloc(x.rows, w.rows);
    be.matmul(x, w, nullptr, part);
    all_gather(be, part, all);
  }
};

// The devices of a tensor-parallel group: rank r's backend and communicator. Rank 0's backend is
// the caller's; the others are made on the thread that runs the rank (a GPU is its thread's).
class RankDevices {
 public:
  virtual ~RankDevices() = default;
  virtual int size() const = 0;
  virtual std::unique_ptr<Backend> make_backend(int rank) = 0;  // rank >= 1
  virtual Communicator& comm(int rank) = 0;
  // Whether the ranks' threads wait for each other's calls by spinning a while before they sleep:
  // where a rank's thread only queues work on its device, a thread that wakes late makes every
  // device wait for its launches in the first collective. Not where the threads compute (CPU).
  virtual bool spin_waits() const { return false; }
  // A rank failed: ranks waiting in a collective on the host, or arriving at one, stop with an
  // error naming why.
  virtual void abort(const std::string& why) = 0;
  // After a call of the ranks, once none is inside a collective: ready for the next. alike: every
  // rank failed with the same error (or none failed), so no rank queued a collective that another
  // will not match; otherwise a group whose collectives run on devices stops for good (every
  // later collective is refused with the first failure).
  virtual void reset(bool alike) = 0;
};

// GPUs 0..size-1 of this process with NCCL communicators; rank0 must be the CUDA backend of GPU 0.
// Error when this build has no NCCL, or the GPUs are too few or not all of one kind.
std::unique_ptr<RankDevices> make_cuda_rank_devices(const Backend& rank0, int size);

// The other ranks of a tensor-parallel group, as rank 0's backend sees them in its graphs: while
// rank 0 captures or restages a graph, the ranks' work that its body drives is captured or
// restaged with it, and a replay of rank 0's graph replays theirs (Backend::set_graph_peers).
class GraphPeers {
 public:
  virtual ~GraphPeers() = default;
  virtual void begin_capture(bool share_uploads) = 0;
  // The ranks' graphs of the capture; null when one of them failed (rank 0's capture fails then).
  virtual std::shared_ptr<void> end_capture() = 0;
  virtual void begin_restage(const std::shared_ptr<void>& graphs) = 0;
  virtual bool end_restage() = 0;  // false: a rank's part no longer matches its graph
  virtual void cancel() = 0;       // rank 0's capture or restage stopped with an error
  // Launches the ranks' graphs while own() (rank 0's launch of its part) runs: a GPU whose
  // launch came after rank 0's would reach the first collective late, with rank 0 waiting there.
  virtual void replay(const std::shared_ptr<void>& graphs, const std::function<void()>& own) = 0;
};

}  // namespace dflash
