#pragma once
// The convolutional VQ-VAE that `quanta train` fits to 28 x 28 gray images:
//   encoder  1x28x28 -conv4 s2-> Cx14x14 -conv4 s2-> Cx7x7 -conv3-> Cx7x7
//            [-GroupNorm->] -conv1-> Dx7x7                   (ReLU between)
//   quantizer on the D x 7 x 7 map (49 codes per image)
//   decoder  Dx7x7 -conv3-> Cx7x7 -convT4 s2-> Cx14x14 -convT4 s2-> 1x28x28
//            -> sigmoid                                      (ReLU between)
// (ModelConfig::arch "conv"; "vqp-example" is vector-quantize-pytorch's
// examples' autoencoder instead:
//   encoder  1x28x28 -conv3-> C/2 -maxpool2-> GELU -conv3-> C -maxpool2->
//            Cx7x7 [-GroupNorm->] -conv1-> Dx7x7
//   decoder  Dx7x7 -conv3-> C -up2-> -conv3-> C/2 -> GELU -up2-> -conv3-> 1x28x28
//            -> clamp to [-1, 1]
// on images mapped to [-1, 1] and back.)
// C = ModelConfig::hidden, D = ModelConfig::dim; the GroupNorm (no affine
// parameters, so no new state) when ModelConfig::latent_norm_groups > 0. Loss: mean squared
// reconstruction error plus the sum of the quantizer's auxiliary loss.
// Between its layers the activations are channels last on the CPU (its
// convolution kernels' layout) and channels first on a GPU unless
// set_activation_layout says otherwise; encode and decode take and give
// channels first either way.
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

/** How the convolutions of a VqVae keep their activations between layers. */
enum class ActivationLayout {
  automatic,       // as the device prefers (DeviceCaps::prefers_channels_last)
  channels_first,  // [B, C, H, W] on every device
  channels_last,   // [B, H, W, C] on every device
};

/** Throws std::invalid_argument when a model of `arch` cannot keep its
 * activations as `layout` says: channels_last on "vqp-example", whose pools
 * and upsampling compute channels first. */
void check_activation_layout(const std::string& arch, ActivationLayout layout);

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

  /** Width of the range images span inside the model: 1 for [0, 1] (conv),
   * 2 for vqp-example's [-1, 1]. The reconstruction loss is measured in the
   * model's own units, as the reference examples measure theirs. */
  double image_scale() const;

  /** Chooses the activations' layout (automatic unless set): channels last
   * where the device prefers it (the CPU, sim), channels first elsewhere.
   * Both layouts compute the same function, equal to f32 rounding (on the
   * CPU most layers give the same bits; the one-channel layers and the bias
   * gradients sum in another order; a GPU runs other cuDNN algorithms).
   * Throws std::invalid_argument for channels_last on
   * "vqp-example", whose pools and upsampling compute channels first. */
  void set_activation_layout(ActivationLayout layout);

  TrainQuantizer& quantizer() { return *quantizer_; }
  const ModelConfig& config() const { return cfg_; }

 private:
  void build_conv(Generator& enc_gen, Generator& dec_gen);
  void build_vqp_example(Generator& enc_gen, Generator& dec_gen);
  // Sets every convolution's layout for activations on `device`.
  ConvLayout use_layout_for(Device device);

  class LatentNorm;

  ModelConfig cfg_;
  std::shared_ptr<Sequential> encoder_, decoder_;
  std::shared_ptr<LatentNorm> latent_norm_;
  std::vector<std::shared_ptr<Conv2d>> convs_;
  std::vector<std::shared_ptr<ConvTranspose2d>> ups_;
  std::unique_ptr<TrainQuantizer> quantizer_;
  ActivationLayout layout_ = ActivationLayout::automatic;
};

/** Side length of the latent map for 28 x 28 inputs. */
inline constexpr int64_t kLatentSide = 7;

}  // namespace quanta::train
