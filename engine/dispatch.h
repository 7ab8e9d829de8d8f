#pragma once
// Runs a generic lambda with the C++ type of a runtime dtype. The error names
// the op and the dtype it cannot take.
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "engine/dtype.h"

namespace quanta {

namespace detail {
template <class T>
struct TypeTag {
  using type = T;
};
[[noreturn]] inline void bad_dtype(const char* op, DType t, const char* what) {
  throw std::invalid_argument(std::string("[") + op + "] dtype " + dtype_name(t) +
                              " is not supported (" + what + ")");
}
}  // namespace detail

/** Throws "[op] dtype nf4 does not support arithmetic (a byte-only format:
 * dequantize it first)" when one of `dtypes` is byte-only. */
inline void check_arithmetic(const char* op, std::initializer_list<DType> dtypes) {
  for (DType t : dtypes)
    if (!dtype_info(t).arithmetic)
      throw std::invalid_argument(std::string("[") + op + "] dtype " + dtype_name(t) +
                                  " does not support arithmetic (a byte-only format: "
                                  "dequantize it first)");
}

/** f32 and f64: the dtypes CPU floating kernels compute in. */
template <class F>
decltype(auto) dispatch_float(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f32:
      return f(detail::TypeTag<float>{});
    case DType::f64:
      return f(detail::TypeTag<double>{});
    default:
      detail::bad_dtype(op, t, "expected f32 or f64");
  }
}

/** Every arithmetic dtype computed on the CPU (no bool, no 16-bit floats). */
template <class F>
decltype(auto) dispatch_numeric(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::i32:
      return f(detail::TypeTag<int32_t>{});
    case DType::i64:
      return f(detail::TypeTag<int64_t>{});
    case DType::u8:
      return f(detail::TypeTag<uint8_t>{});
    case DType::f32:
    case DType::f64:
      return dispatch_float(t, op, f);
    default:
      detail::bad_dtype(op, t, "expected f32, f64, i32, i64 or u8");
  }
}

/** Every plain dtype, including bool and the 16-bit floats (copies, fills). */
template <class F>
decltype(auto) dispatch_all(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::bf16:
      return f(detail::TypeTag<bf16>{});
    case DType::f16:
      return f(detail::TypeTag<f16>{});
    case DType::boolean:
      return f(detail::TypeTag<bool>{});
    case DType::f32:
    case DType::f64:
    case DType::i32:
    case DType::i64:
    case DType::u8:
      return dispatch_numeric(t, op, f);
    default:
      detail::bad_dtype(op, t, "a byte-only format: dequantize it first");
  }
}

/** Calls f(TypeTag<H>) and returns true when t is a 16-bit float (bf16 or
 * f16); returns false, calling nothing, for every other dtype. */
template <class F>
bool visit_half(DType t, F&& f) {
  if (t == DType::bf16) {
    f(detail::TypeTag<bf16>{});
    return true;
  }
  if (t == DType::f16) {
    f(detail::TypeTag<f16>{});
    return true;
  }
  return false;
}

}  // namespace quanta
