#include "train/vqvae.h"

#include <stdexcept>

#include "engine/device_backend.h"
#include "engine/ops/view.h"

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
  // Each stream draws its layers last first: the order in which GCC
  // evaluated the arguments of the expression that used to build them, kept
  // explicit so that every compiler draws the same parameters and earlier
  // runs reproduce.
  convs_.resize(5);
  convs_[3] = conv(c, d, 1, 1, 0, enc_gen);
  convs_[2] = conv(c, c, 3, 1, 1, enc_gen);
  convs_[1] = conv(c, c, 4, 2, 1, enc_gen);
  convs_[0] = conv(1, c, 4, 2, 1, enc_gen);
  encoder_ = register_module(
      "encoder", std::make_shared<Sequential>(convs_[0], std::make_shared<ReLU>(), convs_[1],
                                              std::make_shared<ReLU>(), convs_[2],
                                              std::make_shared<ReLU>(), convs_[3]));
  register_module("quantizer", quantizer_->module());
  ups_.resize(2);
  ups_[1] = up(c, 1, dec_gen);
  ups_[0] = up(c, c, dec_gen);
  convs_[4] = conv(d, c, 3, 1, 1, dec_gen);
  decoder_ = register_module(
      "decoder",
      std::make_shared<Sequential>(convs_[4], std::make_shared<ReLU>(), ups_[0],
                                   std::make_shared<ReLU>(), ups_[1], std::make_shared<Sigmoid>()));
}

ConvLayout VqVae::use_layout_for(Device device) {
  // Channels last saves the CPU kernels (the CPU's and sim's) two transposes
  // per layer and pass; the CUDA kernels compute channels first, where
  // channels last would add them instead (engine/ops/conv.h).
  const ConvLayout layout =
      device_caps(device).channels_last_conv ? ConvLayout::nhwc : ConvLayout::nchw;
  for (const auto& c : convs_) c->set_layout(layout);
  for (const auto& u : ups_) u->set_layout(layout);
  return layout;
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
  if (use_layout_for(images.device()) == ConvLayout::nchw) return encoder_->forward(images);
  // One channel: [B, 1, 28, 28] is already [B, 28, 28, 1] in memory.
  const Tensor z = encoder_->forward(reshape(images, {images.size(0), 28, 28, 1}));
  return permute(z, {0, 3, 1, 2});  // [B, dim, 7, 7], a view
}

Tensor VqVae::decode(const Tensor& latents) {
  if (latents.dim() != 4)
    throw std::invalid_argument("[VqVae] expected latents [B, dim, H, W], got " +
                                shape_str(latents.shape()));
  if (use_layout_for(latents.device()) == ConvLayout::nchw) return decoder_->forward(latents);
  const Tensor y = decoder_->forward(permute(latents, {0, 2, 3, 1}));
  return reshape(y, {y.size(0), 1, y.size(1), y.size(2)});
}

}  // namespace quanta::train
