#pragma once
// Temporary device memory for one kernel call: n elements from the device's
// stream-ordered pool (cudaMallocAsync on the device's stream, where every
// quanta kernel runs), reused across calls without a cudaMalloc and freed in stream order,
// so the kernels queued before the free still read it.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "engine/cuda/check.cuh"
#include "engine/cuda/stream.h"

namespace quanta::cuda {

template <class T>
class Scratch {
 public:
  explicit Scratch(int64_t n) {
    if (n > 0)
      QUANTA_CUDA_CHECK(cudaMallocAsync(&p_, sizeof(T) * static_cast<std::size_t>(n), stream()));
  }
  ~Scratch() {
    if (p_) cudaFreeAsync(p_, stream());
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  T* get() const { return p_; }

 private:
  T* p_ = nullptr;
};

}  // namespace quanta::cuda
