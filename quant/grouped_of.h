#pragma once
// GroupedOf<Layer>: the grouped form of a family's residual stack, made from
// its LayerTraits (quant/layer_traits.h) over the one grouped wrapper
// (quant/grouped.h): the features split into equal chunks, one stack `Stack`
// per chunk, built one after another from the generator.
#include <cstdint>
#include <memory>

#include "engine/random/generator.h"
#include "quant/grouped.h"
#include "quant/layer_traits.h"
#include "quant/residual_of.h"

namespace quanta::quant {

template <class Layer, class Stack = ResidualOf<Layer>>
class GroupedOf : public Grouped {
 public:
  using Traits = LayerTraits<Layer>;
  using Options = typename Traits::GroupedOptions;

  /** Groups "rvqs.<g>", each a Stack of Traits::group_options(opts). */
  GroupedOf(const Options& opts, Generator& gen) : Grouped(Traits::grouped_name, layout_of(opts)) {
    for (int64_t g = 0; g < layout().groups; ++g)
      add_group(std::make_shared<Stack>(Traits::group_options(opts), gen));
  }

  /** forward(x, mask, {}). */
  QuantizeOutput forward(const Tensor& x, const Tensor& mask) {
    return forward(x, mask, QuantizeOptions{});
  }
  using Grouped::forward;

  /** Group `g`'s stack. */
  Stack& group(int64_t g) { return static_cast<Stack&>(Grouped::group(g)); }

 private:
  static GroupedLayout layout_of(const Options& opts) {
    GroupedLayout layout = Traits::grouped_layout(opts);
    layout.losses = Traits::losses;
    return layout;
  }
};

}  // namespace quanta::quant
