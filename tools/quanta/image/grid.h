#pragma once
// Image grids from tensors of gray images.
#include <cstdint>
#include <string>

#include "engine/tensor.h"
#include "image/canvas.h"
#include "image/png.h"

namespace quanta::image {

/** A gray image of `images` [N, 1, H, W] (values in [0, 1], clamped) laid out
 * row-major in `cols` columns, each pixel a `scale` x `scale` block, tiles
 * separated by `pad` pixels of mid gray. N = 0 gives a 1 x 1 image. */
Image image_grid(const Tensor& images, int64_t cols, int64_t pad = 2, int64_t scale = 1);

/** Rows of `cols` originals, each row followed by the row of their
 * reconstructions (both [N, 1, H, W], same shape), as one grid. */
Image reconstruction_grid(const Tensor& originals, const Tensor& reconstructions, int64_t cols,
                          int64_t scale = 2);

/** reconstruction_grid with its labels: "IN" and "OUT" beside each row, and
 * `caption` (what made them: quantizer, step, test MSE) above, on white. */
Canvas reconstruction_figure(const Tensor& originals, const Tensor& reconstructions, int64_t cols,
                             const std::string& caption, int64_t scale = 2);

}  // namespace quanta::image
