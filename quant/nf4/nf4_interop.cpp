#include "quant/nf4/nf4_interop.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <vector>

#include "engine/factory.h"
#include "quant/kernels/table.h"
#include "quant/nf4/double_quant.h"
#include "quant/nf4/nf4_format.h"
#include "quant/nf4/nf4_runs.h"

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
  Tensor codes = quanta::detail::make_tensor({n}, DType::u8, Device::cpu());
  const uint8_t* pp = p.data<uint8_t>();
  uint8_t* pc = codes.data<uint8_t>();
  for (int64_t i = 0; i < n; ++i) pc[i] = i % 2 == 0 ? pp[i / 2] >> 4 : pp[i / 2] & 15;
  return codes;
}

// A shape read from a file: every later size computation multiplies it out.
void check_file_shape(const Shape& shape, const char* op, const std::string& where) {
  if (!checked_numel(shape))
    throw std::invalid_argument(std::string("[") + op + "] '" + where + "': shape " +
                                shape_str(shape) +
                                " has a negative size or overflows 64-bit sizes");
}

// The packed codes as the bytes they are. bitsandbytes' quant_storage views
// them as another dtype ([bytes / size, 1]; FSDP-QLoRA stores bf16 so that
// the shards of 4-bit and float parameters split alike): the bytes, in
// memory order, are the same stream as uint8 storage's.
Tensor packed_bytes(const Tensor& stored) {
  if (stored.dtype() == DType::u8) return stored;
  const Tensor c = stored.detach().to(Device::cpu()).contiguous();
  const auto bytes = static_cast<int64_t>(c.numel() * element_size(c.dtype()));
  return blob(c.raw_data(), {bytes, 1}, DType::u8);
}

const Tensor& need(const std::map<std::string, Tensor>& m, const std::string& key, const char* op) {
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

// Throws unless `s` is a consistent NF4 state: a block size the kernels
// handle (32 or a multiple of 64), the NF4 table, (n + 1) / 2 packed bytes
// and one scale (or scale code) per block.
void check_bnb(const BnbNF4State& s, const char* op) {
  const std::string o = std::string("[") + op + "] ";
  if (s.blocksize != 32 && (s.blocksize <= 0 || s.blocksize % kNF4UnitElems != 0))
    throw std::invalid_argument(o + "blocksize must be 32 or a multiple of 64, got " +
                                std::to_string(s.blocksize));
  if (!s.packed.defined() || !s.absmax.defined() || !s.quant_map.defined())
    throw std::invalid_argument(o + "packed, absmax and quant_map must be set");
  const Tensor qmap = f32_cpu(s.quant_map);
  if (qmap.numel() != 16 || !std::equal(kNF4Values.begin(), kNF4Values.end(), qmap.data<float>()))
    throw std::invalid_argument(o +
                                "quant_map is not the NF4 table (FP4 or a custom map "
                                "cannot be imported)");
  const int64_t n = numel_of(s.shape);
  if (s.packed.numel() != (n + 1) / 2)
    throw std::invalid_argument(o + "packed holds " + std::to_string(s.packed.numel()) +
                                " bytes, expected " + std::to_string((n + 1) / 2) + " for " +
                                std::to_string(n) + " elements");
  const int64_t blocks = (n + s.blocksize - 1) / s.blocksize;
  if (s.absmax.numel() != blocks)
    throw std::invalid_argument(o + "absmax has " + std::to_string(s.absmax.numel()) +
                                " entries, expected " + std::to_string(blocks));
}

// A state holding `packed` and f32 `scales`, double-quantized when asked.
BnbNF4State make_state(const Tensor& packed, const std::vector<float>& scales, int64_t block,
                       const Shape& shape, bool double_quant) {
  BnbNF4State s;
  s.shape = shape;
  s.blocksize = block;
  s.double_quant = double_quant;
  s.packed = packed;
  s.quant_map = blob(kNF4Values.data(), {16}, DType::f32);
  const int64_t blocks = static_cast<int64_t>(scales.size());
  if (!double_quant) {
    s.absmax = blob(scales.data(), {blocks}, DType::f32);
    return s;
  }
  const DoubleQuantState dq = double_quantize(scales.data(), blocks, kNF4DoubleQuantGroup);
  s.absmax = blob(dq.codes.data(), {blocks}, DType::u8);
  s.nested_absmax =
      blob(dq.group_absmax.data(), {static_cast<int64_t>(dq.group_absmax.size())}, DType::f32);
  s.nested_quant_map = blob(dq.map.data(), {256}, DType::f32);
  s.nested_offset = dq.offset;
  s.nested_blocksize = dq.group;
  return s;
}

std::vector<float> to_vector_f32(const Tensor& t) {
  const Tensor f = f32_cpu(t);
  return std::vector<float>(f.data<float>(), f.data<float>() + f.numel());
}

}  // namespace

BnbNF4State quantize_bnb(const Tensor& x, const NF4Options& o) {
  check_options(o);
  const Tensor xf = detail::as_f32_cpu(x, "quantize_bnb");
  const int64_t n = xf.numel();
  const int64_t run = std::min(o.block_size, kNF4UnitElems);
  Tensor packed = quanta::detail::make_tensor({(n + 1) / 2, 1}, DType::u8, Device::cpu());
  // bitsandbytes' layout is built on the host (interop), with the CPU kernels.
  const QuantKernelTable& host = quant_kernels(Device::cpu());
  std::vector<float> absmax(static_cast<size_t>((n + o.block_size - 1) / o.block_size));
  host.nf4_absmax(xf.data<float>(), n, o.block_size, absmax.data());
  if (n > 0)
    host.nf4_encode(
        xf.data<float>(), n, o.block_size, absmax.data(), absmax.data(),
        {.run = run, .codes = packed.data<uint8_t>(), .code_stride = run / 2, .pad_runs = false});
  BnbNF4State state = make_state(packed, absmax, o.block_size, x.shape(), o.double_quant);
  if (x.dtype() == DType::bf16 || x.dtype() == DType::f16) state.dtype = x.dtype();
  return state;
}

Tensor bnb_scales(const BnbNF4State& s) {
  check_bnb(s, "bnb_scales");
  if (!s.double_quant) return f32_cpu(s.absmax).reshape({s.absmax.numel()});
  DoubleQuantState dq;
  const Tensor q = u8_cpu(s.absmax);
  dq.codes.assign(q.data<uint8_t>(), q.data<uint8_t>() + q.numel());
  if (!s.nested_absmax.defined() || !s.nested_quant_map.defined())
    throw std::invalid_argument(
        "[bnb_scales] double quant needs nested_absmax and "
        "nested_quant_map");
  dq.group_absmax = to_vector_f32(s.nested_absmax);
  const std::vector<float> map = to_vector_f32(s.nested_quant_map);
  if (map.size() != 256)
    throw std::invalid_argument("[bnb_scales] nested_quant_map must have 256 entries, got " +
                                std::to_string(map.size()));
  std::copy(map.begin(), map.end(), dq.map.begin());
  dq.offset = s.nested_offset;
  dq.group = s.nested_blocksize;
  const std::vector<float> rec = double_dequantize(dq);
  return blob(rec.data(), {static_cast<int64_t>(rec.size())}, DType::f32);
}

std::size_t bnb_payload_bytes(const BnbNF4State& s) {
  std::size_t b = s.packed.nbytes() + s.absmax.nbytes();
  if (s.double_quant && s.nested_absmax.defined()) b += s.nested_absmax.nbytes();
  return b;
}

Tensor dequantize(const BnbNF4State& s, DType dtype) {
  detail::check_dequant_dtype(dtype, "dequantize");
  const Tensor scales = bnb_scales(s);
  const Tensor packed = u8_cpu(s.packed);
  Tensor out = quanta::detail::make_tensor(s.shape, dtype, Device::cpu());
  quant_kernels(Device::cpu())
      .nf4_decode(detail::packed_runs(packed.data<uint8_t>(), scales.data<float>(), out.numel(),
                                      s.blocksize),
                  dtype, out.raw_data());
  return out;
}

BnbNF4State to_bnb(const Tensor& nf4_any, bool double_quant, int64_t block_size) {
  check_nf4(nf4_any, "to_bnb");
  // Layout conversion, on the host.
  const Tensor nf4 = nf4_any.to(Device::cpu());
  if (block_size <= 0 || block_size % kNF4UnitElems != 0)
    throw std::invalid_argument("[to_bnb] block_size must be a positive multiple of 64, got " +
                                std::to_string(block_size));
  const int64_t n = nf4.numel();
  const std::vector<uint8_t> packed = packed_codes(nf4);
  const Tensor units = nf4_unit_scales(nf4);
  const float* pu = units.data<float>();
  const int64_t per_block = block_size / kNF4UnitElems;
  const int64_t blocks = (n + block_size - 1) / block_size;
  std::vector<float> scales(static_cast<size_t>(blocks));
  for (int64_t b = 0; b < blocks; ++b) {
    scales[static_cast<size_t>(b)] = pu[b * per_block];
    for (int64_t u = b * per_block; u < std::min(units.numel(), (b + 1) * per_block); ++u)
      if (std::memcmp(&pu[u], &pu[b * per_block], sizeof(float)) != 0)
        throw std::invalid_argument("[to_bnb] the units of block " + std::to_string(b) +
                                    " have different scales: the tensor was not quantized "
                                    "with block size " +
                                    std::to_string(block_size));
  }
  return make_state(blob(packed.data(), {static_cast<int64_t>(packed.size()), 1}, DType::u8),
                    scales, block_size, nf4.shape(), double_quant);
}

BnbNF4State to_bnb(const BnbNF4State& s, bool double_quant) {
  if (s.double_quant == double_quant) return s;
  const Tensor scales = bnb_scales(s);
  BnbNF4State out = make_state(s.packed, to_vector_f32(scales), s.blocksize, s.shape, double_quant);
  out.dtype = s.dtype;
  return out;
}

Tensor from_bnb(const BnbNF4State& s) {
  check_bnb(s, "from_bnb");
  if (s.blocksize % kNF4UnitElems != 0)
    throw std::invalid_argument("[from_bnb] blocksize " + std::to_string(s.blocksize) +
                                " needs two scales per 64-element unit of the nf4 dtype; "
                                "keep block-32 weights in bitsandbytes' layout");
  const int64_t n = numel_of(s.shape);
  const Tensor codes = codes_from_packed(s.packed, n, "from_bnb");
  return nf4_from_codes(codes, bnb_scales(s), s.shape, s.blocksize);
}

void append_bnb_tensors(io::TensorMap& out, const std::string& name, const BnbNF4State& s) {
  out.emplace_back(name, s.packed);
  out.emplace_back(name + ".absmax", s.absmax);
  out.emplace_back(name + ".quant_map", s.quant_map);
  // bitsandbytes' QuantState.as_dict through Python's json.dumps: its key
  // order, ", " and ": " separators, the offset as Python prints a double
  // (shortest round trip, as nlohmann prints it), so the bytes are its own.
  std::string shape;
  for (std::size_t i = 0; i < s.shape.size(); ++i)
    shape += (i ? ", " : "") + std::to_string(s.shape[i]);
  std::string meta = std::string(R"({"quant_type": "nf4", "blocksize": )") +
                     std::to_string(s.blocksize) + R"(, "dtype": ")" + torch_name(s.dtype) +
                     R"(", "shape": [)" + shape + "]";
  if (s.double_quant) {
    out.emplace_back(name + ".nested_absmax", s.nested_absmax);
    out.emplace_back(name + ".nested_quant_map", s.nested_quant_map);
    meta += R"(, "nested_blocksize": )" + std::to_string(s.nested_blocksize) +
            R"(, "nested_dtype": "float32", "nested_offset": )" +
            json(static_cast<double>(s.nested_offset)).dump();
  }
  out.emplace_back(name + ".quant_state.bitsandbytes__nf4", string_to_bytes(meta + "}"));
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
    const std::string dtype = meta.value("dtype", std::string("float32"));
    s.dtype = parse_dtype(dtype);
    if (s.dtype != DType::f32 && s.dtype != DType::bf16 && s.dtype != DType::f16)
      throw std::invalid_argument("[read_bnb_tensors] '" + key + "' has dtype " + dtype +
                                  ", not float32, bfloat16 or float16");
    s.double_quant = meta.contains("nested_blocksize");
    if (s.double_quant) {
      s.nested_blocksize = meta.at("nested_blocksize").get<int64_t>();
      s.nested_offset = static_cast<float>(meta.at("nested_offset").get<double>());
    }
  } catch (const json::exception& e) {
    throw std::invalid_argument("[read_bnb_tensors] '" + key + "': " + e.what());
  }
  check_file_shape(s.shape, "read_bnb_tensors", key);
  s.packed = packed_bytes(need(t, name, op));
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
  const int64_t group = int64_t{64} * 256;
  if (nf4.numel() % group != 0)
    throw std::invalid_argument("[to_torchao] torchao needs numel % " + std::to_string(group) +
                                " == 0, got " + std::to_string(nf4.numel()) + " elements");
  return to_torchao(to_bnb(nf4, false));
}

TorchaoNF4State to_torchao(const BnbNF4State& b) {
  TorchaoNF4State s;
  s.shape = b.shape;
  s.block_size = b.blocksize;
  const int64_t n = numel_of(b.shape);
  const int64_t group = s.block_size * s.scaler_block_size;
  if (n % group != 0)
    throw std::invalid_argument("[to_torchao] torchao needs numel % " + std::to_string(group) +
                                " == 0, got " + std::to_string(n) + " elements");
  const Tensor scales = bnb_scales(b);
  s.quantized_data = u8_cpu(b.packed).reshape({n / 2});
  const float* a = scales.data<float>();
  const int64_t blocks = scales.numel(), groups = blocks / s.scaler_block_size;
  double sum = 0;
  for (int64_t i = 0; i < blocks; ++i) sum += a[i];
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
      const int64_t k = g * s.scaler_block_size + i;
      const float v = std::nearbyint((a[k] - mean) * f);
      q[static_cast<size_t>(k)] =
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

BnbNF4State to_bnb(const TorchaoNF4State& s) {
  const int64_t n = numel_of(s.shape);
  const std::vector<float> sc = torchao_scalers(s);
  if (static_cast<int64_t>(sc.size()) * s.block_size != n)
    throw std::invalid_argument("[to_bnb] torchao scalers do not cover the shape " +
                                shape_str(s.shape));
  if (s.quantized_data.numel() != (n + 1) / 2)
    throw std::invalid_argument("[to_bnb] torchao quantized_data holds " +
                                std::to_string(s.quantized_data.numel()) + " bytes, expected " +
                                std::to_string((n + 1) / 2));
  BnbNF4State b = make_state(u8_cpu(s.quantized_data).reshape({(n + 1) / 2, 1}), sc, s.block_size,
                             s.shape, false);
  check_bnb(b, "to_bnb");
  return b;
}

Tensor from_torchao(const TorchaoNF4State& s) { return from_bnb(to_bnb(s)); }

Tensor torchao_dequantize(const TorchaoNF4State& s) {
  const int64_t n = numel_of(s.shape);
  const Tensor codes = codes_from_packed(s.quantized_data, n, "torchao_dequantize");
  const std::vector<float> sc = torchao_scalers(s);
  const Tensor table = f32_cpu(s.nf4);
  Tensor out = quanta::detail::make_tensor(s.shape, DType::f32, Device::cpu());
  float* po = out.data<float>();
  for (int64_t i = 0; i < n; ++i)
    po[i] =
        table.data<float>()[codes.data<uint8_t>()[i]] * sc[static_cast<size_t>(i / s.block_size)];
  return out;
}

void append_torchao_tensors(io::TensorMap& out, std::map<std::string, std::string>& metadata,
                            const std::string& name, const TorchaoNF4State& s) {
  out.emplace_back(name + ".quantized_data", s.quantized_data);
  out.emplace_back(name + ".quantized_scalers", s.quantized_scalers);
  out.emplace_back(name + ".quantization_factor", s.quantization_factor);
  out.emplace_back(name + ".scaler_mean", s.scaler_mean);
  out.emplace_back(name + ".nf4", s.nf4);
  metadata[name + ".torchao_nf4"] = json{{"shape", s.shape},
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
    throw std::invalid_argument("[read_torchao_tensors] no metadata '" + name + ".torchao_nf4'");
  TorchaoNF4State s;
  try {
    const json m = json::parse(it->second);
    s.shape = m.at("shape").get<Shape>();
    s.block_size = m.at("block_size").get<int64_t>();
    s.scaler_block_size = m.at("scaler_block_size").get<int64_t>();
  } catch (const json::exception& e) {
    throw std::invalid_argument("[read_torchao_tensors] metadata of '" + name + "': " + e.what());
  }
  check_file_shape(s.shape, "read_torchao_tensors", it->first);
  s.quantized_data = need(t, name + ".quantized_data", op);
  s.quantized_scalers = need(t, name + ".quantized_scalers", op);
  s.quantization_factor = need(t, name + ".quantization_factor", op);
  s.scaler_mean = need(t, name + ".scaler_mean", op);
  s.nf4 = need(t, name + ".nf4", op);
  return s;
}

}  // namespace quanta::quant
