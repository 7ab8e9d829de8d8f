// Samplers: validate, take one stream slice, then map words to values in
// parallel (the word -> element rules are documented in sampling.h).
// rand, randn, randint, bernoulli, uniform_, normal_ and randperm draw on
// the target device through its random_fill (engine/random/draw.h); the rest
// draw on the CPU.
#include "engine/random/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine/autograd/grad_mode.h"
#include "engine/capture/device_graph.h"
#include "engine/cpu/parallel.h"
#include "engine/dispatch.h"
#include "engine/factory.h"
#include "engine/kernels/table.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/view.h"
#include "engine/random/draw.h"
#include "engine/random/word_groups.h"

namespace quanta {
namespace {

void check_shape(const char* op, const Shape& shape) {
  for (int64_t s : shape)
    if (s < 0)
      throw std::invalid_argument(std::string("[") + op + "] negative size in shape " +
                                  shape_str(shape));
}

void check_floating(const char* op, DType t) {
  if (!is_floating(t)) detail::bad_dtype(op, t, "expected a floating dtype");
}

Tensor finish(Tensor t, const TensorOptions& opts) {
  t = t.to(opts.device);
  if (opts.requires_grad) t.requires_grad_(true);
  return t;
}

using cpu::for_groups;
using draw::u53;
using draw::u64_of;

// f with the words for n of its elements taken from gen. Inside a capture of
// `device` the fill reads its stream from device memory that each replay
// rewrites (engine/capture/device_graph.h); outside, a device fill from a
// layer's stream (or a copy of one) is not a draw that keeps a step from
// being captured.
RandomFill take_stream(RandomFill f, int64_t n, Generator& gen, Device device) {
  const int64_t words = draw::words(f.draw, f.dtype, n);
  if (!device.is_cpu() && capturing(device)) {
    f.stream_at = detail::captured_stream(device, gen, words);  // refuses what cannot replay
  } else {
    std::optional<detail::ReplayableDraw> counted_as;
    if (!device.is_cpu() && gen.replay() != Generator::Replay::no) counted_as.emplace();
    const PhiloxStream s = gen.take(words);
    f.key[0] = s.key[0];
    f.key[1] = s.key[1];
    f.start_lo = s.start.lo;
    f.start_hi = s.start.hi;
  }
  return f;
}

// A new contiguous tensor on `device` holding fill f over `shape`: the words
// are taken from gen here, the values made by the device's random_fill.
Tensor draw_tensor(const Shape& shape, RandomFill f, Generator& gen, Device device) {
  Tensor out = detail::make_tensor(shape, f.dtype, device);
  const int64_t n = out.numel();
  kernels(device).random_fill(take_stream(f, n, gen, device), n, out.raw_data());
  return out;
}

RandomFill fill_of(RandomDraw d, DType t) {
  RandomFill f;
  f.draw = d;
  f.dtype = t;
  return f;
}

RandomFill affine_fill(RandomDraw d, DType t, double scale, double shift) {
  RandomFill f = fill_of(d, t);
  f.affine = true;
  f.scale = scale;
  f.shift = shift;
  return f;
}

// A bernoulli(p) fill in `dtype` (f32 or f64: of `value` or 0), its
// arguments checked.
RandomFill bernoulli_fill(const Shape& shape, double p, DType dtype, double value = 1.0) {
  check_shape("bernoulli", shape);
  if (!(p >= 0 && p <= 1))
    throw std::invalid_argument("[bernoulli] p must be in [0, 1]: got " + std::to_string(p));
  RandomFill f = value == 1.0 ? fill_of(RandomDraw::bernoulli, dtype)
                              : affine_fill(RandomDraw::bernoulli, dtype, value, 0.0);
  f.below = draw::bernoulli_below(p);
  return f;
}

// The dtype in-place fills draw in: f64 for f64, else f32.
DType draw_dtype(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }

void check_fill_target(const char* op, const Tensor& t) {
  if (!t.defined()) throw std::invalid_argument(std::string("[") + op + "] undefined tensor");
  check_floating(op, t.dtype());
  if (grad_enabled() && t.requires_grad())
    throw std::invalid_argument(std::string("[") + op +
                                "] in-place update of a tensor that requires grad; run it "
                                "under NoGradGuard (as initialisers do)");
}

// vals (on t's device, f32/f64) written into t (any float dtype and layout).
void write_into(const Tensor& t, Tensor vals) {
  if (vals.dtype() != t.dtype()) vals = vals.to(t.dtype());
  NoGradGuard no_grad;  // t was checked above; copy_ need not see grad mode
  copy_(t, vals);
}

bool representable(int64_t v, DType t) {
  switch (t) {
    case DType::i32:
      return v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max();
    case DType::u8:
      return v >= 0 && v <= 255;
    default:
      return true;
  }
}

}  // namespace

Tensor rand(const Shape& shape, Generator& gen, const TensorOptions& opts) {
  check_shape("rand", shape);
  check_floating("rand", opts.dtype);
  return finish(draw_tensor(shape, fill_of(RandomDraw::uniform, opts.dtype), gen, opts.device),
                opts);
}

Tensor randn(const Shape& shape, Generator& gen, const TensorOptions& opts) {
  check_shape("randn", shape);
  check_floating("randn", opts.dtype);
  Tensor out =
      draw_tensor(shape, fill_of(RandomDraw::normal, draw_dtype(opts.dtype)), gen, opts.device);
  if (out.dtype() != opts.dtype) out = out.to(opts.dtype);
  return finish(out, opts);
}

Tensor randint(int64_t low, int64_t high, const Shape& shape, Generator& gen,
               const TensorOptions& opts) {
  check_shape("randint", shape);
  if (!(low < high))
    throw std::invalid_argument("[randint] need low < high: got low=" + std::to_string(low) +
                                ", high=" + std::to_string(high));
  if (opts.dtype == DType::boolean || !dtype_info(opts.dtype).arithmetic)
    detail::bad_dtype("randint", opts.dtype, "expected an integer or floating dtype");
  if (!representable(low, opts.dtype) || !representable(high - 1, opts.dtype))
    throw std::invalid_argument("[randint] range [" + std::to_string(low) + ", " +
                                std::to_string(high) + ") does not fit dtype " +
                                dtype_name(opts.dtype));
  RandomFill f = fill_of(RandomDraw::integer, DType::i64);
  f.low = low;
  // Unsigned arithmetic: a range up to 2^64 - 1 and the wrapping add are exact.
  f.range = static_cast<uint64_t>(high) - static_cast<uint64_t>(low);
  Tensor out = draw_tensor(shape, f, gen, opts.device);
  if (opts.dtype != DType::i64) out = out.to(opts.dtype);
  return finish(out, opts);
}

namespace {

// The first m of randperm(n): the same keys, only the m smallest sorted.
Tensor permutation_prefix(const char* op, int64_t n, int64_t m, Generator& gen,
                          const TensorOptions& opts) {
  if (n < 0)
    throw std::invalid_argument(std::string("[") + op + "] n must be >= 0: got " +
                                std::to_string(n));
  if (m < 0 || m > n)
    throw std::invalid_argument(std::string("[") + op + "] m must lie in [0, n = " +
                                std::to_string(n) + "]: got " + std::to_string(m));
  if (opts.dtype == DType::boolean || !dtype_info(opts.dtype).arithmetic)
    detail::bad_dtype(op, opts.dtype, "expected an integer or floating dtype");
  if (!opts.device.is_cpu()) {
    // On the device: the same keys drawn there (the bits rule), sorted with
    // their positions by the table's stable sort, which is the order of
    // (key, position) the host sorts by. No upload, so a captured step
    // (dead-code replacement) can draw it, each replay its own.
    const Device device = opts.device;
    const Tensor keys = draw_tensor({n}, fill_of(RandomDraw::bits, DType::i64), gen, device);
    const Tensor positions = shared_arange(n, {.dtype = DType::i64, .device = device});
    Tensor sorted = detail::make_tensor({n}, DType::i64, device);
    kernels(device).sort_pairs(n, static_cast<const int64_t*>(keys.raw_data()),
                               static_cast<const int64_t*>(positions.raw_data()),
                               static_cast<int64_t*>(sorted.raw_data()));
    Tensor out = m == n ? sorted : contiguous(slice(sorted, 0, 0, m));
    if (opts.dtype != DType::i64) out = out.to(opts.dtype);
    return finish(out, opts);
  }
  std::vector<std::pair<uint64_t, int64_t>> keyed(static_cast<size_t>(n));
  for_groups<2>(gen.take(2 * n), n, [&](int64_t i, const uint32_t* w) {
    keyed[static_cast<size_t>(i)] = {u64_of(w), i};
  });
  // (key, index) is a total order, so a partial sort's prefix is the full sort's.
  if (m == n)
    std::sort(keyed.begin(), keyed.end());
  else
    std::partial_sort(keyed.begin(), keyed.begin() + m, keyed.end());
  Tensor out = detail::make_tensor({m}, DType::i64, Device::cpu());
  int64_t* p = out.data<int64_t>();
  for (int64_t i = 0; i < m; ++i) p[i] = keyed[static_cast<size_t>(i)].second;
  if (opts.dtype != DType::i64) out = out.to(opts.dtype);
  return finish(out, opts);
}

}  // namespace

Tensor randperm(int64_t n, Generator& gen, const TensorOptions& opts) {
  return permutation_prefix("randperm", n, n < 0 ? 0 : n, gen, opts);
}

Tensor randperm_prefix(int64_t n, int64_t m, Generator& gen, const TensorOptions& opts) {
  return permutation_prefix("randperm_prefix", n, m, gen, opts);
}

Tensor multinomial(const Tensor& probs, int64_t num_samples, bool replacement, Generator& gen) {
  if (!probs.defined()) throw std::invalid_argument("[multinomial] undefined probs");
  if (probs.dim() != 1 && probs.dim() != 2)
    throw std::invalid_argument("[multinomial] probs must be 1-d or 2-d: got shape " +
                                shape_str(probs.shape()));
  if (!is_floating(probs.dtype()) && !is_integral(probs.dtype()))
    detail::bad_dtype("multinomial", probs.dtype(), "expected floating or integer weights");
  if (num_samples < 0)
    throw std::invalid_argument("[multinomial] num_samples must be >= 0: got " +
                                std::to_string(num_samples));
  const bool one_d = probs.dim() == 1;
  const int64_t rows = one_d ? 1 : probs.size(0), k = probs.size(-1);
  if (!replacement && num_samples > k)
    throw std::invalid_argument("[multinomial] cannot draw " + std::to_string(num_samples) +
                                " samples without replacement from " + std::to_string(k) +
                                " categories");
  Tensor w = probs.detach().to(Device::cpu()).to(DType::f64).contiguous();
  const double* wp = w.data<double>();
  // Validate every row before drawing anything (no throwing inside loops below).
  std::vector<double> cdf(static_cast<size_t>(rows * k));
  for (int64_t r = 0; r < rows; ++r) {
    double acc = 0;
    int64_t positive = 0;
    for (int64_t j = 0; j < k; ++j) {
      const double v = wp[r * k + j];
      if (!(v >= 0) || std::isinf(v))
        throw std::invalid_argument(
            "[multinomial] weights must be finite and non-negative: "
            "got " +
            std::to_string(v) + " at row " + std::to_string(r) + ", column " + std::to_string(j));
      positive += v > 0;
      acc += v;
      cdf[static_cast<size_t>(r * k + j)] = acc;
    }
    if (positive == 0)
      throw std::invalid_argument("[multinomial] row " + std::to_string(r) +
                                  " has no positive weight");
    if (std::isinf(acc))
      throw std::invalid_argument("[multinomial] weights of row " + std::to_string(r) +
                                  " sum to infinity; rescale them");
    if (!replacement && num_samples > positive)
      throw std::invalid_argument("[multinomial] row " + std::to_string(r) + " has only " +
                                  std::to_string(positive) +
                                  " categories with positive "
                                  "weight, asked for " +
                                  std::to_string(num_samples) + " samples without replacement");
  }
  Tensor out = detail::make_tensor(one_d ? Shape{num_samples} : Shape{rows, num_samples},
                                   DType::i64, Device::cpu());
  int64_t* op = out.data<int64_t>();
  if (replacement) {
    const int64_t n = rows * num_samples;
    for_groups<2>(gen.take(2 * n), n, [&](int64_t i, const uint32_t* wd) {
      const int64_t r = i / num_samples;
      const double* c = cdf.data() + r * k;
      const double x = u53(wd) * c[k - 1];
      // First category whose cumulative weight exceeds x: never a zero weight.
      int64_t j = std::upper_bound(c, c + k, x) - c;
      if (j == k) j = k - 1;  // x rounded up to the total (cannot in exact math)
      while (wp[r * k + j] == 0) --j;
      op[i] = j;
    });
  } else {
    // Exponential race: key = ln(E) - ln(w), E = -ln u ~ Exp(1); zero weights
    // get +inf and positive ones stay finite or -inf, so they are never taken
    // (validated: at least num_samples positive weights per row).
    std::vector<double> keys(static_cast<size_t>(rows * k));
    for_groups<2>(gen.take(2 * rows * k), rows * k, [&](int64_t i, const uint32_t* wd) {
      const double u = draw::u53_open0(wd);  // (0, 1]
      keys[static_cast<size_t>(i)] = wp[i] > 0 ? std::log(-std::log(u)) - std::log(wp[i])
                                               : std::numeric_limits<double>::infinity();
    });
    const int64_t grain = std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(k, 1));
    cpu::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
      std::vector<int64_t> idx(static_cast<size_t>(k));
      for (int64_t r = lo; r < hi; ++r) {
        const double* key = keys.data() + r * k;
        std::iota(idx.begin(), idx.end(), int64_t{0});
        std::partial_sort(
            idx.begin(), idx.begin() + num_samples, idx.end(),
            [key](int64_t a, int64_t b) { return key[a] < key[b] || (key[a] == key[b] && a < b); });
        std::copy(idx.begin(), idx.begin() + num_samples, op + r * num_samples);
      }
    });
  }
  return out.to(probs.device());
}

Tensor bernoulli(const Shape& shape, double p, Generator& gen, const TensorOptions& opts) {
  const bool floating = is_floating(opts.dtype);
  if (!floating && opts.dtype != DType::boolean && !dtype_info(opts.dtype).arithmetic)
    detail::bad_dtype("bernoulli", opts.dtype, "expected a numeric or bool dtype");
  // Drawn on the target device in a floating dtype; 0 and 1 then convert
  // exactly to integers and bool.
  const RandomFill f = bernoulli_fill(shape, p, floating ? opts.dtype : DType::f32);
  Tensor out = draw_tensor(shape, f, gen, opts.device);
  if (!floating) out = out.to(opts.dtype);
  return finish(out, opts);
}

Tensor scaled_bernoulli(const Shape& shape, double p, double value, Generator& gen,
                        const TensorOptions& opts) {
  if (opts.dtype != DType::f32 && opts.dtype != DType::f64)
    return mul(bernoulli(shape, p, gen, opts), scalar(value, opts));
  return finish(draw_tensor(shape, bernoulli_fill(shape, p, opts.dtype, value), gen, opts.device),
                opts);
}

namespace detail {
RandomFill taken_bernoulli_fill(const Shape& shape, double p, double value, DType dtype,
                                Generator& gen, Device device) {
  if (dtype != DType::f32 && dtype != DType::f64)
    bad_dtype("bernoulli fill", dtype, "expected f32 or f64");
  return take_stream(bernoulli_fill(shape, p, dtype, value), numel_of(shape), gen, device);
}
}  // namespace detail

Tensor bernoulli_mul(const Tensor& x, double p, double value, Generator& gen) {
  NoGradGuard no_grad;
  if ((x.dtype() != DType::f32 && x.dtype() != DType::f64) || !x.is_contiguous())
    return mul(
        x, scaled_bernoulli(x.shape(), p, value, gen, {.dtype = x.dtype(), .device = x.device()}));
  RandomFill f = bernoulli_fill(x.shape(), p, x.dtype(), value);
  f.times = x.raw_data();
  return draw_tensor(x.shape(), f, gen, x.device());
}

std::pair<Tensor, Tensor> bernoulli_mul_pair(const Tensor& a, const Tensor& b, double p,
                                             double value, Generator& gen) {
  NoGradGuard no_grad;
  if (!a.defined() || !b.defined() || a.shape() != b.shape() || a.dtype() != b.dtype() ||
      a.device() != b.device())
    throw std::invalid_argument(
        "[bernoulli_mul_pair] a and b must share shape, dtype and device: got " +
        (a.defined() ? shape_str(a.shape()) + " " + dtype_name(a.dtype()) : "undefined") + " and " +
        (b.defined() ? shape_str(b.shape()) + " " + dtype_name(b.dtype()) : "undefined"));
  if ((a.dtype() != DType::f32 && a.dtype() != DType::f64) || !a.is_contiguous() ||
      !b.is_contiguous()) {
    const Tensor m =
        scaled_bernoulli(a.shape(), p, value, gen, {.dtype = a.dtype(), .device = a.device()});
    return {mul(a, m), mul(b, m)};
  }
  RandomFill f = bernoulli_fill(a.shape(), p, a.dtype(), value);
  f.times = a.raw_data();
  f.times2 = b.raw_data();
  Tensor second = detail::make_tensor(b.shape(), b.dtype(), b.device());
  f.out2 = second.raw_data();
  Tensor first = draw_tensor(a.shape(), f, gen, a.device());
  return {first, second};
}

void uniform_(const Tensor& t, double lo, double hi, Generator& gen) {
  check_fill_target("uniform_", t);
  if (!(lo <= hi) || !std::isfinite(lo) || !std::isfinite(hi))
    throw std::invalid_argument("[uniform_] need finite lo <= hi: got lo=" + std::to_string(lo) +
                                ", hi=" + std::to_string(hi));
  const RandomFill f = affine_fill(RandomDraw::uniform, draw_dtype(t.dtype()), hi - lo, lo);
  write_into(t, draw_tensor(t.shape(), f, gen, t.device()));
}

void normal_(const Tensor& t, double mean, double std, Generator& gen) {
  check_fill_target("normal_", t);
  if (!(std >= 0) || !std::isfinite(std) || !std::isfinite(mean))
    throw std::invalid_argument("[normal_] need finite mean and std >= 0: got mean=" +
                                std::to_string(mean) + ", std=" + std::to_string(std));
  const RandomFill f = affine_fill(RandomDraw::normal, draw_dtype(t.dtype()), std, mean);
  write_into(t, draw_tensor(t.shape(), f, gen, t.device()));
}

}  // namespace quanta
