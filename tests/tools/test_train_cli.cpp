// `quanta train`, `eval`, `encode`, `decode` run as a user runs them. The
// training runs use a small subset of Fashion-MNIST and --threads 1 (suites
// run side by side; one thread per run keeps timings steady).
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>

#include "cli_runner.h"
#include "data/idx.h"
#include "engine/device.h"
#include "engine/factory.h"
#include "engine/io/safetensors.h"
#include "image/png.h"
#include "train/outputs.h"
#include "train/run_folder.h"

using namespace quanta;
using namespace quanta::test;
using nlohmann::json;

namespace {

std::vector<json> records(const std::string& dir, const std::string& kind) {
  std::vector<json> out;
  for (json& r : train::read_metrics(dir + "/metrics.jsonl"))
    if (r["kind"] == kind) out.push_back(std::move(r));
  return out;
}

}  // namespace

TEST_CASE("quanta train (quantizer none) learns and writes every output") {
  if (!have_dataset()) return;
  ScratchDir dir("train");
  const std::string out = dir.file("run");
  const auto t0 = std::chrono::steady_clock::now();
  CliResult r = run_quanta({"train", "--quantizer", "none", "--steps", "80", "--hidden", "16",
                            "--batch-size", "32", "--limit-train", "1000", "--limit-test", "200",
                            "--log-every", "20", "--threads", "1", "--out", out});
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE("80 training steps + 3 evaluations took " << seconds << " s");
  CAPTURE(r.out);
  CAPTURE(r.err);
  REQUIRE(r.code == 0);
  CHECK(r.err.empty());
  CHECK(contains(r.out, "step 20/80"));  // plain log lines: stdout is not a terminal
  CHECK(contains(r.out, "eval step 32 (epoch 1): test mse"));
  CHECK(contains(r.out, "codebook usage n/a"));
  CHECK(contains(r.out, "done: 80 steps"));

  for (const char* f : {train::kCheckpointFile, train::kMetricsFile, train::kReconstructionsFile,
                        train::kUsageFile, train::kLossFile})
    CHECK_MESSAGE(fs::exists(fs::path(out) / f), f);
  const std::vector<json> train_recs = records(out, "train"), evals = records(out, "eval");
  REQUIRE(train_recs.size() == 4);  // steps 20, 40, 60, 80
  CHECK(train_recs.back()["step"] == 80);
  REQUIRE(evals.size() == 3);  // end of epochs 1 and 2 (32 steps each), and the end
  CHECK(evals[0]["step"] == 32);
  CHECK(evals[2]["step"] == 80);
  CHECK(evals[2]["codebook_usage"].is_null());
  const double mse = evals[2]["test_mse"].get<double>();
  // Measured 0.027 (the pixel variance of the test images is 0.124).
  CHECK(mse < 0.035);
  CHECK(mse < evals[0]["test_mse"].get<double>());
  CHECK(train_recs.back()["loss"].get<double>() < train_recs.front()["loss"].get<double>());

  const image::Image recon = image::read_png(out + "/reconstructions.png");
  // 8 columns of 2x-scaled 28-pixel tiles after a 32-pixel IN / OUT margin;
  // 2 rows of originals, 2 of reconstructions under a 22-pixel caption band.
  CHECK(recon.width == 32 + 8 * 56 + 9 * 2);
  CHECK(recon.height == 22 + 4 * 56 + 5 * 2);
  // The caption (dark text) names what made the figure; the band is white elsewhere.
  int64_t ink = 0;
  for (int64_t y = 0; y < 22; ++y)
    for (int64_t x = 0; x < recon.width; ++x) ink += recon.at(x, y)[0] < 100;
  CHECK(ink > 100);
  for (const char* png : {"loss.png", "codebook_usage.png"}) {
    const image::Image img = image::read_png(out + "/" + png);
    CHECK(img.width == 720);
    CHECK(img.height == 440);
  }
  const io::SafetensorsHeader h = io::read_safetensors_header(out + "/checkpoint.safetensors");
  CHECK(h.metadata.at("step") == "80");
  CHECK(json::parse(h.metadata.at("config"))["model"]["hidden"] == 16);

  {  // quanta eval reproduces the run's last test figure (blocks, not SUBCASEs:
     // a SUBCASE would train again)
    CliResult e = run_quanta({"eval", out + "/checkpoint.safetensors", "--limit", "200", "--json",
                              "--png", dir.file("eval.png")});
    CAPTURE(e.err);
    REQUIRE(e.code == 0);
    const json j = json::parse(e.out);
    CHECK(j["step"] == 80);
    CHECK(j["test_samples"] == 200);
    CHECK(j["test_mse"].get<double>() == doctest::Approx(mse).epsilon(1e-6));
    CHECK(j["codebook_usage"].is_null());
    CHECK(image::read_png(dir.file("eval.png")).width == recon.width);
  }
  {  // encode and decode need a quantizer with codes
    check_one_line_error(run_quanta({"encode", out + "/checkpoint.safetensors", "--out",
                                     dir.file("codes.safetensors")}),
                         2, "has no codes to encode");
    io::save_safetensors(dir.file("codes.safetensors"),
                         {{"indices", zeros({1, 7, 7}, {.dtype = DType::i64})}});
    CliResult d = run_quanta({"decode", out + "/checkpoint.safetensors",
                              dir.file("codes.safetensors"), "--out", dir.file("d.png")});
    CHECK(d.code != 0);
    CHECK(contains(d.err, "codebook of 0"));
  }
}

TEST_CASE("quanta train (default vq) uses its codebook; encode and decode round-trip") {
  if (!have_dataset()) return;
  ScratchDir dir("train_vq");
  const std::string out = dir.file("run");
  CliResult r = run_quanta({"train", "--steps", "60", "--hidden", "16", "--batch-size", "32",
                            "--limit-train", "1000", "--limit-test", "200", "--log-every", "20",
                            "--threads", "1", "--out", out});
  CAPTURE(r.out);
  CAPTURE(r.err);
  REQUIRE(r.code == 0);
  CHECK(contains(r.out, "quantizer vq"));
  const std::vector<json> evals = records(out, "eval");
  REQUIRE(evals.size() == 2);  // end of epoch 1 (step 32) and the end
  const json& last = evals.back();
  MESSAGE("vq, 60 steps: " << last.dump());
  // Measured: test mse 0.055 (0.086 at step 32), usage 100% of 512 codes,
  // perplexity 436.
  CHECK(last["test_mse"].get<double>() < 0.07);
  CHECK(last["test_mse"].get<double>() < evals[0]["test_mse"].get<double>());
  CHECK(last["codebook_usage"].get<double>() > 0.9);
  CHECK(last["perplexity"].get<double>() > 300);
  CHECK(contains(r.out, "eval step 60 (epoch 2): test mse"));
  CHECK_FALSE(contains(r.out, "codebook usage n/a"));

  const std::string ckpt = out + "/checkpoint.safetensors";
  CliResult e = run_quanta({"encode", ckpt, "--limit", "16", "--out", dir.file("codes.st")});
  CAPTURE(e.err);
  REQUIRE(e.code == 0);
  const io::SafetensorsFile codes = io::load_safetensors(dir.file("codes.st"));
  const Tensor& idx = codes.tensors.at(0).second;
  CHECK(codes.tensors.at(0).first == "indices");
  CHECK(idx.shape() == Shape{16, 7, 7});
  CHECK(idx.dtype() == DType::i64);
  for (int64_t v : idx.to_vector<int64_t>()) CHECK((v >= 0 && v < 512));
  CliResult d = run_quanta({"decode", ckpt, dir.file("codes.st"), "--out", dir.file("d.png")});
  CAPTURE(d.err);
  REQUIRE(d.code == 0);
  CHECK(image::read_png(dir.file("d.png")).width > 0);
  // Codes of another layout (a trailing codebook dim this quantizer does
  // not have): one line naming the file and both shapes, not an error from
  // deep inside the decoder.
  io::save_safetensors(dir.file("codes4.st"),
                       {{"indices", zeros({2, 7, 7, 2}, {.dtype = DType::i64})}});
  check_one_line_error(
      run_quanta({"decode", ckpt, dir.file("codes4.st"), "--out", dir.file("d4.png")}), 1,
      dir.file("codes4.st") +
          ": 'indices' has shape [2, 7, 7, 2]; this checkpoint's quantizer "
          "decodes [N, 7, 7]");
}

TEST_CASE("PSNR and per-codebook usage: metrics.jsonl, the lines, eval and the usage picture") {
  if (!have_dataset()) return;
  ScratchDir dir("per_codebook");
  const std::string run = dir.file("run");
  const CliResult r = run_quanta(
      tiny_train(run, 3, {"--quantizer", "rvq", "--num-quantizers", "3", "--codebook-size", "32"}));
  CAPTURE(r.out);
  CAPTURE(r.err);
  REQUIRE(r.code == 0);
  // Each train record's PSNR is its window's reconstruction error in dB
  // (images in [0, 1]), shown on the progress line.
  for (const json& t : records(run, "train"))
    CHECK(t["psnr"].get<double>() ==
          doctest::Approx(-10 * std::log10(t["recon_mse"].get<double>())).epsilon(1e-12));
  CHECK(contains(r.out, " dB  "));
  const std::vector<json> evals = records(run, "eval");
  REQUIRE(evals.size() == 1);
  const json& ev = evals[0];
  CHECK(ev["psnr"].get<double>() ==
        doctest::Approx(-10 * std::log10(ev["test_mse"].get<double>())).epsilon(1e-12));
  // One entry per level, whose means are the overall figures.
  REQUIRE(ev["codebook_usage_per_level"].size() == 3);
  REQUIRE(ev["perplexity_per_level"].size() == 3);
  double usage = 0, perplexity = 0;
  for (int q = 0; q < 3; ++q) {
    const double u = ev["codebook_usage_per_level"][q], p = ev["perplexity_per_level"][q];
    CHECK(u > 0);
    CHECK(u <= 1);
    CHECK(p >= 1);
    CHECK(p <= 32);
    usage += u / 3;
    perplexity += p / 3;
  }
  CHECK(ev["codebook_usage"].get<double>() == doctest::Approx(usage).epsilon(1e-12));
  CHECK(ev["perplexity"].get<double>() == doctest::Approx(perplexity).epsilon(1e-12));
  CHECK(contains(r.out, "psnr "));
  CHECK(contains(r.out, "per codebook (level 0 first): usage "));
  // The summed chart above one chart per level.
  const image::Image png = image::read_png(run + "/" + train::kUsageFile);
  CHECK(png.width == 720);
  CHECK(png.height == 440 + 3 * 240);

  const CliResult e = run_quanta({"eval", run + "/checkpoint.safetensors", "--json", "--limit",
                                  "64", "--png", dir.file("eval.png")});
  CAPTURE(e.err);
  REQUIRE(e.code == 0);
  const json j = json::parse(e.out);
  CHECK(j["codebook_names"] == json{"level 0", "level 1", "level 2"});
  CHECK(j["codebook_usage_per_level"] == ev["codebook_usage_per_level"]);
  CHECK(j["perplexity_per_level"] == ev["perplexity_per_level"]);
  CHECK(j["psnr"].get<double>() == doctest::Approx(ev["psnr"].get<double>()).epsilon(1e-6));
  const CliResult text = run_quanta(
      {"eval", run + "/checkpoint.safetensors", "--limit", "64", "--png", dir.file("eval.png")});
  CHECK(contains(text.out, "test psnr:"));
  CHECK(contains(text.out, "  level 2: usage "));
}

TEST_CASE("quanta train --resume continues exactly") {
  if (!have_dataset()) return;
  ScratchDir dir("resume");
  // Residual VQ with k-means and quantize dropout: the dropout draws are
  // keyed by the step the checkpoint holds, so they repeat exactly.
  const std::vector<std::string> rvq = {
      "--quantizer",     "rvq", "--num-quantizers", "3",
      "--codebook-size", "32",  "--kmeans-init",    "--quantize-dropout"};
  const std::string a = dir.file("a"), b = dir.file("b");
  REQUIRE(run_quanta(tiny_train(a, 6, rvq)).code == 0);
  REQUIRE(run_quanta(tiny_train(b, 4, rvq)).code == 0);  // checkpoints at steps 3 and 4
  CliResult r = run_quanta(with(tiny_train(b, 6, rvq), {"--resume"}));
  CAPTURE(r.err);
  REQUIRE(r.code == 0);
  CHECK(contains(r.out, "resuming at step 4 of 6"));

  const std::vector<json> ra = records(a, "train"), rb = records(b, "train");
  REQUIRE(ra.size() == 6);
  REQUIRE(rb.size() == 6);
  for (size_t i = 0; i < 6; ++i) {
    CAPTURE(i);
    CHECK(rb[i]["step"] == static_cast<int>(i + 1));
    // Bitwise: the same double, printed with round-trip precision.
    CHECK(rb[i]["loss"].dump() == ra[i]["loss"].dump());
  }
  const io::SafetensorsFile fa = io::load_safetensors(a + "/checkpoint.safetensors");
  const io::SafetensorsFile fb = io::load_safetensors(b + "/checkpoint.safetensors");
  REQUIRE(fa.tensors.size() == fb.tensors.size());
  for (size_t i = 0; i < fa.tensors.size(); ++i) {
    CAPTURE(fa.tensors[i].first);
    CHECK(fa.tensors[i].first == fb.tensors[i].first);
    CHECK(fa.tensors[i].second.to_vector<double>() == fb.tensors[i].second.to_vector<double>());
  }
  CHECK(fa.metadata == fb.metadata);
  CHECK(json::parse(fa.metadata.at("rng"))["quantizer"] == json{{"steps", 6}});

  std::vector<std::string> changed = with(tiny_train(b, 9, rvq), {"--resume", "--lr", "0.01"});
  check_one_line_error(run_quanta(changed), 2,
                       "--resume cannot change the run it continues (lr: checkpoint 0.002");
  check_one_line_error(run_quanta(with(tiny_train(b, 9), {"--resume", "--quantizer", "vq"})), 2,
                       "--resume cannot change the run it continues (quantizer.type: checkpoint "
                       "\"rvq\", now \"vq\")");
  check_one_line_error(run_quanta(with(tiny_train(b, 6, rvq), {"--resume"})), 2,
                       "the checkpoint is at step 6");

  // The default vq replaces dead codes with rows drawn from the codebook's
  // stream, keyed by the step (restored from the checkpoint): every step
  // after the resume point is identical too, replacements included.
  const std::string c = dir.file("c"), d = dir.file("d");
  REQUIRE(run_quanta(tiny_train(c, 9)).code == 0);
  REQUIRE(run_quanta(tiny_train(d, 4)).code == 0);
  REQUIRE(run_quanta(with(tiny_train(d, 9), {"--resume"})).code == 0);
  const std::vector<json> rc = records(c, "train"), rd = records(d, "train");
  REQUIRE(rc.size() == 9);
  REQUIRE(rd.size() == 9);
  for (std::size_t i = 4; i < 9; ++i) CHECK(rd[i]["loss"].dump() == rc[i]["loss"].dump());
  const auto tc = io::load_safetensors(c + "/checkpoint.safetensors").tensors;
  const auto td = io::load_safetensors(d + "/checkpoint.safetensors").tensors;
  REQUIRE(tc.size() == td.size());
  for (std::size_t i = 0; i < tc.size(); ++i) {
    const auto& [name, t] = tc[i];
    CAPTURE(name);
    REQUIRE(td[i].first == name);
    REQUIRE(t.nbytes() == td[i].second.nbytes());
    CHECK(std::memcmp(t.raw_data(), td[i].second.raw_data(), t.nbytes()) == 0);
  }

  // HierarchicalVQ: its levels' k-means and dead codes, and nested dropout's
  // cutoff, drawn from streams keyed by the step.
  const std::vector<std::string> hvq = {"--quantizer",     "hvq", "--scales",         "1,2,4,7",
                                        "--codebook-size", "32",  "--nested-dropout", "0.5"};
  const std::string e = dir.file("e"), f = dir.file("f");
  REQUIRE(run_quanta(tiny_train(e, 7, hvq)).code == 0);
  REQUIRE(run_quanta(tiny_train(f, 3, hvq)).code == 0);
  REQUIRE(run_quanta(with(tiny_train(f, 7, hvq), {"--resume"})).code == 0);
  const std::vector<json> re = records(e, "train"), rf = records(f, "train");
  REQUIRE(re.size() == 7);
  REQUIRE(rf.size() == 7);
  for (std::size_t i = 3; i < 7; ++i) CHECK(rf[i]["loss"].dump() == re[i]["loss"].dump());
  const io::SafetensorsFile fe = io::load_safetensors(e + "/checkpoint.safetensors");
  const io::SafetensorsFile ff = io::load_safetensors(f + "/checkpoint.safetensors");
  REQUIRE(fe.tensors.size() == ff.tensors.size());
  for (std::size_t i = 0; i < fe.tensors.size(); ++i) {
    CAPTURE(fe.tensors[i].first);
    CHECK(fe.tensors[i].second.to_vector<double>() == ff.tensors[i].second.to_vector<double>());
  }
}

TEST_CASE("SIGTERM finishes the step, writes a checkpoint and exits cleanly") {
  if (!have_dataset()) return;
  ScratchDir dir("sigterm");
  const std::string out = dir.file("run");
  CliProcess p(tiny_train(out, 100000));
  // Wait until a few steps are logged, then ask it to stop.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline &&
         (!fs::exists(out + "/metrics.jsonl") || records(out, "train").size() < 2))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  REQUIRE(::kill(p.pid, SIGTERM) == 0);
  CliResult r = p.wait();
  CAPTURE(r.out);
  CAPTURE(r.err);
  CHECK(r.code == 0);
  CHECK(r.err.empty());
  CHECK(contains(r.out, "interrupted by SIGTERM after step"));
  const io::SafetensorsHeader h = io::read_safetensors_header(out + "/checkpoint.safetensors");
  const int64_t step = std::stoll(h.metadata.at("step"));
  CHECK(step >= 2);
  CHECK(step < 100000);
  CHECK(records(out, "train").back()["step"] == step);  // the finished step was logged
}

TEST_CASE("quanta train: config file and flags, one line per mistake") {
  ScratchDir dir("train_bad");
  const std::string cfg = dir.file("run.json");
  std::ofstream(cfg) << R"({"lr": 0.001, "batch_size": 16, "model": {"dim": 8},
                           "quantizer": {"type": "none"}})";
  CliResult p = run_quanta({"train", "--config", cfg, "--batch-size", "128", "--print-config"});
  CAPTURE(p.err);
  REQUIRE(p.code == 0);
  const json merged = json::parse(p.out);
  CHECK(merged["lr"] == 0.001);            // from the file
  CHECK(merged["batch_size"] == 128);      // the flag wins
  CHECK(merged["model"]["dim"] == 8);      // file, inside "model"
  CHECK(merged["model"]["hidden"] == 32);  // default kept
  CHECK(merged["epochs"] == 2);
  CHECK(merged["quantizer"] == json{{"type", "none"}});  // the file's type drops the defaults
  CliResult d = run_quanta({"train", "--print-config"});
  REQUIRE(d.code == 0);
  const json vq = json::parse(d.out)["quantizer"];
  CHECK(vq["type"] == "vq");
  CHECK(vq["codebook_size"] == 512);
  CHECK(vq["kmeans_init"] == true);
  CHECK(vq["threshold_ema_dead_code"] == 2);
  CHECK(vq["decay"] == 0.8);  // resolved: the layer's default written out
  // hvq: its recipe and the layer's options, resolved; a bad option is one line naming it.
  CliResult hp =
      run_quanta({"train", "--quantizer", "hvq", "--nested-dropout", "0.25", "--print-config"});
  REQUIRE(hp.code == 0);
  const json hvq = json::parse(hp.out)["quantizer"];
  CHECK(hvq["scales"] == json{1, 2, 4, 7});
  CHECK(hvq["shared_codebook"] == false);
  CHECK(hvq["nested_dropout"] == 0.25);
  CHECK(hvq["decay"] == 0.99);
  CHECK(hvq["quant_resi"] == 0.5);
  // Named before any data is read: --data names nothing here.
  check_one_line_error(run_quanta({"train", "--quantizer", "hvq", "--scales", "1,9", "--data",
                                   dir.file("no-data"), "--out", dir.file("h")}),
                       2, "[quantizer hvq] scales must be at most the latent's side 7, got 9");
  check_one_line_error(
      run_quanta({"train", "--quantizer", "hvq", "--scales", "2,x", "--out", dir.file("h")}), 2,
      "--scales: expected a list of positive integers");

  CliResult h = run_quanta({"train", "--help"});
  CHECK(h.code == 0);
  for (const char* s :
       {"Examples:", "--codebook-size", "--levels", "--threshold-ema-dead-code", "--num-quantizers",
        "--use-cosine-sim", "--entropy-loss-weight", "--resume", "--nproc"})
    CHECK_MESSAGE(contains(h.out, s), s);
  for (const char* sub : {"eval", "encode", "decode"}) {
    CliResult s = run_quanta({sub, "--help"});
    CHECK(s.code == 0);
    CHECK(contains(s.out, "Examples:"));
  }

  check_one_line_error(run_quanta({"train", "--bogus"}), 2, "--bogus");
  check_one_line_error(run_quanta({"train", "--steps", "0"}), 2, "--steps: must be a number > 0");
  check_one_line_error(run_quanta({"train", "--lr", "-1"}), 2, "--lr: must be a number > 0");
  check_one_line_error(run_quanta({"train", "--steps", "3", "--epochs", "2"}), 2, "--steps");
  check_one_line_error(run_quanta({"train", "--quantizer", "none", "--codebook-size", "512"}), 2,
                       "'codebook_size' does not apply to quantizer 'none'");
  if (have_dataset())  // the layer is built once the data is read
    check_one_line_error(run_quanta({"train", "--quantizer", "grvq", "--groups", "3"}), 2,
                         "[quantizer grvq] dim 16 is not a multiple of groups 3");
  check_one_line_error(run_quanta({"train", "--quantizer", "vqq"}), 2,
                       "unknown quantizer type 'vqq'");
  check_one_line_error(run_quanta({"train", "--quantizer", "fsq", "--levels", "8,x"}), 2,
                       "--levels: expected a list of positive integers");
  check_one_line_error(run_quanta({"train", "--quantizer", "vq", "--kmeans-init=maybe"}), 2,
                       "--kmeans-init: expected true or false");
  check_one_line_error(run_quanta({"train", "--nproc", "0"}), 2, "--nproc: must be a number > 0");
  check_one_line_error(run_quanta({"train", "--conv-layout", "channels_last"}), 2,
                       "--conv-layout: channels_last not in {auto,nchw,nhwc}");
  check_one_line_error(run_quanta({"train", "--arch", "vqp-example", "--conv-layout", "nhwc",
                                   "--data", dir.file("no-data"), "--out", dir.file("l")}),
                       2,
                       "--conv-layout nhwc: model.arch vqp-example computes channels first (its "
                       "pools and upsampling); use auto or nchw");
  check_one_line_error(run_quanta({"train", "--device", "gpu"}), 2,
                       "--device must be cpu, cuda, cuda:N, sim or sim:N, got 'gpu'");
  if (cuda_device_count() == 0)  // else cuda is a place to train
    check_one_line_error(run_quanta({"train", "--device", "cuda"}), 2,
                         cuda_built() ? "--device cuda: 0 CUDA devices are visible"
                                      : "--device cuda: this quanta was built without CUDA");
  check_one_line_error(run_quanta({"train", "--device", "cuda:7"}), 2,
                       cuda_built() ? "CUDA devices are visible" : "built without CUDA");
  check_one_line_error(run_quanta({"train", "--resume"}), 2, "--resume needs --out DIR");
  check_one_line_error(run_quanta({"train", "--resume", "--out", dir.file("none")}), 1,
                       "checkpoint.safetensors: cannot open");
  check_one_line_error(run_quanta({"train", "--config", dir.file("missing.json")}), 2,
                       "missing.json");
  std::ofstream(dir.file("broken.json")) << "{\"lr\": ";
  check_one_line_error(run_quanta({"train", "--config", dir.file("broken.json")}), 1,
                       "broken.json: not valid JSON");
  std::ofstream(dir.file("typo.json")) << R"({"learning_rate": 0.1})";
  check_one_line_error(run_quanta({"train", "--config", dir.file("typo.json")}), 2,
                       "unknown key 'learning_rate'");
  std::ofstream(dir.file("type.json")) << R"({"quantizer": {"type": "vq", "decay": "x"}})";
  check_one_line_error(run_quanta({"train", "--config", dir.file("type.json")}), 2,
                       "quantizer option 'decay' must be a number");

  // No dataset: one line saying how to get it.
  check_one_line_error(run_quanta({"train", "--data", dir.path().string(), "--out", dir.file("o")}),
                       1, "apt-get install dataset-fashion-mnist");
  std::ofstream(dir.file("notes.txt")) << "hello";
  check_one_line_error(run_quanta({"eval", dir.file("notes.txt")}), 1, "notes.txt");
  check_one_line_error(run_quanta({"eval", dir.file("absent.safetensors")}), 1,
                       "absent.safetensors: cannot open");
  io::save_safetensors(dir.file("plain.safetensors"), {{"w", zeros({2})}});
  check_one_line_error(run_quanta({"eval", dir.file("plain.safetensors")}), 1,
                       "not a quanta training checkpoint");
  check_one_line_error(run_quanta({"decode", dir.file("plain.safetensors")}), 2,
                       "codes is required");
}

TEST_CASE("quanta train refuses a folder that holds a run unless --resume or --overwrite") {
  // Before, a second run into the same --out replaced the checkpoint and
  // truncated metrics.jsonl, and exited 0. Refused before any data is read.
  ScratchDir dir("train_refuse");
  const std::string run = dir.file("run");
  fs::create_directories(run);
  std::ofstream(run + "/metrics.jsonl") << "{\"kind\": \"train\", \"step\": 1}\n";
  const CliResult r = run_quanta({"train", "--steps", "1", "--out", run});
  check_one_line_error(r, 2, "--out " + run + " already holds a run (metrics.jsonl)");
  CHECK(contains(r.err, "continue it with --resume, or replace it with --overwrite"));
  CHECK(slurp(run + "/metrics.jsonl") == "{\"kind\": \"train\", \"step\": 1}\n");
  check_one_line_error(run_quanta({"train", "--resume", "--overwrite", "--out", run}), 2,
                       "--resume continues the run in --out, --overwrite replaces it");
  // --task classify alike (the same training loop, the same files).
  std::ofstream(run + "/checkpoint.safetensors") << "x";
  const CliResult c = run_quanta({"train", "--task", "classify", "--steps", "1", "--out", run});
  check_one_line_error(c, 2, "already holds a run (checkpoint.safetensors, metrics.jsonl)");
  CHECK(contains(c.err, "continue it with --resume, or replace it with --overwrite"));
  // --print-config writes nothing, so it is not refused.
  CHECK(run_quanta({"train", "--out", run, "--print-config"}).code == 0);
  // --dist-timeout is a flag of the process, not a setting of the run.
  const CliResult p = run_quanta({"train", "--dist-timeout", "30", "--print-config"});
  REQUIRE(p.code == 0);
  CHECK_FALSE(contains(p.out, "timeout"));
  // So is --fast-conv; without a GPU it changes nothing and says nothing.
  const CliResult fc = run_quanta({"train", "--fast-conv", "--print-config"});
  REQUIRE(fc.code == 0);
  CHECK(fc.out == run_quanta({"train", "--print-config"}).out);
  if (cuda_device_count() == 0) CHECK(fc.err.empty());
  if (!have_dataset()) return;
  // A start that failed before its first step leaves its header alone: the
  // corrected command runs without --overwrite.
  const std::string failed = dir.file("failed");
  fs::create_directories(failed);
  std::ofstream(failed + "/metrics.jsonl") << "{\"kind\": \"header\", \"step\": 0}\n";
  CHECK(run_quanta(tiny_train(failed, 1)).code == 0);
  const std::string real = dir.file("real");
  REQUIRE(run_quanta(tiny_train(real, 2)).code == 0);
  const std::string metrics = slurp(real + "/metrics.jsonl");
  check_one_line_error(run_quanta(tiny_train(real, 2)), 2,
                       "already holds a run (checkpoint.safetensors, metrics.jsonl)");
  CHECK(slurp(real + "/metrics.jsonl") == metrics);  // untouched
  const CliResult o = run_quanta(with(tiny_train(real, 3), {"--overwrite"}));
  CAPTURE(o.err);
  CHECK(o.code == 0);
  CHECK(records(real, "train").size() == 3);
}

TEST_CASE("one run per folder: a run into a folder that another run holds is refused, naming it") {
  // Before, two runs started into one --out at once both passed the check
  // for earlier files, both ran, and interleaved their records.
  ScratchDir dir("train_lock");
  const std::string run = dir.file("run");
  train::RunFolderLock held = train::lock_run_folder(run);
  REQUIRE(held.held());
  const std::string holder = "(pid " + std::to_string(::getpid()) + " on host ";
  const std::vector<std::vector<std::string>> commands = {
      {"train", "--steps", "1", "--out", run},
      {"train", "--task", "classify", "--steps", "1", "--out", run},
      {"finetune", dir.file("base.safetensors"), "--out", run},
  };
  for (const auto& args : commands) {
    CAPTURE(args[1]);
    const CliResult r = run_quanta(args);
    check_one_line_error(r, 2, "--out " + run + " is in use by another quanta run " + holder);
    CHECK(contains(r.err, "wait for it to end, or give another --out"));
  }
  CHECK_THROWS_WITH_AS(train::lock_run_folder(run), doctest::Contains(holder.c_str()),
                       std::invalid_argument);
  CHECK_FALSE(fs::exists(run + "/metrics.jsonl"));
  // A lock ends with its holder (a process that died holds none): the file
  // it leaves, naming the old holder, does not stand in the way.
  held = train::RunFolderLock();
  CHECK(train::lock_run_folder(run).held());
}

TEST_CASE("encode and decode refuse an --out that is one of their inputs") {
  // Before, `encode run/checkpoint.safetensors --out run/checkpoint.safetensors`
  // replaced the checkpoint with a codes file and exited 0.
  ScratchDir dir("train_same_file");
  const std::string ck = dir.file("checkpoint.safetensors"), codes = dir.file("codes.safetensors");
  std::ofstream(ck) << "a checkpoint";
  std::ofstream(codes) << "codes";
  const CliResult e = run_quanta({"encode", ck, "--out", ck});
  check_one_line_error(e, 2, "--out " + ck + " is the checkpoint this command reads");
  for (const std::string& out : {ck, codes}) {
    CAPTURE(out);
    const CliResult d = run_quanta({"decode", ck, codes, "--out", out});
    check_one_line_error(d, 2, "--out " + out + " is the ");
    CHECK(contains(d.err, "writing it would destroy that input; give another --out"));
  }
  CHECK(slurp(ck) == "a checkpoint");
  CHECK(slurp(codes) == "codes");
}

TEST_CASE("quanta train: a test split of 0 images is an error, not 'test mse n/a'") {
  ScratchDir dir("train_no_test");
  // 64 training images, 0 test images (plain IDX bytes read through gzread).
  auto write = [&](const std::string& name, const std::vector<int64_t>& dims) {
    data::IdxArray a;
    a.dims = dims;
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    a.data.assign(static_cast<std::size_t>(n), 7);
    const std::vector<uint8_t> bytes = data::idx_bytes(a);
    std::ofstream(dir.file(name), std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  };
  write("train-images-idx3-ubyte.gz", {64, 28, 28});
  write("train-labels-idx1-ubyte.gz", {64});
  write("t10k-images-idx3-ubyte.gz", {0, 28, 28});
  write("t10k-labels-idx1-ubyte.gz", {0});
  const CliResult r =
      run_quanta({"train", "--data", dir.path().string(), "--steps", "1", "--batch-size", "16",
                  "--hidden", "8", "--dim", "4", "--threads", "1", "--out", dir.file("run")});
  check_one_line_error(r, 1, "t10k-images-idx3-ubyte.gz: holds no images");
}

TEST_CASE("eval warns about and fails on a NaN codebook; decode and encode refuse it") {
  if (!have_dataset()) return;
  ScratchDir dir("nan_codebook");
  const std::string out = dir.file("run");
  REQUIRE(run_quanta(tiny_train(out, 1, {"--codebook-size", "16", "--kmeans-init=false"})).code ==
          0);
  io::SafetensorsFile f = io::load_safetensors(out + "/checkpoint.safetensors");
  std::string poisoned;
  for (auto& [name, t] : f.tensors)
    if (name.rfind("model.", 0) == 0 && name.find("embed") != std::string::npos &&
        is_floating(t.dtype()) && poisoned.empty()) {
      std::vector<float> v = t.to_vector<float>();
      v[0] = NAN;
      t = from_vector<float>(v, t.shape());
      poisoned = name;
    }
  REQUIRE_MESSAGE(!poisoned.empty(), "no codebook tensor (model.*embed*) in the checkpoint");
  const std::string bad = dir.file("nan.safetensors");
  io::save_safetensors(bad, f.tensors, f.metadata);

  const CliResult e = run_quanta({"eval", bad, "--limit", "16", "--png", dir.file("e.png")});
  CAPTURE(e.out);
  CAPTURE(e.err);
  CHECK(e.code == 1);
  CHECK(e.err.rfind("quanta: warning: ", 0) == 0);
  CHECK(contains(e.err, "'" + poisoned + "' holds NaN or Inf values"));
  CHECK(contains(e.err, "quanta: error: "));
  CHECK(contains(e.out, "test mse"));  // the figures are still shown
  io::save_safetensors(dir.file("codes.safetensors"),
                       {{"indices", zeros({1, 7, 7}, {.dtype = DType::i64})}});
  check_one_line_error(
      run_quanta({"decode", bad, dir.file("codes.safetensors"), "--out", dir.file("d.png")}), 1,
      "'" + poisoned + "' holds NaN or Inf values");
  check_one_line_error(
      run_quanta({"encode", bad, "--limit", "4", "--out", dir.file("c2.safetensors")}), 1,
      "holds NaN or Inf values");
}

TEST_CASE("quanta train --print-config shows the quantizer's resolved options") {
  ScratchDir dir("print_config");
  CliResult r = run_quanta({"train", "--quantizer", "rvq", "--print-config"});
  CAPTURE(r.err);
  REQUIRE(r.code == 0);
  const json q = json::parse(r.out)["quantizer"];
  CHECK(q["type"] == "rvq");
  CHECK(q["num_quantizers"] == 4);  // "4 levels of 512 codes" (docs/train.md)
  CHECK(q["codebook_size"] == 512);
  CHECK(q["quantize_dropout"] == false);
  CHECK(q["shared_codebook"] == false);
  CHECK(q["decay"] == 0.8);
  CHECK_FALSE(q.contains("codebook_dim"));  // derived from --dim, not a value
  // What it prints is a config file that resolves to itself.
  const std::string cfg = dir.file("rvq.json");
  std::ofstream(cfg) << r.out;
  CliResult again = run_quanta({"train", "--config", cfg, "--print-config"});
  CAPTURE(again.err);
  REQUIRE(again.code == 0);
  CHECK(json::parse(again.out) == json::parse(r.out));
  CliResult fsq = run_quanta({"train", "--quantizer", "fsq", "--print-config"});
  REQUIRE(fsq.code == 0);
  const json fsq_config = json::parse(fsq.out);
  CHECK(fsq_config["quantizer"]["levels"] == json{8, 8, 8});  // FSQ's recipe
  CHECK(fsq_config["model"]["dim"] == 3);
  CHECK(fsq_config["lr"] == 0.005);
  // Flags win over the recipe; the latent width follows the levels given.
  CliResult mine = run_quanta(
      {"train", "--quantizer", "fsq", "--levels", "8,5,5,5", "--lr", "0.001", "--print-config"});
  REQUIRE(mine.code == 0);
  const json mine_config = json::parse(mine.out);
  CHECK(mine_config["quantizer"]["levels"] == json{8, 5, 5, 5});
  CHECK(mine_config["model"]["dim"] == 4);
  CHECK(mine_config["lr"] == 0.001);
}

TEST_CASE("metrics.jsonl: a header per start, lr and elapsed_s; resume keeps the log window") {
  if (!have_dataset()) return;
  ScratchDir dir("metrics");
  // A log window of 4 steps; evaluation at each epoch's end only.
  auto run = [](const std::string& out, int steps, std::vector<std::string> extra = {}) {
    return run_quanta(
        set_flag(set_flag(tiny_train(out, steps, extra), "--log-every", "4"), "--eval-every", "0"));
  };
  const std::string a = dir.file("a"), b = dir.file("b");
  REQUIRE(run(a, 6).code == 0);
  REQUIRE(run(b, 2).code == 0);  // stops inside the window of steps 1 to 4
  CliResult r = run(b, 6, {"--resume"});
  CAPTURE(r.err);
  REQUIRE(r.code == 0);

  const std::vector<json> all = train::read_metrics(a + "/metrics.jsonl");
  REQUIRE(!all.empty());
  const json& header = all.front();
  CHECK(header["kind"] == "header");
  CHECK("quanta " + header["quanta_version"].get<std::string>() + "\n" ==
        run_quanta({"--version"}).out);
  CHECK(header["threads"] == 1);
  CHECK(header["device"] == "cpu");
  CHECK(header["resumed"] == false);
  CHECK(header["config"]["steps"] == 6);
  CHECK(header["config"]["quantizer"]["decay"] == 0.8);  // resolved, as --print-config
  double last = 0;
  for (const json& rec : all) {
    if (rec["kind"] == "header") continue;
    CAPTURE(rec.dump());
    CHECK(rec["lr"] == 0.002);
    REQUIRE(rec["elapsed_s"].is_number());
    CHECK(rec["elapsed_s"].get<double>() >= last);
    last = rec["elapsed_s"].get<double>();
  }

  const std::vector<json> headers = records(b, "header");
  REQUIRE(headers.size() == 2);
  CHECK(headers[1]["resumed"] == true);
  CHECK(headers[1]["step"] == 2);
  const std::vector<json> ta = records(a, "train"), tb = records(b, "train");
  REQUIRE(ta.size() == 2);  // steps 4 and 6
  REQUIRE(tb.size() == 3);  // steps 2 (where the first run ended), 4 and 6
  CHECK(tb[0]["step"] == 2);
  CHECK(tb[1]["step"] == 4);
  // The step-4 record averages steps 1 to 4 in both runs, bit for bit.
  CHECK(tb[1]["loss"].dump() == ta[0]["loss"].dump());
  CHECK(tb[1]["recon_mse"].dump() == ta[0]["recon_mse"].dump());
  CHECK(tb[2]["loss"].dump() == ta[1]["loss"].dump());
}

TEST_CASE("decode refuses codes another checkpoint made, unless --allow-other-checkpoint") {
  if (!have_dataset()) return;
  ScratchDir dir("decode_other");
  const std::string a = dir.file("a"), b = dir.file("b");
  REQUIRE(run_quanta(tiny_train(a, 2)).code == 0);
  REQUIRE(run_quanta(tiny_train(b, 2, {"--seed", "1"})).code == 0);
  const std::string ca = a + "/checkpoint.safetensors", cb = b + "/checkpoint.safetensors";
  const std::string codes = dir.file("codes.st");
  REQUIRE(run_quanta({"encode", ca, "--limit", "4", "--out", codes}).code == 0);
  CHECK(run_quanta({"decode", ca, codes, "--out", dir.file("a.png")}).code == 0);
  CliResult other = run_quanta({"decode", cb, codes, "--out", dir.file("b.png")});
  check_one_line_error(other, 1, "holds codes made with '" + ca + "'");
  CHECK(contains(other.err, "not with '" + cb + "'"));
  CHECK(contains(other.err, "--allow-other-checkpoint"));
  CHECK_FALSE(std::filesystem::exists(dir.file("b.png")));
  CHECK(run_quanta({"decode", cb, codes, "--out", dir.file("b.png"), "--allow-other-checkpoint"})
            .code == 0);
}

// sim runs the CPU's kernels behind a GPU's rules: a run there must give the
// CPU's losses and checkpoint bytes exactly, and any tensor a layer makes on
// the CPU beside its device tensors fails the run instead.

// The layout of the activations is how the run computes, not what it is:
// forced either way on the CPU and sim, the run's losses agree to rounding.
TEST_CASE("quanta train --conv-layout: channels first or last, the same run to rounding") {
  if (!have_dataset()) return;
  ScratchDir dir("layout");
  std::vector<double> reference;
  for (const char* device : {"cpu", "sim"})
    for (const char* layout : {"nhwc", "nchw"}) {
      const std::string out = dir.file(std::string(device) + "-" + layout);
      CAPTURE(out);
      CliResult r =
          run_quanta(with(tiny_train(out, 4, {}), {"--device", device, "--conv-layout", layout}));
      CAPTURE(r.err);
      REQUIRE(r.code == 0);
      std::vector<double> losses;
      for (const json& rec : records(out, "train")) losses.push_back(rec["loss"].get<double>());
      REQUIRE(!losses.empty());
      if (reference.empty()) reference = losses;
      REQUIRE(losses.size() == reference.size());
      for (std::size_t i = 0; i < losses.size(); ++i)
        CHECK(losses[i] == doctest::Approx(reference[i]).epsilon(1e-4));
    }
}

TEST_CASE("quanta train --device sim writes the CPU's losses and checkpoint bytes") {
  if (!have_dataset()) return;
  ScratchDir dir("sim");
  const std::vector<std::vector<std::string>> runs = {
      {},  // the default: vq with k-means init and dead-code replacement
      {"--quantizer", "none"},
      {"--quantizer", "fsq"},
      {"--quantizer", "lfq"},
      {"--quantizer", "rvq", "--num-quantizers", "3", "--codebook-size", "32", "--kmeans-init",
       "--quantize-dropout"},
      // Every other type at its recipe, and the reference examples' model.
      {"--quantizer", "grvq", "--num-quantizers", "2", "--codebook-size", "32"},
      {"--quantizer", "simvq"},
      {"--quantizer", "fsp"},
      {"--quantizer", "rfsq"},
      {"--quantizer", "rlfq"},
      {"--quantizer", "hvq", "--nested-dropout", "0.5"},
      {"--arch", "vqp-example", "--quantizer", "lfq", "--recon-loss", "l1"},
  };
  for (std::size_t k = 0; k < runs.size(); ++k) {
    const std::string name = runs[k].empty() ? "vq" : runs[k][1];
    CAPTURE(name);
    const std::string a = dir.file(name + "-cpu"), b = dir.file(name + "-sim");
    CliResult ra = run_quanta(with(tiny_train(a, 4, runs[k]), {"--device", "cpu"}));
    CliResult rb = run_quanta(with(tiny_train(b, 4, runs[k]), {"--device", "sim"}));
    CAPTURE(rb.err);
    REQUIRE(ra.code == 0);
    REQUIRE(rb.code == 0);
    const std::vector<json> la = records(a, "train"), lb = records(b, "train");
    REQUIRE(la.size() == lb.size());
    for (std::size_t i = 0; i < la.size(); ++i) CHECK(lb[i]["loss"].dump() == la[i]["loss"].dump());
    // The CPU never waits for a device; sim counts what a GPU would wait
    // for, and no family's step waits for anything: the losses are read once
    // per log window, k-means, EMA and dead codes stay on the device.
    CHECK(la.back()["host_syncs_per_step"].get<double>() == 0);
    const double syncs = lb.back()["host_syncs_per_step"].get<double>();
    MESSAGE(name << ": " << syncs << " host syncs per step on sim (steps 1-4)");
    CHECK(syncs == 0);
    const auto ta = io::load_safetensors(a + "/checkpoint.safetensors").tensors;
    const auto tb = io::load_safetensors(b + "/checkpoint.safetensors").tensors;
    REQUIRE(ta.size() == tb.size());
    for (std::size_t i = 0; i < ta.size(); ++i) {
      CAPTURE(ta[i].first);
      REQUIRE(tb[i].first == ta[i].first);
      REQUIRE(tb[i].second.nbytes() == ta[i].second.nbytes());
      CHECK(std::memcmp(tb[i].second.raw_data(), ta[i].second.raw_data(), ta[i].second.nbytes()) ==
            0);
    }
  }
}

// On sim (as on CUDA) the step's forward and backward are captured once,
// after two steps, and replayed: the run must be --no-graph's, byte for byte,
// through evaluations, an epoch's smaller last batch (captured anew, then the
// full batches again), k-means, dead codes and the layers' device draws (each
// replay draws its step's numbers). A step that draws on the host is never
// captured, and says so.
TEST_CASE("quanta train --device sim: the captured step replays --no-graph's bytes") {
  if (!have_dataset()) return;
  ScratchDir dir("graph");
  struct Run {
    std::vector<std::string> flags;
    bool captured;
  };
  const std::vector<Run> runs = {
      // vq with k-means init and dead-code replacement: the EMA and the
      // replacement (its permutations drawn on the device) in the graph.
      {{}, true},
      {{"--threshold-ema-dead-code", "0"}, true},
      {{"--quantizer", "fsq"}, true},
      {{"--quantizer", "lfq", "--entropy-loss-weight", "0.1"}, true},
      {{"--quantizer", "grvq", "--num-quantizers", "2", "--codebook-size", "32"}, true},
      {{"--quantizer", "hvq"}, true},
      {{"--precision", "bf16"}, true},
      // Device draws from the layers' own streams: replayed, each step its own.
      {{"--quantizer", "fsp"}, true},  // noise inside its bins while training
      {{"--threshold-ema-dead-code", "2", "--directional-reparam"}, true},
      // AdamW in the graph, its lr changing every step: read at each replay.
      {{"--lr-schedule", "cosine", "--warmup-steps", "4", "--weight-decay", "0.01"}, true},
      // A level count drawn on the host: never captured.
      {{"--quantizer", "rvq", "--quantize-dropout"}, false},
  };
  for (const Run& run : runs) {
    const std::string name = run.flags.empty() ? "vq" : run.flags.back();
    CAPTURE(name);
    const std::string a = dir.file(name + "-graph"), b = dir.file(name + "-eager");
    // 200 images in batches of 32: the epoch's last step (7) has 8.
    const std::vector<std::string> base =
        with(set_flag(tiny_train(a, 9, run.flags), "--limit-train", "200"), {"--device", "sim"});
    CliResult ra = run_quanta(base);
    CliResult rb = run_quanta(with(set_flag(base, "--out", b), {"--no-graph"}));
    CAPTURE(ra.err);
    REQUIRE(ra.code == 0);
    REQUIRE(rb.code == 0);
    CHECK(contains(ra.out, "step 3 captured as a graph of ") == run.captured);
    // Launch budgets: the default vq step held 82 kernels and copies on sim
    // when its budget was set (the EMA, k-means' state and the dead-code
    // replacement included), where constants' fills, the replacement's
    // clamps, range mapping and composed choice and writes, the loop's
    // stacking, the EMA's composed lerps and smoothing, the commitment
    // loss's composed scalars and a one-table codebook's stacking copies had
    // made 173; this fsq step held 100 once its
    // group norm was one kernel pair. A new launch a layer or a codebook
    // fails them.
    if (name == "vq" || name == "fsq") {
      const std::size_t at = ra.out.find("captured as a graph of ");
      REQUIRE(at != std::string::npos);
      const long nodes = std::stol(ra.out.substr(at + 23));
      MESSAGE("the captured ", name, " VQ-VAE step holds ", nodes, " kernels and copies");
      CHECK(nodes <= (name == "vq" ? 86 : 105));
    }
    CHECK_FALSE(contains(ra.out, "the state update after it draws on the host"));
    CHECK(contains(ra.out, "the step draws random numbers") == !run.captured);
    CHECK_FALSE(contains(rb.out, "captured"));
    CHECK(records(a, "header").at(0)["graph"] == true);
    CHECK(records(b, "header").at(0)["graph"] == false);
    const std::vector<json> la = records(a, "train"), lb = records(b, "train");
    REQUIRE(la.size() == 9);
    REQUIRE(lb.size() == 9);
    for (std::size_t i = 0; i < la.size(); ++i) CHECK(la[i]["loss"].dump() == lb[i]["loss"].dump());
    CHECK(la.back()["host_syncs_per_step"].get<double>() == 0);
    const std::vector<json> ea = records(a, "eval"), eb = records(b, "eval");
    REQUIRE(ea.size() == eb.size());
    for (std::size_t i = 0; i < ea.size(); ++i)
      CHECK(ea[i]["test_mse"].dump() == eb[i]["test_mse"].dump());
    CHECK(quanta::test::slurp(a + "/checkpoint.safetensors") ==
          quanta::test::slurp(b + "/checkpoint.safetensors"));
  }
}

// --profile: the kernel calls of some steps, counted and timed per table
// entry (engine/profile/call_profile.h), on the log and as a metrics
// record; the steps run as called, so the run is --no-graph's, byte for byte.
TEST_CASE("quanta train --profile: where the steps' time went, and the same bytes") {
  if (!have_dataset()) return;
  ScratchDir dir("profile");
  const std::string a = dir.file("profiled"), b = dir.file("plain");
  const std::vector<std::string> base = with(tiny_train(a, 5), {"--device", "sim"});
  CliResult ra = run_quanta(with(base, {"--profile", "2"}));
  CliResult rb = run_quanta(with(set_flag(base, "--out", b), {"--no-graph"}));
  CAPTURE(ra.err);
  REQUIRE(ra.code == 0);
  REQUIRE(rb.code == 0);
  CHECK(contains(ra.out,
                 "profile of steps 3 to 4 (run as called; each call timed on the host, "
                 "the device's work not waited for)"));
  CHECK(contains(ra.out, "table calls a step; the device was done "));
  CHECK(contains(ra.out, "engine.conv:conv2d_weight_grad"));
  CHECK(contains(ra.out, "(cpu)"));  // the batch gathered on the host
  CHECK_FALSE(contains(ra.out, "captured"));
  CHECK(records(a, "header").at(0)["graph"] == false);
  const std::vector<json> p = records(a, "profile");
  REQUIRE(p.size() == 1);
  CHECK(p[0]["step"] == 4);
  CHECK(p[0]["first_step"] == 3);
  CHECK(p[0]["steps"] == 2);
  CHECK(p[0]["timing"] == "host");
  CHECK(p[0]["device"] == "sim:0");
  CHECK(p[0]["table_calls_per_step"].get<double>() > 50);
  CHECK(p[0]["host_ms_per_step"].get<double>() >= p[0]["table_ms_per_step"].get<double>());
  double conv_calls = 0, sum_ms = 0;
  for (const json& e : p[0]["entries"]) {
    // The conv entry's rows, one a kind (forward, input and weight gradients).
    if (e["name"].get<std::string>().rfind("engine.conv:", 0) == 0 && e["device"] == "sim")
      conv_calls += e["calls_per_step"].get<double>();
    sum_ms += e["ms_per_step"].get<double>();
  }
  // The VQ-VAE's convolutions forward and backward, every step the same.
  CHECK(conv_calls >= 12);
  CHECK(conv_calls == std::floor(conv_calls));
  CHECK(sum_ms >= p[0]["table_ms_per_step"].get<double>() * 0.999);
  CHECK(quanta::test::slurp(a + "/checkpoint.safetensors") ==
        quanta::test::slurp(b + "/checkpoint.safetensors"));
  // A run shorter than the warm-up and the window profiles its last steps;
  // device timing on the CPU, which queues nothing, times the calls alone.
  const std::string c = dir.file("short");
  CliResult rc =
      run_quanta(with(tiny_train(c, 2), {"--profile", "5", "--profile-timing", "device"}));
  CAPTURE(rc.err);
  REQUIRE(rc.code == 0);
  CHECK(contains(rc.out,
                 "profile of steps 1 to 2 (run as called; each call timed until the "
                 "device was done with it)"));
  CHECK_FALSE(contains(rc.out, "after the last step's calls"));
  REQUIRE(records(c, "profile").size() == 1);
  CHECK(records(c, "profile")[0]["timing"] == "device");
  // --profile-trace: the window's calls as a Chrome trace, one event a call
  // (as many as the record counts), a span a step; a file that cannot be
  // written is a line in the log, not a failed run.
  const std::string t = dir.file("traced"), trace = dir.file("trace.json");
  CliResult rt = run_quanta(
      with(tiny_train(t, 5), {"--device", "sim", "--profile", "2", "--profile-trace", trace}));
  CAPTURE(rt.err);
  REQUIRE(rt.code == 0);
  CHECK(contains(rt.out, "profile trace: " + trace + " ("));
  const json tj = json::parse(quanta::test::slurp(trace));
  double want_calls = 0;
  const std::vector<json> traced = records(t, "profile");
  REQUIRE(traced.size() == 1);
  for (const json& e : traced[0]["entries"]) want_calls += e["calls_per_step"].get<double>() * 2;
  int64_t calls = 0;
  std::vector<std::string> steps;
  for (const json& e : tj["traceEvents"]) {
    if (e["ph"] != "X") continue;
    if (e["cat"] == "step") {
      steps.push_back(e["name"]);
      continue;
    }
    ++calls;
    CHECK(e["dur"].get<double>() >= 0);
    CHECK(e["ts"].get<double>() >= 0);
  }
  CHECK(double(calls) == want_calls);
  CHECK(steps == std::vector<std::string>{"step 3", "step 4"});
  CHECK(tj["otherData"]["device"] == "sim:0");
  CliResult unwritable = run_quanta(
      with(tiny_train(dir.file("unwritable"), 3),
           {"--profile", "1", "--profile-trace", dir.file("no/such/folder/trace.json")}));
  CHECK(unwritable.code == 0);
  CHECK(contains(unwritable.out, "profile trace: could not write "));
  // Mistakes.
  CliResult bad = run_quanta(with(tiny_train(dir.file("bad"), 2), {"--profile-timing", "device"}));
  CHECK(bad.code == 2);
  CHECK(contains(bad.err, "--profile-timing requires --profile"));
  bad = run_quanta(with(tiny_train(dir.file("bad"), 2), {"--profile-trace", trace}));
  CHECK(bad.code == 2);
  CHECK(contains(bad.err, "--profile-trace requires --profile"));
  bad = run_quanta(with(tiny_train(dir.file("bad"), 2), {"--profile", "0"}));
  CHECK(bad.code == 2);
  CHECK(contains(bad.err, "--profile"));
  bad = run_quanta(
      with(tiny_train(dir.file("bad"), 2), {"--profile", "2", "--profile-timing", "gpu"}));
  CHECK(bad.code == 2);
  CHECK(contains(bad.err, "--profile-timing"));
}

TEST_CASE("eval, encode and decode --device sim: the CPU's figures, codes and pictures") {
  if (!have_dataset()) return;
  ScratchDir dir("sim_tools");
  auto bytes = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  // The default vq, and hvq, whose level codes travel on the latent's grid.
  for (const std::string type : {"vq", "hvq"}) {
    CAPTURE(type);
    const std::string run = dir.file(type), ckpt = run + "/checkpoint.safetensors";
    REQUIRE(run_quanta(tiny_train(run, 4, {"--quantizer", type})).code == 0);
    const std::string codes_cpu = dir.file(type + "-codes-cpu.st");
    std::map<std::string, json> evals;
    for (const std::string device : {"cpu", "sim"}) {
      CAPTURE(device);
      const std::string at = type + "-" + device;
      const CliResult e = run_quanta({"eval", ckpt, "--json", "--limit", "64", "--device", device,
                                      "--png", dir.file(at + "-eval.png")});
      const CliResult c = run_quanta({"encode", ckpt, "--limit", "16", "--device", device, "--out",
                                      dir.file(type + "-codes-" + device + ".st")});
      const CliResult d = run_quanta(
          {"decode", ckpt, codes_cpu, "--device", device, "--out", dir.file(at + "-decoded.png")});
      CAPTURE(e.err);
      CAPTURE(c.err);
      CAPTURE(d.err);
      REQUIRE(e.code == 0);
      REQUIRE(c.code == 0);
      REQUIRE(d.code == 0);
      evals[device] = json::parse(e.out);
    }
    for (const char* key : {"test_mse", "codebook_usage", "perplexity", "test_samples",
                            "codebook_usage_per_level", "perplexity_per_level"})
      CHECK(evals["sim"].value(key, json()).dump() == evals["cpu"].value(key, json()).dump());
    CHECK(bytes(dir.file(type + "-sim-eval.png")) == bytes(dir.file(type + "-cpu-eval.png")));
    const Tensor a = io::load_safetensors(codes_cpu).tensors.at(0).second;
    const Tensor b = io::load_safetensors(dir.file(type + "-codes-sim.st")).tensors.at(0).second;
    CHECK(a.to_vector<int64_t>() == b.to_vector<int64_t>());
    CHECK(bytes(dir.file(type + "-sim-decoded.png")) == bytes(dir.file(type + "-cpu-decoded.png")));
  }
  const std::string ckpt = dir.file("vq") + "/checkpoint.safetensors";
  for (const char* command : {"eval", "encode", "decode"}) {
    std::vector<std::string> args = {command, ckpt};
    if (std::string(command) == "decode") args.push_back(dir.file("vq-codes-cpu.st"));
    if (std::string(command) != "eval") args.insert(args.end(), {"--out", dir.file("x")});
    args.insert(args.end(), {"--device", "gpu"});
    check_one_line_error(run_quanta(args), 2,
                         "--device must be cpu, cuda, cuda:N, sim or sim:N, got 'gpu'");
  }
}

TEST_CASE("a diverging run names its first non-finite step, on the CPU and on sim alike") {
  if (!have_dataset()) return;
  ScratchDir dir("diverge");
  // sim reads the losses once per log window (here after step 4), yet names
  // the step the CPU, which reads every step, names.
  std::string message;
  for (const std::string device : {"cpu", "sim"}) {
    CAPTURE(device);
    std::vector<std::string> args = with(tiny_train(dir.file(device), 8, {"--quantizer", "none"}),
                                         {"--lr", "1e6", "--device", device});
    *(std::find(args.begin(), args.end(), "--log-every") + 1) = "4";
    CliResult r = run_quanta(args);
    CAPTURE(r.err);
    CHECK(r.code != 0);
    CHECK(r.err.find("diverged") != std::string::npos);
    CHECK(r.err.find(" at step ") != std::string::npos);
    if (message.empty())
      message = r.err;
    else
      CHECK(r.err == message);
  }
}
