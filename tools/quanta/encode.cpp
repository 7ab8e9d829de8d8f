// `quanta encode CHECKPOINT --out CODES`: images to code indices, for users who
// train a prior (a transformer, a PixelCNN) on the codes.
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "data/fashion_mnist.h"
#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/io/safetensors.h"
#include "engine/ops/join.h"
#include "flag_checks.h"
#include "image/png.h"
#include "train/checkpoint.h"
#include "train/limits.h"

namespace quanta::cli {
namespace {

struct EncodeOptions {
  std::string checkpoint;
  std::string out;
  std::string data;
  std::string split = "test";
  int64_t limit = -1;
  std::string device = "cpu";
  std::vector<std::string> images;
};

// A 28 x 28 PNG as [1, 1, 28, 28] in [0, 1]; RGB is averaged to gray.
Tensor image_tensor(const std::string& path) {
  const image::Image img = image::read_png(path);
  if (img.width != 28 || img.height != 28)
    throw std::runtime_error(path + ": expected a 28 x 28 image, got " + std::to_string(img.width) +
                             " x " + std::to_string(img.height));
  Tensor t = empty({1, 1, 28, 28});
  float* p = t.data<float>();
  for (int64_t i = 0; i < 28 * 28; ++i) {
    float s = 0;
    for (int c = 0; c < img.channels; ++c) s += img.pixels[i * img.channels + c];
    p[i] = s / (255.0f * static_cast<float>(img.channels));
  }
  return t;
}

void run_encode(const EncodeOptions& o) {
  std::vector<InputFile> inputs = {{"the checkpoint", o.checkpoint}};
  for (const std::string& image : o.images) inputs.push_back({"an image", image});
  refuse_output_over_input("--out", o.out, inputs);
  const Device device = device_flag(o.device);
  const train::Checkpoint ck = train::load_checkpoint(o.checkpoint);
  std::unique_ptr<train::VqVae> model = train::restore_model(ck, o.checkpoint);
  model->to(device);
  if (model->quantizer().codebook_size() == 0)
    throw UsageError(o.checkpoint + " was trained with quantizer '" +
                     ck.info.config["quantizer"].value("type", std::string("none")) +
                     "', which has no codes to encode");
  if (const std::string bad = train::non_finite_summary(ck, o.checkpoint); !bad.empty())
    throw std::runtime_error(bad + ": its codes would be meaningless");
  io::TensorMap tensors;
  Tensor images;
  if (!o.images.empty()) {
    std::vector<Tensor> list;
    for (const auto& path : o.images) list.push_back(image_tensor(path));
    images = cat(list, 0);
  } else {
    const std::string dir =
        o.data.empty() ? ck.info.config.value("data", std::string(data::kFashionMnistDir)) : o.data;
    data::ImageDataset ds = data::load_fashion_mnist(
        dir, o.split == "train" ? data::Split::train : data::Split::test, o.limit);
    images = ds.images;
    tensors.emplace_back("labels", ds.labels);
  }
  std::vector<Tensor> codes;
  {
    NoGradGuard no_grad;
    for (int64_t s = 0; s < images.size(0); s += 256) {
      const Tensor batch =
          images.narrow(0, s, std::min<int64_t>(256, images.size(0) - s)).to(device);
      codes.push_back(model->quantizer().forward(model->encode(batch)).indices);
    }
  }
  if (codes.empty()) throw UsageError("no images to encode");
  const Tensor indices = cat(codes, 0).to(Device::cpu());  // one read, at the end
  tensors.insert(tensors.begin(), {"indices", indices});
  io::save_safetensors(o.out, tensors,
                       {{"checkpoint", o.checkpoint},
                        {"checkpoint_fingerprint", train::model_fingerprint(ck)},
                        {"codebook_size", std::to_string(model->quantizer().codebook_size())},
                        {"num_codebooks", std::to_string(model->quantizer().num_codebooks())},
                        {"source", o.images.empty() ? "fashion-mnist " + o.split : "png files"}});
  std::cout << "encoded " << images.size(0) << " images to indices " << shape_str(indices.shape())
            << " (codebook of " << model->quantizer().codebook_size() << ") in " << o.out << "\n";
}

}  // namespace

void add_encode(CLI::App& app) {
  auto o = std::make_shared<EncodeOptions>();
  CLI::App* sub =
      app.add_subcommand("encode",
                         "Encode images (Fashion-MNIST or 28x28 PNGs) to code indices in a "
                         "safetensors file (\"indices\" [N, 7, 7], \"labels\" for dataset images)");
  sub->footer(
      "Examples:\n"
      "  quanta encode runs/vq/checkpoint.safetensors --out codes.safetensors\n"
      "  quanta encode ckpt.safetensors --split train --limit 1000 --out train_codes.safetensors\n"
      "  quanta encode ckpt.safetensors --images a.png b.png --out ab.safetensors");
  sub->add_option("checkpoint", o->checkpoint, "checkpoint.safetensors from quanta train")
      ->required();
  sub->add_option("--out", o->out, "safetensors file to write")->required();
  sub->add_option("--split", o->split, "dataset split: test or train")
      ->capture_default_str()
      ->check(CLI::IsMember({"test", "train"}));
  sub->add_option("--limit", o->limit, "first N images of the split only")
      ->transform(integer_in(0, train::kMaxCount));
  sub->add_option("--data", o->data, "Fashion-MNIST folder (default: the one trained on)");
  add_device_flag(*sub, o->device, "the model and each batch");
  sub->add_option("--images", o->images, "28x28 PNG files to encode instead of the dataset")
      ->check(CLI::ExistingFile);
  sub->callback([o] { run_encode(*o); });
}

}  // namespace quanta::cli
