// layer_norm and group_norm, composed from mean, var and elementwise ops.
#include "engine/ops/norm.h"

#include <algorithm>
#include <string>

#include "engine/kernels/table.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/reduce.h"
#include "engine/ops/reductions.h"
#include "engine/ops/view.h"

namespace quanta {
namespace {

void check_input(const char* op, const Tensor& x, const Tensor& w, const Tensor& b) {
  kernels_for(op, {&x, &w, &b});  // one device for all
  if (!is_floating(x.dtype()))
    throw std::invalid_argument(std::string("[") + op + "] needs a floating input, got " +
                                dtype_name(x.dtype()));
}

void check_param(const char* op, const char* what, const Tensor& p, const Shape& want) {
  if (p.defined() && p.shape() != want)
    throw std::invalid_argument(std::string("[") + op + "] " + what + " shape " +
                                shape_str(p.shape()) + " does not match " + shape_str(want));
}

// (x - mean) / sqrt(var + eps) over `dims`, with the biased variance.
Tensor standardize(const Tensor& x, const Dims& dims, double eps) {
  const Tensor centered = sub(x, mean(x, dims, true));
  const Tensor v = var(x, dims, 0.0, true);
  return mul(centered, rsqrt(add(v, constant_like(v, eps))));
}

Tensor affine(Tensor y, const Tensor& w, const Tensor& b, const Shape& param_shape) {
  if (w.defined()) y = mul(y, reshape(w, param_shape));
  if (b.defined()) y = add(y, reshape(b, param_shape));
  return y;
}

}  // namespace

Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight,
                  const Tensor& bias, double eps) {
  check_input("layer_norm", x, weight, bias);
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  const Shape trailing(x.shape().end() - std::min<int64_t>(k, x.dim()), x.shape().end());
  if (k == 0 || k > x.dim() || trailing != normalized_shape)
    throw std::invalid_argument("[layer_norm] normalized_shape " + shape_str(normalized_shape) +
                                " must be non-empty and match the trailing dims of input "
                                "shape " +
                                shape_str(x.shape()));
  check_param("layer_norm", "weight", weight, normalized_shape);
  check_param("layer_norm", "bias", bias, normalized_shape);
  Dims dims;
  for (int64_t d = x.dim() - k; d < x.dim(); ++d) dims.push_back(d);
  return affine(standardize(x, dims, eps), weight, bias, normalized_shape);
}

Tensor group_norm(const Tensor& x, int64_t num_groups, const Tensor& weight, const Tensor& bias,
                  double eps) {
  check_input("group_norm", x, weight, bias);
  if (x.dim() < 2)
    throw std::invalid_argument("[group_norm] input must be [N, C, *], got shape " +
                                shape_str(x.shape()));
  const int64_t n = x.shape()[0], c = x.shape()[1];
  if (num_groups <= 0 || c % num_groups != 0)
    throw std::invalid_argument("[group_norm] num_groups " + std::to_string(num_groups) +
                                " must be positive and divide the " + std::to_string(c) +
                                " channels");
  check_param("group_norm", "weight", weight, {c});
  check_param("group_norm", "bias", bias, {c});
  int64_t spatial = 1;
  for (int64_t d = 2; d < x.dim(); ++d) spatial *= x.shape()[d];
  const Tensor grouped = reshape(x, {n, num_groups, c / num_groups * spatial});
  const Tensor y = reshape(standardize(grouped, {2}, eps), x.shape());
  Shape param_shape(x.dim(), 1);
  param_shape[1] = c;
  return affine(y, weight, bias, param_shape);
}

}  // namespace quanta
