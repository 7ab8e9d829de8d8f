#pragma once
// The argument checks the language-model ops share; each error names the op
// and what was wrong.
#include <cmath>
#include <stdexcept>
#include <string>

#include "engine/dtype.h"
#include "engine/shape.h"
#include "engine/tensor.h"

namespace quanta::llm::detail {

[[noreturn]] inline void bad_argument(const char* op, const std::string& what) {
  throw std::invalid_argument(std::string("[") + op + "] " + what);
}

/** Throws unless t is defined and floating (f32, f64, bf16 or f16). */
inline void check_floating(const char* op, const char* name, const Tensor& t) {
  if (!t.defined()) bad_argument(op, std::string(name) + " is undefined");
  const DType d = t.dtype();
  if (d != DType::f32 && d != DType::f64 && d != DType::bf16 && d != DType::f16)
    bad_argument(
        op, std::string(name) + " has dtype " + dtype_name(d) + "; expected f32, f64, bf16 or f16");
}

/** Throws unless a and b share a dtype. */
inline void check_same_dtype(const char* op, const char* a_name, const Tensor& a,
                             const char* b_name, const Tensor& b) {
  if (a.dtype() != b.dtype())
    bad_argument(op, std::string(a_name) + " is " + dtype_name(a.dtype()) + " but " + b_name +
                         " is " + dtype_name(b.dtype()) + "; convert one of them");
}

/** Throws unless t has `dims` dims. */
inline void check_dims(const char* op, const char* name, const Tensor& t, int64_t dims,
                       const char* layout) {
  if (t.dim() != dims)
    bad_argument(op, std::string(name) + " must be " + layout + ", got " + shape_str(t.shape()));
}

/** The product of all dims but the last. */
inline int64_t leading_rows(const Tensor& t) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.shape()[d];
  return rows;
}

}  // namespace quanta::llm::detail
