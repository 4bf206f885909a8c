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
