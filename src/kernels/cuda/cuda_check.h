// Checks of CUDA runtime and cuBLAS calls: a failure throws Error naming the
// call, its file:line and the library's message.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "util/error.h"

#define CUDA_CHECK(call)                                                                                   \
  do {                                                                                                     \
    const cudaError_t err_ = (call);                                                                       \
    if (err_ != cudaSuccess)                                                                               \
      throw ::dflash::Error(::dflash::cat("CUDA error at ", __FILE__, ":", __LINE__, ": ", #call, ": ",    \
                                          cudaGetErrorString(err_)));                                      \
  } while (0)

#define CUBLAS_CHECK(call)                                                                                 \
  do {                                                                                                     \
    const cublasStatus_t st_ = (call);                                                                     \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                                      \
      throw ::dflash::Error(::dflash::cat("cuBLAS error at ", __FILE__, ":", __LINE__, ": ", #call, ": ",  \
                                          cublasLtGetStatusString(st_)));                                    \
  } while (0)

// After a kernel launch: reports bad launch configurations at the call site.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

namespace dflash::cuda {

// The current device, or `device` for a scope: what a tensor-parallel rank's memory and handles
// are freed under when the last reference goes on another rank's thread.
inline int current_device() {
  int d = 0;
  CUDA_CHECK(cudaGetDevice(&d));
  return d;
}
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    cudaGetDevice(&previous_);
    if (previous_ != device_) cudaSetDevice(device_);
  }
  ~DeviceGuard() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_, previous_ = 0;
};

}  // namespace dflash::cuda
