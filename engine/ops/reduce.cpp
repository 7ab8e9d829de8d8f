// sum, mean and sum_to: the reductions autograd itself needs. The other
// reductions live in reductions.cpp.
#include "engine/ops/reduce.h"

#include <Eigen/Core>

#include "engine/autograd/node.h"
#include "engine/cpu/parallel.h"
#include "engine/cpu/reduce_plan.h"
#include "engine/device_check.h"
#include "engine/dispatch.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/elementwise_kernels.h"
#include "engine/ops/view.h"

namespace quanta {
namespace {

// Sum of n contiguous values; long rows are split across threads.
template <class T, class Acc>
Acc row_sum(const T* p, int64_t n, bool parallel) {
  using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
  if (!parallel || n <= cpu::kGrainElements) {
    if constexpr (std::is_floating_point_v<T>) {
      return static_cast<Acc>(Eigen::Map<const Arr>(p, n).sum());
    } else {
      Acc s = 0;
      for (int64_t i = 0; i < n; ++i) s += static_cast<Acc>(p[i]);
      return s;
    }
  }
  const int threads = std::max(1, num_threads());
  std::vector<Acc> partial(threads, Acc(0));
  const int64_t step = (n + threads - 1) / threads;
  cpu::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const int64_t b = c * step, e = std::min(n, b + step);
      if (b < e) partial[c] = row_sum<T, Acc>(p + b, e - b, false);
    }
  });
  Acc s = 0;
  for (Acc v : partial) s += v;
  return s;
}

// Gradient of a reduction: g broadcast back over the reduced dims.
Tensor expand_back(const Tensor& g, const Shape& kept_shape, const Shape& in_shape) {
  return expand(reshape(g, kept_shape), in_shape);
}

}  // namespace

Tensor sum(const Tensor& x, const Dims& dims, bool keepdim) {
  detail::check_cpu("sum", {&x});
  const DType out_dt = is_floating(x.dtype()) ? x.dtype() : DType::i64;
  const DType ct = detail::cpu_compute_dtype(out_dt);
  Tensor src = detail::cpu_compute_dtype(x.dtype()) != x.dtype() ? detail::as_plain(x, ct) : x;
  auto p = cpu::plan_reduce(src, dims, keepdim, "sum");
  Tensor out = detail::make_tensor(p.out_shape, ct, Device::cpu());
  dispatch_all(p.rows.dtype(), "sum", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (cpu::is_half_v<T>) {
      throw std::logic_error("[sum] 16-bit input reached the kernel");
    } else {
      using O = std::conditional_t<std::is_floating_point_v<T>, T, int64_t>;
      const T* in = p.rows.data<T>();
      O* o = out.data<O>();
      const int64_t inner = p.inner;
      if (p.outer == 1) {
        o[0] = row_sum<T, O>(in, inner, true);
      } else {
        cpu::parallel_for(0, p.outer, std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(inner, 1)),
                          [&](int64_t lo, int64_t hi) {
          for (int64_t r = lo; r < hi; ++r) o[r] = row_sum<T, O>(in + r * inner, inner, false);
        });
      }
    }
  });
  if (ct != out_dt) out = detail::as_plain(out, out_dt);
  return autograd::record("sum", out, {x},
                          [kept = p.kept_shape, in = x.shape()](const Tensor& g) {
    return std::vector<Tensor>{expand_back(g, kept, in)};
  });
}

Tensor mean(const Tensor& x, const Dims& dims, bool keepdim) {
  if (!is_floating(x.dtype()))
    throw std::invalid_argument(std::string("[mean] needs a floating tensor, got ") +
                                dtype_name(x.dtype()));
  const auto wrapped = wrap_dims(dims, x.dim(), "mean");
  int64_t count = 1;
  // A 0-d tensor takes dim 0 / -1 but reduces over nothing (count 1).
  if (x.dim() > 0)
    for (int64_t d : wrapped) count *= x.shape()[d];
  // 0 / 0 gives NaN for an empty reduction, as in NumPy and PyTorch.
  return div(sum(x, dims, keepdim), scalar_like(x, static_cast<double>(count)));
}

Tensor sum_to(const Tensor& x, const Shape& shape) {
  if (x.shape() == shape) return x;
  const int64_t lead = x.dim() - static_cast<int64_t>(shape.size());
  if (lead < 0)
    throw std::invalid_argument("[sum_to] cannot sum shape " + shape_str(x.shape()) + " to " +
                                shape_str(shape));
  Dims dims;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (d < lead) {
      dims.push_back(d);
    } else if (shape[d - lead] == 1 && x.shape()[d] != 1) {
      dims.push_back(d);
    } else if (shape[d - lead] != x.shape()[d]) {
      throw std::invalid_argument("[sum_to] cannot sum shape " + shape_str(x.shape()) +
                                  " to " + shape_str(shape));
    }
  }
  if (dims.empty()) return reshape(x, shape);
  return reshape(sum(x, dims, true), shape);
}

}  // namespace quanta
