// The `quanta` command run as a user runs it: a child process with its exit
// code, stdout and stderr. Meson passes the binary in QUANTA_EXE.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "quanta.h"
#include "support/temp_dir.h"

extern char** environ;

namespace fs = std::filesystem;
using namespace quanta;

using testing::TempDir;

namespace {


std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Result {
  int code = -1;  // exit code, or 128 + signal
  std::string out;
  std::string err;
};

// Runs quanta with `args`, no shell involved.
Result quanta_cli(const std::vector<std::string>& args) {
  const char* exe = std::getenv("QUANTA_EXE");
  REQUIRE_MESSAGE(exe != nullptr, "set QUANTA_EXE to the quanta binary (meson test does)");
  TempDir dir;
  const std::string out = dir.file("out"), err = dir.file("err");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<std::string> argv_s = {exe};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, exe, &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  REQUIRE_MESSAGE(rc == 0, "cannot run " << exe);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  Result r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// One line on stderr naming `what`, nothing on stdout.
void check_one_line_error(const Result& r, int code, const std::string& what) {
  CAPTURE(r.err);
  CHECK(r.code == code);
  CHECK(r.out.empty());
  CHECK(r.err.rfind("quanta: error: ", 0) == 0);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(contains(r.err, what));
}

}  // namespace

TEST_CASE("quanta --help and --version") {
  Result help = quanta_cli({"--help"});
  CHECK(help.code == 0);
  CHECK(contains(help.out, "inspect"));
  CHECK(contains(help.out, "bench"));
  Result bench_help = quanta_cli({"bench", "--help"});
  CHECK(bench_help.code == 0);
  CHECK(contains(bench_help.out, "A [M, K] by B [K, N]"));
  Result version = quanta_cli({"--version"});
  CHECK(version.code == 0);
  const char* want = std::getenv("QUANTA_VERSION");
  REQUIRE(want != nullptr);
  CHECK(version.out == std::string("quanta ") + want + "\n");
}

TEST_CASE("quanta rejects bad usage with exit code 2") {
  check_one_line_error(quanta_cli({}), 2, "a subcommand is required");
  check_one_line_error(quanta_cli({"--bogus"}), 2, "--bogus");
  check_one_line_error(quanta_cli({"frobnicate"}), 2, "unknown subcommand 'frobnicate'");
  check_one_line_error(quanta_cli({"inspect"}), 2, "file is required");
  check_one_line_error(quanta_cli({"inspect", "x.safetensors", "--bogus"}), 2, "--bogus");
  check_one_line_error(quanta_cli({"bench"}), 2, "suite is required");
  check_one_line_error(quanta_cli({"bench", "nope"}), 2,
                       "unknown bench suite 'nope' (suites: dist, engine, nf4, quant)");
  check_one_line_error(quanta_cli({"bench", "engine", "--repeat", "0"}), 2, "--repeat");
  check_one_line_error(quanta_cli({"bench", "engine", "--size", "huge"}), 2, "--size");
}

TEST_CASE("quanta inspect lists tensors and metadata") {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  io::save_safetensors(path,
                       {{"encoder.weight", zeros({2, 3})},
                        {"codebook", ones({4}, {.dtype = DType::f16})},
                        {"step", scalar(7, {.dtype = DType::i64})}},
                       {{"framework", "quanta"}, {"epoch", "3"}});
  SUBCASE("table") {
    Result r = quanta_cli({"inspect", path});
    CAPTURE(r.out);
    CAPTURE(r.err);
    CHECK(r.code == 0);
    CHECK(r.err.empty());
    CHECK(contains(r.out, path));
    CHECK(contains(r.out, "encoder.weight  F32    [2, 3]"));
    CHECK(contains(r.out, "codebook"));
    CHECK(contains(r.out, "step"));
    CHECK(contains(r.out, "total: 3 tensors, 11 elements, 40 bytes"));
    CHECK(contains(r.out, "framework = quanta"));
    CHECK(contains(r.out, "epoch = 3"));
  }
  SUBCASE("json") {
    Result r = quanta_cli({"inspect", path, "--json"});
    REQUIRE(r.code == 0);
    const auto j = nlohmann::json::parse(r.out);
    CHECK(j["file"] == path);
    REQUIRE(j["tensors"].size() == 3);
    CHECK(j["tensors"][0]["name"] == "codebook");  // sorted by name
    CHECK(j["tensors"][0]["dtype"] == "F16");
    CHECK(j["tensors"][0]["bytes"] == 8);
    CHECK(j["tensors"][1]["name"] == "encoder.weight");
    CHECK(j["tensors"][1]["shape"] == nlohmann::json::array({2, 3}));
    CHECK(j["tensors"][2]["shape"] == nlohmann::json::array());
    CHECK(j["total_elements"] == 11);
    CHECK(j["total_bytes"] == 40);
    CHECK(j["metadata"]["framework"] == "quanta");
    CHECK(j["metadata"]["epoch"] == "3");
  }
}

TEST_CASE("quanta inspect fails with one line naming the file") {
  TempDir dir;
  const std::string path = dir.file("broken.safetensors");
  std::ofstream(path, std::ios::binary) << std::string("\x10\0\0\0\0\0\0\0{\"a\":", 14);
  check_one_line_error(quanta_cli({"inspect", path}), 1, path);
  check_one_line_error(quanta_cli({"inspect", path}), 1, "exceeds");
  check_one_line_error(quanta_cli({"inspect", dir.file("missing.safetensors")}), 1,
                       "missing.safetensors: cannot open");
  check_one_line_error(quanta_cli({"inspect", dir.path().string()}), 1, "is a directory");
}

TEST_CASE("quanta bench engine reports five rows against their floors") {
  const std::set<std::string> names = {"matmul_1024", "matmul_4096x4096x256", "add", "exp",
                                       "sum"};
  SUBCASE("json") {
    Result r =
        quanta_cli({"bench", "engine", "--json", "--repeat", "1", "--size", "small"});
    CAPTURE(r.err);
    REQUIRE(r.code == 0);
    const auto rows = nlohmann::json::parse(r.out);
    REQUIRE(rows.is_array());
    std::set<std::string> seen;
    for (const auto& row : rows) {
      CHECK(row.size() == 4);
      seen.insert(row["name"].get<std::string>());
      for (const char* key : {"ms", "floor_ms", "ratio"}) {
        REQUIRE(row[key].is_number());
        CHECK(row[key].get<double>() > 0);
      }
      CHECK(row["ratio"].get<double>() ==
            doctest::Approx(row["ms"].get<double>() / row["floor_ms"].get<double>()));
    }
    CHECK(seen == names);
    CHECK(rows.size() == names.size());
  }
  SUBCASE("table") {
    Result r = quanta_cli(
        {"bench", "engine", "--repeat", "1", "--size", "small", "--threads", "1"});
    REQUIRE(r.code == 0);
    CHECK(contains(r.out, "1 threads"));
    CHECK(contains(r.out, "floor_ms"));
    CHECK(contains(r.out, "ratio"));
    for (const auto& n : names) CHECK(contains(r.out, "\n" + n + " "));
  }
}
