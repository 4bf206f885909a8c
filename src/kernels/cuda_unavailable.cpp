// Builds without the CUDA toolkit: the cuda device is reported as absent.
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/cuda/kernel_forms.h"
#include "util/error.h"

namespace dflash {

int cuda_device_count() { return 0; }

std::unique_ptr<Backend> make_cuda_backend(const BackendOptions&) {
  throw Error("this dflash was built without CUDA (install the CUDA toolkit and rebuild); use --device cpu");
}

std::unique_ptr<RankDevices> make_cuda_rank_devices(const Backend&, int) {
  throw Error("this dflash was built without CUDA: tensor parallelism on GPUs needs it; use --device cpu");
}

void cuda::force_kernel_forms(Backend&, const KernelForms&) { throw Error("this dflash was built without CUDA"); }
long long cuda::routed_tile_products(const Backend&) { throw Error("this dflash was built without CUDA"); }
long long cuda::pushed_products(const Backend&) { throw Error("this dflash was built without CUDA"); }
bool cuda::warpgroup_tile_products(const Backend&) { throw Error("this dflash was built without CUDA"); }

}  // namespace dflash
