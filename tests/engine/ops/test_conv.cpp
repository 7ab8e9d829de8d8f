// Op-harness rows for conv2d, conv_transpose2d, pooling and nearest
// upsampling against direct-loop references, plus multi-image sizes that take
// the threaded paths, zero batches and error messages.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "engine/cpu/conv_direct.h"
#include "engine/cpu/conv_onednn.h"
#include "engine/cpu/gemm_bf16.h"
#include "engine/cpu/parallel.h"
#include "engine/cuda/runtime.h"
#include "engine/ops/harness.h"
#include "support/gpu.h"
#include "support/main_job_conv.h"

using namespace quanta;
using namespace quanta::testing;

namespace {

using Pair = std::array<int64_t, 2>;

Tensor from_values(const std::vector<double>& v, const Shape& shape) {
  const int64_t n = static_cast<int64_t>(v.size());
  return from_vector<double>(v, n ? Shape{n} : Shape{0}).reshape(shape);
}

struct ConvArgs {
  Pair stride{1, 1}, padding{0, 0}, dilation{1, 1}, output_padding{0, 0};
  int64_t groups = 1;
  ConvLayout layout = ConvLayout::nchw;  // of the op's activations; references take nchw
};

// An activation between the op's layout and the references' NCHW.
Tensor to_nchw(const Tensor& t, const ConvArgs& a) {
  return a.layout == ConvLayout::nhwc ? contiguous(permute(t, {0, 3, 1, 2})) : t;
}
Tensor from_nchw(const Tensor& t, const ConvArgs& a) {
  return a.layout == ConvLayout::nhwc ? contiguous(permute(t, {0, 2, 3, 1})) : t;
}

// Direct convolution: seven nested loops (plus the bias).
Tensor ref_conv2d(const Tensor& x, const Tensor& w, const Tensor* b, const ConvArgs& a) {
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t O = w.size(0), Cg = w.size(1), kh = w.size(2), kw = w.size(3);
  const int64_t Og = O / a.groups;
  const int64_t OH = (H + 2 * a.padding[0] - a.dilation[0] * (kh - 1) - 1) / a.stride[0] + 1;
  const int64_t OW = (W + 2 * a.padding[1] - a.dilation[1] * (kw - 1) - 1) / a.stride[1] + 1;
  const auto xv = x.to_vector<double>(), wv = w.to_vector<double>();
  const auto bv = b ? b->to_vector<double>() : std::vector<double>(O, 0.0);
  std::vector<double> out(static_cast<size_t>(N * O * OH * OW));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          double s = bv[o];
          for (int64_t c = 0; c < Cg; ++c)
            for (int64_t i = 0; i < kh; ++i)
              for (int64_t j = 0; j < kw; ++j) {
                const int64_t ih = oh * a.stride[0] - a.padding[0] + i * a.dilation[0];
                const int64_t iw = ow * a.stride[1] - a.padding[1] + j * a.dilation[1];
                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                const int64_t ci = (o / Og) * Cg + c;
                s += xv[((n * C + ci) * H + ih) * W + iw] * wv[((o * Cg + c) * kh + i) * kw + j];
              }
          out[((n * O + o) * OH + oh) * OW + ow] = s;
        }
  return from_values(out, {N, O, OH, OW});
}

// Transposed convolution as a scatter: every input pixel adds its kernel
// (times the pixel) into the output.
Tensor ref_conv_transpose2d(const Tensor& x, const Tensor& w, const Tensor* b, const ConvArgs& a) {
  const int64_t N = x.size(0), Cin = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t Og = w.size(1), kh = w.size(2), kw = w.size(3);
  const int64_t O = Og * a.groups, Cg = Cin / a.groups;
  const int64_t OH =
      (H - 1) * a.stride[0] - 2 * a.padding[0] + a.dilation[0] * (kh - 1) + a.output_padding[0] + 1;
  const int64_t OW =
      (W - 1) * a.stride[1] - 2 * a.padding[1] + a.dilation[1] * (kw - 1) + a.output_padding[1] + 1;
  const auto xv = x.to_vector<double>(), wv = w.to_vector<double>();
  const auto bv = b ? b->to_vector<double>() : std::vector<double>(O, 0.0);
  std::vector<double> out(static_cast<size_t>(N * O * OH * OW));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t p = 0; p < OH * OW; ++p) out[(n * O + o) * OH * OW + p] = bv[o];
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < Cin; ++c)
      for (int64_t ih = 0; ih < H; ++ih)
        for (int64_t iw = 0; iw < W; ++iw)
          for (int64_t ol = 0; ol < Og; ++ol)
            for (int64_t i = 0; i < kh; ++i)
              for (int64_t j = 0; j < kw; ++j) {
                const int64_t oh = ih * a.stride[0] - a.padding[0] + i * a.dilation[0];
                const int64_t ow = iw * a.stride[1] - a.padding[1] + j * a.dilation[1];
                if (oh < 0 || oh >= OH || ow < 0 || ow >= OW) continue;
                const int64_t o = (c / Cg) * Og + ol;
                out[((n * O + o) * OH + oh) * OW + ow] +=
                    xv[((n * Cin + c) * H + ih) * W + iw] * wv[((c * Og + ol) * kh + i) * kw + j];
              }
  return from_values(out, {N, O, OH, OW});
}

OpCase conv_case(std::string name, std::vector<Shape> shapes, ConvArgs a,
                 std::vector<Shape> zero = {}) {
  OpCase c;
  c.name = std::move(name);
  c.shapes = std::move(shapes);
  c.zero_shapes = std::move(zero);
  c.op = [a](const Inputs& x) {
    return conv2d(x[0], x[1], x.size() > 2 ? x[2] : Tensor(), a.stride, a.padding, a.dilation,
                  a.groups, a.layout);
  };
  c.reference = [a](const Inputs& x) {
    return from_nchw(ref_conv2d(to_nchw(x[0], a), x[1], x.size() > 2 ? &x[2] : nullptr, a), a);
  };
  return c;
}

OpCase conv_t_case(std::string name, std::vector<Shape> shapes, ConvArgs a,
                   std::vector<Shape> zero = {}) {
  OpCase c;
  c.name = std::move(name);
  c.shapes = std::move(shapes);
  c.zero_shapes = std::move(zero);
  c.op = [a](const Inputs& x) {
    return conv_transpose2d(x[0], x[1], x.size() > 2 ? x[2] : Tensor(), a.stride, a.padding,
                            a.output_padding, a.groups, a.dilation, a.layout);
  };
  c.reference = [a](const Inputs& x) {
    return from_nchw(
        ref_conv_transpose2d(to_nchw(x[0], a), x[1], x.size() > 2 ? &x[2] : nullptr, a), a);
  };
  return c;
}

// Pooling reference over [N, C, H, W]; `max` or mean with count_include_pad.
Tensor ref_pool(const Tensor& x, Pair k, Pair s, Pair p, Pair d, bool max) {
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t OH = (H + 2 * p[0] - d[0] * (k[0] - 1) - 1) / s[0] + 1;
  const int64_t OW = (W + 2 * p[1] - d[1] * (k[1] - 1) - 1) / s[1] + 1;
  const auto xv = x.to_vector<double>();
  std::vector<double> out(static_cast<size_t>(N * C * OH * OW));
  for (int64_t nc = 0; nc < N * C; ++nc)
    for (int64_t oh = 0; oh < OH; ++oh)
      for (int64_t ow = 0; ow < OW; ++ow) {
        double acc = max ? -std::numeric_limits<double>::infinity() : 0.0;
        for (int64_t i = 0; i < k[0]; ++i)
          for (int64_t j = 0; j < k[1]; ++j) {
            const int64_t ih = oh * s[0] - p[0] + i * d[0], iw = ow * s[1] - p[1] + j * d[1];
            if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
            const double v = xv[(nc * H + ih) * W + iw];
            acc = max ? std::max(acc, v) : acc + v;
          }
        out[(nc * OH + oh) * OW + ow] = max ? acc : acc / static_cast<double>(k[0] * k[1]);
      }
  return from_values(out, {N, C, OH, OW});
}

OpCase pool_case(std::string name, Shape shape, Pair k, Pair s, Pair p, Pair d, bool max) {
  OpCase c;
  c.name = std::move(name);
  c.shapes = {shape};
  shape[0] = 0;
  c.zero_shapes = {shape};
  if (max) c.inputs = {InputSpec{.domain = Domain::distinct, .make = {}}};
  c.op = [=](const Inputs& x) {
    return max ? max_pool2d(x[0], k, s, p, d) : avg_pool2d(x[0], k, s, p);
  };
  const Pair rs{s[0] ? s[0] : k[0], s[1] ? s[1] : k[1]};
  c.reference = [=](const Inputs& x) { return ref_pool(x[0], k, rs, p, d, max); };
  return c;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const auto av = a.to_vector<double>(), bv = b.to_vector<double>();
  REQUIRE(av.size() == bv.size());
  double worst = 0;
  for (size_t i = 0; i < av.size(); ++i) worst = std::max(worst, std::abs(av[i] - bv[i]));
  return worst;
}

double dot(const Tensor& a, const Tensor& b) { return sum(mul(a, b)).item(); }

// The convolutions a scope ran on the GPU, by path (engine/cuda/module.h's
// ConvPaths). `expect_cudnn` checks that cuDNN ran them all (im2col only in
// a module built without cuDNN); `expect_im2col` that cuDNN refused them.
class GpuConvPaths {
 public:
  GpuConvPaths() {
    if (have_gpu()) before_ = cuda::conv_paths();
  }
  void expect_cudnn() const { expect(true); }
  void expect_im2col() const { expect(false); }
  // Either path, as long as the GPU ran some.
  void expect_some() const { expect(std::nullopt); }
  // Some through cuDNN (not every dtype need have an algorithm).
  void expect_some_cudnn() const {
    expect(std::nullopt);
    if (have_gpu() && cuda::conv_paths().cudnn_linked)
      CHECK(cuda::conv_paths().cudnn > before_.cudnn);
  }

 private:
  void expect(std::optional<bool> cudnn) const {
    if (!have_gpu()) {
      MESSAGE("GPU convolution paths not checked: " << no_gpu_reason());
      return;
    }
    const cuda::ConvPaths now = cuda::conv_paths();
    const int64_t ran_cudnn = now.cudnn - before_.cudnn, ran_im2col = now.im2col - before_.im2col;
    MESSAGE("on the GPU: " << ran_cudnn << " convolutions through cuDNN, " << ran_im2col
                           << " through im2col");
    CHECK(ran_cudnn + ran_im2col > 0);
    if (!now.cudnn_linked) {
      MESSAGE("the CUDA module was built without cuDNN: every convolution takes im2col");
      CHECK(ran_cudnn == 0);
    } else if (cudnn == true) {
      CHECK(ran_im2col == 0);
    } else if (cudnn == false) {
      CHECK(ran_cudnn == 0);
    }
  }
  cuda::ConvPaths before_{};
};

}  // namespace

TEST_CASE("conv2d through the harness") {
  const GpuConvPaths paths;
  run_case(conv_case("conv2d plain with bias", {{2, 3, 5, 6}, {4, 3, 3, 3}, {4}}, {},
                     {{0, 3, 5, 6}, {4, 3, 3, 3}, {4}}));
  run_case(conv_case("conv2d stride 2 padding 1", {{2, 3, 7, 6}, {4, 3, 3, 3}, {4}},
                     {.stride = {2, 2}, .padding = {1, 1}}));
  run_case(conv_case("conv2d dilation 2, uneven padding, no bias", {{1, 2, 7, 7}, {3, 2, 3, 2}},
                     {.padding = {2, 1}, .dilation = {2, 2}}));
  run_case(conv_case("conv2d groups 2", {{2, 4, 5, 5}, {6, 2, 3, 3}, {6}},
                     {.stride = {1, 2}, .padding = {1, 0}, .groups = 2},
                     {{0, 4, 5, 5}, {6, 2, 3, 3}, {6}}));
  run_case(conv_case("conv2d depthwise", {{1, 3, 5, 5}, {3, 1, 3, 3}}, {.groups = 3}));
  run_case(conv_case("conv2d 1x1 pointwise", {{2, 3, 4, 5}, {5, 3, 1, 1}, {5}}, {}));
  run_case(conv_case("conv2d 1x1 strided", {{2, 3, 5, 5}, {2, 3, 1, 1}}, {.stride = {2, 2}}));
  run_case(conv_case("conv2d groups 3, stride, dilation, uneven padding",
                     {{2, 6, 9, 8}, {6, 2, 3, 2}, {6}},
                     {.stride = {2, 1}, .padding = {2, 1}, .dilation = {2, 2}, .groups = 3}));
  run_case(
      conv_case("conv2d 1x1 pointwise groups 2", {{3, 4, 4, 4}, {6, 2, 1, 1}, {6}}, {.groups = 2}));
  run_case(
      conv_case("conv2d several images", {{5, 3, 6, 6}, {4, 3, 3, 3}, {4}}, {.padding = {1, 1}}));
  paths.expect_cudnn();  // on a GPU: forward, both gradients, f32 and f64
}

TEST_CASE("conv_transpose2d through the harness") {
  const GpuConvPaths paths;
  run_case(conv_t_case("conv_transpose2d stride 2 output_padding 1",
                       {{2, 4, 3, 3}, {4, 3, 3, 3}, {3}},
                       {.stride = {2, 2}, .padding = {1, 1}, .output_padding = {1, 1}},
                       {{0, 4, 3, 3}, {4, 3, 3, 3}, {3}}));
  run_case(conv_t_case(
      "conv_transpose2d groups 2, dilation, uneven stride", {{1, 4, 3, 4}, {4, 2, 2, 3}, {4}},
      {.stride = {2, 1}, .dilation = {1, 2}, .output_padding = {1, 0}, .groups = 2}));
  run_case(conv_t_case("conv_transpose2d 1x1", {{2, 3, 4, 4}, {3, 5, 1, 1}}, {}));
  run_case(
      conv_t_case("conv_transpose2d groups 3, padding, bias", {{2, 6, 4, 3}, {6, 1, 3, 3}, {3}},
                  {.stride = {2, 2}, .padding = {1, 1}, .output_padding = {1, 0}, .groups = 3}));
  run_case(conv_t_case("conv_transpose2d 1x1 groups 2 with bias", {{2, 4, 3, 3}, {4, 3, 1, 1}, {6}},
                       {.groups = 2}));
  paths.expect_cudnn();
  // output_padding below the dilation but not the stride: the output grows
  // past what the matching conv2d would read. cuDNN derives the output size
  // from the input and refuses this geometry; im2col runs it.
  const GpuConvPaths grown;
  run_case(conv_t_case("conv_transpose2d output_padding from dilation",
                       {{1, 2, 3, 3}, {2, 2, 2, 2}, {2}},
                       {.dilation = {2, 2}, .output_padding = {1, 1}}));
  grown.expect_im2col();
}

TEST_CASE("conv on a GPU with cuDNN's algorithms timed, atomics allowed (--fast-conv)") {
  if (!have_gpu()) {
    MESSAGE("cuda:0 skipped: " << no_gpu_reason());
    return;
  }
  // Fresh plans (they are kept per setting), chosen by timing on this GPU;
  // atomics-based gradients differ from the CPU's in the last bits, which
  // the harness's device tolerance takes.
  cuda::set_nondeterministic_conv(true);
  struct Restore {
    ~Restore() { cuda::set_nondeterministic_conv(false); }
  } restore;
  const GpuConvPaths paths;
  run_case(conv_case("fast conv2d stride 2 padding 1", {{4, 3, 9, 8}, {6, 3, 3, 3}, {6}},
                     {.stride = {2, 2}, .padding = {1, 1}}));
  run_case(conv_case("fast conv2d groups 2, dilation", {{2, 4, 9, 9}, {6, 2, 3, 3}, {6}},
                     {.padding = {2, 2}, .dilation = {2, 2}, .groups = 2}));
  run_case(conv_t_case("fast conv_transpose2d stride 2", {{2, 4, 5, 5}, {4, 3, 4, 4}, {3}},
                       {.stride = {2, 2}, .padding = {1, 1}}));
  paths.expect_cudnn();
}

TEST_CASE("conv2d and conv_transpose2d channels last (nhwc) through the harness") {
  // Inputs [N, H, W, C]; the references run on the NCHW permutation. One
  // group takes the CPU kernels' in-place path and, on a GPU, cuDNN's
  // channels-last algorithms (the filter transposed to [O, kh, kw, C] for
  // them); several groups are permuted around the channels-first kernels.
  const ConvLayout nhwc = ConvLayout::nhwc;
  // One group: cuDNN's channels-last algorithms, for f32 at least (f64
  // channels last may have none, and its rows then run through im2col).
  const GpuConvPaths one_group;
  run_case(conv_case("conv2d nhwc with bias", {{2, 5, 6, 3}, {4, 3, 3, 3}, {4}}, {.layout = nhwc},
                     {{0, 5, 6, 3}, {4, 3, 3, 3}, {4}}));
  run_case(conv_case("conv2d nhwc stride 2 padding 1, 16 outputs",
                     {{2, 7, 6, 3}, {16, 3, 3, 3}, {16}},
                     {.stride = {2, 2}, .padding = {1, 1}, .layout = nhwc}));
  run_case(conv_case("conv2d nhwc dilation, uneven padding, one channel",
                     {{1, 7, 7, 1}, {3, 1, 3, 2}},
                     {.padding = {2, 1}, .dilation = {2, 2}, .layout = nhwc}));
  run_case(conv_case("conv2d nhwc 1x1", {{2, 4, 5, 3}, {5, 3, 1, 1}, {5}}, {.layout = nhwc}));
  run_case(conv_t_case(
      "conv_transpose2d nhwc stride 2 output_padding 1", {{2, 3, 3, 4}, {4, 3, 3, 3}, {3}},
      {.stride = {2, 2}, .padding = {1, 1}, .output_padding = {1, 1}, .layout = nhwc},
      {{0, 3, 3, 4}, {4, 3, 3, 3}, {3}}));
  one_group.expect_some_cudnn();
  // Several groups: permuted around the channels-first kernels.
  const GpuConvPaths groups;
  run_case(conv_case("conv2d nhwc groups 2", {{2, 5, 5, 4}, {6, 2, 3, 3}, {6}},
                     {.stride = {1, 2}, .padding = {1, 0}, .groups = 2, .layout = nhwc}));
  run_case(conv_t_case("conv_transpose2d nhwc groups 2, dilation",
                       {{1, 3, 4, 4}, {4, 2, 2, 3}, {4}},
                       {.stride = {2, 1},
                        .dilation = {1, 2},
                        .output_padding = {1, 0},
                        .groups = 2,
                        .layout = nhwc}));
  groups.expect_some();
  // A geometry cuDNN refuses (above) on the im2col path between transposes.
  const GpuConvPaths grown;
  run_case(conv_t_case("conv_transpose2d nhwc output_padding from dilation",
                       {{1, 3, 3, 2}, {2, 2, 2, 2}, {2}},
                       {.dilation = {2, 2}, .output_padding = {1, 1}, .layout = nhwc}));
  grown.expect_im2col();
}

TEST_CASE("conv channels last computes the same bits as channels first") {
  // The kernels plan their chunks the same way in both layouts and only skip
  // the transposes, so outputs and input and weight gradients are equal to
  // the bit, in f32 (the direct kernels where the CPU has AVX-512) and f64
  // (the GEMM path). Convolutions with one channel on the input side run
  // planar channels first (no transposes to save), so theirs are only near,
  // as is the bias gradient, which sums in another order.
  struct Layer {
    Shape x, w;
    ConvArgs a;
    bool transposed;
  };
  const std::vector<Layer> layers = {
      {{5, 1, 28, 28}, {32, 1, 4, 4}, {.stride = {2, 2}, .padding = {1, 1}}, false},
      {{5, 32, 14, 14}, {32, 32, 4, 4}, {.stride = {2, 2}, .padding = {1, 1}}, false},
      {{3, 16, 7, 7}, {32, 16, 3, 3}, {.padding = {1, 1}}, false},
      {{4, 6, 9, 8}, {5, 6, 3, 2}, {.stride = {2, 1}, .padding = {1, 1}}, false},
      {{3, 32, 7, 7}, {32, 32, 4, 4}, {.stride = {2, 2}, .padding = {1, 1}}, true},
      {{3, 32, 14, 14}, {32, 1, 4, 4}, {.stride = {2, 2}, .padding = {1, 1}}, true},
  };
  // Our kernels, and oneDNN's where the build has them (f32 layers with one
  // group run its channels-last primitive between transposes).
  const bool onednn_was_on = cpu::conv_onednn_enable(false);
  uint64_t seed = 300;
  for (const bool onednn : {false, true})
    for (const DType dt : {DType::f32, DType::f64})
      for (const Layer& l : layers) {
        cpu::conv_onednn_enable(onednn);
        const std::string what =
            std::string(dtype_name(dt)) + " " + shape_str(l.x) + (onednn ? " oneDNN" : "");
        CAPTURE(what);
        const Tensor x = make_input(l.x, Domain::any, seed++).to(dt);
        const Tensor w = make_input(l.w, Domain::any, seed++).to(dt);
        const Tensor b = make_input({l.transposed ? l.w[1] : l.w[0]}, Domain::any, seed++).to(dt);
        auto run = [&](ConvLayout layout) {
          ConvArgs a = l.a;
          a.layout = layout;
          const Tensor xl = from_nchw(x, a).detach().requires_grad_();
          const Tensor wl = w.detach().requires_grad_(), bl = b.detach().requires_grad_();
          const Tensor y = l.transposed
                               ? conv_transpose2d(xl, wl, bl, a.stride, a.padding, a.output_padding,
                                                  1, a.dilation, layout)
                               : conv2d(xl, wl, bl, a.stride, a.padding, a.dilation, 1, layout);
          const Tensor g = from_nchw(make_input(to_nchw(y, a).shape(), Domain::any, 7).to(dt), a);
          sum(mul(y, g)).backward();
          return std::vector<Tensor>{to_nchw(y.detach(), a), to_nchw(xl.grad(), a), wl.grad(),
                                     bl.grad()};
        };
        const std::vector<Tensor> first = run(ConvLayout::nchw), last = run(ConvLayout::nhwc);
        const bool one_channel = (l.transposed ? l.w[1] : l.x[1]) == 1;
        const double eps = dt == DType::f32 ? 1e-5 : 1e-12;
        for (size_t i = 0; i < 4; ++i) {
          const double tol = i == 3 || one_channel ? eps * (1 + max(abs(first[i])).item()) : 0.0;
          CHECK(max_abs_diff(first[i], last[i]) <= tol);
        }
      }
  cpu::conv_onednn_enable(onednn_was_on);
}

TEST_CASE("pooling and upsampling through the harness") {
  run_case(pool_case("avg_pool2d 2x2", {2, 3, 4, 6}, {2, 2}, {0, 0}, {0, 0}, {1, 1}, false));
  run_case(pool_case("avg_pool2d 3x3 stride 2 padding 1", {1, 2, 7, 6}, {3, 3}, {2, 2}, {1, 1},
                     {1, 1}, false));
  run_case(pool_case("avg_pool2d 3x2 stride (1, 2)", {1, 2, 5, 5}, {3, 2}, {1, 2}, {0, 1}, {1, 1},
                     false));
  run_case(pool_case("max_pool2d 2x2", {2, 3, 4, 6}, {2, 2}, {0, 0}, {0, 0}, {1, 1}, true));
  run_case(pool_case("max_pool2d 3x3 stride 2 padding 1", {1, 2, 7, 6}, {3, 3}, {2, 2}, {1, 1},
                     {1, 1}, true));
  run_case(pool_case("max_pool2d dilation 2", {1, 2, 6, 7}, {2, 3}, {1, 1}, {1, 1}, {2, 2}, true));
  run_case(pool_case("avg_pool2d 2x3 stride (2, 1) padding 1", {2, 2, 5, 6}, {2, 3}, {2, 1}, {1, 1},
                     {1, 1}, false));
  run_case(pool_case("max_pool2d 3x2 stride (1, 2) padding 1 dilation (2, 1)", {2, 2, 7, 6}, {3, 2},
                     {1, 2}, {1, 1}, {2, 1}, true));
  run_case(pool_case("max_pool2d overlapping 3x3 stride 1 padding 1", {1, 3, 5, 5}, {3, 3}, {1, 1},
                     {1, 1}, {1, 1}, true));

  OpCase up;
  up.name = "interpolate_nearest2x";
  up.shapes = {{2, 3, 3, 4}};
  up.zero_shapes = {{0, 3, 3, 4}};
  up.op = [](const Inputs& x) { return interpolate_nearest2x(x[0]); };
  up.reference = [](const Inputs& x) {
    const Shape& s = x[0].shape();
    const auto v = x[0].to_vector<double>();
    const int64_t P = s[0] * s[1], H = s[2], W = s[3];
    std::vector<double> out(static_cast<size_t>(P * 4 * H * W));
    for (int64_t p = 0; p < P; ++p)
      for (int64_t h = 0; h < 2 * H; ++h)
        for (int64_t w = 0; w < 2 * W; ++w)
          out[(p * 2 * H + h) * 2 * W + w] = v[(p * H + h / 2) * W + w / 2];
    return from_values(out, {s[0], s[1], 2 * H, 2 * W});
  };
  run_case(up);
}

TEST_CASE("conv on several images takes the threaded paths and stays exact") {
  // Enough images for whole images per thread (weight-gradient partial sums).
  const ConvArgs a{.stride = {1, 1}, .padding = {1, 1}, .groups = 2};
  const Tensor x = make_input({5, 6, 11, 13}, Domain::any, 1).requires_grad_();
  const Tensor w = make_input({8, 3, 3, 3}, Domain::any, 2).requires_grad_();
  const Tensor b = make_input({8}, Domain::any, 3).requires_grad_();
  const Tensor y = conv2d(x, w, b, a.stride, a.padding, a.dilation, a.groups);
  CHECK(max_abs_diff(y, ref_conv2d(x.detach(), w.detach(), &b, a)) < 1e-10);
  const Tensor g = make_input(y.shape(), Domain::any, 4);
  sum(mul(y, g)).backward();
  // <conv(x, w), g> is linear in x and in w: its gradients must reproduce it.
  const Tensor y0 = ref_conv2d(x.detach(), w.detach(), nullptr, a);
  CHECK(dot(x.detach(), x.grad()) == doctest::Approx(dot(y0, g)).epsilon(1e-10));
  CHECK(dot(w.detach(), w.grad()) == doctest::Approx(dot(y0, g)).epsilon(1e-10));
  CHECK(max_abs_diff(b.grad(), sum(g, {0, 2, 3})) < 1e-10);
  // The weight gradient is the sum of the per-image ones.
  Tensor per_image = zeros(w.shape(), {.dtype = DType::f64});
  for (int64_t n = 0; n < 5; ++n) {
    const Tensor xn = narrow(x.detach(), 0, n, 1);
    const Tensor wn = w.detach().clone().requires_grad_();
    sum(mul(conv2d(xn, wn, Tensor(), a.stride, a.padding, a.dilation, a.groups),
            narrow(g, 0, n, 1)))
        .backward();
    per_image = per_image + wn.grad();
  }
  CHECK(max_abs_diff(per_image, w.grad()) < 1e-10);

  // Transposed convolution on several images matches its scatter reference.
  const ConvArgs t{.stride = {2, 2}, .padding = {1, 1}, .output_padding = {1, 0}};
  const Tensor xt = make_input({4, 5, 6, 7}, Domain::any, 5);
  const Tensor wt = make_input({5, 3, 4, 3}, Domain::any, 6);
  CHECK(max_abs_diff(conv_transpose2d(xt, wt, Tensor(), t.stride, t.padding, t.output_padding),
                     ref_conv_transpose2d(xt, wt, nullptr, t)) < 1e-10);
}

// Gradients of <conv2d(x, w) + b, g> checked through linearity: <x, dx> and
// <w, dw> each reproduce <conv2d(x, w), g>, and db is g summed per channel.
void check_conv2d_exact(const Shape& xs, const Shape& ws, const ConvArgs& a, uint64_t seed,
                        double tol) {
  const Tensor x = make_input(xs, Domain::any, seed).requires_grad_();
  const Tensor w = make_input(ws, Domain::any, seed + 1).requires_grad_();
  const Tensor b = make_input({ws[0]}, Domain::any, seed + 2).requires_grad_();
  const Tensor y = conv2d(x, w, b, a.stride, a.padding, a.dilation, a.groups);
  CHECK(max_abs_diff(y, ref_conv2d(x.detach(), w.detach(), &b, a)) < tol);
  const Tensor g = make_input(y.shape(), Domain::any, seed + 3);
  sum(mul(y, g)).backward();
  const double y0g = dot(ref_conv2d(x.detach(), w.detach(), nullptr, a), g);
  CHECK(dot(x.detach(), x.grad()) == doctest::Approx(y0g).epsilon(tol));
  CHECK(dot(w.detach(), w.grad()) == doctest::Approx(y0g).epsilon(tol));
  CHECK(max_abs_diff(b.grad(), sum(g, {0, 2, 3})) < tol);
}

TEST_CASE("conv with many channels (the channels-last path) matches the direct loops") {
  // The main job's layers at a small batch, then strides, dilations and
  // paddings the main job does not use; odd batches split unevenly into
  // chunks and threads.
  check_conv2d_exact({3, 32, 14, 14}, {32, 32, 4, 4}, {.stride = {2, 2}, .padding = {1, 1}}, 20,
                     1e-10);
  check_conv2d_exact({2, 32, 7, 7}, {32, 32, 3, 3}, {.padding = {1, 1}}, 30, 1e-10);
  check_conv2d_exact({5, 32, 7, 7}, {16, 32, 1, 1}, {}, 40, 1e-10);
  check_conv2d_exact({3, 16, 7, 7}, {32, 16, 3, 3}, {.padding = {1, 1}}, 50, 1e-10);
  check_conv2d_exact({7, 8, 9, 11}, {5, 8, 3, 2},
                     {.stride = {2, 3}, .padding = {2, 1}, .dilation = {2, 1}}, 60, 1e-10);
  check_conv2d_exact({1, 4, 5, 6}, {3, 4, 5, 6}, {.padding = {0, 0}}, 70, 1e-10);
  check_conv2d_exact({2, 6, 4, 4}, {4, 6, 3, 3}, {.stride = {3, 3}, .padding = {2, 2}}, 80, 1e-10);

  // Transposed (the decoder's upsampling layers): forward against the
  // scatter reference, several images.
  const ConvArgs t{.stride = {2, 2}, .padding = {1, 1}};
  for (const Shape& ws : {Shape{32, 32, 4, 4}, Shape{32, 1, 4, 4}, Shape{8, 6, 3, 3}}) {
    const Tensor xt = make_input({5, ws[0], 7, 7}, Domain::any, 90);
    const Tensor wt = make_input(ws, Domain::any, 91);
    const Tensor bt = make_input({ws[1]}, Domain::any, 92);
    CHECK(max_abs_diff(conv_transpose2d(xt, wt, bt, t.stride, t.padding),
                       ref_conv_transpose2d(xt, wt, &bt, t)) < 1e-10);
  }

  // f32 stays within f32 rounding of the f64 result.
  const Tensor x = make_input({6, 32, 14, 14}, Domain::any, 100);
  const Tensor w = make_input({32, 32, 4, 4}, Domain::any, 101);
  const Tensor y64 = conv2d(x, w, Tensor(), {2, 2}, {1, 1});
  const Tensor y32 = conv2d(x.to(DType::f32), w.to(DType::f32), Tensor(), {2, 2}, {1, 1});
  CHECK(max_abs_diff(y32.to(DType::f64), y64) < 1e-4 * (1 + max(abs(y64)).item()));
}

TEST_CASE("conv2d is the adjoint of conv_transpose2d") {
  const Tensor x = make_input({2, 4, 9, 8}, Domain::any, 7);
  const Tensor w = make_input({6, 2, 3, 3}, Domain::any, 8);
  const Tensor y = conv2d(x, w, Tensor(), {2, 2}, {1, 1}, {1, 1}, 2);
  const Tensor g = make_input(y.shape(), Domain::any, 9);
  const Tensor xt = conv_transpose2d(g, w, Tensor(), {2, 2}, {1, 1}, {0, 1}, 2);
  CHECK(xt.shape() == x.shape());
  CHECK(dot(y, g) == doctest::Approx(dot(x, xt)).epsilon(1e-12));
}

TEST_CASE("conv and pooling with zero batch run forward and backward") {
  const Tensor x = zeros({0, 3, 6, 6}, {.dtype = DType::f64}).requires_grad_();
  const Tensor w = make_input({4, 3, 3, 3}, Domain::any, 10).requires_grad_();
  const Tensor b = make_input({4}, Domain::any, 11).requires_grad_();
  const Tensor y = conv2d(x, w, b, {1, 1}, {1, 1});
  CHECK(y.shape() == Shape{0, 4, 6, 6});
  const Tensor yt = conv_transpose2d(y, w, Tensor(), {2, 2}, {1, 1}, {1, 1});
  CHECK(yt.shape() == Shape{0, 3, 12, 12});
  const Tensor p = max_pool2d(avg_pool2d(interpolate_nearest2x(yt), {2, 2}), {2, 2});
  CHECK(p.shape() == Shape{0, 3, 6, 6});
  sum(p).backward();
  CHECK(x.grad().shape() == x.shape());
  CHECK(w.grad().shape() == w.shape());
  CHECK(sum(abs(w.grad())).item() == 0.0);
  CHECK(b.grad().shape() == b.shape());
  CHECK(sum(abs(b.grad())).item() == 0.0);
}

TEST_CASE("conv and pooling: 16-bit floats compute in f32 and keep their dtype") {
  const Tensor x = make_input({1, 2, 5, 5}, Domain::any, 12);
  const Tensor w = make_input({3, 2, 3, 3}, Domain::any, 13);
  for (DType t : {DType::bf16, DType::f16}) {
    const Tensor y = conv2d(x.to(t), w.to(t), Tensor(), {1, 1}, {1, 1});
    CHECK(y.dtype() == t);
    const Tensor want =
        ref_conv2d(x.to(t).to(DType::f64), w.to(t).to(DType::f64), nullptr, {.padding = {1, 1}});
    CHECK(max_abs_diff(y, want) < (t == DType::bf16 ? 0.25 : 0.05));
    CHECK(max_pool2d(x.to(t), {2, 2}).dtype() == t);
    CHECK(avg_pool2d(x.to(t), {2, 2}).dtype() == t);
  }
}

TEST_CASE("max_pool2d sends the gradient to the first maximum only") {
  const Tensor x = from_vector<double>({1, 3, 3, 2}, {1, 1, 2, 2}).requires_grad_();
  const Tensor y = max_pool2d(x, {2, 2});
  CHECK(y.item() == 3.0);
  sum(y).backward();
  CHECK(x.grad().to_vector<double>() == std::vector<double>{0, 1, 0, 0});
  // Padding never wins, even against negative values.
  const Tensor n = full({1, 1, 2, 2}, -5.0);
  CHECK(max_pool2d(n, {2, 2}, {1, 1}, {1, 1}).to_vector<double>() == std::vector<double>(9, -5.0));
  // avg_pool2d counts the padding in the mean.
  const Tensor o = ones({1, 1, 2, 2});
  CHECK(avg_pool2d(o, {2, 2}, {1, 1}, {1, 1}).to_vector<double>() ==
        std::vector<double>{0.25, 0.5, 0.25, 0.5, 1.0, 0.5, 0.25, 0.5, 0.25});
}

TEST_CASE("max_pool2d: ties and NaN pick the same element on every device") {
  // One 2x2 window each: ties go to the first maximum; a NaN beats
  // everything and a later NaN beats an earlier one.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<double> v{2, 2, 1, 2, 1, nan, 3, nan, -1, -1, -1, -1};
  const Tensor x = from_vector<double>(v, {1, 3, 2, 2});
  const Tensor g = from_vector<double>({1, 2, 3}, {1, 3, 1, 1});
  auto run = [&](Device d, DType t) {
    const Tensor xd = x.to(t).to(d).detach().requires_grad_();  // never x itself
    const Tensor y = max_pool2d(xd, {2, 2});
    CHECK(y.device() == d);
    y.backward(g.to(t).to(d));
    return std::pair{y.to(Device::cpu()).to_vector<double>(),
                     xd.grad().to(Device::cpu()).to_vector<double>()};
  };
  const auto [y, gx] = run(Device::cpu(), DType::f64);
  CHECK(y[0] == 2.0);
  CHECK(std::isnan(y[1]));
  CHECK(y[2] == -1.0);
  CHECK(gx == std::vector<double>{1, 0, 0, 0, 0, 0, 0, 2, 3, 0, 0, 0});
  for (const Device dev : quanta::testing::test_devices()) {
    for (DType t : {DType::f64, DType::f32}) {
      const auto [yd, gd] = run(dev, t);
      CHECK(yd[0] == 2.0);
      CHECK(std::isnan(yd[1]));
      CHECK(yd[2] == -1.0);
      CHECK(gd == gx);
    }
  }
}

TEST_CASE("conv and pooling name the op and the problem in their errors") {
  const Tensor x = ones({1, 4, 5, 5});
  CHECK_THROWS_WITH_AS(conv2d(x, ones({2, 3, 3, 3})),
                       doctest::Contains("[conv2d] weight [2, 3, 3, 3] expects 3 input channels"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(conv2d(x, ones({2, 2, 3, 3}), Tensor(), {1, 1}, {0, 0}, {1, 1}, 3),
                       doctest::Contains("[conv2d] input channels (4) are not divisible by "
                                         "groups (3)"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(conv2d(x, ones({3, 2, 3, 3}), Tensor(), {1, 1}, {0, 0}, {1, 1}, 2),
                       doctest::Contains("output channels (3) are not divisible"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(conv2d(x, ones({2, 4, 7, 3})),
                       doctest::Contains("[conv2d] output size is not positive"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(conv2d(x, ones({2, 4, 3, 3}), ones({3})),
                       doctest::Contains("[conv2d] bias must have shape [2]"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(conv2d(ones({4, 5, 5}), ones({2, 4, 3, 3})),
                       doctest::Contains("[conv2d] input must be 4-d"), std::invalid_argument);
  // Channels last: the sizes are read where that layout keeps them.
  const ConvLayout nhwc = ConvLayout::nhwc;
  CHECK_THROWS_WITH_AS(
      conv2d(ones({4, 5, 5}), ones({2, 4, 3, 3}), Tensor(), {1, 1}, {0, 0}, {1, 1}, 1, nhwc),
      doctest::Contains("[conv2d] input must be 4-d [N, H, W, C] (layout nhwc)"),
      std::invalid_argument);
  CHECK_THROWS_WITH_AS(conv2d(x, ones({2, 4, 3, 3}), Tensor(), {1, 1}, {0, 0}, {1, 1}, 1, nhwc),
                       doctest::Contains("[conv2d] weight [2, 4, 3, 3] expects 4 input channels"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(conv_transpose2d(ones({1, 5, 5, 3}), ones({4, 2, 3, 3}), Tensor(), {1, 1},
                                        {0, 0}, {0, 0}, 1, {1, 1}, nhwc),
                       doctest::Contains("[conv_transpose2d] weight [4, 2, 3, 3] expects 4 input "
                                         "channels: got input [1, 5, 5, 3]"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(conv2d(x, ones({2, 4, 3, 3}), Tensor(), {0, 1}),
                       doctest::Contains("[conv2d] stride must be positive"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(
      conv2d(ones({1, 4, 5, 5}, {.dtype = DType::i32}), ones({2, 4, 3, 3}, {.dtype = DType::i32})),
      doctest::Contains("[conv2d] needs floating operands: got i32"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(conv_transpose2d(x, ones({3, 2, 3, 3})),
                       doctest::Contains("[conv_transpose2d] weight [3, 2, 3, 3] expects 3 "
                                         "input channels"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(conv_transpose2d(x, ones({4, 2, 3, 3}), Tensor(), {2, 2}, {0, 0}, {2, 0}),
                       doctest::Contains("[conv_transpose2d] output_padding must be"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(
      conv_transpose2d(ones({1, 4, 1, 1}), ones({4, 2, 1, 1}), Tensor(), {1, 1}, {1, 1}),
      doctest::Contains("[conv_transpose2d] output size is not positive"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(avg_pool2d(x, {2, 2}, {0, 0}, {2, 2}),
                       doctest::Contains("[avg_pool2d] padding must be between 0 and half"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(max_pool2d(x, {7, 7}),
                       doctest::Contains("[max_pool2d] output size is not positive"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(interpolate_nearest2x(ones({5, 5})),
                       doctest::Contains("[interpolate_nearest2x] input must be"),
                       std::invalid_argument);
}

namespace {

// Output, input gradient and weight gradient of <op(x, w) + b, g>.
struct ConvResults {
  Tensor y, gx, gw;
};
template <class Op>
ConvResults conv_results(Op op, const Tensor& x0, const Tensor& w0, const Tensor& b0,
                         const Tensor& g, DType dt) {
  const Tensor x = x0.to(dt).detach().requires_grad_(), w = w0.to(dt).detach().requires_grad_();
  const Tensor y = op(x, w, b0.to(dt));
  sum(mul(y, g.to(dt))).backward();
  return {y.detach().to(DType::f64), x.grad().to(DType::f64), w.grad().to(DType::f64)};
}

bool same_bits(const Tensor& a, const Tensor& b) { return max_abs_diff(a, b) == 0.0; }

// Output, input gradient and weight gradient of an f32 run within f32
// rounding of the reference's.
void check_near(const ConvResults& got, const ConvResults& ref) {
  auto near = [](const Tensor& t, const Tensor& r) {
    return max_abs_diff(t, r) < 2e-5 * (1 + max(abs(r)).item());
  };
  CHECK(near(got.y, ref.y));
  CHECK(near(got.gx, ref.gx));
  CHECK(near(got.gw, ref.gw));
}

}  // namespace

TEST_CASE("conv f32: the direct kernels match the GEMM path and the f64 result") {
  // The direct kernels (engine/cpu/conv_direct.h) take f32 layers with 16k
  // channels on their vector side and AVX-512; the GEMM path serves the rest.
  ConvGeom probe{};
  probe.O = probe.C = 16;
  probe.groups = 1;
  const bool direct_here = cpu::conv_direct_serves(ConvKind::forward, probe);
  if (!direct_here)
    MESSAGE(
        "no AVX-512 here: both runs below take the GEMM path, whose sums follow the thread "
        "count, so the thread-count check is skipped");
  struct Layer {
    const char* name;
    Shape x, w;
    ConvArgs a;
    bool transposed;
    bool fixed_order;  // conv2d with a direct forward
  };
  const std::vector<Layer> layers = {
      {"enc1 (one input channel)",
       {3, 1, 28, 28},
       {32, 1, 4, 4},
       {.stride = {2, 2}, .padding = {1, 1}},
       false,
       false},
      {"enc2", {5, 32, 14, 14}, {32, 32, 4, 4}, {.stride = {2, 2}, .padding = {1, 1}}, false, true},
      {"enc4 (1x1, 16 outputs)", {5, 32, 7, 7}, {16, 32, 1, 1}, {}, false, true},
      {"dec1 (16 inputs)", {3, 16, 7, 7}, {32, 16, 3, 3}, {.padding = {1, 1}}, false, true},
      {"48 channels: a 32 and a 16 block",
       {2, 48, 6, 5},
       {48, 48, 3, 2},
       {.stride = {2, 1}, .padding = {2, 0}, .dilation = {1, 2}},
       false,
       true},
      {"8 channels (weight gradient only)",
       {3, 8, 9, 9},
       {16, 8, 3, 3},
       {.padding = {1, 1}},
       false,
       false},
      {"dec2 (transposed)",
       {3, 32, 7, 7},
       {32, 32, 4, 4},
       {.stride = {2, 2}, .padding = {1, 1}},
       true,
       false},
      {"dec3 (transposed, one output channel)",
       {3, 32, 14, 14},
       {32, 1, 4, 4},
       {.stride = {2, 2}, .padding = {1, 1}},
       true,
       false},
  };
  // Our kernels alone: oneDNN's are off (the case below compares them).
  const bool onednn_was_on = cpu::conv_onednn_enable(false);
  const int threads = num_threads();
  uint64_t seed = 200;
  for (const Layer& l : layers) {
    const std::string name = l.name;
    CAPTURE(name);
    const ConvArgs a = l.a;
    auto op = [&](const Tensor& x, const Tensor& w, const Tensor& b) {
      return l.transposed
                 ? conv_transpose2d(x, w, b, a.stride, a.padding, a.output_padding, 1, a.dilation)
                 : conv2d(x, w, b, a.stride, a.padding, a.dilation);
    };
    const Tensor x = make_input(l.x, Domain::any, seed++);
    const Tensor w = make_input(l.w, Domain::any, seed++);
    const Tensor b = make_input({l.transposed ? l.w[1] : l.w[0]}, Domain::any, seed++);
    const Tensor g = make_input(op(x, w, b).shape(), Domain::any, seed++);
    const ConvResults f64 = conv_results(op, x, w, b, g, DType::f64);
    cpu::conv_direct_enable(false);
    const ConvResults gemm = conv_results(op, x, w, b, g, DType::f32);
    cpu::conv_direct_enable(true);
    const ConvResults direct = conv_results(op, x, w, b, g, DType::f32);
    check_near(direct, f64);
    check_near(gemm, f64);
    // The direct forward sums each element in one fixed order: the thread
    // count does not change a bit. (The input gradient adds its tiles in an
    // order that follows the chunks, which follow the thread count.)
    if (!l.fixed_order || !direct_here) continue;
    set_num_threads(1);
    const ConvResults one = conv_results(op, x, w, b, g, DType::f32);
    set_num_threads(2);
    const ConvResults two = conv_results(op, x, w, b, g, DType::f32);
    CHECK(same_bits(one.y, two.y));
  }
  set_num_threads(threads);
  cpu::conv_onednn_enable(onednn_was_on);
}

TEST_CASE("conv f32: oneDNN's kernels match ours and the f64 result") {
  // f32 layers that oneDNN runs with one of its optimised kernels go through
  // it (engine/cpu/conv_onednn.h); off, the same layers take our kernels.
  if (!cpu::bf16_products_built()) {
    MESSAGE("skipped: this build has no oneDNN, so every convolution takes our own kernels");
    return;
  }
  struct Layer {
    const char* name;
    Shape x, w;
    ConvArgs a;
    bool transposed;
  };
  const ConvArgs s2p1{.stride = {2, 2}, .padding = {1, 1}, .layout = ConvLayout::nhwc};
  const std::vector<Layer> layers = {
      {"enc1 (one input channel)", {4, 28, 28, 1}, {32, 1, 4, 4}, s2p1, false},
      {"enc2", {4, 14, 14, 32}, {32, 32, 4, 4}, s2p1, false},
      {"enc3",
       {3, 7, 7, 32},
       {32, 32, 3, 3},
       {.padding = {1, 1}, .layout = ConvLayout::nhwc},
       false},
      {"enc4 (1x1)", {3, 7, 7, 32}, {16, 32, 1, 1}, {.layout = ConvLayout::nhwc}, false},
      {"dec1",
       {3, 7, 7, 16},
       {32, 16, 3, 3},
       {.padding = {1, 1}, .layout = ConvLayout::nhwc},
       false},
      {"dec2 (transposed)", {3, 7, 7, 32}, {32, 32, 4, 4}, s2p1, true},
      {"dec3 (transposed to one channel)", {3, 14, 14, 32}, {32, 1, 4, 4}, s2p1, true},
      {"enc2 channels first",
       {3, 32, 14, 14},
       {32, 32, 4, 4},
       {.stride = {2, 2}, .padding = {1, 1}},
       false},
      {"two groups, channels first",
       {2, 8, 9, 9},
       {6, 4, 3, 3},
       {.padding = {1, 1}, .groups = 2},
       false},
      {"dilated, strided unevenly",
       {2, 6, 5, 48},
       {48, 48, 3, 2},
       {.stride = {2, 1}, .padding = {2, 0}, .dilation = {1, 2}, .layout = ConvLayout::nhwc},
       false},
      {"a stride that drops the last row",
       {2, 16, 16, 8},
       {16, 8, 3, 3},
       {.stride = {2, 2}, .layout = ConvLayout::nhwc},
       false},
      {"transposed with output padding",
       {2, 5, 5, 16},
       {16, 8, 3, 3},
       {.stride = {2, 2}, .padding = {1, 1}, .output_padding = {1, 1}, .layout = ConvLayout::nhwc},
       true},
  };
  uint64_t seed = 900;
  for (const Layer& l : layers) {
    const std::string name = l.name;
    CAPTURE(name);
    const ConvArgs a = l.a;
    auto op = [&](const Tensor& x, const Tensor& w, const Tensor& b) {
      return l.transposed ? conv_transpose2d(x, w, b, a.stride, a.padding, a.output_padding,
                                             a.groups, a.dilation, a.layout)
                          : conv2d(x, w, b, a.stride, a.padding, a.dilation, a.groups, a.layout);
    };
    const Tensor x = make_input(l.x, Domain::any, seed++);
    const Tensor w = make_input(l.w, Domain::any, seed++);
    const Tensor b = make_input({l.transposed ? l.w[1] * a.groups : l.w[0]}, Domain::any, seed++);
    const Tensor g = make_input(op(x, w, b).shape(), Domain::any, seed++);
    const ConvResults f64 = conv_results(op, x, w, b, g, DType::f64);
    const bool was_on = cpu::conv_onednn_enable(false);
    const ConvResults ours = conv_results(op, x, w, b, g, DType::f32);
    cpu::conv_onednn_enable(true);
    const ConvResults onednn = conv_results(op, x, w, b, g, DType::f32);
    const ConvResults again = conv_results(op, x, w, b, g, DType::f32);
    cpu::conv_onednn_enable(was_on);
    check_near(onednn, f64);
    check_near(onednn, ours);
    // A run repeats the last one bit for bit.
    CHECK(same_bits(onednn.y, again.y));
    CHECK(same_bits(onednn.gx, again.gx));
    CHECK(same_bits(onednn.gw, again.gw));
  }
}

TEST_CASE("conv f32: which layers oneDNN takes") {
  if (!cpu::bf16_products_built()) {
    MESSAGE("skipped: this build has no oneDNN");
    return;
  }
  // The main job's enc2 (channels last, batch 64) and its last transposed
  // convolution (the input gradient of a conv2d with one input channel).
  const ConvGeom enc2 = main_job_enc2();
  ConvGeom dec3 = enc2;
  dec3.C = 1, dec3.H = dec3.W = 28, dec3.OH = dec3.OW = 14;
  const bool was_on = cpu::conv_onednn_enable(true);
  for (const ConvKind kind : {ConvKind::forward, ConvKind::input_grad, ConvKind::weight_grad}) {
    CAPTURE(conv_op_name(kind));
    const std::string kernel = cpu::conv_onednn_kernel(kind, enc2);
    CAPTURE(kernel);
    CHECK(!kernel.empty());
    CHECK(kernel.rfind("ref", 0) != 0);
  }
  // Measured slower than ours there (engine/cpu/conv_onednn.cpp).
  CHECK(cpu::conv_onednn_kernel(ConvKind::input_grad, dec3).empty());
  CHECK(!cpu::conv_onednn_kernel(ConvKind::weight_grad, dec3).empty());
  // Off, nothing is oneDNN's.
  cpu::conv_onednn_enable(false);
  CHECK(cpu::conv_onednn_kernel(ConvKind::forward, enc2).empty());
  cpu::conv_onednn_enable(was_on);
}
