#pragma once
// The residual stack every residual quantizer is (SoundStream's algorithm 1):
// layer i quantizes what layers 0..i-1 left, later layers see that residual
// cut from the graph, layers after the quantize-dropout decision give index
// -1 and loss 0, the output is the sum of the kept layers' outputs. Written
// once here, with the dropout decision and its stream; ResidualOf<Layer>
// (quant/residual_of.h) runs it for a family from its LayerTraits, which say
// how one of its layers is made and quantizes and which code an index stands
// for.
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "engine/dtype.h"
#include "engine/nn/module.h"
#include "engine/tensor.h"
#include "quant/quantize_dropout.h"
#include "quant/quantize_output.h"
#include "quant/quantizer.h"
#include "quant/step_stream.h"
#include "quant/token_layout.h"

namespace quanta::quant {

/** How a stack (of layers or of groups) reports its members' losses. */
enum class MemberLosses {
  /** loss and every loss term stacked over members (0 for dropped layers):
   * the VQ family. */
  stacked,
  /** loss stacked over members, loss terms summed over the kept ones: LFQ. */
  summed,
  /** no loss (a scalar 0) and no terms: FSQ. */
  none,
};

/** Loss terms by name, one value per member of a stack: [term][member]. */
using MemberTerms = std::vector<std::pair<std::string, std::vector<Tensor>>>;

/** Sets out.loss and out.losses from the members' `losses` and `terms` as
 * `how` says; `zero` is the loss of no member (dtype and device). */
void combine_member_losses(QuantizeOutput& out, const std::vector<Tensor>& losses,
                           const MemberTerms& terms, MemberLosses how, const Tensor& zero);

/** Layer `layer` of a stack quantizing `residual` (tokens [B, N, d]), given
 * the outputs of the layers before it (`earlier`, in order; what a layer
 * conditioned on the running sum reads): its output in tokens, indices
 * [B, N], loss and loss terms. */
using ResidualLayer = std::function<QuantizeOutput(int64_t layer, const Tensor& residual,
                                                   const std::vector<Tensor>& earlier)>;

/** Runs `num_layers` layers on successive residuals of `tokens` [B, N, d],
 * keeping layers 0..last_kept (kKeepAllLayers: all). Returns the summed
 * output [B, N, d] (add_n: one pass), indices [B, N, Q] of `index_dtype`
 * (-1 for dropped layers) and the losses as `losses` says. Layer i + 1
 * quantizes residual - (grad_frac q_i + (1 - grad_frac) sg(q_i)): with
 * grad_frac 0 (the default) later layers' losses do not reach layer i's
 * output, with 1 fully. */
QuantizeOutput residual_quantize(const Tensor& tokens, int64_t num_layers, int64_t last_kept,
                                 DType index_dtype, MemberLosses losses, const ResidualLayer& layer,
                                 double grad_frac = 0.0);

/** What residual_quantize subtracts from the residual for a layer's output
 * q: its value, carrying grad_frac of the gradient (0: none, a cut). */
Tensor frac_gradient(const Tensor& q, double grad_frac);

/** What a stack outputs at the tokens its mask leaves out. */
struct MaskedOutput {
  /** [B, N] bool, true for valid tokens; undefined: no mask, nothing to do. */
  Tensor keep;
  /** Zeros there; false: the input there, unchanged. */
  bool zeros = true;
};

/** What every stack does around its residual loop: `x` (laid out as
 * `layout` says) to tokens [B, N, D], through `project_in` when there is one,
 * `quantize` on them, its output through `project_out` when there is one,
 * set at masked tokens as `masked` says, and back to x's layout; its indices
 * to x's spatial shape. */
QuantizeOutput quantize_tokens(const TokenLayout& layout, const Tensor& x, Module* project_in,
                               Module* project_out,
                               const std::function<QuantizeOutput(const Tensor&)>& quantize,
                               const MaskedOutput& masked = {});

/** Layer `layer`'s codes [..., d] of valid indices (i64, none negative),
 * given the codes of the layers before it (`earlier`, in order, zeros where
 * an index was -1). */
using ResidualLookup =
    std::function<Tensor(int64_t layer, const Tensor& indices, const std::vector<Tensor>& earlier)>;

/** Per-layer codes [Q, ..., d] of `indices` [..., q] (q <= Q): missing layers
 * and index -1 give zeros. Errors name `who`. */
Tensor residual_codes(const Tensor& indices, int64_t num_layers, const ResidualLookup& lookup,
                      const char* who);

/** Base of the residual quantizers: the dropout decision (QuantizeDropout's
 * rule, from the stream the family seeds) and the Quantizer forward that
 * takes one from outside. */
class Residual : public Quantizer, public StepKeyed {
 public:
  Residual(std::string name, QuantizeDropout dropout);

  /** forward_kept with opts.last_kept, or this layer's own decision. */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask, const QuantizeOptions& opts) override;
  int64_t dropout_decision() override;
  /** The next quantize-dropout draw (advances the stream), whether or not
   * dropout applies. */
  int64_t draw_dropout();
  /** Keys the dropout stream by `step` (see StepStream). */
  void pin_random_step(uint64_t step) override { dropout_stream_.pin(step); }
  const QuantizeDropout& quantize_dropout() const { return dropout_; }
  /** Sets the stream the dropout draws come from (the family seeds it; the
   * `quanta` command keys it by its run seed instead). */
  void seed_dropout(Generator stream) { dropout_stream_ = StepStream(stream); }

 protected:
  /** The forward with the dropout decision made: layers after `last_kept`
   * are dropped (kKeepAllLayers: none). */
  virtual QuantizeOutput forward_kept(const Tensor& x, const Tensor& mask, int64_t last_kept,
                                      const QuantizeOptions& opts) = 0;

 private:
  QuantizeDropout dropout_;
  StepStream dropout_stream_{Generator(0)};
};

}  // namespace quanta::quant
