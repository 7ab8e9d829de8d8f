// `quanta train --nproc N`: the real binary starts N ranks through quanta
// launch; with the same seed and global batch, 1 and 2 ranks (and 3, with an
// uneven split of every batch) end with the same model, and every rank's
// codebook is the same (only rank 0 writes, so this is checked by the
// quantizer-sync suite; here the end result is compared with one process).
#include <doctest/doctest.h>
#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "cli_runner.h"
#include "engine/factory.h"
#include "engine/io/safetensors.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/reductions.h"
#include "engine/ops/view.h"
#include "train/outputs.h"

using namespace quanta;
using namespace quanta::test;
using nlohmann::json;

namespace {

CliResult run_train(const std::string& out, const std::string& nproc,
                    const std::vector<std::string>& extra) {
  // 4 steps of a global batch of 31 (2 ranks: 15 + 16, 3 ranks: 10 + 10 + 11).
  std::vector<std::string> args = {
      "train", "--steps",  "4",   "--limit-train", "512", "--limit-test", "64", "--batch-size",
      "31",    "--hidden", "8",   "--dim",         "4",   "--eval-every", "4",  "--threads",
      "1",     "--nproc",  nproc, "--out",         out};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_quanta(args);
}

std::map<std::string, Tensor> tensors(const std::string& dir) {
  std::map<std::string, Tensor> out;
  for (auto& [name, t] : io::load_safetensors(dir + "/checkpoint.safetensors").tensors)
    out[name] = t;
  return out;
}

double max_rel(const Tensor& a, const Tensor& b) {
  const Tensor x = to_dtype(a, DType::f64), y = to_dtype(b, DType::f64);
  return max(abs(x - y)).item() / std::max(1e-30, max(abs(y)).item());
}

}  // namespace

TEST_CASE("quanta train --nproc 2 and 3 equal one process (same seed, same global batch)") {
  if (!have_dataset()) return;
  // vq (EMA statistics reduced across ranks), fsq, lfq (cross-rank entropy
  // means). f32 training on real images is discontinuous in its inputs: a
  // VQ argmin, a k-means assignment or an FSQ rounding that is near-tied can
  // flip under the 1e-7 differences of a different reduction order (batch
  // shapes change the GEMM blocking), and Adam's first steps turn a flipped
  // tiny gradient into a full step, so k-means, dead-code expiry and quantize
  // dropout are proven equal to one process in f64 by tests/quant/sync,
  // where no such near-tie can hide; here the end-to-end run is compared on
  // configurations whose decisions are not near-tied. For the same reason the
  // scalar runs leave out their recipes' latent GroupNorm and spherical codes:
  // both normalise away a direction (a channel that is positive everywhere
  // under a one-channel group, a latent's length), so some parameters get a
  // gradient that is zero but for rounding, which Adam scales up to a step
  // whose sign the reduction order decides. Both are per-sample maps, equal
  // across ranks by construction: the recipes' runs match one process's
  // losses at 1e-5 and their model parameters to that noise (measured: up to
  // 6e-3 of the largest; their Adam moments are the noise and are skipped).
  struct Config {
    std::vector<std::string> flags;
    double parameter_tolerance;
    // A codebook's EMA statistics (names holding "_codebook."); 0: the
    // parameters'.
    double codebook_tolerance = 0;
  };
  const std::vector<Config> configs = {
      {{"--quantizer", "vq", "--kmeans-init=false", "--threshold-ema-dead-code", "0"}, 1e-5},
      {{"--quantizer", "fsq", "--levels", "5,5,5,5", "--latent-norm-groups", "0", "--lr", "0.002"},
       1e-5},
      {{"--quantizer", "lfq", "--codebook-size", "16", "--latent-norm-groups", "0",
        "--spherical=false", "--entropy-loss-weight", "0.1"},
       1e-5},
      // HierarchicalVQ with a codebook per level (its recipe) and with one
      // shared by the levels (pooled level by level across the ranks), with
      // dead codes and nested dropout. Not k-means: on one CPU (2026-12-02,
      // a Xeon with AMX) its first-batch clustering flipped a near-tied
      // assignment between 1 and 2 ranks (step 2's aux loss 1.6% apart, the
      // weights 2e-3), on others it did not; tests/quant/sync proves it in f64.
      {{"--quantizer", "hvq", "--scales", "1,2,4,7", "--codebook-size", "32", "--nested-dropout",
        "0.5", "--kmeans-init=false"},
       1e-5},
      // The shared codebook assigns each level's vectors in turn, and on that
      // CPU one of them sat on a near-tie: the ranks' losses stayed within
      // 1e-7 of one process's at every step, but one code's count (and so
      // its EMA) moved by one assignment's weight, 7e-4 of the largest.
      {{"--quantizer", "hvq", "--scales", "1,2,4,7", "--codebook-size", "32", "--nested-dropout",
        "0.5", "--kmeans-init=false", "--shared-codebook"},
       1e-5,
       2e-3},
      {{"--quantizer", "fsq", "--levels", "5,5,5,5"}, 2e-2},
      {{"--quantizer", "lfq", "--codebook-size", "16"}, 2e-2}};
  for (const auto& [extra, tolerance, codebook_tolerance] : configs) {
    const std::string q = extra[1] + (tolerance > 1e-5 ? "_recipe" : "") +
                          (extra.back() == "--shared-codebook" ? "_shared" : "");
    CAPTURE(q);
    ScratchDir dir("train_dist_" + q);
    const CliResult one = run_train(dir.file("one"), "1", extra);
    CAPTURE(one.err);
    REQUIRE(one.code == 0);
    const auto want = tensors(dir.file("one"));
    for (const char* n : {"2", "3"}) {
      CAPTURE(n);
      const CliResult r = run_train(dir.file(std::string("n") + n), n, extra);
      CAPTURE(r.out);
      CAPTURE(r.err);
      REQUIRE(r.code == 0);
      CHECK(contains(r.out, "[rank 0] done: 4 steps"));
      CHECK_FALSE(contains(r.out, "[rank 1] done"));  // only rank 0 reports and writes
      const auto got = tensors(dir.file(std::string("n") + n));
      REQUIRE(got.size() == want.size());
      for (const auto& [name, t] : want) {
        CAPTURE(name);
        REQUIRE(got.count(name) == 1);
        if (t.numel() == 0 || !dtype_info(t.dtype()).arithmetic) continue;
        // The recipes' Adam moments hold the rounding noise itself.
        if (tolerance > 1e-5 && name.rfind("optim.", 0) == 0) continue;
        const bool codebook = name.find("._codebook.") != std::string::npos;
        // Adam's second moment holds squared gradients: twice their relative
        // rounding (oneDNN's weight gradient of the one-channel transposed
        // layer, which sums each weight's 6000 terms in its own order, left
        // fsq's at 1.008e-5 on 2 ranks).
        const double squared = name.find(".exp_avg_sq") != std::string::npos ? 2 : 1;
        CHECK(max_rel(got.at(name), t) <=
              squared * (codebook && codebook_tolerance > 0 ? codebook_tolerance : tolerance));
      }
      // The logged losses agree step by step (all-reduced shares).
      const auto a = train::read_metrics(dir.file("one") + "/metrics.jsonl");
      const auto b = train::read_metrics(dir.file(std::string("n") + n) + "/metrics.jsonl");
      REQUIRE(a.size() == b.size());
      for (std::size_t i = 0; i < a.size(); ++i)
        if (a[i]["kind"] == "train")
          CHECK(b[i]["loss"].get<double>() ==
                doctest::Approx(a[i]["loss"].get<double>()).epsilon(1e-5));
    }
  }
}

// --profile on several ranks: each rank profiles its steps, rank 0 reports,
// and the collectives (DataParallel's gradient all_reduce, the quantizer's
// sync, the loop's stop flag) are rows beside the kernel tables'.
TEST_CASE("quanta train --nproc 2 --profile: the collectives' rows beside the tables'") {
  if (!have_dataset()) return;
  ScratchDir dir("train_dist_profile");
  const CliResult r = run_train(dir.file("run"), "2", {"--profile", "2"});
  CAPTURE(r.out);
  CAPTURE(r.err);
  REQUIRE(r.code == 0);
  CHECK(contains(r.out, "[rank 0] profile of steps 3 to 4 (run as called;"));
  CHECK_FALSE(contains(r.out, "[rank 1] profile"));
  CHECK(contains(r.out, "dist.all_reduce"));
  std::vector<json> profiles;
  for (json& rec : train::read_metrics(dir.file("run") + "/metrics.jsonl"))
    if (rec["kind"] == "profile") profiles.push_back(std::move(rec));
  REQUIRE(profiles.size() == 1);
  double all_reduces = 0, ms = 0;
  for (const json& e : profiles[0]["entries"])
    if (e["name"] == "dist.all_reduce") {
      all_reduces = e["calls_per_step"];
      ms = e["ms_per_step"];
    }
  CHECK(all_reduces >= 2);  // the gradients' buckets and the stop flag at least
  CHECK(all_reduces == std::floor(all_reduces));
  CHECK(ms > 0);
}

TEST_CASE("quanta train --nproc: a world size that disagrees with the launcher is one clear line") {
  if (!have_dataset()) return;
  ScratchDir dir("train_dist_bad");
  // Under quanta launch -n 2 the launcher's world is 2; --nproc 3 disagrees.
  const CliResult r =
      run_quanta({"launch", "-n", "2", "--", std::getenv("QUANTA_EXE"), "train", "--steps", "1",
                  "--limit-train", "64", "--nproc", "3", "--out", dir.file("run")});
  CHECK(r.code != 0);
  CHECK(contains(r.out + r.err, "--nproc 3 but the launcher (torchrun) started 2 ranks"));
}

namespace {

// Waits (at most `seconds`) until `pred` holds; returns whether it did.
template <class Pred>
bool wait_for(Pred pred, double seconds) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(int64_t(seconds * 1000));
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// A process that has exited: gone, or a zombie nobody reaped yet.
bool is_gone(pid_t pid) {
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const auto close = line.rfind(')');
  return close == std::string::npos || (close + 2 < line.size() && line[close + 2] == 'Z');
}

}  // namespace

TEST_CASE("quanta launch: SIGTERM passed on to ranks that stop cleanly exits 0") {
  // A scheduler's SIGTERM (Slurm, Kubernetes preemption) went on to the
  // ranks, they stopped cleanly, and quanta launch still exited 143: it must
  // say 0 when every rank exited 0, else report the ranks' failure.
  for (const bool clean : {true, false}) {
    CAPTURE(clean);
    const std::string body = clean ? "trap 'exit 0' TERM; echo ready; while :; do sleep 0.05; done"
                                   : "echo ready; exec sleep 30";
    CliProcess p({"launch", "-n", "2", "--", "/bin/sh", "-c", body});
    const bool ready = wait_for(
        [&] {
          const std::string out = slurp(p.dir.file("out"));
          return contains(out, "[rank 0] ready") && contains(out, "[rank 1] ready");
        },
        30);
    CHECK(ready);
    REQUIRE(::kill(p.pid, SIGTERM) == 0);
    const CliResult r = p.wait();
    CAPTURE(r.out);
    CAPTURE(r.err);
    CHECK(contains(r.err, "[launch] got signal 15; stopping the ranks"));
    CHECK(r.code == (clean ? 0 : 128 + SIGTERM));
  }
}

TEST_CASE("quanta launch: ranks die with their launcher (SIGKILL leaves none running)") {
  ScratchDir dir("launch_pdeathsig");
  // Each rank writes its pid, then becomes a 30-second sleep.
  CliProcess p({"launch", "-n", "2", "--", "/bin/sh", "-c",
                "echo $$ > " + dir.file("pid.") + "$RANK.tmp && mv " + dir.file("pid.") +
                    "$RANK.tmp " + dir.file("pid.") + "$RANK; exec sleep 30"});
  REQUIRE(
      wait_for([&] { return fs::exists(dir.file("pid.0")) && fs::exists(dir.file("pid.1")); }, 30));
  std::vector<pid_t> ranks;
  for (const char* r : {"pid.0", "pid.1"}) ranks.push_back(std::stoi(slurp(dir.file(r))));
  REQUIRE(::kill(p.pid, SIGKILL) == 0);
  CHECK(p.wait().code == 128 + SIGKILL);
  const bool all_gone =
      wait_for([&] { return std::all_of(ranks.begin(), ranks.end(), is_gone); }, 5);
  CHECK_MESSAGE(all_gone, "ranks still running after their launcher was killed");
  for (pid_t r : ranks) ::kill(r, SIGKILL);  // bounded even when the check failed
}

TEST_CASE("quanta launch --dist-timeout sets QUANTA_DIST_TIMEOUT for every rank") {
  const CliResult r = run_quanta({"launch", "-n", "2", "--dist-timeout", "7", "--", "/bin/sh", "-c",
                                  "echo timeout=$QUANTA_DIST_TIMEOUT"});
  CAPTURE(r.err);
  CHECK(r.code == 0);
  CHECK(contains(r.out, "[rank 0] timeout=7"));
  CHECK(contains(r.out, "[rank 1] timeout=7"));
  // A program that cannot start is still one clear line.
  const CliResult bad = run_quanta({"launch", "-n", "1", "--", "/nonexistent/program"});
  CHECK(bad.code == 1);
  CHECK(contains(bad.err, "cannot start '/nonexistent/program'"));
}

TEST_CASE("quanta train --nproc 2: SIGTERM writes the checkpoint and exits 0") {
  if (!have_dataset()) return;
  ScratchDir dir("train_dist_sigterm");
  const std::string out = dir.file("run");
  CliProcess p({"train", "--steps",      "100000", "--limit-train",  "256",    "--limit-test",
                "32",    "--batch-size", "16",     "--hidden",       "8",      "--dim",
                "4",     "--log-every",  "1",      "--eval-every",   "100000", "--threads",
                "1",     "--nproc",      "2",      "--dist-timeout", "60",     "--out",
                out});
  const bool stepping = wait_for(
      [&] {
        return fs::exists(out + "/metrics.jsonl") &&
               train::read_metrics(out + "/metrics.jsonl").size() >= 2;
      },
      120);
  CHECK(stepping);
  REQUIRE(::kill(p.pid, SIGTERM) == 0);
  const CliResult r = p.wait();
  CAPTURE(r.out);
  CAPTURE(r.err);
  CHECK(r.code == 0);
  CHECK(contains(r.out, "[rank 0] interrupted by SIGTERM after step"));
  const io::SafetensorsHeader h = io::read_safetensors_header(out + "/checkpoint.safetensors");
  CHECK(std::stoll(h.metadata.at("step")) >= 2);
}
