// `quanta train`: fits the VQ-VAE to Fashion-MNIST. Settings come in layers
// (defaults, --config FILE, flags; a resumed run starts from its checkpoint's
// config), merged into one JSON object that the checkpoint keeps.
#include <unistd.h>

#include <cmath>
#include <ctime>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "dist_timeout.h"
#include "engine/io/safetensors.h"
#include "fast_conv.h"
#include "flag_checks.h"
#include "graph_flag.h"
#include "profile_flag.h"
#include "quanta_config.h"
#include "relaunch.h"
#include "run_start.h"
#include "train/checkpoint.h"
#include "train/classify.h"
#include "train/config.h"
#include "train/limits.h"
#include "train/outputs.h"
#include "train/quantizer_config.h"
#include "train/run_folder.h"
#include "train/trainer.h"
#include "train/vqvae.h"

namespace quanta::cli {
namespace {

using nlohmann::json;

struct TrainFlags {
  std::string task = "vqvae";
  std::string config_file;
  std::string out;
  bool resume = false;
  bool overwrite = false;
  bool print_config = false;
  bool fast_conv = false;
  bool no_graph = false;
  ProfileFlags profile;
  std::string conv_layout = "auto";
  std::string dist_timeout;  // seconds; empty: the library's default
  // Each given flag writes its value into the flags' config layer.
  std::vector<std::function<void(json&)>> apply;
};

// How --help shows a default: what default_config_json() holds, so the help
// cannot drift from the value a run uses.
enum class ShowDefault { yes, no };

template <class T>
CLI::Option* add_override(CLI::App* sub, TrainFlags& f, const std::string& flag,
                          const std::string& pointer, const std::string& help,
                          ShowDefault show = ShowDefault::yes) {
  auto value = std::make_shared<T>();
  CLI::Option* opt = sub->add_option(flag, *value, help);
  static const json defaults = train::default_config_json();
  const json::json_pointer at(pointer);
  if (show == ShowDefault::yes && defaults.contains(at))
    opt->default_str(defaults[at].is_string() ? defaults[at].get<std::string>()
                                              : defaults[at].dump());
  f.apply.push_back([opt, value, pointer](json& layer) {
    if (opt->count() > 0) layer[json::json_pointer(pointer)] = *value;
  });
  return opt;
}

// A checkpoint's epoch is step / steps-per-epoch, so an --epochs run is
// complete exactly when that reaches --epochs (no need to count the data).
bool run_complete(int64_t steps, int64_t epochs, int64_t step, int64_t epoch) {
  return steps > 0 ? step >= steps : epoch >= epochs;
}

// The --out policy of a run of quanta train (run_start.h).
RunRequest run_request(const TrainFlags& f, const std::string& out) {
  return {.out = out,
          .out_given = !f.out.empty(),
          .resume = f.resume,
          .overwrite = f.overwrite,
          .dry = f.print_config,
          .files = {train::kCheckpointFile, train::kMetricsFile}};
}

// `quanta train --task classify`: the same folder rules as the VQ-VAE's.
void run_train_classify(const TrainFlags& f, const json& layer, const std::string& out) {
  if (!f.config_file.empty()) throw UsageError("--task classify takes no --config");
  RunRequest request = run_request(f, out);
  // Complete: the flags' --steps / --epochs, else the checkpoint's steps.
  request.complete = [&](int64_t step, int64_t epoch, const json& ck_config) {
    const int64_t steps = layer.contains("steps") ? layer["steps"].get<int64_t>() : 0;
    const int64_t epochs = layer.contains("epochs") ? layer["epochs"].get<int64_t>() : 0;
    if (steps > 0 || epochs > 0) return run_complete(steps, epochs, step, epoch);
    return ck_config.contains("steps") && step >= ck_config["steps"].get<int64_t>();
  };
  RunStart start(std::move(request));
  if (start.finished()) return;
  try {
    train::RunFolderLock folder;
    if (!f.print_config) folder = start.take(1, "");
    train::run_classify_command(
        layer,
        {out, start.resume(), ::isatty(STDOUT_FILENO) == 1, QUANTA_VERSION, f.profile.settings()},
        f.print_config, std::cout);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
}

std::string default_out_dir() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "runs/%Y%m%d-%H%M%S", std::localtime(&now));
  return buf;
}

void run_train(const TrainFlags& f) {
  apply_fast_conv(f.fast_conv);
  json layer = json::object();
  for (const auto& apply : f.apply) apply(layer);
  const std::string out = f.out.empty() ? default_out_dir() : f.out;
  if (f.task == "classify") return run_train_classify(f, layer, out);

  // Restarted by the launcher job that wrote --out: continue its run.
  RunRequest request = run_request(f, out);
  train::TrainConfig cfg;
  request.complete = [&](int64_t step, int64_t epoch, const json&) {
    return run_complete(cfg.steps, cfg.epochs, step, epoch);
  };
  RunStart start(std::move(request));
  const bool resume = start.resume();
  json from_checkpoint;
  if (resume) {
    const std::string ckpt = train::out_file(out, train::kCheckpointFile);
    from_checkpoint = train::load_checkpoint(ckpt).info.config;
  }
  json config;
  try {
    std::vector<json> layers;
    if (!f.config_file.empty()) layers.push_back(train::read_config_file(f.config_file));
    layers.push_back(layer);
    if (resume) {
      // The checkpoint's config already holds its recipe.
      config = from_checkpoint;
      for (const json& l : layers) config = train::merge_config(config, l);
    } else {
      config = train::compose_config(layers);
    }
    train::config_from_json(config);  // validate before touching any file
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  if (resume) {
    const std::string diff = train::resume_conflict(from_checkpoint, config);
    if (!diff.empty())
      throw UsageError("--resume cannot change the run it continues (" + diff + ")");
  }
  if (f.print_config) {
    try {
      std::cout << train::resolved_config(config).dump(2) << "\n";
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());  // options that do not fit the layer
    }
    return;
  }
  cfg = train::config_from_json(config);
  const train::ActivationLayout layout =
      f.conv_layout == "nhwc"   ? train::ActivationLayout::channels_last
      : f.conv_layout == "nchw" ? train::ActivationLayout::channels_first
                                : train::ActivationLayout::automatic;
  try {
    train::check_activation_layout(cfg.model.arch, layout);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--conv-layout nhwc: ") + e.what() + "; use auto or nchw");
  }
  if (start.finished()) return;
  // --nproc N started by hand: run again as N ranks under quanta launch.
  const int64_t nproc = config.value("nproc", int64_t{1});
  train::RunFolderLock folder = start.take(nproc, f.dist_timeout);
  train::TrainJob job{config,         out,         resume, ::isatty(STDOUT_FILENO) == 1,
                      QUANTA_VERSION, !f.no_graph, layout, f.profile.settings()};
  train::TrainResult r;
  try {
    r = train::run_training(job, std::cout);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  if (r.interrupted || r.rank != 0) return;
  std::cout << "done: " << r.step << " steps; test mse " << train::fmt_metric(r.last_eval.mse, 5)
            << ", codebook usage " << train::fmt_percent(r.last_eval.usage) << ", perplexity "
            << train::fmt_metric(r.last_eval.perplexity, 1) << "\n"
            << "outputs in " << out << ": " << train::kCheckpointFile << " " << train::kMetricsFile
            << " " << train::kReconstructionsFile << " " << train::kUsageFile << " "
            << train::kLossFile << "\n";
}

}  // namespace

void add_train(CLI::App& app) {
  auto f = std::make_shared<TrainFlags>();
  CLI::App* sub = app.add_subcommand(
      "train",
      "Train a convolutional VQ-VAE on Fashion-MNIST: progress, per-evaluation test "
      "metrics, checkpoint, metrics.jsonl and PNGs in --out");
  sub->footer(
      "Examples:\n"
      "  quanta train --out runs/baseline                 # defaults, see --print-config\n"
      "  quanta train --steps 200 --limit-train 2000 --limit-test 500 --out runs/quick\n"
      "  quanta train --quantizer fsq --levels 8,5,5,5 --dim 4 --out runs/fsq\n"
      "  quanta train --config run.json --lr 1e-3        # flags override the file\n"
      "  quanta train --resume --out runs/baseline --epochs 4   # continue a run\n"
      "  quanta launch -n 2 --max-restarts 3 -- quanta train --out runs/elastic\n"
      "Outputs: checkpoint.safetensors, metrics.jsonl, reconstructions.png,\n"
      "codebook_usage.png, loss.png. A folder that holds a run is refused unless\n"
      "--resume continues it or --overwrite replaces it. Ctrl-C or SIGTERM finishes the\n"
      "step, writes the checkpoint and exits 0; --resume continues exactly where it stopped.\n"
      "Restarted by quanta launch --max-restarts (or torchrun's), a run continues from\n"
      "its last checkpoint in --out by itself.");
  TrainFlags& t = *f;
  sub->add_option("--task", t.task,
                  "vqvae or classify (the MLP classifier "
                  "quanta finetune adapts, see docs/finetune.md)")
      ->capture_default_str()
      ->check(CLI::IsMember({"vqvae", "classify"}));
  sub->add_option("--config", t.config_file,
                  "JSON config file (keys as --print-config "
                  "shows); flags override it")
      ->check(CLI::ExistingFile);
  sub->add_option("--out", t.out, "output folder (default runs/YYYYmmdd-HHMMSS)");
  sub->add_flag("--resume", t.resume, "continue the run in --out from its checkpoint");
  sub->add_flag("--overwrite", t.overwrite,
                "replace the run --out already holds (its checkpoint and metrics.jsonl) "
                "instead of refusing");
  add_dist_timeout_flag(*sub, t.dist_timeout);
  add_fast_conv_flag(*sub, t.fast_conv);
  add_no_graph_flag(*sub, t.no_graph);
  add_profile_flags(*sub, t.profile);
  sub->add_option("--conv-layout", t.conv_layout,
                  "the VQ-VAE's activations between convolutions: auto (channels last on the "
                  "CPU and sim, whose kernels compute that way; channels first on CUDA, until a "
                  "GPU run measures cuDNN's channels-last kernels faster), nchw or nhwc (either "
                  "on every device; the same model and checkpoint, results equal to f32 rounding)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "nchw", "nhwc"}));
  sub->add_flag("--print-config", t.print_config, "print the merged config as JSON and exit");
  add_override<int64_t>(sub, t, "--steps", "/steps", "optimizer steps in total", ShowDefault::no)
      ->transform(integer_in(1, train::kMaxSteps));
  add_override<int64_t>(sub, t, "--epochs", "/epochs", "passes over the training set")
      ->transform(integer_in(1, train::kMaxEpochs))
      ->excludes("--steps");
  add_override<int64_t>(sub, t, "--batch-size", "/batch_size", "global batch size")
      ->transform(integer_in(1, train::kMaxBatchSize));
  add_override<double>(sub, t, "--lr", "/lr", "Adam learning rate")->check(number_in(0, 1e6, true));
  add_override<uint64_t>(sub, t, "--seed", "/seed", "seed of the model init and the data order")
      ->transform(unsigned_integer());
  add_override<std::string>(sub, t, "--data", "/data", "folder with the Fashion-MNIST .gz files");
  add_override<int64_t>(sub, t, "--limit-train", "/limit_train",
                        "use only the first N training images (default: all)", ShowDefault::no)
      ->transform(integer_in(0, train::kMaxCount));
  add_override<int64_t>(sub, t, "--limit-test", "/limit_test",
                        "evaluate on only the first N test images (default: all)", ShowDefault::no)
      ->transform(integer_in(1, train::kMaxCount));
  add_override<int64_t>(sub, t, "--log-every", "/log_every",
                        "steps between log lines / metrics records")
      ->transform(integer_in(1, train::kMaxCount));
  add_override<int64_t>(sub, t, "--eval-every", "/eval_every",
                        "steps between evaluations + checkpoints (0: each epoch)")
      ->transform(integer_in(0, train::kMaxCount));
  add_override<int64_t>(sub, t, "--threads", "/threads", "CPU threads")->transform(thread_count());
  add_override<std::string>(sub, t, "--device", "/device",
                            device_flag_help("the model and the batches"));
  add_override<std::string>(sub, t, "--precision", "/precision",
                            "f32, or bf16: convolutions and linear layers multiply in bf16 "
                            "with f32 sums where the device has bf16 products (the weights, "
                            "optimizer state, quantizer math and losses stay f32)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  add_override<int64_t>(
      sub, t, "--nproc", "/nproc",
      "ranks for data-parallel training on this machine (started through quanta launch; "
      "under torchrun/srun/mpirun the launcher's world size is used)")
      ->transform(integer_in(1, train::kMaxRanks));
  add_override<std::string>(sub, t, "--lr-schedule", "/lr_schedule",
                            "the lr over the run: constant, linear or cosine (to 0 at the end)")
      ->check(CLI::IsMember({"constant", "linear", "cosine"}));
  add_override<int64_t>(sub, t, "--warmup-steps", "/warmup_steps",
                        "steps of linear lr warmup from 0")
      ->transform(integer_in(0, train::kMaxSteps));
  add_override<double>(sub, t, "--weight-decay", "/weight_decay",
                       "AdamW's decoupled weight decay (0: Adam)")
      ->check(CLI::NonNegativeNumber);
  add_override<int64_t>(sub, t, "--hidden", "/model/hidden", "channels of the hidden convolutions")
      ->transform(integer_in(1, train::kMaxChannels));
  add_override<int64_t>(sub, t, "--dim", "/model/dim",
                        "channels of the latent map the quantizer sees")
      ->transform(integer_in(1, train::kMaxChannels));
  add_override<std::string>(
      sub, t, "--arch", "/model/arch",
      "the autoencoder: conv (ours) or vqp-example (vector-quantize-pytorch's "
      "examples': max pools, nearest upsampling, GELU, images in [-1, 1])")
      ->check(CLI::IsMember({"conv", "vqp-example"}));
  add_override<std::string>(sub, t, "--recon-loss", "/recon_loss",
                            "reconstruction loss: mse or l1, in the model's image units")
      ->check(CLI::IsMember({"mse", "l1"}));
  add_override<int64_t>(sub, t, "--latent-norm-groups", "/model/latent_norm_groups",
                        "groups of a GroupNorm (no affine) in front of the encoder's last "
                        "convolution; 0: none")
      ->transform(integer_in(0, train::kMaxChannels));
  std::string types;
  for (const auto& [name, what] : train::quantizer_types()) types += "\n  " + name + ": " + what;
  add_override<std::string>(sub, t, "--quantizer", "/quantizer/type", "quantizer type:" + types)
      ->group("Quantizer options");
  // One flag per option of the table; each given flag sets quantizer.<key>.
  for (const train::QuantizerOption& opt : train::quantizer_options()) {
    auto text = std::make_shared<std::string>();
    std::string applies;
    for (const auto& ty : opt.types) applies += (applies.empty() ? "" : ",") + ty;
    const std::string help = opt.help + " [" + applies + "]";
    // Read as text (parse_option_value checks it against the table); named in
    // --help by the type the table declares. Defaults depend on the type (see
    // docs/train.md), so none is shown here.
    CLI::Option* o = opt.type == train::OptionType::boolean
                         ? sub->add_flag("--" + train::flag_name(opt.key), *text,
                                         help + " (--flag or --flag=false)")
                         : sub->add_option("--" + train::flag_name(opt.key), *text, help);
    if (opt.type == train::OptionType::integer) o->type_name("INT");
    if (opt.type == train::OptionType::number) o->type_name("FLOAT");
    if (opt.type == train::OptionType::integer_list) o->type_name("INT,INT,...");
    if (opt.type == train::OptionType::choice) {
      std::string names;
      for (const auto& c : opt.choices) names += (names.empty() ? "" : "|") + c;
      o->type_name("{" + names + "}");
    }
    o->group("Quantizer options");
    t.apply.push_back([o, text, opt](json& layer) {
      if (o->count() == 0) return;
      try {
        layer["quantizer"][opt.key] = train::parse_option_value(opt, *text);
      } catch (const std::invalid_argument& e) {
        throw UsageError(e.what());
      }
    });
  }
  sub->callback([f] { run_train(*f); });
}

}  // namespace quanta::cli
