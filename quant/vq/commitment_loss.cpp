#include "quant/vq/commitment_loss.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "engine/autograd/function.h"
#include "engine/cpu/parallel.h"
#include "engine/device_check.h"
#include "engine/dispatch.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/view.h"

namespace quanta::quant {

namespace {

// |a - b|^2 over one row, in SIMD lanes (GCC keeps a plain float sum serial;
// the row pointers are parameters so no closure load blocks vectorising).
template <class T>
T squared_distance(const T* a, const T* b, int64_t d) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t e = 0; e < d; ++e) s += (a[e] - b[e]) * (a[e] - b[e]);
  return s;
}

}  // namespace

template <class T>
std::vector<T> row_weights(const Tensor& valid, int64_t rows) {
  if (!valid.defined()) return {};
  const std::vector<uint8_t> v = valid.to_vector<uint8_t>();
  if (static_cast<int64_t>(v.size()) != rows)
    throw std::invalid_argument("[commitment_loss] valid has " + std::to_string(v.size()) +
                                " entries for " + std::to_string(rows) + " tokens");
  return std::vector<T>(v.begin(), v.end());
}
template std::vector<float> row_weights<float>(const Tensor&, int64_t);
template std::vector<double> row_weights<double>(const Tensor&, int64_t);

SquaredError masked_squared_error(const Tensor& x, const Tensor& q, const Tensor& valid) {
  const Tensor xc = contiguous(x.detach()), qc = contiguous(q.detach());
  const int64_t d = xc.size(-1);
  const int64_t rows = d == 0 ? 0 : xc.numel() / d;
  return dispatch_float(xc.dtype(), "commitment_loss", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const std::vector<T> w = row_weights<T>(valid, rows);
    const T* px = xc.data<T>();
    const T* pq = qc.data<T>();
    // Rows in chunks; each chunk's partial sum in f64, added in order, so
    // the total does not depend on the thread count.
    const int64_t chunk = 256;
    const int64_t chunks = (rows + chunk - 1) / chunk;
    std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
    cpu::parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t c = lo; c < hi; ++c) {
        double s = 0;
        for (int64_t r = c * chunk; r < std::min(rows, (c + 1) * chunk); ++r) {
          if (!w.empty() && w[r] == T(0)) continue;
          s += squared_distance(px + r * d, pq + r * d, d);
        }
        partial[c] = s;
      }
    });
    SquaredError out;
    for (double p : partial) out.total += p;
    double count = 0;
    if (w.empty())
      count = double(rows);
    else
      for (T v : w) count += double(v);
    out.elements = count * double(d);
    return out;
  });
}

Tensor commitment_loss(const Tensor& x, const Tensor& q, const Tensor& valid) {
  detail::check_cpu("commitment_loss", {&x, &q, &valid});
  if (x.shape() != q.shape() || x.dtype() != q.dtype() || x.dim() < 1)
    throw std::invalid_argument("[commitment_loss] x and q must share shape and dtype, got " +
                                shape_str(x.shape()) + " and " + shape_str(q.shape()));
  const int64_t d = x.size(-1);
  const int64_t rows = d == 0 ? 0 : x.numel() / d;
  autograd::Function fn;
  fn.name = "commitment_loss";
  // count * d, shared by forward and backward.
  auto denom = std::make_shared<double>(0.0);
  fn.forward = [=](const std::vector<Tensor>& in) {
    const SquaredError e = masked_squared_error(in[0], in[1], valid);
    *denom = e.elements;
    const double value = e.elements > 0 ? e.total / e.elements : 0.0;
    return std::vector<Tensor>{scalar(value, options_of(in[0]))};
  };
  const bool q_grad = q.requires_grad();
  fn.backward = [=, xs = x.detach(), qs = q.detach()](const std::vector<Tensor>& grads) {
    const Tensor xc = contiguous(xs), qc = contiguous(qs);
    // Uninitialised: every element is written below (0 for masked rows).
    Tensor gx = *denom > 0 ? empty(xs.shape(), options_of(xs)) : zeros(xs.shape(), options_of(xs));
    if (*denom > 0) {
      const double g = grads[0].item() * 2.0 / *denom;
      dispatch_float(xc.dtype(), "commitment_loss", [&](auto tag) {
        using T = typename decltype(tag)::type;
        const std::vector<T> w = row_weights<T>(valid, rows);
        const T* px = xc.data<T>();
        const T* pq = qc.data<T>();
        T* out = gx.data<T>();
        const int64_t grain = std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(d, 1));
        cpu::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
          for (int64_t r = lo; r < hi; ++r) {
            T* o = out + r * d;
            if (!w.empty() && w[r] == T(0)) {  // masked: exactly 0, whatever x holds
              std::fill(o, o + d, T(0));
              continue;
            }
            for (int64_t e = 0; e < d; ++e) o[e] = T(g) * (px[r * d + e] - pq[r * d + e]);
          }
        });
      });
    }
    return std::vector<Tensor>{gx, q_grad ? -gx : Tensor()};
  };
  return autograd::apply(fn, {x, q})[0];
}

}  // namespace quanta::quant
