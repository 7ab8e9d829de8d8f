#pragma once
// The CPU language-model table's entries, one family per file; contracts in
// llm/kernels/table.h. dispatch_llm gives an entry its data and accumulation
// types.
#include <type_traits>

#include "engine/dispatch.h"
#include "llm/kernels/table.h"

namespace quanta::llm::llm_cpu {

template <class T, class A>
struct Types {
  using data = T;
  using acc = A;
};

/** Runs f(Types<T, A>{}) for dtype's data type T (f32, f64, bf16, f16) and
 * its accumulation type A; throws naming `op` for any other dtype. */
template <class F>
void dispatch_llm(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f32:
      return f(Types<float, float>{});
    case DType::f64:
      return f(Types<double, double>{});
    case DType::bf16:
      return f(Types<bf16, float>{});
    case DType::f16:
      return f(Types<f16, float>{});
    default:
      detail::bad_dtype(op, t, "expected f32, f64, bf16 or f16");
  }
}

QUANTA_LLM_KERNEL_ENTRIES(QUANTA_DECLARE_LLM_KERNEL)

}  // namespace quanta::llm::llm_cpu
