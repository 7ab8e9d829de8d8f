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

Image reconstruction_grid(const Tensor& originals, const Tensor& reconstructions, int64_t cols,
                          int64_t scale) {
  if (originals.shape() != reconstructions.shape())
    throw std::invalid_argument(
        "[reconstruction_grid] originals and reconstructions differ "
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

Canvas reconstruction_figure(const Tensor& originals, const Tensor& reconstructions, int64_t cols,
                             const std::string& caption, int64_t scale) {
  const Image grid = reconstruction_grid(originals, reconstructions, cols, scale);
  constexpr int64_t kPad = 2;       // reconstruction_grid's gap between tiles
  constexpr int64_t kLabels = 32;   // left margin for IN / OUT
  constexpr int64_t kCaption = 22;  // top band
  const Rgb ink{40, 40, 40};
  const int64_t width =
      std::max(kLabels + grid.width, Canvas::text_width(caption) + 2 * kLabels / 4);
  Canvas c(width, kCaption + grid.height);
  for (int64_t y = 0; y < grid.height; ++y)
    for (int64_t x = 0; x < grid.width; ++x) {
      const uint8_t v = *grid.at(x, y);
      c.set(kLabels + x, kCaption + y, {v, v, v});
    }
  c.text(kLabels / 4, (kCaption - Canvas::text_height()) / 2, caption, ink);
  const int64_t n = originals.dim() == 4 ? originals.size(0) : 0;
  if (n > 0) {
    const int64_t tile = originals.size(2) * scale;
    const int64_t rows = 2 * ((n + std::max<int64_t>(1, std::min(cols, n)) - 1) /
                              std::max<int64_t>(1, std::min(cols, n)));
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t mid = kCaption + kPad + r * (tile + kPad) + tile / 2;
      const std::string label = r % 2 == 0 ? "IN" : "OUT";
      c.text((kLabels - Canvas::text_width(label)) / 2, mid - Canvas::text_height() / 2, label,
             ink);
    }
  }
  return c;
}

}  // namespace quanta::image
