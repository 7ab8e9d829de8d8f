// Sorting pairs by key on the CPU: a stable sort of the positions by the
// keys' unsigned bits (randperm's device path runs on it under sim).
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "engine/cpu/kernels.h"

namespace quanta::cpu {

void sort_pairs(int64_t n, const int64_t* keys, const int64_t* values, int64_t* values_out) {
  std::vector<int64_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [keys](int64_t a, int64_t b) {
    return static_cast<uint64_t>(keys[a]) < static_cast<uint64_t>(keys[b]);
  });
  for (int64_t i = 0; i < n; ++i) values_out[i] = values[order[static_cast<std::size_t>(i)]];
}

}  // namespace quanta::cpu
