#include "quant/nf4/double_quant.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "engine/cpu/parallel.h"

namespace quanta::quant {
namespace {

// torch.linspace(start, end, steps) in float32, as PyTorch's CPU kernel
// computes it: the first half counts up from start, the second half down from
// end, so both ends are exact; each value is one fused multiply-add (the
// kernel is built with FMA contraction, so start + step * i rounds once).
std::vector<float> linspace_f32(float start, float end, int64_t steps) {
  std::vector<float> v(static_cast<size_t>(steps));
  const float step = (end - start) / static_cast<float>(steps - 1);
  const int64_t halfway = steps / 2;
  for (int64_t i = 0; i < steps; ++i)
    v[static_cast<size_t>(i)] = i < halfway
                                    ? std::fma(step, static_cast<float>(i), start)
                                    : std::fma(-step, static_cast<float>(steps - i - 1), end);
  return v;
}

std::array<float, 256> build_dynamic_map() {
  // Signed, 7 exponent bits, 8 bits in all: for decade i (scale 10^(i-6)),
  // 2^i values per sign at the midpoints of linspace(0.1, 1, 2^i + 1); plus 0
  // and 1.0.
  std::vector<float> data;
  for (int i = 0; i < 7; ++i) {
    const std::vector<float> bounds = linspace_f32(0.1f, 1.0f, (int64_t{1} << i) + 1);
    const float scale = static_cast<float>(std::pow(10.0, i - 6));
    for (size_t j = 0; j + 1 < bounds.size(); ++j) {
      const float mean = (bounds[j] + bounds[j + 1]) / 2.0f;
      data.push_back(scale * mean);
      data.push_back(-scale * mean);
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  if (data.size() != 256) throw std::logic_error("[dynamic_map8] recipe gave a wrong size");
  std::sort(data.begin(), data.end());
  std::array<float, 256> out{};
  std::copy(data.begin(), data.end(), out.begin());
  return out;
}

// torch.sum of float32 values on the CPU as PyTorch's cascade sum computes
// it in one chunk (SumKernel.cpp: vectors of 8 lanes, 4 independent
// accumulators, partial sums carried up 4 levels every 16 rows, then the
// scalar tail and the lanes in order), so that the mean bitsandbytes
// subtracts before double quantization is its bits. PyTorch splits a sum of
// more than 32768 values across threads, so bitsandbytes' own offset then
// depends on its thread count; this stays the one-chunk order.
float torch_sum_f32(const float* x, int64_t n) {
  constexpr int64_t kLanes = 8, kRows = 4, kLevels = 4;
  using Lanes = std::array<float, kLanes>;
  const auto add = [](Lanes& acc, const float* v) {
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += v[l];
  };
  const auto add_lanes = [](Lanes& acc, const Lanes& v) {
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += v[l];
  };
  const int64_t vectors = n / kLanes, rows = vectors / kRows;
  const auto ceil_log2 = [](int64_t v) -> int64_t {
    if (v <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t u = static_cast<uint64_t>(v) - 1; u; u >>= 1) ++bits;
    return bits;
  };
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(rows) / kLevels);
  const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
  std::array<std::array<Lanes, kRows>, kLevels> acc{};
  int64_t i = 0;
  while (i + level_step <= rows) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int64_t k = 0; k < kRows; ++k) add(acc[0][k], x + (i * kRows + k) * kLanes);
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < kRows; ++k) {
        add_lanes(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = Lanes{};
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < rows; ++i)
    for (int64_t k = 0; k < kRows; ++k) add(acc[0][k], x + (i * kRows + k) * kLanes);
  for (int64_t j = 1; j < kLevels; ++j)
    for (int64_t k = 0; k < kRows; ++k) add_lanes(acc[0][k], acc[j][k]);
  Lanes partial = acc[0][0];
  for (int64_t v = rows * kRows; v < vectors; ++v) add(partial, x + v * kLanes);
  for (int64_t k = 1; k < kRows; ++k) add_lanes(partial, acc[0][k]);
  float total = 0;
  for (int64_t t = vectors * kLanes; t < n; ++t) total += x[t];
  for (int64_t l = 0; l < kLanes; ++l) total += partial[l];
  return total;
}

std::array<float, 255> midpoints_of(const std::array<float, 256>& map) {
  std::array<float, 255> m{};
  for (size_t i = 0; i < m.size(); ++i) m[i] = (map[i] + map[i + 1]) / 2.0f;
  return m;
}

}  // namespace

const std::array<float, 256>& dynamic_map8() {
  static const std::array<float, 256> map = build_dynamic_map();  // immutable once built
  return map;
}

DoubleQuantState double_quantize(const float* scales, int64_t n, int64_t group) {
  if (group <= 0)
    throw std::invalid_argument("[double_quantize] group must be positive, got " +
                                std::to_string(group));
  DoubleQuantState s;
  s.group = group;
  s.map = dynamic_map8();
  const auto mids = midpoints_of(s.map);
  // torch.mean: the float sum, then one float division.
  s.offset = n == 0 ? 0.0f : torch_sum_f32(scales, n) / static_cast<float>(n);
  s.codes.resize(static_cast<size_t>(n));
  const int64_t groups = (n + group - 1) / group;
  s.group_absmax.resize(static_cast<size_t>(groups));
  // Groups are independent once the offset is known.
  cpu::parallel_for(0, groups, 64, [&](int64_t g_lo, int64_t g_hi) {
    std::vector<float> centred(static_cast<size_t>(group));
    for (int64_t g = g_lo; g < g_hi; ++g) {
      const int64_t lo = g * group, len = std::min(group, n - lo);
      float amax = 0;
      for (int64_t i = 0; i < len; ++i) {
        centred[i] = scales[lo + i] - s.offset;
        amax = std::max(amax, std::fabs(centred[i]));
      }
      s.group_absmax[static_cast<size_t>(g)] = amax;
      const float a = std::max(amax, 1e-38f);
      const float inv = 1.0f / a;
      for (int64_t i = 0; i < len; ++i) {
        // bitsandbytes' reference backend: a full group multiplies by the
        // reciprocal, the partial last group divides.
        float v = len == group ? centred[i] * inv : centred[i] / a;
        v = std::clamp(v, -1.0f, 1.0f);
        s.codes[static_cast<size_t>(lo + i)] = static_cast<uint8_t>(bucket_below(v, mids));
      }
    }
  });
  return s;
}

std::vector<float> double_dequantize(const DoubleQuantState& s) {
  const int64_t n = static_cast<int64_t>(s.codes.size());
  if (s.group <= 0 || static_cast<int64_t>(s.group_absmax.size()) != (n + s.group - 1) / s.group)
    throw std::invalid_argument("[double_dequantize] " + std::to_string(s.group_absmax.size()) +
                                " group scales for " + std::to_string(n) +
                                " block scales in groups of " + std::to_string(s.group));
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t b = 0; b < n; ++b) {
    // Two float32 roundings, as bitsandbytes' unfused path (no FMA).
    volatile float prod = s.map[s.codes[b]] * s.group_absmax[static_cast<size_t>(b / s.group)];
    out[static_cast<size_t>(b)] = prod + s.offset;
  }
  return out;
}

}  // namespace quanta::quant
