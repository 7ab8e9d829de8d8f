#include "train/vqvae.h"

#include <stdexcept>

#include "engine/device_backend.h"
#include "engine/ops/elementwise.h"
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

// GroupNorm over the channels of activations in either layout: channels last
// are viewed channels first for the normalisation and back, views only (the
// norm's kernels read and write channels-last memory where it lies).
class VqVae::LatentNorm : public Module {
 public:
  explicit LatentNorm(int64_t groups, int64_t channels)
      : Module("LatentNorm"), norm_(groups, channels, 1e-5, /*affine=*/false) {}
  void set_layout(ConvLayout layout) { layout_ = layout; }
  Tensor forward(const Tensor& x) override {
    if (layout_ == ConvLayout::nchw) return norm_.forward(x);
    return permute(norm_.forward(permute(x, {0, 3, 1, 2})), {0, 2, 3, 1});
  }

 private:
  GroupNorm norm_;
  ConvLayout layout_ = ConvLayout::nchw;
};

VqVae::VqVae(const ModelConfig& cfg, std::unique_ptr<TrainQuantizer> quantizer, Generator& gen)
    : Module("VqVae"), cfg_(cfg), quantizer_(std::move(quantizer)) {
  if (cfg.hidden <= 0 || cfg.dim <= 0)
    throw std::invalid_argument("[VqVae] hidden and dim must be positive");
  Generator enc_gen = gen.fork("encoder"), dec_gen = gen.fork("decoder");
  if (cfg.arch == "conv") {
    build_conv(enc_gen, dec_gen);
  } else if (cfg.arch == "vqp-example") {
    build_vqp_example(enc_gen, dec_gen);
  } else {
    throw std::invalid_argument("[VqVae] arch must be conv or vqp-example, got \"" + cfg.arch +
                                "\"");
  }
}

void VqVae::build_conv(Generator& enc_gen, Generator& dec_gen) {
  const int64_t c = cfg_.hidden, d = cfg_.dim;
  // Each stream draws its layers last first: the order in which GCC
  // evaluated the arguments of the expression that used to build them, kept
  // explicit so that every compiler draws the same parameters and earlier
  // runs reproduce.
  convs_.resize(5);
  convs_[3] = conv(c, d, 1, 1, 0, enc_gen);
  convs_[2] = conv(c, c, 3, 1, 1, enc_gen);
  convs_[1] = conv(c, c, 4, 2, 1, enc_gen);
  convs_[0] = conv(1, c, 4, 2, 1, enc_gen);
  auto encoder =
      std::make_shared<Sequential>(convs_[0], std::make_shared<ReLU>(), convs_[1],
                                   std::make_shared<ReLU>(), convs_[2], std::make_shared<ReLU>());
  if (cfg_.latent_norm_groups > 0) {
    latent_norm_ = std::make_shared<LatentNorm>(cfg_.latent_norm_groups, c);
    encoder->push_back(latent_norm_);
  }
  encoder->push_back(convs_[3]);
  encoder_ = register_module("encoder", encoder);
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

void VqVae::build_vqp_example(Generator& enc_gen, Generator& dec_gen) {
  // vector-quantize-pytorch's examples/autoencoder_{fsq,lfq}.py: 3x3
  // convolutions, 2x2 max pools and nearest upsampling, GELU; C/2 and C
  // channels (16 and 32 there).
  const int64_t c = cfg_.hidden, h = c / 2, d = cfg_.dim;
  if (h < 1) throw std::invalid_argument("[VqVae] arch vqp-example needs hidden >= 2");
  convs_ = {conv(1, h, 3, 1, 1, enc_gen), conv(h, c, 3, 1, 1, enc_gen),
            conv(c, d, 1, 1, 0, enc_gen), conv(d, c, 3, 1, 1, dec_gen),
            conv(c, h, 3, 1, 1, dec_gen), conv(h, 1, 3, 1, 1, dec_gen)};
  auto pool = [] { return std::make_shared<MaxPool2d>(std::array<int64_t, 2>{2, 2}); };
  auto encoder =
      std::make_shared<Sequential>(convs_[0], pool(), std::make_shared<GELU>(), convs_[1], pool());
  if (cfg_.latent_norm_groups > 0) {
    latent_norm_ = std::make_shared<LatentNorm>(cfg_.latent_norm_groups, c);
    encoder->push_back(latent_norm_);
  }
  encoder->push_back(convs_[2]);
  encoder_ = register_module("encoder", encoder);
  register_module("quantizer", quantizer_->module());
  decoder_ = register_module(
      "decoder", std::make_shared<Sequential>(convs_[3], std::make_shared<UpsampleNearest2x>(),
                                              convs_[4], std::make_shared<GELU>(),
                                              std::make_shared<UpsampleNearest2x>(), convs_[5]));
}

double VqVae::image_scale() const { return cfg_.arch == "vqp-example" ? 2.0 : 1.0; }

void check_activation_layout(const std::string& arch, ActivationLayout layout) {
  if (layout == ActivationLayout::channels_last && arch != "conv")
    throw std::invalid_argument("model.arch " + arch +
                                " computes channels first (its pools and upsampling)");
}

void VqVae::set_activation_layout(ActivationLayout layout) {
  check_activation_layout(cfg_.arch, layout);
  layout_ = layout;
}

ConvLayout VqVae::use_layout_for(Device device) {
  // Channels last saves the CPU kernels (the CPU's and sim's) two transposes
  // per layer and pass. The pools and upsampling of vqp-example compute
  // channels first.
  const bool last = layout_ == ActivationLayout::automatic
                        ? device_caps(device).prefers_channels_last
                        : layout_ == ActivationLayout::channels_last;
  const ConvLayout layout = last && cfg_.arch == "conv" ? ConvLayout::nhwc : ConvLayout::nchw;
  for (const auto& c : convs_) c->set_layout(layout);
  for (const auto& u : ups_) u->set_layout(layout);
  if (latent_norm_) latent_norm_->set_layout(layout);
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
  const ConvLayout layout = use_layout_for(images.device());
  // vqp-example sees images in [-1, 1], as the examples' Normalize((0.5,), (0.5,)).
  if (cfg_.arch == "vqp-example") return encoder_->forward(images * 2.0 - 1.0);
  if (layout == ConvLayout::nchw) return encoder_->forward(images);
  // One channel: [B, 1, 28, 28] is already [B, 28, 28, 1] in memory.
  const Tensor z = encoder_->forward(reshape(images, {images.size(0), 28, 28, 1}));
  return permute(z, {0, 3, 1, 2});  // [B, dim, 7, 7], a view
}

Tensor VqVae::decode(const Tensor& latents) {
  if (latents.dim() != 4)
    throw std::invalid_argument("[VqVae] expected latents [B, dim, H, W], got " +
                                shape_str(latents.shape()));
  if (cfg_.arch == "vqp-example") {
    // The examples clamp the output to [-1, 1]; mapped back to [0, 1].
    use_layout_for(latents.device());
    return (clamp(decoder_->forward(latents), -1.0, 1.0) + 1.0) * 0.5;
  }
  if (use_layout_for(latents.device()) == ConvLayout::nchw) return decoder_->forward(latents);
  const Tensor y = decoder_->forward(permute(latents, {0, 2, 3, 1}));
  return reshape(y, {y.size(0), 1, y.size(1), y.size(2)});
}

}  // namespace quanta::train
