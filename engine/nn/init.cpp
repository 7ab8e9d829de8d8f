// Initialisers: PyTorch's torch.nn.init formulas over the explicit Generator.
#include "engine/nn/init.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "engine/autograd/grad_mode.h"
#include "engine/ops/elementwise.h"
#include "engine/random/sampling.h"

namespace quanta::init {

double calculate_gain(Nonlinearity nl, double param) {
  switch (nl) {
    case Nonlinearity::linear:
    case Nonlinearity::conv:
    case Nonlinearity::sigmoid:
      return 1.0;
    case Nonlinearity::tanh:
      return 5.0 / 3.0;
    case Nonlinearity::relu:
      return std::sqrt(2.0);
    case Nonlinearity::leaky_relu:
      return std::sqrt(2.0 / (1.0 + param * param));
    case Nonlinearity::selu:
      return 3.0 / 4.0;
  }
  throw std::invalid_argument("[calculate_gain] unknown nonlinearity");
}

std::pair<int64_t, int64_t> calculate_fan_in_and_fan_out(const Tensor& t) {
  if (t.dim() < 2)
    throw std::invalid_argument(
        "[calculate_fan_in_and_fan_out] needs a tensor of at least "
        "2 dims, got shape " +
        shape_str(t.shape()));
  int64_t receptive = 1;
  for (int64_t d = 2; d < t.dim(); ++d) receptive *= t.size(d);
  return {t.size(1) * receptive, t.size(0) * receptive};
}

namespace {
double kaiming_std(const char* op, const Tensor& t, double a, FanMode mode, Nonlinearity nl) {
  const auto [fan_in, fan_out] = calculate_fan_in_and_fan_out(t);
  const int64_t fan = mode == FanMode::fan_in ? fan_in : fan_out;
  if (fan == 0)
    throw std::invalid_argument(std::string("[") + op + "] fan is 0 for shape " +
                                shape_str(t.shape()));
  return calculate_gain(nl, a) / std::sqrt(static_cast<double>(fan));
}

double xavier_std(const Tensor& t, double gain) {
  const auto [fan_in, fan_out] = calculate_fan_in_and_fan_out(t);
  return gain * std::sqrt(2.0 / static_cast<double>(fan_in + fan_out));
}
}  // namespace

void kaiming_uniform_(const Tensor& t, Generator& gen, double a, FanMode mode, Nonlinearity nl) {
  if (t.numel() == 0) return;
  const double bound = std::sqrt(3.0) * kaiming_std("kaiming_uniform_", t, a, mode, nl);
  NoGradGuard no_grad;
  ::quanta::uniform_(t, -bound, bound, gen);
}

void kaiming_normal_(const Tensor& t, Generator& gen, double a, FanMode mode, Nonlinearity nl) {
  if (t.numel() == 0) return;
  const double std = kaiming_std("kaiming_normal_", t, a, mode, nl);
  NoGradGuard no_grad;
  ::quanta::normal_(t, 0.0, std, gen);
}

void xavier_uniform_(const Tensor& t, Generator& gen, double gain) {
  if (t.numel() == 0) return;
  const double bound = std::sqrt(3.0) * xavier_std(t, gain);
  NoGradGuard no_grad;
  ::quanta::uniform_(t, -bound, bound, gen);
}

void xavier_normal_(const Tensor& t, Generator& gen, double gain) {
  if (t.numel() == 0) return;
  const double std = xavier_std(t, gain);
  NoGradGuard no_grad;
  ::quanta::normal_(t, 0.0, std, gen);
}

void zeros_(const Tensor& t) { constant_(t, 0.0); }
void ones_(const Tensor& t) { constant_(t, 1.0); }

void constant_(const Tensor& t, double value) {
  NoGradGuard no_grad;
  fill_(t, value);
}

}  // namespace quanta::init
