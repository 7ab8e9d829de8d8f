// Pooling and nearest upsampling. Every kernel here is linear in its input
// (max pooling once its argmax is fixed), so each backward is the adjoint
// kernel, recorded as an op whose own backward is the forward again. The loops
// are the device table's pooling entries (engine/cpu/pool_kernels.cpp,
// engine/cuda/pool_kernels.cu); this file validates, sizes and differentiates.
#include "engine/ops/pool.h"

#include <string>

#include "engine/autograd/node.h"
#include "engine/kernels/table.h"
#include "engine/ops/kernel_call.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"

namespace quanta {
namespace {

using Pair = std::array<int64_t, 2>;

// P planes of H x W pooled to OH x OW (the kernels' PoolWindow), with the
// tensor shapes on either side.
struct PoolGeom : PoolWindow {
  Shape in_shape, out_shape;
};

[[noreturn]] void pool_fail(const char* op, const std::string& what) {
  throw std::invalid_argument(std::string("[") + op + "] " + what);
}

// Validates x and the window parameters; fills in a stride of 0 as kernel.
PoolGeom pool_geom(const char* op, const Tensor& x, Pair kernel, Pair stride, Pair padding,
                   Pair dilation) {
  if (x.dim() != 3 && x.dim() != 4)
    pool_fail(op, "input must be [N, C, H, W] or [C, H, W]: got shape " + shape_str(x.shape()));
  if (!is_floating(x.dtype()))
    pool_fail(op, std::string("needs a floating input: got ") + dtype_name(x.dtype()));
  if (kernel[0] < 1 || kernel[1] < 1)
    pool_fail(op, "kernel must be positive: got " + pair_str(kernel));
  if (stride[0] < 0 || stride[1] < 0)
    pool_fail(op, "stride must be positive (0 means the kernel size): got " + pair_str(stride));
  if (dilation[0] < 1 || dilation[1] < 1)
    pool_fail(op, "dilation must be positive: got " + pair_str(dilation));
  for (int d = 0; d < 2; ++d) {
    if (stride[d] == 0) stride[d] = kernel[d];
    const int64_t extent = dilation[d] * (kernel[d] - 1) + 1;
    if (padding[d] < 0 || padding[d] > extent / 2)
      pool_fail(op,
                "padding must be between 0 and half the kernel: got padding " + pair_str(padding) +
                    " for kernel " + pair_str(kernel) +
                    (dilation == Pair{1, 1} ? std::string() : " dilated by " + pair_str(dilation)));
  }
  PoolGeom g;
  g.H = x.size(-2);
  g.W = x.size(-1);
  g.P = g.H * g.W == 0 ? 0 : x.numel() / (g.H * g.W);
  const int64_t nh = g.H + 2 * padding[0] - dilation[0] * (kernel[0] - 1) - 1;
  const int64_t nw = g.W + 2 * padding[1] - dilation[1] * (kernel[1] - 1) - 1;
  if (nh < 0 || nw < 0)
    pool_fail(op, "output size is not positive: input " + std::to_string(g.H) + "x" +
                      std::to_string(g.W) + " is smaller than the kernel " + pair_str(kernel));
  g.OH = nh / stride[0] + 1;
  g.OW = nw / stride[1] + 1;
  g.kernel = kernel;
  g.stride = stride;
  g.padding = padding;
  g.dilation = dilation;
  g.in_shape = x.shape();
  g.out_shape = x.shape();
  g.out_shape[x.dim() - 2] = g.OH;
  g.out_shape[x.dim() - 1] = g.OW;
  return g;
}

// Runs `kernel(table, ct, in, out)` on `t` as a contiguous plain tensor of the
// compute dtype ct, giving an (uninitialised) output of `shape` in t's dtype
// on t's device.
template <class F>
Tensor run_float(const char* op, const Tensor& t, const Shape& shape, F kernel) {
  const KernelTable& k = kernels_for(op, {&t});
  const DType ct = detail::compute_dtype(t.dtype());
  Tensor in = detail::as_plain(t, ct).contiguous();
  Tensor out = detail::make_tensor(shape, ct, t.device());
  kernel(k, ct, in.raw_data(), out.raw_data());
  return ct == t.dtype() ? out : detail::as_plain(out, t.dtype());
}

// ---- average pooling: forward and its adjoint ----

Tensor avg_op(bool adjoint, const Tensor& t, const PoolGeom& g) {
  const char* op = adjoint ? "avg_pool2d_backward" : "avg_pool2d";
  Tensor out = run_float(op, t, adjoint ? g.in_shape : g.out_shape,
                         [&](const KernelTable& k, DType ct, const void* in, void* o) {
                           k.avg_pool(adjoint, ct, g, in, o);
                         });
  return autograd::record(op, out, {t}, [adjoint, g](const Tensor& gout) {
    return std::vector<Tensor>{avg_op(!adjoint, gout, g)};
  });
}

// ---- max pooling: argmax positions, scatter to them and gather from them ----

// idx [P, OH, OW] (i64, on the input's device): flat position in the H x W
// plane of each window's maximum, -1 for a window that lies entirely in the
// padding.
Tensor pool_scatter(const Tensor& gy, const Tensor& idx, const PoolGeom& g);

Tensor pool_gather(const Tensor& gx, const Tensor& idx, const PoolGeom& g) {
  const char* op = "max_pool2d_gather";
  kernels_for(op, {&gx, &idx});
  Tensor out =
      run_float(op, gx, g.out_shape, [&](const KernelTable& k, DType ct, const void* in, void* o) {
        k.max_pool_route(false, ct, g, static_cast<const int64_t*>(idx.raw_data()), in, o);
      });
  return autograd::record(op, out, {gx}, [idx, g](const Tensor& gout) {
    return std::vector<Tensor>{pool_scatter(gout, idx, g)};
  });
}

Tensor pool_scatter(const Tensor& gy, const Tensor& idx, const PoolGeom& g) {
  const char* op = "max_pool2d_backward";
  kernels_for(op, {&gy, &idx});
  Tensor out =
      run_float(op, gy, g.in_shape, [&](const KernelTable& k, DType ct, const void* in, void* o) {
        k.max_pool_route(true, ct, g, static_cast<const int64_t*>(idx.raw_data()), in, o);
      });
  return autograd::record(op, out, {gy}, [idx, g](const Tensor& gout) {
    return std::vector<Tensor>{pool_gather(gout, idx, g)};
  });
}

}  // namespace

Tensor avg_pool2d(const Tensor& x, Pair kernel, Pair stride, Pair padding) {
  const PoolGeom g = pool_geom("avg_pool2d", x, kernel, stride, padding, {1, 1});
  return avg_op(false, x, g);
}

Tensor max_pool2d(const Tensor& x, Pair kernel, Pair stride, Pair padding, Pair dilation) {
  const PoolGeom g = pool_geom("max_pool2d", x, kernel, stride, padding, dilation);
  Tensor idx = detail::make_tensor(g.out_shape, DType::i64, x.device());
  Tensor out = run_float("max_pool2d", x, g.out_shape,
                         [&](const KernelTable& k, DType ct, const void* in, void* o) {
                           k.max_pool(ct, g, in, o, static_cast<int64_t*>(idx.raw_data()));
                         });
  return autograd::record("max_pool2d", out, {x}, [idx, g](const Tensor& gout) {
    return std::vector<Tensor>{pool_scatter(gout, idx, g)};
  });
}

Tensor interpolate_nearest2x(const Tensor& x) {
  const char* op = "interpolate_nearest2x";
  const KernelTable& k = kernels_for(op, {&x});
  if (x.dim() != 3 && x.dim() != 4)
    pool_fail(op, "input must be [N, C, H, W] or [C, H, W]: got shape " + shape_str(x.shape()));
  const int64_t nd = x.dim(), H = x.size(-2), W = x.size(-1);
  Shape out_shape = x.shape();
  out_shape[nd - 2] = 2 * H;
  out_shape[nd - 1] = 2 * W;
  Tensor in = x.detach().contiguous();
  Tensor out = detail::make_tensor(out_shape, x.dtype(), x.device());
  const int64_t rows = H * W == 0 ? 0 : x.numel() / W;  // input rows over all planes
  k.upsample_nearest2x(x.dtype(), rows, W, in.raw_data(), out.raw_data());
  return autograd::record(op, out, {x}, [shape = x.shape()](const Tensor& g) {
    const int64_t nd = static_cast<int64_t>(shape.size());
    Shape blocks(shape.begin(), shape.end() - 2);
    blocks.insert(blocks.end(), {shape[nd - 2], 2, shape[nd - 1], 2});
    return std::vector<Tensor>{sum(reshape(g, blocks), {nd - 1, nd + 1})};
  });
}

}  // namespace quanta
