// Checkpoints are never torn: `quanta train` killed (SIGKILL) at 50 points
// spread over a run leaves either no checkpoint or a whole one, and a
// resumed run ends on the uninterrupted run's bytes. A suite of its own: 50
// killed runs and a few whole ones as processes, about 20 s here and about
// six times that under the sanitizers.
#include <doctest/doctest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cli_runner.h"
#include "engine/io/safetensors.h"
#include "quanta.h"

using namespace quanta;
using namespace quanta::test;

namespace {
// Steps of the killed run, each ending with a checkpoint: short, since the
// suite runs it about 30 times (several times slower under the sanitizers).
constexpr int kSteps = 6;
}  // namespace

TEST_CASE(
    "SIGKILL anywhere leaves a whole checkpoint or none, and --resume continues bit for bit") {
  if (!have_dataset()) return;
  ScratchDir dir("sigkill");
  // A checkpoint every step: kills land before, during and after writes.
  auto run_args = [](const std::string& out) {
    return set_flag(tiny_train(out, kSteps), "--eval-every", "1");
  };
  const std::string ref = dir.file("ref");
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE(run_quanta(run_args(ref)).code == 0);
  const auto full_us =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  const auto want = io::load_safetensors(ref + "/checkpoint.safetensors").tensors;
  std::mt19937 rng(2026);  // the kill times repeat run to run
  std::uniform_int_distribution<int64_t> when(0, full_us);
  int whole = 0, resumed = 0;
  for (int i = 0; i < 50; ++i) {
    CAPTURE(i);
    const std::string out = dir.file("k" + std::to_string(i));
    CliProcess p(run_args(out));
    std::this_thread::sleep_for(std::chrono::microseconds(when(rng)));
    ::kill(p.pid, SIGKILL);
    p.wait();
    const std::string ck = out + "/checkpoint.safetensors";
    if (!fs::exists(ck)) continue;  // killed before the first checkpoint
    // Whole: it loads (sizes, header and offsets checked), at a step of the run.
    const io::SafetensorsFile f = io::load_safetensors(ck);
    const int64_t step = std::stoll(f.metadata.at("step"));
    CHECK(step >= 1);
    CHECK(step <= kSteps);
    ++whole;
    if (step == kSteps || resumed >= 2) continue;
    // The dead run's folder lock is gone with it; the resumed run ends on
    // the uninterrupted run's bytes.
    const CliResult r = run_quanta(with(run_args(out), {"--resume"}));
    CAPTURE(r.err);
    REQUIRE(r.code == 0);
    const auto got = io::load_safetensors(ck).tensors;
    REQUIRE(got.size() == want.size());
    for (std::size_t t = 0; t < got.size(); ++t) {
      CAPTURE(got[t].first);
      CHECK(got[t].second.to_vector<double>() == want[t].second.to_vector<double>());
    }
    ++resumed;
  }
  MESSAGE(whole << " of 50 killed runs held a checkpoint; " << resumed << " resumed");
  CHECK(whole >= 10);  // the kills spread over the run
  CHECK(resumed >= 1);
}
