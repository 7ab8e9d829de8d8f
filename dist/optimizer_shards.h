#pragma once
// The optimizer state of data-parallel training, split across the ranks
// (ZeRO stage 1, with the gradients of the parameters a rank does not own
// dropped before the step): every rank holds the averaged gradients after
// DataParallel's reduction, but each parameter has one owner rank, only the
// owner updates it and keeps its optimizer state (Adam's two moments: twice
// the parameters' bytes), and the updated values are then broadcast from
// the owners. Optimizer updates are per parameter, so the parameters after
// each step are the unsharded optimizer's, bit for bit.
//
//   dist::OptimizerShards shards(group, params);   // params in optimizer order
//   dp.finish_step();                              // gradients averaged
//   clip_grad_norm_(params, 1.0);                  // on the whole gradients
//   shards.drop_unowned_grads();
//   optimizer.step();                              // skips parameters without a gradient
//   shards.broadcast_updates();
//
// Checkpoints keep the ordinary layout: gather_state() rebuilds the whole
// state_dict that an unsharded optimizer would give (a collective), and
// owned_state() cuts a whole one down to this rank's share for
// load_state_dict, so a checkpoint moves between sharded and unsharded
// runs and across world sizes.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dist/data_parallel.h"
#include "dist/process_group.h"
#include "engine/nn/module.h"
#include "engine/tensor.h"

namespace quanta::dist {

class OptimizerShards {
 public:
  /** `params`: the optimizer's parameters, in its order: its groups one
   * after the other, `group_sizes` parameters each (empty: one group). Each
   * gets an owner: contiguous runs balanced by element count (a rank may
   * own none when there are fewer parameters than ranks). */
  OptimizerShards(ProcessGroup& group, std::vector<Tensor> params,
                  std::vector<std::size_t> group_sizes = {});

  /** The owner rank of parameter `i`. */
  int owner(std::size_t i) const { return owners_.at(i); }
  /** The owner of parameter `p` (the same tensor), -1 when it is not one of them. */
  int owner_of(const Tensor& p) const;
  /** Elements of the parameters this rank owns, and of all of them. */
  int64_t owned_elements() const { return owned_elements_; }
  int64_t total_elements() const { return total_elements_; }

  /** Makes `dp` reduce each of these parameters' gradients into its owner
   * (DataParallel::reduce_gradients_to_owners): a rank then never holds the
   * others' averaged gradients. Every rank calls it, between steps. */
  void reduce_gradients_to_owners(DataParallel& dp) const;
  /** clip_grad_norm_ over every rank's share: each owner's per-parameter
   * norms are summed across ranks (each slot has one writer, so the sum is
   * exact), and the total is taken over them in parameter order, as
   * clip_grad_norm_ does over the whole gradients: the same total and the
   * same scaled gradients, bit for bit. Scales this rank's gradients;
   * returns the total norm. A collective. */
  double clip_grad_norm_(double max_norm, double norm_type = 2.0, bool error_if_nonfinite = false);
  /** Drops the gradients of the parameters this rank does not own, so that
   * the optimizer skips them and makes no state for them. Call after the
   * gradients are averaged (and clipped), before the step. */
  void drop_unowned_grads();
  /** Every parameter from its owner after the step: one broadcast per
   * owning rank and dtype. A collective. */
  void broadcast_updates();

  /** The whole optimizer state_dict, as an unsharded optimizer over the same
   * parameters would give it (same keys in the same order, same values),
   * from `mine`, this rank's optimizer's state_dict. A collective; the
   * gathered state is on the CPU. */
  StateDict gather_state(const StateDict& mine);
  /** `whole` (an ordinary optimizer state_dict, from a checkpoint) without
   * the per-parameter state of the parameters this rank does not own. */
  StateDict owned_state(const StateDict& whole) const;

 private:
  /** The parameter index (over all groups) of an optimizer state key
   * "state.{g}.{i}.{name}", or -1 for the keys every rank holds alike
   * (groups.*, hparams.*); throws for a slot these groups lack. */
  int64_t state_param(const std::string& key) const;

  ProcessGroup& group_;
  std::vector<Tensor> params_;
  std::vector<std::size_t> group_sizes_, group_first_;
  std::vector<int> owners_;
  int64_t owned_elements_ = 0;
  int64_t total_elements_ = 0;
};

}  // namespace quanta::dist
