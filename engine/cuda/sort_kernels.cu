// Sorting pairs by key on CUDA: CUB's radix sort, which is stable, over the
// keys' unsigned bits; the sorted keys go to scratch memory.
#include <algorithm>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <limits>
#include <stdexcept>
#include <string>

#include "engine/cuda/check.cuh"
#include "engine/cuda/kernels.h"
#include "engine/cuda/scratch.h"
#include "engine/cuda/stream.h"

namespace quanta::cuda {

void sort_pairs(int64_t n, const int64_t* keys, const int64_t* values, int64_t* values_out) {
  if (n == 0) return;
  if (n > std::numeric_limits<int>::max())
    throw std::invalid_argument("[sort_pairs] " + std::to_string(n) +
                                " pairs: CUB's sort takes at most 2^31 - 1");
  const auto* in = reinterpret_cast<const unsigned long long*>(keys);
  Scratch<unsigned long long> sorted(n);
  const int count = static_cast<int>(n);
  size_t temp_bytes = 0;
  QUANTA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, in, sorted.get(), values,
                                                    values_out, count, 0, 64, stream()));
  Scratch<unsigned char> temp(std::max<int64_t>(1, static_cast<int64_t>(temp_bytes)));
  QUANTA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.get(), temp_bytes, in, sorted.get(),
                                                    values, values_out, count, 0, 64, stream()));
}

}  // namespace quanta::cuda
