#pragma once
// Throwing error checks for CUDA calls (tiny-cuda-nn style): file, line, call.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#define QUANTA_CUDA_CHECK(call)                                                   \
  do {                                                                            \
    cudaError_t quanta_err_ = (call);                                             \
    if (quanta_err_ != cudaSuccess)                                               \
      throw std::runtime_error(std::string(__FILE__) + ":" +                      \
                               std::to_string(__LINE__) + ": " #call " failed: " + \
                               cudaGetErrorString(quanta_err_));                  \
  } while (0)
