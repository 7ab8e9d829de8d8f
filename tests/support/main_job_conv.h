#pragma once
// The geometry of the main job's second encoder convolution (`quanta
// train`'s VQ-VAE at batch 64, channels last): 32 -> 32 channels, 14 x 14 to
// 7 x 7, kernel 4, stride 2, padding 1; 51M multiply-adds a kind. The tests
// that ask which CPU kernel takes a layer use it.
#include "engine/kernels/conv_geom.h"

namespace quanta::testing {

inline ConvGeom main_job_enc2(bool bf16_products = false) {
  return ConvGeom{.N = 64,
                  .C = 32,
                  .H = 14,
                  .W = 14,
                  .O = 32,
                  .kh = 4,
                  .kw = 4,
                  .OH = 7,
                  .OW = 7,
                  .stride = {2, 2},
                  .padding = {1, 1},
                  .dilation = {1, 1},
                  .groups = 1,
                  .channels_last = true,
                  .bf16_products = bf16_products};
}

}  // namespace quanta::testing
