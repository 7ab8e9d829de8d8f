#pragma once
// One image between channels first [C, HW] and channels last [HW, C]: the
// transposes the convolution kernels run around layers stored in the other
// layout. They go in tiles of kImageTile x kImageTile so that both sides
// stay in cache lines the tile has already touched.
#include <algorithm>
#include <cstdint>

namespace quanta::cpu {

inline constexpr int64_t kImageTile = 16;

/** dst [HW, C] = src [C, HW]^T: one image to channels last. */
template <class T>
void to_channels_last(const T* src, int64_t C, int64_t HW, T* dst) {
  for (int64_t c0 = 0; c0 < C; c0 += kImageTile)
    for (int64_t p0 = 0; p0 < HW; p0 += kImageTile) {
      const int64_t c1 = std::min(C, c0 + kImageTile), p1 = std::min(HW, p0 + kImageTile);
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t c = c0; c < c1; ++c) dst[p * C + c] = src[c * HW + p];
    }
}

/** dst [C, HW] = src [HW, C]^T + shift[c] (shift may be null): back to
 * channels first. */
template <class T>
void to_planar(const T* src, int64_t C, int64_t HW, const T* shift, T* dst) {
  for (int64_t c0 = 0; c0 < C; c0 += kImageTile)
    for (int64_t p0 = 0; p0 < HW; p0 += kImageTile) {
      const int64_t c1 = std::min(C, c0 + kImageTile), p1 = std::min(HW, p0 + kImageTile);
      for (int64_t c = c0; c < c1; ++c) {
        const T s = shift ? shift[c] : T(0);
        for (int64_t p = p0; p < p1; ++p) dst[c * HW + p] = src[p * C + c] + s;
      }
    }
}

}  // namespace quanta::cpu
