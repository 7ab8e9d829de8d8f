#include "engine/ops/harness.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>
#include <string>

#include "support/gpu.h"

namespace quanta::testing {
namespace {

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
double uniform01(uint64_t& s) { return static_cast<double>(splitmix(s) >> 11) * 0x1.0p-53; }

// Largest |a - b| relative to max(1, |b|), NaNs equal only to NaNs.
double max_rel_error(const Tensor& a, const Tensor& b) {
  auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  double worst = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    if (std::isnan(va[i]) || std::isnan(vb[i])) {
      if (std::isnan(va[i]) != std::isnan(vb[i])) return INFINITY;
      continue;
    }
    if (std::isinf(va[i]) || std::isinf(vb[i])) {
      if (va[i] != vb[i]) return INFINITY;
      continue;
    }
    worst = std::max(worst, std::abs(va[i] - vb[i]) / std::max(1.0, std::abs(vb[i])));
  }
  return worst;
}

void check_close(const std::string& what, const Tensor& got, const Tensor& want, double tol) {
  if (got.shape() != want.shape()) {
    FAIL_CHECK(what << ": shape " << shape_str(got.shape()) << ", expected "
                    << shape_str(want.shape()));
    return;
  }
  const double err = max_rel_error(got, want);
  CHECK_MESSAGE(err <= tol, what << ": max relative error " << err << " > " << tol);
}

Inputs make_inputs(const OpCase& c, const std::vector<Shape>& shapes, uint64_t seed) {
  Inputs xs;
  for (size_t k = 0; k < shapes.size(); ++k) {
    const InputSpec spec = k < c.inputs.size() ? c.inputs[k] : InputSpec{};
    xs.push_back(spec.make ? spec.make(shapes[k], seed + 7919 * k)
                           : make_input(shapes[k], spec.domain, seed + 7919 * k));
  }
  return xs;
}

bool differentiable(const OpCase& c, const Inputs& xs, size_t k) {
  const InputSpec spec = k < c.inputs.size() ? c.inputs[k] : InputSpec{};
  return spec.differentiable && xs[k].defined() && is_floating(xs[k].dtype());
}

Inputs cast_floating(const Inputs& xs, DType t) {
  Inputs out;
  for (const auto& x : xs) out.push_back(x.defined() && is_floating(x.dtype()) ? x.to(t) : x);
  return out;
}

// Same values, non-contiguous layout: every other element of a wider buffer
// along the last dim (or a transpose for 0-size-last-dim cases).
Tensor strided_copy(const Tensor& x) {
  if (!x.defined() || x.dim() == 0) return x;
  Shape wide = x.shape();
  wide.back() *= 2;
  Tensor big = zeros(wide, {.dtype = x.dtype()});
  Tensor v = slice(big, -1, 0, wide.back(), 2);
  {
    NoGradGuard no_grad;
    copy_(v, x);
  }
  return v;
}

void forward_check(const OpCase& c, const std::vector<Shape>& shapes, const std::string& tag) {
  Inputs xs = make_inputs(c, shapes, 1234);
  Tensor want = c.reference(xs);
  Tensor got = c.op(xs);
  check_close(c.name + " " + tag + " forward f64", got, want, 1e-9);
  // f32 run against the reference on the same (rounded) values.
  Inputs x32 = cast_floating(xs, DType::f32);
  Tensor want32 = c.reference(cast_floating(x32, DType::f64));
  Tensor got32 = c.op(x32);
  check_close(c.name + " " + tag + " forward f32", got32, want32, c.fwd_tol);
}

// A 16-bit forward on `dev` against the f64 reference on the same rounded values.
void half_forward_check(const OpCase& c, const std::vector<Shape>& shapes, const std::string& tag,
                        Device dev) {
  const Inputs xs = make_inputs(c, shapes, 1234);
  for (DType dt : {DType::bf16, DType::f16}) {
    const std::string what = c.name + " " + tag + " on " + dev.str() + " (" + dtype_name(dt) + ")";
    const Inputs x16 = cast_floating(xs, dt);
    const Tensor want = c.reference(cast_floating(x16, DType::f64));
    Inputs on_dev;
    for (const auto& x : x16) on_dev.push_back(x.defined() ? x.to(dev) : x);
    const Tensor got = c.op(on_dev);
    CHECK_MESSAGE(got.dtype() == dt, what << ": result has dtype " << dtype_name(got.dtype()));
    check_close(what + " forward", got.to(Device::cpu()), want, half_tol(dt));
  }
}

// Analytic gradients of L = sum(op(xs) * w) for every differentiable input.
std::vector<Tensor> analytic_grads(const OpCase& c, const Inputs& xs, const Tensor& w,
                                   Tensor* out_value) {
  Inputs leaves;
  for (size_t k = 0; k < xs.size(); ++k) {
    Tensor x = xs[k];
    if (differentiable(c, xs, k)) x = x.detach().clone().requires_grad_();
    leaves.push_back(x);
  }
  Tensor out = c.op(leaves);
  if (out_value) *out_value = out.detach();
  std::vector<Tensor> grads(xs.size());
  std::vector<Tensor> wanted;
  std::vector<size_t> which;
  for (size_t k = 0; k < xs.size(); ++k)
    if (differentiable(c, xs, k)) {
      wanted.push_back(leaves[k]);
      which.push_back(k);
    }
  if (wanted.empty()) return grads;
  if (!out.requires_grad()) {
    FAIL_CHECK(c.name << ": output does not require grad although an input does");
    return grads;
  }
  Tensor loss = sum(mul(out, w));
  auto gs = autograd::grad({loss}, wanted);
  for (size_t i = 0; i < which.size(); ++i)
    grads[which[i]] = gs[i].defined() ? gs[i] : zeros_like(xs[which[i]]);
  return grads;
}

void gradient_check(const OpCase& c, const std::vector<Shape>& shapes, const std::string& tag) {
  Inputs xs = make_inputs(c, shapes, 4321);
  for (auto& x : xs)
    if (x.defined() && is_floating(x.dtype())) x = x.to(DType::f64);
  Tensor out0;
  {
    NoGradGuard no_grad;
    out0 = c.op(xs);
  }
  Tensor w = make_input(out0.shape(), Domain::any, 99);
  auto grads = analytic_grads(c, xs, w, nullptr);
  const double h = 1e-6;
  for (size_t k = 0; k < xs.size(); ++k) {
    if (!differentiable(c, xs, k)) continue;
    Tensor x = xs[k].contiguous().clone();
    Inputs probe = xs;
    probe[k] = x;
    double* p = x.data<double>();
    std::vector<double> numeric(static_cast<size_t>(x.numel()));
    NoGradGuard no_grad;
    for (int64_t j = 0; j < x.numel(); ++j) {
      const double orig = p[j];
      p[j] = orig + h;
      const double up = sum(mul(c.op(probe), w)).item();
      p[j] = orig - h;
      const double down = sum(mul(c.op(probe), w)).item();
      p[j] = orig;
      numeric[j] = (up - down) / (2 * h);
    }
    Tensor num = from_vector<double>(numeric, x.numel() ? x.shape() : Shape{0}).reshape(x.shape());
    check_close(c.name + " " + tag + " gradient of input " + std::to_string(k), grads[k], num,
                c.grad_tol);
  }
}

void strided_check(const OpCase& c) {
  Inputs xs = make_inputs(c, c.shapes, 555);
  for (auto& x : xs)
    if (x.defined() && is_floating(x.dtype())) x = x.to(DType::f64);
  Inputs ys;
  for (const auto& x : xs) ys.push_back(strided_copy(x));
  Tensor want, got;
  {
    NoGradGuard no_grad;
    want = c.op(xs);
    got = c.op(ys);
  }
  check_close(c.name + " non-contiguous forward", got, want, 1e-12);
  if (!c.grad) return;
  Tensor w = make_input(want.shape(), Domain::any, 77);
  auto g_want = analytic_grads(c, xs, w, nullptr);
  auto g_got = analytic_grads(c, ys, w, nullptr);
  for (size_t k = 0; k < xs.size(); ++k)
    if (g_want[k].defined())
      check_close(c.name + " non-contiguous gradient of input " + std::to_string(k), g_got[k],
                  g_want[k], 1e-12);
}

void zero_size_check(const OpCase& c) {
  Inputs xs = make_inputs(c, c.zero_shapes, 31);
  Tensor want = c.reference(xs);
  Tensor got = c.op(xs);
  CHECK_MESSAGE(got.shape() == want.shape(), c.name << " zero-size: shape "
                                                    << shape_str(got.shape()) << ", expected "
                                                    << shape_str(want.shape()));
  check_close(c.name + " zero-size forward", got, want, 1e-9);
  if (!c.grad) return;
  Tensor w = make_input(got.shape(), Domain::any, 5);
  auto grads = analytic_grads(c, xs, w, nullptr);
  for (size_t k = 0; k < xs.size(); ++k)
    if (grads[k].defined())
      CHECK_MESSAGE(grads[k].shape() == xs[k].shape(),
                    c.name << " zero-size gradient shape of input " << k);
}

}  // namespace

Tensor make_input(const Shape& shape, Domain d, uint64_t seed) {
  const int64_t n = numel_of(shape);
  std::vector<double> v(static_cast<size_t>(n));
  uint64_t s = seed * 0x2545f4914f6cdd1dull + 1;
  for (auto& x : v) {
    const double u = uniform01(s);
    switch (d) {
      case Domain::any:
        x = 4 * u - 2;
        break;
      case Domain::positive:
        x = 0.5 + 1.5 * u;
        break;
      case Domain::unit:
        x = 1.8 * u - 0.9;
        break;
      case Domain::away_from_zero:
        x = (0.3 + 1.7 * u) * (splitmix(s) & 1 ? 1 : -1);
        break;
      case Domain::distinct:
        break;
    }
  }
  if (d == Domain::distinct) {
    // A shuffled ramp: gaps of 0.1 stay far wider than finite-difference steps.
    for (int64_t i = 0; i < n; ++i) v[i] = -0.05 * static_cast<double>(n) + 0.1 * i;
    for (int64_t i = n - 1; i > 0; --i)
      std::swap(v[i], v[splitmix(s) % static_cast<uint64_t>(i + 1)]);
  }
  return from_vector<double>(v, n ? Shape{n} : Shape{0}).reshape(shape);
}

std::vector<int64_t> unravel(int64_t flat, const Shape& shape) {
  std::vector<int64_t> idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    idx[d] = shape[d] ? flat % shape[d] : 0;
    flat = shape[d] ? flat / shape[d] : 0;
  }
  return idx;
}

int64_t ravel(const std::vector<int64_t>& idx, const Shape& shape) {
  int64_t flat = 0;
  for (size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + idx[d];
  return flat;
}

Tensor ref_elementwise(const Inputs& xs,
                       const std::function<double(const std::vector<double>&)>& f) {
  Shape out_shape;
  for (const auto& x : xs) out_shape = broadcast_shapes(out_shape, x.shape(), "ref_elementwise");
  std::vector<std::vector<double>> vals;
  for (const auto& x : xs) vals.push_back(x.to_vector<double>());
  const int64_t n = numel_of(out_shape);
  std::vector<double> out(static_cast<size_t>(n));
  std::vector<double> args(xs.size());
  for (int64_t i = 0; i < n; ++i) {
    auto idx = unravel(i, out_shape);
    for (size_t k = 0; k < xs.size(); ++k) {
      const Shape& s = xs[k].shape();
      std::vector<int64_t> sub(s.size());
      for (size_t d = 0; d < s.size(); ++d) {
        const int64_t od = static_cast<int64_t>(d + out_shape.size() - s.size());
        sub[d] = s[d] == 1 ? 0 : idx[od];
      }
      args[k] = vals[k][ravel(sub, s)];
    }
    out[i] = f(args);
  }
  return from_vector<double>(out, n ? Shape{n} : Shape{0}).reshape(out_shape);
}

Tensor ref_reduce(const Tensor& x, std::vector<int64_t> dims, bool keepdim,
                  const std::function<double(const std::vector<double>&)>& f) {
  dims = wrap_dims(dims, x.dim(), "ref_reduce");
  const Shape& s = x.shape();
  std::vector<bool> red(s.size(), false);
  for (int64_t d : dims) red[d] = true;
  Shape kept = s;
  for (int64_t d : dims) kept[d] = 1;
  auto vals = x.to_vector<double>();
  std::vector<std::vector<double>> groups(static_cast<size_t>(numel_of(kept)));
  for (int64_t i = 0; i < x.numel(); ++i) {
    auto idx = unravel(i, s);
    for (size_t d = 0; d < s.size(); ++d)
      if (red[d]) idx[d] = 0;
    groups[ravel(idx, kept)].push_back(vals[i]);
  }
  std::vector<double> out;
  for (auto& g : groups) out.push_back(f(g));
  Shape out_shape;
  for (size_t d = 0; d < s.size(); ++d)
    if (keepdim || !red[d]) out_shape.push_back(kept[d]);
  const int64_t n = static_cast<int64_t>(out.size());
  return from_vector<double>(out, n ? Shape{n} : Shape{0}).reshape(out_shape);
}

double half_tol(DType t) { return t == DType::bf16 ? 2 * 0x1p-8 : 2 * 0x1p-11; }

// ---- the device axis: every row again on each CUDA device, against the CPU ----

Inputs to_device(const Inputs& xs, Device d) {
  Inputs out;
  for (const auto& x : xs) out.push_back(x.defined() ? x.to(d) : x);
  return out;
}

void device_variant(const OpCase& c, const std::vector<Shape>& shapes, const std::string& tag,
                    Device dev) {
  Inputs xs = make_inputs(c, shapes, 555);
  for (DType dt : {DType::f64, DType::f32}) {
    const std::string what = c.name + " " + tag + " on " + dev.str() + " (" + dtype_name(dt) + ")";
    Inputs host = cast_floating(xs, dt);
    Tensor out_cpu;
    {
      NoGradGuard no_grad;
      out_cpu = c.op(host);
    }
    Tensor w = make_input(out_cpu.shape(), Domain::any, 99);
    if (is_floating(out_cpu.dtype())) w = w.to(out_cpu.dtype());
    // sim runs the CPU's kernels: the same bits. On a GPU, f64 differs from
    // the CPU only by summation order and libm ulps.
    const double tol = dev.is_sim() ? 0.0 : dt == DType::f64 ? 1e-9 : std::max(c.fwd_tol, 1e-5);
    try {
      Tensor got, want;
      std::vector<Tensor> g_cpu, g_dev;
      if (c.grad && is_floating(out_cpu.dtype())) {
        g_cpu = analytic_grads(c, host, w, &want);
        g_dev = analytic_grads(c, to_device(host, dev), w.to(dev), &got);
      } else {
        want = out_cpu;
        got = c.op(to_device(host, dev));
      }
      CHECK_MESSAGE(got.device() == dev, what << ": output landed on " << got.device().str());
      check_close(what + " forward", got.to(Device::cpu()), want, tol);
      for (size_t k = 0; k < g_cpu.size(); ++k)
        if (g_cpu[k].defined())
          check_close(what + " grad of input " + std::to_string(k), g_dev[k].to(Device::cpu()),
                      g_cpu[k], tol * 10);
    } catch (const std::exception& e) {
      // Every kernel family has its device entries: a throw here (a missing
      // entry included) is a failure, never a gap to log.
      FAIL_CHECK(what << " threw: " << e.what());
      return;
    }
  }
}

void device_check(const OpCase& c) {
  static bool said = false;
  if (!said && !have_gpu()) MESSAGE("op harness: cuda axis skipped: " << no_gpu_reason());
  said = true;
  for (const Device dev : test_devices()) {
    device_variant(c, c.shapes, "main", dev);
    if (!c.broadcast_shapes.empty()) device_variant(c, c.broadcast_shapes, "broadcast", dev);
    if (!c.zero_shapes.empty()) device_variant(c, c.zero_shapes, "zero-size", dev);
    if (c.half) {
      try {
        half_forward_check(c, c.shapes, "main", dev);
        if (!c.broadcast_shapes.empty())
          half_forward_check(c, c.broadcast_shapes, "broadcast", dev);
      } catch (const std::exception& e) {
        FAIL_CHECK(c.name << " 16-bit on " << dev.str() << " threw: " << e.what());
      }
    }
  }
}

void run_case(const OpCase& c) {
  INFO("op case: ", c.name);
  REQUIRE_MESSAGE(c.op, c.name << " has no op");
  REQUIRE_MESSAGE(c.reference, c.name << " has no reference");
  forward_check(c, c.shapes, "main");
  if (c.grad) gradient_check(c, c.shapes, "main");
  strided_check(c);
  if (!c.broadcast_shapes.empty()) {
    forward_check(c, c.broadcast_shapes, "broadcast");
    if (c.grad) gradient_check(c, c.broadcast_shapes, "broadcast");
  }
  if (!c.zero_shapes.empty()) zero_size_check(c);
  if (c.half) {
    half_forward_check(c, c.shapes, "main", Device::cpu());
    if (!c.broadcast_shapes.empty())
      half_forward_check(c, c.broadcast_shapes, "broadcast", Device::cpu());
  }
  device_check(c);
}

}  // namespace quanta::testing
