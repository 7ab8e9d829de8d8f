// `quanta decode CHECKPOINT CODES --out PNG`: code indices back to images.
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>

#include "commands.h"
#include "engine/autograd/grad_mode.h"
#include "engine/io/safetensors.h"
#include "flag_checks.h"
#include "image/grid.h"
#include "train/checkpoint.h"
#include "train/limits.h"

namespace quanta::cli {
namespace {

struct DecodeOptions {
  std::string checkpoint;
  std::string codes;
  std::string out;
  int64_t cols = 8;
  int64_t limit = 64;
  std::string device = "cpu";
  bool allow_other_checkpoint = false;
};

// Codes from `quanta encode` name the checkpoint that made them (path and a
// fingerprint of its model); decoded by another model they are only noise.
// Codes without a fingerprint (sampled by a prior, older files) pass.
void check_same_model(const io::SafetensorsFile& codes, const train::Checkpoint& ck,
                      const DecodeOptions& o) {
  const auto made_by = codes.metadata.find("checkpoint_fingerprint");
  if (made_by == codes.metadata.end() || o.allow_other_checkpoint) return;
  const std::string here = train::model_fingerprint(ck);
  if (made_by->second == here) return;
  const auto path = codes.metadata.find("checkpoint");
  const std::string named =
      path == codes.metadata.end() ? std::string("another checkpoint") : "'" + path->second + "'";
  throw std::runtime_error(o.codes + " holds codes made with " + named + " (model " +
                           made_by->second + "), not with '" + o.checkpoint + "' (model " + here +
                           "); decode with that checkpoint, or pass --allow-other-checkpoint");
}

void run_decode(const DecodeOptions& o) {
  refuse_output_over_input("--out", o.out,
                           {{"the checkpoint", o.checkpoint}, {"the codes file", o.codes}});
  const Device device = device_flag(o.device);
  const train::Checkpoint ck = train::load_checkpoint(o.checkpoint);
  std::unique_ptr<train::VqVae> model = train::restore_model(ck, o.checkpoint);
  if (const std::string bad = train::non_finite_summary(ck, o.checkpoint); !bad.empty())
    throw std::runtime_error(bad + ": its decoded images would be meaningless");
  model->to(device);
  const io::SafetensorsFile file = io::load_safetensors(o.codes);
  check_same_model(file, ck, o);
  const Tensor* found = find_tensor(file.tensors, "indices");
  if (!found) throw std::runtime_error(o.codes + ": no tensor named 'indices'");
  Tensor indices = *found;
  if (indices.dim() < 1 || (indices.dtype() != DType::i64 && indices.dtype() != DType::i32))
    throw std::runtime_error(o.codes + ": 'indices' must be an integer tensor [N, 7, 7, ...]");
  // The layout encode writes for this quantizer: [N, 7, 7], and a trailing
  // dim of Q when it returns Q codes per position.
  const int64_t q = model->quantizer().num_codebooks();
  Shape want = {indices.size(0), train::kLatentSide, train::kLatentSide};
  if (q > 1) want.push_back(q);
  if (indices.shape() != want) {
    Shape shown = want;
    shown[0] = -1;
    std::string layout = shape_str(shown);
    layout.replace(layout.find("-1"), 2, "N");
    throw std::runtime_error(o.codes + ": 'indices' has shape " + shape_str(indices.shape()) +
                             "; this checkpoint's quantizer decodes " + layout +
                             " (quanta encode writes that layout)");
  }
  const int64_t k = model->quantizer().codebook_size();
  for (int64_t v : indices.to_vector<int64_t>())
    if (v < 0 || v >= k)
      throw std::runtime_error(o.codes + ": index " + std::to_string(v) +
                               " outside the checkpoint's codebook of " + std::to_string(k));
  indices = indices.narrow(0, 0, std::min(o.limit, indices.size(0)));
  Tensor images;
  {
    NoGradGuard no_grad;
    images = model->decode(model->quantizer().decode(indices.to(device))).to(Device::cpu());
  }
  image::write_png(o.out, image::image_grid(images, o.cols, 2, 2));
  std::cout << "decoded " << images.size(0) << " images to " << o.out << "\n";
}

}  // namespace

void add_decode(CLI::App& app) {
  auto o = std::make_shared<DecodeOptions>();
  CLI::App* sub =
      app.add_subcommand("decode",
                         "Decode code indices (a safetensors file from quanta encode, or sampled "
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
  sub->add_option("--cols", o->cols, "images per row")
      ->capture_default_str()
      ->transform(integer_in(1, 4096));
  sub->add_option("--limit", o->limit, "decode the first N only")
      ->capture_default_str()
      ->transform(integer_in(1, train::kMaxCount));
  add_device_flag(*sub, o->device, "the model and the codes");
  sub->add_flag("--allow-other-checkpoint", o->allow_other_checkpoint,
                "decode codes that quanta encode made with another checkpoint (refused "
                "otherwise)");
  sub->callback([o] { run_decode(*o); });
}

}  // namespace quanta::cli
