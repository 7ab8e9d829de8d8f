#include "quant/hierarchical/hierarchical_vq.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

#include "engine/factory.h"
#include "engine/ops/conv.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/join.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "engine/precision.h"
#include "engine/random/sampling.h"
#include "quant/hierarchical/resample.h"
#include "quant/streams.h"

namespace quanta::quant {
namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[HierarchicalVQ] " + what);
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "(";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + ")";
}

int64_t numel_of_level(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t v : s) n *= v;
  return n;
}

// [B, C, s...] -> [B, prod(s), C]: the VectorQuantize's channel-last tokens.
Tensor to_tokens(const Tensor& t) { return transpose(flatten(t, 2, -1), 1, 2); }

// [B, n, C] -> [B, C, s...].
Tensor from_tokens(const Tensor& t, const std::vector<int64_t>& s) {
  return unflatten(transpose(t, 1, 2), 2, Shape(s.begin(), s.end()));
}

// PyTorch's default Conv{1,2,3}d init: weight and bias U(-1/sqrt(fan_in), +).
std::shared_ptr<Module> make_phi(int64_t dim, int64_t spatial_dims, Generator& gen) {
  auto phi = std::make_shared<Module>("Phi");
  auto conv = phi->register_module("conv", std::make_shared<Module>("Conv"));
  Shape w_shape{dim, dim};
  for (int64_t d = 0; d < spatial_dims; ++d) w_shape.push_back(3);
  const double bound = 1.0 / std::sqrt(static_cast<double>(numel_of(w_shape) / dim));  // fan_in
  conv->register_parameter("weight", rand(w_shape, gen) * (2 * bound) - bound);
  conv->register_parameter("bias", rand({dim}, gen) * (2 * bound) - bound);
  return phi;
}

}  // namespace

HierarchicalVQ::HierarchicalVQ(HierarchicalVQOptions opts, Generator& gen)
    : Module("HierarchicalVQ"), opts_(std::move(opts)), cutoff_stream_(Generator(0)) {
  const HierarchicalVQOptions& o = opts_;
  if (o.accept_image_fmap && o.accept_3d_fmap)
    fail("choose at most one of accept_image_fmap / accept_3d_fmap");
  if (!(o.nested_dropout >= 0 && o.nested_dropout <= 1))
    fail("nested_dropout must lie in [0, 1], got " + std::to_string(o.nested_dropout));
  if (o.nested_dropout_min_levels < 1)
    fail("nested_dropout_min_levels must be >= 1, got " +
         std::to_string(o.nested_dropout_min_levels));
  if (o.dim <= 0) fail("dim must be positive, got " + std::to_string(o.dim));
  spatial_dims_ = o.accept_image_fmap ? 2 : o.accept_3d_fmap ? 3 : 1;
  if (o.scales.empty()) fail("scales must name at least one level");
  for (const auto& s : o.scales) {
    if (s.size() == 1) {
      level_shapes_.emplace_back(static_cast<size_t>(spatial_dims_), s[0]);
    } else if (static_cast<int64_t>(s.size()) == spatial_dims_) {
      level_shapes_.push_back(s);
    } else {
      fail("scales: a level " + shape_text(s) + " needs one size or " +
           std::to_string(spatial_dims_) + " (the spatial dims)");
    }
    for (int64_t v : level_shapes_.back())
      if (v <= 0) fail("scales must be positive, got " + shape_text(s));
  }
  for (size_t l = 1; l < level_shapes_.size(); ++l)
    for (size_t d = 0; d < level_shapes_[l].size(); ++d)
      if (level_shapes_[l - 1][d] > level_shapes_[l][d])
        fail("scales must be non-decreasing, got " + shape_text(level_shapes_[l - 1]) + " before " +
             shape_text(level_shapes_[l]));
  std::vector<int64_t> sizes = o.codebook_size;
  if (sizes.size() == 1) sizes.assign(level_shapes_.size(), sizes[0]);
  if (sizes.size() != level_shapes_.size())
    fail("codebook_size has " + std::to_string(o.codebook_size.size()) + " entries for " +
         std::to_string(level_shapes_.size()) + " levels");
  if (o.shared_codebook && std::set<int64_t>(sizes.begin(), sizes.end()).size() != 1)
    fail("shared_codebook requires uniform codebook sizes (codebook_size)");

  VectorQuantizeOptions lo = o.layer;
  lo.dim = o.dim;
  lo.accept_image_fmap = false;
  lo.channel_last = true;
  if (o.shared_codebook) {
    lo.codebook_size = sizes[0];
    vqs_.push_back(register_module("vq", std::make_shared<VectorQuantize>(lo, gen)));
    vqs_[0]->codebook().set_calls_per_forward(num_levels());
  } else {
    auto list = register_module("vqs", std::make_shared<Module>("ModuleList"));
    for (size_t l = 0; l < sizes.size(); ++l) {
      lo.codebook_size = sizes[l];
      vqs_.push_back(
          list->register_module(std::to_string(l), std::make_shared<VectorQuantize>(lo, gen)));
    }
  }
  if (o.share_quant_resi == 1) {
    phis_.push_back(register_module("phi_shared", make_phi(o.dim, spatial_dims_, gen)).get());
  } else {
    const int64_t n =
        o.share_quant_resi <= 0 ? num_levels() : std::min(num_levels(), o.share_quant_resi);
    auto list = register_module("phi_levels", std::make_shared<Module>("ModuleList"));
    for (int64_t i = 0; i < n; ++i)
      phis_.push_back(
          list->register_module(std::to_string(i), make_phi(o.dim, spatial_dims_, gen)).get());
  }
  cutoff_stream_ = StepStream(Generator::named(draw_seed(gen), "hvq.nested_dropout"));
  draw_cutoff = [this] {
    // The reference's two draws: keep everything with probability
    // 1 - nested_dropout, else a cutoff uniform in [min_levels - 1, levels - 2].
    Generator& g = cutoff_stream_.next();
    if (rand({1}, g, {.dtype = DType::f64}).item<double>() >= opts_.nested_dropout)
      return int64_t{-1};
    return randint(opts_.nested_dropout_min_levels - 1, num_levels() - 1, {}, g).item<int64_t>();
  };
}

VectorQuantize& HierarchicalVQ::vq(int64_t level) {
  return *vqs_[vqs_.size() == 1 ? 0 : static_cast<size_t>(level)];
}

std::vector<int64_t> HierarchicalVQ::level_offsets() const {
  std::vector<int64_t> off{0};
  for (const auto& s : level_shapes_) off.push_back(off.back() + numel_of_level(s));
  return off;
}

std::vector<Tensor> HierarchicalVQ::split_indices(const Tensor& indices) const {
  const std::vector<int64_t> off = level_offsets();
  if (indices.dim() != 2 || indices.shape()[1] != off.back())
    fail("split_indices: expected indices [B, " + std::to_string(off.back()) + "], got " +
         shape_str(indices.shape()));
  std::vector<Tensor> out;
  for (size_t l = 0; l < level_shapes_.size(); ++l)
    out.push_back(unflatten(narrow(indices, 1, off[l], off[l + 1] - off[l]), 1,
                            Shape(level_shapes_[l].begin(), level_shapes_[l].end())));
  return out;
}

Tensor HierarchicalVQ::pool_residual(const Tensor& t, const std::vector<int64_t>& shape,
                                     const Tensor& maskf, Tensor* level_mask) const {
  if (!maskf.defined()) return adaptive_avg_pool_nd(t, shape, &resample_);
  const Tensor pooled_mask = adaptive_avg_pool_nd(maskf, shape, &resample_);  // [B, 1, l...]
  *level_mask = flatten(gt(pooled_mask, zeros_like(pooled_mask)), 1, -1);
  if (numel_of_level(shape) == 1) {
    // The coarsest level is the reference's masked_mean: sum / max(count, 1e-5).
    Dims spatial;
    for (int64_t d = 0; d < spatial_dims_; ++d) spatial.push_back(d + 2);
    const Tensor count = sum(maskf, spatial, true);
    return sum(t * maskf, spatial, true) / clamp(count, 1e-5, INFINITY);
  }
  return adaptive_avg_pool_nd(t * maskf, shape, &resample_) / clamp(pooled_mask, 1e-6, INFINITY);
}

Module* HierarchicalVQ::choose_phi(int64_t level) {
  const int64_t n = static_cast<int64_t>(phis_.size());
  if (n == 1) return phis_[0];
  const double pos =
      static_cast<double>(level) / static_cast<double>(std::max<int64_t>(num_levels() - 1, 1));
  // Python's round: halves to even.
  return phis_[static_cast<size_t>(std::nearbyint(pos * static_cast<double>(n - 1)))];
}

Tensor HierarchicalVQ::phi(Module& p, const Tensor& x) const {
  const double ratio = std::abs(opts_.quant_resi);
  if (ratio <= 1e-8) return x;
  const Tensor w = p.find("conv.weight"), b = p.find("conv.bias");
  const int64_t c = opts_.dim;
  Tensor conv;
  if (spatial_dims_ == 1) {
    // [B, C, L] as [B, C, 1, L] with the [C, C, 3] kernel as [C, C, 1, 3].
    conv = squeeze(conv2d(unsqueeze(x, 2), unsqueeze(w, 2), b, {1, 1}, {0, 1}), 2);
  } else if (spatial_dims_ == 2) {
    conv = conv2d(x, w, b, {1, 1}, {1, 1});
  } else {
    // Depth as the sum of its 3 taps, each a conv2d of the depth slices it reads.
    const int64_t bsz = x.shape()[0], d = x.shape()[2], h = x.shape()[3], wd = x.shape()[4];
    const Tensor pad = zeros({bsz, c, 1, h, wd}, options_of(x));
    const Tensor xp = cat({pad, x, pad}, 2);  // [B, C, D + 2, H, W]
    std::vector<Tensor> taps;
    for (int64_t t = 0; t < 3; ++t) {
      const Tensor slices =
          reshape(contiguous(transpose(narrow(xp, 2, t, d), 1, 2)), {bsz * d, c, h, wd});
      taps.push_back(conv2d(slices, select(w, 2, t), Tensor(), {1, 1}, {1, 1}));
    }
    conv = transpose(reshape(add_n(taps), {bsz, d, c, h, wd}), 1, 2) + reshape(b, {1, c, 1, 1, 1});
  }
  return x + (conv - x) * ratio;
}

Tensor HierarchicalVQ::upsample_to_full(const Tensor& q, const std::vector<int64_t>& full,
                                        int64_t level) {
  const Tensor up = level_shapes_[static_cast<size_t>(level)] == full
                        ? q
                        : interpolate_linear_nd(q, full, &resample_);
  return phi(*choose_phi(level), up);
}

int64_t HierarchicalVQ::nested_cutoff() {
  if (!is_training() || opts_.nested_dropout <= 0 || num_levels() <= 1) return -1;
  if (opts_.nested_dropout_min_levels >= num_levels()) return -1;
  return draw_cutoff();
}

QuantizeOutput HierarchicalVQ::forward_lens(const Tensor& x, const Tensor& lens) {
  if (spatial_dims_ != 1) fail("lens is only taken for 1-d sequences; pass a mask");
  if (!lens.defined() || lens.dim() != 1 || is_floating(lens.dtype()))
    fail("lens must be integer lengths [B]");
  if (x.dim() != 3 || lens.size(0) != x.size(0))
    fail("lens " + shape_str(lens.shape()) + " must give one length per sequence of " +
         shape_str(x.shape()));
  const int64_t length = x.size(opts_.channel_first ? 2 : 1);
  const Tensor positions =
      unsqueeze(arange(length, {.dtype = DType::i64, .device = x.device()}), 0);
  const Tensor mask = lt(positions, unsqueeze(to_dtype(lens.to(x.device()), DType::i64), 1));
  return forward(x, mask);
}

QuantizeOutput HierarchicalVQ::forward(const Tensor& x, const Tensor& mask) {
  const MixedPrecision f32_math(false);  // quantizer math stays f32 (engine/precision.h)
  const int64_t k = spatial_dims_;
  if (x.dim() != k + 2)
    fail("expected input [B, " + std::string(opts_.channel_first ? "dim, " : "") +
         std::to_string(k) + " spatial dims" + (opts_.channel_first ? "" : ", dim") + "], got " +
         shape_str(x.shape()));
  // Channel-first from here on: [B, C, s...].
  Tensor xcf = x;
  if (!opts_.channel_first) {
    std::vector<int64_t> perm{0, k + 1};
    for (int64_t d = 1; d <= k; ++d) perm.push_back(d);
    xcf = permute(x, perm);
  }
  if (xcf.shape()[1] != opts_.dim)
    fail("expected dim " + std::to_string(opts_.dim) + " features, got input " +
         shape_str(x.shape()));
  const std::vector<int64_t> full(xcf.shape().begin() + 2, xcf.shape().end());
  Tensor maskf;
  if (mask.defined()) {
    if (mask.dim() != k + 1 || mask.shape()[0] != xcf.shape()[0] ||
        !std::equal(full.begin(), full.end(), mask.shape().begin() + 1))
      fail("mask must be [B, spatial shape] " + shape_text(full) + ", got " +
           shape_str(mask.shape()));
    maskf = unsqueeze(to_dtype(mask, x.dtype()), 1);
  }

  Tensor residual = xcf;
  Tensor reconstruction = zeros_like(xcf);
  std::vector<Tensor> cumulative, indices, losses;
  for (int64_t l = 0; l < num_levels(); ++l) {
    const auto& shape = level_shapes_[static_cast<size_t>(l)];
    Tensor level_mask;
    const Tensor down = pool_residual(residual, shape, maskf, &level_mask);
    QuantizeOutput out = vq(l).forward(to_tokens(down), level_mask);
    const Tensor q = upsample_to_full(from_tokens(out.quantized, shape), full, l);
    reconstruction = reconstruction + q;
    residual = residual - q;
    cumulative.push_back(reconstruction);
    indices.push_back(out.indices);
    losses.push_back(reshape(out.loss, {}));
  }

  last_cutoff_ = nested_cutoff();
  const int64_t kept = last_cutoff_ < 0 ? num_levels() : last_cutoff_ + 1;
  if (last_cutoff_ >= 0) reconstruction = cumulative[static_cast<size_t>(last_cutoff_)];
  QuantizeOutput result;
  result.loss = mean(stack({losses.begin(), losses.begin() + kept}));
  if (maskf.defined()) reconstruction = reconstruction * maskf;
  if (!opts_.channel_first) {
    std::vector<int64_t> perm{0};
    for (int64_t d = 2; d < k + 2; ++d) perm.push_back(d);
    perm.push_back(1);
    reconstruction = contiguous(permute(reconstruction, perm));
  }
  result.quantized = reconstruction;
  result.indices = cat(indices, 1);
  result.losses = {{"commitment", result.loss}};
  return result;
}

Tensor HierarchicalVQ::get_output_from_indices(const Tensor& indices,
                                               std::vector<int64_t> full_shape) {
  if (full_shape.empty()) full_shape = level_shapes_.back();
  if (full_shape.size() == 1 && spatial_dims_ > 1)
    full_shape.assign(static_cast<size_t>(spatial_dims_), full_shape[0]);
  if (static_cast<int64_t>(full_shape.size()) != spatial_dims_)
    fail("get_output_from_indices: full_shape " + shape_text(full_shape) + " needs " +
         std::to_string(spatial_dims_) + " sizes");
  const std::vector<Tensor> levels = split_indices(indices);
  Tensor out;
  for (int64_t l = 0; l < num_levels(); ++l) {
    const Tensor flat = flatten(levels[static_cast<size_t>(l)], 1, -1);
    // Codes of -1 are zeros (VectorQuantize's rule), as the reference's where.
    const Tensor q = vq(l).get_output_from_indices(flat);
    const Tensor up =
        upsample_to_full(from_tokens(q, level_shapes_[static_cast<size_t>(l)]), full_shape, l);
    out = out.defined() ? out + up : up;
  }
  if (!opts_.channel_first) {
    std::vector<int64_t> perm{0};
    for (int64_t d = 2; d < spatial_dims_ + 2; ++d) perm.push_back(d);
    perm.push_back(1);
    out = contiguous(permute(out, perm));
  }
  return out;
}

void HierarchicalVQ::update_state() {
  for (auto& v : vqs_) v->update_state();
}

void HierarchicalVQ::set_update_in_forward(bool on) {
  for (auto& v : vqs_) v->set_update_in_forward(on);
}

}  // namespace quanta::quant
