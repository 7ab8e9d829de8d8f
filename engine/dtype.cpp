#include "engine/dtype.h"

#include <algorithm>
#include <array>
#include <stdexcept>

namespace quanta {
namespace {

// Indexed by DType. nf4's row is the layout of quant/nf4/nf4_format.h: units
// of 64 elements, each 32 bytes of packed 4-bit codes then an f32 scale, so
// every unit is self-contained and byte copies of whole units are exact.
constexpr std::array<DTypeInfo, 9> kTable = {{
    {"f32", 4, 1, true, false, true, "float32"},
    {"f64", 8, 1, true, false, true, "float64"},
    {"bf16", 2, 1, true, false, true, "bfloat16"},
    {"f16", 2, 1, true, false, true, "float16"},
    {"i32", 4, 1, false, true, true, "int32"},
    {"i64", 8, 1, false, true, true, "int64"},
    {"u8", 1, 1, false, true, true, "uint8"},
    {"bool", 1, 1, false, false, true, "bool"},
    {"nf4", 36, 64, false, false, false, nullptr},
}};
static_assert(kTable.size() == static_cast<std::size_t>(DType::nf4) + 1,
              "one traits row per dtype");
// Storage sizes divide by block_elems and multiply by block_bytes unchecked
// (tensor.cpp's storage_bytes): every row must have a layout.
static_assert(std::all_of(kTable.begin(), kTable.end(),
                          [](const DTypeInfo& d) {
                            return d.block_bytes > 0 && d.block_elems > 0;
                          }),
              "every dtype has a storage layout");
static_assert(sizeof(bf16) == 2 && sizeof(f16) == 2);

int rank_of(DType t) {
  switch (t) {
    case DType::boolean:
      return 0;
    case DType::u8:
      return 1;
    case DType::i32:
      return 2;
    case DType::i64:
      return 3;
    case DType::f16:
      return 4;
    case DType::bf16:
      return 5;
    case DType::f32:
      return 6;
    case DType::f64:
      return 7;
    case DType::nf4:
      return -1;
  }
  return -1;
}

}  // namespace

const DTypeInfo& dtype_info(DType t) {
  auto i = static_cast<std::size_t>(t);
  if (i >= kTable.size()) throw std::invalid_argument("[dtype] unknown dtype id");
  return kTable[i];
}

std::size_t element_size(DType t) {
  const auto& info = dtype_info(t);
  if (info.block_elems != 1)
    throw std::invalid_argument(std::string("[element_size] dtype ") + info.name +
                                " is block-quantized");
  return info.block_bytes;
}

DType parse_dtype(const std::string& s) {
  if (s == "f32" || s == "float32" || s == "float" || s == "F32") return DType::f32;
  if (s == "f64" || s == "float64" || s == "double" || s == "F64") return DType::f64;
  if (s == "bf16" || s == "bfloat16" || s == "BF16") return DType::bf16;
  if (s == "f16" || s == "float16" || s == "half" || s == "F16") return DType::f16;
  if (s == "i32" || s == "int32" || s == "I32") return DType::i32;
  if (s == "i64" || s == "int64" || s == "I64") return DType::i64;
  if (s == "u8" || s == "uint8" || s == "U8") return DType::u8;
  if (s == "bool" || s == "BOOL") return DType::boolean;
  if (s == "nf4") return DType::nf4;
  throw std::invalid_argument("[parse_dtype] unknown dtype: got '" + s + "'");
}

const char* torch_name(DType t) {
  const char* name = dtype_info(t).torch_name;
  if (!name)
    throw std::invalid_argument(std::string("[torch_name] ") + dtype_name(t) +
                                " has no PyTorch dtype");
  return name;
}

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  if (!dtype_info(a).arithmetic || !dtype_info(b).arithmetic)
    throw std::invalid_argument(std::string("[promote_types] dtype ") +
                                (dtype_info(a).arithmetic ? dtype_name(b) : dtype_name(a)) +
                                " does not support arithmetic");
  // bf16 with f16 has no exact common 16-bit type: compute in f32.
  if ((a == DType::bf16 && b == DType::f16) || (a == DType::f16 && b == DType::bf16))
    return DType::f32;
  return rank_of(a) >= rank_of(b) ? a : b;
}

DType to_floating(DType t) { return is_floating(t) ? t : DType::f32; }

}  // namespace quanta
