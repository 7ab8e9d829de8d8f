#pragma once
// Tensor: a cheap handle (shared pointer) to storage + layout + autograd
// metadata. Views share storage and only make a new layout.
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/device.h"
#include "engine/dtype.h"
#include "engine/shape.h"
#include "engine/storage.h"

namespace quanta {

class Node;
struct TensorImpl;

/** Options for factories: dtype, device and whether the result is a leaf that
 * requires grad. Designated initialisers read well: {.dtype = DType::f64}. */
struct TensorOptions {
  DType dtype = DType::f32;
  Device device = Device::cpu();
  bool requires_grad = false;
};

class Tensor {
 public:
  /** An undefined tensor (no storage); `defined()` is false. */
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  /** True when both handles point at the same tensor (not just equal values). */
  bool is_same(const Tensor& o) const { return impl_ == o.impl_; }

  // ---- layout ----
  const Shape& shape() const;
  /** Strides in elements. */
  const Shape& strides() const;
  int64_t dim() const;
  /** Size of dimension `d` (negative counts from the end). */
  int64_t size(int64_t d) const;
  int64_t numel() const;
  /** Offset of element 0 in the storage, in elements. */
  int64_t offset() const;
  DType dtype() const;
  Device device() const;
  bool is_contiguous() const;
  const std::shared_ptr<Storage>& storage() const;
  /** Bytes the elements span (numel * element size, or blocks for nf4). */
  std::size_t nbytes() const;

  /** Address of element 0; CPU only. */
  void* raw_data() const;
  /** Typed address of element 0; checks dtype and that the tensor is on CPU. */
  template <class T>
  T* data() const {
    check_data_access(dtype_v<T>);
    return static_cast<T*>(raw_data());
  }

  // ---- conversion ----
  /** Same values in another dtype (a copy unless already of that dtype). */
  Tensor to(DType dtype) const;
  /** Same values on another device (a copy unless already there). */
  Tensor to(Device device) const;
  /** A contiguous tensor with the same values (itself if already contiguous). */
  Tensor contiguous() const;
  /** A contiguous copy that owns fresh storage (differentiable). */
  Tensor clone() const;
  /** The value of a one-element tensor as double. */
  double item() const;
  template <class T>
  T item() const {
    return static_cast<T>(item());
  }
  /** All elements in row-major order, converted to T. */
  template <class T>
  std::vector<T> to_vector() const;

  // ---- autograd ----
  bool requires_grad() const;
  /** Marks a leaf as requiring grad; floating dtypes only. Returns *this. */
  Tensor& requires_grad_(bool on = true);
  /** Accumulated gradient of a leaf (undefined until a backward reaches it). */
  Tensor grad() const;
  void set_grad(const Tensor& g) const;
  /** Drops the accumulated gradient (sets it undefined). */
  void zero_grad() const;
  /** The node that produced this tensor, null for leaves. */
  const std::shared_ptr<Node>& grad_fn() const;
  /** Which output of grad_fn this tensor is. */
  uint32_t output_nr() const;
  bool is_leaf() const { return grad_fn() == nullptr; }
  /** Reverse-mode pass from this tensor; `grad` may be omitted for one-element
   * tensors. Frees the graph unless `retain_graph`. */
  void backward(const Tensor& grad = Tensor(), bool retain_graph = false) const;
  /** Same storage and layout, cut from the graph, requires_grad false. */
  Tensor detach() const;
  /** Runs `hook(leaf)` each time a gradient has been accumulated into this
   * leaf's `.grad`. */
  void register_post_accumulate_hook(std::function<void(const Tensor&)> hook) const;

  // ---- views (free-function forms live in engine/ops/view.h) ----
  Tensor reshape(const Shape& shape) const;
  Tensor view(const Shape& shape) const;
  Tensor permute(const std::vector<int64_t>& dims) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  /** Transpose of a 2-d tensor. */
  Tensor t() const;
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor select(int64_t dim, int64_t index) const;
  Tensor expand(const Shape& shape) const;
  Tensor squeeze() const;
  Tensor squeeze(int64_t dim) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor flatten(int64_t start = 0, int64_t end = -1) const;
  Tensor unflatten(int64_t dim, const Shape& sizes) const;

  /** Human-readable values, dtype and shape (large tensors are summarised). */
  std::string str() const;

 private:
  void check_data_access(DType want) const;
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

/** Autograd state, present only on tensors that take part in autograd. */
struct AutogradMeta {
  bool requires_grad = false;
  Tensor grad;
  std::shared_ptr<Node> grad_fn;
  uint32_t output_nr = 0;
  std::weak_ptr<Node> grad_accumulator;  // leaves: one accumulator per leaf
  std::vector<std::function<void(const Tensor&)>> post_accumulate_hooks;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  DType dtype = DType::f32;
  Shape shape;
  Shape strides;
  int64_t offset = 0;
  std::unique_ptr<AutogradMeta> autograd;

  AutogradMeta& meta() {
    if (!autograd) autograd = std::make_unique<AutogradMeta>();
    return *autograd;
  }
};

namespace detail {
/** A tensor over `storage` with the given layout; no checks beyond bounds. */
Tensor make_view(const Tensor& base, Shape shape, Shape strides, int64_t offset);
/** The same elements read as `dtype`, whose elements have base's size (a
 * bool tensor's bytes as u8): a view, no copy, no graph. */
Tensor same_bytes_as(const Tensor& base, DType dtype);
/** Bytes of a contiguous tensor of `shape` and `dtype` (whole storage blocks),
 * or std::nullopt when a size is negative or the element or byte count does not
 * fit int64 (the check for shapes read from files). */
std::optional<int64_t> storage_bytes(const Shape& shape, DType dtype);
/** A fresh contiguous tensor (uninitialised); throws std::invalid_argument
 * naming the shape when a size is negative or its sizes overflow. */
Tensor make_tensor(const Shape& shape, DType dtype, Device device);
}  // namespace detail

template <class T>
std::vector<T> Tensor::to_vector() const {
  Tensor c = to(Device::cpu()).to(dtype_v<T>).contiguous();
  const T* p = c.data<T>();
  return std::vector<T>(p, p + c.numel());
}

}  // namespace quanta
