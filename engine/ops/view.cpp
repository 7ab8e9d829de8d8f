#include "engine/ops/view.h"

#include <algorithm>
#include <numeric>
#include <optional>

#include "engine/autograd/node.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/op_helpers.h"
#include "engine/ops/reduce.h"

namespace quanta {
namespace {

using detail::one;

// Strides for viewing `x` with `shape` without a copy, or empty if impossible
// (the dims being merged or split must be contiguous with each other).
std::optional<Shape> view_strides(const Tensor& x, const Shape& shape) {
  if (x.numel() == 0 || x.is_contiguous()) return contiguous_strides(shape);
  const Shape& os = x.shape();
  const Shape& ost = x.strides();
  Shape out(shape.size());
  int64_t vi = static_cast<int64_t>(shape.size()) - 1;
  int64_t chunk_numel = 1, tensor_numel = 1;
  int64_t chunk_base_stride = ost.empty() ? 1 : ost.back();
  for (int64_t ti = static_cast<int64_t>(os.size()) - 1; ti >= 0; --ti) {
    tensor_numel *= os[ti];
    if (ti == 0 || (os[ti - 1] != 1 && ost[ti - 1] != tensor_numel * chunk_base_stride)) {
      while (vi >= 0 && (chunk_numel < tensor_numel || shape[vi] == 1)) {
        out[vi] = chunk_numel * chunk_base_stride;
        chunk_numel *= shape[vi];
        --vi;
      }
      if (chunk_numel != tensor_numel) return std::nullopt;
      if (ti > 0) {
        chunk_base_stride = ost[ti - 1];
        tensor_numel = 1;
        chunk_numel = 1;
      }
    }
  }
  if (vi != -1) return std::nullopt;
  return out;
}

Shape infer_shape(const Shape& shape, int64_t numel, const char* op) {
  Shape out = shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      if (infer >= 0) throw std::invalid_argument(std::string("[") + op + "] only one -1 allowed");
      infer = static_cast<int64_t>(i);
    } else if (out[i] < 0) {
      throw std::invalid_argument(std::string("[") + op + "] invalid size in " + shape_str(shape));
    } else {
      known *= out[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || numel % known != 0)
      throw std::invalid_argument(std::string("[") + op + "] cannot infer -1 in " +
                                  shape_str(shape) + " for " + std::to_string(numel) + " elements");
    out[infer] = numel / known;
  }
  if (numel_of(out) != numel)
    throw std::invalid_argument(std::string("[") + op + "] shape " + shape_str(shape) +
                                " does not hold " + std::to_string(numel) + " elements");
  return out;
}

Tensor reshape_view(const Tensor& x, const Shape& s, const Shape& st, const char* op) {
  Tensor out = detail::make_view(x, s, st, x.offset());
  return autograd::record(op, out, {x},
                          [in = x.shape()](const Tensor& g) { return one(reshape(g, in)); });
}

}  // namespace

Tensor view(const Tensor& x, const Shape& shape) {
  const Shape s = infer_shape(shape, x.numel(), "view");
  auto st = view_strides(x, s);
  if (!st)
    throw std::invalid_argument("[view] the layout of a tensor of shape " + shape_str(x.shape()) +
                                " does not allow a view as " + shape_str(s) +
                                "; use reshape (which copies)");
  return reshape_view(x, s, *st, "view");
}

Tensor reshape(const Tensor& x, const Shape& shape) {
  const Shape s = infer_shape(shape, x.numel(), "reshape");
  if (s == x.shape()) return x;
  if (auto st = view_strides(x, s)) return reshape_view(x, s, *st, "reshape");
  return reshape_view(contiguous(x), s, contiguous_strides(s), "reshape");
}

Tensor permute(const Tensor& x, const std::vector<int64_t>& dims) {
  const int64_t nd = x.dim();
  if (static_cast<int64_t>(dims.size()) != nd)
    throw std::invalid_argument("[permute] got " + std::to_string(dims.size()) + " dims for a " +
                                std::to_string(nd) + "-d tensor");
  Shape s(nd), st(nd);
  std::vector<int64_t> inverse(nd, -1);
  for (int64_t i = 0; i < nd; ++i) {
    const int64_t d = wrap_dim(dims[i], nd, "permute");
    if (inverse[d] != -1) throw std::invalid_argument("[permute] dim repeated");
    inverse[d] = i;
    s[i] = x.shape()[d];
    st[i] = x.strides()[d];
  }
  Tensor out = detail::make_view(x, s, st, x.offset());
  return autograd::record("permute", out, {x},
                          [inverse](const Tensor& g) { return one(permute(g, inverse)); });
}

Tensor transpose(const Tensor& x, int64_t d0, int64_t d1) {
  const int64_t nd = x.dim();
  if (nd == 0) return x;
  std::vector<int64_t> dims(nd);
  std::iota(dims.begin(), dims.end(), 0);
  std::swap(dims[wrap_dim(d0, nd, "transpose")], dims[wrap_dim(d1, nd, "transpose")]);
  return permute(x, dims);
}

Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step) {
  const int64_t d = wrap_dim(dim, x.dim(), "slice");
  if (step <= 0) throw std::invalid_argument("[slice] step must be positive");
  const int64_t n = x.shape()[d];
  auto clampi = [n](int64_t v) { return std::clamp<int64_t>(v < 0 ? v + n : v, 0, n); };
  start = clampi(start);
  end = std::max(clampi(end), start);
  Shape s = x.shape(), st = x.strides();
  s[d] = (end - start + step - 1) / step;
  st[d] *= step;
  Tensor out = detail::make_view(x, s, st, x.offset() + start * x.strides()[d]);
  return autograd::record("slice", out, {x},
                          [in = x.shape(), d, start, end, step](const Tensor& g) {
                            Tensor z = zeros(in, options_of(g));
                            copy_(slice(z, d, start, end, step), g);
                            return one(z);
                          });
}

Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length) {
  const int64_t d = wrap_dim(dim, x.dim(), "narrow");
  const int64_t n = x.shape()[d];
  if (start < 0) start += n;
  if (start < 0 || length < 0 || start + length > n)
    throw std::invalid_argument("[narrow] range [" + std::to_string(start) + ", " +
                                std::to_string(start + length) + ") out of bounds for dim " +
                                std::to_string(d) + " of size " + std::to_string(n));
  return slice(x, d, start, start + length);
}

Tensor select(const Tensor& x, int64_t dim, int64_t index) {
  const int64_t d = wrap_dim(dim, x.dim(), "select");
  const int64_t n = x.shape()[d];
  if (index < -n || index >= n)
    throw std::invalid_argument("[select] index " + std::to_string(index) +
                                " out of range for dim " + std::to_string(d) + " of size " +
                                std::to_string(n));
  if (index < 0) index += n;
  return squeeze(narrow(x, d, index, 1), d);
}

Tensor expand(const Tensor& x, const Shape& shape) {
  const int64_t nd = static_cast<int64_t>(shape.size());
  const int64_t xd = x.dim();
  if (nd < xd)
    throw std::invalid_argument("[expand] cannot expand shape " + shape_str(x.shape()) +
                                " to fewer dims " + shape_str(shape));
  Shape s(nd), st(nd);
  for (int64_t i = nd - 1; i >= 0; --i) {
    const int64_t xi = i - (nd - xd);
    const int64_t want = shape[i];
    if (xi < 0) {
      if (want < 0) throw std::invalid_argument("[expand] -1 not allowed for a new dim");
      s[i] = want;
      st[i] = 0;
      continue;
    }
    const int64_t have = x.shape()[xi];
    if (want == -1 || want == have) {
      s[i] = have;
      st[i] = x.strides()[xi];
    } else if (have == 1) {
      s[i] = want;
      st[i] = 0;
    } else {
      throw std::invalid_argument("[expand] cannot expand shape " + shape_str(x.shape()) + " to " +
                                  shape_str(shape));
    }
  }
  if (s == x.shape()) return x;
  Tensor out = detail::make_view(x, s, st, x.offset());
  return autograd::record("expand", out, {x},
                          [in = x.shape()](const Tensor& g) { return one(sum_to(g, in)); });
}

Tensor broadcast_to(const Tensor& x, const Shape& shape) {
  return expand(x, broadcast_shapes(x.shape(), shape, "broadcast_to"));
}

Tensor squeeze(const Tensor& x) {
  Shape s;
  for (int64_t v : x.shape())
    if (v != 1) s.push_back(v);
  return reshape(x, s);
}

Tensor squeeze(const Tensor& x, int64_t dim) {
  if (x.dim() == 0) return x;
  const int64_t d = wrap_dim(dim, x.dim(), "squeeze");
  if (x.shape()[d] != 1) return x;
  Shape s = x.shape(), st = x.strides();
  s.erase(s.begin() + d);
  st.erase(st.begin() + d);
  return reshape_view(x, s, st, "squeeze");
}

Tensor unsqueeze(const Tensor& x, int64_t dim) {
  const int64_t d = wrap_dim(dim, x.dim() + 1, "unsqueeze");
  Shape s = x.shape(), st = x.strides();
  const int64_t stride = d < x.dim() ? x.strides()[d] * x.shape()[d] : 1;
  s.insert(s.begin() + d, 1);
  st.insert(st.begin() + d, stride);
  return reshape_view(x, s, st, "unsqueeze");
}

Tensor flatten(const Tensor& x, int64_t start, int64_t end) {
  if (x.dim() == 0) return reshape(x, {1});
  start = wrap_dim(start, x.dim(), "flatten");
  end = wrap_dim(end, x.dim(), "flatten");
  if (start > end) throw std::invalid_argument("[flatten] start dim after end dim");
  Shape s(x.shape().begin(), x.shape().begin() + start);
  int64_t m = 1;
  for (int64_t i = start; i <= end; ++i) m *= x.shape()[i];
  s.push_back(m);
  s.insert(s.end(), x.shape().begin() + end + 1, x.shape().end());
  return reshape(x, s);
}

Tensor unflatten(const Tensor& x, int64_t dim, const Shape& sizes) {
  const int64_t d = wrap_dim(dim, x.dim(), "unflatten");
  const Shape inner = infer_shape(sizes, x.shape()[d], "unflatten");
  Shape s(x.shape().begin(), x.shape().begin() + d);
  s.insert(s.end(), inner.begin(), inner.end());
  s.insert(s.end(), x.shape().begin() + d + 1, x.shape().end());
  return reshape(x, s);
}

Tensor detach(const Tensor& x) { return detail::make_view(x, x.shape(), x.strides(), x.offset()); }

}  // namespace quanta
