#include "quant/vq/vector_quantize.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/nn/layers.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/join.h"
#include "engine/ops/linalg.h"
#include "engine/ops/loss.h"
#include "engine/ops/reduce.h"
#include "engine/ops/reductions.h"
#include "engine/ops/softmax.h"
#include "engine/ops/view.h"
#include "engine/precision.h"
#include "engine/random/sampling.h"
#include "quant/streams.h"
#include "quant/token_layout.h"
#include "quant/vq/commitment_loss.h"
#include "quant/vq/directional_reparam.h"
#include "quant/vq/nearest_code.h"
#include "quant/vq/rotation_trick.h"
#include "quant/vq/top_codes.h"

namespace quanta::quant {
namespace {

const char* kWho = "VectorQuantize";

[[noreturn]] void vq_fail(const std::string& what) {
  throw std::invalid_argument(std::string("[") + kWho + "] " + what);
}

VectorQuantizeOptions checked(VectorQuantizeOptions o) {
  if (o.dim <= 0) vq_fail("dim must be positive, got " + std::to_string(o.dim));
  if (o.codebook_size <= 0)
    vq_fail("codebook_size must be positive, got " + std::to_string(o.codebook_size));
  if (o.heads <= 0) vq_fail("heads must be positive, got " + std::to_string(o.heads));
  if (o.codebook_dim < 0)
    vq_fail("codebook_dim must be >= 0, got " + std::to_string(o.codebook_dim));
  if (o.kmeans_iters < 0) vq_fail("kmeans_iters must be >= 0");
  if (o.threshold_ema_dead_code < 0) vq_fail("threshold_ema_dead_code must be >= 0");
  if (o.sample_codebook_temp < 0) vq_fail("sample_codebook_temp must be >= 0");
  if (!(o.directional_reparam_variance >= 0))
    vq_fail("directional_reparam_variance must be >= 0, got " +
            std::to_string(o.directional_reparam_variance));
  // Nothing else revives a code the gradient never reaches.
  if (o.directional_reparam && o.threshold_ema_dead_code <= 0)
    vq_fail("directional_reparam needs dead-code replacement: set threshold_ema_dead_code > 0");
  return o;
}

CodebookOptions codebook_options(const VectorQuantizeOptions& o, int64_t codebook_dim,
                                 bool learnable, bool ema) {
  CodebookOptions c;
  c.dim = codebook_dim;
  c.codebook_size = o.codebook_size;
  c.num_codebooks = o.separate_codebook_per_head ? o.heads : 1;
  c.kmeans_init = o.kmeans_init;
  c.kmeans_iters = o.kmeans_iters;
  c.decay = o.decay;
  c.eps = o.eps;
  c.threshold_ema_dead_code = o.threshold_ema_dead_code;
  c.use_cosine_sim = o.use_cosine_sim;
  c.ema_update = ema;
  c.manual_ema_update = o.manual_ema_update;
  // The orthogonal loss needs a gradient on the codes even when the EMA
  // trains them, as in the reference.
  c.embed_is_parameter = learnable || o.orthogonal_reg_weight > 0;
  c.affine_param = o.affine_param;
  c.affine_param_batch_decay = o.affine_param_batch_decay;
  c.affine_param_codebook_decay = o.affine_param_codebook_decay;
  return c;
}

// Shared (a loss term the options turned off is the same zero every step):
// read, never written.
Tensor zero_like_loss(const Tensor& like) { return shared_full({}, 0.0, options_of(like)); }

// Gumbel noise -log(-log(u)), logs clamped at 1e-20 as the reference does.
Tensor gumbel_noise(const Shape& shape, Generator& gen, const TensorOptions& opts) {
  const Tensor u = rand(shape, gen, opts);
  const double open = std::numeric_limits<double>::quiet_NaN();
  return -log(clamp(-log(clamp(u, 1e-20, open)), 1e-20, open));
}

// codes [G, K, d] at idx [G, T] -> [G, T, d]: one gather over the flattened
// codebooks (codebook g's codes start at row g * K).
Tensor gather_codes(const Tensor& codes, const Tensor& idx) {
  const int64_t g = codes.size(0), k = codes.size(1), d = codes.size(2), tt = idx.size(1);
  Tensor flat = idx;
  if (g > 1)
    flat = idx + unsqueeze(arange(g, {.dtype = DType::i64, .device = idx.device()}) * k, 1);
  return reshape(index_select(reshape(codes, {g * k, d}), 0, reshape(flat, {g * tt})), {g, tt, d});
}

// Per-token codes [G, T, K, d] at idx [G, T] -> [G, T, d]: each token's own
// codebook's row (token t of table g starts at row (g T + t) K).
Tensor gather_token_codes(const Tensor& codes, const Tensor& idx) {
  const int64_t g = codes.size(0), tt = codes.size(1), k = codes.size(2), d = codes.size(3);
  const Tensor start =
      reshape(arange(g * tt, {.dtype = DType::i64, .device = idx.device()}) * k, {g, tt});
  return reshape(index_select(reshape(codes, {g * tt * k, d}), 0, reshape(idx + start, {g * tt})),
                 {g, tt, d});
}

// The distances to per-token codes [G, T, K, d], [G, T, K]: the reference's
// -pairwise_distance(x, c), i.e. -|x - c + 1e-6|.
Tensor token_distances(const Tensor& x, const Tensor& codes) {
  return -sqrt(sum(square(unsqueeze(x, 2) - codes + 1e-6), {-1}));
}

}  // namespace

/** The input as the codebook sees it. */
struct VectorQuantize::Tokens {
  explicit Tokens(TokenLayout l) : layout(std::move(l)) {}
  TokenLayout layout;
  int64_t b = 0, n = 0;
  /** The input as tokens [B, N, dim], before project_in. */
  Tensor input;
  /** [G, T, codebook_dim], T = B * N (* heads when shared). */
  Tensor x;
  /** [G, T] bool, undefined without a mask. */
  Tensor valid;
  /** [B, N] bool, undefined without a mask. */
  Tensor mask;
};

VectorQuantize::VectorQuantize(const VectorQuantizeOptions& opts, Generator& gen)
    : VectorQuantize(opts, gen, nullptr) {}

VectorQuantize::VectorQuantize(const VectorQuantizeOptions& opts, Generator& gen,
                               std::shared_ptr<Codebook> shared)
    : SingleLayerQuantizer(kWho),
      opts_(checked(opts)),
      sample_gen_(Generator(0)),
      orthogonal_gen_(Generator(0)),
      diveq_gen_(Generator(0)) {
  codebook_dim_ = opts_.codebook_dim > 0 ? opts_.codebook_dim : opts_.dim;
  const bool diveq = opts_.directional_reparam;
  rotation_trick_ = opts_.rotation_trick.value_or(!diveq && opts_.dim > 1);
  const bool bridge = opts_.vq_bridge != nullptr;
  learnable_ = opts_.learnable_codebook.value_or(diveq || bridge);
  ema_update_ = opts_.ema_update.value_or(!diveq && !bridge);
  if (bridge && (!learnable_ || ema_update_))
    vq_fail(
        "vq_bridge trains the codes through the bridge: learnable_codebook must be on and "
        "ema_update off");
  if (bridge && opts_.use_cosine_sim)
    vq_fail("vq_bridge needs a learnable codebook, which cosine similarity does not take");
  if (diveq && (opts_.straight_through || rotation_trick_))
    vq_fail(
        "directional_reparam is a gradient route of its own: turn straight_through and "
        "rotation_trick off");
  const int64_t inner = codebook_dim_ * opts_.heads;
  if (inner != opts_.dim) {
    auto lin_in = std::make_shared<Linear>(opts_.dim, inner, gen);
    if (opts_.layernorm_after_project_in) {
      auto seq = std::make_shared<Sequential>();
      seq->push_back(lin_in);
      seq->push_back(std::make_shared<LayerNorm>(Shape{inner}));
      project_in_ = register_module("project_in", std::shared_ptr<Module>(seq));
    } else {
      project_in_ = register_module("project_in", std::shared_ptr<Module>(lin_in));
    }
    project_out_ = register_module(
        "project_out", std::shared_ptr<Module>(std::make_shared<Linear>(inner, opts_.dim, gen)));
  }
  if (shared) {
    const CodebookOptions& c = shared->options();
    if (c.dim != codebook_dim_ || c.codebook_size != opts_.codebook_size ||
        c.num_codebooks != separate_codebooks())
      vq_fail("the shared codebook has another shape than this layer needs");
    codebook_ = register_module("_codebook", shared);
  } else {
    codebook_ = register_module(
        "_codebook", std::make_shared<Codebook>(
                         codebook_options(opts_, codebook_dim_, learnable_, ema_update_), gen));
  }
  if (bridge) {
    bool registered = false;  // a shared codebook holds its bridge once
    for (const auto& [name, child] : codebook_->named_children()) registered |= name == "vq_bridge";
    if (!registered) codebook_->register_module("vq_bridge", opts_.vq_bridge);
    codebook_transform = [b = opts_.vq_bridge](const Tensor& codes, const Tensor&) {
      return b->forward(codes);
    };
  }
  const uint64_t seed = draw_seed(gen);
  sample_gen_ = StepStream(Generator::named(seed, "vq.sample"));
  orthogonal_gen_ = StepStream(Generator::named(seed, "vq.orthogonal"));
  diveq_gen_ = StepStream(Generator::named(seed, "vq.diveq"));
  directional_noise = [this](const Shape& shape, const TensorOptions& o) {
    return randn(shape, diveq_gen_.next(), o);
  };
}

// [B, N, H * Dc] -> [G, T, Dc] with tokens in (b, n) order per head
// (separate codebooks) or (b, n, h) order (one shared codebook).
Tensor VectorQuantize::split_heads(const Tensor& t, int64_t b, int64_t n) const {
  const int64_t h = opts_.heads, d = codebook_dim_;
  if (h == 1) return reshape(t, {1, b * n, d});
  if (!opts_.separate_codebook_per_head) return reshape(t, {1, b * n * h, d});
  return reshape(permute(reshape(t, {b, n, h, d}), {2, 0, 1, 3}), {h, b * n, d});
}

Tensor VectorQuantize::merge_heads(const Tensor& t, int64_t b, int64_t n) const {
  const int64_t h = opts_.heads, d = codebook_dim_;
  if (h == 1 || !opts_.separate_codebook_per_head) return reshape(t, {b, n, h * d});
  return reshape(permute(reshape(t, {h, b, n, d}), {1, 2, 0, 3}), {b, n, h * d});
}

// [G, T] -> [B, N] or [B, N, heads]
Tensor VectorQuantize::indices_to_tokens(const Tensor& idx, int64_t b, int64_t n) const {
  const int64_t h = opts_.heads;
  if (h == 1) return reshape(idx, {b, n});
  if (!opts_.separate_codebook_per_head) return reshape(idx, {b, n, h});
  return contiguous(permute(reshape(idx, {h, b, n}), {1, 2, 0}));
}

VectorQuantize::Tokens VectorQuantize::prepare(const Tensor& x, const Tensor& mask) {
  if (x.dim() >= 4 && !opts_.accept_image_fmap)
    vq_fail("got a feature map of shape " + shape_str(x.shape()) +
            "; set accept_image_fmap to quantize [B, D, H, W...] inputs");
  Tokens t{TokenLayout(x, opts_.channel_last, opts_.dim, kWho)};
  t.b = t.layout.batch();
  t.n = t.layout.tokens();
  Tensor tokens = t.layout.to_tokens(x);
  t.input = tokens;
  if (project_in_) tokens = project_in_->forward(tokens);
  Tensor xs = split_heads(tokens, t.b, t.n);
  if (opts_.use_cosine_sim) xs = l2norm(xs);
  t.x = xs;
  if (mask.defined()) {
    if (mask.dtype() != DType::boolean)
      vq_fail(std::string("mask must be bool, got ") + dtype_name(mask.dtype()));
    if (mask.numel() != t.b * t.n)
      vq_fail("mask of shape " + shape_str(mask.shape()) + " does not match the " +
              std::to_string(t.b) + " x " + std::to_string(t.n) + " tokens of the input");
    t.mask = contiguous(reshape(mask, {t.b, t.n}));
    const int64_t h = opts_.heads;
    if (h == 1) {
      t.valid = reshape(t.mask, {1, t.b * t.n});
    } else if (!opts_.separate_codebook_per_head) {
      t.valid =
          reshape(contiguous(expand(unsqueeze(t.mask, 2), {t.b, t.n, h})), {1, t.b * t.n * h});
    } else {
      t.valid = reshape(contiguous(expand(unsqueeze(t.mask, 0), {h, t.b, t.n})), {h, t.b * t.n});
    }
  }
  return t;
}

// The reference's "dist": -sqrt(max(|x - e|^2, 1e-8)) or the cosine similarity,
// [G, T, K], differentiable in x (and in the codes when they need a gradient).
Tensor VectorQuantize::distances(const Tensor& x, const Tensor& codes) const {
  if (codes.dim() == 4) return token_distances(x, codes);
  if (opts_.use_cosine_sim) return matmul(x, transpose(codes, 1, 2));
  std::vector<Tensor> per;
  for (int64_t g = 0; g < x.size(0); ++g)
    per.push_back(-sqrt(clamp(sq_dist(select(x, 0, g), select(codes, 0, g)), 1e-8,
                              std::numeric_limits<double>::quiet_NaN())));
  return stack(per);
}

Tensor VectorQuantize::project_out(const Tensor& t) {
  return project_out_ ? project_out_->forward(t) : t;
}

/** What one forward does, from the options and the mode. */
struct VectorQuantize::Plan {
  bool training = false;
  /** The codebook takes this forward's statistics. */
  bool updates = false;
  /** Gumbel-softmax straight-through output. */
  bool gumbel = false;
  /** Gumbel-sampled codes. */
  bool stochastic = false;
  /** The full distance matrix is needed (else the blocked nearest-code search). */
  bool need_dist = false;
};

/** The loss terms of one forward and, when the route was fused with the
 * commitment loss, the routed output. */
struct VectorQuantize::Losses {
  Tensor loss, commit, ortho, diversity;
  Tensor routed;
};

// k-means initialisation: on the first batch inside this forward (the
// reference's behaviour), or, with the update deferred to an explicit
// reconciliation point (distributed training), only collect this training
// batch as samples; until then the codes are the zero vectors.
void VectorQuantize::init_codebook(const Tokens& t) {
  Codebook& cb = *codebook_;
  if (cb.initted()) return;
  if (!opts_.update_in_forward) {
    if (is_training()) cb.add_init_samples(t.x, t.valid);
    return;
  }
  const int64_t g = t.x.size(0);
  std::vector<Tensor> samples;
  for (int64_t h = 0; h < g; ++h) {
    Tensor rows = select(t.x, 0, h).detach();
    if (t.valid.defined()) rows = index_select(rows, 0, nonzero(select(t.valid, 0, h)));
    samples.push_back(rows);
  }
  cb.init_from_samples(samples);
}

VectorQuantize::Plan VectorQuantize::plan() const {
  Plan p;
  p.training = is_training();
  // Still uninitialised after init_codebook: k-means waits for the deferred update.
  const bool deferred_init = !codebook_->initted() && !opts_.update_in_forward;
  p.updates = p.training && !deferred_init && !opts_.freeze_codebook &&
              (ema_update_ || opts_.threshold_ema_dead_code > 0);
  const double temp = opts_.sample_codebook_temp;
  p.gumbel = p.training && opts_.straight_through && temp > 0;
  p.stochastic = p.training && opts_.stochastic_sample_codes && temp > 0;
  // Losses are computed in training only.
  p.need_dist =
      p.gumbel || p.stochastic ||
      (p.training && opts_.commitment_weight > 0 && opts_.commitment_use_cross_entropy_loss) ||
      (p.training && opts_.codebook_diversity_loss_weight > 0);
  return p;
}

// The running input statistics of affine_param (training only); deferred
// with the other statistics when the update is (distributed).
void VectorQuantize::update_affine(const Tokens& t) {
  if (opts_.update_in_forward)
    codebook_->update_affine(t.x, t.valid);
  else
    codebook_->accumulate_affine(t.x, t.valid);
}

// The codes this forward uses, with a gradient only for a learnable
// codebook. Backward reads them (for the codes' own gradient, and for the
// input's through the distances), so when a state update before backward
// (this forward's, or a shared codebook's after the last layer) will
// overwrite the codebook in place, they are a copy.
// Through codebook_transform when there is one: a per-token codebook
// [G, T, K, d] comes back as it is (affine_param's map has no per-token form).
Tensor VectorQuantize::codes_for(const Plan& p, const Tensor& condition) const {
  Codebook& cb = *codebook_;
  Tensor embed = learnable_ ? cb.embed() : cb.embed().detach();
  if (p.updates && (learnable_ || p.need_dist)) embed = embed.clone();
  if (!codebook_transform) return cb.affine_codes(embed);
  const Tensor codes = codebook_transform(embed, condition);
  if (codes.dim() != 4) return cb.affine_codes(codes);
  if (opts_.affine_param) vq_fail("affine_param does not take a per-token codebook transform");
  return codes;
}

// A condition [B, N, d] (or any shape of `rows` rows) as rows [rows, d].
Tensor VectorQuantize::condition_rows(const Tensor& condition, int64_t rows) const {
  if (!condition.defined()) return condition;
  if (opts_.heads != 1)
    vq_fail("a condition for the codebook transform needs heads = 1, the layer has " +
            std::to_string(opts_.heads));
  if (condition.numel() != rows * codebook_dim_)
    vq_fail("a condition of shape " + shape_str(condition.shape()) + " for " +
            std::to_string(rows) + " tokens of " + std::to_string(codebook_dim_) + " features");
  return reshape(condition, {rows, codebook_dim_});
}

// The chosen code of every token [G, T]: Gumbel-sampled, the argmax of the
// distances when they are formed anyway, else the blocked nearest-code search.
Tensor VectorQuantize::choose_codes(const Tokens& t, const Tensor& codes, const Tensor& dist,
                                    const Plan& p) {
  NoGradGuard no_grad;
  if (p.stochastic) {
    const Tensor logits = dist.detach() / opts_.sample_codebook_temp +
                          gumbel_noise(dist.shape(), sample_gen_.next(), options_of(dist));
    return argmax(logits, -1);
  }
  if (p.need_dist || codes.dim() == 4) return argmax(dist.detach(), -1);
  std::vector<Tensor> per;
  for (int64_t h = 0; h < t.x.size(0); ++h)
    per.push_back(nearest_codes(select(t.x, 0, h), select(codes, 0, h), opts_.use_cosine_sim));
  return per.size() == 1 ? unsqueeze(per[0], 0) : stack(per);  // one table: no copy
}

// The chosen codes [G, T, d], gathered (not a one-hot product) from the
// codebook as it was before this forward's update; a one-hot straight-through
// softmax for Gumbel straight-through.
Tensor VectorQuantize::gathered_codes(const Tensor& idx, const Tensor& codes, const Tensor& dist,
                                      const Plan& p) const {
  if (p.gumbel) {
    const Tensor soft = softmax(dist / opts_.sample_codebook_temp, -1);
    const Tensor hard = to_dtype(one_hot(idx, opts_.codebook_size), soft.dtype());
    const Tensor weights = hard + soft - soft.detach();  // [G, T, K]
    if (codes.dim() != 4) return matmul(weights, codes);
    const int64_t g = codes.size(0), tt = codes.size(1), k = codes.size(2), d = codes.size(3);
    return reshape(matmul(reshape(weights, {g * tt, 1, k}), reshape(codes, {g * tt, k, d})),
                   {g, tt, d});
  }
  return codes.dim() == 4 ? gather_token_codes(codes, idx) : gather_codes(codes, idx);
}

void VectorQuantize::accumulate(const Tokens& t, const Tensor& idx) {
  Codebook& cb = *codebook_;
  cb.accumulate(opts_.affine_param ? cb.to_codebook_space(t.x.detach()) : t.x, idx, t.valid);
  if (opts_.update_in_forward) cb.update_state();
}

// The weighted loss and its terms (training only; zeros otherwise). The
// gradient route from the output back to the input is fused with the MSE
// commitment loss (one backward pass over the tokens instead of three and an
// add) when the codes take no gradient.
VectorQuantize::Losses VectorQuantize::losses(const Tokens& t, const Tensor& idx, const Tensor& q,
                                              const Tensor& dist, const Plan& p) {
  Losses l;
  l.loss = zero_like_loss(t.x);
  l.commit = zero_like_loss(t.x);
  l.ortho = l.commit;
  l.diversity = l.commit;
  if (!p.training) return l;
  const int64_t g = t.x.size(0), tt = t.x.size(1), k = opts_.codebook_size;
  // Without a mask every token counts, which the host knows; a mask is read.
  const bool any_valid = t.valid.defined() ? any(t.valid).item() != 0.0 : g * tt > 0;
  // DiVeQ trains the codes through the output: no commitment loss.
  if (opts_.commitment_weight > 0 && !opts_.directional_reparam && any_valid) {
    if (opts_.commitment_use_cross_entropy_loss) {
      Tensor target = idx;
      if (t.valid.defined()) target = where(t.valid, idx, full_like(idx, -1.0));
      l.commit =
          cross_entropy(reshape(dist, {g * tt, k}), reshape(target, {g * tt}), Reduction::mean, -1);
    } else if (!p.gumbel && !learnable_ && opts_.route_gradients_to_input) {
      const GradientRoute route =
          rotation_trick_ ? GradientRoute::rotation : GradientRoute::straight_through;
      const TrainingOutput r = route_with_commitment(t.x, q.detach(), t.valid, route);
      l.commit = r.commitment;
      l.routed = r.quantized;
    } else {
      l.commit = commitment_loss(t.x, learnable_ ? q : q.detach(), t.valid);
    }
    l.loss = l.loss + l.commit * opts_.commitment_weight;
  }
  // Whatever the token count: batch_mean may be a collective.
  if (opts_.codebook_diversity_loss_weight > 0) {
    l.diversity = diversity_loss(dist, t.valid, t.b, t.n);
    l.loss = l.loss + l.diversity * opts_.codebook_diversity_loss_weight;
  }
  if (opts_.orthogonal_reg_weight > 0) {
    l.ortho = orthogonal_loss(idx);
    l.loss = l.loss + l.ortho * opts_.orthogonal_reg_weight;
  }
  return l;
}

// The gradient route from the output q back to the input x (unless `fused`
// into the commitment loss): rotation trick, DiVeQ or straight-through in
// training, none in eval; Gumbel straight-through routes through the softmax
// already. Without routing the output is the code (a learnable one keeps its
// gradient).
Tensor VectorQuantize::routed_output(const Tensor& x, const Tensor& q, const Tensor& fused,
                                     const Plan& p) {
  if (!p.training) return q.detach();
  if (p.gumbel) return q;
  Tensor out = fused;
  if (!out.defined()) {
    if (!opts_.route_gradients_to_input)
      out = q;
    else if (opts_.directional_reparam)
      out = directional_reparam(x, q, opts_.directional_reparam_variance,
                                directional_noise(x.shape(), options_of(x)));
    else
      out = rotation_trick_ ? rotate_to(x, q.detach()) : straight_through(x, q.detach());
  }
  if (opts_.sync_update_v > 0) out = out + (out - out.detach()) * opts_.sync_update_v;
  return out;
}

// The output in the input's layout: masked tokens get zeros (or the input)
// and index -1.
QuantizeOutput VectorQuantize::finish(const Tokens& t, const Tensor& q_out, const Tensor& idx,
                                      const Losses& l) {
  Tensor y = project_out(merge_heads(q_out, t.b, t.n));
  Tensor indices = indices_to_tokens(idx, t.b, t.n);
  if (t.mask.defined()) {
    y = opts_.return_zeros_for_masked_padding ? y * unsqueeze(to_dtype(t.mask, y.dtype()), -1)
                                              : where(unsqueeze(t.mask, -1), y, t.input);
    const Tensor m = opts_.heads == 1 ? t.mask : unsqueeze(t.mask, -1);
    indices = where(m, indices, full_like(indices, -1.0));
  }
  QuantizeOutput out;
  out.quantized = t.layout.from_tokens(y);
  out.indices = t.layout.spatial_from_tokens(indices);
  out.loss = l.loss;
  out.losses = {{"commitment", l.commit},
                {"orthogonal_reg", l.ortho},
                {"codebook_diversity", l.diversity},
                {"inplace_optimize", zero_like_loss(t.x)}};
  return out;
}

QuantizeOutput VectorQuantize::forward(const Tensor& x, const Tensor& mask,
                                       const QuantizeOptions& opts) {
  const MixedPrecision f32_math(false);  // quantizer math stays f32 (engine/precision.h)
  const Tokens t = prepare(x, mask);
  init_codebook(t);
  const Plan p = plan();
  if (opts_.affine_param && p.training) update_affine(t);
  const Tensor codes = codes_for(p, condition_rows(opts.condition, t.b * t.n));
  Tensor dist;
  if (p.need_dist) {
    dist = distances(t.x, codes);
  } else if (codes.dim() == 4) {  // a codebook per token: the choice reads the distances
    NoGradGuard choice_only;
    dist = distances(t.x, codes);
  }
  const Tensor idx = choose_codes(t, codes, dist, p);
  const Tensor q = gathered_codes(idx, codes, dist, p);
  if (p.updates) accumulate(t, idx);
  const Losses l = losses(t, idx, q, dist, p);
  return finish(t, routed_output(t.x, q, l.routed, p), idx, l);
}

QuantizeOutput VectorQuantize::forward_topk(const Tensor& x, int64_t k, const Tensor& mask) {
  if (opts_.heads != 1)
    vq_fail("topk codes need heads = 1, the layer has " + std::to_string(opts_.heads));
  if (k < 1) vq_fail("topk must be >= 1, got " + std::to_string(k));
  if (x.dim() >= 4 || (x.dim() == 3 && !opts_.channel_last))
    vq_fail("topk codes take channel-last tokens [B, N, D] or [B, D], got " + shape_str(x.shape()));
  if (is_training() && opts_.commitment_use_cross_entropy_loss)
    vq_fail(
        "topk codes in training need the MSE commitment (commitment_use_cross_entropy_loss is on)");
  k = std::min(k, opts_.codebook_size);
  const Tokens t = prepare(x, mask);
  init_codebook(t);
  Plan p = plan();
  p.updates = false;  // candidates only: the caller keeps some (update_indices)
  if (opts_.affine_param && p.training) update_affine(t);
  const Tensor codes = codes_for(p, Tensor());
  if (codes.dim() == 4) vq_fail("topk codes do not take a per-token codebook transform");
  // The distances [1, T, K] where a loss, the Gumbel softmax or sampling
  // reads them; else the k nearest are those of least squared distance (the
  // same order without the square root and sign).
  Tensor dist, idx;
  if (p.gumbel || p.stochastic || (p.training && opts_.codebook_diversity_loss_weight > 0)) {
    dist = distances(t.x, codes);
    Tensor logits = dist.detach();
    if (p.stochastic)
      logits = logits / opts_.sample_codebook_temp +
               gumbel_noise(dist.shape(), sample_gen_.next(), options_of(dist));
    idx = top_indices(logits, k);  // [1, T, k]
  } else {
    NoGradGuard choice_only;
    const Tensor xs = t.x.detach();
    std::vector<Tensor> per;  // cosine: similarities (largest nearest); else squared distances
    for (int64_t g = 0; g < xs.size(0); ++g)
      per.push_back(opts_.use_cosine_sim
                        ? matmul(select(xs, 0, g), transpose(select(codes, 0, g), 0, 1))
                        : sq_dist(select(xs, 0, g), select(codes, 0, g)));
    idx = top_indices(per.size() == 1 ? unsqueeze(per[0], 0) : stack(per), k,
                      /*largest=*/opts_.use_cosine_sim);
  }
  const int64_t tt = t.x.size(1), d = codebook_dim_, kk = opts_.codebook_size;
  const Tensor flat = reshape(idx, {1, tt * k});
  Tensor q;
  if (p.gumbel) {  // each candidate's one-hot + softmax - sg(softmax)
    const Tensor soft = unsqueeze(softmax(dist / opts_.sample_codebook_temp, -1), 2);
    const Tensor hard = to_dtype(one_hot(idx, kk), soft.dtype());
    q = matmul(reshape(hard + soft - soft.detach(), {1, tt * k, kk}), codes);
  } else {
    q = gather_codes(codes, flat);
  }
  q = reshape(q, {1, tt, k, d});
  const Tensor xk = expand(unsqueeze(t.x, 2), {1, tt, k, d});
  Tensor commit = mean(square((learnable_ ? q : q.detach()) - xk), {-1});  // [1, T, k]
  if (t.valid.defined()) commit = commit * unsqueeze(to_dtype(t.valid, commit.dtype()), -1);
  const bool has_commitment = opts_.commitment_weight > 0 && !opts_.directional_reparam;
  Losses l;
  l.commit = commit;
  l.loss = has_commitment ? commit * opts_.commitment_weight : commit;
  l.ortho = zero_like_loss(t.x);
  l.diversity = l.ortho;
  if (p.training) {
    if (!has_commitment) l.loss = zeros_like(commit);
    if (opts_.codebook_diversity_loss_weight > 0) {
      l.diversity = diversity_loss(dist, t.valid, t.b, t.n);
      l.loss = l.loss + l.diversity * opts_.codebook_diversity_loss_weight;
    }
    if (opts_.orthogonal_reg_weight > 0) {
      l.ortho = orthogonal_loss(flat);
      l.loss = l.loss + l.ortho * opts_.orthogonal_reg_weight;
    }
  }
  // The output: [B, N, k, D] (no heads to merge), masked as forward does.
  Tensor y = project_out(reshape(routed_output(xk, q, Tensor(), p), {t.b, t.n, k, d}));
  Tensor indices = reshape(idx, {t.b, t.n, k});
  if (t.mask.defined()) {
    const Tensor m = unsqueeze(t.mask, -1);
    y = opts_.return_zeros_for_masked_padding
            ? y * unsqueeze(to_dtype(m, y.dtype()), -1)
            : where(unsqueeze(m, -1), y, expand(unsqueeze(t.input, 2), y.shape()));
    indices = where(m, indices, full_like(indices, -1.0));
  }
  const bool single = x.dim() == 2;
  QuantizeOutput out;
  out.quantized = single ? reshape(y, {t.b, k, opts_.dim}) : y;
  out.indices = single ? reshape(indices, {t.b, k}) : indices;
  const auto per_token = [&](const Tensor& v) {
    return v.dim() == 0 ? v : (single ? reshape(v, {t.b, k}) : reshape(v, {t.b, t.n, k}));
  };
  out.loss = per_token(l.loss);
  out.losses = {{"commitment", per_token(l.commit)},
                {"orthogonal_reg", l.ortho},
                {"codebook_diversity", l.diversity},
                {"inplace_optimize", zero_like_loss(t.x)}};
  return out;
}

void VectorQuantize::update_indices(const Tensor& x, const Tensor& indices, const Tensor& mask) {
  if (!plan().updates) return;
  NoGradGuard no_grad;
  const Tokens t = prepare(x.detach(), mask);
  const int64_t tokens = t.x.size(1);
  if (indices.numel() != tokens)
    vq_fail("update_indices got indices of shape " + shape_str(indices.shape()) + " for " +
            std::to_string(tokens) + " tokens");
  // Masked tokens' -1 look up code 0 and count nothing.
  Tensor idx = reshape(to_dtype(indices, DType::i64), {1, tokens});
  idx = where(lt(idx, constant_like(idx, 0.0)), zeros_like(idx), idx);
  accumulate(t, idx);
}

Tensor VectorQuantize::orthogonal_loss(const Tensor& indices) {
  Tensor e = codebook_->embed();  // after this forward's update, as the reference
  if (opts_.orthogonal_reg_active_codes_only) {
    std::set<int64_t> used;
    for (int64_t i : indices.to_vector<int64_t>()) used.insert(i);
    const std::vector<int64_t> ids(used.begin(), used.end());
    e = index_select(e, 1,
                     from_vector<int64_t>(ids, {int64_t(ids.size())},
                                          {.dtype = DType::i64, .device = e.device()}));
  }
  const int64_t n = e.size(1);
  if (opts_.orthogonal_reg_max_codes > 0 && n > opts_.orthogonal_reg_max_codes)
    e = index_select(
        e, 1,
        slice(randperm(n, orthogonal_gen_.next(), {.dtype = DType::i64, .device = e.device()}), 0,
              0, opts_.orthogonal_reg_max_codes));
  const int64_t m = e.size(1), h = e.size(0);
  if (m == 0) return zero_like_loss(e);
  const Tensor en = l2norm(e);
  const Tensor cos = matmul(en, transpose(en, 1, 2));
  return sum(square(cos)) / double(h * m * m) - 1.0 / double(m);
}

Tensor local_batch_mean(const Tensor& sum, const Tensor& count) {
  return sum / unsqueeze(clamp(count, 1.0, std::numeric_limits<double>::quiet_NaN()), -1);
}

Tensor VectorQuantize::diversity_loss(const Tensor& dist, const Tensor& valid, int64_t b,
                                      int64_t n) const {
  const int64_t k = opts_.codebook_size, h = opts_.heads;
  Tensor p = softmax(dist * opts_.codebook_diversity_temperature, -1);  // [G, T, K]
  Tensor w = valid.defined() ? to_dtype(valid, p.dtype())
                             : shared_full({p.size(0), p.size(1)}, 1.0, options_of(p));
  p = p * unsqueeze(w, -1);
  // Average over everything but the sequence position n, as the reference.
  Tensor pn, cnt;
  if (h > 1 && opts_.separate_codebook_per_head) {
    pn = sum(reshape(p, {h, b, n, k}), {0, 1});
    cnt = sum(reshape(w, {h, b, n}), {0, 1});
  } else {
    const int64_t hh = h > 1 ? h : 1;
    pn = sum(reshape(p, {b, n, hh, k}), {0, 2});
    cnt = sum(reshape(w, {b, n, hh}), {0, 2});
  }
  pn = batch_mean(pn, cnt);
  const Tensor entropy =
      -sum(pn * log(clamp(pn, 1e-5, std::numeric_limits<double>::quiet_NaN())), {-1});
  return -mean(entropy);
}

QuantizeOutput VectorQuantize::forward_with_indices(const Tensor& x, const Tensor& indices,
                                                    const Tensor& mask) {
  Tokens t = prepare(x, mask);
  const int64_t g = t.x.size(0), tt = t.x.size(1), k = opts_.codebook_size;
  Plan p = plan();
  p.updates = false;  // this forward updates nothing
  const Tensor codes = codes_for(p, Tensor());
  if (codes.dim() == 4)
    vq_fail("forward with indices does not take a per-token codebook transform");
  const Tensor dist = distances(t.x, codes);
  const Tensor idx = argmax(dist.detach(), -1);
  // Given indices [B, N(, heads)] to the codebook's token order [G, T].
  Tensor target = t.layout.spatial_to_tokens(indices, opts_.heads > 1 ? 1 : 0);
  if (opts_.heads > 1 && opts_.separate_codebook_per_head)
    target = contiguous(permute(target, {2, 0, 1}));
  target = reshape(to_dtype(target, DType::i64), {g * tt});
  if (t.mask.defined()) target = where(reshape(t.valid, {g * tt}), target, full_like(target, -1.0));
  QuantizeOutput out;
  Tensor ce = zero_like_loss(t.x);
  if (g * tt > 0 && any(ne(target, full_like(target, -1.0))).item())
    ce = cross_entropy(reshape(dist, {g * tt, k}), target, Reduction::mean, -1);
  Tensor q = gather_codes(codes, idx);
  if (is_training())
    q = rotation_trick_ ? rotate_to(t.x, q.detach()) : straight_through(t.x, q.detach());
  Tensor y = project_out(merge_heads(q, t.b, t.n));
  if (t.mask.defined()) y = y * unsqueeze(to_dtype(t.mask, y.dtype()), -1);
  out.quantized = t.layout.from_tokens(y);
  out.indices = indices;
  out.loss = ce;
  out.losses = {{"cross_entropy", ce}};
  return out;
}

Tensor VectorQuantize::codes_from_indices(const Tensor& indices, const Tensor& condition) {
  const int64_t h = opts_.heads, k = opts_.codebook_size, d = codebook_dim_;
  Shape lead = indices.shape();
  if (h > 1) {
    if (lead.empty() || lead.back() != h)
      vq_fail("get_codes_from_indices expects indices [..., " + std::to_string(h) + "] for " +
              std::to_string(h) + " heads, got " + shape_str(indices.shape()));
    lead.pop_back();
  }
  int64_t m = 1;
  for (int64_t s : lead) m *= s;
  NoGradGuard no_grad;
  Tensor codes = codebook_->embed().detach();
  if (codebook_transform) codes = codebook_transform(codes, condition_rows(condition, m));
  const int64_t g = codes.size(0);
  Tensor idx = reshape(to_dtype(indices, DType::i64), {m, h});
  const Tensor valid = ge(idx, constant_like(idx, 0.0));
  Tensor flat = where(valid, idx, zeros_like(idx));
  Tensor rows;
  if (codes.dim() == 4) {  // one head: token i's code from its own codebook
    rows = reshape(gather_token_codes(codes, reshape(flat, {1, m})), {m, h, d});
  } else {
    if (g > 1)
      flat = flat + unsqueeze(arange(h, {.dtype = DType::i64, .device = idx.device()}) * k, 0);
    rows = reshape(index_select(reshape(codes, {g * k, d}), 0, reshape(flat, {m * h})), {m, h, d});
  }
  rows = rows * unsqueeze(to_dtype(valid, rows.dtype()), -1);
  Shape out = lead;
  out.push_back(h * d);
  return reshape(rows, out);
}

Tensor VectorQuantize::get_output_from_indices(const Tensor& indices) {
  return project_out(get_codes_from_indices(indices));
}

}  // namespace quanta::quant
