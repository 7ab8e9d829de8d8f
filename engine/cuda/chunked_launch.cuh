#pragma once
// Multi-tensor entries' launches (Adam, scale_n, copy_blocks): a host list
// of tensors cut into chunks whose pointers travel as the kernel's argument
// (no upload, nothing for a captured graph to hold but the launch), one grid
// row a tensor.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "engine/cuda/check.cuh"
#include "engine/cuda/device_types.cuh"
#include "engine/cuda/launch.h"

namespace quanta::cuda {

/** The elements of a list entry with a count `n` (TensorSpan, AdamTensor). */
struct EntryElements {
  template <class Entry>
  int64_t operator()(const Entry& e) const {
    return e.n;
  }
};

/** For each run of up to Cap entries of `list` ({data, count}) with
 * elements (elements(entry) > 0), fill(chunk, row, entry) puts the entry in
 * grid row `row` of a Chunk, and launch(chunk, grid, threads) starts the
 * kernel over them: grid.y rows, grid.x blocks enough for the chunk's
 * largest entry in a grid-stride loop. */
template <int Cap, class Chunk, class List, class Fill, class Launch,
          class Elements = EntryElements>
void launch_in_chunks(const List& list, Fill&& fill, Launch&& launch, Elements elements = {}) {
  for (int64_t first = 0; first < list.count; first += Cap) {
    Chunk c{};
    int rows = 0;
    int64_t widest = 0;
    for (int64_t i = first; i < std::min<int64_t>(list.count, first + Cap); ++i) {
      const auto& t = list.data[i];
      const int64_t n = elements(t);
      if (n == 0) continue;
      fill(c, rows, t);
      widest = std::max(widest, n);
      ++rows;
    }
    if (rows == 0) continue;
    const LaunchConfig cfg = launch_config(widest, max_blocks());
    launch(c, dim3(static_cast<unsigned>(cfg.blocks), static_cast<unsigned>(rows)), cfg.threads);
    QUANTA_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace quanta::cuda
