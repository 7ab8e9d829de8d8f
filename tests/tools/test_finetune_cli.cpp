// `quanta train --task classify`, `quanta quantize` and `quanta finetune` run
// as a user runs them, on a Fashion-MNIST subset (2000 training, 500 test
// images) with --threads 1, so each run takes about a second.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>

#include "cli_runner.h"
#include "engine/io/safetensors.h"

using namespace quanta;
using namespace quanta::test;
using nlohmann::json;

namespace {

const std::vector<std::string> kSubset = {"--limit-train", "2000", "--limit-test", "500",
                                          "--threads",     "1",    "--batch-size", "64"};

// The percentage after `label` in `text` ("... label 81.20%"), NaN if absent.
double percent_after(const std::string& text, const std::string& label) {
  std::smatch m;
  const std::regex re(label + R"(\s*([0-9]+\.[0-9]+)%)");
  if (!std::regex_search(text, m, re)) return NAN;
  return std::stod(m[1]) / 100;
}

// One classifier per test process: 150 steps on the subset (about 79% test
// accuracy), and its quanta-format NF4 conversion.
struct Trained {
  ScratchDir dir{"classify"};
  std::string float_ckpt, nf4_ckpt;
  double accuracy = NAN;
  CliResult train, quantize;
};

const Trained& trained() {
  static Trained t;  // built in place: its folder must not be copied (or removed twice)
  static const bool ready = [] {
    t.train = run_quanta(with(
        {"train", "--task", "classify", "--steps", "150", "--out", t.dir.file("clf")}, kSubset));
    t.float_ckpt = t.dir.file("clf/checkpoint.safetensors");
    t.nf4_ckpt = t.dir.file("nf4.safetensors");
    t.accuracy = percent_after(t.train.out, "test accuracy");
    t.quantize = run_quanta({"quantize", t.float_ckpt, t.nf4_ckpt});
    return true;
  }();
  (void)ready;
  return t;
}

// A fine-tuning run on the subset at lr 2e-3 (40 steps unless given).
std::vector<std::string> finetune(const std::string& ckpt, const std::string& out,
                                  const std::vector<std::string>& extra = {},
                                  const std::string& steps = "40") {
  return with(with({"finetune", ckpt, "--out", out, "--steps", steps, "--lr", "2e-3"}, kSubset),
              extra);
}

}  // namespace

TEST_CASE("train --task classify writes a classifier checkpoint above 70% test accuracy") {
  if (!have_dataset()) return;
  const Trained& t = trained();
  CAPTURE(t.train.out);
  CAPTURE(t.train.err);
  REQUIRE(t.train.code == 0);
  CHECK(contains(t.train.out, "training a classifier (MLP 784-256-128-10) on 2000 images"));
  CHECK(t.accuracy > 0.70);  // 79.4% measured
  const io::SafetensorsFile f = io::load_safetensors(t.float_ckpt);
  CHECK(f.metadata.at("format") == "quanta-classifier-1");
  const json config = json::parse(f.metadata.at("config"));
  CHECK(config["task"] == "classify");
  CHECK(config["steps"] == 150);
  CHECK(json::parse(f.metadata.at("results"))["test_accuracy"].get<double>() ==
        doctest::Approx(t.accuracy).epsilon(1e-3));
  std::vector<std::string> names;
  int optimizer_tensors = 0;
  for (const auto& [name, _] : f.tensors) {
    if (name.rfind("model.", 0) == 0) names.push_back(name);
    optimizer_tensors += name.rfind("optim.", 0) == 0;
  }
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"model.1.bias", "model.1.weight", "model.3.bias",
                                          "model.3.weight", "model.5.bias", "model.5.weight"});
  CHECK(optimizer_tensors > 0);  // Adam's state: --resume can extend the run
  CHECK(names.size() + optimizer_tensors == f.tensors.size());
  // The training loop's metrics: a header, train records, the final eval.
  std::vector<std::string> kinds;
  {
    std::ifstream in(t.dir.file("clf/metrics.jsonl"));
    for (std::string line; std::getline(in, line);) kinds.push_back(json::parse(line)["kind"]);
  }
  REQUIRE(kinds.size() >= 3);
  CHECK(kinds.front() == "header");
  CHECK(kinds.back() == "eval");
  // Flags of the VQ-VAE are refused, not ignored.
  check_one_line_error(run_quanta({"train", "--task", "classify", "--codebook-size", "64"}), 2,
                       "--task classify");
}

TEST_CASE("quantize + finetune: NF4 base, adapters trained, accuracy kept or improved") {
  if (!have_dataset()) return;
  const Trained& t = trained();
  REQUIRE(t.train.code == 0);
  REQUIRE(fs::exists(t.nf4_ckpt));
  // The classifier's Adam state stays behind: it belongs to the float weights.
  CAPTURE(t.quantize.out);
  CHECK(contains(t.quantize.out, "optimizer state: 25 tensors ("));
  for (const auto& [name, _] : io::load_safetensors(t.nf4_ckpt).tensors)
    CHECK(name.rfind("optim.", 0) != 0);
  ScratchDir out("finetune");
  const CliResult r = run_quanta(finetune(t.nf4_ckpt, out.file("ft")));
  CAPTURE(r.out);
  CAPTURE(r.err);
  REQUIRE(r.code == 0);
  CHECK(contains(r.out, "3 Linear layers, NF4 from the file"));
  // The float figure is the one quanta train recorded.
  CHECK(percent_after(r.out, "float") == doctest::Approx(t.accuracy).epsilon(1e-3));
  const double before = percent_after(r.out, "NF4 base");
  const double after = percent_after(r.out, "after fine-tuning:");
  CHECK(before > 0.65);    // NF4 costs little: 78.0% vs 79.4% measured
  CHECK(after >= before);  // 80.6% measured
  CHECK(contains(r.out, "memory: NF4 base weights 132,048 bytes vs 939,008 bytes as f32"));
  CHECK(contains(r.out, "trainable adapters 12,496 parameters = 49,984 bytes"));

  const io::SafetensorsFile a = io::load_safetensors(out.file("ft/adapters.safetensors"));
  CHECK(a.metadata.at("format") == "quanta-lora-1");
  CHECK(json::parse(a.metadata.at("lora"))["rank"] == 8);
  CHECK(json::parse(a.metadata.at("results"))["finetuned_accuracy"].get<double>() ==
        doctest::Approx(after).epsilon(1e-3));
  REQUIRE(a.tensors.size() == 6);
  CHECK(a.tensors[0].first == "1.lora_A");
  CHECK(a.tensors[0].second.shape() == Shape{8, 784});
  CHECK(a.tensors[1].first == "1.lora_B");
  CHECK(a.tensors[1].second.shape() == Shape{256, 8});
}

TEST_CASE("finetune on the float checkpoint measures the float model; --merge writes it back") {
  if (!have_dataset()) return;
  const Trained& t = trained();
  REQUIRE(t.train.code == 0);
  ScratchDir out("finetune_float");
  const CliResult r = run_quanta(finetune(t.float_ckpt, out.file("ft"), {"--merge"}));
  CAPTURE(r.out);
  CAPTURE(r.err);
  REQUIRE(r.code == 0);
  CHECK(contains(r.out, "3 Linear layers, float, quantized to NF4 here"));
  CHECK(percent_after(r.out, "float") == doctest::Approx(t.accuracy).epsilon(1e-3));
  CHECK(percent_after(r.out, "after fine-tuning:") >= percent_after(r.out, "NF4 base"));
  // The merged model is a float classifier checkpoint that finetune takes again.
  const std::string merged = out.file("ft/merged.safetensors");
  REQUIRE(fs::exists(merged));
  const double merged_acc = percent_after(r.out, "merged float model, test accuracy");
  CHECK(merged_acc >= percent_after(r.out, "NF4 base") - 0.01);
  const CliResult again = run_quanta(finetune(merged, out.file("ft2"), {}, "1"));
  CAPTURE(again.err);
  CHECK(again.code == 0);
  CHECK(percent_after(again.out, "float") == doctest::Approx(merged_acc).epsilon(1e-3));
}

TEST_CASE("finetune --nproc 2 runs two ranks and ends with the adapters of one process") {
  if (!have_dataset()) return;
  const Trained& t = trained();
  REQUIRE(t.train.code == 0);
  ScratchDir out("finetune_dp");
  const CliResult one = run_quanta(finetune(t.nf4_ckpt, out.file("one")));
  const CliResult two = run_quanta(finetune(t.nf4_ckpt, out.file("two"), {"--nproc", "2"}));
  CAPTURE(two.out);
  CAPTURE(two.err);
  REQUIRE(one.code == 0);
  REQUIRE(two.code == 0);
  CHECK(contains(two.out, "[rank 0] fine-tuning LoRA adapters"));
  CHECK(contains(two.out, "2 ranks"));
  CHECK(!contains(two.out, "[rank 1]"));  // only rank 0 prints
  const double after = percent_after(two.out, "after fine-tuning:");
  CHECK(after >= percent_after(two.out, "NF4 base"));
  CHECK(after == doctest::Approx(percent_after(one.out, "after fine-tuning:")).epsilon(0.01));
  // Same global batch, same seed: the adapters agree up to summation order.
  const io::SafetensorsFile a = io::load_safetensors(out.file("one/adapters.safetensors"));
  const io::SafetensorsFile b = io::load_safetensors(out.file("two/adapters.safetensors"));
  REQUIRE(a.tensors.size() == b.tensors.size());
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    const Tensor x = a.tensors[i].second.contiguous(), y = b.tensors[i].second.contiguous();
    REQUIRE(x.numel() == y.numel());
    double worst = 0;
    for (int64_t k = 0; k < x.numel(); ++k)
      worst = std::max(worst, double(std::abs(x.data<float>()[k] - y.data<float>()[k])));
    CAPTURE(a.tensors[i].first);
    CHECK(worst < 1e-4);
  }
}

// The tensors of a safetensors file by name.
std::map<std::string, Tensor> tensors_of(const std::string& path) {
  std::map<std::string, Tensor> out;
  for (auto& [name, t] : io::load_safetensors(path).tensors) out.emplace(name, t);
  return out;
}

// Whether two files hold the same tensors, bit for bit (names, shapes, bytes).
void check_same_tensors(const std::string& a, const std::string& b) {
  const auto x = tensors_of(a), y = tensors_of(b);
  REQUIRE(x.size() == y.size());
  for (const auto& [name, t] : x) {
    CAPTURE(name);
    REQUIRE(y.count(name) == 1);
    const Tensor u = t.contiguous(), v = y.at(name).contiguous();
    REQUIRE(u.shape() == v.shape());
    REQUIRE(u.dtype() == v.dtype());
    CHECK(std::memcmp(u.raw_data(), v.raw_data(), u.nbytes()) == 0);
  }
}

TEST_CASE("train --task classify --resume continues exactly; a changed run is refused") {
  if (!have_dataset()) return;
  ScratchDir dir("classify_resume");
  const auto run = [&](const std::string& out, const std::string& steps,
                       const std::vector<std::string>& extra = {}) {
    return run_quanta(with(with({"train", "--task", "classify", "--steps", steps, "--log-every",
                                 "4", "--out", dir.file(out)},
                                kSubset),
                           extra));
  };
  REQUIRE(run("whole", "12").code == 0);
  REQUIRE(run("split", "5").code == 0);
  const CliResult r = run("split", "12", {"--resume"});
  CAPTURE(r.out);
  CAPTURE(r.err);
  REQUIRE(r.code == 0);
  CHECK(contains(r.out, "resuming at step 5 of 12"));
  check_same_tensors(dir.file("whole/checkpoint.safetensors"),
                     dir.file("split/checkpoint.safetensors"));
  // The resumed log's records at the --log-every steps equal the
  // uninterrupted one's (the window 5..8 spans the resume); the first run's
  // record of its last step 5 stays in the log.
  auto losses = [&](const std::string& out) {
    std::vector<double> v;
    std::ifstream in(dir.file(out + "/metrics.jsonl"));
    for (std::string line; std::getline(in, line);) {
      const json j = json::parse(line);
      if (j["kind"] == "train" && j["step"].get<int64_t>() % 4 == 0)
        v.push_back(j["loss"].get<double>());
    }
    return v;
  };
  CHECK(losses("whole").size() == 3);
  CHECK(losses("whole") == losses("split"));
  check_one_line_error(
      run("split", "20", {"--resume", "--lr", "0.5"}), 2,
      "--resume cannot change the run it continues (lr: checkpoint 0.001, now 0.5)");
  check_one_line_error(run("split", "12", {"--resume"}), 2,
                       "the checkpoint is at step 12, the run asks for 12 steps");
}

TEST_CASE("finetune --resume continues exactly, dropout streams included") {
  if (!have_dataset()) return;
  const Trained& t = trained();
  REQUIRE(t.train.code == 0);
  ScratchDir out("finetune_resume");
  const std::vector<std::string> drop = {"--lora-dropout", "0.2", "--log-every", "4"};
  const CliResult whole = run_quanta(finetune(t.nf4_ckpt, out.file("whole"), drop, "12"));
  REQUIRE(whole.code == 0);
  REQUIRE(run_quanta(finetune(t.nf4_ckpt, out.file("split"), drop, "5")).code == 0);
  const CliResult r =
      run_quanta(finetune(t.nf4_ckpt, out.file("split"), with(drop, {"--resume"}), "12"));
  CAPTURE(r.out);
  CAPTURE(r.err);
  REQUIRE(r.code == 0);
  CHECK(contains(r.out, "resuming at step 5 of 12 steps"));
  check_same_tensors(out.file("whole/adapters.safetensors"),
                     out.file("split/adapters.safetensors"));
  check_same_tensors(out.file("whole/checkpoint.safetensors"),
                     out.file("split/checkpoint.safetensors"));
  CHECK(percent_after(r.out, "after fine-tuning:") ==
        doctest::Approx(percent_after(whole.out, "after fine-tuning:")));
  // What defines the run may not change; the base neither.
  check_one_line_error(
      run_quanta(
          finetune(t.nf4_ckpt, out.file("split"), with(drop, {"--resume", "--lora-r", "4"}), "20")),
      2,
      "--resume cannot change the run it continues (model.lora_rank: checkpoint 8, "
      "now 4)");
  check_one_line_error(
      run_quanta(finetune(t.float_ckpt, out.file("split"), with(drop, {"--resume"}), "20")), 2,
      "--resume cannot change the run it continues (base:");
}

// The records of one kind ("train", "header", "profile") of a run's
// metrics.jsonl.
std::vector<json> train_records(const std::string& dir, const std::string& kind = "train") {
  std::vector<json> out;
  std::ifstream in(dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const json j = json::parse(line);
    if (j["kind"] == kind) out.push_back(j);
  }
  return out;
}

// sim runs the CPU's kernels behind a GPU's rules: the classifier and the
// QLoRA adapters it trains are the CPU's bit for bit, and no step waits for
// the device (the losses are read once per log window).
TEST_CASE("train --task classify and finetune --device sim: the CPU's losses and bytes") {
  if (!have_dataset()) return;
  const Trained& t = trained();
  REQUIRE(t.train.code == 0);
  ScratchDir dir("on_sim");
  auto same_runs = [&](const std::string& a, const std::string& b) {
    const std::vector<json> la = train_records(a), lb = train_records(b);
    REQUIRE(!la.empty());
    REQUIRE(la.size() == lb.size());
    for (std::size_t i = 0; i < la.size(); ++i) {
      CHECK(lb[i]["loss"].dump() == la[i]["loss"].dump());
      CHECK(lb[i]["host_syncs_per_step"].get<double>() == 0);
    }
  };
  std::map<std::string, CliResult> classify, tune;
  for (const std::string device : {"cpu", "sim"}) {
    classify[device] =
        run_quanta(with({"train", "--task", "classify", "--steps", "8", "--log-every", "4",
                         "--device", device, "--out", dir.file("clf-" + device)},
                        kSubset));
    tune[device] = run_quanta(finetune(
        t.nf4_ckpt, dir.file("qlora-" + device),
        {"--lora-dropout", "0.2", "--log-every", "4", "--merge", "--device", device}, "8"));
    CAPTURE(classify[device].err);
    CAPTURE(tune[device].err);
    REQUIRE(classify[device].code == 0);
    REQUIRE(tune[device].code == 0);
  }
  // --profile fine-tunes as called, timing each kernel call: the same bytes.
  const CliResult profiled = run_quanta(finetune(
      t.nf4_ckpt, dir.file("qlora-profiled"),
      {"--lora-dropout", "0.2", "--log-every", "4", "--merge", "--device", "sim", "--profile", "3"},
      "8"));
  CAPTURE(profiled.err);
  REQUIRE(profiled.code == 0);
  const std::vector<json> p = train_records(dir.file("qlora-profiled"), "profile");
  REQUIRE(p.size() == 1);
  CHECK(p[0]["first_step"] == 3);
  CHECK(p[0]["steps"] == 3);
  bool nf4_products = false;
  for (const json& e : p[0]["entries"])
    nf4_products = nf4_products || (e["name"] == "quant.nf4_linear" && e["device"] == "sim");
  CHECK(nf4_products);
  CHECK(contains(profiled.out, "quant.nf4_linear"));
  check_same_tensors(dir.file("qlora-sim/adapters.safetensors"),
                     dir.file("qlora-profiled/adapters.safetensors"));
  same_runs(dir.file("clf-cpu"), dir.file("clf-sim"));
  check_same_tensors(dir.file("clf-cpu/checkpoint.safetensors"),
                     dir.file("clf-sim/checkpoint.safetensors"));
  CHECK(percent_after(classify["sim"].out, "test accuracy") ==
        percent_after(classify["cpu"].out, "test accuracy"));
  same_runs(dir.file("qlora-cpu"), dir.file("qlora-sim"));
  for (const char* file : {"adapters.safetensors", "checkpoint.safetensors", "merged.safetensors"})
    check_same_tensors(dir.file(std::string("qlora-cpu/") + file),
                       dir.file(std::string("qlora-sim/") + file));
  CHECK(percent_after(tune["sim"].out, "after fine-tuning:") ==
        percent_after(tune["cpu"].out, "after fine-tuning:"));
  // The device is where this run went, not what defines it: the checkpoint's
  // config records it, and a resume may move the run.
  const auto meta = io::load_safetensors(dir.file("clf-sim/checkpoint.safetensors")).metadata;
  CHECK(json::parse(meta.at("config"))["device"] == "sim");
  const CliResult more =
      run_quanta(with({"train", "--task", "classify", "--steps", "12", "--log-every", "4",
                       "--device", "cpu", "--resume", "--out", dir.file("clf-sim")},
                      kSubset));
  CAPTURE(more.err);
  CHECK(more.code == 0);
  for (const std::vector<std::string>& bad :
       {std::vector<std::string>{"train", "--task", "classify", "--device", "gpu", "--out",
                                 dir.file("bad")},
        finetune(t.nf4_ckpt, dir.file("bad2"), {"--device", "gpu"})})
    check_one_line_error(run_quanta(bad), 2,
                         "--device must be cpu, cuda, cuda:N, sim or sim:N, got 'gpu'");
}

TEST_CASE("finetune: bad files and flags give one line and a non-zero exit") {
  const CliResult help = run_quanta({"finetune", "--help"});
  CHECK(help.code == 0);
  CHECK(contains(help.out, "quanta finetune runs/clf/nf4.safetensors --out runs/qlora"));
  ScratchDir dir("finetune_bad");
  check_one_line_error(
      run_quanta({"finetune", dir.file("missing.safetensors"), "--out", dir.file("o")}), 1,
      "missing.safetensors");
  {
    std::ofstream(dir.file("junk.safetensors")) << "not a safetensors file";
    check_one_line_error(
        run_quanta({"finetune", dir.file("junk.safetensors"), "--out", dir.file("o")}), 1,
        "junk.safetensors");
  }
  check_one_line_error(
      run_quanta({"finetune", dir.file("x"), "--out", dir.file("o"), "--lora-r", "0"}), 2,
      "--lora-r");
  check_one_line_error(run_quanta({"finetune", dir.file("x")}), 2, "--out");
  {  // An --out that holds a fine-tuning run is refused (before, replaced
     // silently), before anything is read; --overwrite goes on.
    fs::create_directories(dir.file("done"));
    std::ofstream(dir.file("done/adapters.safetensors")) << "earlier run";
    const CliResult r = run_quanta({"finetune", dir.file("x"), "--out", dir.file("done")});
    check_one_line_error(r, 2,
                         "--out " + dir.file("done") +
                             " already holds a run "
                             "(adapters.safetensors)");
    CHECK(contains(r.err, "continue it with --resume, or replace it with --overwrite"));
    CHECK(slurp(dir.file("done/adapters.safetensors")) == "earlier run");
    check_one_line_error(
        run_quanta({"finetune", dir.file("x"), "--out", dir.file("done"), "--overwrite"}), 1,
        "cannot read checkpoint");
    check_one_line_error(
        run_quanta({"finetune", dir.file("x"), "--out", dir.file("done"), "--resume"}), 1,
        "checkpoint.safetensors");
    check_one_line_error(run_quanta({"finetune", dir.file("x"), "--out", dir.file("done"),
                                     "--resume", "--overwrite"}),
                         2, "--resume continues the run in --out, --overwrite replaces it");
  }
  if (!have_dataset()) return;
  // A VQ-VAE checkpoint is not a classifier.
  const CliResult vq = run_quanta({"train", "--steps", "1", "--limit-train", "64", "--limit-test",
                                   "16", "--batch-size", "16", "--hidden", "8", "--dim", "4",
                                   "--threads", "1", "--out", dir.file("vq")});
  REQUIRE(vq.code == 0);
  check_one_line_error(
      run_quanta({"finetune", dir.file("vq/checkpoint.safetensors"), "--out", dir.file("o")}), 1,
      "quanta train --task classify");
}

TEST_CASE("finetune refuses an --out that would replace its base checkpoint") {
  // `quanta finetune runs/clf/checkpoint.safetensors --out runs/clf --overwrite`
  // would write the fine-tune's checkpoint over the base it reads.
  ScratchDir dir("finetune_same_file");
  const std::string run = dir.file("clf");
  fs::create_directories(run);
  const std::string base = run + "/checkpoint.safetensors";
  std::ofstream(base) << "the base";
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{}, std::vector<std::string>{"--overwrite"}}) {
    std::vector<std::string> args = {"finetune", base, "--out", run};
    args.insert(args.end(), extra.begin(), extra.end());
    const CliResult r = run_quanta(args);
    check_one_line_error(r, 2, "--out " + base + " is the base checkpoint this command reads");
  }
  CHECK(slurp(base) == "the base");
}
