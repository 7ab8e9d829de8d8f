#pragma once
// Distributed-correct quantizer state (docs/design.md "Distributed rules").
//
// A QuantizerSync takes every quantizer layer inside a module tree into
// distributed mode and is the ONE point per optimizer step where their
// cross-rank state is reconciled:
//
//   auto sync = quant::QuantizerSync(model, *group);   // every rank, no collective
//   dist::DataParallel dp(model, *group);
//   sync.attach(dp);                                    // sync_state() in finish_step()
//   for (...) {
//     loss = ...; loss.backward();
//     dp.finish_step();     // gradients, then sync_state(): EMA, dead codes, k-means
//     opt.step(); opt.zero_grad();
//   }
//
// What distributed mode changes in each layer (no collective in a VQ
// forward, deferred global k-means, LFQ's cross-rank token means, step-pinned
// random streams, affine statistics): docs/distributed_quantizers.md.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dist/data_parallel.h"
#include "dist/process_group.h"
#include "engine/nn/module.h"

namespace quanta::quant {

class Codebook;
class StepKeyed;

class QuantizerSync {
 public:
  /** Puts every quantizer layer inside `module` (the module itself
   * included) into distributed mode on `group`. Issues no collective; every
   * rank must build the same module tree. `group` and `module` must outlive
   * this object. Throws std::invalid_argument when `module` is null. */
  QuantizerSync(std::shared_ptr<Module> module, dist::ProcessGroup& group);

  /** The reconciliation point, on every rank once per optimizer step (after
   * the step's forwards, before the next ones). Collectives, in this order:
   * (1) for each codebook awaiting k-means, one all_gather_v of samples per
   * table and pool slot (a codebook shared by L levels has L slots, one per
   * call: the pools hold every rank's rows call by call, as one process
   * holds the whole batch's); (2) when some codebook is initialised, ONE fused all_reduce(sum)
   * carrying a small header (every rank's forward count and candidate row
   * counts, scattered so that the sum gathers them), every initialised
   * codebook's counts, token totals, affine statistics and EMA sums (zeros
   * from a rank that accumulated none); (3) when some codebook has dead-code
   * expiry on and some rank holds candidate rows, one all_reduce(sum) of
   * replacement rows (every code's, applied where the reduced cluster sizes
   * show it expired). Each condition is the same on every rank
   * (initialisation is global, the candidate counts travel in the header),
   * so the ranks always issue the same sequence, whatever forwards each of
   * them ran. The steady state is one collective per step, two with expiry.
   * Host reads: with several ranks, one per step (the header, after the
   * fused all_reduce: forward counts and candidate counts size the EMA
   * decay and the replacement pool); with one rank, none. Which codes
   * expire and which rows replace them are decided on the device.
   * Then the step count advances and the layers' random streams are pinned
   * to it. Throws std::invalid_argument (before any collective) when the
   * codebooks are not all on one device. */
  void sync_state();

  /** Runs sync_state() at the end of every DataParallel::finish_step(). */
  void attach(dist::DataParallel& dp);

  /** Reconciliations so far (the key of this step's random draws). */
  uint64_t step() const { return step_; }
  /** Restores the step count (resuming from a checkpoint) and re-pins. */
  void set_step(uint64_t step);
  /** The distinct codebooks found, in traversal order. */
  std::size_t num_codebooks() const { return codebooks_.size(); }

 private:
  // Every rank's per-codebook [forwards, candidate rows per table and pool
  // slot...]
  // (local_header() holds this rank's row alone until the fused all_reduce
  // gathers the others).
  struct Header {
    std::vector<int64_t> values;  // [world * width]
    std::vector<int64_t> offset;  // per codebook, into one rank's block
    int64_t width = 0;
    int world = 1;
    int64_t max_steps(int64_t codebook) const;
    // Candidate rows of `rank` in pool slot `slot` of `slots` (the codebook's
    // calls_per_forward()).
    int64_t candidates(int rank, int64_t codebook, int64_t table, int64_t slot,
                       int64_t slots) const;
  };
  Header local_header() const;
  void pin_streams();

  // sync_state()'s steps, in order. What every step decides is the same on
  // every rank, so the ranks issue the same collectives.
  struct Reconciliation {
    std::vector<bool> reduce;       // per codebook: initialised, so its statistics reconcile
    DType wide = DType::f32;        // the widest dtype among them carries the fused buffers
    Device device = Device::cpu();  // the codebooks' one device
  };
  /** Throws std::invalid_argument (before any collective) when the codebooks
   * are on more than one device. */
  Reconciliation plan_reconciliation() const;
  /** (1) k-means for every codebook awaiting it, on every rank's samples. */
  void init_awaiting_codebooks();
  /** (2) The fused all_reduce of the header and the statistics, then each
   * codebook's EMA step; fills `header` with every rank's row. */
  void reduce_statistics(const Reconciliation& plan, Header& header);
  /** (3) Dead-code replacement: the all_reduce of replacement rows, when
   * expiry is on and the pool is not empty. */
  void replace_dead_codes(const Reconciliation& plan, const Header& header);
  // Codebook `index`'s replacement rows as this rank holds them, per table:
  // [K, D], a code's drawn row where this rank holds it, zeros elsewhere;
  // undefined for a table whose pool is empty on every rank.
  std::vector<Tensor> pick_replacements(Codebook& cb, int64_t index, const Header& header);

  std::shared_ptr<Module> module_;
  dist::ProcessGroup& group_;
  std::vector<Codebook*> codebooks_;
  std::vector<StepKeyed*> streams_;
  uint64_t step_ = 0;
  // The fused all_reduce buffers, kept between steps (see Fused).
  Tensor staging_, replacement_staging_;
};

}  // namespace quanta::quant
