// Layers over the engine ops, with PyTorch's default initialisation.
#include "engine/nn/layers.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/nn/init.h"
#include "engine/ops/conv.h"
#include "engine/ops/index.h"
#include "engine/ops/linalg.h"
#include "engine/ops/pool.h"
#include "engine/ops/view.h"
#include "engine/random/sampling.h"

namespace quanta {
namespace {

[[noreturn]] void layer_fail(const std::string& layer, const std::string& what) {
  throw std::invalid_argument("[" + layer + "] " + what);
}

void check_positive(const std::string& layer, const char* what, int64_t v, bool zero_ok) {
  if (v < 0 || (!zero_ok && v == 0))
    layer_fail(layer, std::string(what) + " must be " + (zero_ok ? "non-negative" : "positive") +
                          ", got " + std::to_string(v));
}

// PyTorch's reset_parameters for Linear and the convolutions: the weight with
// kaiming_uniform_(a = sqrt(5)), which is U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
// then the bias from the same range (zero when fan_in is 0).
void default_init(const Tensor& weight, const Tensor& bias, Generator& gen) {
  init::kaiming_uniform_(weight, gen, std::sqrt(5.0));
  if (!bias.defined()) return;
  const int64_t fan_in = weight.numel() == 0 ? 0 : init::calculate_fan_in_and_fan_out(weight).first;
  const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
  NoGradGuard no_grad;
  uniform_(bias, -bound, bound, gen);
}

void check_conv(const std::string& layer, int64_t in, int64_t out, std::array<int64_t, 2> kernel,
                const Conv2dOptions& o) {
  check_positive(layer, "in_channels", in, false);
  check_positive(layer, "out_channels", out, false);
  check_positive(layer, "groups", o.groups, false);
  for (int i = 0; i < 2; ++i) {
    check_positive(layer, "kernel_size", kernel[i], false);
    check_positive(layer, "stride", o.stride[i], false);
    check_positive(layer, "dilation", o.dilation[i], false);
    check_positive(layer, "padding", o.padding[i], true);
    check_positive(layer, "output_padding", o.output_padding[i], true);
  }
  if (in % o.groups != 0 || out % o.groups != 0)
    layer_fail(layer, "in_channels " + std::to_string(in) + " and out_channels " +
                          std::to_string(out) + " must be multiples of groups " +
                          std::to_string(o.groups));
}

void check_channels(const std::string& layer, const Tensor& x, int64_t channels,
                    ConvLayout layout) {
  const std::string c = std::to_string(channels);
  if (layout == ConvLayout::nhwc) {
    if (x.dim() != 4 || x.size(3) != channels)
      layer_fail(layer,
                 "input must be [N, H, W, " + c + "] (layout nhwc), got " + shape_str(x.shape()));
  } else if (x.dim() != 4 || x.size(1) != channels) {
    layer_fail(layer, "input must be [N, " + c + ", H, W], got " + shape_str(x.shape()));
  }
}

}  // namespace

// ---- Linear ----
Linear::Linear(int64_t in_features, int64_t out_features, Generator& gen, bool bias)
    : Module("Linear"), in_(in_features), out_(out_features) {
  check_positive("Linear", "in_features", in_features, true);
  check_positive("Linear", "out_features", out_features, true);
  Tensor w = empty({out_features, in_features});
  Tensor b = bias ? empty({out_features}) : Tensor();
  default_init(w, b, gen);
  weight_ = register_parameter("weight", w);
  if (bias) bias_ = register_parameter("bias", b);
}

Linear::Linear(const Tensor& weight, const Tensor& bias) : Module("Linear") {
  if (!weight.defined() || weight.dim() != 2)
    layer_fail("Linear",
               "weight must be [out, in], got " +
                   (weight.defined() ? shape_str(weight.shape()) : std::string("undefined")));
  in_ = weight.size(1);
  out_ = weight.size(0);
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != out_))
    layer_fail("Linear",
               "bias must be [" + std::to_string(out_) + "], got " + shape_str(bias.shape()));
  weight_ = register_parameter("weight", weight);
  if (bias.defined()) bias_ = register_parameter("bias", bias);
}

Tensor Linear::forward(const Tensor& x) {
  if (x.dim() < 1 || x.size(-1) != in_)
    layer_fail("Linear", "input must end in in_features " + std::to_string(in_) + ", got " +
                             shape_str(x.shape()));
  return linear(x, weight_, bias_);
}

// ---- Conv2d ----
Conv2d::Conv2d(int64_t in_channels, int64_t out_channels, std::array<int64_t, 2> kernel,
               Generator& gen, const Conv2dOptions& opts)
    : Module("Conv2d"), opts_(opts) {
  check_conv("Conv2d", in_channels, out_channels, kernel, opts);
  if (opts.output_padding != std::array<int64_t, 2>{0, 0})
    layer_fail("Conv2d", "output_padding applies only to ConvTranspose2d");
  Tensor w = empty({out_channels, in_channels / opts.groups, kernel[0], kernel[1]});
  Tensor b = opts.bias ? empty({out_channels}) : Tensor();
  default_init(w, b, gen);
  weight_ = register_parameter("weight", w);
  if (opts.bias) bias_ = register_parameter("bias", b);
}

Tensor Conv2d::forward(const Tensor& x) {
  check_channels("Conv2d", x, weight_.size(1) * opts_.groups, opts_.layout);
  return conv2d(x, weight_, bias_, opts_.stride, opts_.padding, opts_.dilation, opts_.groups,
                opts_.layout);
}

// ---- ConvTranspose2d ----
ConvTranspose2d::ConvTranspose2d(int64_t in_channels, int64_t out_channels,
                                 std::array<int64_t, 2> kernel, Generator& gen,
                                 const Conv2dOptions& opts)
    : Module("ConvTranspose2d"), opts_(opts) {
  check_conv("ConvTranspose2d", in_channels, out_channels, kernel, opts);
  for (int i = 0; i < 2; ++i)
    if (opts.output_padding[i] >= opts.stride[i] && opts.output_padding[i] >= opts.dilation[i])
      layer_fail("ConvTranspose2d", "output_padding must be smaller than stride or dilation, got " +
                                        std::to_string(opts.output_padding[i]));
  Tensor w = empty({in_channels, out_channels / opts.groups, kernel[0], kernel[1]});
  Tensor b = opts.bias ? empty({out_channels}) : Tensor();
  default_init(w, b, gen);
  weight_ = register_parameter("weight", w);
  if (opts.bias) bias_ = register_parameter("bias", b);
}

Tensor ConvTranspose2d::forward(const Tensor& x) {
  check_channels("ConvTranspose2d", x, weight_.size(0), opts_.layout);
  return conv_transpose2d(x, weight_, bias_, opts_.stride, opts_.padding, opts_.output_padding,
                          opts_.groups, opts_.dilation, opts_.layout);
}

// ---- Embedding ----
Embedding::Embedding(int64_t num_embeddings, int64_t embedding_dim, Generator& gen,
                     int64_t padding_idx)
    : Module("Embedding"), padding_idx_(padding_idx) {
  check_positive("Embedding", "num_embeddings", num_embeddings, true);
  check_positive("Embedding", "embedding_dim", embedding_dim, true);
  if (padding_idx < -1 || padding_idx >= num_embeddings)
    layer_fail("Embedding", "padding_idx must be -1 (none) or in [0, " +
                                std::to_string(num_embeddings) + "), got " +
                                std::to_string(padding_idx));
  Tensor w = empty({num_embeddings, embedding_dim});
  {
    NoGradGuard no_grad;
    normal_(w, 0.0, 1.0, gen);
    if (padding_idx >= 0) fill_(w.select(0, padding_idx), 0.0);
  }
  weight_ = register_parameter("weight", w);
}

Embedding::Embedding(const Tensor& weight) : Module("Embedding"), padding_idx_(-1) {
  if (!weight.defined() || weight.dim() != 2)
    layer_fail("Embedding",
               "weight must be [num_embeddings, embedding_dim], got " +
                   (weight.defined() ? shape_str(weight.shape()) : std::string("undefined")));
  weight_ = register_parameter("weight", weight);
}

Tensor Embedding::forward(const Tensor& indices) {
  return embedding(weight_, indices, padding_idx_);
}

// ---- Sequential ----
void Sequential::push_back(std::shared_ptr<Module> module) {
  register_module(std::to_string(items_.size()), module);
  items_.push_back(std::move(module));
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor y = x;
  for (const auto& m : items_) y = m->forward(y);
  return y;
}

std::shared_ptr<Module> Sequential::replace_module(const std::string& name,
                                                   std::shared_ptr<Module> module) {
  std::shared_ptr<Module> old = Module::replace_module(name, module);
  for (auto& item : items_)
    if (item == old) item = module;
  return old;
}

const std::shared_ptr<Module>& Sequential::operator[](size_t i) const {
  if (i >= items_.size())
    layer_fail("Sequential", "index " + std::to_string(i) + " out of range for " +
                                 std::to_string(items_.size()) + " modules");
  return items_[i];
}

// ---- activations ----
Tensor ReLU::forward(const Tensor& x) { return relu(x); }
Tensor GELU::forward(const Tensor& x) { return gelu(x, approx_); }
Tensor SiLU::forward(const Tensor& x) { return silu(x); }
Tensor Tanh::forward(const Tensor& x) { return tanh(x); }
Tensor Sigmoid::forward(const Tensor& x) { return sigmoid(x); }
Tensor LeakyReLU::forward(const Tensor& x) { return leaky_relu(x, slope_); }
Tensor Flatten::forward(const Tensor& x) { return flatten(x, start_, end_); }
Tensor MaxPool2d::forward(const Tensor& x) { return max_pool2d(x, kernel_, stride_); }
Tensor UpsampleNearest2x::forward(const Tensor& x) { return interpolate_nearest2x(x); }

}  // namespace quanta
