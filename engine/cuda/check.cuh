#pragma once
// Throwing error checks for CUDA calls (tiny-cuda-nn style): file, line, call.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#define QUANTA_CUDA_CHECK(call)                                                           \
  do {                                                                                    \
    cudaError_t quanta_err_ = (call);                                                     \
    if (quanta_err_ != cudaSuccess)                                                       \
      throw std::runtime_error(std::string(__FILE__) + ":" + std::to_string(__LINE__) +   \
                               ": " #call " failed: " + cudaGetErrorString(quanta_err_)); \
  } while (0)

#include <cublas_v2.h>

#define QUANTA_CUBLAS_CHECK(call)                                                           \
  do {                                                                                      \
    cublasStatus_t quanta_st_ = (call);                                                     \
    if (quanta_st_ != CUBLAS_STATUS_SUCCESS)                                                \
      throw std::runtime_error(std::string(__FILE__) + ":" + std::to_string(__LINE__) +     \
                               ": " #call " failed: " + cublasGetStatusString(quanta_st_)); \
  } while (0)

// After a kernel launch: a bad configuration shows here, not at the next call.
#define QUANTA_CUDA_CHECK_LAUNCH() QUANTA_CUDA_CHECK(cudaGetLastError())
