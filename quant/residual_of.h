#pragma once
// ResidualOf<Layer>: the residual stack of a layer family, made from its
// LayerTraits (quant/layer_traits.h) over the one residual algorithm
// (quant/residual.h). Its member functions live in quant/residual_of_impl.h,
// which only the file that instantiates a family's stack includes (each
// family's header declares `extern template class ResidualOf<Layer>`).
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/nn/layers.h"
#include "engine/random/generator.h"
#include "engine/tensor.h"
#include "quant/layer_traits.h"
#include "quant/quantize_output.h"
#include "quant/quantizer.h"
#include "quant/residual.h"

namespace quanta::quant {

template <class Layer>
class ResidualOf : public Residual {
 public:
  using Traits = LayerTraits<Layer>;
  using Options = typename Traits::Options;

  /** Validates `opts` (errors name the family's stack) and builds it from
   * `gen` as quant/layer_traits.h says: modules "project_in" / "project_out"
   * (when the layers are narrower than the input) and "layers.<i>". */
  ResidualOf(Options opts, Generator& gen);

  /** forward(x, mask, {}). */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask) {
    return forward(x, mask, QuantizeOptions{});
  }
  using Residual::forward;

  /** Per-layer codes [Q, ..., d] of indices [..., q] (q <= Q; missing layers
   * and -1 give zeros), scaled as the layers quantized. */
  Tensor get_codes_from_indices(const Tensor& indices) override;
  /** project_out of the summed codes: what forward outputs, [..., dim]. */
  Tensor get_output_from_indices(const Tensor& indices) override;

  int64_t num_quantizers() const override { return static_cast<int64_t>(layers_.size()); }
  int64_t codebook_size() const override;
  /** One index per layer. */
  int64_t num_codebooks() const override { return num_quantizers(); }
  /** The options as validated (what they imply filled in). */
  const Options& options() const { return opts_; }
  /** Input features. */
  int64_t dim() const { return plan_.dim; }
  bool has_projections() const { return project_in_ != nullptr; }
  Layer& layer(int64_t i) { return *layers_.at(static_cast<size_t>(i)); }
  const Layer& layer(int64_t i) const { return *layers_.at(static_cast<size_t>(i)); }

 protected:
  QuantizeOutput forward_kept(const Tensor& x, const Tensor& mask, int64_t last_kept,
                              const QuantizeOptions& opts) override;
  /** The options, for a family method that changes them (ResidualVQ's
   * update_in_forward). */
  Options& mutable_options() { return opts_; }
  const std::vector<std::shared_ptr<Layer>>& layers() const { return layers_; }
  /** Layer q's scale [d] (the level_scales hook), or undefined. */
  Tensor level_scale(int64_t q) const;
  /** Layers after the first quantize with the sum of the earlier ones'
   * outputs as QuantizeOptions::condition (the conditions_layers hook). */
  bool conditions_layers() const;
  /** Every layer's scale [Q, d] (the level_scales hook), or undefined. */
  const Tensor& level_scales() const { return scales_; }

 private:
  struct Planned {
    Options opts;
    StackPlan plan;
  };
  static Planned planned(Options opts);
  ResidualOf(Planned planned, Generator& gen);

  Options opts_;
  StackPlan plan_;
  std::vector<std::shared_ptr<Layer>> layers_;
  std::shared_ptr<Linear> project_in_, project_out_;
  Tensor scales_;       // [Q, d] or undefined: the level_scales hook
  Tensor input_bound_;  // or undefined: the input_bound hook
};

}  // namespace quanta::quant
