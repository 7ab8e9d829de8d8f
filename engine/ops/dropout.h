#pragma once
// Dropout with an explicit Generator (no global random state).
#include "engine/random/generator.h"
#include "engine/tensor.h"

namespace quanta {

/** Inverted dropout: in training, x * mask / (1 - p) with
 * mask = bernoulli(x.shape(), 1 - p, gen) (sampling.h), so the gradient is
 * g * mask / (1 - p). Returns x itself (drawing nothing) when !training or
 * p == 0, and x * 0 (no draw) when p == 1. Needs 0 <= p <= 1 and a floating x. */
Tensor dropout(const Tensor& x, double p, bool training, Generator& gen);

/** linear(dropout(x, p, training, gen), weight) * scale: the same draws
 * (the same elements kept), and values and gradients equal up to the order
 * of their sums and the place of the scale's rounding. In training, for x [..., in] and weight
 * [out, in] of one dtype, f32 or f64, it runs as KernelTable::dropout_product (on the CPU each
 * block of rows dropped and multiplied while in cache, the dropped copy never stored, for f32 with
 * AVX-512 and for f64), the graph keeps x (which other ops keep too: LoRA's input is the frozen
 * layer's input) and, where the device keeps it (KernelTable::dropout_keeps_bits), the mask as
 * bits, and the backward applies the forward's mask again without drawing; `scale` (LoRA's alpha /
 * r) joins the mask's 1 / (1 - p), so it costs no pass of its own either way. Other dtypes,
 * evaluation and p == 0 take the two ops (and a multiplication by scale where it is not 1). */
Tensor dropout_linear(const Tensor& x, const Tensor& weight, double p, bool training,
                      Generator& gen, double scale = 1.0);

}  // namespace quanta
