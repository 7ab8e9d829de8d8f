#include "quant/nf4/nf4_interop.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <vector>

#include "engine/factory.h"
#include "quant/nf4/double_quant.h"
#include "quant/nf4/nf4_format.h"

namespace quanta::quant {
namespace {

using json = nlohmann::json;

// A copy of host memory as a tensor of exactly `dtype`.
Tensor blob(const void* data, const Shape& shape, DType dtype) {
  return from_blob(data, shape, dtype, {.dtype = dtype});
}

Tensor f32_cpu(const Tensor& t) { return t.detach().to(Device::cpu()).to(DType::f32).contiguous(); }
Tensor u8_cpu(const Tensor& t) { return t.detach().to(Device::cpu()).to(DType::u8).contiguous(); }

// torchao's NF4 table: the values rounded to 4 decimals.
constexpr std::array<float, 16> kTorchaoNF4 = {
    -1.0000f, -0.6962f, -0.5251f, -0.3949f, -0.2844f, -0.1848f, -0.0911f, 0.0000f,
    0.0796f,  0.1609f,  0.2461f,  0.3379f,  0.4407f,  0.5626f,  0.7230f,  1.0000f};

// Codes of an nf4 tensor packed two per byte (high nibble first), n/2 rounded up.
std::vector<uint8_t> packed_codes(const Tensor& nf4) {
  const int64_t n = nf4.numel();
  std::vector<uint8_t> out(static_cast<size_t>((n + 1) / 2));
  const auto* p = static_cast<const uint8_t*>(nf4.raw_data());
  // Units hold 32 packed bytes each, so the packed stream is their concatenation.
  for (size_t j = 0; j < out.size(); ++j)
    out[j] = p[(j / kNF4CodeBytes) * kNF4UnitBytes + j % kNF4CodeBytes];
  if (n % 2 == 1) out.back() = static_cast<uint8_t>((out.back() & 0xF0) | kNF4ZeroCode);
  return out;
}

Tensor codes_from_packed(const Tensor& packed, int64_t n, const char* op) {
  const Tensor p = u8_cpu(packed);
  if (p.numel() != (n + 1) / 2)
    throw std::invalid_argument(std::string("[") + op + "] packed holds " +
                                std::to_string(p.numel()) + " bytes, expected " +
                                std::to_string((n + 1) / 2) + " for " + std::to_string(n) +
                                " elements");
  Tensor codes = detail::make_tensor({n}, DType::u8, Device::cpu());
  const uint8_t* pp = p.data<uint8_t>();
  uint8_t* pc = codes.data<uint8_t>();
  for (int64_t i = 0; i < n; ++i) pc[i] = i % 2 == 0 ? pp[i / 2] >> 4 : pp[i / 2] & 15;
  return codes;
}

const Tensor& need(const std::map<std::string, Tensor>& m, const std::string& key,
                   const char* op) {
  auto it = m.find(key);
  if (it == m.end())
    throw std::invalid_argument(std::string("[") + op + "] missing tensor '" + key + "'");
  return it->second;
}

std::string bytes_to_string(const Tensor& t) {
  const Tensor u = u8_cpu(t);
  return std::string(reinterpret_cast<const char*>(u.data<uint8_t>()),
                     static_cast<size_t>(u.numel()));
}

Tensor string_to_bytes(const std::string& s) {
  return blob(s.data(), {static_cast<int64_t>(s.size())}, DType::u8);
}

}  // namespace

BnbNF4State to_bnb(const Tensor& nf4, bool double_quant) {
  check_nf4(nf4, "to_bnb");
  BnbNF4State s;
  s.shape = nf4.shape();
  s.blocksize = kNF4UnitElems;
  s.double_quant = double_quant;
  const std::vector<uint8_t> packed = packed_codes(nf4);
  s.packed = blob(packed.data(), {static_cast<int64_t>(packed.size()), 1}, DType::u8);
  s.quant_map = blob(kNF4Values.data(), {16}, DType::f32);
  const Tensor scales = nf4_unit_scales(nf4);
  if (!double_quant) {
    s.absmax = scales;
    return s;
  }
  const DoubleQuantState dq = double_quantize(scales.data<float>(), scales.numel(),
                                              kNF4DoubleQuantGroup);
  s.absmax = blob(dq.codes.data(), {static_cast<int64_t>(dq.codes.size())}, DType::u8);
  s.nested_absmax = blob(dq.group_absmax.data(),
                              {static_cast<int64_t>(dq.group_absmax.size())}, DType::f32);
  s.nested_quant_map = blob(dq.map.data(), {256}, DType::f32);
  s.nested_offset = dq.offset;
  s.nested_blocksize = dq.group;
  return s;
}

Tensor from_bnb(const BnbNF4State& s) {
  const int64_t n = numel_of(s.shape);
  if (s.blocksize <= 0 || s.blocksize % kNF4UnitElems != 0)
    throw std::invalid_argument("[from_bnb] blocksize " + std::to_string(s.blocksize) +
                                " is not a multiple of the 64-element nf4 unit");
  const Tensor qmap = f32_cpu(s.quant_map);
  if (qmap.numel() != 16 ||
      !std::equal(kNF4Values.begin(), kNF4Values.end(), qmap.data<float>()))
    throw std::invalid_argument("[from_bnb] quant_map is not the NF4 table (FP4 or a custom "
                                "map cannot be imported)");
  const Tensor codes = codes_from_packed(s.packed, n, "from_bnb");
  const int64_t blocks = (n + s.blocksize - 1) / s.blocksize;
  if (s.absmax.numel() != blocks)
    throw std::invalid_argument("[from_bnb] absmax has " + std::to_string(s.absmax.numel()) +
                                " entries, expected " + std::to_string(blocks));
  Tensor scales;
  if (!s.double_quant) {
    scales = f32_cpu(s.absmax);
  } else {
    DoubleQuantState dq;
    const Tensor q = u8_cpu(s.absmax);
    dq.codes.assign(q.data<uint8_t>(), q.data<uint8_t>() + q.numel());
    const Tensor a2 = f32_cpu(s.nested_absmax);
    dq.group_absmax.assign(a2.data<float>(), a2.data<float>() + a2.numel());
    const Tensor map = f32_cpu(s.nested_quant_map);
    if (map.numel() != 256)
      throw std::invalid_argument("[from_bnb] nested_quant_map must have 256 entries, got " +
                                  std::to_string(map.numel()));
    std::copy(map.data<float>(), map.data<float>() + 256, dq.map.begin());
    dq.offset = s.nested_offset;
    dq.group = s.nested_blocksize;
    const std::vector<float> rec = double_dequantize(dq);
    scales = blob(rec.data(), {blocks}, DType::f32);
  }
  return nf4_from_codes(codes, scales, s.shape, s.blocksize);
}

void append_bnb_tensors(io::TensorMap& out, const std::string& name, const BnbNF4State& s) {
  out.emplace_back(name, s.packed);
  out.emplace_back(name + ".absmax", s.absmax);
  out.emplace_back(name + ".quant_map", s.quant_map);
  json meta = {{"quant_type", "nf4"},
               {"blocksize", s.blocksize},
               {"dtype", "float32"},
               {"shape", s.shape}};
  if (s.double_quant) {
    out.emplace_back(name + ".nested_absmax", s.nested_absmax);
    out.emplace_back(name + ".nested_quant_map", s.nested_quant_map);
    meta["nested_blocksize"] = s.nested_blocksize;
    meta["nested_dtype"] = "float32";
    meta["nested_offset"] = static_cast<double>(s.nested_offset);
  }
  out.emplace_back(name + ".quant_state.bitsandbytes__nf4", string_to_bytes(meta.dump()));
}

bool has_bnb_tensors(const std::map<std::string, Tensor>& t, const std::string& name) {
  return t.count(name) && t.count(name + ".quant_state.bitsandbytes__nf4");
}

BnbNF4State read_bnb_tensors(const std::map<std::string, Tensor>& t, const std::string& name) {
  const char* op = "read_bnb_tensors";
  const std::string key = name + ".quant_state.bitsandbytes__nf4";
  json meta;
  try {
    meta = json::parse(bytes_to_string(need(t, key, op)));
  } catch (const json::exception& e) {
    throw std::invalid_argument("[read_bnb_tensors] '" + key + "' is not JSON: " + e.what());
  }
  BnbNF4State s;
  try {
    if (meta.at("quant_type").get<std::string>() != "nf4")
      throw std::invalid_argument("[read_bnb_tensors] '" + name + "' is quant_type " +
                                  meta.at("quant_type").get<std::string>() + ", not nf4");
    s.blocksize = meta.at("blocksize").get<int64_t>();
    s.shape = meta.at("shape").get<Shape>();
    s.double_quant = meta.contains("nested_blocksize");
    if (s.double_quant) {
      s.nested_blocksize = meta.at("nested_blocksize").get<int64_t>();
      s.nested_offset = static_cast<float>(meta.at("nested_offset").get<double>());
    }
  } catch (const json::exception& e) {
    throw std::invalid_argument("[read_bnb_tensors] '" + key + "': " + e.what());
  }
  s.packed = need(t, name, op);
  s.absmax = need(t, name + ".absmax", op);
  s.quant_map = need(t, name + ".quant_map", op);
  if (s.double_quant) {
    s.nested_absmax = need(t, name + ".nested_absmax", op);
    s.nested_quant_map = need(t, name + ".nested_quant_map", op);
  }
  return s;
}

// ---- torchao ----

TorchaoNF4State to_torchao(const Tensor& nf4) {
  check_nf4(nf4, "to_torchao");
  TorchaoNF4State s;
  s.shape = nf4.shape();
  const int64_t n = nf4.numel();
  const int64_t group = s.block_size * s.scaler_block_size;
  if (n % group != 0)
    throw std::invalid_argument("[to_torchao] torchao needs numel % " + std::to_string(group) +
                                " == 0, got " + std::to_string(n) + " elements");
  const std::vector<uint8_t> packed = packed_codes(nf4);
  s.quantized_data = blob(packed.data(), {n / 2}, DType::u8);
  const Tensor scales = nf4_unit_scales(nf4);
  const float* a = scales.data<float>();
  const int64_t blocks = scales.numel(), groups = blocks / s.scaler_block_size;
  double sum = 0;
  for (int64_t b = 0; b < blocks; ++b) sum += a[b];
  const float mean = blocks ? static_cast<float>(sum / static_cast<double>(blocks)) : 0.0f;
  std::vector<uint8_t> q(static_cast<size_t>(blocks));
  std::vector<float> factor(static_cast<size_t>(groups));
  for (int64_t g = 0; g < groups; ++g) {
    float amax = 0;
    for (int64_t i = 0; i < s.scaler_block_size; ++i)
      amax = std::max(amax, std::fabs(a[g * s.scaler_block_size + i] - mean));
    // torchao: factor = 256 / (2 * max|c|), q = clamp(round_half_even(c * factor)).
    // A group whose scales all equal the mean has nothing to quantize: any
    // finite factor gives codes 0 (and avoids 0 * inf).
    const float f = amax > 0 ? 256.0f / (2.0f * amax) : 1.0f;
    factor[static_cast<size_t>(g)] = f;
    for (int64_t i = 0; i < s.scaler_block_size; ++i) {
      const int64_t b = g * s.scaler_block_size + i;
      const float v = std::nearbyint((a[b] - mean) * f);
      q[static_cast<size_t>(b)] =
          static_cast<uint8_t>(static_cast<int8_t>(std::clamp(v, -128.0f, 127.0f)));
    }
  }
  s.quantized_scalers = blob(q.data(), {blocks}, DType::u8);
  s.quantization_factor = blob(factor.data(), {groups}, DType::f32);
  s.scaler_mean = blob(&mean, {}, DType::f32);
  s.nf4 = blob(kTorchaoNF4.data(), {16}, DType::f32);
  return s;
}

namespace {
std::vector<float> torchao_scalers(const TorchaoNF4State& s) {
  const Tensor q = u8_cpu(s.quantized_scalers);
  const Tensor f = f32_cpu(s.quantization_factor);
  const float mean = static_cast<float>(s.scaler_mean.item());
  const int64_t blocks = q.numel();
  if (f.numel() * s.scaler_block_size != blocks)
    throw std::invalid_argument("[torchao] " + std::to_string(f.numel()) + " factors for " +
                                std::to_string(blocks) + " scalers");
  std::vector<float> out(static_cast<size_t>(blocks));
  for (int64_t b = 0; b < blocks; ++b) {
    const float v = static_cast<float>(static_cast<int8_t>(q.data<uint8_t>()[b])) /
                    f.data<float>()[b / s.scaler_block_size];
    out[static_cast<size_t>(b)] = v + mean;
  }
  return out;
}
}  // namespace

Tensor from_torchao(const TorchaoNF4State& s) {
  const int64_t n = numel_of(s.shape);
  const Tensor codes = codes_from_packed(s.quantized_data, n, "from_torchao");
  const std::vector<float> sc = torchao_scalers(s);
  if (static_cast<int64_t>(sc.size()) * s.block_size != n)
    throw std::invalid_argument("[from_torchao] scalers do not cover the shape");
  return nf4_from_codes(codes, blob(sc.data(), {static_cast<int64_t>(sc.size())},
                                         DType::f32), s.shape, s.block_size);
}

Tensor torchao_dequantize(const TorchaoNF4State& s) {
  const int64_t n = numel_of(s.shape);
  const Tensor codes = codes_from_packed(s.quantized_data, n, "torchao_dequantize");
  const std::vector<float> sc = torchao_scalers(s);
  const Tensor table = f32_cpu(s.nf4);
  Tensor out = detail::make_tensor(s.shape, DType::f32, Device::cpu());
  float* po = out.data<float>();
  for (int64_t i = 0; i < n; ++i)
    po[i] = table.data<float>()[codes.data<uint8_t>()[i]] *
            sc[static_cast<size_t>(i / s.block_size)];
  return out;
}

void append_torchao_tensors(io::TensorMap& out, std::map<std::string, std::string>& metadata,
                            const std::string& name, const TorchaoNF4State& s) {
  out.emplace_back(name + ".quantized_data", s.quantized_data);
  out.emplace_back(name + ".quantized_scalers", s.quantized_scalers);
  out.emplace_back(name + ".quantization_factor", s.quantization_factor);
  out.emplace_back(name + ".scaler_mean", s.scaler_mean);
  out.emplace_back(name + ".nf4", s.nf4);
  metadata[name + ".torchao_nf4"] =
      json{{"shape", s.shape},
           {"block_size", s.block_size},
           {"scaler_block_size", s.scaler_block_size},
           {"quantized_scalers", "int8 stored as uint8 bit patterns"}}
          .dump();
}

TorchaoNF4State read_torchao_tensors(const std::map<std::string, Tensor>& t,
                                     const std::map<std::string, std::string>& metadata,
                                     const std::string& name) {
  const char* op = "read_torchao_tensors";
  auto it = metadata.find(name + ".torchao_nf4");
  if (it == metadata.end())
    throw std::invalid_argument("[read_torchao_tensors] no metadata '" + name +
                                ".torchao_nf4'");
  TorchaoNF4State s;
  try {
    const json m = json::parse(it->second);
    s.shape = m.at("shape").get<Shape>();
    s.block_size = m.at("block_size").get<int64_t>();
    s.scaler_block_size = m.at("scaler_block_size").get<int64_t>();
  } catch (const json::exception& e) {
    throw std::invalid_argument("[read_torchao_tensors] metadata of '" + name + "': " + e.what());
  }
  s.quantized_data = need(t, name + ".quantized_data", op);
  s.quantized_scalers = need(t, name + ".quantized_scalers", op);
  s.quantization_factor = need(t, name + ".quantization_factor", op);
  s.scaler_mean = need(t, name + ".scaler_mean", op);
  s.nf4 = need(t, name + ".nf4", op);
  return s;
}

}  // namespace quanta::quant
