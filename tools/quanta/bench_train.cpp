// `quanta bench train`: one optimizer step of `quanta train`'s models at the
// default batch (64) on random images: the VQ-VAE with its default quantizer
// (vq), with none and with fsq, and the classifier of `--task classify`.
// Each row's floor is the time a large GEMM (1024^3 through quanta's matmul)
// takes for the step's FLOPs, timed in turns with the step: ratio 1 would be
// a step that spends all its time in its FLOPs at the GEMM's rate. FLOPs
// count the convolutions (or Linear layers) forward and backward and, for
// vq, the nearest-code distance GEMM; everything else is overhead here.
#include "bench.h"
#include "engine/ops/loss.h"
#include "engine/optim/optimizer.h"
#include "quanta.h"
#include "train/classifier.h"
#include "train/config.h"
#include "train/quantizer.h"
#include "train/vqvae.h"

namespace quanta::cli {
namespace {

constexpr int64_t kBatch = 64;

// The classifier's Linear layers forward (x 2 per multiply-add), then
// backward: weight gradients everywhere, input gradients but for the first.
double classifier_flops(const train::ClassifierShape& s, int64_t batch) {
  const double first = 784.0 * s.hidden1,
               rest = double(s.hidden1) * s.hidden2 + double(s.hidden2) * train::kNumClasses;
  return 2.0 * batch * (3 * (first + rest) - first);
}

BenchRow time_step(const std::string& name, double flops, int repeat,
                   const std::function<void()>& step, const std::function<void()>& gemm,
                   double gemm_flops) {
  const std::vector<double> ms = interleaved_ms(repeat, 4, {step, gemm});
  BenchRow row{name};
  row.ms = ms[0];
  row.floor_ms = ms[1] * flops / gemm_flops;
  return row;
}

}  // namespace

std::vector<BenchRow> bench_train(const BenchOptions& o) {
  Generator gen(2024);
  const int64_t g = o.small ? 64 : 1024;
  const Tensor a = rand({g, g}, gen), b = rand({g, g}, gen);
  const double gemm_flops = 2.0 * double(g) * double(g) * double(g);
  auto gemm = [&] {
    NoGradGuard no_grad;
    Tensor c = matmul(a, b);
  };
  const int64_t batch = o.small ? 4 : kBatch;
  const Tensor images = rand({batch, 1, 28, 28}, gen);
  std::vector<BenchRow> rows;

  for (const char* type : {"vq", "none", "fsq"}) {
    const nlohmann::json config =
        train::merge_config(train::default_config_json(), {{"quantizer", {{"type", type}}}});
    const train::TrainConfig cfg = train::config_from_json(config);
    Generator model_gen = Generator::named(cfg.seed, "model");
    train::VqVae model(cfg.model, train::make_quantizer(cfg.quantizer, cfg.model.dim, cfg.seed),
                       model_gen);
    model.train();
    std::vector<Tensor> trainable;
    for (const Tensor& p : model.parameters())
      if (p.requires_grad()) trainable.push_back(p);
    Adam optimizer(trainable, {.lr = cfg.lr});
    auto step = [&] {
      train::VqVaeOutput out = model.run(images);
      const Tensor loss = mean(square(out.reconstruction - images)) + sum(out.quantized.loss);
      optimizer.zero_grad();
      loss.backward();
      optimizer.step();
      model.quantizer().after_step();
    };
    double flops = main_job_conv_flops(batch);
    if (std::string(type) == "vq") {
      const int64_t tokens = batch * 7 * 7;
      flops += 2.0 * double(tokens) * double(cfg.quantizer.value("codebook_size", 512)) *
               double(cfg.model.dim);
    }
    std::string name = "train_step_vqvae_";  // appended: GCC 12's false -Wrestrict
    name += type;
    rows.push_back(time_step(name, flops, o.repeat, step, gemm, gemm_flops));
  }

  const train::ClassifierShape shape;
  Generator classifier_gen(7);
  const std::shared_ptr<Sequential> classifier = train::make_classifier(shape, classifier_gen);
  classifier->train();
  Adam optimizer(classifier->parameters(), {.lr = 1e-3});
  const Tensor labels = randint(0, train::kNumClasses, {batch}, gen);
  auto step = [&] {
    const Tensor loss = cross_entropy(classifier->forward(images), labels);
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
  };
  rows.push_back(time_step("train_step_classifier", classifier_flops(shape, batch), o.repeat, step,
                           gemm, gemm_flops));
  return rows;
}

}  // namespace quanta::cli
