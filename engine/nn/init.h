#pragma once
// Parameter initialisers with PyTorch's formulas (torch.nn.init). Random ones
// draw from an explicit Generator. All fill in place under NoGradGuard, so
// they work on parameters that require grad; zero-element tensors are left
// as they are. Plain uniform and normal fills are quanta::uniform_ and
// quanta::normal_ (engine/random/sampling.h).
#include <cstdint>
#include <utility>

#include "engine/random/generator.h"
#include "engine/tensor.h"

namespace quanta::init {

/** The nonlinearity a gain is computed for (torch.nn.init.calculate_gain). */
enum class Nonlinearity { linear, conv, sigmoid, tanh, relu, leaky_relu, selu };
/** Which fan kaiming_* preserves the variance of: forward (fan_in) or
 * backward (fan_out) pass. */
enum class FanMode { fan_in, fan_out };

/** The recommended gain for `nl`: 1 for linear, conv and sigmoid, 5/3 for
 * tanh, sqrt(2) for relu, sqrt(2 / (1 + slope^2)) for leaky_relu with
 * negative slope `param`, 3/4 for selu. */
double calculate_gain(Nonlinearity nl, double param = 0.01);

/** (fan_in, fan_out) of a weight of at least 2 dims: dim 1 and dim 0 sizes
 * times the product of the remaining (receptive field) sizes. */
std::pair<int64_t, int64_t> calculate_fan_in_and_fan_out(const Tensor& t);

/** U(-b, b) with b = gain * sqrt(3 / fan), gain = calculate_gain(nl, a). */
void kaiming_uniform_(const Tensor& t, Generator& gen, double a = 0, FanMode mode = FanMode::fan_in,
                      Nonlinearity nl = Nonlinearity::leaky_relu);
/** N(0, std^2) with std = gain / sqrt(fan), gain = calculate_gain(nl, a). */
void kaiming_normal_(const Tensor& t, Generator& gen, double a = 0, FanMode mode = FanMode::fan_in,
                     Nonlinearity nl = Nonlinearity::leaky_relu);
/** U(-b, b) with b = gain * sqrt(6 / (fan_in + fan_out)). */
void xavier_uniform_(const Tensor& t, Generator& gen, double gain = 1.0);
/** N(0, std^2) with std = gain * sqrt(2 / (fan_in + fan_out)). */
void xavier_normal_(const Tensor& t, Generator& gen, double gain = 1.0);
/** Fills with 0. */
void zeros_(const Tensor& t);
/** Fills with 1. */
void ones_(const Tensor& t);
/** Fills with `value`. */
void constant_(const Tensor& t, double value);

}  // namespace quanta::init
