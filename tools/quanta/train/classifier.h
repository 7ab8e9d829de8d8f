#pragma once
// The Fashion-MNIST classifier of `quanta train --task classify`, the model
// `quanta finetune` adapts: an MLP whose big layers are Linear, so
// quant::quantize_nf4 turns all of them into NF4 bases (with LoRA adapters):
//   [B, 1, 28, 28] -flatten-> 784 -Linear-> H1 -ReLU-> -Linear-> H2 -ReLU->
//   -Linear-> 10 logits
// Children of one Sequential, so its state dict reads "1.weight", "1.bias",
// "3.*", "5.*" (the layers quantize_nf4 replaces in place).
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/nn/layers.h"
#include "engine/random/generator.h"

namespace quanta::train {

/** Format tag of classifier checkpoints (checkpoint.h). */
inline constexpr const char* kClassifierFormat = "quanta-classifier-1";

/** Number of Fashion-MNIST classes. */
inline constexpr int64_t kNumClasses = 10;

/** Widths of the two hidden layers. */
struct ClassifierShape {
  int64_t hidden1 = 256;
  int64_t hidden2 = 128;
};

/** The MLP above, parameters drawn from `gen`. */
std::shared_ptr<Sequential> make_classifier(const ClassifierShape& shape, Generator& gen);

/** Fraction of `images` [N, 1, 28, 28] whose argmax logit equals `labels`
 * [N] (i64), in eval mode and without gradients, `batch` images at a time
 * moved to the model's device (its parameters'); NaN when N = 0. One read of
 * the device, at the end. */
double accuracy(Module& model, const Tensor& images, const Tensor& labels, int64_t batch = 500);

}  // namespace quanta::train
