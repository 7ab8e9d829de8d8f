#include "quant/nf4/nf4_modules.h"

#include <cmath>
#include <stdexcept>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/nn/init.h"
#include "engine/ops/dropout.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/linalg.h"
#include "engine/ops/qr.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "engine/random/sampling.h"
#include "quant/kernels/table.h"
#include "quant/nf4/nf4_linear.h"
#include "quant/nf4/nf4_runs.h"

namespace quanta::quant {

namespace {
std::string stream_name(const char* kind, const std::string& stream) {
  return stream.empty() ? std::string(kind) : std::string(kind) + "." + stream;
}
}  // namespace

NF4Linear::NF4Linear(const Linear& linear, const NF4Options& o)
    : Module("NF4Linear"), dequant_dtype_(o.dequant_dtype) {
  const Tensor bias = linear.bias().defined() ? linear.bias().detach().clone() : Tensor();
  if (o.block_size % kNF4UnitElems != 0)
    init_bnb(quantize_bnb(linear.weight(), o), bias);
  else
    init_nf4(quantize_nf4(linear.weight(), o), bias);
}

NF4Linear::NF4Linear(const Tensor& weight_nf4, const Tensor& bias, DType dequant_dtype)
    : Module("NF4Linear"), dequant_dtype_(dequant_dtype) {
  init_nf4(weight_nf4, bias);
}

NF4Linear::NF4Linear(const BnbNF4State& w, const Tensor& bias, DType dequant_dtype)
    : Module("NF4Linear"), dequant_dtype_(dequant_dtype) {
  init_bnb(w, bias);
}

void NF4Linear::init_nf4(const Tensor& w, const Tensor& bias) {
  check_nf4(w, "NF4Linear");
  detail::check_dequant_dtype(dequant_dtype_, "NF4Linear");
  if (w.dim() != 2)
    throw std::invalid_argument("[NF4Linear] weight must be 2-d [out, in], got " +
                                shape_str(w.shape()));
  shape_ = w.shape();
  weight_ = register_buffer("weight", w);
  register_bias(bias);
}

void NF4Linear::init_bnb(const BnbNF4State& w, const Tensor& bias) {
  detail::check_dequant_dtype(dequant_dtype_, "NF4Linear");
  if (w.shape.size() != 2)
    throw std::invalid_argument("[NF4Linear] weight must be 2-d [out, in], got " +
                                shape_str(w.shape));
  const Tensor scales = bnb_scales(w);  // throws naming what is inconsistent
  shape_ = w.shape;
  bnb_block_ = w.blocksize;
  nested_block_ = w.nested_blocksize;
  weight_ = register_buffer("weight", w.packed.contiguous());
  absmax_ = register_buffer("weight_absmax", w.absmax.contiguous());
  if (w.double_quant) {
    nested_absmax_ = register_buffer("weight_nested_absmax", w.nested_absmax.contiguous());
    nested_quant_map_ = register_buffer("weight_nested_quant_map", w.nested_quant_map.contiguous());
    nested_offset_ =
        register_buffer("weight_nested_offset", full({}, w.nested_offset, {.dtype = DType::f32}));
    nested_offset_value_ = w.nested_offset;
  }
  scales_ = register_buffer("weight_scales", scales.to(weight_.device()), /*persistent=*/false);
  register_bias(bias);
}

void NF4Linear::read_host_state() {
  if (!is_bnb()) return;
  // A load replaced the state's tensors in place: one read of them here
  // instead of one per forward.
  if (nested_offset_.defined()) nested_offset_value_ = static_cast<float>(nested_offset_.item());
  NoGradGuard no_grad;
  copy_(scales_, bnb_scales(bnb_weight()).to(scales_.device()));
}

void NF4Linear::register_bias(const Tensor& bias) {
  if (!bias.defined()) return;
  if (bias.shape() != Shape{shape_[0]})
    throw std::invalid_argument("[NF4Linear] bias must be [" + std::to_string(shape_[0]) +
                                "], got " + shape_str(bias.shape()));
  bias_ = register_parameter("bias", bias, /*requires_grad=*/false);
}

BnbNF4State NF4Linear::bnb_weight() const {
  if (!is_bnb())
    throw std::invalid_argument(
        "[NF4Linear::bnb_weight] the weight is an nf4 tensor; "
        "to_bnb(weight(), ...) exports it");
  BnbNF4State s;
  s.packed = weight_;
  s.absmax = absmax_;
  s.quant_map = from_vector(std::vector<float>(kNF4Values.begin(), kNF4Values.end()), {16});
  s.double_quant = nested_absmax_.defined();
  if (s.double_quant) {
    s.nested_absmax = nested_absmax_;
    s.nested_quant_map = nested_quant_map_;
    s.nested_offset = nested_offset_value_;
  }
  s.blocksize = bnb_block_;
  s.nested_blocksize = nested_block_;
  s.shape = shape_;
  return s;
}

Tensor NF4Linear::forward(const Tensor& x) {
  if (x.dtype() == DType::bf16 || x.dtype() == DType::f16) {
    // Half-precision activations (a bf16 model): the products are summed in
    // f32 and the result rounded once, as a bf16 GEMM with f32 accumulation
    // does; the frozen bias joins in f32.
    const Tensor b = bias_.defined() ? bias_.to(DType::f32) : Tensor();
    return apply(x.to(DType::f32), b).to(x.dtype());
  }
  return apply(x, bias_);
}

Tensor NF4Linear::product(const Tensor& x) const { return apply(x, Tensor()); }

Tensor NF4Linear::apply(const Tensor& x, const Tensor& bias) const {
  if (is_bnb())
    return detail::nf4_linear_scaled(x, weight_, scales_, bnb_block_, shape_, bias, dequant_dtype_);
  return nf4_linear(x, weight_, bias, dequant_dtype_);
}

Tensor NF4Linear::dequantized_weight() const { return dequantized_weight(dequant_dtype_); }

Tensor NF4Linear::dequantized_weight(DType dtype) const {
  if (!is_bnb()) return dequantize(weight_, dtype).to(DType::f32);
  // Decoded where the weight lives, from the scales forward multiplies by
  // (bitsandbytes' own dequantize rebuilds them on the host first).
  detail::check_dequant_dtype(dtype, "dequantized_weight");
  const Tensor packed = weight_.to(DType::u8).contiguous();
  Tensor out = quanta::detail::make_tensor(shape_, dtype, packed.device());
  quant_kernels(packed.device())
      .nf4_decode(detail::packed_runs(static_cast<const uint8_t*>(packed.raw_data()),
                                      static_cast<const float*>(scales_.raw_data()), out.numel(),
                                      bnb_block_),
                  dtype, out.raw_data());
  return out.to(DType::f32);
}

std::size_t NF4Linear::weight_bytes() const {
  return is_bnb() ? bnb_payload_bytes(bnb_weight()) : weight_.nbytes();
}

LoRALinear::LoRALinear(std::shared_ptr<NF4Linear> base, const LoRAOptions& o)
    : Module("LoRALinear"),
      base_(std::move(base)),
      base_dtype_(o.base_dtype),
      scaling_(0),
      dropout_(o.dropout),
      dropout_gen_(Generator::named(o.seed, stream_name("lora.dropout", o.stream))) {
  if (!base_) throw std::invalid_argument("[LoRALinear] base is null");
  dropout_gen_.set_replayable();  // the layer's own: a captured step redraws from it
  if (o.rank <= 0)
    throw std::invalid_argument("[LoRALinear] rank must be positive, got " +
                                std::to_string(o.rank));
  if (o.dropout < 0 || o.dropout >= 1)
    throw std::invalid_argument("[LoRALinear] dropout must be in [0, 1), got " +
                                std::to_string(o.dropout));
  if (o.dtype != DType::f32 && o.dtype != DType::f64)
    throw std::invalid_argument(
        std::string("[LoRALinear] adapters' dtype must be f32 or f64, got ") + dtype_name(o.dtype));
  const double r = static_cast<double>(o.rank);
  scaling_ = o.use_rslora ? o.alpha / std::sqrt(r) : o.alpha / r;
  register_module("base", base_);
  // Drawn in f32 whatever the dtype, so an f64 model starts from the same
  // adapters as an f32 one.
  Tensor a = empty({o.rank, base_->in_features()});
  Tensor b = zeros({base_->out_features(), o.rank});
  Generator init_gen = Generator::named(o.seed, stream_name("lora.init", o.stream));
  switch (o.init) {
    case LoRAInit::kaiming_uniform:
      init::kaiming_uniform_(a, init_gen, std::sqrt(5.0));  // PEFT's default for lora_A
      break;
    case LoRAInit::gaussian: {
      NoGradGuard no_grad;
      normal_(a, 0.0, 1.0 / r, init_gen);
      break;
    }
    case LoRAInit::both_random:  // B drawn after A, from the same stream
      init::kaiming_uniform_(a, init_gen, std::sqrt(5.0));
      init::kaiming_uniform_(b, init_gen, std::sqrt(5.0));
      break;
    case LoRAInit::orthogonal: {
      if (o.rank % 2 != 0)
        throw std::invalid_argument("[LoRALinear] the orthogonal start needs an even rank, got " +
                                    std::to_string(o.rank));
      // PEFT's draws in its order: the rotation, then A's, then B's factor.
      NoGradGuard no_grad;
      const Tensor q = thin_qr(randn({o.rank, o.rank}, init_gen)).q;
      const Tensor q_odd =
          index_select(q, 0, arange(0.0, double(o.rank), 2.0, {.dtype = DType::i64}));
      const Tensor q_even =
          index_select(q, 0, arange(1.0, double(o.rank), 2.0, {.dtype = DType::i64}));
      const int64_t half = o.rank / 2;
      a = transpose(matmul(randn({base_->in_features(), half}, init_gen), q_odd), 0, 1)
              .contiguous() /
          10.0;
      b = matmul(transpose(randn({half, base_->out_features()}, init_gen), 0, 1), q_even) / 10.0;
      break;
    }
  }
  const Device device = base_->weight().device();
  lora_a_ = register_parameter("lora_A", a.to(o.dtype).to(device));
  lora_b_ = register_parameter("lora_B", b.to(o.dtype).to(device));
  if (o.lora_bias && o.use_dora)
    throw std::invalid_argument(
        "[LoRALinear] lora_bias is not available with DoRA (PEFT refuses it)");
  if (o.lora_bias)
    lora_b_bias_ = register_parameter(
        "lora_B_bias", zeros({base_->out_features()}, {.dtype = o.dtype}).to(device));
  if (o.use_dora) {
    if (o.base_dtype != DType::f32 && o.base_dtype != DType::bf16 && o.base_dtype != DType::f16)
      throw std::invalid_argument(
          std::string("[LoRALinear] base_dtype must be f32, bf16 or f16, got ") +
          dtype_name(o.base_dtype));
    // B is zero: the rows' norms of W, so the layer starts as the base.
    magnitude_ = register_parameter("lora_magnitude_vector", weight_norm());
  }
}

void LoRALinear::set_adapters(const Tensor& a, const Tensor& b) {
  if (a.shape() != lora_a_.shape() || b.shape() != lora_b_.shape())
    throw std::invalid_argument(
        "[LoRALinear] set_adapters: A " + shape_str(a.shape()) + " and B " + shape_str(b.shape()) +
        " for adapters A " + shape_str(lora_a_.shape()) + " and B " + shape_str(lora_b_.shape()));
  NoGradGuard no_grad;
  copy_(lora_a_, a.to(lora_a_.dtype()).to(lora_a_.device()));
  copy_(lora_b_, b.to(lora_b_.dtype()).to(lora_b_.device()));
  if (magnitude_.defined()) copy_(magnitude_, weight_norm());
}

void LoRALinear::set_initial_adapters(const Tensor& a, const Tensor& b) {
  if (a.shape() != lora_a_.shape() || b.shape() != lora_b_.shape())
    throw std::invalid_argument("[LoRALinear] set_initial_adapters: A " + shape_str(a.shape()) +
                                " and B " + shape_str(b.shape()) + " for adapters A " +
                                shape_str(lora_a_.shape()) + " and B " +
                                shape_str(lora_b_.shape()));
  NoGradGuard no_grad;
  initial_a_ = a.detach().to(lora_a_.dtype()).to(Device::cpu()).contiguous();
  initial_b_ = b.detach().to(lora_b_.dtype()).to(Device::cpu()).contiguous();
}

Tensor LoRALinear::adapted_weight() const {
  // Decoded each time: the frozen weight is not kept dense beside its 4 bits.
  return adapted_weight(base_->dequantized_weight(base_dtype_));
}

Tensor LoRALinear::adapted_weight(const Tensor& w) const {
  return plus_delta(w.to(base_dtype_).to(lora_a_.dtype()));
}

Tensor LoRALinear::plus_delta(const Tensor& w) const {
  // Written as w + matmul(B, A) * s, the expression's temporaries live to its
  // end: four [out, in] tensors at once, where a merge a layer at a time
  // wants two. The product is scaled and summed in its own buffer instead,
  // with the same roundings (an IEEE sum does not depend on its order).
  NoGradGuard no_grad;
  Tensor delta = matmul(lora_b_, lora_a_);
  mul_(delta, scaling_);
  if (w.dtype() != delta.dtype()) return w + delta;
  add_(delta, w);
  return delta;
}

Tensor LoRALinear::weight_norm() const {
  NoGradGuard no_grad;
  return sqrt(sum(square(adapted_weight()), {1}));
}

std::vector<std::pair<std::string, Shape>> LoRALinear::adapter_tensor_shapes(int64_t in,
                                                                             int64_t out,
                                                                             const LoRAOptions& o) {
  std::vector<std::pair<std::string, Shape>> names{{"lora_A.weight", {o.rank, in}},
                                                   {"lora_B.weight", {out, o.rank}}};
  if (o.lora_bias) names.emplace_back("lora_B.bias", Shape{out});
  if (o.use_dora) names.emplace_back("lora_magnitude_vector", Shape{out});
  return names;
}

std::vector<std::pair<std::string, Tensor>> LoRALinear::adapter_tensors() const {
  const auto names = adapter_tensor_shapes(
      base_->in_features(), base_->out_features(),
      {.rank = lora_a_.size(0), .use_dora = use_dora(), .lora_bias = lora_b_bias_.defined()});
  // In the names' order: A, B, then whichever of B's bias and the magnitude are held.
  std::vector<Tensor> held{lora_a_, lora_b_};
  for (const Tensor& t : {lora_b_bias_, magnitude_})
    if (t.defined()) held.push_back(t);
  std::vector<std::pair<std::string, Tensor>> out;
  for (std::size_t i = 0; i < names.size(); ++i) out.emplace_back(names[i].first, held.at(i));
  return out;
}

void LoRALinear::keep_weight_norm(bool on) {
  keep_norm_ = on;
  kept_norm_ = Tensor();
}

Tensor LoRALinear::forward_dora(const Tensor& x) {
  const DType dt = lora_a_.dtype();
  // The frozen products' outputs are read below (and by the magnitude's
  // gradient), even where the caller's output is not.
  ReadOutputGuard read;
  const Tensor y = base_->forward(x);
  const bool dropping = is_training() && dropout_ > 0;
  if (keep_norm_ && (!kept_norm_.defined() || kept_norm_.device() != magnitude_.device()))
    kept_norm_ = weight_norm();
  const Tensor k = magnitude_ / (keep_norm_ ? kept_norm_ : weight_norm());
  // PEFT's y + (k - 1) f + k (x A^T B^T) s in fewer passes over the output:
  // k s scales B's rows (x A^T (k s B)^T is the adapters' term) and that
  // product adds onto y + (k - 1) f in place. f is y - bias, or in training
  // with dropout the frozen product of the dropped input.
  const Tensor yd = y.to(dt);
  Tensor adapters_in = x.to(dt), frozen_sum;
  if (dropping) {
    // PEFT drops the input of both the adapters and the frozen term. The
    // frozen term is the base layer's own product (its compute dtype), where
    // PEFT multiplies the dequantized weight in the adapters' f32: the same
    // arithmetic with f32 compute, and with bf16 compute a bf16 product at
    // that dtype's rate instead of an f32 one.
    adapters_in = dropout(adapters_in, dropout_, true, dropout_gen_);
    frozen_sum = yd + (k - 1.0) * base_->product(adapters_in);
  } else {
    // y + (k - 1)(y - bias) = k y - (k - 1) bias.
    const Tensor& bias = base_->bias();
    frozen_sum = bias.defined() ? yd * k - (k - 1.0) * bias.to(dt) : yd * k;
  }
  const Tensor b_scaled = lora_b_ * (k * scaling_).reshape({k.numel(), 1});
  return linear_add(std::move(frozen_sum), linear(adapters_in, lora_a_), b_scaled).to(y.dtype());
}

Tensor LoRALinear::forward(const Tensor& x) {
  if (use_dora()) return forward_dora(x);
  // dropout_linear keeps x for the backward, not the dropped copy. The
  // scaling goes on the rank-r activation (in training with dropout, on the
  // mask's kept value: no pass of its own forward or backward), and the
  // second product adds onto the frozen layer's output in its GEMM: (a s)
  // B^T + y, where PEFT writes y + (a B^T) s, equal up to rounding, without
  // two passes over [.., out].
  const Tensor a = dropout_linear(x.to(lora_a_.dtype()), lora_a_, dropout_, is_training(),
                                  dropout_gen_, scaling_);
  // The frozen product made after the adapter's: the backward runs it first
  // (later nodes first), so its input gradient is the fresh one x's other
  // gradients add onto (the adapter's kernel adds onto a sum for free, a
  // bf16 product does not).
  Tensor y = base_->forward(x);
  if (lora_b_bias_.defined()) {
    // PEFT's (a B^T + b_B) s: the bias joins the adapters' product before it
    // is added in the output's dtype.
    const Tensor adapters = linear(a, lora_b_) + lora_b_bias_ * scaling_;
    return y.dtype() == adapters.dtype() ? y + adapters : y + adapters.to(y.dtype());
  }
  // y handed over: the product adds onto the frozen layer's output in place.
  if (y.dtype() == lora_b_.dtype()) return linear_add(std::move(y), a, lora_b_);
  return y + linear(a, lora_b_).to(y.dtype());
}

Tensor LoRALinear::dora_merged(const Tensor& adapted) const {
  NoGradGuard no_grad;
  const Tensor norm = sqrt(sum(square(adapted), {1}, /*keepdim=*/true));
  return (adapted * (magnitude_.reshape({magnitude_.numel(), 1}) / norm)).to(DType::f32);
}

Tensor LoRALinear::merged_weight() const {
  if (use_dora()) return dora_merged(adapted_weight());
  return plus_delta(base_->dequantized_weight());
}

Tensor LoRALinear::merged_weight(const Tensor& base_weight) const {
  const Shape want{base_->out_features(), base_->in_features()};
  if (base_weight.shape() != want)
    throw std::invalid_argument("[LoRALinear::merged_weight] a base weight " +
                                shape_str(base_weight.shape()) + " for a layer " + shape_str(want));
  const Tensor w = base_weight.detach().to(lora_a_.device());
  if (use_dora()) return dora_merged(adapted_weight(w));
  return plus_delta(w.to(lora_a_.dtype()));
}

Tensor LoRALinear::merged_bias() const {
  NoGradGuard no_grad;
  const Tensor& bias = base_->bias();
  if (!lora_b_bias_.defined()) return bias.defined() ? bias.detach() : Tensor();
  if (!bias.defined())
    throw std::invalid_argument("[LoRALinear::merged_bias] lora_bias over a layer [" +
                                std::to_string(base_->out_features()) + ", " +
                                std::to_string(base_->in_features()) +
                                "] without a bias: a merged layer has nowhere to hold it (PEFT "
                                "refuses to merge it too)");
  return (bias.to(lora_b_bias_.dtype()) + lora_b_bias_ * scaling_).to(bias.dtype());
}

std::shared_ptr<Linear> LoRALinear::merge() const {
  const Tensor bias = merged_bias();
  Generator unused(0);
  auto out =
      std::make_shared<Linear>(base_->in_features(), base_->out_features(), unused, bias.defined());
  NoGradGuard no_grad;
  copy_(out->weight(), merged_weight());
  if (bias.defined()) copy_(out->bias(), bias);
  return out;
}

bool name_selected(const std::string& name, const std::vector<std::string>& include,
                   const std::vector<std::string>& exclude) {
  auto any = [&](const std::vector<std::string>& pats) {
    for (const auto& p : pats)
      if (name.find(p) != std::string::npos) return true;
    return false;
  };
  return (include.empty() || any(include)) && !any(exclude);
}

namespace {

// RMSE and max |difference| of a float weight and the f32 values `d`.
NF4LayerReport error_of(const Tensor& weight, const Tensor& d) {
  NF4LayerReport r;
  r.shape = weight.shape();
  // A report, computed on the host.
  const Tensor w = weight.detach().to(Device::cpu()).to(DType::f32).contiguous();
  const Tensor dh = d.to(Device::cpu()).contiguous();
  const float* pw = w.data<float>();
  const float* pd = dh.data<float>();
  double sq = 0;
  for (int64_t i = 0; i < w.numel(); ++i) {
    const double e = std::fabs(double(pw[i]) - double(pd[i]));
    sq += e * e;
    r.max_abs = std::max(r.max_abs, e);
  }
  r.rmse = w.numel() ? std::sqrt(sq / double(w.numel())) : 0.0;
  r.bytes_before = weight.nbytes();
  return r;
}

}  // namespace

NF4LayerReport quantization_error(const Tensor& weight, const Tensor& nf4, DType dequant_dtype) {
  NF4LayerReport r = error_of(weight, dequantize(nf4, dequant_dtype).to(DType::f32));
  r.bytes_after = nf4.nbytes();
  return r;
}

std::vector<NF4LayerReport> quantize_nf4(Module& root, const NF4ConvertOptions& o) {
  check_options(o.format);
  // Collect first: replacing children while walking the tree would
  // invalidate the walk.
  struct Target {
    Module* parent;
    std::string child, full;
    Linear* linear;
  };
  std::vector<Target> targets;
  for (auto& [prefix, m] : root.named_modules())
    for (auto& [child, c] : m->named_children()) {
      auto* lin = dynamic_cast<Linear*>(c.get());
      const std::string full = prefix.empty() ? child : prefix + "." + child;
      if (lin && name_selected(full, o.include, o.exclude))
        targets.push_back({m, child, full, lin});
    }
  std::vector<NF4LayerReport> reports;
  for (const Target& t : targets) {
    auto q = std::make_shared<NF4Linear>(*t.linear, o.format);
    NF4LayerReport r = error_of(t.linear->weight(), q->dequantized_weight());
    r.bytes_after = q->weight_bytes();
    r.name = t.full;
    std::shared_ptr<Module> replacement = q;
    if (o.lora) replacement = std::make_shared<LoRALinear>(q, o.lora_options);
    t.parent->replace_module(t.child, replacement);
    reports.push_back(std::move(r));
  }
  return reports;
}

}  // namespace quanta::quant
