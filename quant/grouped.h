#pragma once
// The grouped form of a residual quantizer (GroupedResidualVQ, -FSQ, -LFQ):
// the features split into G equal chunks, one residual stack per chunk, one
// quantize-dropout decision (group 0's) for all of them, the outputs
// concatenated and the indices stacked. Written once here over the Quantizer
// interface; GroupedOf<Layer> (quant/grouped_of.h) builds a family's groups.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/tensor.h"
#include "quant/quantize_output.h"
#include "quant/quantizer.h"
#include "quant/residual.h"

namespace quanta::quant {

/** How a grouped quantizer reads its input. */
struct GroupedLayout {
  /** Input feature size; each group gets dim / groups. */
  int64_t dim = 0;
  int64_t groups = 1;
  /** [B, N, D]; false: [B, D, N]. Rank >= 4 inputs are feature maps. */
  bool channel_last = true;
  /** Accept feature maps [B, D, H, W...] (else they are an error). */
  bool accept_image_fmap = true;
  /** How the groups' losses combine (as their layers' do). */
  MemberLosses losses = MemberLosses::stacked;
};

class Grouped : public Quantizer {
 public:
  /** Checks that dim is a positive multiple of groups; errors name `name`.
   * The groups are added by the family's constructor (add_group). */
  Grouped(std::string name, GroupedLayout layout);

  /** Concatenated group outputs in the input's layout; indices
   * [G, B, spatial..., Q]; loss stacked over groups ([G, ...], a scalar 0
   * for losses none), loss terms stacked or summed over groups. One dropout
   * decision for every group: opts.last_kept, else group 0's. */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask, const QuantizeOptions& opts) override;
  /** [G, Q, ..., d] from indices [G, ..., q]. */
  Tensor get_codes_from_indices(const Tensor& indices) override;
  /** [..., dim]: each group's output, concatenated. */
  Tensor get_output_from_indices(const Tensor& indices) override;
  int64_t num_quantizers() const override { return groups_.front()->num_quantizers(); }
  int64_t codebook_size() const override { return groups_.front()->codebook_size(); }
  /** groups x layers. */
  int64_t num_codebooks() const override { return groups() * groups_.front()->num_codebooks(); }
  int64_t dropout_decision() override { return groups_.front()->dropout_decision(); }

  int64_t groups() const { return static_cast<int64_t>(groups_.size()); }
  /** Group `g`'s residual stack ("rvqs.<g>"). */
  Quantizer& group(int64_t g) { return *groups_.at(static_cast<size_t>(g)); }

 protected:
  /** Registers the next group as "rvqs.<g>". */
  void add_group(std::shared_ptr<Quantizer> group);
  const GroupedLayout& layout() const { return layout_; }

 private:
  std::vector<Tensor> per_group(const Tensor& indices, bool output);

  GroupedLayout layout_;
  std::shared_ptr<Module> list_;
  std::vector<std::shared_ptr<Quantizer>> groups_;
};

}  // namespace quanta::quant
