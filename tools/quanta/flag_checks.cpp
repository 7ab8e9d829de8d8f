#include "flag_checks.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "commands.h"
#include "llm/model/model_folder.h"
#include "train/limits.h"
#include "train/run_device.h"

namespace quanta::cli {
namespace {

std::string show(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}

// An integer bound as people read it: 2^40 rather than 1099511627776.
std::string show_bound(int64_t v) {
  if (v >= 1024 && (v & (v - 1)) == 0) {
    int k = 0;
    while ((int64_t{1} << k) != v) ++k;
    std::string s = "2^";
    s += std::to_string(k);
    return s;
  }
  return std::to_string(v);
}

// "in [lo, hi]" for --help, after the type name.
std::string range_text(const std::string& lo, const std::string& hi, bool open_lo,
                       bool open_hi = false) {
  std::string s = open_lo ? "in (" : "in [";
  s += lo;
  s += ", ";
  s += hi;
  s += open_hi ? ")" : "]";
  return s;
}

// Parses all of `s` as a decimal integer of type T; false on anything else
// (sign where T has none, spaces, hex, overflow).
template <class T>
bool parse_integer(const std::string& s, T& out) {
  const char* end = s.data() + s.size();
  const auto [p, ec] = std::from_chars(s.data(), end, out);
  return !s.empty() && ec == std::errc() && p == end;
}

// True when `s` is a decimal integer too large for int64 (a range error,
// not a malformed number).
bool is_huge_integer(const std::string& s) {
  std::size_t i = s[0] == '-' ? 1 : 0;
  return s.size() > i && s.find_first_not_of("0123456789", i) == std::string::npos;
}

}  // namespace

CLI::Validator integer_in(int64_t lo, int64_t hi) {
  const std::string low = lo == 1   ? "a number > 0"
                          : lo == 0 ? "a number >= 0"
                                    : "at least " + std::to_string(lo);
  return CLI::Validator(
      [lo, hi, low](std::string& s) -> std::string {
        int64_t v = 0;
        if (!parse_integer(s, v)) {
          if (!s.empty() && is_huge_integer(s))
            return s[0] == '-' ? "must be " + low + ", got '" + s + "'"
                               : "must be at most " + std::to_string(hi) + ", got '" + s + "'";
          return "must be an integer, got '" + s + "'";
        }
        if (v < lo) return "must be " + low + ", got '" + s + "'";
        if (v > hi) return "must be at most " + std::to_string(hi) + ", got '" + s + "'";
        s = std::to_string(v);  // "010" is ten, not CLI11's octal eight
        return "";
      },
      range_text(show_bound(lo), show_bound(hi), false));
}

CLI::Validator unsigned_integer() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        uint64_t v = 0;
        if (parse_integer(s, v)) {
          s = std::to_string(v);
          return "";
        }
        if (!s.empty() && s[0] == '-') return "must be an integer >= 0, got '" + s + "'";
        if (!s.empty() && is_huge_integer(s))
          return "must be at most 18446744073709551615 (2^64 - 1), got '" + s + "'";
        return "must be an integer >= 0, got '" + s + "'";
      },
      "in [0, 2^64 - 1]");
}

CLI::Validator number_in(double lo, double hi, bool above_lo, bool below_hi) {
  const std::string low = (above_lo ? "a number > " : "a number >= ") + show(lo);
  return CLI::Validator(
      [lo, hi, above_lo, below_hi, low](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || *end != '\0' || std::isnan(v)) return "must be a number, got '" + s + "'";
        if (!std::isfinite(v)) return "must be a finite number, got '" + s + "'";
        if (v < lo || (above_lo && v == lo)) return "must be " + low + ", got '" + s + "'";
        if (v > hi || (below_hi && v == hi))
          return (below_hi ? "must be below " : "must be at most ") + show(hi) + ", got '" + s +
                 "'";
        return "";
      },
      hi >= 1e300 ? std::string(above_lo ? "> " : ">= ").append(show(lo))
                  : range_text(show(lo), show(hi), above_lo, below_hi));
}

CLI::Validator thread_count() {
  const int64_t most = train::max_threads();
  CLI::Validator v = integer_in(0, most);
  return CLI::Validator(
      [v, most](std::string& s) -> std::string {
        const std::string err = v(s);
        if (err.empty() || err.find("at most") == std::string::npos) return err;
        return err + " (4 per core, at most 1024)";
      },
      std::string("0 (all cores) to ").append(std::to_string(most)));
}

std::string device_flag_help(const std::string& what) {
  return "cpu, cuda, cuda:N or sim (a simulated GPU: the CPU's results, a GPU's rules): where " +
         what + " live";
}

CLI::Option* add_device_flag(CLI::App& sub, std::string& device, const std::string& what) {
  return sub.add_option("--device", device, device_flag_help(what))->capture_default_str();
}

Device device_flag(const std::string& device) {
  try {
    return train::run_device(device);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
}

void refuse_output_over_input(const std::string& flag, const std::string& output,
                              const std::vector<InputFile>& inputs) {
  namespace fs = std::filesystem;
  for (const InputFile& in : inputs) {
    std::error_code ec;
    // An output that does not exist yet is no input (an input exists).
    if (!fs::equivalent(output, in.path, ec) || ec) continue;
    throw UsageError(flag + " " + output + " is " + in.what + " this command reads (" + in.path +
                     "): writing it would destroy that input; give another " + flag);
  }
}

CLI::Option* add_max_shard_size_flag(CLI::App& sub, std::string& size, const std::string& what) {
  return sub.add_option("--max-shard-size", size,
                        what +
                            " in files of at most this size, as transformers' save_pretrained "
                            "max_shard_size: model-0000N-of-0000M.safetensors and "
                            "model.safetensors.index.json past it (\"5GB\", \"500MB\" or bytes; "
                            "default 50GB)");
}

uint64_t max_shard_size_flag(const std::string& size) {
  if (size.empty()) return llm::kDefaultMaxShardBytes;
  try {
    return llm::parse_shard_size(size);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--max-shard-size: ") + e.what());
  }
}

DType compute_dtype_flag(const std::string& name, DType model_dtype) {
  if (name == "auto") return model_dtype == DType::f64 ? DType::f32 : model_dtype;
  if (name == "bfloat16" || name == "bf16") return DType::bf16;
  if (name == "float32" || name == "f32") return DType::f32;
  if (name == "float16" || name == "f16") return DType::f16;
  throw UsageError("--compute-dtype must be auto, bfloat16, float32 or float16, got \"" + name +
                   "\"");
}

}  // namespace quanta::cli
