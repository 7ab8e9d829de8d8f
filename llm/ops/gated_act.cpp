#include "llm/ops/gated_act.h"

#include <stdexcept>
#include <string>

#include "engine/autograd/grad_mode.h"
#include "engine/autograd/node.h"
#include "engine/dispatch.h"
#include "engine/factory.h"
#include "llm/kernels/table.h"

namespace quanta::llm {

Tensor gated_activation(const Tensor& gate, const Tensor& up, GatedAct act) {
  if (!gate.defined() || !up.defined())
    throw std::invalid_argument("[gated_activation] needs defined gate and up tensors");
  if (gate.shape() != up.shape() || gate.dtype() != up.dtype() || gate.device() != up.device())
    throw std::invalid_argument(
        "[gated_activation] gate and up must share shape, dtype and device: got " +
        shape_str(gate.shape()) + " " + dtype_name(gate.dtype()) + " on " + gate.device().str() +
        " and " + shape_str(up.shape()) + " " + dtype_name(up.dtype()) + " on " +
        up.device().str());
  if (!is_floating(gate.dtype()))
    quanta::detail::bad_dtype("gated_activation", gate.dtype(), "expected a floating dtype");
  const Tensor gc = gate.detach().contiguous(), uc = up.detach().contiguous();
  const LlmKernelTable& k = llm_kernels_for("gated_activation", {&gc, &uc});
  const TensorOptions opts{.dtype = gc.dtype(), .device = gc.device()};
  Tensor out = empty(gc.shape(), opts);
  k.gated_act(gc.dtype(), act, gc.raw_data(), uc.raw_data(), gc.numel(), out.raw_data());
  const bool need_gate = gate.requires_grad(), need_up = up.requires_grad();
  // The graph keeps gate, and up only when gate's gradient needs it.
  return autograd::record(
      "gated_activation", out, {gate, up},
      [gc, uc = need_gate ? uc : Tensor(), opts, act, need_gate, need_up](const Tensor& g) {
        const Tensor gg = g.to(gc.dtype()).contiguous();
        const LlmKernelTable& kg = llm_kernels_for("gated_activation backward", {&gc, &gg});
        Tensor d_gate = need_gate ? empty(gc.shape(), opts) : Tensor();
        Tensor d_up = need_up ? empty(gc.shape(), opts) : Tensor();
        kg.gated_act_grad(gc.dtype(), act, gc.raw_data(), need_gate ? uc.raw_data() : nullptr,
                          gg.raw_data(), gc.numel(), need_gate ? d_gate.raw_data() : nullptr,
                          need_up ? d_up.raw_data() : nullptr);
        return std::vector<Tensor>{d_gate, d_up};
      });
}

}  // namespace quanta::llm
