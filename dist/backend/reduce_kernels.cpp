#include "dist/backend/reduce_kernels.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace quanta::dist::detail {
namespace {

template <class T, class Acc, class F>
ReduceFn make(F f) {
  return [f](void* c, const void* a, const void* b, std::size_t n) {
    T* out = static_cast<T*>(c);
    const T* x = static_cast<const T*>(a);
    const T* y = static_cast<const T*>(b);
    for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<T>(f(Acc(x[i]), Acc(y[i])));
  };
}

template <class T, class Acc>
ReduceFn typed(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return make<T, Acc>([](Acc a, Acc b) { return a + b; });
    case ReduceOp::prod:
      return make<T, Acc>([](Acc a, Acc b) { return a * b; });
    case ReduceOp::min:
      return make<T, Acc>([](Acc a, Acc b) { return std::min(a, b); });
    case ReduceOp::max:
      return make<T, Acc>([](Acc a, Acc b) { return std::max(a, b); });
  }
  throw std::logic_error("reduce_fn: unknown op");
}

}  // namespace

void check_reducible(const char* op_name, DType dtype, ReduceOp op) {
  const DTypeInfo& info = dtype_info(dtype);
  const std::string what = std::string("[dist::") + op_name + "] ";
  if (!info.arithmetic)
    throw std::invalid_argument(what + "cannot reduce dtype " + info.name +
                                ": it is a byte-only format (broadcast, all_gather and "
                                "all_gather_v move it; dequantize it to reduce)");
  if (dtype == DType::boolean && op != ReduceOp::min && op != ReduceOp::max)
    throw std::invalid_argument(what +
                                "bool tensors reduce only with min (and) or max (or), "
                                "got " +
                                reduce_op_name(op));
  if (op == ReduceOp::avg && !info.is_floating)
    throw std::invalid_argument(what + "avg needs a floating dtype, got " + info.name +
                                " (reduce with sum and divide yourself)");
}

ReduceFn reduce_fn(DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::f32:
      return typed<float, float>(op);
    case DType::f64:
      return typed<double, double>(op);
    case DType::bf16:
      return typed<bf16, float>(op);
    case DType::f16:
      return typed<f16, float>(op);
    case DType::i32:
      return typed<int32_t, int32_t>(op);
    case DType::i64:
      return typed<int64_t, int64_t>(op);
    case DType::u8:
      return typed<uint8_t, uint32_t>(op);
    case DType::boolean:
      return typed<bool, bool>(op);
    default:
      break;
  }
  throw std::invalid_argument(std::string("[dist] no reduction for dtype ") + dtype_name(dtype));
}

void divide(void* data, DType dtype, std::size_t n, double divisor) {
  auto run = [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<T>(static_cast<double>(p[i]) / divisor);
  };
  switch (dtype) {
    case DType::f32:
      run(static_cast<float*>(data));
      return;
    case DType::f64:
      run(static_cast<double*>(data));
      return;
    case DType::bf16:
      run(static_cast<bf16*>(data));
      return;
    case DType::f16:
      run(static_cast<f16*>(data));
      return;
    default:
      throw std::invalid_argument(std::string("[dist] avg on dtype ") + dtype_name(dtype));
  }
}

}  // namespace quanta::dist::detail
