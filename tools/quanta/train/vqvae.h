#pragma once
// The convolutional VQ-VAE that `quanta train` fits to 28 x 28 gray images:
//   encoder  1x28x28 -conv4 s2-> Cx14x14 -conv4 s2-> Cx7x7 -conv3-> Cx7x7
//            -conv1-> Dx7x7                                  (ReLU between)
//   quantizer on the D x 7 x 7 map (49 codes per image)
//   decoder  Dx7x7 -conv3-> Cx7x7 -convT4 s2-> Cx14x14 -convT4 s2-> 1x28x28
//            -> sigmoid                                      (ReLU between)
// C = ModelConfig::hidden, D = ModelConfig::dim. Loss: mean squared
// reconstruction error plus the sum of the quantizer's auxiliary loss.
// Between its layers the activations are channels last on the CPU (its
// convolution kernels' layout) and channels first on a GPU (the CUDA
// kernels'); encode and decode take and give channels first either way.
#include <memory>
#include <vector>

#include "engine/nn/layers.h"
#include "engine/random/generator.h"
#include "quant/quantize_output.h"
#include "train/config.h"
#include "train/quantizer.h"

namespace quanta::train {

/** One forward pass: the reconstruction and what the quantizer returned. */
struct VqVaeOutput {
  Tensor reconstruction;  // [B, 1, 28, 28] in (0, 1)
  quant::QuantizeOutput quantized;
};

/** Encoder, quantizer and decoder as one Module ("encoder.*", "quantizer.*",
 * "decoder.*" in its state dict). */
class VqVae : public Module {
 public:
  /** Parameters drawn from `gen`; `quantizer` is owned. */
  VqVae(const ModelConfig& cfg, std::unique_ptr<TrainQuantizer> quantizer, Generator& gen);

  /** Encodes, quantizes and decodes images [B, 1, 28, 28]. */
  VqVaeOutput run(const Tensor& images);
  /** The reconstruction of run(images). */
  Tensor forward(const Tensor& images) override { return run(images).reconstruction; }
  /** The latent map [B, D, 7, 7] before quantization. */
  Tensor encode(const Tensor& images);
  /** Images [B, 1, 28, 28] from a (quantized) latent map [B, D, 7, 7]. */
  Tensor decode(const Tensor& latents);

  TrainQuantizer& quantizer() { return *quantizer_; }
  const ModelConfig& config() const { return cfg_; }

 private:
  // Sets every convolution's layout for activations on `device`.
  ConvLayout use_layout_for(Device device);

  ModelConfig cfg_;
  std::shared_ptr<Sequential> encoder_, decoder_;
  std::vector<std::shared_ptr<Conv2d>> convs_;
  std::vector<std::shared_ptr<ConvTranspose2d>> ups_;
  std::unique_ptr<TrainQuantizer> quantizer_;
};

/** Side length of the latent map for 28 x 28 inputs. */
inline constexpr int64_t kLatentSide = 7;

}  // namespace quanta::train
