// `quanta bench train`: one optimizer step of `quanta train`'s models at the
// default batch (64) on random images: the VQ-VAE with its default quantizer
// (vq), with none and with fsq, the classifier of `--task classify`, and
// `quanta finetune`'s QLoRA step on that classifier (NF4 bases, LoRA adapters
// with finetune's defaults, Adam over the adapters only).
// Each row's floor is the time a large GEMM (1024^3 through quanta's matmul)
// takes for the step's FLOPs, timed in turns with the step: ratio 1 would be
// a step that spends all its time in its FLOPs at the GEMM's rate. FLOPs
// count the convolutions (or Linear layers, or NF4 bases and adapters)
// forward and backward and, for vq, the nearest-code distance GEMM;
// everything else (for QLoRA, decoding the NF4 weights too) is overhead here.
// With --device cuda each row is the step on the GPU against the same step
// (same weights, same images) on the CPU, timed in turns: below 1 the GPU is
// faster; the _graph rows are the step captured as a graph against the same
// step launched kernel by kernel on the device, both uploading their batch
// every step (below 1 the graph is faster); the _graph_nhwc rows the captured
// step with channels-last activations against the captured step channels
// first (below 1 channels last is faster on that device). A model whose step fails on the
// GPU (a kernel it has not yet) prints its row as unavailable with the error.
// On a device (cuda or sim) each row also counts what one step asks of the
// host: host syncs (each one stalls a GPU's queue) and copies. sim runs the
// CPU's kernels, so its time is the CPU's plus the device bookkeeping, and
// its counts are CUDA's.
#include "bench.h"
#include "engine/cuda/runtime.h"
#include "engine/device_backend.h"
#include "engine/ops/loss.h"
#include "engine/optim/optimizer.h"
#include "quant/nf4/nf4_modules.h"
#include "quanta.h"
#include "train/captured_step.h"
#include "train/classifier.h"
#include "train/config.h"
#include "train/quantizer.h"
#include "train/vqvae.h"

namespace quanta::cli {
namespace {

constexpr int64_t kBatch = 64;
// Steps run as called before a graph row's step is captured: quanta train's.
constexpr int64_t kGraphWarmup = 2;

// The classifier's Linear layers forward (x 2 per multiply-add), then
// backward: weight gradients everywhere, input gradients but for the first.
double classifier_flops(const train::ClassifierShape& s, int64_t batch) {
  const double first = 784.0 * s.hidden1,
               rest = double(s.hidden1) * s.hidden2 + double(s.hidden2) * train::kNumClasses;
  return 2.0 * batch * (3 * (first + rest) - first);
}

// The QLoRA step on the same classifier (x 2 per multiply-add). Each layer
// [in -> out] forward: the NF4 base's x W^T (in * out) and the adapters'
// x A^T, then B (rank * (in + out)). Backward: the base's input gradient but
// for the first layer (its weight is frozen: no weight gradient); for the
// adapters, B's weight gradient and the gradient into x A^T (rank * out
// each), A's weight gradient (rank * in) and, but for the first layer, the
// input gradient through A (rank * in).
double qlora_flops(const train::ClassifierShape& s, int64_t rank, int64_t batch) {
  const double in[] = {784.0, double(s.hidden1), double(s.hidden2)};
  const double out[] = {double(s.hidden1), double(s.hidden2), double(train::kNumClasses)};
  double mads = 0;
  for (int i = 0; i < 3; ++i) {
    const bool first = i == 0;
    const double base = in[i] * out[i] * (first ? 1 : 2);
    const double adapters = rank * (in[i] * (first ? 2 : 3) + out[i] * 3);
    mads += base + adapters;
  }
  return 2.0 * batch * mads;
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

// One model's training step on one device, built the same way on every
// device: weights drawn on the CPU from the run's seed, then moved.
struct Step {
  std::function<void()> run;
  std::shared_ptr<void> state;  // the model and optimizer `run` uses
};

// How a row's VQ-VAE step gets its images: already on the device (the
// step's own work alone), uploaded at every step as quanta train does, or
// uploaded and the forward, backward and Adam step replayed as a captured graph
// (train/captured_step.h, on cuda and sim).
enum class StepInput { resident, uploaded, graph };

Step vqvae_step(const char* type, const Tensor& cpu_images, Device device,
                StepInput input = StepInput::resident,
                train::ActivationLayout layout = train::ActivationLayout::automatic) {
  const nlohmann::json config =
      train::merge_config(train::default_config_json(), {{"quantizer", {{"type", type}}}});
  const train::TrainConfig cfg = train::config_from_json(config);
  struct State {
    std::unique_ptr<train::VqVae> model;
    std::unique_ptr<Adam> optimizer;
    Tensor images, host_images;
    std::unique_ptr<train::CapturedStep> captured;
  };
  auto st = std::make_shared<State>();
  Generator model_gen = Generator::named(cfg.seed, "model");
  st->model = std::make_unique<train::VqVae>(
      cfg.model, train::make_quantizer(cfg.quantizer, cfg.model.dim, cfg.seed), model_gen);
  st->model->to(device);
  st->model->set_activation_layout(layout);
  st->model->train();
  std::vector<Tensor> trainable;
  for (const Tensor& p : st->model->parameters())
    if (p.requires_grad()) trainable.push_back(p);
  st->optimizer = std::make_unique<Adam>(trainable, AdamOptions{.lr = cfg.lr});
  st->images = cpu_images.to(device);
  st->host_images = cpu_images;
  if (input == StepInput::graph)
    st->captured = std::make_unique<train::CapturedStep>(device, kGraphWarmup);
  State* s = st.get();
  auto forward_backward = [s](const std::vector<Tensor>& in) {
    const Tensor& x = in.at(0);
    train::VqVaeOutput out = s->model->run(x);
    const Tensor loss = mean(square(out.reconstruction - x)) + sum(out.quantized.loss);
    loss.backward();
    return loss.detach();
  };
  return {[s, input, forward_backward] {
            if (s->captured) {
              s->captured->run(
                  {s->host_images}, forward_backward, [s] { s->optimizer->step(); },
                  [s] { s->model->quantizer().after_step(); }, *s->optimizer);
            } else {
              s->optimizer->zero_grad();
              forward_backward({input == StepInput::uploaded ? s->host_images.to(s->images.device())
                                                             : s->images});
              s->optimizer->step();
              s->model->quantizer().after_step();
            }
          },
          st};
}

// The cross-entropy step of a classifier built on the CPU: moved to
// `device`, Adam over the parameters that require grad (all of them for the
// float classifier, the adapters for QLoRA).
Step cross_entropy_step(std::shared_ptr<Sequential> model, double lr, const Tensor& cpu_images,
                        const Tensor& cpu_labels, Device device) {
  struct State {
    std::shared_ptr<Sequential> model;
    std::unique_ptr<Adam> optimizer;
    Tensor images, labels;
  };
  auto st = std::make_shared<State>();
  st->model = std::move(model);
  st->model->to(device);
  st->model->train();
  std::vector<Tensor> trainable;
  for (const Tensor& p : st->model->parameters())
    if (p.requires_grad()) trainable.push_back(p);
  st->optimizer = std::make_unique<Adam>(trainable, AdamOptions{.lr = lr});
  st->images = cpu_images.to(device);
  st->labels = cpu_labels.to(device);
  State* s = st.get();
  return {[s] {
            const Tensor loss = cross_entropy(s->model->forward(s->images), s->labels);
            s->optimizer->zero_grad();
            loss.backward();
            s->optimizer->step();
          },
          st};
}

Step classifier_step(const train::ClassifierShape& shape, const Tensor& cpu_images,
                     const Tensor& cpu_labels, Device device) {
  Generator classifier_gen(7);
  return cross_entropy_step(train::make_classifier(shape, classifier_gen), 1e-3, cpu_images,
                            cpu_labels, device);
}

// `quanta finetune`'s LoRA options and lr at its defaults (its adapter
// defaults are LoRAOptions'; --lr 1e-3), so the row times the step finetune
// runs.
constexpr quant::LoRAOptions kFinetuneLoRA{};
constexpr double kFinetuneLr = 1e-3;

// The classifier of classifier_step with every Linear converted as `quanta
// finetune` converts a float checkpoint: a frozen NF4 base (block 64, double
// quant) wrapped in a LoRALinear.
Step qlora_step(const train::ClassifierShape& shape, const Tensor& cpu_images,
                const Tensor& cpu_labels, Device device) {
  Generator classifier_gen(7);
  std::shared_ptr<Sequential> model = train::make_classifier(shape, classifier_gen);
  quant::NF4ConvertOptions convert;
  convert.lora = true;
  convert.lora_options = kFinetuneLoRA;
  quant::quantize_nf4(*model, convert);
  return cross_entropy_step(std::move(model), kFinetuneLr, cpu_images, cpu_labels, device);
}

// Steps counted for a row's host syncs and copies, after its timing (the
// steady state: k-means and other first-step work are behind it).
constexpr int kCountedSteps = 3;

// The device rows: each model's step on o.device against the same step on
// the CPU, in turns, each batch ended by a synchronisation; then its counts.
std::vector<BenchRow> bench_train_device(const BenchOptions& o, const Tensor& images,
                                         const Tensor& labels) {
  const Device dev = o.device;
  std::function<void()> sync;
  if (!dev.is_cpu()) sync = [dev] { synchronize(dev); };
  // `step` timed against `floor` in turns, then what `step` asks of the host.
  auto measure = [&](const std::string& name, const Step& step, const Step& floor) {
    const std::vector<double> ms = interleaved_ms(o.repeat, 4, {step.run, floor.run}, sync);
    BenchRow r{name};
    r.ms = ms[0];
    r.floor_ms = ms[1];
    const DeviceStats before = device_stats(dev);
    for (int i = 0; i < kCountedSteps; ++i) step.run();
    const DeviceStats after = device_stats(dev);
    // Nothing of the row runs on after it (at exit, its kernels' libraries go).
    if (sync) sync();
    auto per_step = [](int64_t n) { return double(n) / kCountedSteps; };
    r.host_syncs_per_step = per_step(after.host_syncs - before.host_syncs);
    r.copies_per_step =
        per_step(after.copies_to_host + after.copies_from_host + after.copies_on_device -
                 before.copies_to_host - before.copies_from_host - before.copies_on_device);
    return r;
  };
  auto row = [&](const std::string& name, const std::function<Step(Device)>& make) {
    try {
      return measure(name, make(dev), make(Device::cpu()));
    } catch (const std::exception& e) {
      return unavailable_row(name, e.what());
    }
  };
  auto graph_row = [&](const std::string& name, const char* type) {
    try {
      return measure(name, vqvae_step(type, images, dev, StepInput::graph),
                     vqvae_step(type, images, dev, StepInput::uploaded));
    } catch (const std::exception& e) {
      return unavailable_row(name, e.what());
    }
  };
  // The captured step with its activations channels last against the same
  // step channels first: below 1, channels last is faster on this device
  // (what DeviceCaps::prefers_channels_last should then say).
  auto layout_row = [&](const std::string& name, const char* type) {
    try {
      using train::ActivationLayout;
      return measure(
          name, vqvae_step(type, images, dev, StepInput::graph, ActivationLayout::channels_last),
          vqvae_step(type, images, dev, StepInput::graph, ActivationLayout::channels_first));
    } catch (const std::exception& e) {
      return unavailable_row(name, e.what());
    }
  };
  std::vector<BenchRow> rows;
  for (const char* type : {"vq", "none", "fsq"})
    rows.push_back(row(std::string("train_step_vqvae_") + type,
                       [&](Device d) { return vqvae_step(type, images, d); }));
  // The captured step against the same step launched kernel by kernel on
  // the same device, both uploading their batch every step as quanta train
  // does: below 1 the graph is faster.
  if (device_backend(dev.type).graph)
    for (const char* type : {"vq", "none", "fsq"})
      rows.push_back(graph_row(std::string("train_step_vqvae_") + type + "_graph", type));
  if (device_backend(dev.type).graph)
    for (const char* type : {"vq", "none", "fsq"})
      rows.push_back(layout_row(std::string("train_step_vqvae_") + type + "_graph_nhwc", type));
  const train::ClassifierShape shape;
  rows.push_back(row("train_step_classifier",
                     [&](Device d) { return classifier_step(shape, images, labels, d); }));
  rows.push_back(
      row("train_step_qlora", [&](Device d) { return qlora_step(shape, images, labels, d); }));
  return rows;
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
  const Tensor labels = randint(0, train::kNumClasses, {batch}, gen);
  if (!o.device.is_cpu()) return bench_train_device(o, images, labels);
  std::vector<BenchRow> rows;

  for (const char* type : {"vq", "none", "fsq"}) {
    const Step step = vqvae_step(type, images, Device::cpu());
    const train::TrainConfig cfg = train::config_from_json(
        train::merge_config(train::default_config_json(), {{"quantizer", {{"type", type}}}}));
    double flops = main_job_conv_flops(batch);
    if (std::string(type) == "vq") {
      const int64_t tokens = batch * 7 * 7;
      flops += 2.0 * double(tokens) * double(cfg.quantizer.value("codebook_size", 512)) *
               double(cfg.model.dim);
    }
    std::string name = "train_step_vqvae_";  // appended: GCC 12's false -Wrestrict
    name += type;
    rows.push_back(time_step(name, flops, o.repeat, step.run, gemm, gemm_flops));
  }

  const train::ClassifierShape shape;
  const Step step = classifier_step(shape, images, labels, Device::cpu());
  rows.push_back(time_step("train_step_classifier", classifier_flops(shape, batch), o.repeat,
                           step.run, gemm, gemm_flops));
  const Step qlora = qlora_step(shape, images, labels, Device::cpu());
  rows.push_back(time_step("train_step_qlora", qlora_flops(shape, kFinetuneLoRA.rank, batch),
                           o.repeat, qlora.run, gemm, gemm_flops));
  return rows;
}

}  // namespace quanta::cli
