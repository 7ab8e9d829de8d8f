#include "llm/ops/swiglu.h"

#include <stdexcept>
#include <string>

#include "engine/autograd/grad_mode.h"
#include "engine/autograd/node.h"
#include "engine/dispatch.h"
#include "engine/ops/elementwise.h"

namespace quanta::llm {

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  if (!gate.defined() || !up.defined())
    throw std::invalid_argument("[swiglu] needs defined gate and up tensors");
  if (gate.shape() != up.shape() || gate.dtype() != up.dtype() || gate.device() != up.device())
    throw std::invalid_argument("[swiglu] gate and up must share shape, dtype and device: got " +
                                shape_str(gate.shape()) + " " + dtype_name(gate.dtype()) + " on " +
                                gate.device().str() + " and " + shape_str(up.shape()) + " " +
                                dtype_name(up.dtype()) + " on " + up.device().str());
  if (!is_floating(gate.dtype()))
    quanta::detail::bad_dtype("swiglu", gate.dtype(), "expected a floating dtype");
  Tensor out;
  {
    NoGradGuard no_grad;
    out = mul(silu(gate), up);
  }
  const bool need_gate = gate.requires_grad(), need_up = up.requires_grad();
  // The formulas of mul's and silu's backward, in their order, so the bits
  // match the two ops': d up = g silu(gate), d gate = (g up) s (1 + gate (1 - s))
  // with s = sigmoid(gate).
  return autograd::record("swiglu", out, {gate, up},
                          [gate = gate.detach(), up = need_gate ? up.detach() : Tensor(), need_gate,
                           need_up](const Tensor& g) {
                            Tensor d_gate, d_up;
                            if (need_up) d_up = mul(g, silu(gate));
                            if (need_gate) {
                              const Tensor s = sigmoid(gate);
                              d_gate = mul(mul(g, up), s * (1.0 + gate * (1.0 - s)));
                            }
                            return std::vector<Tensor>{d_gate, d_up};
                          });
}

}  // namespace quanta::llm
