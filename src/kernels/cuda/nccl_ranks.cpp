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

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, const std::string* stopped) : comm_(comm), stopped_(stopped) {}
  void all_reduce_sum(Backend& be, Tensor& t) override {
    auto& c = ready(be, t, "all-reduce");
    c.launch_library([&](cudaStream_t s) {
      NCCL_CHECK(ncclAllReduce(t.data, t.data, static_cast<size_t>(t.rows * t.cols), nccl_type(t), ncclSum, comm_, s));
    });
  }
  void broadcast(Backend& be, Tensor& t) override {
    auto& c = ready(be, t, "broadcast");
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
    CUDA_CHECK(cudaSetDevice(0));  // the caller's thread runs rank 0
    for (int r = 0; r < size; ++r) communicators_.push_back(std::make_unique<NcclCommunicator>(comms_[static_cast<size_t>(r)], &stopped_));
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
      for (ncclComm_t c : comms_) ncclCommAbort(c);
    }
    failure_.clear();
  }

 private:
  BackendOptions options_;
  std::vector<ncclComm_t> comms_;
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
