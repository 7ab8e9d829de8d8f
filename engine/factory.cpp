#include "engine/factory.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>

#include "engine/capture/device_graph.h"
#include "engine/cpu/convert.h"
#include "engine/dispatch.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/reductions.h"

namespace quanta {
namespace {

Tensor finish(Tensor t, const TensorOptions& opts) {
  if (opts.requires_grad) t.requires_grad_(true);
  return t;
}

// Builds on the CPU with `fill(T* data, n)`, then moves to the device.
template <class Fill>
Tensor build(const Shape& shape, const TensorOptions& opts, const char* op, Fill&& fill) {
  Tensor t = detail::make_tensor(shape, opts.dtype, Device::cpu());
  dispatch_all(opts.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    fill(static_cast<T*>(t.raw_data()), t.numel());
  });
  return finish(t.to(opts.device), opts);
}

}  // namespace

Tensor empty(const Shape& shape, const TensorOptions& opts) {
  return finish(detail::make_tensor(shape, opts.dtype, opts.device), opts);
}

Tensor full(const Shape& shape, double value, const TensorOptions& opts) {
  Tensor t = detail::make_tensor(shape, opts.dtype, opts.device);
  fill_(t, value);
  return finish(t, opts);
}

Tensor zeros(const Shape& shape, const TensorOptions& opts) { return full(shape, 0.0, opts); }
Tensor ones(const Shape& shape, const TensorOptions& opts) { return full(shape, 1.0, opts); }
Tensor scalar(double value, const TensorOptions& opts) { return full({}, value, opts); }

Tensor arange(double start, double end, double step, const TensorOptions& opts) {
  if (step == 0 || !std::isfinite(start) || !std::isfinite(end) || !std::isfinite(step))
    throw std::invalid_argument("[arange] need finite bounds and a non-zero step");
  const double span = (end - start) / step;
  const int64_t n = span > 0 ? static_cast<int64_t>(std::ceil(span)) : 0;
  return build({n}, opts, "arange", [&]<class T>(T* p, int64_t m) {
    for (int64_t i = 0; i < m; ++i) p[i] = cpu::cast<T>(start + static_cast<double>(i) * step);
  });
}

Tensor arange(int64_t end, const TensorOptions& opts) {
  if (!opts.device.is_cpu() && opts.dtype == DType::i64 && end > 0 && !opts.requires_grad)
    return cumsum(shared_full({end}, 1.0, opts), 0) - 1.0;  // exact: whole numbers
  return arange(0.0, static_cast<double>(end), 1.0, opts);
}

Tensor linspace(double start, double end, int64_t steps, const TensorOptions& opts) {
  if (steps < 0) throw std::invalid_argument("[linspace] steps must be >= 0");
  return build({steps}, opts, "linspace", [&]<class T>(T* p, int64_t n) {
    const double step = n > 1 ? (end - start) / static_cast<double>(n - 1) : 0.0;
    // Fill from both ends so the last value is exactly `end`, like NumPy.
    for (int64_t i = 0; i < n; ++i)
      p[i] = cpu::cast<T>(i < (n + 1) / 2 ? start + step * static_cast<double>(i)
                                          : end - step * static_cast<double>(n - 1 - i));
  });
}

Tensor eye(int64_t n, int64_t m, const TensorOptions& opts) {
  if (m < 0) m = n;
  if (n < 0) throw std::invalid_argument("[eye] n must be >= 0");
  return build({n, m}, opts, "eye", [&]<class T>(T* p, int64_t count) {
    for (int64_t i = 0; i < count; ++i) p[i] = cpu::cast<T>(0.0);
    for (int64_t i = 0; i < std::min(n, m); ++i) p[i * m + i] = cpu::cast<T>(1.0);
  });
}

Tensor from_blob(const void* data, const Shape& shape, DType dtype, const TensorOptions& opts) {
  Tensor t = detail::make_tensor(shape, dtype, Device::cpu());
  if (t.nbytes()) std::memcpy(t.raw_data(), data, t.nbytes());
  if (opts.dtype != dtype) t = t.to(opts.dtype);
  return finish(t.to(opts.device), opts);
}

template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, const TensorOptions& opts) {
  const Shape s = shape.empty() ? Shape{static_cast<int64_t>(values.size())} : shape;
  if (numel_of(s) != static_cast<int64_t>(values.size()))
    throw std::invalid_argument("[from_vector] " + std::to_string(values.size()) +
                                " values do not fill shape " + shape_str(s));
  if constexpr (std::is_same_v<T, bool>) {
    std::vector<uint8_t> bytes(values.begin(), values.end());
    return from_blob(bytes.data(), s, DType::boolean, opts);
  } else {
    return from_blob(values.data(), s, dtype_v<T>, opts);
  }
}

namespace {

// The shared constants, one per key (what made them: kind, dtype, device,
// shape, value bytes), kept for the process. A handful per layer; past the
// bound (a caller minting keys) nothing more is kept. A new one is kept only
// when `keep` says so.
Tensor kept_constant(std::string key, const std::function<Tensor()>& make, bool keep = true) {
  constexpr std::size_t kMaxKept = 4096;
  static std::mutex mutex;
  static auto* kept = new std::unordered_map<std::string, Tensor>;  // outlives main's tensors
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto it = kept->find(key);
    if (it != kept->end()) return it->second;
  }
  Tensor t = make();
  if (t.storage()) t.storage()->mark_shared_constant();
  if (!keep) return t;
  std::lock_guard<std::mutex> lock(mutex);
  if (kept->size() < kMaxKept) kept->emplace(std::move(key), t);
  return t;
}

std::string constant_key(const char* kind, DType value_type, const Shape& shape,
                         const TensorOptions& opts, const void* bytes, std::size_t nbytes) {
  std::string key = std::string(kind) + "|" + dtype_name(value_type) + "|" +
                    dtype_name(opts.dtype) + "|" + opts.device.str() + "|" + shape_str(shape) + "|";
  key.append(static_cast<const char*>(bytes), nbytes);
  return key;
}

}  // namespace

template <class T>
Tensor constant_tensor(const std::vector<T>& values, const Shape& shape,
                       const TensorOptions& opts) {
  if (opts.requires_grad)
    throw std::invalid_argument("[constant_tensor] a shared constant cannot require grad");
  return kept_constant(
      constant_key("values", dtype_v<T>, shape, opts, values.data(), values.size() * sizeof(T)),
      [&] { return from_vector<T>(values, shape, opts); });
}

namespace {

// A constant made by device work (a fill, arange's running sum), shared on a
// device. The CPU's is a store, not a launch: nothing to save there; a large
// one is not pinned for good. One made while the device records a graph is
// made inside it (its memory is the graph's, written by the graph's
// replays): used there, not kept for calls outside.
Tensor shared_device_constant(const char* op, const Shape& shape, const TensorOptions& opts,
                              const void* value, std::size_t value_bytes,
                              const std::function<Tensor()>& make) {
  if (opts.requires_grad)
    throw std::invalid_argument(std::string("[") + op + "] a shared constant cannot require grad");
  constexpr int64_t kMaxKeptElements = int64_t{1} << 16;
  if (opts.device.is_cpu() || numel_of(shape) > kMaxKeptElements) return make();
  return kept_constant(constant_key(op, DType::f64, shape, opts, value, value_bytes), make,
                       !capturing(opts.device));
}

}  // namespace

Tensor shared_full(const Shape& shape, double value, const TensorOptions& opts) {
  return shared_device_constant("shared_full", shape, opts, &value, sizeof value,
                                [&] { return full(shape, value, opts); });
}

Tensor shared_arange(int64_t end, const TensorOptions& opts) {
  return shared_device_constant("shared_arange", {std::max<int64_t>(end, 0)}, opts, nullptr, 0,
                                [&] { return arange(end, opts); });
}

template Tensor constant_tensor(const std::vector<double>&, const Shape&, const TensorOptions&);
template Tensor constant_tensor(const std::vector<float>&, const Shape&, const TensorOptions&);
template Tensor constant_tensor(const std::vector<int64_t>&, const Shape&, const TensorOptions&);
template Tensor constant_tensor(const std::vector<int32_t>&, const Shape&, const TensorOptions&);

template Tensor from_vector(const std::vector<float>&, const Shape&, const TensorOptions&);
template Tensor from_vector(const std::vector<double>&, const Shape&, const TensorOptions&);
template Tensor from_vector(const std::vector<int32_t>&, const Shape&, const TensorOptions&);
template Tensor from_vector(const std::vector<int64_t>&, const Shape&, const TensorOptions&);
template Tensor from_vector(const std::vector<uint8_t>&, const Shape&, const TensorOptions&);
template Tensor from_vector(const std::vector<bool>&, const Shape&, const TensorOptions&);
template Tensor from_vector(const std::vector<bf16>&, const Shape&, const TensorOptions&);
template Tensor from_vector(const std::vector<f16>&, const Shape&, const TensorOptions&);

TensorOptions options_of(const Tensor& t) { return {.dtype = t.dtype(), .device = t.device()}; }
Tensor empty_like(const Tensor& t) { return empty(t.shape(), options_of(t)); }
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), options_of(t)); }
Tensor ones_like(const Tensor& t) { return ones(t.shape(), options_of(t)); }
Tensor full_like(const Tensor& t, double v) { return full(t.shape(), v, options_of(t)); }

}  // namespace quanta
