// `quanta decode CHECKPOINT CODES --out PNG`: code indices back to images.
#include <iostream>
#include <memory>
#include <string>

#include "commands.h"
#include "engine/autograd/grad_mode.h"
#include "engine/io/safetensors.h"
#include "image/grid.h"
#include "train/checkpoint.h"

namespace quanta::cli {
namespace {

struct DecodeOptions {
  std::string checkpoint;
  std::string codes;
  std::string out;
  int64_t cols = 8;
  int64_t limit = 64;
};

void run_decode(const DecodeOptions& o) {
  const train::Checkpoint ck = train::load_checkpoint(o.checkpoint);
  std::unique_ptr<train::VqVae> model = train::restore_model(ck, o.checkpoint);
  const io::SafetensorsFile file = io::load_safetensors(o.codes);
  const Tensor* found = find_tensor(file.tensors, "indices");
  if (!found) throw std::runtime_error(o.codes + ": no tensor named 'indices'");
  Tensor indices = *found;
  if (indices.dim() < 1 || (indices.dtype() != DType::i64 && indices.dtype() != DType::i32))
    throw std::runtime_error(o.codes + ": 'indices' must be an integer tensor [N, 7, 7, ...]");
  const int64_t k = model->quantizer().codebook_size();
  for (int64_t v : indices.to_vector<int64_t>())
    if (v < 0 || v >= k)
      throw std::runtime_error(o.codes + ": index " + std::to_string(v) +
                               " outside the checkpoint's codebook of " + std::to_string(k));
  indices = indices.narrow(0, 0, std::min(o.limit, indices.size(0)));
  Tensor images;
  {
    NoGradGuard no_grad;
    images = model->decode(model->quantizer().decode(indices));
  }
  image::write_png(o.out, image::image_grid(images, o.cols, 2, 2));
  std::cout << "decoded " << images.size(0) << " images to " << o.out << "\n";
}

}  // namespace

void add_decode(CLI::App& app) {
  auto o = std::make_shared<DecodeOptions>();
  CLI::App* sub = app.add_subcommand(
      "decode", "Decode code indices (a safetensors file from quanta encode, or sampled "
                "by a prior) to images, written as a PNG grid");
  sub->footer(
      "Examples:\n"
      "  quanta decode runs/vq/checkpoint.safetensors codes.safetensors --out decoded.png\n"
      "  quanta decode ckpt.safetensors samples.safetensors --out grid.png --cols 16 "
      "--limit 128");
  sub->add_option("checkpoint", o->checkpoint, "checkpoint.safetensors from quanta train")
      ->required();
  sub->add_option("codes", o->codes, "safetensors file with an integer tensor 'indices'")
      ->required();
  sub->add_option("--out", o->out, "PNG file to write")->required();
  sub->add_option("--cols", o->cols, "images per row (default 8)")->check(CLI::PositiveNumber);
  sub->add_option("--limit", o->limit, "decode the first N only (default 64)")
      ->check(CLI::PositiveNumber);
  sub->callback([o] { run_decode(*o); });
}

}  // namespace quanta::cli
