// Builds without the CUDA toolkit: the cuda device is reported as absent.
#include "kernels/backend.h"
#include "util/error.h"

namespace dflash {

int cuda_device_count() { return 0; }

std::unique_ptr<Backend> make_cuda_backend() {
  throw Error("this dflash was built without CUDA (install the CUDA toolkit and rebuild); use --device cpu");
}

}  // namespace dflash
