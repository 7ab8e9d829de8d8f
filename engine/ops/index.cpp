// Indexing ops: forward kernels, shape rules and backward formulas together.
// Every index tensor is converted to contiguous i64 and bounds-checked before
// a kernel runs (on a device, by the device), so kernel bodies (which may run
// in parallel) never throw or read out of bounds.
#include "engine/ops/index.h"

#include <algorithm>
#include <array>

#include "engine/autograd/grad_mode.h"
#include "engine/autograd/node.h"
#include "engine/cpu/parallel.h"
#include "engine/device_backend.h"
#include "engine/device_error.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/join.h"
#include "engine/ops/kernel_call.h"
#include "engine/ops/op_helpers.h"
#include "engine/ops/view.h"

namespace quanta {
namespace {

using detail::check_plain;
using detail::str;

[[noreturn]] void index_fail(const char* op, const std::string& what) {
  throw std::invalid_argument(std::string("[") + op + "] " + what);
}

// `index` as contiguous i64 with no graph; i32 is accepted and widened.
Tensor as_index(const char* op, const Tensor& index) {
  if (!index.defined()) index_fail(op, "index is undefined");
  if (index.dtype() != DType::i64 && index.dtype() != DType::i32)
    index_fail(op, std::string("index must be i64 or i32, got ") + dtype_name(index.dtype()));
  return detail::as_plain(index, DType::i64).contiguous();
}

// A fresh contiguous copy of x in dtype t, with no graph.
Tensor plain_copy(const Tensor& x, DType t) {
  Tensor out = detail::make_tensor(x.shape(), t, x.device());
  NoGradGuard no_grad;
  copy_(out, x.detach());
  return out;
}

// [outer, n, inner] -> [outer, m, inner]: slices idx[j] of x along `dim`.
// No checks and no graph.
Tensor select_slices(const Tensor& x, int64_t dim, const Tensor& idx) {
  const Tensor src = x.contiguous();
  const Shape& s = src.shape();
  int64_t outer = 1, inner = 1;
  for (int64_t k = 0; k < dim; ++k) outer *= s[k];
  for (int64_t k = dim + 1; k < src.dim(); ++k) inner *= s[k];
  const int64_t n = s[dim], m = idx.numel();
  Shape out_shape = s;
  out_shape[dim] = m;
  Tensor out = detail::make_tensor(out_shape, x.dtype(), x.device());
  if (out.numel() == 0) return out;
  kernels(x.device())
      .index_select(x.dtype(), src.raw_data(), outer, n, inner,
                    static_cast<const int64_t*>(idx.raw_data()), m, out.raw_data());
  return out;
}

// 0-d operands of gather and scatter count as one-element 1-d tensors (as in
// PyTorch); true when the call was rewritten that way.
bool rank0_as_1d(const char* op, std::initializer_list<const Tensor*> ts) {
  bool any0 = false, any_big = false;
  for (const Tensor* t : ts) {
    any0 = any0 || t->dim() == 0;
    any_big = any_big || t->dim() > 1;
  }
  if (any0 && any_big) {
    std::string shapes;
    for (const Tensor* t : ts) shapes += (shapes.empty() ? "" : ", ") + shape_str(t->shape());
    index_fail(op, "operands must have the same number of dims, got shapes " + shapes);
  }
  return any0;
}

Tensor as_1d(const Tensor& t) { return reshape(t, {t.numel()}); }

enum class ScatterMode { copy, fill, add };

// Shape rules shared by gather and the scatters: index has x's rank and fits
// inside x outside `dim` (and inside src everywhere).
void check_scatter_shapes(const char* op, const Tensor& x, int64_t d, const Tensor& index,
                          const Tensor* src) {
  const int64_t nd = x.dim();
  if (index.dim() != nd)
    index_fail(op, "index has " + str(index.dim()) + " dims, expected " + str(nd) +
                       " (the dims of the input)");
  if (src && src->dim() != nd)
    index_fail(op, "src has " + str(src->dim()) + " dims, expected " + str(nd));
  for (int64_t k = 0; k < nd; ++k) {
    if (k != d && index.shape()[k] > x.shape()[k])
      index_fail(op, "index of shape " + shape_str(index.shape()) + " exceeds the input shape " +
                         shape_str(x.shape()) + " in dim " + str(k));
    if (src && index.shape()[k] > src->shape()[k])
      index_fail(op, "index of shape " + shape_str(index.shape()) + " exceeds the src shape " +
                         shape_str(src->shape()) + " in dim " + str(k));
  }
}

// gather(g, dim, idx) zero-padded up to src's shape (src may be larger than
// index; its uncovered elements get no gradient).
Tensor gather_to(const Tensor& g, int64_t d, const Tensor& idx, const Shape& src_shape) {
  Tensor r = gather(g, d, idx);
  if (r.shape() == src_shape) return r;
  std::vector<int64_t> pads;
  for (int64_t k = r.dim() - 1; k >= 0; --k) {
    pads.push_back(0);
    pads.push_back(src_shape[k] - r.shape()[k]);
  }
  return pad(r, pads, 0.0);
}

Tensor scatter_impl(const char* op, ScatterMode mode, Tensor x, int64_t dim, const Tensor& index,
                    const Tensor& src, double value) {
  const bool has_src = mode != ScatterMode::fill;
  const KernelTable& k = kernels_for(op, {&x, &src, &index});
  check_plain(op, x);
  if (has_src && !src.defined()) index_fail(op, "src is undefined");
  if (has_src && src.dtype() != x.dtype())
    index_fail(op, std::string("src has dtype ") + dtype_name(src.dtype()) +
                       ", expected the input's dtype " + dtype_name(x.dtype()));
  if (has_src ? rank0_as_1d(op, {&x, &index, &src}) : rank0_as_1d(op, {&x, &index})) {
    const Tensor s1 = has_src ? as_1d(src) : src;
    return reshape(scatter_impl(op, mode, as_1d(x), dim, as_1d(index), s1, value), x.shape());
  }
  Tensor idx = as_index(op, index);
  const int64_t d = wrap_dim(dim, x.dim(), op);
  check_scatter_shapes(op, x, d, idx, has_src ? &src : nullptr);
  idx = detail::checked_index(op, idx, d, x.shape()[d]);

  const DType ct = mode == ScatterMode::add ? detail::compute_dtype(x.dtype()) : x.dtype();
  // x handed over, and nobody else can see it: written in place.
  Tensor out = x.dtype() == ct && autograd::sole_storage(x) ? x.detach() : plain_copy(x, ct);
  const Tensor s = has_src ? detail::as_plain(src, ct) : Tensor();
  const IndexMode im = mode == ScatterMode::add    ? IndexMode::scatter_add
                       : mode == ScatterMode::fill ? IndexMode::scatter_fill
                                                   : IndexMode::scatter_copy;
  k.index_lines(im, idx.shape(), d, operand_of(idx), operand_of(out),
                has_src ? operand_of(s) : operand_of(out), value);
  if (ct != x.dtype()) out = detail::as_plain(out, x.dtype());

  const bool need_src = has_src && src.requires_grad();
  // A frozen x (trained rows written into a frozen weight) needs no
  // gradient of its size.
  const bool need_x = x.requires_grad();
  const Shape src_shape = has_src ? src.shape() : Shape{};
  auto inputs = has_src ? std::vector<Tensor>{x, src} : std::vector<Tensor>{x};
  return autograd::record(
      op, out, inputs, [mode, d, idx, need_src, need_x, src_shape](const Tensor& g) {
        std::vector<Tensor> grads;
        // Written positions were overwritten, so x gets no gradient there.
        grads.push_back(!need_x                    ? Tensor()
                        : mode == ScatterMode::add ? g
                                                   : scatter(g, d, idx, 0.0));
        if (mode != ScatterMode::fill)
          grads.push_back(need_src ? gather_to(g, d, idx, src_shape) : Tensor());
        return grads;
      });
}

}  // namespace

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  kernels_for("index_select", {&x, &index});
  check_plain("index_select", x);
  Tensor idx = as_index("index_select", index);
  if (idx.dim() > 1)
    index_fail("index_select", "index must be 0-d or 1-d, got shape " + shape_str(idx.shape()));
  if (x.dim() == 0) {
    const Tensor r = index_select(reshape(x, {1}), dim, idx);
    return idx.dim() == 0 ? reshape(r, {}) : r;
  }
  const int64_t d = wrap_dim(dim, x.dim(), "index_select");
  idx = detail::checked_index("index_select", idx, d, x.shape()[d]);
  Tensor out = select_slices(x, d, idx);
  return autograd::record("index_select", out, {x}, [d, idx, in = x.shape()](const Tensor& g) {
    return std::vector<Tensor>{index_add(zeros(in, options_of(g)), d, idx, g)};
  });
}

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) {
  const KernelTable& k = kernels_for("gather", {&x, &index});
  check_plain("gather", x);
  if (rank0_as_1d("gather", {&x, &index}))
    return reshape(gather(as_1d(x), dim, as_1d(index)), index.shape());
  Tensor idx = as_index("gather", index);
  const int64_t d = wrap_dim(dim, x.dim(), "gather");
  check_scatter_shapes("gather", x, d, idx, nullptr);
  idx = detail::checked_index("gather", idx, d, x.shape()[d]);
  Tensor out = detail::make_tensor(idx.shape(), x.dtype(), x.device());
  // x's own strides: no copy for views.
  k.index_lines(IndexMode::gather, idx.shape(), d, operand_of(idx), operand_of(out), operand_of(x),
                0.0);
  return autograd::record("gather", out, {x}, [d, idx, in = x.shape()](const Tensor& g) {
    return std::vector<Tensor>{scatter_add(zeros(in, options_of(g)), d, idx, g)};
  });
}

Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  return scatter_impl("scatter", ScatterMode::copy, x, dim, index, src, 0.0);
}

Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, double value) {
  return scatter_impl("scatter", ScatterMode::fill, x, dim, index, Tensor(), value);
}

Tensor scatter_add(Tensor x, int64_t dim, const Tensor& index, const Tensor& src) {
  return scatter_impl("scatter_add", ScatterMode::add, std::move(x), dim, index, src, 0.0);
}

Tensor index_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src,
                 double alpha) {
  const KernelTable& k = kernels_for("index_add", {&x, &src, &index});
  check_plain("index_add", x);
  if (!src.defined()) index_fail("index_add", "src is undefined");
  if (src.dtype() != x.dtype())
    index_fail("index_add", std::string("src has dtype ") + dtype_name(src.dtype()) +
                                ", expected the input's dtype " + dtype_name(x.dtype()));
  Tensor idx = as_index("index_add", index);
  if (idx.dim() > 1)
    index_fail("index_add", "index must be 0-d or 1-d, got shape " + shape_str(idx.shape()));
  if (x.dim() == 0) return reshape(index_add(reshape(x, {1}), dim, idx, as_1d(src), alpha), {});
  const int64_t d = wrap_dim(dim, x.dim(), "index_add");
  const int64_t m = idx.numel();
  Shape want = x.shape();
  want[d] = m;
  // A 0-d src stands for one slice when x is 1-d (as in PyTorch).
  const Tensor s_in = (src.dim() == 0 && x.dim() == 1) ? reshape(src, {1}) : src;
  if (s_in.shape() != want)
    index_fail("index_add", "src has shape " + shape_str(src.shape()) + ", expected " +
                                shape_str(want) +
                                " (the input's shape with the index's length in "
                                "dim " +
                                str(d) + ")");
  idx = detail::checked_index("index_add", idx, d, x.shape()[d]);

  const DType ct = detail::compute_dtype(x.dtype());
  Tensor out = plain_copy(x, ct);
  const Tensor s = detail::as_plain(s_in, ct).contiguous();
  const Shape& xs = x.shape();
  int64_t outer = 1, inner = 1;
  for (int64_t k = 0; k < d; ++k) outer *= xs[k];
  for (int64_t k = d + 1; k < x.dim(); ++k) inner *= xs[k];
  const int64_t n = xs[d];
  k.index_add(ct, out.raw_data(), outer, n, inner, static_cast<const int64_t*>(idx.raw_data()), m,
              s.raw_data(), alpha);
  if (ct != x.dtype()) out = detail::as_plain(out, x.dtype());

  const bool need_src = src.requires_grad();
  return autograd::record("index_add", out, {x, src},
                          [d, idx, alpha, need_src, src_shape = src.shape()](const Tensor& g) {
                            Tensor gs;
                            if (need_src) {
                              gs = index_select(g, d, idx);
                              if (alpha != 1.0) gs = mul(gs, constant_like(gs, alpha));
                              gs = reshape(gs, src_shape);
                            }
                            return std::vector<Tensor>{g, gs};
                          });
}

Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  kernels_for("masked_fill", {&x, &mask});
  check_plain("masked_fill", x);
  if (mask.dtype() != DType::boolean)
    index_fail("masked_fill", std::string("mask must be bool, got ") + dtype_name(mask.dtype()));
  broadcast_shapes(x.shape(), mask.shape(), "masked_fill");  // names this op on mismatch
  // where's backward already gives zeros where filled.
  return where(mask.detach(), shared_full({}, value, {.dtype = x.dtype(), .device = x.device()}),
               x);
}

Tensor nonzero(const Tensor& mask) {
  if (mask.dtype() != DType::boolean)
    index_fail("nonzero", std::string("mask must be bool, got ") + dtype_name(mask.dtype()));
  // The positions are counted on the host: the output's size depends on them.
  const Tensor m = mask.detach().contiguous().to(Device::cpu());
  const bool* mp = m.data<bool>();
  std::vector<int64_t> where_true;
  for (int64_t i = 0, n = m.numel(); i < n; ++i)
    if (mp[i]) where_true.push_back(i);
  const auto count = static_cast<int64_t>(where_true.size());
  return from_vector<int64_t>(where_true, {count}, {.dtype = DType::i64, .device = mask.device()});
}

Tensor masked_select(const Tensor& x, const Tensor& mask) {
  kernels_for("masked_select", {&x, &mask});
  check_plain("masked_select", x);
  if (mask.dtype() != DType::boolean)
    index_fail("masked_select", std::string("mask must be bool, got ") + dtype_name(mask.dtype()));
  const Shape shape = broadcast_shapes(x.shape(), mask.shape(), "masked_select");
  // Row-major positions of the true elements; index_select's backward then
  // routes the gradient (and expand's sums it over broadcast dims).
  const Tensor pos = nonzero(expand(mask, shape));
  return index_select(reshape(expand(x, shape), {numel_of(shape)}), 0, pos);
}

Tensor embedding(const Tensor& weight, const Tensor& indices, int64_t padding_idx) {
  kernels_for("embedding", {&weight, &indices});
  check_plain("embedding", weight);
  if (weight.dim() != 2)
    index_fail("embedding", "weight must be 2-d [V, D], got shape " + shape_str(weight.shape()));
  const int64_t V = weight.shape()[0], D = weight.shape()[1];
  if (padding_idx < -1 || padding_idx >= V)
    index_fail("embedding", "padding_idx " + str(padding_idx) + " is out of range for " + str(V) +
                                " rows (expected -1 for none, or 0.." + str(V - 1) + ")");
  Tensor idx = as_index("embedding", indices).reshape({indices.numel()});
  idx = detail::checked_index("embedding", idx, 0, V);
  Shape out_shape = indices.shape();
  out_shape.push_back(D);
  Tensor out = select_slices(weight, 0, idx).reshape(out_shape);
  return autograd::record("embedding", out, {weight}, [idx, V, D, padding_idx](const Tensor& g) {
    Tensor rows = reshape(g, {idx.numel(), D});
    if (padding_idx >= 0) {
      const Tensor pad_row = shared_full({}, static_cast<double>(padding_idx),
                                         {.dtype = DType::i64, .device = idx.device()});
      rows = masked_fill(rows, unsqueeze(eq(idx, pad_row), 1), 0.0);
    }
    return std::vector<Tensor>{index_add(zeros({V, D}, options_of(g)), 0, idx, rows)};
  });
}

namespace detail {

// Every index must lie in [0, size). The host checks the CPU's at once,
// naming the first bad one. A device checks its own without the host reading
// them (engine/device_error.h): the op then runs on the returned copy, where
// a bad index reads as 0, and the next read of the device reports it.
Tensor checked_index(const char* op, const Tensor& index, int64_t dim, int64_t size) {
  const Device device = index.device();
  if (!device_caps(device).host_readable) {
    Tensor safe = detail::make_tensor(index.shape(), DType::i64, device);
    kernels(device).checked_indices(static_cast<const int64_t*>(index.raw_data()), index.numel(),
                                    size, static_cast<int64_t*>(safe.raw_data()),
                                    detail::device_error_flag(device),
                                    detail::register_index_check(op, dim, size));
    return safe;
  }
  const int64_t* p = index.data<int64_t>();
  for (int64_t i = 0, n = index.numel(); i < n; ++i)
    if (p[i] < 0 || p[i] >= size)
      index_fail(op, "index " + str(p[i]) + " is out of bounds for dim " + str(dim) +
                         " with size " + str(size));
  return index;
}

}  // namespace detail

}  // namespace quanta
