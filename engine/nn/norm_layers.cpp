// LayerNorm and GroupNorm modules over the norm ops.
#include <stdexcept>
#include <string>

#include "engine/factory.h"
#include "engine/nn/layers.h"
#include "engine/ops/norm.h"

namespace quanta {
namespace {

[[noreturn]] void norm_layer_fail(const std::string& layer, const std::string& what) {
  throw std::invalid_argument("[" + layer + "] " + what);
}

void check_positive(const std::string& layer, const char* what, int64_t v) {
  if (v <= 0)
    norm_layer_fail(layer, std::string(what) + " must be positive, got " + std::to_string(v));
}

}  // namespace

// ---- LayerNorm ----
LayerNorm::LayerNorm(Shape normalized_shape, double eps, bool elementwise_affine)
    : Module("LayerNorm"), shape_(std::move(normalized_shape)), eps_(eps) {
  if (shape_.empty()) norm_layer_fail("LayerNorm", "normalized_shape is empty");
  for (int64_t s : shape_) check_positive("LayerNorm", "normalized_shape sizes", s);
  if (elementwise_affine) {
    weight_ = register_parameter("weight", ones(shape_));
    bias_ = register_parameter("bias", zeros(shape_));
  }
}

Tensor LayerNorm::forward(const Tensor& x) { return layer_norm(x, shape_, weight_, bias_, eps_); }

// ---- GroupNorm ----
GroupNorm::GroupNorm(int64_t num_groups, int64_t num_channels, double eps, bool affine)
    : Module("GroupNorm"), groups_(num_groups), channels_(num_channels), eps_(eps) {
  check_positive("GroupNorm", "num_groups", num_groups);
  check_positive("GroupNorm", "num_channels", num_channels);
  if (num_channels % num_groups != 0)
    norm_layer_fail("GroupNorm", "num_channels " + std::to_string(num_channels) +
                                     " must be a multiple of num_groups " +
                                     std::to_string(num_groups));
  if (affine) {
    weight_ = register_parameter("weight", ones({num_channels}));
    bias_ = register_parameter("bias", zeros({num_channels}));
  }
}

Tensor GroupNorm::forward(const Tensor& x) {
  if (x.dim() < 2 || x.size(1) != channels_)
    norm_layer_fail("GroupNorm", "input must be [N, " + std::to_string(channels_) + ", ...], got " +
                                     shape_str(x.shape()));
  return group_norm(x, groups_, weight_, bias_, eps_);
}

}  // namespace quanta
