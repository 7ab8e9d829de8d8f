// cat, stack, split, chunk, flip, repeat, pad: forward and backward together.
// The kernels are strided copies (copy_) into fresh outputs or views.
#include "engine/ops/join.h"

#include <algorithm>

#include "engine/autograd/grad_mode.h"
#include "engine/autograd/node.h"
#include "engine/dispatch.h"
#include "engine/factory.h"
#include "engine/kernels/table.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/op_helpers.h"
#include "engine/ops/view.h"

namespace quanta {
namespace {

using detail::check_plain;
using detail::str;

// dst <- src with no graph (dst is a fresh output or a view of one).
void copy_plain(const Tensor& dst, const Tensor& src) {
  NoGradGuard no_grad;
  copy_(dst, src.detach());
}

}  // namespace

void detail::copy_pieces(const Tensor& out, int64_t dim, const std::vector<Tensor>& pieces) {
  // Piece i is `outer` rows of n_i * inner elements, out.size(dim) * inner
  // apart: one block of copy_blocks (one launch for all, where a copy each
  // took one each).
  const Shape& shape = out.shape();
  int64_t outer = 1, inner = 1;
  for (int64_t k = 0; k < dim; ++k) outer *= shape[k];
  for (int64_t k = dim + 1; k < out.dim(); ++k) inner *= shape[k];
  const DType dt = out.dtype();
  const std::size_t width = element_size(dt);
  std::vector<CopyBlock> blocks;
  int64_t off = 0;
  for (const Tensor& t : pieces) {
    const int64_t n = t.shape()[dim];
    if (n > 0 && t.numel() > 0) {
      if (t.dtype() == dt && t.is_contiguous())
        blocks.push_back({t.raw_data(),
                          static_cast<unsigned char*>(out.raw_data()) + off * inner * width, outer,
                          n * inner, shape[dim] * inner});
      else
        copy_plain(narrow(out, dim, off, n), t);
    }
    off += n;
  }
  if (!blocks.empty())
    kernels(out.device()).copy_blocks(dt, {blocks.data(), static_cast<int64_t>(blocks.size())});
}

Tensor cat(const std::vector<Tensor>& ts, int64_t dim) {
  if (ts.empty()) throw std::invalid_argument("[cat] needs at least one tensor, got none");
  for (size_t i = 0; i < ts.size(); ++i) {
    if (!ts[i].defined())
      throw std::invalid_argument("[cat] tensor " + std::to_string(i) + " is undefined");
    if (ts[i].device() != ts[0].device())
      throw std::invalid_argument("[cat] tensor " + std::to_string(i) + " is on " +
                                  ts[i].device().str() + ", tensor 0 on " + ts[0].device().str() +
                                  "; move them to one device first");
    check_plain("cat", ts[i]);
    if (ts[i].dim() == 0)
      throw std::invalid_argument("[cat] tensor " + std::to_string(i) +
                                  " is 0-d and cannot be concatenated; unsqueeze it or use "
                                  "stack");
  }
  const Shape& first = ts[0].shape();
  const int64_t nd = ts[0].dim();
  const int64_t d = wrap_dim(dim, nd, "cat");
  Shape out_shape = first;
  out_shape[d] = 0;
  DType dt = ts[0].dtype();
  for (size_t i = 0; i < ts.size(); ++i) {
    const Shape& s = ts[i].shape();
    bool fits = ts[i].dim() == nd;
    for (int64_t k = 0; fits && k < nd; ++k) fits = k == d || s[k] == first[k];
    if (!fits)
      throw std::invalid_argument("[cat] tensor " + std::to_string(i) + " has shape " +
                                  shape_str(s) + ", expected " + shape_str(first) +
                                  " in every dim except " + str(d));
    out_shape[d] += s[d];
    dt = promote_types(dt, ts[i].dtype());
  }
  Tensor out = detail::make_tensor(out_shape, dt, ts[0].device());
  std::vector<int64_t> sizes;
  std::vector<DType> dtypes;
  for (const Tensor& t : ts) {
    sizes.push_back(t.shape()[d]);
    dtypes.push_back(t.dtype());
  }
  detail::copy_pieces(out, d, ts);
  std::vector<Tensor> inputs(ts.begin(), ts.end());
  return autograd::record("cat", out, inputs, [d, sizes, dtypes](const Tensor& g) {
    std::vector<Tensor> grads;
    int64_t at = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      grads.push_back(is_floating(dtypes[i]) ? to_dtype(narrow(g, d, at, sizes[i]), dtypes[i])
                                             : Tensor());
      at += sizes[i];
    }
    return grads;
  });
}

Tensor stack(const std::vector<Tensor>& ts, int64_t dim) {
  if (ts.empty()) throw std::invalid_argument("[stack] needs at least one tensor, got none");
  for (size_t i = 0; i < ts.size(); ++i) {
    if (!ts[i].defined())
      throw std::invalid_argument("[stack] tensor " + std::to_string(i) + " is undefined");
    if (ts[i].shape() != ts[0].shape())
      throw std::invalid_argument("[stack] tensor " + std::to_string(i) + " has shape " +
                                  shape_str(ts[i].shape()) + ", expected " +
                                  shape_str(ts[0].shape()) + " (all shapes must match)");
  }
  const int64_t d = wrap_dim(dim, ts[0].dim() + 1, "stack");
  std::vector<Tensor> pieces;
  pieces.reserve(ts.size());
  for (const Tensor& t : ts) pieces.push_back(unsqueeze(t, d));
  return cat(pieces, d);
}

std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  if (x.dim() == 0) throw std::invalid_argument("[split] cannot split a 0-d tensor");
  const int64_t d = wrap_dim(dim, x.dim(), "split");
  const int64_t n = x.shape()[d];
  int64_t total = 0;
  for (int64_t s : sizes) {
    if (s < 0)
      throw std::invalid_argument("[split] split sizes must be non-negative, got " + str(s));
    total += s;
  }
  if (total != n)
    throw std::invalid_argument("[split] split sizes sum to " + str(total) + ", expected " +
                                str(n) + " (the size of dim " + str(d) + ")");
  // Views of a detached x; one node for all pieces, so backward is one cat
  // instead of one zero-filled tensor per piece.
  const Tensor base = x.detach();
  std::vector<Tensor> outs;
  int64_t at = 0;
  for (int64_t s : sizes) {
    outs.push_back(narrow(base, d, at, s));
    at += s;
  }
  return autograd::record("split", std::move(outs), {x}, [d](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{cat(g, d)};
  });
}

std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim) {
  if (x.dim() == 0) throw std::invalid_argument("[split] cannot split a 0-d tensor");
  const int64_t d = wrap_dim(dim, x.dim(), "split");
  const int64_t n = x.shape()[d];
  if (split_size < 0 || (split_size == 0 && n > 0))
    throw std::invalid_argument("[split] split_size must be positive, got " + str(split_size) +
                                " for dim " + str(d) + " of size " + str(n));
  std::vector<int64_t> sizes;
  if (n == 0) sizes.push_back(0);  // like torch: one empty piece
  for (int64_t at = 0; at < n; at += split_size) sizes.push_back(std::min(split_size, n - at));
  return split(x, sizes, d);
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  if (chunks <= 0)
    throw std::invalid_argument("[chunk] chunks must be positive, got " + str(chunks));
  if (x.dim() == 0) throw std::invalid_argument("[chunk] cannot chunk a 0-d tensor");
  const int64_t d = wrap_dim(dim, x.dim(), "chunk");
  const int64_t n = x.shape()[d];
  // torch.chunk: pieces of ceil(n / chunks), so fewer than `chunks` may come
  // back; an empty dim still gives `chunks` empty pieces.
  if (n == 0) return split(x, std::vector<int64_t>(chunks, 0), d);
  return split(x, (n + chunks - 1) / chunks, d);
}

Tensor flip(const Tensor& x, const std::vector<int64_t>& dims) {
  check_plain("flip", x);
  const int64_t nd = x.dim();
  std::vector<bool> flipped(std::max<int64_t>(nd, 1), false);
  std::vector<int64_t> wrapped;
  for (int64_t dim : dims) {
    const int64_t d = wrap_dim(dim, nd, "flip");
    if (flipped[d]) throw std::invalid_argument("[flip] dim " + str(d) + " appears more than once");
    flipped[d] = true;
    wrapped.push_back(d);
  }
  // A view with negated strides, then one strided copy.
  Shape st = x.strides();
  int64_t offset = x.offset();
  for (int64_t d : wrapped)
    if (d < nd && x.shape()[d] > 1) {
      offset += (x.shape()[d] - 1) * st[d];
      st[d] = -st[d];
    }
  Tensor out = detail::make_tensor(x.shape(), x.dtype(), x.device());
  copy_plain(out, detail::make_view(x, x.shape(), st, offset));
  return autograd::record("flip", out, {x}, [wrapped](const Tensor& g) {
    return std::vector<Tensor>{flip(g, wrapped)};
  });
}

Tensor repeat(const Tensor& x, const Shape& repeats) {
  const int64_t nd = x.dim();
  const int64_t nr = static_cast<int64_t>(repeats.size());
  if (nr < nd)
    throw std::invalid_argument("[repeat] got " + str(nr) + " repeats for a " + str(nd) +
                                "-d tensor; expected at least " + str(nd));
  for (int64_t r : repeats)
    if (r < 0)
      throw std::invalid_argument("[repeat] repeats must be non-negative, got " +
                                  shape_str(repeats));
  // [s0, s1] -> [1, s0, 1, s1] -> expand [r0, s0, r1, s1] -> [r0*s0, r1*s1]:
  // expand's backward sums the tiles.
  Shape padded(nr - nd, 1);
  padded.insert(padded.end(), x.shape().begin(), x.shape().end());
  Shape split_shape, tiled, out_shape;
  for (int64_t i = 0; i < nr; ++i) {
    split_shape.insert(split_shape.end(), {1, padded[i]});
    tiled.insert(tiled.end(), {repeats[i], padded[i]});
    out_shape.push_back(repeats[i] * padded[i]);
  }
  return reshape(expand(reshape(x, split_shape), tiled).clone(), out_shape);
}

Tensor pad(const Tensor& x, const std::vector<int64_t>& pads, double value) {
  check_plain("pad", x);
  const int64_t nd = x.dim();
  const int64_t np = static_cast<int64_t>(pads.size());
  if (np % 2 != 0 || np > 2 * nd)
    throw std::invalid_argument("[pad] got " + str(np) + " pad values for a " + str(nd) +
                                "-d tensor; expected an even count of at most " + str(2 * nd));
  Shape out_shape = x.shape();
  for (int64_t i = 0; i < np / 2; ++i) {
    const int64_t d = nd - 1 - i;
    out_shape[d] += pads[2 * i] + pads[2 * i + 1];
    if (out_shape[d] < 0)
      throw std::invalid_argument("[pad] dim " + str(d) + " of size " + str(x.shape()[d]) +
                                  " padded by (" + str(pads[2 * i]) + ", " + str(pads[2 * i + 1]) +
                                  ") would have negative size " + str(out_shape[d]));
  }
  Tensor out = full(out_shape, value, options_of(x));
  // The part of x that survives the crops, and where it lands.
  Tensor src = x.detach(), dst = out;
  bool any_left = true;
  for (int64_t i = 0; i < np / 2; ++i) {
    const int64_t d = nd - 1 - i;
    const int64_t lo = pads[2 * i], hi = pads[2 * i + 1];
    const int64_t crop_lo = std::max<int64_t>(0, -lo), crop_hi = std::max<int64_t>(0, -hi);
    const int64_t len = x.shape()[d] - crop_lo - crop_hi;
    if (len <= 0) {
      any_left = false;
      break;
    }
    src = narrow(src, d, crop_lo, len);
    dst = narrow(dst, d, std::max<int64_t>(0, lo), len);
  }
  if (any_left) copy_plain(dst, src);
  std::vector<int64_t> back(pads.size());
  for (size_t i = 0; i < pads.size(); ++i) back[i] = -pads[i];
  // Padding by the negated amounts crops the gradient back to x's shape and
  // puts zeros where x was cropped.
  return autograd::record(
      "pad", out, {x}, [back](const Tensor& g) { return std::vector<Tensor>{pad(g, back, 0.0)}; });
}

}  // namespace quanta
