#pragma once
// Differentiable collectives (docs/design.md rule 4: gradients cross ranks only
// through these or DataParallel).
//
// Convention, as PyTorch's torch.distributed.nn: the objective is the SUM of
// every rank's loss, L = sum_r L_r. Each collective's backward is therefore
// its adjoint: all_reduce(sum) <-> all_reduce(sum) of the gradients,
// all_gather <-> reduce_scatter(sum), all_gather_v <-> sum then slice,
// broadcast <-> reduce(sum) to the root (other ranks get zero), reduce_scatter
// <-> all_gather. Under DataParallel, which averages gradients over N ranks,
// a term computed from a global statistic then gets exactly the
// single-process gradient (for equal local batches; use global_mean with
// uneven ones).
//
// These are collectives: every rank must call them in the same order, and
// backward runs the adjoint collective on every rank, so every rank must
// also run backward through them. The group must outlive the graph.
#include "dist/process_group.h"

namespace quanta::dist::fn {

/** Sum or average of `x` over ranks (a new tensor); min, max and prod have
 * no simple gradient and are refused. */
Tensor all_reduce(ProcessGroup& g, const Tensor& x, ReduceOp op = ReduceOp::sum);
/** Every rank's `x` concatenated on dim 0: [N * d0, ...]; backward sums the
 * gradients over ranks and keeps this rank's block (reduce_scatter). */
Tensor all_gather(ProcessGroup& g, const Tensor& x);
/** all_gather with a per-rank dim 0 (zero allowed); backward sums over ranks
 * and slices this rank's rows. */
Tensor all_gather_v(ProcessGroup& g, const Tensor& x);
/** Block r of the sum (or avg) over ranks of `x` ([N * m, ...] -> [m, ...]);
 * backward all-gathers the gradients (divided by N for avg). */
Tensor reduce_scatter(ProcessGroup& g, const Tensor& x, ReduceOp op = ReduceOp::sum);
/** `x` of rank `root` on every rank; backward sums the gradients on the root
 * (other ranks' inputs get zero gradient). */
Tensor broadcast(ProcessGroup& g, const Tensor& x, int root);
/** Token-weighted mean across ranks: (sum over ranks of `sum`) / (sum over
 * ranks of `count`), with the gradient of that global mean flowing into
 * `sum`. `count` (any numeric scalar, no gradient) is this rank's number of
 * items; a global count of zero gives zeros, never NaN. */
Tensor global_mean(ProcessGroup& g, const Tensor& sum, const Tensor& count);
/** global_mean with this rank's count known on the host. On one rank it is
 * sum / max(count, 1) by one division (the same bits), where a count tensor
 * costs a fill, a clamp and a cast before it: three launches a call. */
Tensor global_mean(ProcessGroup& g, const Tensor& sum, int64_t count);

}  // namespace quanta::dist::fn
