#pragma once
// ShardedUnits: frozen state split across ranks and gathered just in time.
//
// A "unit" is a module whose forward runs as one piece (a decoder layer).
// Its buffers (for a QLoRA layer: the NF4 codes, their scales and the
// double-quantization state) are laid end to end as bytes, each tensor
// starting on a `granule_bytes` boundary, and cut into N equal shards; rank r
// keeps shard r and the module's own tensors are emptied. Just before the
// unit's forward (a forward hook: Module::ForwardScope) the shards are
// all-gathered and every buffer gets its bytes back in fresh storage; just
// after it the storage is dropped. What an op kept for its backward stays
// alive through the graph (the ops hold their own handles), so without
// recomputation a unit's weights live until its backward; with it
// (quanta::recompute) they are gathered again when the backward reruns the
// forward, and the base's memory per rank is its shard plus a unit or two.
//
// Gathers are byte copies: a gathered unit is the same bytes as the
// unsharded one for any pattern (NaN payloads, signalling NaNs, denormals),
// and the always-on call check of every collective covers them. Since
// boundaries fall on granules, a shard never cuts an NF4 block of up to
// 2 * granule_bytes elements (bitsandbytes' 64 is 32 bytes of codes).
//
// While unit i runs, the unit expected next is gathered on a communication
// thread of its own (one group clone): i + 1 going forward, i - 1 going
// back (a recomputing backward), turning at the ends. A wrong guess costs a
// gather, never a wrong result.
//
// Collective rules: construction, every forward of a unit and unshard() are
// collectives. Every rank must run the same unit forwards in the same order
// (training steps, and evaluations, on every rank), which the guesses then
// follow identically.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dist/process_group.h"
#include "engine/nn/module.h"

namespace quanta::dist {

struct ShardOptions {
  /** Tensor starts and shard boundaries fall on multiples of this. */
  std::size_t granule_bytes = 256;
  /** Gather the next unit on a communication thread while one runs. */
  bool prefetch = true;
};

class ShardedUnits {
 public:
  /** Shards the buffers of the modules of `root` named `units` (dotted
   * paths, e.g. "model.layers.0"; in the order they run forward; none inside
   * another; a unit without buffers is left alone). Collective.
   * Every rank must hold the same units with the same bytes: a difference
   * raises DistError on every rank, naming the first tensors that differ
   * and the ranks that hold them. `group` and `root` must outlive this. */
  ShardedUnits(Module& root, ProcessGroup& group, std::vector<std::string> units,
               ShardOptions options = {});
  /** The one-at-a-time form, for a loader that makes a model a unit at a
   * time (apply_qlora's on_layer_converted): nothing is sharded until
   * shard(unit) is called for each unit, so that a rank never holds more
   * than its shards and the unit being made. Collective. */
  ShardedUnits(Module& root, ProcessGroup& group, ShardOptions options = {});
  /** Shards one more unit of `root` as the list constructor shards each
   * (its bytes checked equal on every rank, then cut), after those before
   * it in forward order. Collective; call it before any unit's forward.
   * Refuses a unit already sharded or nested in one. */
  void shard(const std::string& unit);
  /** The units sharded, in forward order (those without buffers left out). */
  std::vector<std::string> unit_names() const;

  /** Removes the hooks; units still sharded stay empty (unshard() first to
   * keep using the module). */
  ~ShardedUnits();
  ShardedUnits(const ShardedUnits&) = delete;
  ShardedUnits& operator=(const ShardedUnits&) = delete;

  /** Gathers every unit back into its module for good and removes the
   * hooks: the module is whole again (to save or merge it). Collective. */
  void unshard();
  /** False after unshard(). */
  bool sharded() const;

  /** The names of the sharded tensors ("model.layers.0.mlp.up_proj.base.weight"). */
  const std::vector<std::string>& tensor_names() const;
  /** Bytes of the units' buffers in all (what one unsharded rank holds). */
  std::size_t full_bytes() const;
  /** Bytes this rank keeps: its shard of every unit. */
  std::size_t shard_bytes() const;
  /** Bytes gathered so far (the units' bytes, once per gather started, a
   * prefetch still under way included). */
  uint64_t gathered_bytes() const;
  /** Gathers started so far, and how many units were found prefetched when
   * their forward began. */
  uint64_t gathers() const;
  uint64_t prefetch_hits() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace quanta::dist
