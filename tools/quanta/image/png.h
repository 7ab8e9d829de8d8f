#pragma once
// 8-bit PNG files through libpng: gray or RGB images in and out.
#include <cstdint>
#include <string>
#include <vector>

namespace quanta::image {

/** An 8-bit image, rows top to bottom, channels interleaved (1: gray, 3: RGB). */
struct Image {
  int64_t width = 0;
  int64_t height = 0;
  int channels = 1;
  std::vector<uint8_t> pixels;  // height * width * channels

  Image() = default;
  /** A `width` x `height` image filled with `fill` in every channel. */
  Image(int64_t width, int64_t height, int channels, uint8_t fill = 0);
  /** Pointer to the first channel of pixel (x, y). */
  uint8_t* at(int64_t x, int64_t y) { return &pixels[(y * width + x) * channels]; }
  const uint8_t* at(int64_t x, int64_t y) const { return &pixels[(y * width + x) * channels]; }
};

/** Writes `img` (1 or 3 channels, non-empty) to `path` as an 8-bit PNG,
 * through a temporary file renamed over `path` so readers never see half a
 * file. Throws std::runtime_error naming the file on any failure. */
void write_png(const std::string& path, const Image& img);

/** Reads an 8-bit gray or RGB PNG (palette, 16-bit and alpha are converted:
 * alpha is dropped, palette expanded to RGB). Throws naming the file. */
Image read_png(const std::string& path);

}  // namespace quanta::image
