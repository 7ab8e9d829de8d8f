#include "image/grid.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "engine/factory.h"
#include "engine/ops/join.h"

namespace quanta::image {

Image image_grid(const Tensor& images, int64_t cols, int64_t pad, int64_t scale) {
  if (images.dim() != 4 || images.size(1) != 1)
    throw std::invalid_argument("[image_grid] expected [N, 1, H, W] images");
  if (cols <= 0 || pad < 0 || scale <= 0)
    throw std::invalid_argument("[image_grid] cols and scale must be positive");
  const int64_t n = images.size(0), h = images.size(2), w = images.size(3);
  if (n == 0 || h == 0 || w == 0) return Image(1, 1, 1, 128);
  cols = std::min(cols, n);
  const int64_t rows = (n + cols - 1) / cols;
  const int64_t th = h * scale, tw = w * scale;
  Image img(cols * tw + (cols + 1) * pad, rows * th + (rows + 1) * pad, 1, 128);
  const std::vector<float> px = images.to_vector<float>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ox = pad + (i % cols) * (tw + pad), oy = pad + (i / cols) * (th + pad);
    for (int64_t y = 0; y < th; ++y)
      for (int64_t x = 0; x < tw; ++x) {
        float v = px[(i * h + y / scale) * w + x / scale];
        v = std::isfinite(v) ? std::clamp(v, 0.0f, 1.0f) : 0.0f;
        *img.at(ox + x, oy + y) = static_cast<uint8_t>(std::lround(v * 255.0f));
      }
  }
  return img;
}

Image reconstruction_grid(const Tensor& originals, const Tensor& reconstructions,
                          int64_t cols, int64_t scale) {
  if (originals.shape() != reconstructions.shape())
    throw std::invalid_argument("[reconstruction_grid] originals and reconstructions differ "
                                "in shape");
  const int64_t n = originals.size(0);
  cols = std::max<int64_t>(1, std::min(cols, n));
  std::vector<Tensor> rows;
  for (int64_t start = 0; start < n; start += cols) {
    const int64_t len = std::min(cols, n - start);
    Tensor a = originals.narrow(0, start, len), b = reconstructions.narrow(0, start, len);
    if (len < cols) {  // pad the last row pair so originals stay above their outputs
      Tensor blank = zeros({cols - len, 1, originals.size(2), originals.size(3)});
      a = cat({a, blank}, 0), b = cat({b, blank}, 0);
    }
    rows.push_back(a);
    rows.push_back(b);
  }
  if (rows.empty()) return image_grid(originals, 1, 2, scale);
  return image_grid(cat(rows, 0).to(DType::f32), cols, 2, scale);
}

}  // namespace quanta::image
