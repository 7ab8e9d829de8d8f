#pragma once
// Double quantization of NF4 block scales, as bitsandbytes does it
// (compress_statistics): subtract the mean of the scales, then quantize them
// in groups of 256 with the signed 8-bit dynamic code.
#include <array>
#include <cstdint>
#include <vector>

namespace quanta::quant {

/** The 256 values of bitsandbytes' signed 8-bit dynamic code
 * (create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8)),
 * sorted ascending, rebuilt in float32 from its recipe. */
const std::array<float, 256>& dynamic_map8();

/** Quantized block scales: one code per block, one absmax per group of
 * `group` blocks, and the offset subtracted before quantizing. */
struct DoubleQuantState {
  std::vector<uint8_t> codes;
  std::vector<float> group_absmax;
  float offset = 0;
  int64_t group = 256;
  /** The 256-entry code table the codes index. */
  std::array<float, 256> map{};
};

/** Double-quantizes `n` scales (offset = their mean, summed in float in
 * PyTorch's CPU order so that it is bitsandbytes' offset bit for bit; above
 * 32768 scales PyTorch's sum, so bitsandbytes' offset, depends on its thread
 * count and may differ in the last bit). */
DoubleQuantState double_quantize(const float* scales, int64_t n, int64_t group = 256);

/** Reconstructs the scales as bitsandbytes does:
 * float32(float32(map[code] * group_absmax[b / group]) + offset). */
std::vector<float> double_dequantize(const DoubleQuantState& s);

/** Index of the bucket of `v` among sorted `midpoints` (count strictly below:
 * ties go to the lower code), as torch.bucketize(right=False). */
template <std::size_t N>
inline uint32_t bucket_below(float v, const std::array<float, N>& midpoints) {
  // Branch-free lower bound (a conditional move per halving): the outcome of
  // each comparison is data-dependent, so branches would mispredict.
  const float* base = midpoints.data();
  std::size_t n = N;
  while (n > 1) {
    const std::size_t half = n / 2;
    base = base[half - 1] < v ? base + half : base;
    n -= half;
  }
  return static_cast<uint32_t>(base - midpoints.data()) + (*base < v ? 1u : 0u);
}

}  // namespace quanta::quant
