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
#include "quant/nf4/nf4_runs.h"
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

// Elements of work for the parallel loops: big enough to amortise a task.
constexpr int64_t kElemsPerTask = 512 * kNF4UnitElems;

// Codes of R scaled values packed into R / 2 bytes. `scaled` holds R values;
// entries past the run's length are 0, which is code 7 (the padding).
template <int R>
void pack_run(const float* scaled, uint8_t* dst) {
#ifdef QUANTA_NF4_ENCODE_SIMD
  simd::encode_run<R>(scaled, nf4_midpoints(), dst);
#else
  // Counting the midpoints below each value is branch-free; the inner loop
  // runs over elements so it vectorises.
  int32_t count[R] = {};
  for (float m : nf4_midpoints())
    for (int i = 0; i < R; ++i) count[i] += scaled[i] > m ? 1 : 0;
  for (int j = 0; j < R / 2; ++j)
    dst[j] = static_cast<uint8_t>((count[2 * j] << 4) | count[2 * j + 1]);
#endif
}

template <int R>
void encode_runs(const float* px, int64_t n, int64_t bs, const std::vector<float>& absmax,
                 const std::vector<float>& stored, const detail::NF4RunsOut& out) {
  const int64_t blocks = static_cast<int64_t>(absmax.size());
  cpu::parallel_for(0, blocks, std::max<int64_t>(1, kElemsPerTask / bs),
                    [&](int64_t lo, int64_t hi) {
    float scaled[R];
    uint8_t packed[R / 2];
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t begin = b * bs, len = std::min(bs, n - begin);
      const float a = std::max(absmax[static_cast<size_t>(b)], kMinScale);
      const float inv = 1.0f / a;
      const bool full = len == bs;
      for (int64_t r0 = 0; r0 < len; r0 += R) {
        const int64_t rlen = std::min<int64_t>(R, len - r0);
        const float* p = px + begin + r0;
        // bitsandbytes' reference backend multiplies full blocks by the
        // reciprocal and divides the partial last block; both are kept so
        // codes match bit for bit.
        if (full) {
          for (int64_t i = 0; i < rlen; ++i) scaled[i] = std::clamp(p[i] * inv, -1.0f, 1.0f);
        } else {
          for (int64_t i = 0; i < rlen; ++i) scaled[i] = std::clamp(p[i] / a, -1.0f, 1.0f);
        }
        for (int64_t i = rlen; i < R; ++i) scaled[i] = 0.0f;
        const int64_t r = (begin + r0) / R;
        uint8_t* dst = out.codes + r * out.code_stride;
        if (rlen == R || out.pad_runs) {
          pack_run<R>(scaled, dst);
        } else {
          pack_run<R>(scaled, packed);
          std::memcpy(dst, packed, static_cast<size_t>((rlen + 1) / 2));
        }
        if (out.scales) {
          const float s = stored[static_cast<size_t>(b)];
          std::memcpy(out.scales + r * out.scale_stride, &s, sizeof s);
        }
      }
    }
  });
}

// Every element of `w` as T (float, bf16 or f16): T(value * scale).
template <class T, int R>
void decode_all_runs(const detail::NF4Runs& w, T* po) {
  const int64_t n = w.n;
  cpu::parallel_for(0, w.runs(), std::max<int64_t>(1, kElemsPerTask / R),
                    [&](int64_t lo, int64_t hi) {
    T lut[16];
    T tmp[R];
    for (int64_t r = lo; r < hi; ++r) {
      const uint8_t* codes = w.codes_of(r);
      const float s = w.scale_of(r);
      const int64_t begin = r * R;
      const int64_t len = std::min<int64_t>(R, n - begin);
      if constexpr (std::is_same_v<T, float>) {
        if (len == R) {
          simd::decode_run_f32<R>(codes, s, DType::f32, po + begin);
          continue;
        }
      }
      // One float32 product per code, then one rounding to T: exactly
      // bitsandbytes' T(code * absmax).
      for (int c = 0; c < 16; ++c) lut[c] = T(kNF4Values[c] * s);
      T* dst = len == R ? po + begin : tmp;
      for (int64_t j = 0; j < (len + 1) / 2; ++j) {
        dst[2 * j] = lut[codes[j] >> 4];
        if (2 * j + 1 < R) dst[2 * j + 1] = lut[codes[j] & 15];
      }
      if (dst == tmp) std::copy(tmp, tmp + len, po + begin);
    }
  });
}

template <class T, int R>
void decode_range_runs(const detail::NF4Runs& w, int64_t begin, int64_t count, DType dtype,
                       T* out) {
  const int64_t end = begin + count;
  int64_t i = begin;
  while (i < end) {
    const int64_t r = i / R;
    const uint8_t* codes = w.codes_of(r);
    const float s = w.scale_of(r);
    const int64_t stop = std::min(end, (r + 1) * R);
    if (i == r * R && stop == i + R) {
      T* dst = out + (i - begin);
      if constexpr (std::is_same_v<T, float>) {
        simd::decode_run_f32<R>(codes, s, dtype, dst);
        i = stop;
        continue;
      }
    }
    const std::array<float, 16> t = simd::scaled_table(s, dtype);
    T lut[16];
    for (int c = 0; c < 16; ++c) lut[c] = static_cast<T>(t[c]);
    for (; i < stop; ++i) {
      const int64_t k = i - r * R;
      const uint8_t byte = codes[k / 2];
      out[i - begin] = lut[k % 2 == 0 ? byte >> 4 : byte & 15];
    }
  }
}

}  // namespace

namespace detail {

Tensor as_f32_cpu(const Tensor& x, const char* op) {
  if (!x.defined()) throw std::invalid_argument(std::string("[") + op + "] tensor is undefined");
  if (!is_floating(x.dtype()))
    throw std::invalid_argument(std::string("[") + op + "] expects a floating tensor, got " +
                                dtype_name(x.dtype()));
  return x.detach().to(Device::cpu()).to(DType::f32).contiguous();
}

void check_dequant_dtype(DType dtype, const char* op) {
  if (dtype != DType::f32 && dtype != DType::bf16 && dtype != DType::f16)
    throw std::invalid_argument(std::string("[") + op +
                                "] dequantized dtype must be f32, bf16 or f16, got " +
                                dtype_name(dtype));
}

NF4Runs unit_runs(const Tensor& q) {
  NF4Runs w;
  w.n = q.numel();
  w.run = kNF4UnitElems;
  w.codes = static_cast<const uint8_t*>(q.raw_data());
  w.code_stride = static_cast<int64_t>(kNF4UnitBytes);
  w.scales = w.codes ? w.codes + kNF4CodeBytes : nullptr;
  w.scale_stride = static_cast<int64_t>(kNF4UnitBytes);
  return w;
}

NF4Runs packed_runs(const uint8_t* packed, const float* scales, int64_t n, int64_t block) {
  NF4Runs w;
  w.n = n;
  w.run = std::min<int64_t>(block, kNF4UnitElems);
  w.codes = packed;
  w.code_stride = w.run / 2;
  w.scales = reinterpret_cast<const uint8_t*>(scales);
  w.scale_stride = sizeof(float);
  w.runs_per_scale = block / w.run;
  return w;
}

template <class T>
void decode_range(const NF4Runs& w, int64_t begin, int64_t count, DType dtype, T* out) {
  if (begin < 0 || count < 0 || begin + count > w.n)
    throw std::invalid_argument("[nf4 decode] range [" + std::to_string(begin) + ", " +
                                std::to_string(begin + count) + ") outside " +
                                std::to_string(w.n) + " elements");
  if (w.run == 32) decode_range_runs<T, 32>(w, begin, count, dtype, out);
  else decode_range_runs<T, 64>(w, begin, count, dtype, out);
}

template void decode_range<float>(const NF4Runs&, int64_t, int64_t, DType, float*);
template void decode_range<double>(const NF4Runs&, int64_t, int64_t, DType, double*);

void decode_all(const NF4Runs& w, DType dtype, void* out) {
  if (w.n == 0) return;
  dispatch_all(dtype, "dequantize", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, bf16> ||
                  std::is_same_v<T, f16>) {
      if (w.run == 32) decode_all_runs<T, 32>(w, static_cast<T*>(out));
      else decode_all_runs<T, 64>(w, static_cast<T*>(out));
    }
  });
}

std::vector<float> block_absmax(const float* px, int64_t n, int64_t bs) {
  const int64_t blocks = (n + bs - 1) / bs;
  std::vector<float> absmax(static_cast<size_t>(blocks));
  cpu::parallel_for(0, blocks, std::max<int64_t>(1, kElemsPerTask / bs),
                    [&](int64_t lo, int64_t hi) {
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
  return absmax;
}

void encode_blocks(const float* x, int64_t n, int64_t block, const std::vector<float>& absmax,
                   const std::vector<float>& stored, const NF4RunsOut& out) {
  if ((out.run != 32 && out.run != 64) || block % out.run != 0)
    throw std::logic_error("[nf4 encode] block " + std::to_string(block) +
                           " is not whole runs of " + std::to_string(out.run));
  if (out.run == 32) encode_runs<32>(x, n, block, absmax, stored, out);
  else encode_runs<64>(x, n, block, absmax, stored, out);
}

}  // namespace detail

void check_options(const NF4Options& o) {
  if (std::find(kNF4BlockSizes.begin(), kNF4BlockSizes.end(), o.block_size) ==
      kNF4BlockSizes.end())
    throw std::invalid_argument("[nf4] block_size must be 32, 64, 128 or 256, got " +
                                std::to_string(o.block_size));
  detail::check_dequant_dtype(o.dequant_dtype, "nf4");
}

NF4Bits bits_per_parameter(const NF4Options& o) {
  check_options(o);
  const double bs = static_cast<double>(o.block_size);
  NF4Bits bits;
  bits.bnb = o.double_quant ? 4.0 + 8.0 / bs + 32.0 / (bs * double(kNF4DoubleQuantGroup))
                            : 4.0 + 32.0 / bs;
  bits.stored = o.block_size % kNF4UnitElems == 0
                    ? 8.0 * double(kNF4UnitBytes) / double(kNF4UnitElems)
                    : bits.bnb;
  return bits;
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
  if (o.block_size % kNF4UnitElems != 0)
    throw std::invalid_argument(
        "[quantize_nf4] block_size " + std::to_string(o.block_size) +
        " needs two scales per 64-element unit of the nf4 dtype (which holds one); "
        "quantize_bnb holds block-32 weights in bitsandbytes' layout");
  const Tensor xf = detail::as_f32_cpu(x, "quantize_nf4");
  const int64_t n = xf.numel();
  Tensor out = quanta::detail::make_tensor(x.shape(), DType::nf4, Device::cpu());
  if (n == 0) return out;
  const float* px = xf.data<float>();
  auto* po = static_cast<uint8_t*>(out.raw_data());
  const std::vector<float> absmax = detail::block_absmax(px, n, o.block_size);
  // Codes use the exact absmax; units store the scale dequantization uses.
  const std::vector<float> stored =
      o.double_quant
          ? double_dequantize(double_quantize(absmax.data(), static_cast<int64_t>(absmax.size())))
          : absmax;
  const int64_t unit = static_cast<int64_t>(kNF4UnitBytes);
  detail::encode_blocks(px, n, o.block_size, absmax, stored,
                        {.run = kNF4UnitElems, .codes = po, .code_stride = unit,
                         .pad_runs = true, .scales = po + kNF4CodeBytes, .scale_stride = unit});
  return out;
}

Tensor dequantize(const Tensor& q, DType dtype) {
  check_nf4(q, "dequantize");
  detail::check_dequant_dtype(dtype, "dequantize");
  Tensor out = quanta::detail::make_tensor(q.shape(), dtype, Device::cpu());
  dequantize_into(q, out);
  return out;
}

Tensor dequantize(const Tensor& q, const NF4Options& o) {
  detail::check_dequant_dtype(o.dequant_dtype, "dequantize");
  return dequantize(q, o.dequant_dtype);
}

void dequantize_into(const Tensor& q, const Tensor& out) {
  check_nf4(q, "dequantize_into");
  detail::check_dequant_dtype(out.dtype(), "dequantize_into");
  if (out.shape() != q.shape() || !out.is_contiguous() || !out.device().is_cpu())
    throw std::invalid_argument("[dequantize_into] output must be a contiguous CPU tensor of "
                                "shape " + shape_str(q.shape()) + ", got " +
                                shape_str(out.shape()));
  if (q.numel() == 0) return;
  detail::decode_all(detail::unit_runs(q), out.dtype(), out.raw_data());
}

Tensor nf4_from_codes(const Tensor& codes, const Tensor& scales, const Shape& shape,
                      int64_t block_size) {
  const int64_t n = numel_of(shape);
  if (block_size <= 0 || block_size % kNF4UnitElems != 0)
    throw std::invalid_argument("[nf4_from_codes] block_size must be a positive multiple of 64, "
                                "got " + std::to_string(block_size));
  const Tensor c = codes.detach().to(Device::cpu()).to(DType::u8).contiguous();
  const Tensor s = detail::as_f32_cpu(scales, "nf4_from_codes");
  const int64_t blocks = (n + block_size - 1) / block_size;
  if (c.numel() != n || s.numel() != blocks)
    throw std::invalid_argument("[nf4_from_codes] shape " + shape_str(shape) + " needs " +
                                std::to_string(n) + " codes and " + std::to_string(blocks) +
                                " scales, got " + std::to_string(c.numel()) + " and " +
                                std::to_string(s.numel()));
  Tensor out = quanta::detail::make_tensor(shape, DType::nf4, Device::cpu());
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
    uint8_t* unit = po + u * static_cast<int64_t>(kNF4UnitBytes);
    for (size_t j = 0; j < kNF4CodeBytes; ++j)
      unit[j] = static_cast<uint8_t>((code[2 * j] << 4) | code[2 * j + 1]);
    const float scale = ps[begin / block_size];
    std::memcpy(unit + kNF4CodeBytes, &scale, sizeof scale);
  }
  return out;
}

Tensor nf4_codes(const Tensor& q) {
  check_nf4(q, "nf4_codes");
  const int64_t n = q.numel();
  Tensor out = quanta::detail::make_tensor({n}, DType::u8, Device::cpu());
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
  const detail::NF4Runs w = detail::unit_runs(q);
  Tensor out = quanta::detail::make_tensor({w.runs()}, DType::f32, Device::cpu());
  float* po = out.data<float>();
  for (int64_t u = 0; u < w.runs(); ++u) po[u] = w.scale_of(u);
  return out;
}

}  // namespace quanta::quant
