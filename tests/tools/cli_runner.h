#pragma once
// Runs the `quanta` binary (QUANTA_EXE) as a child process, no shell, and
// collects its exit code, stdout and stderr; temporary folders for outputs.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "support/spawn.h"
#include "support/temp_dir.h"

extern char** environ;

namespace quanta::test {

namespace fs = std::filesystem;

/** A fresh folder under the system temp dir, removed at scope exit. */
using ScratchDir = quanta::testing::TempDir;

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/** How a run ended. */
struct CliResult {
  int code = -1;  // exit code, or 128 + signal
  std::string out;
  std::string err;
};

/** A started quanta process writing to files in its own scratch folder. */
struct CliProcess {
  pid_t pid = 0;
  ScratchDir dir{"cli_io"};

  explicit CliProcess(const std::vector<std::string>& args) {
    const char* exe = std::getenv("QUANTA_EXE");
    REQUIRE_MESSAGE(exe != nullptr, "set QUANTA_EXE to the quanta binary (meson test does)");
    std::vector<std::string> argv = {exe};
    argv.insert(argv.end(), args.begin(), args.end());
    pid = quanta::testing::spawn_process(argv, {}, dir.file("out"), dir.file("err"));
  }
  /** Waits for the exit and returns what the process printed. */
  CliResult wait() {
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    CliResult r;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    r.out = slurp(dir.file("out"));
    r.err = slurp(dir.file("err"));
    return r;
  }
};

/** Runs quanta with `args` to completion. */
inline CliResult run_quanta(const std::vector<std::string>& args) {
  CliProcess p(args);
  return p.wait();
}

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

/** Exit code `code`, nothing on stdout, one line on stderr naming `what`. */
inline void check_one_line_error(const CliResult& r, int code, const std::string& what) {
  CAPTURE(r.out);
  CAPTURE(r.err);
  CHECK(r.code == code);
  CHECK(r.out.empty());
  CHECK(r.err.rfind("quanta: error: ", 0) == 0);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(contains(r.err, what));
}

/** Where Debian's dataset-fashion-mnist puts the IDX files. */
inline const char* const kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

/** True when Fashion-MNIST is installed; otherwise says which runs are not
 * tested (tools/install-deps.sh installs it, so CI always has it). */
inline bool have_dataset() {
  if (fs::exists(fs::path(kFashionMnistDir) / "train-images-idx3-ubyte.gz")) return true;
  MESSAGE(
      "Fashion-MNIST not installed (apt-get install dataset-fashion-mnist): "
      "training runs not tested");
  return false;
}

/** `a` followed by `b`: a command line with a few more flags. */
inline std::vector<std::string> with(std::vector<std::string> a,
                                     const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

/** `args` with the value after `flag` (which it holds) replaced by `value`. */
inline std::vector<std::string> set_flag(std::vector<std::string> args, const std::string& flag,
                                         const std::string& value) {
  const auto at = std::find(args.begin(), args.end(), flag);
  REQUIRE(at != args.end());
  REQUIRE(at + 1 != args.end());
  *(at + 1) = value;
  return args;
}

/** A `quanta train` of `steps` steps small enough for a test (256 training
 * images, 64 test images, hidden 8, dim 4, a log line per step, an
 * evaluation and checkpoint every 3 steps, one thread) into `out`. */
inline std::vector<std::string> tiny_train(const std::string& out, int steps,
                                           const std::vector<std::string>& extra = {}) {
  return with({"train",
               "--steps",
               std::to_string(steps),
               "--limit-train",
               "256",
               "--limit-test",
               "64",
               "--batch-size",
               "32",
               "--hidden",
               "8",
               "--dim",
               "4",
               "--log-every",
               "1",
               "--eval-every",
               "3",
               "--threads",
               "1",
               "--out",
               out},
              extra);
}

}  // namespace quanta::test
