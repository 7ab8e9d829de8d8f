#include "engine/tensor.h"

#include <cmath>
#include <iomanip>
#include <ostream>
#include <sstream>

#include "engine/autograd/grad_mode.h"
#include "engine/autograd/node.h"
#include "engine/cpu/convert.h"
#include "engine/device_backend.h"
#include "engine/dispatch.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/view.h"

namespace quanta {
namespace {
const Tensor& defined_or_throw(const Tensor& t, const char* what) {
  if (!t.defined()) throw std::invalid_argument(std::string("[") + what + "] tensor is undefined");
  return t;
}
const std::shared_ptr<Node> kNoNode;
}  // namespace

const Shape& Tensor::shape() const { return defined_or_throw(*this, "shape").impl_->shape; }
const Shape& Tensor::strides() const { return defined_or_throw(*this, "strides").impl_->strides; }
int64_t Tensor::dim() const { return static_cast<int64_t>(shape().size()); }
int64_t Tensor::size(int64_t d) const { return shape()[wrap_dim(d, dim(), "size")]; }
int64_t Tensor::numel() const { return numel_of(shape()); }
int64_t Tensor::offset() const { return defined_or_throw(*this, "offset").impl_->offset; }
DType Tensor::dtype() const { return defined_or_throw(*this, "dtype").impl_->dtype; }
Device Tensor::device() const {
  const auto& s = defined_or_throw(*this, "device").impl_->storage;
  return s ? s->device() : Device::cpu();
}
const std::shared_ptr<Storage>& Tensor::storage() const {
  return defined_or_throw(*this, "storage").impl_->storage;
}

bool Tensor::is_contiguous() const {
  const Shape& sh = shape();
  const Shape& st = strides();
  int64_t expected = 1;
  for (size_t i = sh.size(); i-- > 0;) {
    if (sh[i] == 1) continue;  // any stride is fine for a size-1 dim
    if (sh[i] == 0) return true;
    if (st[i] != expected) return false;
    expected *= sh[i];
  }
  return true;
}

std::size_t Tensor::nbytes() const {
  const auto& info = dtype_info(dtype());
  const int64_t n = numel();
  return static_cast<std::size_t>((n + info.block_elems - 1) / info.block_elems) * info.block_bytes;
}

void* Tensor::raw_data() const {
  const auto& s = storage();
  if (!s || s->nbytes() == 0) return nullptr;
  const auto& info = dtype_info(dtype());
  // A block dtype's bytes start only at whole blocks (a view into the middle
  // of an nf4 unit has no address of its own).
  if (offset() % static_cast<int64_t>(info.block_elems) != 0)
    throw std::invalid_argument(std::string("[data] ") + info.name + " view starts at element " +
                                std::to_string(offset()) + ", inside a block of " +
                                std::to_string(info.block_elems) + " elements");
  return static_cast<char*>(s->data()) +
         offset() / static_cast<int64_t>(info.block_elems) * info.block_bytes;
}

void Tensor::check_data_access(DType want) const {
  if (dtype() != want)
    throw std::invalid_argument(std::string("[data] tensor has dtype ") + dtype_name(dtype()) +
                                ", accessed as " + dtype_name(want));
  if (!device_caps(device()).host_readable)
    throw std::invalid_argument("[data] tensor is on " + device().str() + "; copy it to cpu first");
}

Tensor Tensor::to(DType dt) const { return to_dtype(*this, dt); }

Tensor Tensor::to(Device d) const {
  if (device() == d) return *this;
  Tensor src = contiguous();
  Tensor out = detail::make_tensor(shape(), dtype(), d);
  copy_bytes(out.raw_data(), d, src.raw_data(), src.device(), nbytes());
  return autograd::record("to_device", out, {*this}, [from = device()](const Tensor& g) {
    return std::vector<Tensor>{g.to(from)};
  });
}

Tensor Tensor::contiguous() const { return quanta::contiguous(*this); }

Tensor Tensor::clone() const {
  Tensor out = detail::make_tensor(shape(), dtype(), device());
  {
    NoGradGuard no_grad;
    copy_(out, *this);
  }
  return autograd::record("clone", out, {*this},
                          [](const Tensor& g) { return std::vector<Tensor>{g}; });
}

double Tensor::item() const {
  if (numel() != 1)
    throw std::invalid_argument("[item] needs a one-element tensor, got shape " +
                                shape_str(shape()));
  Tensor c = to(Device::cpu());
  return dispatch_all(c.dtype(), "item", [&](auto tag) {
    using T = typename decltype(tag)::type;
    return cpu::cast<double>(*static_cast<const T*>(c.raw_data()));
  });
}

// ---- autograd ----
bool Tensor::requires_grad() const {
  const auto& a = defined_or_throw(*this, "requires_grad").impl_->autograd;
  return a && a->requires_grad;
}

Tensor& Tensor::requires_grad_(bool on) {
  if (on && !is_floating(dtype()))
    throw std::invalid_argument(std::string("[requires_grad_] only floating tensors can "
                                            "require grad, got ") +
                                dtype_name(dtype()));
  if (!is_leaf())
    throw std::invalid_argument(
        "[requires_grad_] only leaves can change requires_grad; "
        "use detach() first");
  impl_->meta().requires_grad = on;
  return *this;
}

Tensor Tensor::grad() const {
  const auto& a = defined_or_throw(*this, "grad").impl_->autograd;
  return a ? a->grad : Tensor();
}

void Tensor::set_grad(const Tensor& g) const {
  if (g.defined() && g.shape() != shape())
    throw std::invalid_argument("[set_grad] gradient shape " + shape_str(g.shape()) +
                                " does not match tensor shape " + shape_str(shape()));
  impl_->meta().grad = g;
}

void Tensor::zero_grad() const {
  if (impl_ && impl_->autograd) impl_->autograd->grad = Tensor();
}

const std::shared_ptr<Node>& Tensor::grad_fn() const {
  const auto& a = defined_or_throw(*this, "grad_fn").impl_->autograd;
  return a ? a->grad_fn : kNoNode;
}

uint32_t Tensor::output_nr() const {
  const auto& a = impl_->autograd;
  return a ? a->output_nr : 0;
}

void Tensor::backward(const Tensor& grad, bool retain_graph) const {
  autograd::backward({*this}, {grad}, retain_graph);
}

Tensor Tensor::detach() const { return quanta::detach(*this); }

void Tensor::register_post_accumulate_hook(std::function<void(const Tensor&)> hook) const {
  if (!is_leaf() || !requires_grad())
    throw std::invalid_argument(
        "[register_post_accumulate_hook] only leaves that require "
        "grad accumulate gradients");
  impl_->meta().post_accumulate_hooks.push_back(std::move(hook));
}

// ---- views ----
Tensor Tensor::reshape(const Shape& s) const { return quanta::reshape(*this, s); }
Tensor Tensor::view(const Shape& s) const { return quanta::view(*this, s); }
Tensor Tensor::permute(const std::vector<int64_t>& d) const { return quanta::permute(*this, d); }
Tensor Tensor::transpose(int64_t a, int64_t b) const { return quanta::transpose(*this, a, b); }
Tensor Tensor::t() const {
  if (dim() != 2)
    throw std::invalid_argument("[t] expects a 2-d tensor, got shape " + shape_str(shape()));
  return quanta::transpose(*this, 0, 1);
}
Tensor Tensor::narrow(int64_t d, int64_t s, int64_t l) const {
  return quanta::narrow(*this, d, s, l);
}
Tensor Tensor::slice(int64_t d, int64_t s, int64_t e, int64_t st) const {
  return quanta::slice(*this, d, s, e, st);
}
Tensor Tensor::select(int64_t d, int64_t i) const { return quanta::select(*this, d, i); }
Tensor Tensor::expand(const Shape& s) const { return quanta::expand(*this, s); }
Tensor Tensor::squeeze() const { return quanta::squeeze(*this); }
Tensor Tensor::squeeze(int64_t d) const { return quanta::squeeze(*this, d); }
Tensor Tensor::unsqueeze(int64_t d) const { return quanta::unsqueeze(*this, d); }
Tensor Tensor::flatten(int64_t s, int64_t e) const { return quanta::flatten(*this, s, e); }
Tensor Tensor::unflatten(int64_t d, const Shape& s) const { return quanta::unflatten(*this, d, s); }

// ---- printing ----
namespace {
constexpr int64_t kEdgeItems = 3;  // shown at each end of a long dim
constexpr int64_t kSummariseAbove = 1000;

void print_rec(std::ostream& os, const Tensor& c, const std::vector<double>& v, int64_t d,
               int64_t off, bool summarise, const Shape& cs) {
  const auto& sh = c.shape();
  if (sh.empty()) {
    os << v[0];
    return;
  }
  os << "[";
  const int64_t n = sh[d];
  for (int64_t i = 0; i < n; ++i) {
    if (summarise && n > 2 * kEdgeItems && i == kEdgeItems) {
      os << "..., ";
      i = n - kEdgeItems;
    }
    if (d + 1 == static_cast<int64_t>(sh.size())) {
      os << v[off + i * cs[d]];
    } else {
      print_rec(os, c, v, d + 1, off + i * cs[d], summarise, cs);
    }
    if (i + 1 < n) os << (d + 1 == static_cast<int64_t>(sh.size()) ? ", " : ",\n ");
  }
  os << "]";
}
}  // namespace

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  std::ostringstream os;
  os << "tensor(";
  if (!dtype_info(dtype()).arithmetic) {
    os << "<" << nbytes() << " bytes>";
  } else {
    Tensor c = to(Device::cpu()).contiguous();
    std::vector<double> v = c.to_vector<double>();
    os << std::setprecision(6);
    print_rec(os, c, v, 0, 0, numel() > kSummariseAbove, contiguous_strides(shape()));
  }
  os << ", dtype=" << dtype_name(dtype()) << ", shape=" << shape_str(shape());
  if (!device().is_cpu()) os << ", device=" << device().str();
  if (requires_grad()) os << ", requires_grad";
  os << ")";
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.str(); }

namespace detail {

Tensor make_view(const Tensor& base, Shape shape, Shape strides, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = base.storage();
  impl->dtype = base.dtype();
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->offset = offset;
  return Tensor(std::move(impl));
}

Tensor same_bytes_as(const Tensor& base, DType dtype) {
  if (dtype_info(dtype).block_bytes != dtype_info(base.dtype()).block_bytes ||
      dtype_info(dtype).block_elems != dtype_info(base.dtype()).block_elems)
    throw std::invalid_argument(std::string("[same_bytes_as] ") + dtype_name(base.dtype()) +
                                " and " + dtype_name(dtype) + " elements differ in size");
  Tensor view = make_view(base, base.shape(), base.strides(), base.offset());
  view.impl()->dtype = dtype;
  return view;
}

std::optional<int64_t> storage_bytes(const Shape& shape, DType dtype) {
  const auto& info = dtype_info(dtype);
  const auto n = checked_numel(shape);
  if (!n) return std::nullopt;
  // ceil(n / block_elems) without n + block_elems - 1, which can overflow.
  const auto elems = static_cast<int64_t>(info.block_elems);
  return checked_mul(*n / elems + (*n % elems != 0), static_cast<int64_t>(info.block_bytes));
}

Tensor make_tensor(const Shape& shape, DType dtype, Device device) {
  for (int64_t s : shape)
    if (s < 0) throw std::invalid_argument("[empty] negative size in shape " + shape_str(shape));
  const auto& info = dtype_info(dtype);
  const auto bytes = storage_bytes(shape, dtype);
  if (!bytes)
    throw std::invalid_argument("[empty] shape " + shape_str(shape) + " of " + info.name +
                                " overflows 64-bit sizes");
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(static_cast<std::size_t>(*bytes), device);
  impl->dtype = dtype;
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  return Tensor(std::move(impl));
}

}  // namespace detail
}  // namespace quanta
