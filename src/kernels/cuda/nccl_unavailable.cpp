// CUDA builds without NCCL: tensor parallelism on GPUs is refused.
#include "kernels/communicator.h"
#include "util/error.h"

namespace dflash {

std::unique_ptr<RankDevices> make_cuda_rank_devices(const Backend&, int) {
  throw Error("this dflash was built without NCCL: tensor parallelism on GPUs needs it (install libnccl-dev and rebuild)");
}

}  // namespace dflash
