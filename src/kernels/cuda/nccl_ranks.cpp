// Tensor-parallel ranks on the GPUs of this process: one CUDA backend per GPU, NCCL communicators
// created together at load (ncclCommInitAll), collectives queued on each rank's stream (so they
// are captured into its graphs like kernels).
#include <nccl.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/communicator.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/peer_collectives.h"
#include "util/error.h"

#define NCCL_CHECK(call)                                                                                 \
  do {                                                                                                   \
    const ncclResult_t r_ = (call);                                                                      \
    if (r_ != ncclSuccess)                                                                               \
      throw ::dflash::Error(::dflash::cat("NCCL error at ", __FILE__, ":", __LINE__, ": ", #call, ": ", \
                                          ncclGetErrorString(r_)));                                      \
  } while (0)

namespace dflash {
namespace {

cuda::CudaBackend& cuda_of(Backend& be) {
  auto* c = dynamic_cast<cuda::CudaBackend*>(&be);
  check(c != nullptr, "NCCL collectives need the CUDA backend, not ", be.name());
  return *c;
}

ncclDataType_t nccl_type(const Tensor& t) {
  switch (t.dtype) {
    case DType::F32: return ncclFloat32;
    case DType::BF16: return ncclBfloat16;
    case DType::I32: return ncclInt32;
    default: throw Error(cat("NCCL collectives: unsupported tensor type ", dtype_name(t.dtype)));
  }
}

// The group's memory for the peer collectives: on each GPU its inbox, acknowledgements and call
// counts, the pushed sums' inbox, call count and block count (all zeroed), and one host-mapped
// stop flag. Only where every GPU reaches every other, and
// for at most kPeerMaxRanks GPUs.
class PeerMemory {
 public:
  explicit PeerMemory(int size) {
    if (size > cuda::kPeerMaxRanks) return;  // NCCL alone then
    for (int i = 0; i < size; ++i)
      for (int j = 0; j < size; ++j) {
        int ok = 0;
        if (i != j && (cudaDeviceCanAccessPeer(&ok, i, j) != cudaSuccess || !ok)) return;  // NCCL alone then
      }
    CUDA_CHECK(cudaHostAlloc(&stop_, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
    *stop_ = 0;
    args_.resize(static_cast<size_t>(size));
    const size_t inbox_bytes = static_cast<size_t>(cuda::kPeerInboxBytesPerPeer) * static_cast<size_t>(size - 1);
    const size_t acks_bytes = sizeof(uint64_t) * cuda::kPeerMaxBlocks * cuda::kPeerMaxRanks;
    const size_t calls_bytes = sizeof(uint64_t) * cuda::kPeerMaxBlocks;
    const size_t push_inbox_bytes = static_cast<size_t>(cuda::kPushInboxBytesPerPeer) * static_cast<size_t>(size - 1);
    push_.resize(static_cast<size_t>(size));
    std::vector<uint2*> push_inbox(static_cast<size_t>(size));
    for (int d = 0; d < size; ++d) {
      cuda::DeviceGuard on(d);
      for (int p = 0; p < size; ++p) {
        if (p == d) continue;
        const cudaError_t e = cudaDeviceEnablePeerAccess(p, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
        else CUDA_CHECK(e);
      }
      void* inbox = alloc_zeroed(d, inbox_bytes);
      void* acks = alloc_zeroed(d, acks_bytes);
      void* calls = alloc_zeroed(d, calls_bytes);
      push_inbox[static_cast<size_t>(d)] = static_cast<uint2*>(alloc_zeroed(d, push_inbox_bytes));
      cuda::PeerPush& pp = push_[static_cast<size_t>(d)];
      pp.calls = static_cast<uint64_t*>(alloc_zeroed(d, sizeof(uint64_t)));
      pp.done = static_cast<unsigned*>(alloc_zeroed(d, sizeof(unsigned)));
      pp.stop = stop_;
      pp.rank = d;
      pp.n_ranks = size;
      CUDA_CHECK(cudaDeviceSynchronize());
      for (int r = 0; r < size; ++r) {
        args_[static_cast<size_t>(r)].inbox[d] = static_cast<uint4*>(inbox);
        args_[static_cast<size_t>(r)].acks[d] = static_cast<uint64_t*>(acks);
      }
      args_[static_cast<size_t>(d)].calls = static_cast<uint64_t*>(calls);
      args_[static_cast<size_t>(d)].rank = d;
      args_[static_cast<size_t>(d)].n_ranks = size;
      args_[static_cast<size_t>(d)].stop = stop_;
    }
    // Rank r's slot in rank q's push inbox: r, less one past q (as the collectives' inbox).
    auto slot = [&](int r, int q) {
      return push_inbox[static_cast<size_t>(q)] + (r < q ? r : r - 1) * 2 * cuda::kPushMaxWords;
    };
    for (int r = 0; r < size; ++r)
      for (int q = 0; q < size; ++q) {
        if (q == r) continue;
        push_[static_cast<size_t>(r)].to[q] = slot(r, q);
        push_[static_cast<size_t>(r)].from[q] = slot(q, r);
      }
  }
  ~PeerMemory() {
    for (const auto& [device, p] : owned_) {
      cuda::DeviceGuard on(device);
      cudaFree(p);
    }
    if (stop_) cudaFreeHost(stop_);
  }
  // Null where the GPUs lack peer access.
  const cuda::PeerArgs* args(int rank) const {
    return args_.empty() ? nullptr : &args_[static_cast<size_t>(rank)];
  }
  const cuda::PeerPush* push(int rank) const { return push_.empty() ? nullptr : &push_[static_cast<size_t>(rank)]; }
  void stop() {
    if (stop_) *static_cast<volatile int*>(stop_) = 1;
  }

 private:
  void* alloc_zeroed(int device, size_t bytes) {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, bytes));
    owned_.push_back({device, p});
    CUDA_CHECK(cudaMemset(p, 0, bytes));
    return p;
  }
  int* stop_ = nullptr;
  std::vector<cuda::PeerArgs> args_;
  std::vector<cuda::PeerPush> push_;
  std::vector<std::pair<int, void*>> owned_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, const cuda::PeerArgs* peer, const cuda::PeerPush* push, const std::string* stopped)
      : comm_(comm), peer_(peer), push_(push), stopped_(stopped) {}
  int size() const override {
    int n = 0;
    NCCL_CHECK(ncclCommCount(comm_, &n));
    return n;
  }
  void all_reduce_sum(Backend& be, Tensor& t) override {
    auto& c = ready(be, t, "all-reduce");
    const int64_t n = t.rows * t.cols;
    if (peer_ && t.dtype == DType::BF16 &&
        cuda::peer_collective_fits(t.data, 2 * n, cuda::peer_all_reduce_max_bytes(peer_->n_ranks))) {
      c.launch_library([&](cudaStream_t s) { cuda::launch_peer_all_reduce(*peer_, static_cast<cuda::bf16*>(t.data), n, s); });
      return;
    }
    c.launch_library([&](cudaStream_t s) {
      NCCL_CHECK(ncclAllReduce(t.data, t.data, static_cast<size_t>(n), nccl_type(t), ncclSum, comm_, s));
    });
  }
  // Where the product is the skinny kernel's, its blocks send their outputs as they finish, and
  // the sum is left to the kernel that reads out (defer) or to a small kernel after the product.
  void matmul_all_reduce(Backend& be, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out,
                         RankSum* defer) override {
    auto& c = ready(be, out, "all-reduce");
    if (push_ && out.dtype == DType::BF16 && out.stride == out.cols &&
        cuda::peer_push_fits(out.data, out.rows, out.cols, out.stride) && c.matmul_pushing(x, w, bias, out, *push_)) {
      RankSum sum{true, push_};
      if (defer) *defer = sum;
      else c.finish_rank_sum(sum, out);
      return;
    }
    Communicator::matmul_all_reduce(be, x, w, bias, out, defer);
  }
  // The routed MLP's last kernel sends its output as its blocks finish; the sum as above.
  void norm_moe_all_reduce(Backend& be, const ResidualNorm& n, Tensor& h, const MoeWeights& w, Tensor& out,
                           Tensor* expert_rows, MoeScratch* scratch, RankSum* defer) override {
    auto& c = ready(be, out, "all-reduce");
    if (push_ && c.norm_moe_pushing(n, h, w, out, expert_rows, scratch, *push_)) {
      RankSum sum{true, push_};
      if (defer) *defer = sum;
      else c.finish_rank_sum(sum, out);
      return;
    }
    Communicator::norm_moe_all_reduce(be, n, h, w, out, expert_rows, scratch, defer);
  }
  // Where the product is the skinny kernel's, it writes its part into its columns of all and its
  // blocks send their outputs to the peers as they finish; a small kernel puts the peers' parts in.
  void matmul_all_gather(Backend& be, const Tensor& x, const Tensor& w, Tensor& all) override {
    auto& c = ready(be, all, "all-gather");
    if (push_ && all.dtype == DType::BF16 && all.rows == x.rows && all.cols == push_->n_ranks * w.rows) {
      Tensor own = all.slice_cols(push_->rank * w.rows, w.rows);
      if (cuda::peer_push_fits(own.data, own.rows, own.cols, own.stride) &&
          c.matmul_pushing(x, w, nullptr, own, *push_)) {
        c.launch_library([&](cudaStream_t s) {
          cuda::launch_peer_pushed_gather(*push_, static_cast<cuda::bf16*>(all.data), all.rows, w.rows, all.stride, s);
        });
        return;
      }
    }
    Communicator::matmul_all_gather(be, x, w, all);
  }
  void all_gather(Backend& be, const Tensor& part, Tensor& all) override {
    auto& c = ready(be, part, "all-gather");
    ready(be, all, "all-gather");
    int n_ranks = 0;
    NCCL_CHECK(ncclCommCount(comm_, &n_ranks));
    check(all.rows == part.rows && all.cols == part.cols * n_ranks && all.dtype == part.dtype,
          "all-gather: the result must hold every rank's part side by side");
    const int64_t elem = static_cast<int64_t>(dtype_size(part.dtype)), row_bytes = part.cols * elem;
    if (peer_ && cuda::peer_all_gather_fits(part.data, all.data, part.rows, row_bytes, all.stride * elem)) {
      c.launch_library([&](cudaStream_t s) {
        cuda::launch_peer_all_gather(*peer_, part.data, all.data, part.rows, row_bytes, all.stride * elem, s);
      });
      return;
    }
    // NCCL stacks the parts; their rows then go to their columns.
    check(part.dtype == DType::BF16 || part.dtype == DType::F32, "all-gather: unsupported tensor type ",
          dtype_name(part.dtype));
    Tensor stacked = part.dtype == DType::F32 ? be.alloc_f32(n_ranks * part.rows, part.cols)
                                              : be.alloc(n_ranks * part.rows, part.cols);
    c.launch_library([&](cudaStream_t s) {
      NCCL_CHECK(ncclAllGather(part.data, stacked.data, static_cast<size_t>(part.rows * part.cols), nccl_type(part),
                               comm_, s));
    });
    std::vector<int32_t> rows(static_cast<size_t>(part.rows));
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int32_t>(i);
    for (int r = 0; r < n_ranks; ++r) {
      Tensor cols = all.slice_cols(r * part.cols, part.cols);
      be.gather_rows(stacked.slice_rows(r * part.rows, part.rows), rows, cols);
    }
  }
  // The candidates exchanged and chosen in one peer kernel.
  void argmax_all(Backend& be, const Tensor& cand, Tensor& ids) override {
    auto& c = ready(be, cand, "argmax");
    if (peer_ && cand.dtype == DType::F32 && cand.cols == 2 && ids.dtype == DType::I32 && ids.rows == cand.rows &&
        cuda::peer_collective_fits(cand.data, cand.rows * 8, cuda::kPeerMaxBytes) &&
        reinterpret_cast<uintptr_t>(ids.data) % 4 == 0) {
      c.launch_library([&](cudaStream_t s) {
        cuda::launch_peer_argmax(*peer_, static_cast<const float*>(cand.data), static_cast<int32_t*>(ids.data),
                                 cand.rows, s);
      });
      return;
    }
    Communicator::argmax_all(be, cand, ids);
  }
  void broadcast(Backend& be, Tensor& t) override {
    auto& c = ready(be, t, "broadcast");
    const int64_t bytes = t.rows * t.cols * static_cast<int64_t>(dtype_size(t.dtype));
    if (peer_ && cuda::peer_collective_fits(t.data, bytes, cuda::kPeerMaxBytes)) {
      c.launch_library([&](cudaStream_t s) { cuda::launch_peer_broadcast(*peer_, t.data, bytes, s); });
      return;
    }
    c.launch_library([&](cudaStream_t s) {
      NCCL_CHECK(ncclBroadcast(t.data, t.data, static_cast<size_t>(t.rows * t.cols), nccl_type(t), 0, comm_, s));
    });
  }

 private:
  cuda::CudaBackend& ready(Backend& be, const Tensor& t, const char* what) {
    check(stopped_->empty(), "the tensor-parallel group stopped after a failure (", *stopped_,
          "); restart to use it again");
    check(t.rows <= 1 || t.stride == t.cols, "NCCL ", what, ": the tensor's rows must be contiguous");
    return cuda_of(be);
  }
  ncclComm_t comm_;
  const cuda::PeerArgs* peer_;
  const cuda::PeerPush* push_;
  const std::string* stopped_;
};

class NcclRankDevices final : public RankDevices {
 public:
  NcclRankDevices(const cuda::CudaBackend& rank0, int size) : options_(rank0.options()) {
    check(rank0.device() == 0, "tensor parallelism: rank 0 must run on GPU 0, not GPU ", rank0.device());
    const int n = cuda_device_count();
    check(size <= n, "--tensor-parallel ", size, " needs ", size, " GPUs; this machine has ", n);
    for (int d = 1; d < size; ++d) {
      cudaDeviceProp p{};
      CUDA_CHECK(cudaGetDeviceProperties(&p, d));
      check(std::string(p.name) == rank0.properties().name &&
                p.multiProcessorCount == rank0.properties().multiProcessorCount,
            "tensor parallelism needs GPUs of one kind: GPU 0 is ", rank0.properties().name, ", GPU ", d, " is ",
            p.name);
    }
    setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);  // NVLink multicast stays off unless asked for
    comms_.resize(static_cast<size_t>(size));
    std::vector<int> devices(static_cast<size_t>(size));
    for (int d = 0; d < size; ++d) devices[static_cast<size_t>(d)] = d;
    NCCL_CHECK(ncclCommInitAll(comms_.data(), size, devices.data()));
    peer_ = std::make_unique<PeerMemory>(size);
    CUDA_CHECK(cudaSetDevice(0));  // the caller's thread runs rank 0
    for (int r = 0; r < size; ++r)
      communicators_.push_back(std::make_unique<NcclCommunicator>(comms_[static_cast<size_t>(r)], peer_->args(r), peer_->push(r), &stopped_));
  }
  ~NcclRankDevices() override {
    for (ncclComm_t c : comms_) {
      if (aborted_) continue;  // ncclCommAbort freed it
      ncclCommDestroy(c);
    }
  }
  int size() const override { return static_cast<int>(comms_.size()); }
  std::unique_ptr<Backend> make_backend(int rank) override {
    BackendOptions o = options_;
    o.device = rank;
    return make_cuda_backend(o);
  }
  Communicator& comm(int rank) override { return *communicators_[static_cast<size_t>(rank)]; }
  bool spin_waits() const override { return true; }
  // The ranks never wait for each other on the host (collectives are queued on the GPUs): a
  // failure is only noted here, and reset decides.
  void abort(const std::string& why) override {
    std::lock_guard<std::mutex> lk(mu_);
    if (failure_.empty()) failure_ = why.empty() ? "a rank failed" : why;
  }
  // Collectives that only some ranks queued cannot be taken back: the communicators are aborted
  // (a GPU waiting in one returns) and the group refuses every later collective.
  void reset(bool alike) override {
    std::lock_guard<std::mutex> lk(mu_);
    if (!alike && !failure_.empty() && !aborted_) {
      stopped_ = failure_;
      aborted_ = true;
      peer_->stop();
      for (ncclComm_t c : comms_) ncclCommAbort(c);
    }
    failure_.clear();
  }

 private:
  BackendOptions options_;
  std::vector<ncclComm_t> comms_;
  std::unique_ptr<PeerMemory> peer_;
  std::vector<std::unique_ptr<NcclCommunicator>> communicators_;
  std::mutex mu_;
  std::string failure_;  // of the call under way
  std::string stopped_;  // why the group stopped for good
  bool aborted_ = false;
};

}  // namespace

std::unique_ptr<RankDevices> make_cuda_rank_devices(const Backend& rank0, int size) {
  const auto* c = dynamic_cast<const cuda::CudaBackend*>(&rank0);
  check(c != nullptr, "tensor parallelism runs on CPU backends or on GPUs with NCCL, not on ", rank0.name());
  return std::make_unique<NcclRankDevices>(*c, size);
}

}  // namespace dflash
