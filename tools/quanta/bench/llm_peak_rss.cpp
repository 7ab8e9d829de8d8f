// The llm suite's memory row: the peak resident memory of a QLoRA step in a
// process of its own. The bench process holds other rows' models and the
// CPU block cache's blocks, so its own peak says nothing about one step;
// a fresh `quanta bench llm` started with QUANTA_BENCH_LLM_PEAK_RSS builds
// the step alone, runs it twice (the second step reuses the first's
// memory, as training does) and reports its peak resident memory (VmHWM).
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "../peak_memory.h"
#include "bench.h"
#include "engine/cpu/parallel.h"
#include "quanta.h"

namespace quanta::cli {
namespace {

constexpr const char* kChildVariable = "QUANTA_BENCH_LLM_PEAK_RSS";

// VmHWM, not getrusage's maximum: that one keeps what the bench process
// held when it forked this child.
double own_peak_rss_mb() { return double(peak_rss_bytes()) / (1024.0 * 1024.0); }

}  // namespace

bool run_as_peak_rss_child(const BenchOptions& o) {
  if (!std::getenv(kChildVariable)) return false;
  Generator gen(321);
  const LlmWorkload step = qlora_workload(o, bench_llm_config(o), gen);
  step.run();
  step.run();
  std::printf("peak_rss_mb %.1f\n", own_peak_rss_mb());
  std::fflush(stdout);
  return true;
}

double qlora_peak_rss_mb(const BenchOptions& o) {
  const std::string size = o.small ? "small" : o.large ? "large" : "full";
  const std::string threads = std::to_string(num_threads());
  std::vector<std::string> args = {"quanta", "bench", "llm", "--size", size, "--threads", threads};
  int out[2];
  if (pipe(out) != 0) throw std::runtime_error("peak RSS child: pipe failed");
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("peak RSS child: fork failed");
  if (pid == 0) {
    dup2(out[1], 1);
    close(out[0]);
    close(out[1]);
    setenv(kChildVariable, "1", 1);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv("/proc/self/exe", argv.data());
    _exit(127);
  }
  close(out[1]);
  std::string text;
  char buf[256];
  ssize_t got = 0;
  while ((got = read(out[0], buf, sizeof buf)) > 0) text.append(buf, size_t(got));
  close(out[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  const size_t at = text.find("peak_rss_mb ");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || at == std::string::npos)
    throw std::runtime_error(
        "the peak RSS child (" + std::string(kChildVariable) + "=1 quanta bench llm) failed: " +
        (WIFEXITED(status) ? "exit status " + std::to_string(WEXITSTATUS(status))
                           : std::string("killed by a signal")));
  return std::stod(text.substr(at + 12));
}

}  // namespace quanta::cli
