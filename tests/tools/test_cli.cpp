// The `quanta` command run as a user runs it: a child process with its exit
// code, stdout and stderr. Meson passes the binary in QUANTA_EXE.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cli_runner.h"
#include "engine/cpu/gemm_bf16.h"
#include "quanta.h"
#include "support/temp_dir.h"

extern char** environ;

namespace fs = std::filesystem;
using namespace quanta;

using quanta::testing::TempDir;
using namespace quanta::test;

namespace {

// tests/data: QUANTA_TEST_DATA when set (meson sets it for the library
// suites), else beside this source file. __FILE__ is relative to the build
// directory, the parent of the quanta binary's folder.
fs::path test_data() {
  if (const char* env = std::getenv("QUANTA_TEST_DATA")) return env;
  const fs::path here = fs::path(__FILE__).parent_path().parent_path() / "data";
  std::vector<fs::path> tries{here};
  if (const char* exe = std::getenv("QUANTA_EXE"); exe && here.is_relative())
    tries.push_back(fs::path(exe).parent_path().parent_path() / here);
  for (const fs::path& p : tries)
    if (fs::is_directory(p / "reference-vectors")) return p;
  FAIL("cannot find tests/data: set QUANTA_TEST_DATA");
  return {};
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

}  // namespace

TEST_CASE("quanta --help and --version") {
  CliResult help = run_quanta({"--help"});
  CHECK(help.code == 0);
  CHECK(contains(help.out, "inspect"));
  CHECK(contains(help.out, "bench"));
  CliResult bench_help = run_quanta({"bench", "--help"});
  CHECK(bench_help.code == 0);
  CHECK(contains(bench_help.out, "A [M, K] by B [K, N]"));
  CliResult version = run_quanta({"--version"});
  CHECK(version.code == 0);
  const char* want = std::getenv("QUANTA_VERSION");
  REQUIRE(want != nullptr);
  CHECK(version.out == std::string("quanta ") + want + "\n");
}

TEST_CASE("every subcommand's --help has examples, readable types and its defaults") {
  for (const char* sub : {"train", "eval", "encode", "decode", "inspect", "bench", "parity",
                          "quantize", "finetune", "merge", "launch"}) {
    CAPTURE(sub);
    CliResult r = run_quanta({sub, "--help"});
    CHECK(r.code == 0);
    CHECK(contains(r.out, "Examples:\n  quanta "));
    // Defaults come from the values (CLI11 shows "=VALUE"), never as text.
    CHECK_FALSE(contains(r.out, "(default 8)"));
    CHECK_FALSE(contains(r.out, "(default 64)"));
    CHECK_FALSE(contains(r.out, "(default 300)"));
    CHECK_FALSE(contains(r.out, "1099511627776"));  // ranges read "in [1, 2^40]"
    CHECK_FALSE(contains(r.out, "{true}"));
  }
  CliResult quantize = run_quanta({"quantize", "--help"});
  CHECK(contains(quantize.out, "TEXT=quanta"));
  CHECK(contains(quantize.out, "INT=64"));
  CliResult launch = run_quanta({"launch", "--help"});
  CHECK(contains(launch.out, "INT:in [1, 2^10]=1"));
  CliResult finetune = run_quanta({"finetune", "--help"});
  CHECK(contains(finetune.out, "--steps INT:in [1, 2^40]=300"));
  CHECK(contains(finetune.out, "--lr FLOAT:in (0, 1e+06]=0.001"));
  CHECK(contains(finetune.out, "--dist-timeout SECONDS:in (0, "));
  CliResult train = run_quanta({"train", "--help"});
  CHECK(contains(train.out, "--batch-size INT:in [1, 2^30]=64"));
  CHECK(contains(train.out, "--lr FLOAT:in (0, 1e+06]=0.002"));
  CHECK(contains(train.out, "--codebook-size INT "));
  CHECK(contains(train.out, "--decay FLOAT "));
  CHECK(contains(train.out, "--levels INT,INT,... "));
  CHECK(contains(train.out, "--kmeans-init "));
  CHECK_FALSE(contains(train.out, "--codebook-size TEXT"));
}

TEST_CASE("quanta rejects bad usage with exit code 2") {
  check_one_line_error(run_quanta({}), 2, "a subcommand is required");
  check_one_line_error(run_quanta({"--bogus"}), 2, "--bogus");
  check_one_line_error(run_quanta({"frobnicate"}), 2, "unknown subcommand 'frobnicate'");
  check_one_line_error(run_quanta({"inspect"}), 2, "file is required");
  check_one_line_error(run_quanta({"inspect", "x.safetensors", "--bogus"}), 2, "--bogus");
  check_one_line_error(run_quanta({"bench"}), 2, "suite is required");
  check_one_line_error(run_quanta({"bench", "nope"}), 2,
                       "unknown bench suite 'nope' (suites: dist, engine, llm, nf4, quant, train)");
  check_one_line_error(run_quanta({"bench", "engine", "--repeat", "0"}), 2, "--repeat");
  check_one_line_error(run_quanta({"bench", "engine", "--size", "huge"}), 2, "--size");
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
    CliResult r = run_quanta({"inspect", path});
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
    CliResult r = run_quanta({"inspect", path, "--json"});
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
  check_one_line_error(run_quanta({"inspect", path}), 1, path);
  check_one_line_error(run_quanta({"inspect", path}), 1, "exceeds");
  check_one_line_error(run_quanta({"inspect", dir.file("missing.safetensors")}), 1,
                       "missing.safetensors: cannot open");
  // A folder is read as a model folder: this one holds no weights.
  check_one_line_error(run_quanta({"inspect", dir.path().string()}), 1,
                       "holds neither model.safetensors nor model.safetensors.index.json");
}

TEST_CASE("quanta inspect refuses a FIFO at once instead of waiting for a writer") {
  TempDir dir;
  const std::string fifo = dir.file("pipe.safetensors");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  // If quanta waits in open(), a writer arriving after 20 s lets it go on;
  // that it had to come is the failure (rather than a hung suite).
  std::atomic<bool> done{false}, had_to_unblock{false};
  std::thread unblocker([&] {
    for (int i = 0; i < 200 && !done; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (done) return;
    const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);  // fails with no reader
    if (fd >= 0) {
      had_to_unblock = true;
      ::close(fd);
    }
  });
  const CliResult r = run_quanta({"inspect", fifo});
  done = true;
  unblocker.join();
  CHECK_FALSE(had_to_unblock);
  check_one_line_error(r, 1, "is not a regular file");
}

// The main job's convolutions, a row each in bench engine on every device.
const std::vector<std::string> kConvRows = {
    "conv_enc1_1x28_k4s2", "conv_enc2_32x14_k4s2", "conv_enc3_32x7_k3",    "conv_enc4_32x7_k1",
    "conv_dec1_16x7_k3",   "convT_dec2_32x7_k4s2", "convT_dec3_32x14_k4s2"};

TEST_CASE("quanta bench engine reports its rows against their floors") {
  std::set<std::string> names = {"matmul_1024",
                                 "matmul_4096x4096x256",
                                 "matmul_3136x16x4",
                                 "matmul_3136x4x16",
                                 "matmul_1568x512x32",
                                 "add",
                                 "exp",
                                 "sum",
                                 "sum_dim1",
                                 "sum_dim0",
                                 "transpose",
                                 "add_bf16",
                                 "exp_bf16",
                                 "group_norm_fsq_latent",
                                 "group_norm_fsq_latent_fwd_bwd"};
  names.insert(kConvRows.begin(), kConvRows.end());
  // bf16 products against f32 ones (size small), and each convolution with
  // oneDNN's kernels against ours, where oneDNN is built in.
  if (cpu::bf16_products_built()) {
    names.insert({"matmul_bf16_128x64x128", "matmul_bf16_128x128x64"});
    for (const std::string& conv : kConvRows) names.insert(conv + "_onednn");
  }
  SUBCASE("json") {
    CliResult r = run_quanta({"bench", "engine", "--json", "--repeat", "1", "--size", "small"});
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
    CliResult r =
        run_quanta({"bench", "engine", "--repeat", "1", "--size", "small", "--threads", "1"});
    REQUIRE(r.code == 0);
    CHECK(contains(r.out, "1 threads"));
    CHECK(contains(r.out, "floor_ms"));
    CHECK(contains(r.out, "ratio"));
    for (const auto& n : names) CHECK(contains(r.out, "\n" + n + " "));
  }
}

TEST_CASE("quanta spins briefly in OpenMP waits unless the environment names a policy") {
  // The command restarts itself once with GOMP_SPINCOUNT=1000
  // (tools/quanta/wait_policy.h); a policy the user set is kept.
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  const char* spins = std::getenv("GOMP_SPINCOUNT");
  const std::string saved_policy = policy ? policy : "", saved_spins = spins ? spins : "";
  auto header = [] {
    CliResult r = run_quanta({"bench", "engine", "--repeat", "1", "--size", "small"});
    REQUIRE(r.code == 0);
    return r.out.substr(0, r.out.find('\n'));
  };
  unsetenv("OMP_WAIT_POLICY");
  unsetenv("GOMP_SPINCOUNT");
  CHECK(contains(header(), "(OpenMP waits: spincount 1000)"));
  setenv("OMP_WAIT_POLICY", "active", 1);
  CHECK(contains(header(), "(OpenMP waits: active)"));
  unsetenv("OMP_WAIT_POLICY");
  setenv("GOMP_SPINCOUNT", "50000", 1);
  CHECK(contains(header(), "(OpenMP waits: spincount 50000)"));
  unsetenv("GOMP_SPINCOUNT");
  if (policy) setenv("OMP_WAIT_POLICY", saved_policy.c_str(), 1);
  if (spins) setenv("GOMP_SPINCOUNT", saved_spins.c_str(), 1);
}

TEST_CASE("quanta bench train times a step of each model against its FLOPs") {
  CliResult r = run_quanta({"bench", "train", "--json", "--repeat", "1", "--size", "small"});
  CAPTURE(r.err);
  REQUIRE(r.code == 0);
  const auto rows = nlohmann::json::parse(r.out);
  std::set<std::string> seen;
  for (const auto& row : rows) {
    seen.insert(row["name"].get<std::string>());
    CHECK(row["ms"].get<double>() > 0);
    CHECK(row["floor_ms"].get<double>() > 0);
  }
  CHECK(seen == std::set<std::string>{"train_step_vqvae_vq", "train_step_vqvae_none",
                                      "train_step_vqvae_fsq", "train_step_classifier",
                                      "train_step_qlora"});
}

// sim runs the CPU's kernels under a GPU's rules: its rows count what a step
// asks of the host, which is what a GPU's queue would wait for.
TEST_CASE("quanta bench train --device sim counts each step's host syncs and copies") {
  CliResult r = run_quanta(
      {"bench", "train", "--device", "sim", "--json", "--repeat", "1", "--size", "small"});
  CAPTURE(r.err);
  REQUIRE(r.code == 0);
  const auto rows = nlohmann::json::parse(r.out);
  // The five steps, the three VQ-VAE steps as graphs, and those graphs
  // channels last against channels first.
  REQUIRE(rows.size() == 11);
  for (const auto& row : rows) {
    const std::string name = row["name"].get<std::string>();
    CAPTURE(name);
    CHECK(row["ms"].get<double>() > 0);
    const double syncs = row["host_syncs_per_step"].get<double>();
    CHECK(row["copies_per_step"].get<double>() >= syncs);
    MESSAGE(name << ": " << syncs << " host syncs per step on sim");
    // Only the VQ step's dead-code replacement still reads the device (the
    // expired counts and positions it draws, docs/gpu-runs.md).
    if (name == "train_step_vqvae_vq" || contains(name, "train_step_vqvae_vq_graph"))
      CHECK(syncs <= 4);
    else
      CHECK(syncs == 0);
    // A graph row: its floor is the same step launched kernel by kernel on
    // sim (a _graph_nhwc row's, the graph channels first); each replay
    // uploads its batch first.
    if (contains(name, "_graph")) {
      CHECK(row["floor_ms"].get<double>() > 0);
      CHECK(row["copies_per_step"].get<double>() >= 1);
    }
  }
  CliResult text =
      run_quanta({"bench", "train", "--device", "sim", "--repeat", "1", "--size", "small"});
  CHECK(contains(text.out, "syncs   copies"));
  check_one_line_error(run_quanta({"bench", "engine", "--device", "sim"}), 2,
                       "the engine suite times the CPU or a GPU, and sim runs the CPU's kernels");
}

// --device cuda: where no GPU is, one line saying why and success (scripts
// run it everywhere); on a GPU, every row measured or unavailable with its
// error, never a failed command.
TEST_CASE("quanta bench engine/train/quant/nf4/llm --device cuda: GPU rows, or one line why not") {
  check_one_line_error(run_quanta({"bench", "engine", "--device", "gpu"}), 2,
                       "--device must be cpu, cuda or cuda:N, got 'gpu'");
  check_one_line_error(
      run_quanta({"bench", "dist", "--device", "cuda"}), 2,
      "the dist suite runs on the CPU only (engine, llm, nf4, quant, train run on CUDA)");
  if (cuda_device_count() == 0) {
    for (const char* suite : {"engine", "train", "quant", "nf4", "llm"}) {
      CAPTURE(suite);
      CliResult r = run_quanta({"bench", suite, "--device", "cuda", "--size", "small"});
      CHECK(r.code == 0);
      CHECK(r.err.empty());
      CHECK(std::count(r.out.begin(), r.out.end(), '\n') == 1);
      CHECK(contains(r.out, std::string("quanta bench ") + suite + " --device cuda: skipped: "));
      if (!cuda_built()) CHECK(contains(r.out, "this quanta was built without CUDA"));
      CliResult j = run_quanta({"bench", suite, "--device", "cuda", "--json"});
      CHECK(j.code == 0);
      CHECK(j.out == "[]\n");  // still JSON for a reader of stdout
      CHECK(contains(j.err, "skipped: "));
    }
    MESSAGE("GPU rows not run: no CUDA device");
    return;
  }
  std::set<std::string> engine_rows = {"add_bf16",
                                       "exp_bf16",
                                       "add",
                                       "add_broadcast_row",
                                       "mul_broadcast_col",
                                       "exp",
                                       "sum",
                                       "sum_dim1",
                                       "sum_dim0",
                                       "amax_dim1",
                                       "permute_0213",
                                       "layer_norm_dim1",
                                       "group_norm_channels_last",
                                       "matmul_1024",
                                       "matmul_4096x4096x256",
                                       "matmul_1024_bf16",
                                       "matmul_4096x4096x256_bf16",
                                       "matmul_1024_f16",
                                       "matmul_4096x4096x256_f16",
                                       "small_add_x256"};
  engine_rows.insert(kConvRows.begin(), kConvRows.end());
  const std::set<std::string> train_rows = {"train_step_vqvae_vq",
                                            "train_step_vqvae_none",
                                            "train_step_vqvae_fsq",
                                            "train_step_classifier",
                                            "train_step_qlora",
                                            "train_step_vqvae_vq_graph",
                                            "train_step_vqvae_none_graph",
                                            "train_step_vqvae_fsq_graph",
                                            "train_step_vqvae_vq_graph_nhwc",
                                            "train_step_vqvae_none_graph_nhwc",
                                            "train_step_vqvae_fsq_graph_nhwc"};
  // The quantizer rows: every one has its kernels, so every one must run.
  const std::set<std::string> quant_rows = {
      "vq_nearest_8192x256_k1024",          "vq_nearest_8192x256_k1024_cosine",
      "vq_nearest_8192x256_k16384",         "vq_nearest_8192x256_k16384_cosine",
      "vq_code_statistics_65536x256_k1024", "vq_code_statistics_65536x256_k1024_one_code"};
  const std::set<std::string> nf4_rows = {"nf4_dequantize",
                                          "nf4_dequantize_bf16",
                                          "nf4_gemv_8192_b1",
                                          "nf4_gemv_8192_b1_staged",
                                          "nf4_gemv_8192_b1_unstaged",
                                          "nf4_gemv_8192_b1_fixed",
                                          "nf4_gemv_8192_b1_bf16_unstaged",
                                          "nf4_gemv_8192_b1_bf16_fixed",
                                          "nf4_gemv_8192_b1_staged_graph",
                                          "nf4_gemv_8192_b1_unstaged_graph",
                                          "nf4_gemv_8192_b1_fixed_graph",
                                          "nf4_gemv_8192_b4_staged",
                                          "nf4_gemv_8192_b4_unstaged",
                                          "nf4_linear_8192_b512"};
  for (const auto& [suite, names] :
       {std::pair{"engine", engine_rows}, std::pair{"train", train_rows},
        std::pair{"quant", quant_rows}, std::pair{"nf4", nf4_rows}}) {
    CAPTURE(suite);
    CliResult r = run_quanta(
        {"bench", suite, "--device", "cuda", "--json", "--repeat", "1", "--size", "small"});
    CAPTURE(r.err);
    REQUIRE(r.code == 0);
    const auto rows = nlohmann::json::parse(r.out);
    std::set<std::string> seen;
    for (const auto& row : rows) {
      const std::string name = row["name"].get<std::string>();
      CAPTURE(name);
      seen.insert(name);
      if (row.contains("unavailable")) {
        MESSAGE(name << " unavailable: " << row["unavailable"].get<std::string>());
        CHECK(!row["unavailable"].get<std::string>().empty());
        CHECK(row["ms"].is_null());
        continue;
      }
      CHECK(row["ms"].get<double>() > 0);
      CHECK(row["floor_ms"].get<double>() > 0);
    }
    CHECK(seen == names);
    // The f32 elementwise, reduction and GEMM rows have kernels: they run.
    for (const auto& row : rows)
      if (suite == std::string("engine") && !contains(row["name"].get<std::string>(), "_bf16") &&
          !contains(row["name"].get<std::string>(), "_f16") &&
          !contains(row["name"].get<std::string>(), "conv"))
        CHECK_MESSAGE(!row.contains("unavailable"), row["name"].get<std::string>());
    if (suite == std::string("quant") || suite == std::string("nf4"))
      for (const auto& row : rows)
        CHECK_MESSAGE(!row.contains("unavailable"), row["name"].get<std::string>());
    // The VQ-VAE without a quantizer trains on CUDA (quanta train --device cuda).
    if (suite == std::string("train"))
      for (const auto& row : rows)
        if (row["name"] == "train_step_vqvae_none") CHECK(!row.contains("unavailable"));
  }
  CliResult table =
      run_quanta({"bench", "engine", "--device", "cuda", "--repeat", "1", "--size", "small"});
  REQUIRE(table.code == 0);
  CHECK(contains(table.out, ", on cuda:0"));
  CHECK(contains(table.out, "\nsum_dim0 "));
}

TEST_CASE("quanta parity: PASS on a reference case, FAIL on a perturbed copy") {
  const std::string ref =
      (test_data() / "reference-vectors" / "vq_euclidean_ste.safetensors").string();
  TempDir dir;
  // The same case with one expected tensor moved: 0.5 added to quantized[0].
  io::SafetensorsFile file = io::load_safetensors(ref);
  double scale = 0;
  for (auto& [name, t] : file.tensors)
    if (name == "quantized") {
      std::vector<float> v = t.to_vector<float>();
      v[0] += 0.5f;
      for (float e : v) scale = std::max(scale, double(std::abs(e)));
      t = from_vector<float>(v, t.shape());
    }
  REQUIRE(scale > 0);
  const std::string bad = dir.file("perturbed.safetensors");
  io::save_safetensors(bad, file.tensors, file.metadata);

  SUBCASE("text") {
    const CliResult ok = run_quanta({"parity", ref});
    CAPTURE(ok.out);
    CAPTURE(ok.err);
    CHECK(ok.code == 0);
    CHECK(ok.err.empty());
    const auto lines = lines_of(ok.out);
    REQUIRE(lines.size() >= 3);
    CHECK(lines.front() == "vq_euclidean_ste (VectorQuantize): PASS");
    CHECK(lines.back() == "1 of 1 cases passed");
    std::set<std::string> names;
    for (size_t i = 1; i + 1 < lines.size(); ++i) {
      std::istringstream row(lines[i]);
      std::string name;
      row >> name;
      names.insert(name);
      CHECK(contains(lines[i], "max_rel_err"));
      CHECK(lines[i].size() >= 4);
      CHECK(lines[i].substr(lines[i].size() - 4) == "PASS");
    }
    for (const char* want : {"quantized", "indices", "aux_loss.commitment", "x_grad",
                             "_codebook.embed_after", "_codebook.cluster_size_after"})
      CHECK_MESSAGE(names.count(want) == 1, want);

    const CliResult fail = run_quanta({"parity", bad});
    CAPTURE(fail.out);
    CHECK(fail.code == 1);
    CHECK(contains(fail.out, "vq_euclidean_ste (VectorQuantize): FAIL"));
    int failed_lines = 0;
    for (const std::string& line : lines_of(fail.out))
      if (line.rfind("  ", 0) == 0 && contains(line, " FAIL")) {  // a check's line
        ++failed_lines;
        CHECK(line.rfind("  quantized ", 0) == 0);  // only the moved tensor
        CHECK(contains(line, "worst at flat index 0"));
      }
    CHECK(failed_lines == 1);
    CHECK(contains(fail.out, "0 of 1 cases passed"));
    CHECK(fail.err == "quanta: error: parity: 1 of 1 cases failed\n");
    // Several files: one report each, the count, and failure if any fails.
    const CliResult both = run_quanta({"parity", ref, bad});
    CHECK(both.code == 1);
    CHECK(contains(both.out, "1 of 2 cases passed"));
    // A tolerance above the moved tensor's error lets it pass.
    const double rel = 0.5 / scale;
    CHECK(run_quanta({"parity", bad, "--tolerance", std::to_string(rel * 1.01)}).code == 0);
    CHECK(run_quanta({"parity", bad, "--tolerance", std::to_string(rel * 0.99)}).code == 1);
  }
  SUBCASE("json") {
    const CliResult r = run_quanta({"parity", "--json", ref, bad});
    CAPTURE(r.err);
    CHECK(r.code == 1);
    const auto cases = nlohmann::json::parse(r.out);
    REQUIRE(cases.is_array());
    REQUIRE(cases.size() == 2);
    CHECK(cases[0]["file"] == ref);
    CHECK(cases[0]["case"] == "vq_euclidean_ste");
    CHECK(cases[0]["class"] == "VectorQuantize");
    CHECK(cases[0]["passed"] == true);
    REQUIRE(cases[0]["checks"].size() >= 10);
    for (const auto& c : cases[0]["checks"]) {
      CHECK(c["pass"] == true);
      CHECK(c["tolerance"].get<double>() == 1e-5);
      CHECK(c["max_rel_error"].get<double>() <= 1e-5);
    }
    CHECK(cases[1]["file"] == bad);
    CHECK(cases[1]["passed"] == false);
    int failed = 0;
    for (const auto& c : cases[1]["checks"]) {
      if (c["pass"] == true) continue;
      ++failed;
      CHECK(c["name"] == "quantized");
      // |actual - expected| / max |expected|: the 0.5 over the copy's largest value.
      CHECK(c["max_rel_error"].get<double>() == doctest::Approx(0.5 / scale).epsilon(1e-4));
    }
    CHECK(failed == 1);
  }
}

TEST_CASE("quanta parity: a missing file is one clear line and exit 1; usage errors exit 2") {
  TempDir dir;
  const std::string missing = dir.file("missing.safetensors");
  const CliResult r = run_quanta({"parity", missing});
  CAPTURE(r.out);
  CAPTURE(r.err);
  CHECK(r.code == 1);
  int naming = 0;
  for (const std::string& line : lines_of(r.out + r.err))
    if (contains(line, missing)) {
      ++naming;
      CHECK(contains(line, "cannot open"));
    }
  CHECK(naming == 1);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(r.err.rfind("quanta: error: ", 0) == 0);
  check_one_line_error(run_quanta({"parity"}), 2, "files is required");
  check_one_line_error(run_quanta({"parity", dir.path().string()}), 2,
                       "holds no .safetensors files");
  check_one_line_error(run_quanta({"parity", missing, "--tolerance", "-1"}), 2,
                       "--tolerance: must be a number >= 0");
}

namespace {

// A bench suite's --json rows: each name once, positive times, ratio =
// ms / floor_ms. Returns the rows (empty after a failed REQUIRE).
nlohmann::json bench_rows(const std::vector<std::string>& args, std::set<std::string>& seen) {
  const CliResult r = run_quanta(args);
  CAPTURE(r.err);
  REQUIRE(r.code == 0);
  const auto rows = nlohmann::json::parse(r.out);
  REQUIRE(rows.is_array());
  for (const auto& row : rows) {
    const std::string name = row["name"].get<std::string>();
    CAPTURE(name);
    CHECK(seen.insert(name).second);  // each row once
    for (const char* key : {"ms", "floor_ms", "ratio"}) {
      REQUIRE(row[key].is_number());
      CHECK(row[key].get<double>() > 0);
    }
    CHECK(row["ratio"].get<double>() ==
          doctest::Approx(row["ms"].get<double>() / row["floor_ms"].get<double>()));
  }
  return rows;
}

}  // namespace

TEST_CASE("quanta bench dist -n 2 --size small --json lists the distributed rows") {
  std::set<std::string> seen;
  const auto rows =
      bench_rows({"bench", "dist", "-n", "2", "--size", "small", "--json", "--repeat", "1"}, seen);
  for (const char* want :
       {"all_reduce_1MB", "all_reduce_1MB_vs_ring", "dp_step", "vq_train_step_dist", "vq_reconcile",
        "vq_reconcile_vs_comm", "vq_reconcile_dead_codes"})
    CHECK_MESSAGE(seen.count(want) == 1, want);
  for (const auto& row : rows)
    if (row["name"].get<std::string>().rfind("vq_reconcile", 0) == 0 &&
        row["name"].get<std::string>() != "vq_reconcile_vs_comm")
      CHECK(row["ratio"].get<double>() < 1.0);  // a part of the step it is measured against
}

TEST_CASE("quanta bench quant --size small --json lists the quantizer rows") {
  std::set<std::string> seen;
  bench_rows({"bench", "quant", "--size", "small", "--json", "--repeat", "1"}, seen);
  for (const char* want : {"vq_train_step", "rvq8_train_step", "fsq_train_step",
                           "lfq_1024_train_step", "lfq_65536_train_step"})
    CHECK_MESSAGE(seen.count(want) == 1, want);
}

TEST_CASE("quanta bench llm --size small: every row, or why its PyTorch peer is missing") {
  // Without the peer environment every row runs quanta's side and says why
  // it has no floor; with it (QUANTA_PEER_PYTHON), the rows are timed in turns.
  const char* peer = std::getenv("QUANTA_PEER_PYTHON");
  const std::string saved = peer ? peer : "";
  ::setenv("QUANTA_PEER_PYTHON", "/nonexistent/python", 1);
  const CliResult r = run_quanta({"bench", "llm", "--size", "small", "--json", "--repeat", "1"});
  const CliResult only = run_quanta(
      {"bench", "llm", "--size", "small", "--json", "--repeat", "1", "--only", "qlorasmall_B"});
  const CliResult none = run_quanta({"bench", "llm", "--size", "small", "--only", "gpt2"});
  const CliResult anchored = run_quanta({"bench", "llm", "--size", "small", "--json", "--repeat",
                                         "1", "--only", "qlorasmall_B2_T32$|^attention_T64$"});
  const CliResult bad = run_quanta({"bench", "llm", "--size", "small", "--only", "qlora("});
  const CliResult sim =
      run_quanta({"bench", "llm", "--size", "small", "--json", "--repeat", "1", "--device", "sim"});
  if (peer)
    ::setenv("QUANTA_PEER_PYTHON", saved.c_str(), 1);
  else
    ::unsetenv("QUANTA_PEER_PYTHON");
  CAPTURE(r.err);
  REQUIRE(r.code == 0);
  std::set<std::string> names;
  std::map<std::string, nlohmann::json> shard;
  for (const auto& row : nlohmann::json::parse(r.out)) {
    const std::string name = row["name"].get<std::string>();
    names.insert(name);
    // The sharding rows compare quanta with quanta: measured without a peer.
    if (contains(name, "_shard2_")) {
      shard[name] = row;
      continue;
    }
    CHECK(contains(row["unavailable"].get<std::string>(),
                   "no PyTorch peer: /nonexistent/python is missing"));
  }
  REQUIRE(shard.size() == 4);
  CHECK(shard["qlorasmall_shard2_step"]["ms"].get<double>() > 0);
  CHECK_FALSE(shard["qlorasmall_shard2_step"].contains("unit"));
  // Two ranks keep less than one; a step gathers the base twice (forward
  // and recomputation).
  CHECK(shard["qlorasmall_shard2_base"]["unit"] == "MB");
  CHECK(shard["qlorasmall_shard2_base"]["ratio"].get<double>() < 1);
  CHECK(shard["qlorasmall_shard2_gathered"]["ratio"].get<double>() == doctest::Approx(2.0));
  for (const char* want :
       {"attention_T64", "attention_T64_fb", "llamasmall_B2_T32", "llamasmall_B2_T32_fb",
        "qlorasmall_B2_T32", "qlorasmall_B2_T32_recompute", "qlorasmall_B2_T32_dora",
        "qlorasmall_B2_T32_peak_rss"})
    CHECK_MESSAGE(names.count(want) == 1, want);
  // The mixed-precision rows come where the CPU has bf16 products.
  const bool mixed = cpu::bf16_gemm_native();
  CHECK(names.count("llamasmall_B2_T32_fb_mixed") == (mixed ? 1 : 0));
  CHECK(names.count("llamasmall_B2_T32_fb_bf16") == (mixed ? 1 : 0));
  CHECK(names.count("qlorasmall_B2_T32_mixed") == (mixed ? 1 : 0));
  // --only keeps the rows whose name contains it, and refuses a text that matches none.
  REQUIRE(only.code == 0);
  nlohmann::json rows = nlohmann::json::parse(only.out);
  REQUIRE(rows.size() == (mixed ? 5 : 4));
  CHECK(rows[0]["name"] == "qlorasmall_B2_T32");
  if (mixed) {
    CHECK(rows[1]["name"] == "qlorasmall_B2_T32_mixed");
    rows.erase(1);
  }
  CHECK(rows[1]["name"] == "qlorasmall_B2_T32_recompute");
  CHECK(rows[1]["ms"].get<double>() > 0);
  rows.erase(1);
  CHECK(rows[1]["name"] == "qlorasmall_B2_T32_dora");
  CHECK(rows[1]["ms"].get<double>() > 0);
  rows.erase(1);
  // Without a peer the rows keep quanta's side: the step's time, and the
  // peak memory of a fresh process running it (MB; a small model still
  // maps the libraries, so tens of MB at least).
  CHECK(rows[0]["ms"].get<double>() > 0);
  CHECK(rows[1]["name"] == "qlorasmall_B2_T32_peak_rss");
  CHECK(rows[1]["unit"] == "MB");
  CHECK(rows[1]["ms"].get<double>() > 10);
  CHECK(rows[1]["ms"].get<double>() < 4000);
  CHECK(none.code != 0);
  CHECK(contains(none.err, "--only gpt2 matches no row of the llm suite (attention_T64,"));
  // A regular expression: anchored names take those rows alone (not _fb,
  // _mixed or _peak_rss), and a malformed one is refused by name.
  CAPTURE(anchored.err);
  REQUIRE(anchored.code == 0);
  std::vector<std::string> anchored_names;
  for (const auto& row : nlohmann::json::parse(anchored.out))
    anchored_names.push_back(row["name"].get<std::string>());
  CHECK(anchored_names == std::vector<std::string>{"attention_T64", "qlorasmall_B2_T32"});
  CHECK(bad.code != 0);
  CHECK(contains(bad.err, "--only qlora( is not a regular expression"));
  // On a device (sim here, the path CUDA takes) every workload runs there;
  // the CPU's peak-memory and sharding rows are left out.
  CAPTURE(sim.err);
  REQUIRE(sim.code == 0);
  std::set<std::string> sim_names;
  for (const auto& row : nlohmann::json::parse(sim.out)) {
    sim_names.insert(row["name"].get<std::string>());
    CHECK(row["ms"].get<double>() > 0);
    CHECK(contains(row["unavailable"].get<std::string>(), "sim has no PyTorch peer"));
  }
  // sim records, so the QLoRA step also runs as a captured graph there.
  CHECK(sim_names == std::set<std::string>{"attention_T64", "attention_T64_fb", "llamasmall_B2_T32",
                                           "llamasmall_B2_T32_fb", "llamasmall_B2_T32_fb_mixed",
                                           "llamasmall_B2_T32_fb_bf16", "qlorasmall_B2_T32",
                                           "qlorasmall_B2_T32_mixed", "qlorasmall_B2_T32_recompute",
                                           "qlorasmall_B2_T32_dora", "qlorasmall_B2_T32_graph"});
  // The ~500M size is the llm suite's alone.
  const CliResult large = run_quanta({"bench", "quant", "--size", "large"});
  CHECK(large.code == 2);
  CHECK(contains(large.err, "--size large is for bench llm (its ~500M config), not quant"));
}

TEST_CASE("numeric flags out of range are one clear line, exit 2, for every subcommand") {
  // CLI11 alone clamped 99999999999999999999 to 2^63 - 1 (a batch size that
  // ended in SIGFPE), took --seed -1 as 2^64 - 1 and let inf and nan through.
  const std::string huge = "99999999999999999999";
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"train", "--batch-size", huge}, "--batch-size: must be at most 1073741824, got '" + huge},
      {{"train", "--steps", huge}, "--steps: must be at most"},
      {{"train", "--threads", "100000"}, "--threads: must be at most"},
      {{"train", "--threads", "-1"}, "--threads: must be a number >= 0"},
      {{"train", "--seed", "-1"}, "--seed: must be an integer >= 0, got '-1'"},
      {{"train", "--seed", "18446744073709551616"}, "--seed: must be at most 18446744073709551615"},
      {{"train", "--lr", "inf"}, "--lr: must be a finite number"},
      {{"train", "--lr", "nan"}, "--lr: must be a number, got 'nan'"},
      {{"train", "--hidden", "1e3"}, "--hidden: must be an integer, got '1e3'"},
      {{"train", "--limit-train", huge}, "--limit-train: must be at most"},
      {{"train", "--eval-every", "-5"}, "--eval-every: must be a number >= 0"},
      {{"train", "--eps", "0"}, "quantizer option 'eps' must be a number > 0, got 0"},
      {{"train", "--decay", "1.5"}, "quantizer option 'decay' must be a number from 0 to 1"},
      {{"train", "--codebook-size", "999999999999"},
       "quantizer option 'codebook_size' must be an integer <= 16777216"},
      {{"train", "--dist-timeout", "0"}, "--dist-timeout: must be a number > 0"},
      {{"finetune", "x.safetensors", "--out", "o", "--steps", huge}, "--steps: must be at most"},
      {{"finetune", "x.safetensors", "--out", "o", "--batch-size", huge},
       "--batch-size: must be at most"},
      {{"finetune", "x.safetensors", "--out", "o", "--seed", "-1"}, "--seed: must be an integer"},
      {{"finetune", "x.safetensors", "--out", "o", "--threads", "100000"}, "--threads"},
      {{"finetune", "x.safetensors", "--out", "o", "--lora-alpha", "nan"},
       "--lora-alpha: must be a number"},
      {{"finetune", "x.safetensors", "--out", "o", "--lora-dropout", "nan"}, "--lora-dropout"},
      {{"finetune", "x.safetensors", "--out", "o", "--dist-timeout", "x"},
       "--dist-timeout: must be a number, got 'x'"},
      {{"eval", "x.safetensors", "--batch-size", huge}, "--batch-size: must be at most"},
      {{"eval", "x.safetensors", "--limit", "-1"}, "--limit: must be a number >= 0"},
      {{"decode", "x.safetensors", "c.safetensors", "--out", "o.png", "--cols", "0"},
       "--cols: must be a number > 0"},
      {{"decode", "x.safetensors", "c.safetensors", "--out", "o.png", "--limit", huge},
       "--limit: must be at most"},
      {{"encode", "x.safetensors", "--out", "c.safetensors", "--limit", huge},
       "--limit: must be at most"},
      {{"bench", "engine", "--threads", "100000"}, "--threads: must be at most"},
      {{"bench", "engine", "--repeat", "0"}, "--repeat: must be a number > 0"},
      {{"launch", "-n", huge, "--", "true"}, "must be at most 1024"},
      {{"launch", "-n", "2", "--dist-timeout", "-3", "--", "true"}, "--dist-timeout"},
      {{"launch", "--nnodes", "2", "--node-rank", "2", "--", "true"},
       "--node-rank 2 is not a node of --nnodes 2: node ranks are 0 to 1"},
      {{"launch", "--node-rank", "1", "--", "true"}, "--node-rank 1 is not a node of --nnodes 1"},
      {{"launch", "--nnodes", "0", "--", "true"}, "--nnodes: must be a number > 0"},
      {{"launch", "--nnodes", "1:4", "--", "true"}, "elastic ranges (torchrun's MIN:MAX)"},
      {{"launch", "--nnodes", "4", "-n", "512", "--", "true"},
       "--nnodes 4 x --nproc-per-node 512 is 2048 ranks: at most 1024"},
      {{"launch", "--master-port", "70000", "--", "true"}, "--master-port: must be at most 65535"},
      {{"launch", "--master-port", "0", "--", "true"}, "--master-port: must be a number > 0"},
      {{"launch", "--max-restarts", "-1", "--", "true"}, "--max-restarts: must be a number >= 0"},
      {{"launch", "--master-addr", "", "--", "true"}, "--master-addr: must not be empty"},
      {{"parity", "x.safetensors", "--tolerance", "inf"}, "--tolerance: must be a finite number"},
      {{"parity", "x.safetensors", "--tolerance", "nan"}, "--tolerance: must be a number"},
  };
  for (const auto& [args, what] : cases) {
    CAPTURE(args.front());
    CAPTURE(args[args.size() - 2]);
    check_one_line_error(run_quanta(args), 2, what);
  }
  // A config file's numbers are held to the same limits.
  TempDir dir;
  std::ofstream(dir.file("big.json")) << R"({"batch_size": 9223372036854775807})";
  check_one_line_error(run_quanta({"train", "--config", dir.file("big.json")}), 2,
                       "'batch_size' must be at most 1073741824");
  std::ofstream(dir.file("threads.json")) << R"({"threads": 100000})";
  check_one_line_error(run_quanta({"train", "--config", dir.file("threads.json")}), 2,
                       "'threads' must be at most 1024");
  // In range, the text is read as decimal ("010" is ten, not octal eight).
  const CliResult ok = run_quanta(
      {"train", "--batch-size", "010", "--seed", "18446744073709551615", "--print-config"});
  CAPTURE(ok.err);
  REQUIRE(ok.code == 0);
  const auto merged = nlohmann::json::parse(ok.out);
  CHECK(merged["batch_size"] == 10);
  CHECK(merged["seed"] == 18446744073709551615ull);
}

TEST_CASE("quanta parity: a case whose spec is missing or damaged fails, naming the spec") {
  // NF4 cases are run from their tensors alone; their spec was never read,
  // so a damaged one passed ("1 of 1 cases passed").
  const std::string ref =
      (test_data() / "reference-vectors" / "nf4_bs64_64x64.safetensors").string();
  TempDir dir;
  const io::SafetensorsFile file = io::load_safetensors(ref);
  REQUIRE(file.metadata.count("spec") == 1);
  const std::vector<std::pair<std::string, std::string>> damaged = {
      {"absent", ""},
      {"truncated", file.metadata.at("spec").substr(0, 40)},
      {"not_object", "[1, 2]"},
      {"wrong_kind", R"({"kind": "lookup"})"},
      {"no_kind", R"({"case": "nf4_bs64_64x64"})"},
  };
  CHECK(run_quanta({"parity", ref}).code == 0);
  for (const auto& [tag, spec] : damaged) {
    CAPTURE(tag);
    std::map<std::string, std::string> meta = file.metadata;
    if (tag == "absent")
      meta.erase("spec");
    else
      meta["spec"] = spec;
    const std::string path = dir.file(tag + ".safetensors");
    io::save_safetensors(path, file.tensors, meta);
    const CliResult r = run_quanta({"parity", path});
    CAPTURE(r.out);
    CHECK(r.code == 1);
    CHECK(contains(r.out, "FAIL"));
    CHECK(contains(r.out, "spec"));
    CHECK(contains(r.out, "0 of 1 cases passed"));
  }
}
