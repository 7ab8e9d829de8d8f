// Checkpoints are never torn: `quanta train` and `quanta finetune --model`,
// each killed (SIGKILL) at 50 points spread over a run, leave either no
// checkpoint or a whole one (and, for the fine-tune, a whole adapter folder
// or none), and a resumed run ends on the uninterrupted run's bytes. A suite
// of its own: 100 killed runs and a few whole ones as processes, about 40 s
// here and several times that under the sanitizers.
#include <doctest/doctest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cli_runner.h"
#include "engine/io/safetensors.h"
#include "llm/data/token_file.h"
#include "llm/model/model_folder.h"
#include "llm/qlora/peft_folder.h"
#include "quanta.h"
#include "support/test_data.h"

using namespace quanta;
using namespace quanta::test;

namespace {

// Steps of a killed run, each ending with a checkpoint: short, since the
// suite runs each command about 30 times (several times slower under the
// sanitizers).
constexpr int kSteps = 6;

void check_same(const std::string& a, const std::string& b) {
  const auto x = io::load_safetensors(a).tensors, y = io::load_safetensors(b).tensors;
  REQUIRE(x.size() == y.size());
  for (std::size_t t = 0; t < x.size(); ++t) {
    CAPTURE(x[t].first);
    CHECK(x[t].first == y[t].first);
    CHECK(x[t].second.to_vector<double>() == y[t].second.to_vector<double>());
  }
}

// Runs `args(out)` to the end once, then 50 times killed at a time drawn
// over that run's length. Each killed folder that holds a checkpoint must
// load it whole at a step of the run and pass `check_folder`; the first two
// that stopped short are resumed and must end on the whole run's bytes in
// every file of `compared`.
void kill_and_resume(const std::string& tag,
                     const std::function<std::vector<std::string>(const std::string&)>& args,
                     const std::function<void(const std::string&)>& check_folder,
                     const std::vector<std::string>& compared) {
  ScratchDir dir(tag);
  const std::string ref = dir.file("ref");
  const auto t0 = std::chrono::steady_clock::now();
  const CliResult whole_run = run_quanta(args(ref));
  REQUIRE_MESSAGE(whole_run.code == 0, whole_run.err);
  const auto full_us =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  std::mt19937 rng(2026);  // the kill times repeat run to run
  std::uniform_int_distribution<int64_t> when(0, full_us);
  int whole = 0, resumed = 0;
  for (int i = 0; i < 50; ++i) {
    CAPTURE(i);
    const std::string out = dir.file("k" + std::to_string(i));
    CliProcess p(args(out));
    std::this_thread::sleep_for(std::chrono::microseconds(when(rng)));
    ::kill(p.pid, SIGKILL);
    p.wait();
    const std::string ck = out + "/checkpoint.safetensors";
    check_folder(out);
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
    const CliResult r = run_quanta(with(args(out), {"--resume"}));
    CAPTURE(r.err);
    REQUIRE(r.code == 0);
    for (const std::string& file : compared) {
      CAPTURE(file);
      check_same(ref + "/" + file, out + "/" + file);
    }
    // What the killed writer left half written, the resumed one removed.
    for (const auto& entry : fs::recursive_directory_iterator(out)) {
      CAPTURE(entry.path().string());
      CHECK(entry.path().filename().string().find(".tmp.") == std::string::npos);
    }
    ++resumed;
  }
  MESSAGE(tag << ": " << whole << " of 50 killed runs held a checkpoint; " << resumed
              << " resumed");
  CHECK(whole >= 10);  // the kills spread over the run
  CHECK(resumed >= 1);
}

std::string test_model(const std::string& name) {
  return quanta::testing::test_data("llm/models/" + name);
}

}  // namespace

TEST_CASE(
    "SIGKILL anywhere leaves a whole checkpoint or none, and --resume continues bit for bit") {
  if (!have_dataset()) return;
  // A checkpoint every step: kills land before, during and after writes.
  kill_and_resume(
      "sigkill_train",
      [](const std::string& out) { return set_flag(tiny_train(out, kSteps), "--eval-every", "1"); },
      [](const std::string&) {}, {"checkpoint.safetensors"});
}

TEST_CASE(
    "finetune --model killed anywhere leaves a whole checkpoint and adapter folder, or none") {
  ScratchDir data("sigkill_ft_data");
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < 800; ++i) ids.push_back((i * 7) % 60);
  const std::string tokens = data.file("train.bin");
  llm::write_token_file(tokens, ids, llm::TokenWidth::u16);
  const std::string model = test_model("llama_gqa");
  kill_and_resume(
      "sigkill_finetune",
      [&](const std::string& out) {
        return std::vector<std::string>{"finetune", "--model",      model, "--data",
                                        tokens,     "--seq-len",    "16",  "--steps",
                                        "6",        "--batch-size", "2",   "--eval-every",
                                        "1",        "--threads",    "1",   "--lora-dropout",
                                        "0.1",      "--out",        out};
      },
      // The adapter folder, when there is one, is whole: its config reads and
      // its tensors fit a model converted with it.
      [&](const std::string& out) {
        const std::string adapters = out + "/adapters";
        if (!fs::exists(adapters)) return;
        CHECK(fs::exists(adapters + "/" + llm::kAdapterConfigFile));
        CHECK(fs::exists(adapters + "/" + llm::kAdapterWeightsFile));
        if (!fs::exists(adapters + "/" + llm::kAdapterConfigFile)) return;
        std::shared_ptr<llm::CausalLM> base = llm::load_causal_lm(model);
        CHECK_NOTHROW(llm::apply_peft_adapters(*base, adapters, model));
      },
      {"checkpoint.safetensors", "adapters/adapter_model.safetensors"});
}
