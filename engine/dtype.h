#pragma once
// Element types and their traits table: one row per dtype (as in ggml's type
// traits), so adding a block-quantized type such as nf4 is adding one row.
#include <cstddef>
#include <cstdint>
#include <string>

#include "engine/eigen.h"  // Eigen::half, Eigen::bfloat16: well-kept conversions

namespace quanta {

enum class DType : uint8_t { f32, f64, bf16, f16, i32, i64, u8, boolean, nf4 };

using bf16 = Eigen::bfloat16;
using f16 = Eigen::half;

/** Static facts about a dtype. Byte-only dtypes refuse arithmetic. */
struct DTypeInfo {
  const char* name;
  std::size_t block_bytes;  // bytes of one storage block
  std::size_t block_elems;  // logical elements in one block (1 for plain types)
  bool is_floating;
  bool is_integral;        // i32, i64, u8 (bool counts as neither)
  bool arithmetic;         // false for byte-only formats (nf4)
  const char* torch_name;  // PyTorch's name ("float32", "bfloat16"); null if it has none
};

/** The traits row of `t`. */
const DTypeInfo& dtype_info(DType t);
/** "f32", "i64", ... */
inline const char* dtype_name(DType t) { return dtype_info(t).name; }
/** Bytes per element of a plain dtype; throws for block formats. */
std::size_t element_size(DType t);
/** Parses "f32", "float32", "bf16", ... ; throws std::invalid_argument. */
DType parse_dtype(const std::string& s);
/** PyTorch's name without "torch.": "float32", "bfloat16", "int64", "uint8",
 * "bool", ...; throws std::invalid_argument for a dtype PyTorch lacks (nf4). */
const char* torch_name(DType t);
/** The dtype two operands are computed in (NumPy-style promotion). */
DType promote_types(DType a, DType b);
/** f32 for integral/bool inputs, the dtype itself for floating inputs. */
DType to_floating(DType t);

inline bool is_floating(DType t) { return dtype_info(t).is_floating; }
inline bool is_integral(DType t) { return dtype_info(t).is_integral; }

/** Maps a C++ type to its dtype. */
template <class T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct dtype_of<double> {
  static constexpr DType value = DType::f64;
};
template <>
struct dtype_of<bf16> {
  static constexpr DType value = DType::bf16;
};
template <>
struct dtype_of<f16> {
  static constexpr DType value = DType::f16;
};
template <>
struct dtype_of<int32_t> {
  static constexpr DType value = DType::i32;
};
template <>
struct dtype_of<int64_t> {
  static constexpr DType value = DType::i64;
};
template <>
struct dtype_of<uint8_t> {
  static constexpr DType value = DType::u8;
};
template <>
struct dtype_of<bool> {
  static constexpr DType value = DType::boolean;
};
template <class T>
inline constexpr DType dtype_v = dtype_of<T>::value;

}  // namespace quanta
