#pragma once
// How the CPU's convolution kernels cut a batch into chunks of images and
// spread them over threads (conv_kernels.cpp, conv_channels_last.cpp).
#include <algorithm>
#include <cstdint>

#include "engine/cpu/parallel.h"
#include "engine/kernels/conv_geom.h"

namespace quanta::cpu {

// Output positions o in [0, n) whose input index o * s + off lies in [0, size).
inline void valid_range(int64_t off, int64_t s, int64_t size, int64_t n, int64_t& lo, int64_t& hi) {
  lo = off >= 0 ? 0 : (-off + s - 1) / s;
  hi = size - off <= 0 ? 0 : (size - off + s - 1) / s;
  lo = std::min(lo, n);
  hi = std::clamp(hi, lo, n);
}

// How a convolution's images are cut into chunks. One chunk's columns, for
// all its images side by side ([ckk, images * L]), feed one GEMM: the main
// job's layers have 49 to 196 output positions per image, far too few for a
// GEMM to run near its peak one image at a time.
struct Chunks {
  int64_t images;   // per chunk (the last one may hold fewer)
  int64_t count;    // chunks in all
  int64_t workers;  // threads that take whole chunks (1: chunk after chunk,
                    // each GEMM and copy threaded inside)
};

// Chunks of about kChunkElements scratch elements (`per_image` per image)
// keep a chunk's operands in the caches; chunks come in multiples of the
// thread count so that every thread gets the same number of images. N > 0.
inline Chunks plan_chunks(const ConvGeom& g, int64_t per_image) {
  constexpr int64_t kChunkElements = int64_t(1) << 18;
  per_image = std::max<int64_t>(1, per_image);
  int64_t images = std::clamp<int64_t>(kChunkElements / per_image, 1, g.N);
  const int64_t threads = num_threads();
  int64_t workers = 1;
  if (threads > 1 && g.N >= threads) {
    workers = threads;
    images = std::min(images, (g.N + threads - 1) / threads);
    int64_t count = (g.N + images - 1) / images;
    count = (count + threads - 1) / threads * threads;
    images = (g.N + count - 1) / count;
  }
  return {images, (g.N + images - 1) / images, workers};
}

// Runs body(first_image, images, worker) for every chunk: worker w takes
// the w-th contiguous run of chunks, so each worker's scratch is its own.
template <class Body>
inline void run_chunks(const ConvGeom& g, const Chunks& c, Body body) {
  auto run = [&](int64_t w, int64_t chunk_lo, int64_t chunk_hi) {
    for (int64_t k = chunk_lo; k < chunk_hi; ++k) {
      const int64_t n0 = k * c.images;
      if (n0 < g.N) body(n0, std::min(c.images, g.N - n0), w);
    }
  };
  if (c.workers == 1) {
    run(0, 0, c.count);
    return;
  }
  const int64_t per_worker = (c.count + c.workers - 1) / c.workers;
  parallel_for(0, c.workers, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) run(w, w * per_worker, (w + 1) * per_worker);
  });
}

}  // namespace quanta::cpu
