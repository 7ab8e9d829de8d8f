#pragma once
// Tensor factories. Random factories (rand, randn, ...) live in
// engine/random/sampling.h.
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "engine/tensor.h"

namespace quanta {

/** Uninitialised tensor. */
Tensor empty(const Shape& shape, const TensorOptions& opts = {});
/** All zeros. */
Tensor zeros(const Shape& shape, const TensorOptions& opts = {});
/** All ones. */
Tensor ones(const Shape& shape, const TensorOptions& opts = {});
/** Every element `value`. */
Tensor full(const Shape& shape, double value, const TensorOptions& opts = {});
/** A 0-d tensor holding `value`. */
Tensor scalar(double value, const TensorOptions& opts = {});
/** [start, end) in steps of `step` (i64 by default when all are integers is
 * left to the caller: pass opts.dtype). */
Tensor arange(double start, double end, double step = 1.0, const TensorOptions& opts = {});
/** arange(0, end). In i64 on a device it is made there (running sums of
 * ones): no upload, so a captured step (engine/capture/device_graph.h) may
 * call it. */
Tensor arange(int64_t end, const TensorOptions& opts = {.dtype = DType::i64});
/** `steps` evenly spaced values from start to end inclusive. */
Tensor linspace(double start, double end, int64_t steps, const TensorOptions& opts = {});
/** n x m identity (m defaults to n). */
Tensor eye(int64_t n, int64_t m = -1, const TensorOptions& opts = {});
/** A copy of `values` with the given shape (1-d when shape is omitted). */
template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape = {},
                   const TensorOptions& opts = {.dtype = dtype_v<T>});
/** from_vector(values, shape, opts), made once per distinct values, shape,
 * dtype and device and then shared: the constants a layer applies at every
 * forward (per-dimension scales), uploaded to a device once instead of at
 * every call (a captured step cannot upload at all; DeviceGraph). Never
 * write into the result. requires_grad is refused. */
template <class T>
Tensor constant_tensor(const std::vector<T>& values, const Shape& shape,
                       const TensorOptions& opts = {.dtype = dtype_v<T>});
/** full(shape, value, opts), shared as constant_tensor's results are: on a
 * device, made once per shape, value, dtype and device, so that a step
 * launches no fill for the constants its ops take (a scalar in `x * 2`, a
 * row of ones) and a captured step holds none. On the CPU, while the device
 * records a graph, and past 65536 elements, a new tensor each call. Never
 * write into the result (in-place ops refuse it on a device); requires_grad
 * is refused. */
Tensor shared_full(const Shape& shape, double value, const TensorOptions& opts = {});
/** arange(end, opts), shared as shared_full's results are (the positions a
 * sort carries, a codebook's code numbers). */
Tensor shared_arange(int64_t end, const TensorOptions& opts = {.dtype = DType::i64});
/** A copy of `numel_of(shape)` elements of type `dtype` at `data` (host memory). */
Tensor from_blob(const void* data, const Shape& shape, DType dtype, const TensorOptions& opts = {});

Tensor empty_like(const Tensor& t);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor full_like(const Tensor& t, double value);

/** Options of `t` (dtype, device; requires_grad false). */
TensorOptions options_of(const Tensor& t);

}  // namespace quanta
