#include "quant/nf4/nf4_format.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/factory.h"
#include "quant/kernels/table.h"
#include "quant/nf4/double_quant.h"
#include "quant/nf4/nf4_runs.h"

namespace quanta::quant {

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

Tensor as_f32(const Tensor& x, const char* op) {
  if (!x.defined()) throw std::invalid_argument(std::string("[") + op + "] tensor is undefined");
  if (!is_floating(x.dtype()))
    throw std::invalid_argument(std::string("[") + op + "] expects a floating tensor, got " +
                                dtype_name(x.dtype()));
  return x.detach().to(DType::f32).contiguous();
}

NF4Runs unit_runs(const Tensor& q) {
  return nf4_unit_runs(static_cast<const uint8_t*>(q.raw_data()), q.numel());
}

}  // namespace detail

void check_options(const NF4Options& o) {
  if (std::find(kNF4BlockSizes.begin(), kNF4BlockSizes.end(), o.block_size) == kNF4BlockSizes.end())
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
  const Tensor xf = detail::as_f32(x, "quantize_nf4");
  const QuantKernelTable& kernels = quant_kernels(xf.device());
  const int64_t n = xf.numel();
  Tensor out = quanta::detail::make_tensor(x.shape(), DType::nf4, xf.device());
  if (n == 0) return out;
  const auto* px = static_cast<const float*>(xf.raw_data());
  auto* po = static_cast<uint8_t*>(out.raw_data());
  const int64_t blocks = (n + o.block_size - 1) / o.block_size;
  const Tensor absmax = quanta::detail::make_tensor({blocks}, DType::f32, xf.device());
  auto* pa = static_cast<float*>(absmax.raw_data());
  kernels.nf4_absmax(px, n, o.block_size, pa);
  // Codes use the exact absmax; units store the scale dequantization uses.
  // Double quantization reads all block scales (one per 64 or more elements)
  // and runs on the host.
  Tensor stored = absmax;
  if (o.double_quant) {
    const Tensor a = absmax.to(Device::cpu());
    const std::vector<float> s = double_dequantize(double_quantize(a.data<float>(), blocks));
    stored = from_vector<float>(s, {blocks}).to(xf.device());
  }
  const int64_t unit = static_cast<int64_t>(kNF4UnitBytes);
  kernels.nf4_encode(px, n, o.block_size, pa, static_cast<const float*>(stored.raw_data()),
                     {.run = kNF4UnitElems,
                      .codes = po,
                      .code_stride = unit,
                      .pad_runs = true,
                      .scales = po + kNF4CodeBytes,
                      .scale_stride = unit});
  return out;
}

Tensor dequantize(const Tensor& q, DType dtype) {
  check_nf4(q, "dequantize");
  detail::check_dequant_dtype(dtype, "dequantize");
  Tensor out = quanta::detail::make_tensor(q.shape(), dtype, q.device());
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
  if (out.shape() != q.shape() || !out.is_contiguous() || out.device() != q.device())
    throw std::invalid_argument("[dequantize_into] output must be a contiguous tensor on " +
                                q.device().str() + " of shape " + shape_str(q.shape()) + ", got " +
                                shape_str(out.shape()) + " on " + out.device().str());
  if (q.numel() == 0) return;
  quant_kernels(q.device()).nf4_decode(detail::unit_runs(q), out.dtype(), out.raw_data());
}

Tensor nf4_from_codes(const Tensor& codes, const Tensor& scales, const Shape& shape,
                      int64_t block_size) {
  const int64_t n = numel_of(shape);
  if (block_size <= 0 || block_size % kNF4UnitElems != 0)
    throw std::invalid_argument(
        "[nf4_from_codes] block_size must be a positive multiple of 64, "
        "got " +
        std::to_string(block_size));
  // Format introspection, on the host: the result moves to the codes' device.
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
  return out.to(codes.device());
}

Tensor nf4_codes(const Tensor& nf4) {
  check_nf4(nf4, "nf4_codes");
  // Format introspection, on the host: the result moves to nf4's device.
  const Tensor q = nf4.to(Device::cpu());
  const int64_t n = q.numel();
  Tensor out = quanta::detail::make_tensor({n}, DType::u8, Device::cpu());
  const auto* pq = static_cast<const uint8_t*>(q.raw_data());
  uint8_t* po = out.data<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t byte =
        pq[(i / kNF4UnitElems) * static_cast<int64_t>(kNF4UnitBytes) + (i % kNF4UnitElems) / 2];
    po[i] = i % 2 == 0 ? byte >> 4 : byte & 15;
  }
  return out.to(nf4.device());
}

Tensor nf4_unit_scales(const Tensor& nf4) {
  check_nf4(nf4, "nf4_unit_scales");
  // Format introspection, on the host: the result moves to nf4's device.
  const Tensor q = nf4.to(Device::cpu());
  const detail::NF4Runs w = detail::unit_runs(q);
  Tensor out = quanta::detail::make_tensor({w.runs()}, DType::f32, Device::cpu());
  float* po = out.data<float>();
  for (int64_t u = 0; u < w.runs(); ++u) po[u] = w.scale_of(u);
  return out.to(nf4.device());
}

}  // namespace quanta::quant
