// The CUDA module's ABI number (engine/cuda/module.h) against what it
// versions. libquanta checks one number when it loads libquanta_cuda; a
// module built before a table gained or moved an entry, or an entry changed
// its arguments, would still load if nobody raised it, and every call after
// the change would land on the wrong function or read the wrong fields. The
// number is easy to forget (the tables change often, the module is rebuilt
// rarely, on a GPU machine), so this test fingerprints the declarations it
// covers and pairs each fingerprint with the number it was recorded for.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "engine/cuda/module.h"
#include "support/test_data.h"

namespace {

// Every header whose declarations cross the module's boundary: the module
// struct, the device backend table (memory, copies, capabilities) the module
// returns, the three kernel tables and the argument types they pass, and the
// distributed backend the NCCL entry point returns.
const char* const kVersionedHeaders[] = {
    "engine/cuda/module.h",
    "engine/kernels/table.h",
    "engine/kernels/conv_geom.h",
    "engine/kernels/group_norm.h",
    "engine/device.h",
    "engine/device_backend.h",
    "engine/device_error.h",
    "engine/dtype.h",
    "engine/shape.h",
    "quant/kernels/table.h",
    "quant/kernels/nf4_layout.h",
    "llm/kernels/table.h",
    "llm/kernels/gated_act.h",
    "llm/kernels/rms_weight.h",
    "dist/backend/backend.h",
};

// Each ABI number with the fingerprint of the headers it was raised for,
// oldest first. When the declarations change: raise Module::kAbi by one and
// append a line here, never edit one.
struct Recorded {
  int abi;
  uint64_t fingerprint;
};
const Recorded kHistory[] = {
    {10, 0xb63a0d2e5ef4fdacull},  // the headers as of the commit that raised it to 10
    {11, 0x9bfa1333e5e02e92ull}, {12, 0x4a93d94a2bbbecd3ull}, {13, 0x70ddceb82a64aedeull},
    {14, 0x6a36ec5db910fd3dull},  // RmsWeight (OLMo 2's norms); its and GatedAct's headers covered
    {15, 0xe27ba58ee8badbcdull},  // DeviceCaps::prefers_channels_last; device_backend.h covered
    {16, 0x64cafc00546a38a8ull},  // KernelTable::scale_n (clipping's scaling in one launch)
    {17, 0x4ccc1ba2f2fb838full},  // KernelTable::norm_n, TensorSpan; rope's shared tables
    {18, 0x9d531b89d95c2ac3ull},  // KernelTable::copy_blocks (cat in one launch)
    {19, 0x9e9b8d60ecea3105ull},  // KernelTable::group_norm(_grad), NormGeom; group_norm.h covered
    {20, 0x3eafe94398a79ff5ull},  // KernelTable::clip_factor; norm_n writes f64
    {21, 0x683cfa4840a9a43aull},  // QuantKernelTable::ema_lerp, ema_embed
    {22, 0x94c7c6838875aaf6ull},  // QuantKernelTable::squared_error_mean, _coefficient
    {23, 0x05e5522fcfe719a3ull},  // QuantKernelTable::dead_code_picks, replace_codes; put_rows gone
    {24, 0xb7a5963541c8409cull},  // QuantKernelTable::bit_probabilities(_grad)
};

// `text` less its comments and all of its whitespace (string and character
// literals kept whole): a reworded comment or a reflowed line is not a change.
std::string code_of(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (c == '/' && i + 1 < text.size() && text[i + 1] == '/') {
      while (i < text.size() && text[i] != '\n') ++i;
    } else if (c == '/' && i + 1 < text.size() && text[i + 1] == '*') {
      const std::size_t end = text.find("*/", i + 2);
      i = end == std::string::npos ? text.size() : end + 2;
    } else if (c == '"' || c == '\'') {
      out += text[i++];
      while (i < text.size() && text[i] != c) {
        if (text[i] == '\\' && i + 1 < text.size()) out += text[i++];
        out += text[i++];
      }
      if (i < text.size()) out += text[i++];
    } else {
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r') out += c;
      ++i;
    }
  }
  return out;
}

// The ABI number's own line is left out: it is what the fingerprint is
// paired with.
std::string without_abi_number(std::string code) {
  const std::string key = "staticconstexprintkAbi=";
  const std::size_t at = code.find(key);
  if (at == std::string::npos) return code;
  const std::size_t end = code.find(';', at);
  return code.erase(at, end == std::string::npos ? std::string::npos : end + 1 - at);
}

uint64_t fnv1a(uint64_t h, const std::string& s) {
  for (const unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%016llxull", static_cast<unsigned long long>(v));
  return buf;
}

// The repository's root: the test data folder is its tests/data.
std::string source_root() { return quanta::testing::test_data() + "/../.."; }

uint64_t fingerprint_of_headers(const std::string& root) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const char* path : kVersionedHeaders) {
    std::ifstream in(root + "/" + path, std::ios::binary);
    REQUIRE_MESSAGE(in.good(), "cannot read " << root << "/" << path);
    std::stringstream text;
    text << in.rdbuf();
    h = fnv1a(h, path);
    h = fnv1a(h, without_abi_number(code_of(text.str())));
  }
  return h;
}

}  // namespace

TEST_CASE("cuda module: its ABI number was raised whenever the declarations it versions changed") {
  const uint64_t now = fingerprint_of_headers(source_root());
  const Recorded& last = kHistory[std::size(kHistory) - 1];
  const int abi = quanta::cuda::Module::kAbi;
  INFO("the headers' fingerprint is " << hex(now) << ", Module::kAbi " << abi);
  CHECK_MESSAGE(last.abi == abi, "Module::kAbi is " << abi << " but the last recorded ABI is "
                                                    << last.abi << ": append {" << abi << ", "
                                                    << hex(now) << "} to kHistory in " << __FILE__);
  CHECK_MESSAGE(now == last.fingerprint,
                "the declarations the CUDA module's ABI covers changed since ABI "
                    << last.abi << " was recorded: raise Module::kAbi in engine/cuda/module.h to "
                    << last.abi + 1 << " and append {" << last.abi + 1 << ", " << hex(now)
                    << "} to kHistory in " << __FILE__);
  for (std::size_t i = 1; i < std::size(kHistory); ++i) {
    CHECK_MESSAGE(kHistory[i].abi == kHistory[i - 1].abi + 1, "kHistory's numbers go up by one");
    CHECK_MESSAGE(kHistory[i].fingerprint != kHistory[i - 1].fingerprint,
                  "ABI " << kHistory[i].abi << " was raised for no change");
  }
}

TEST_CASE("cuda module: the ABI fingerprint ignores comments and layout, not code") {
  const std::string a = "struct T {\n  // the count\n  int (*f)(int a,\n           float b);\n};";
  const std::string b = "struct T { /* reworded */ int (*f)(int a, float b); };";
  const std::string c = "struct T { int (*f)(int a, double b); };";
  CHECK(code_of(a) == code_of(b));
  CHECK(code_of(a) != code_of(c));
  CHECK(code_of("x = \"a // b\"; // c") == "x=\"a // b\";");
  CHECK(without_abi_number("structM{staticconstexprintkAbi=11;intabi=kAbi;}") ==
        "structM{intabi=kAbi;}");
}
