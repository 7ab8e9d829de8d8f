// `quanta finetune CHECKPOINT --out DIR`: QLoRA on the classifier of
// `quanta train --task classify`. The checkpoint's Linear weights become
// frozen NF4 bases (quantized here when they are float; taken as they are
// when `quanta quantize` already converted them, quanta or bnb layout), each
// wrapped in a LoRALinear whose adapters alone are trained. Prints the test
// accuracy of the float model (measured, or as quanta train recorded it), of
// the NF4 base, and after fine-tuning, and the memory of the NF4 base, the
// float weights and the adapters; writes the adapters (and with --merge the
// merged float classifier) as safetensors. The steps run in the training
// loop of quanta train (train/loop.h): the same progress, metrics.jsonl,
// SIGTERM checkpoint (the adapters, Adam's state and the dropout streams) and
// --resume. Data-parallel through dist::DataParallel under a launcher
// environment; --nproc N started by hand re-runs itself under `quanta launch
// -n N` (relaunch.h).
#include "train/classifier.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "data/fashion_mnist.h"
#include "dist/data_parallel.h"
#include "dist/env.h"
#include "dist_timeout.h"
#include "engine/autograd/grad_mode.h"
#include "engine/cpu/parallel.h"
#include "engine/io/safetensors.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/loss.h"
#include "engine/optim/optimizer.h"
#include "engine/precision.h"
#include "flag_checks.h"
#include "quant/nf4/nf4_modules.h"
#include "quanta_config.h"
#include "relaunch.h"
#include "run.h"
#include "train/checkpoint.h"
#include "train/classify.h"
#include "train/limits.h"
#include "train/loop.h"
#include "train/outputs.h"
#include "train/progress.h"
#include "train/run_folder.h"

namespace quanta::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

inline constexpr const char* kAdaptersFile = "adapters.safetensors";
inline constexpr const char* kMergedFile = "merged.safetensors";
// What a fine-tune writes in --out.
const std::vector<std::string> kRunFiles = {train::kCheckpointFile, train::kMetricsFile,
                                            kAdaptersFile, kMergedFile};
inline constexpr const char* kAdaptersFormat = "quanta-lora-1";
// The mid-run checkpoint in --out (train/checkpoint.h's layout; its model
// tensors are the adapters only: the base is the input checkpoint's).
inline constexpr const char* kFinetuneFormat = "quanta-finetune-1";

// The settings a fine-tuning checkpoint keeps; a --resume must not change
// those train::resume_conflict compares (batch_size, lr, seed, limit_train,
// model) nor the base.
json finetune_config_json(const FinetuneOptions& o) {
  return {
      {"task", "finetune"},
      {"base", fs::absolute(o.checkpoint).lexically_normal().string()},
      {"steps", o.steps},
      {"batch_size", o.batch_size},
      {"lr", o.lr},
      {"seed", o.seed},
      {"limit_train", o.limit_train},
      {"log_every", o.log_every},
      {"precision", o.precision},
      {"model",
       {{"lora_rank", o.lora_r}, {"lora_alpha", o.lora_alpha}, {"lora_dropout", o.lora_dropout}}}};
}

// The classifier with LoRA adapters as the training loop's task: the
// classifier's loss and evaluation; a checkpoint keeps the adapters (the
// trainable tensors) and the adapters' dropout streams.
class AdapterTask : public train::ClassifierTask {
 public:
  using ClassifierTask::ClassifierTask;

  StateDict state() override { return train::trainable_state(*model_); }
  void load_state(const StateDict& state) override {
    train::load_trainable_state(*model_, state, "another --lora-r or base?");
  }
  json extra_state() const override {
    return {{"lora_dropout", train::random_stream_states(*model_)}};
  }
  void load_extra_state(const json& rng) override {
    train::load_random_stream_states(*model_, rng.value("lora_dropout", json::object()));
  }
};

// The classifier of a checkpoint with NF4 + LoRA layers, and what it took.
struct QLoraModel {
  std::shared_ptr<Sequential> model;
  train::ClassifyConfig config;
  json recorded;  // results quanta train stored
  bool all_float = true;
  int64_t float_layers = 0, nf4_layers = 0;
  double float_accuracy = NAN;  // measured when every layer was float
};

std::string percent(double v) {
  if (!std::isfinite(v)) return "n/a";
  char b[32];
  std::snprintf(b, sizeof b, "%.2f%%", 100 * v);
  return b;
}

// Builds the classifier the checkpoint describes. Float Linear weights are
// loaded (and the float model evaluated on `test` when all are float);
// NF4 weights become NF4Linear bases directly.
QLoraModel load_classifier(const std::string& path, const data::ImageDataset& test,
                           bool evaluate_float) {
  train::Checkpoint ck;
  try {
    ck = train::load_checkpoint(path, train::kClassifierFormat);
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    if (what.find("checkpoint format") != std::string::npos ||
        what.find("not a quanta training checkpoint") != std::string::npos)
      throw std::runtime_error(what +
                               "; quanta finetune takes the classifier of quanta train "
                               "--task classify (or its quanta quantize output)");
    throw;
  }
  QLoraModel q;
  try {
    q.config = train::classify_config_from_json(ck.info.config);
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": bad classifier config (" + e.what() + ")");
  }
  q.recorded = ck.info.results;
  Generator gen = Generator::named(q.config.seed, "model");
  q.model = train::make_classifier(q.config.model, gen);
  const std::map<std::string, Tensor> tensors(ck.model.begin(), ck.model.end());
  for (const auto& [name, t] : tensors)
    if (name.size() > 15 && name.rfind(".quantized_data") == name.size() - 15)
      throw std::runtime_error(path + ": '" + name +
                               "' is in torchao's layout; convert it with "
                               "quanta quantize --format quanta first");
  std::vector<std::pair<std::string, std::shared_ptr<quant::NF4Linear>>> nf4;
  for (std::size_t i = 0; i < q.model->size(); ++i) {
    auto* linear = dynamic_cast<Linear*>((*q.model)[i].get());
    if (!linear) continue;
    const std::string name = std::to_string(i);
    auto find = [&](const std::string& key) -> const Tensor* {
      auto it = tensors.find(key);
      return it == tensors.end() ? nullptr : &it->second;
    };
    const Tensor* w = find(name + ".weight");
    const Tensor* b = find(name + ".bias");
    if (!w || !b)
      throw std::runtime_error(path + ": no '" + name + (w ? ".bias" : ".weight") +
                               "' tensor (model." + name +
                               ".* is a Linear layer of the "
                               "classifier)");
    const Shape want = linear->weight().shape();
    std::shared_ptr<quant::NF4Linear> base;
    if (quant::has_bnb_tensors(tensors, name + ".weight"))
      base = std::make_shared<quant::NF4Linear>(quant::read_bnb_tensors(tensors, name + ".weight"),
                                                *b);
    else if (w->dtype() == DType::nf4)
      base = std::make_shared<quant::NF4Linear>(*w, *b);
    if (base) {
      if (base->out_features() != want[0] || base->in_features() != want[1])
        throw std::runtime_error(
            path + ": '" + name + ".weight' is [" + std::to_string(base->out_features()) + ", " +
            std::to_string(base->in_features()) + "], its config says " + shape_str(want));
      nf4.emplace_back(name, base);
      ++q.nf4_layers;
      continue;
    }
    if (w->shape() != want || b->shape() != linear->bias().shape())
      throw std::runtime_error(path + ": '" + name + ".weight' is " + shape_str(w->shape()) +
                               ", its config says " + shape_str(want));
    NoGradGuard no_grad;
    copy_(linear->weight(), w->to(DType::f32));
    copy_(linear->bias(), b->to(DType::f32));
    ++q.float_layers;
  }
  q.all_float = q.nf4_layers == 0;
  if (q.all_float && evaluate_float)
    q.float_accuracy = train::accuracy(*q.model, test.images, test.labels);
  // NF4 bases from the file take their places now, as plain NF4Linear; the
  // caller wraps every layer in LoRA adapters.
  for (auto& [name, base] : nf4) q.model->replace_module(name, base);
  return q;
}

// The data folder: --data, else the one the classifier was trained on.
std::string data_folder(const FinetuneOptions& o) {
  if (!o.data.empty()) return o.data;
  const io::SafetensorsFile probe = io::load_safetensors(o.checkpoint);
  auto it = probe.metadata.find("config");
  if (it != probe.metadata.end()) try {
      const std::string dir = train::classify_config_from_json(json::parse(it->second)).data;
      if (!dir.empty()) return dir;
    } catch (const std::exception&) {
      // load_classifier names what is wrong
    }
  return data::kFashionMnistDir;
}

// The sizes finetune reports.
struct AdapterBytes {
  uint64_t nf4 = 0, float32 = 0, trainable = 0;  // trainable: parameters
};

// Every Linear of `q` becomes a frozen NF4 base with LoRA adapters: float
// ones quantized here (their reports returned), NF4 ones from the file
// wrapped.
std::vector<quant::NF4LayerReport> add_adapters(QLoraModel& q, const FinetuneOptions& o,
                                                AdapterBytes& bytes) {
  const quant::LoRAOptions lora{
      .rank = o.lora_r, .alpha = o.lora_alpha, .dropout = o.lora_dropout, .seed = o.seed};
  quant::NF4ConvertOptions convert;
  convert.lora = true;
  convert.lora_options = lora;
  std::vector<quant::NF4LayerReport> reports = quant::quantize_nf4(*q.model, convert);
  for (std::size_t i = 0; i < q.model->size(); ++i) {
    const std::string name = std::to_string(i);
    if (auto base = std::dynamic_pointer_cast<quant::NF4Linear>((*q.model)[i]))
      q.model->replace_module(name, std::make_shared<quant::LoRALinear>(base, lora));
    if (auto l = std::dynamic_pointer_cast<quant::LoRALinear>((*q.model)[i])) {
      bytes.nf4 += l->base()->weight_bytes();
      bytes.float32 += uint64_t(l->base()->out_features() * l->base()->in_features()) * 4;
      bytes.trainable += uint64_t(l->lora_A().numel() + l->lora_B().numel());
    }
  }
  return reports;
}

// The float model's accuracy as finetune knows it: measured, recorded by
// quanta train, or unknown.
double float_accuracy(const QLoraModel& q) {
  return q.all_float ? q.float_accuracy : q.recorded.value("test_accuracy", double(NAN));
}

// "base: ..." with a line per converted layer, and the accuracies before
// fine-tuning.
void print_base(std::ostream& log, const FinetuneOptions& o, const QLoraModel& q,
                const std::vector<quant::NF4LayerReport>& reports, const data::ImageDataset& test,
                double nf4_accuracy) {
  const train::ClassifyConfig& cc = q.config;
  std::string layers = std::to_string(q.float_layers + q.nf4_layers) + " Linear layers";
  if (q.float_layers > 0 && q.nf4_layers > 0)
    layers += ": " + std::to_string(q.nf4_layers) + " NF4 from the file, " +
              std::to_string(q.float_layers) + " float quantized to NF4 here";
  else
    layers += q.nf4_layers > 0 ? ", NF4 from the file" : ", float, quantized to NF4 here";
  log << "base: " << o.checkpoint << " (MLP 784-" << cc.model.hidden1 << "-" << cc.model.hidden2
      << "-10; " << layers << ")\n";
  for (const quant::NF4LayerReport& r : reports) {
    char line[160];
    std::snprintf(line, sizeof line, "  layer %-3s %-12s NF4 rmse %.3e  %8zu -> %7zu bytes\n",
                  r.name.c_str(), shape_str(r.shape).c_str(), r.rmse, r.bytes_before,
                  r.bytes_after);
    log << line;
  }
  std::string float_line = percent(q.float_accuracy);
  if (!q.all_float) {
    if (q.recorded.contains("test_accuracy"))
      float_line = percent(q.recorded["test_accuracy"].get<double>()) +
                   "  (recorded by quanta train on " +
                   std::to_string(q.recorded.value("test_samples", int64_t{0})) + " test images)";
    else
      float_line = "unknown (the checkpoint holds NF4 weights only)";
  }
  log << "test accuracy on " << test.size() << " images: float " << float_line
      << "\n                          NF4 base " << percent(nf4_accuracy)
      << " (before fine-tuning)\n";
}

// The adapter steps, in the training loop.
train::LoopResult fine_tune(AdapterTask& task, const FinetuneOptions& o, bool resume, Device device,
                            dist::ProcessGroup& group) {
  train::LoopSettings s;
  s.out_dir = o.out;
  s.resume = resume;
  s.progress_bar = group.rank() == 0 && ::isatty(STDOUT_FILENO) == 1;
  s.examples = task.examples();
  s.batch_size = o.batch_size;
  s.total_steps = o.steps;
  s.seed = o.seed;
  s.log_every = o.log_every;
  s.eval_every = train::kEvalAtEnd;
  s.lr = o.lr;
  s.mixed_precision = o.precision == "bf16";
  s.profile = o.profile.settings();
  s.checkpoint_format = kFinetuneFormat;
  s.checkpoint_config = finetune_config_json(o);
  s.header = {{"quanta_version", QUANTA_VERSION},
              {"config", s.checkpoint_config},
              {"device", device.str()}};
  s.activity = "fine-tuning";
  return train::run_loop(task, s, group, std::cout);
}

// The memory line: NF4 base against f32, and the trainable adapters.
void print_memory(std::ostream& log, const AdapterBytes& b) {
  char mem[320];
  std::snprintf(mem, sizeof mem,
                "memory: NF4 base weights %s bytes vs %s bytes as f32 (%.2fx smaller); "
                "trainable adapters %s parameters = %s bytes (%.2f%% of the weights' parameters; "
                "Adam state 2x that)\n",
                with_commas(b.nf4).c_str(), with_commas(b.float32).c_str(),
                b.nf4 ? double(b.float32) / double(b.nf4) : 0.0, with_commas(b.trainable).c_str(),
                with_commas(b.trainable * 4).c_str(),
                b.float32 ? 100.0 * double(b.trainable) / double(b.float32 / 4) : 0.0);
  log << mem;
}

// adapters.safetensors: the trained lora_A / lora_B with what made them.
std::string write_adapters(const FinetuneOptions& o, const QLoraModel& q, const json& results,
                           int world) {
  io::TensorMap adapters;
  for (const auto& [name, p] : q.model->named_parameters())
    if (p.requires_grad()) adapters.emplace_back(name, p.detach());
  const json lora_json = {{"rank", o.lora_r},
                          {"alpha", o.lora_alpha},
                          {"dropout", o.lora_dropout},
                          {"steps", o.steps},
                          {"lr", o.lr},
                          {"batch_size", o.batch_size},
                          {"seed", o.seed},
                          {"nproc", world}};
  const std::string path = train::out_file(o.out, kAdaptersFile);
  io::save_safetensors(path, adapters,
                       {{"format", kAdaptersFormat},
                        {"framework", "quanta"},
                        {"base", o.checkpoint},
                        {"config", train::classify_config_json(q.config).dump()},
                        {"lora", lora_json.dump()},
                        {"results", results.dump()}});
  return path + " (" + std::to_string(adapters.size()) + " tensors)";
}

// merged.safetensors: every LoRALinear replaced by the plain Linear of its
// merged weight, a float classifier checkpoint like quanta train's.
std::string write_merged(const FinetuneOptions& o, const QLoraModel& q,
                         const data::ImageDataset& test) {
  auto merged = std::make_shared<Sequential>();
  for (std::size_t i = 0; i < q.model->size(); ++i) {
    auto l = std::dynamic_pointer_cast<quant::LoRALinear>((*q.model)[i]);
    merged->push_back(l ? std::shared_ptr<Module>(l->merge()) : (*q.model)[i]);
  }
  train::CheckpointInfo info;
  info.format = train::kClassifierFormat;
  info.config = train::classify_config_json(q.config);
  info.rng = {{"seed", q.config.seed}};
  info.results = {{"test_accuracy", train::accuracy(*merged, test.images, test.labels)},
                  {"test_samples", test.size()}};
  const std::string path = train::out_file(o.out, kMergedFile);
  train::save_checkpoint(path, *merged, nullptr, info);
  return path + " (merged float model, test accuracy " +
         percent(info.results["test_accuracy"].get<double>()) + ")";
}

}  // namespace

void run_classifier_finetune(const FinetuneOptions& o) {
  RunSpec spec;
  spec.files = kRunFiles;
  spec.config = finetune_config_json(o);
  spec.inputs = {{"the base checkpoint", o.checkpoint}};
  spec.done_marker = kAdaptersFile;
  spec.checkpoint_format = kFinetuneFormat;
  spec.check_inputs = [&] {
    if (!fs::exists(o.checkpoint))
      throw std::runtime_error("cannot read checkpoint '" + o.checkpoint + "': no such file");
  };
  std::optional<StartedRun> run = start_finetune_run(o, spec);
  if (!run) return;
  const Device device = run->device;
  std::shared_ptr<dist::ProcessGroup> group = run->group;
  const int world = group->size();
  const bool lead = group->rank() == 0;
  std::ostream& log = train::lead_log(std::cout, lead);

  const data::ImageDataset test =
      data::load_fashion_mnist(data_folder(o), data::Split::test, o.limit_test);
  const data::ImageDataset train_set =
      data::load_fashion_mnist(test.source, data::Split::train, o.limit_train);
  if (train_set.size() == 0) throw UsageError("--limit-train 0 leaves nothing to train on");

  QLoraModel q = load_classifier(o.checkpoint, test, lead);
  AdapterBytes bytes;
  const std::vector<quant::NF4LayerReport> reports = add_adapters(q, o, bytes);
  // In the run's precision, as the loop's evaluation after it: comparable.
  const double nf4_acc = [&] {
    const MixedPrecision precision(o.precision == "bf16");
    return lead ? train::accuracy(*q.model, test.images, test.labels) : NAN;
  }();
  print_base(log, o, q, reports, test, nf4_acc);

  AdapterTask task(
      q.model, train_set, test, device, [&](std::ostream& os, int64_t start, int64_t total) {
        os << "fine-tuning LoRA adapters (rank " << o.lora_r << ", alpha " << o.lora_alpha
           << ", dropout " << o.lora_dropout << ") on " << train_set.size() << " images: "
           << (start > 0 ? "resuming at step " + std::to_string(start) + " of " : std::string())
           << total << " steps, global batch " << o.batch_size << ", lr " << o.lr << ", seed "
           << o.seed << ", " << world << (world == 1 ? " rank, " : " ranks, ") << num_threads()
           << " threads each\n"
           << std::flush;
      });
  const train::LoopResult r = fine_tune(task, o, run->resume, device, *group);
  if (r.interrupted || !lead) return;

  const double after = task.test_accuracy();
  log << "test accuracy after fine-tuning: " << percent(after) << " (NF4 base " << percent(nf4_acc)
      << ", float " << percent(float_accuracy(q)) << ")\n";
  print_memory(log, bytes);
  const json results = {{"float_accuracy", q.all_float ? json(q.float_accuracy)
                                                       : q.recorded.value("test_accuracy", json())},
                        {"nf4_accuracy", nf4_acc},
                        {"finetuned_accuracy", after},
                        {"test_samples", test.size()},
                        {"nf4_base_bytes", bytes.nf4},
                        {"float_weight_bytes", bytes.float32},
                        {"trainable_parameters", bytes.trainable}};
  log << "wrote " << write_adapters(o, q, results, world);
  if (o.merge) log << " and " << write_merged(o, q, test);
  log << "\n";
}

}  // namespace quanta::cli
