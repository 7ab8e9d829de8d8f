#include "quant/nf4/nf4_format.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"
#include "quant/nf4/double_quant.h"
#include "quant/nf4/nf4_simd.h"

namespace quanta::quant {
namespace {

std::array<float, 15> build_midpoints() {
  std::array<float, 15> m{};
  for (size_t i = 0; i < m.size(); ++i) m[i] = (kNF4Values[i] + kNF4Values[i + 1]) / 2.0f;
  return m;
}

// Smallest stored scale: bitsandbytes clamps absmax to 1e-38 before taking
// its reciprocal, so an all-zero block scales to 0 (code 7), not NaN.
constexpr float kMinScale = 1e-38f;

// Units of work for the parallel loops: big enough to amortise a task.
constexpr int64_t kUnitsPerTask = 512;

uint8_t* unit_ptr(uint8_t* base, int64_t unit) {
  return base + unit * static_cast<int64_t>(kNF4UnitBytes);
}

void write_scale(uint8_t* unit, float scale) {
  std::memcpy(unit + kNF4CodeBytes, &scale, sizeof scale);
}

float read_scale(const uint8_t* unit) {
  float s;
  std::memcpy(&s, unit + kNF4CodeBytes, sizeof s);
  return s;
}

// Codes of `len` (<= 64) scaled values, packed into a unit (padding: code 7).
// `scaled` holds 64 values; entries past `len` are 0, which is code 7.
void pack_unit(const float* scaled, int64_t len, uint8_t* unit) {
  const auto& mids = nf4_midpoints();
#ifdef QUANTA_NF4_ENCODE_SIMD
  (void)len;
  simd::encode_unit(scaled, mids, unit);
  return;
#endif
  // Counting the midpoints below each value is branch-free; the inner loop
  // runs over elements so it vectorises.
  int32_t count[kNF4UnitElems] = {};
  for (float m : mids)
    for (int64_t i = 0; i < kNF4UnitElems; ++i) count[i] += scaled[i] > m ? 1 : 0;
  uint8_t codes[kNF4UnitElems];
  for (int64_t i = 0; i < kNF4UnitElems; ++i)
    codes[i] = i < len ? static_cast<uint8_t>(count[i]) : kNF4ZeroCode;
  for (size_t j = 0; j < kNF4CodeBytes; ++j)
    unit[j] = static_cast<uint8_t>((codes[2 * j] << 4) | codes[2 * j + 1]);
}

Tensor as_f32_cpu(const Tensor& x, const char* op) {
  if (!x.defined()) throw std::invalid_argument(std::string("[") + op + "] tensor is undefined");
  if (!is_floating(x.dtype()))
    throw std::invalid_argument(std::string("[") + op + "] expects a floating tensor, got " +
                                dtype_name(x.dtype()));
  return x.detach().to(Device::cpu()).to(DType::f32).contiguous();
}

}  // namespace

void check_options(const NF4Options& o) {
  if (o.block_size != 64 && o.block_size != 128 && o.block_size != 256)
    throw std::invalid_argument(
        "[nf4] block_size must be 64, 128 or 256 (multiples of the 64-element storage unit), "
        "got " + std::to_string(o.block_size));
  if (o.dequant_dtype != DType::f32 && o.dequant_dtype != DType::bf16 &&
      o.dequant_dtype != DType::f16)
    throw std::invalid_argument(std::string("[nf4] dequant_dtype must be f32, bf16 or f16, got ") +
                                dtype_name(o.dequant_dtype));
}

double bits_per_parameter(const NF4Options& o) {
  check_options(o);
  const double bs = static_cast<double>(o.block_size);
  if (!o.double_quant) return 4.0 + 32.0 / bs;
  return 4.0 + 8.0 / bs + 32.0 / (bs * static_cast<double>(kNF4DoubleQuantGroup));
}

double storage_bits_per_parameter() {
  return 8.0 * static_cast<double>(kNF4UnitBytes) / static_cast<double>(kNF4UnitElems);
}

const std::array<float, 15>& nf4_midpoints() {
  static const std::array<float, 15> mids = build_midpoints();  // immutable once built
  return mids;
}

uint8_t nf4_code(float scaled) {
  uint8_t c = 0;
  for (float m : nf4_midpoints()) c = static_cast<uint8_t>(c + (scaled > m));
  return c;
}

void check_nf4(const Tensor& t, const char* op) {
  if (!t.defined()) throw std::invalid_argument(std::string("[") + op + "] tensor is undefined");
  if (t.dtype() != DType::nf4)
    throw std::invalid_argument(std::string("[") + op + "] expects an nf4 tensor, got " +
                                dtype_name(t.dtype()));
  if (!t.device().is_cpu())
    throw std::invalid_argument(std::string("[") + op + "] nf4 tensor is on " +
                                t.device().str() + "; only CPU kernels exist");
  if (!t.is_contiguous() || t.offset() % kNF4UnitElems != 0)
    throw std::invalid_argument(std::string("[") + op +
                                "] nf4 tensor must be contiguous and start on a 64-element unit");
}

Tensor quantize_nf4(const Tensor& x, const NF4Options& o) {
  check_options(o);
  const Tensor xf = as_f32_cpu(x, "quantize_nf4");
  const int64_t n = xf.numel();
  Tensor out = detail::make_tensor(x.shape(), DType::nf4, Device::cpu());
  if (n == 0) return out;
  const float* px = xf.data<float>();
  auto* po = static_cast<uint8_t*>(out.raw_data());
  const int64_t bs = o.block_size;
  const int64_t blocks = (n + bs - 1) / bs;

  std::vector<float> absmax(static_cast<size_t>(blocks));
  cpu::parallel_for(0, blocks, kUnitsPerTask, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const float* p = px + b * bs;
      const int64_t len = std::min(bs, n - b * bs);
      // Sixteen running maxima (each in element order) vectorise; NaN is
      // ignored as std::max(a, NaN) ignores it.
      float lanes[16] = {};
      int64_t i = 0;
      for (; i + 16 <= len; i += 16)
        for (int l = 0; l < 16; ++l) lanes[l] = std::max(lanes[l], std::fabs(p[i + l]));
      float a = 0;
      for (; i < len; ++i) a = std::max(a, std::fabs(p[i]));
      for (float l : lanes) a = std::max(a, l);
      absmax[static_cast<size_t>(b)] = a;
    }
  });
  // Codes use the exact absmax; units store the scale dequantization uses.
  std::vector<float> stored = absmax;
  if (o.double_quant) stored = double_dequantize(double_quantize(absmax.data(), blocks));

  const int64_t units_per_block = bs / kNF4UnitElems;
  cpu::parallel_for(0, blocks, std::max<int64_t>(1, kUnitsPerTask / units_per_block),
                    [&](int64_t lo, int64_t hi) {
    float scaled[kNF4UnitElems];
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t begin = b * bs, len = std::min(bs, n - begin);
      const float a = std::max(absmax[static_cast<size_t>(b)], kMinScale);
      const float inv = 1.0f / a;
      const bool full = len == bs;
      for (int64_t u0 = 0; u0 < len; u0 += kNF4UnitElems) {
        const int64_t ulen = std::min(kNF4UnitElems, len - u0);
        const float* p = px + begin + u0;
        // bitsandbytes' reference backend multiplies full blocks by the
        // reciprocal and divides the partial last block; both are kept so
        // codes match bit for bit.
        if (full) {
          for (int64_t i = 0; i < ulen; ++i) scaled[i] = std::clamp(p[i] * inv, -1.0f, 1.0f);
        } else {
          for (int64_t i = 0; i < ulen; ++i) scaled[i] = std::clamp(p[i] / a, -1.0f, 1.0f);
        }
        for (int64_t i = ulen; i < kNF4UnitElems; ++i) scaled[i] = 0.0f;
        uint8_t* unit = unit_ptr(po, (begin + u0) / kNF4UnitElems);
        pack_unit(scaled, ulen, unit);
        write_scale(unit, stored[static_cast<size_t>(b)]);
      }
    }
  });
  return out;
}

Tensor dequantize(const Tensor& q, DType dtype) {
  check_nf4(q, "dequantize");
  if (dtype != DType::f32 && dtype != DType::bf16 && dtype != DType::f16)
    throw std::invalid_argument(std::string("[dequantize] output dtype must be f32, bf16 or "
                                            "f16, got ") + dtype_name(dtype));
  Tensor out = detail::make_tensor(q.shape(), dtype, Device::cpu());
  dequantize_into(q, out);
  return out;
}

void dequantize_into(const Tensor& q, const Tensor& out) {
  check_nf4(q, "dequantize_into");
  const DType dtype = out.dtype();
  if (dtype != DType::f32 && dtype != DType::bf16 && dtype != DType::f16)
    throw std::invalid_argument(std::string("[dequantize_into] output dtype must be f32, bf16 "
                                            "or f16, got ") + dtype_name(dtype));
  if (out.shape() != q.shape() || !out.is_contiguous() || !out.device().is_cpu())
    throw std::invalid_argument("[dequantize_into] output must be a contiguous CPU tensor of "
                                "shape " + shape_str(q.shape()) + ", got " +
                                shape_str(out.shape()));
  const int64_t n = q.numel();
  if (n == 0) return;
  const auto* pq = static_cast<const uint8_t*>(q.raw_data());
  const int64_t units = (n + kNF4UnitElems - 1) / kNF4UnitElems;
  dispatch_all(dtype, "dequantize", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, bf16> ||
                  std::is_same_v<T, f16>) {
      T* po = static_cast<T*>(out.raw_data());
      cpu::parallel_for(0, units, kUnitsPerTask, [&](int64_t lo, int64_t hi) {
        T lut[16];
        T tmp[kNF4UnitElems];
        for (int64_t u = lo; u < hi; ++u) {
          const uint8_t* unit = pq + u * static_cast<int64_t>(kNF4UnitBytes);
          const float s = read_scale(unit);
          if constexpr (std::is_same_v<T, float>) {
            if ((u + 1) * kNF4UnitElems <= n) {
              simd::decode_unit_f32(unit, s, po + u * kNF4UnitElems);
              continue;
            }
          }
          // One float32 product per code, then one rounding to T: exactly
          // bitsandbytes' T(code * absmax).
          for (int c = 0; c < 16; ++c) lut[c] = T(kNF4Values[c] * s);
          const int64_t begin = u * kNF4UnitElems;
          const int64_t len = std::min(kNF4UnitElems, n - begin);
          T* dst = len == kNF4UnitElems ? po + begin : tmp;
          for (size_t j = 0; j < kNF4CodeBytes; ++j) {
            dst[2 * j] = lut[unit[j] >> 4];
            dst[2 * j + 1] = lut[unit[j] & 15];
          }
          if (dst == tmp) std::copy(tmp, tmp + len, po + begin);
        }
      });
    }
  });
}

template <class T>
void dequantize_range(const Tensor& q, int64_t begin, int64_t count, T* out) {
  check_nf4(q, "dequantize_range");
  if (begin < 0 || count < 0 || begin + count > q.numel())
    throw std::invalid_argument("[dequantize_range] range [" + std::to_string(begin) + ", " +
                                std::to_string(begin + count) + ") outside " +
                                std::to_string(q.numel()) + " elements");
  const auto* pq = static_cast<const uint8_t*>(q.raw_data());
  const int64_t end = begin + count;
  int64_t i = begin;
  while (i < end) {
    const int64_t u = i / kNF4UnitElems;
    const uint8_t* unit = pq + u * static_cast<int64_t>(kNF4UnitBytes);
    const float s = read_scale(unit);
    T lut[16];
    for (int c = 0; c < 16; ++c) lut[c] = static_cast<T>(kNF4Values[c] * s);
    const int64_t stop = std::min(end, (u + 1) * kNF4UnitElems);
    if (i == u * kNF4UnitElems && stop == i + kNF4UnitElems) {
      T* dst = out + (i - begin);
      if constexpr (std::is_same_v<T, float>) {
        simd::decode_unit_f32(unit, s, dst);
        i = stop;
        continue;
      }
      for (size_t j = 0; j < kNF4CodeBytes; ++j) {
        dst[2 * j] = lut[unit[j] >> 4];
        dst[2 * j + 1] = lut[unit[j] & 15];
      }
      i = stop;
      continue;
    }
    for (; i < stop; ++i) {
      const int64_t k = i - u * kNF4UnitElems;
      const uint8_t byte = unit[k / 2];
      out[i - begin] = lut[k % 2 == 0 ? byte >> 4 : byte & 15];
    }
  }
}

template void dequantize_range<float>(const Tensor&, int64_t, int64_t, float*);
template void dequantize_range<double>(const Tensor&, int64_t, int64_t, double*);

Tensor nf4_from_codes(const Tensor& codes, const Tensor& scales, const Shape& shape,
                      int64_t block_size) {
  const int64_t n = numel_of(shape);
  if (block_size <= 0 || block_size % kNF4UnitElems != 0)
    throw std::invalid_argument("[nf4_from_codes] block_size must be a positive multiple of 64, "
                                "got " + std::to_string(block_size));
  const Tensor c = codes.detach().to(Device::cpu()).to(DType::u8).contiguous();
  const Tensor s = as_f32_cpu(scales, "nf4_from_codes");
  const int64_t blocks = (n + block_size - 1) / block_size;
  if (c.numel() != n || s.numel() != blocks)
    throw std::invalid_argument("[nf4_from_codes] shape " + shape_str(shape) + " needs " +
                                std::to_string(n) + " codes and " + std::to_string(blocks) +
                                " scales, got " + std::to_string(c.numel()) + " and " +
                                std::to_string(s.numel()));
  Tensor out = detail::make_tensor(shape, DType::nf4, Device::cpu());
  const uint8_t* pc = c.data<uint8_t>();
  const float* ps = s.data<float>();
  auto* po = static_cast<uint8_t*>(out.raw_data());
  const int64_t units = (n + kNF4UnitElems - 1) / kNF4UnitElems;
  for (int64_t u = 0; u < units; ++u) {
    uint8_t code[kNF4UnitElems];
    const int64_t begin = u * kNF4UnitElems, len = std::min(kNF4UnitElems, n - begin);
    for (int64_t i = 0; i < kNF4UnitElems; ++i) {
      code[i] = i < len ? pc[begin + i] : kNF4ZeroCode;
      if (code[i] > 15)
        throw std::invalid_argument("[nf4_from_codes] code " + std::to_string(code[i]) +
                                    " at index " + std::to_string(begin + i) + " exceeds 15");
    }
    uint8_t* unit = unit_ptr(po, u);
    for (size_t j = 0; j < kNF4CodeBytes; ++j)
      unit[j] = static_cast<uint8_t>((code[2 * j] << 4) | code[2 * j + 1]);
    write_scale(unit, ps[begin / block_size]);
  }
  return out;
}

Tensor nf4_codes(const Tensor& q) {
  check_nf4(q, "nf4_codes");
  const int64_t n = q.numel();
  Tensor out = detail::make_tensor({n}, DType::u8, Device::cpu());
  const auto* pq = static_cast<const uint8_t*>(q.raw_data());
  uint8_t* po = out.data<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t byte = pq[(i / kNF4UnitElems) * static_cast<int64_t>(kNF4UnitBytes) +
                            (i % kNF4UnitElems) / 2];
    po[i] = i % 2 == 0 ? byte >> 4 : byte & 15;
  }
  return out;
}

Tensor nf4_unit_scales(const Tensor& q) {
  check_nf4(q, "nf4_unit_scales");
  const int64_t units = (q.numel() + kNF4UnitElems - 1) / kNF4UnitElems;
  Tensor out = detail::make_tensor({units}, DType::f32, Device::cpu());
  const auto* pq = static_cast<const uint8_t*>(q.raw_data());
  float* po = out.data<float>();
  for (int64_t u = 0; u < units; ++u) po[u] = read_scale(pq + u * int64_t{kNF4UnitBytes});
  return out;
}

}  // namespace quanta::quant
