#pragma once
// Layers: Linear, convolutions, Embedding, normalisations, Sequential and
// activation modules. Parameters are created f32 on the CPU with PyTorch's
// default initialisation drawn from an explicit Generator (move or cast the
// module afterwards with Module::to):
//   Linear, Conv2d, ConvTranspose2d  weight kaiming_uniform_(a = sqrt(5)),
//                                    i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in));
//                                    bias U(-1/sqrt(fan_in), 1/sqrt(fan_in))
//   Embedding                        weight N(0, 1), row padding_idx zeroed
//   LayerNorm, GroupNorm             weight 1, bias 0
// The weight is drawn before the bias. Parameter names are PyTorch's
// ("weight", "bias"), so state dicts match torch.nn layer for layer.
#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/nn/module.h"
#include "engine/ops/conv.h"
#include "engine/ops/elementwise.h"
#include "engine/random/generator.h"

namespace quanta {

/** y = x w^T + b over the last dim: [..., in] -> [..., out]. */
class Linear : public Module {
 public:
  /** weight [out, in], bias [out] when `bias`. */
  Linear(int64_t in_features, int64_t out_features, Generator& gen, bool bias = true);
  /** Around given tensors (weight [out, in] floating, bias [out] or
   * undefined), registered as they are, without a copy: for models whose
   * weights come from a file. */
  explicit Linear(const Tensor& weight, const Tensor& bias = Tensor());
  Tensor forward(const Tensor& x) override;
  const Tensor& weight() const { return weight_; }
  /** Undefined when built without bias. */
  const Tensor& bias() const { return bias_; }
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }

 private:
  int64_t in_, out_;
  Tensor weight_, bias_;
};

/** Conv2d / ConvTranspose2d settings beyond channels and kernel size. */
struct Conv2dOptions {
  std::array<int64_t, 2> stride = {1, 1};
  std::array<int64_t, 2> padding = {0, 0};
  std::array<int64_t, 2> dilation = {1, 1};
  int64_t groups = 1;
  bool bias = true;
  /** ConvTranspose2d only: extra rows/cols on the output's bottom/right. */
  std::array<int64_t, 2> output_padding = {0, 0};
  /** Activations [N, C, H, W] (nchw) or [N, H, W, C] (nhwc, the CPU
   * kernels' own layout: no transposes around each call). */
  ConvLayout layout = ConvLayout::nchw;
};

/** 2-d cross-correlation: [N, in, H, W] -> [N, out, OH, OW]. */
class Conv2d : public Module {
 public:
  /** weight [out, in / groups, kh, kw], bias [out]; output_padding must be 0. */
  Conv2d(int64_t in_channels, int64_t out_channels, std::array<int64_t, 2> kernel_size,
         Generator& gen, const Conv2dOptions& opts = {});
  Tensor forward(const Tensor& x) override;
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }
  const Conv2dOptions& options() const { return opts_; }
  /** Switches the activations' layout (the weight does not change). */
  void set_layout(ConvLayout layout) { opts_.layout = layout; }

 private:
  Conv2dOptions opts_;
  Tensor weight_, bias_;
};

/** 2-d transposed convolution (conv2d's adjoint): [N, in, H, W] ->
 * [N, out, OH, OW]. */
class ConvTranspose2d : public Module {
 public:
  /** weight [in, out / groups, kh, kw], bias [out]. */
  ConvTranspose2d(int64_t in_channels, int64_t out_channels, std::array<int64_t, 2> kernel_size,
                  Generator& gen, const Conv2dOptions& opts = {});
  Tensor forward(const Tensor& x) override;
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }
  const Conv2dOptions& options() const { return opts_; }
  /** Switches the activations' layout (the weight does not change). */
  void set_layout(ConvLayout layout) { opts_.layout = layout; }

 private:
  Conv2dOptions opts_;
  Tensor weight_, bias_;
};

/** Lookup table: integer indices [...] -> rows [..., dim]. */
class Embedding : public Module {
 public:
  /** weight [num_embeddings, embedding_dim]; row `padding_idx` (-1: none)
   * starts at zero and gets no gradient. */
  Embedding(int64_t num_embeddings, int64_t embedding_dim, Generator& gen,
            int64_t padding_idx = -1);
  /** Around a given weight [num_embeddings, embedding_dim] (floating),
   * registered as it is, without a copy. */
  explicit Embedding(const Tensor& weight);
  Tensor forward(const Tensor& indices) override;
  const Tensor& weight() const { return weight_; }
  int64_t padding_idx() const { return padding_idx_; }

 private:
  int64_t padding_idx_;
  Tensor weight_;
};

/** Normalises over the trailing `normalized_shape` dims, then scales and
 * shifts elementwise. */
class LayerNorm : public Module {
 public:
  /** weight and bias of shape `normalized_shape` when `elementwise_affine`. */
  explicit LayerNorm(Shape normalized_shape, double eps = 1e-5, bool elementwise_affine = true);
  Tensor forward(const Tensor& x) override;
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }

 private:
  Shape shape_;
  double eps_;
  Tensor weight_, bias_;
};

/** Normalises [N, C, ...] over groups of C / num_groups channels, then
 * scales and shifts per channel. */
class GroupNorm : public Module {
 public:
  /** weight and bias [num_channels] when `affine`; num_channels must be a
   * multiple of num_groups. */
  GroupNorm(int64_t num_groups, int64_t num_channels, double eps = 1e-5, bool affine = true);
  Tensor forward(const Tensor& x) override;
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }

 private:
  int64_t groups_;
  int64_t channels_;
  double eps_;
  Tensor weight_, bias_;
};

/** Runs its children in order, each on the previous one's output. Children
 * are named "0", "1", ... */
class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  /** Sequential(a, b, c): the modules in order. */
  template <class... M>
  explicit Sequential(std::shared_ptr<M>... modules) : Module("Sequential") {
    (push_back(std::move(modules)), ...);
  }
  /** Appends `module` under the name of its position. */
  void push_back(std::shared_ptr<Module> module);
  Tensor forward(const Tensor& x) override;
  /** Number of children. */
  size_t size() const { return items_.size(); }
  /** Child `i` (bounds-checked). */
  const std::shared_ptr<Module>& operator[](size_t i) const;
  /** Replaces child `name` ("0", "1", ...) in the list forward runs too. */
  std::shared_ptr<Module> replace_module(const std::string& name,
                                         std::shared_ptr<Module> module) override;

 private:
  std::vector<std::shared_ptr<Module>> items_;
};

// ---- activations and shape helpers (no parameters) ----

/** max(x, 0). */
class ReLU : public Module {
 public:
  ReLU() : Module("ReLU") {}
  Tensor forward(const Tensor& x) override;
};

/** GELU, exact (erf) or tanh-approximated. */
class GELU : public Module {
 public:
  explicit GELU(GeluApprox approx = GeluApprox::none) : Module("GELU"), approx_(approx) {}
  Tensor forward(const Tensor& x) override;

 private:
  GeluApprox approx_;
};

/** x * sigmoid(x). */
class SiLU : public Module {
 public:
  SiLU() : Module("SiLU") {}
  Tensor forward(const Tensor& x) override;
};

/** tanh(x). */
class Tanh : public Module {
 public:
  Tanh() : Module("Tanh") {}
  Tensor forward(const Tensor& x) override;
};

/** 1 / (1 + exp(-x)). */
class Sigmoid : public Module {
 public:
  Sigmoid() : Module("Sigmoid") {}
  Tensor forward(const Tensor& x) override;
};

/** x for x >= 0, negative_slope * x otherwise. */
class LeakyReLU : public Module {
 public:
  explicit LeakyReLU(double negative_slope = 0.01) : Module("LeakyReLU"), slope_(negative_slope) {}
  Tensor forward(const Tensor& x) override;

 private:
  double slope_;
};

/** Returns its input. */
class Identity : public Module {
 public:
  Identity() : Module("Identity") {}
  Tensor forward(const Tensor& x) override { return x; }
};

/** max_pool2d over [N, C, H, W] (engine/ops/pool.h); stride {0, 0} means
 * stride = kernel. */
class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride = {0, 0})
      : Module("MaxPool2d"), kernel_(kernel), stride_(stride) {}
  Tensor forward(const Tensor& x) override;

 private:
  std::array<int64_t, 2> kernel_, stride_;
};

/** Nearest-neighbour 2x upsampling of [N, C, H, W] (PyTorch's
 * Upsample(scale_factor=2, mode="nearest")). */
class UpsampleNearest2x : public Module {
 public:
  UpsampleNearest2x() : Module("UpsampleNearest2x") {}
  Tensor forward(const Tensor& x) override;
};

/** Flattens dims start_dim..end_dim into one (default: all but the batch). */
class Flatten : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1, int64_t end_dim = -1)
      : Module("Flatten"), start_(start_dim), end_(end_dim) {}
  Tensor forward(const Tensor& x) override;

 private:
  int64_t start_, end_;
};

}  // namespace quanta
