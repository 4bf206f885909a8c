#include "model/tensor_parallel.h"

#include <cstring>

#include "util/error.h"

namespace dflash {

ModelConfig shard_config(const ModelConfig& full, const TpRank& tp, const std::string& where) {
  check(tp.size >= 1 && tp.rank >= 0 && tp.rank < tp.size, "tensor parallel rank ", tp.rank, " of ", tp.size,
        " is not a rank of the group");
  if (!tp.sharded()) return full;
  auto divide = [&](int n, const char* field) {
    check(n % tp.size == 0, where, ": ", field, " (", n, ") is not a multiple of the tensor-parallel size (", tp.size,
          ")");
    return n / tp.size;
  };
  ModelConfig c = full;
  c.n_heads = divide(full.n_heads, "num_attention_heads");
  // Fewer KV heads than ranks: each rank keeps the one its query heads read (a KV head's query
  // heads then span whole ranks).
  if (full.n_kv_heads > 0 && full.n_kv_heads < tp.size && tp.size % full.n_kv_heads == 0) c.n_kv_heads = 1;
  else c.n_kv_heads = divide(full.n_kv_heads, "num_key_value_heads");
  if (full.n_ff > 0) c.n_ff = divide(full.n_ff, "intermediate_size");
  if (!full.moe_layer.empty()) {
    c.moe.n_ff = divide(full.moe.n_ff, "moe_intermediate_size");
    if (full.moe.shared_n_ff > 0) c.moe.shared_n_ff = divide(full.moe.shared_n_ff, "shared_expert_intermediate_size");
  }
  if (full.hybrid()) {
    c.linear.n_k_heads = divide(full.linear.n_k_heads, "linear_num_key_heads");
    c.linear.n_v_heads = divide(full.linear.n_v_heads, "linear_num_value_heads");
  }
  return c;
}

HostGroup::HostGroup(int size) : size_(size), published_(static_cast<size_t>(size), nullptr) {
  check(size >= 1, "a tensor-parallel group needs at least one rank");
}

void HostGroup::abort(const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  if (aborted_.empty()) aborted_ = why.empty() ? "a rank failed" : why;
  cv_.notify_all();
}

void HostGroup::reset() {
  std::lock_guard<std::mutex> lk(mu_);
  aborted_.clear();
  arrived_ = 0;
}

void HostGroup::arrive_and_wait() {
  std::unique_lock<std::mutex> lk(mu_);
  check(aborted_.empty(), "tensor parallel group stopped: ", aborted_);
  const uint64_t gen = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  cv_.wait(lk, [&] { return generation_ != gen || !aborted_.empty(); });
  check(generation_ != gen, "tensor parallel group stopped: ", aborted_);
}

void HostCommunicator::all_reduce_sum(Backend& be, Tensor& t) {
  check(be.name() == "cpu" && t.dtype == DType::F32, "host tensor parallelism runs on CPU backends (float32 tensors)");
  if (group_.size_ == 1) return;
  group_.published_[static_cast<size_t>(rank_)] = &t;
  group_.arrive_and_wait();  // every rank's partial sums are in place
  std::vector<float> sum(static_cast<size_t>(t.rows * t.cols));
  for (int r = 0; r < group_.size_; ++r) {
    const Tensor& p = *group_.published_[static_cast<size_t>(r)];
    check(p.rows == t.rows && p.cols == t.cols, "tensor parallel ranks reduce tensors of different shapes");
    for (int64_t i = 0; i < t.rows; ++i)
      for (int64_t j = 0; j < t.cols; ++j) sum[static_cast<size_t>(i * t.cols + j)] += p.row_f32(i)[j];
  }
  group_.arrive_and_wait();  // every rank has read every rank's tensor
  for (int64_t i = 0; i < t.rows; ++i) std::memcpy(t.row_f32(i), sum.data() + i * t.cols, sizeof(float) * t.cols);
}

void HostCommunicator::broadcast(Backend& be, Tensor& t) {
  check(be.name() == "cpu", "host tensor parallelism runs on CPU backends");
  if (group_.size_ == 1) return;
  group_.published_[static_cast<size_t>(rank_)] = &t;
  group_.arrive_and_wait();  // rank 0's tensor is in place
  const Tensor& from = *group_.published_[0];
  check(from.rows == t.rows && from.cols == t.cols && from.dtype == t.dtype,
        "tensor parallel ranks broadcast tensors of different shapes");
  const int64_t row_bytes = t.cols * static_cast<int64_t>(dtype_size(t.dtype));
  if (rank_ != 0)
    for (int64_t i = 0; i < t.rows; ++i)
      std::memcpy(static_cast<char*>(t.data) + i * t.stride * dtype_size(t.dtype),
                  static_cast<const char*>(from.data) + i * from.stride * dtype_size(from.dtype), row_bytes);
  group_.arrive_and_wait();  // every rank has its copy
}

void HostCommunicator::all_gather(Backend& be, const Tensor& part, Tensor& all) {
  check(be.name() == "cpu", "host tensor parallelism runs on CPU backends");
  check(all.rows == part.rows && all.cols == part.cols * group_.size_ && all.dtype == part.dtype,
        "all_gather: the result must hold every rank's part side by side");
  group_.published_[static_cast<size_t>(rank_)] = &part;
  group_.arrive_and_wait();  // every rank's part is in place
  const size_t elem = dtype_size(part.dtype), row_bytes = static_cast<size_t>(part.cols) * elem;
  for (int r = 0; r < group_.size_; ++r) {
    const Tensor& p = *group_.published_[static_cast<size_t>(r)];
    check(p.rows == part.rows && p.cols == part.cols, "tensor parallel ranks gather tensors of different shapes");
    for (int64_t i = 0; i < p.rows; ++i)
      std::memcpy(static_cast<char*>(all.data) + (i * all.stride + r * p.cols) * elem,
                  static_cast<const char*>(p.data) + i * p.stride * elem, row_bytes);
  }
  group_.arrive_and_wait();  // every rank has read every rank's part
}

namespace {

class HostRankDevices final : public RankDevices {
 public:
  explicit HostRankDevices(int size) : group_(size) {
    for (int r = 0; r < size; ++r) comms_.push_back(std::make_unique<HostCommunicator>(group_, r));
  }
  int size() const override { return group_.size(); }
  std::unique_ptr<Backend> make_backend(int) override { return make_cpu_backend(); }
  Communicator& comm(int rank) override { return *comms_[static_cast<size_t>(rank)]; }
  void abort(const std::string& why) override { group_.abort(why); }
  void reset(bool) override { group_.reset(); }

 private:
  HostGroup group_;
  std::vector<std::unique_ptr<HostCommunicator>> comms_;
};

}  // namespace

std::unique_ptr<RankDevices> make_host_rank_devices(int size) { return std::make_unique<HostRankDevices>(size); }

}  // namespace dflash
