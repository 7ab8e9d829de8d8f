#include "train/vqvae.h"

#include <stdexcept>

namespace quanta::train {
namespace {

std::shared_ptr<Conv2d> conv(int64_t in, int64_t out, int64_t k, int64_t stride, int64_t pad,
                             Generator& gen) {
  return std::make_shared<Conv2d>(in, out, std::array<int64_t, 2>{k, k}, gen,
                                  Conv2dOptions{.stride = {stride, stride}, .padding = {pad, pad}});
}

std::shared_ptr<ConvTranspose2d> up(int64_t in, int64_t out, Generator& gen) {
  // kernel 4, stride 2, padding 1 doubles the side exactly.
  return std::make_shared<ConvTranspose2d>(in, out, std::array<int64_t, 2>{4, 4}, gen,
                                           Conv2dOptions{.stride = {2, 2}, .padding = {1, 1}});
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
  return encoder_->forward(images);
}

Tensor VqVae::decode(const Tensor& latents) { return decoder_->forward(latents); }

}  // namespace quanta::train
