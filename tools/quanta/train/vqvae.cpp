#include "train/vqvae.h"

#include <stdexcept>

#include "engine/ops/view.h"

namespace quanta::train {
namespace {

// The layers keep their activations channels last, [B, H, W, C]: the CPU's
// convolution kernels compute in that layout, so no layer transposes its
// input or output (ReLU and Sigmoid do not care). The weights are
// [O, C, kh, kw] as in PyTorch, so checkpoints do not depend on it.
std::shared_ptr<Conv2d> conv(int64_t in, int64_t out, int64_t k, int64_t stride, int64_t pad,
                             Generator& gen) {
  return std::make_shared<Conv2d>(
      in, out, std::array<int64_t, 2>{k, k}, gen,
      Conv2dOptions{.stride = {stride, stride}, .padding = {pad, pad}, .layout = ConvLayout::nhwc});
}

std::shared_ptr<ConvTranspose2d> up(int64_t in, int64_t out, Generator& gen) {
  // kernel 4, stride 2, padding 1 doubles the side exactly.
  return std::make_shared<ConvTranspose2d>(
      in, out, std::array<int64_t, 2>{4, 4}, gen,
      Conv2dOptions{.stride = {2, 2}, .padding = {1, 1}, .layout = ConvLayout::nhwc});
}

}  // namespace

VqVae::VqVae(const ModelConfig& cfg, std::unique_ptr<TrainQuantizer> quantizer, Generator& gen)
    : Module("VqVae"), cfg_(cfg), quantizer_(std::move(quantizer)) {
  if (cfg.hidden <= 0 || cfg.dim <= 0)
    throw std::invalid_argument("[VqVae] hidden and dim must be positive");
  const int64_t c = cfg.hidden, d = cfg.dim;
  Generator enc_gen = gen.fork("encoder"), dec_gen = gen.fork("decoder");
  encoder_ = register_module("encoder", std::make_shared<Sequential>(
                                            conv(1, c, 4, 2, 1, enc_gen), std::make_shared<ReLU>(),
                                            conv(c, c, 4, 2, 1, enc_gen), std::make_shared<ReLU>(),
                                            conv(c, c, 3, 1, 1, enc_gen), std::make_shared<ReLU>(),
                                            conv(c, d, 1, 1, 0, enc_gen)));
  register_module("quantizer", quantizer_->module());
  decoder_ = register_module(
      "decoder", std::make_shared<Sequential>(
                     conv(d, c, 3, 1, 1, dec_gen), std::make_shared<ReLU>(), up(c, c, dec_gen),
                     std::make_shared<ReLU>(), up(c, 1, dec_gen), std::make_shared<Sigmoid>()));
}

VqVaeOutput VqVae::run(const Tensor& images) {
  VqVaeOutput out;
  out.quantized = quantizer_->forward(encode(images));
  out.reconstruction = decode(out.quantized.quantized);
  return out;
}

Tensor VqVae::encode(const Tensor& images) {
  if (images.dim() != 4 || images.size(1) != 1 || images.size(2) != 28 || images.size(3) != 28)
    throw std::invalid_argument("[VqVae] expected images [B, 1, 28, 28], got " +
                                shape_str(images.shape()));
  // One channel: [B, 1, 28, 28] is already [B, 28, 28, 1] in memory.
  const Tensor z = encoder_->forward(reshape(images, {images.size(0), 28, 28, 1}));
  return permute(z, {0, 3, 1, 2});  // [B, dim, 7, 7], a view
}

Tensor VqVae::decode(const Tensor& latents) {
  if (latents.dim() != 4)
    throw std::invalid_argument("[VqVae] expected latents [B, dim, H, W], got " +
                                shape_str(latents.shape()));
  const Tensor y = decoder_->forward(permute(latents, {0, 2, 3, 1}));
  return reshape(y, {y.size(0), 1, y.size(1), y.size(2)});
}

}  // namespace quanta::train
