#include "quant/sync/quantizer_sync.h"

#include <algorithm>
#include <stdexcept>
#include <unordered_set>

#include "dist/functional.h"
#include "engine/autograd/grad_mode.h"
#include "engine/autograd/node.h"
#include "engine/capture/device_graph.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/join.h"
#include "engine/ops/reductions.h"
#include "engine/ops/view.h"
#include "quant/hierarchical/hierarchical_vq.h"
#include "quant/scalar/lfq.h"
#include "quant/step_stream.h"
#include "quant/vq/codebook.h"
#include "quant/vq/residual_vq.h"
#include "quant/vq/vector_quantize.h"

namespace quanta::quant {
namespace {

// Tensors packed into one flat buffer for one all_reduce(sum), then read
// back in the order they were added. An undefined tensor (a rank without
// those statistics) is sent as zeros of its declared shape. The buffer is
// the caller's `staging` tensor, kept across steps and reused while its size
// and dtype match and nothing else holds it: no fresh pages to fault in per
// step (costly on virtual machines) and no temporaries for the parts.
class Fused {
 public:
  Fused(DType dtype, Device device, Tensor& staging)
      : dtype_(dtype), device_(device), flat_(staging) {}

  void add(const Tensor& t, const Shape& shape) {
    parts_.push_back(t);
    shapes_.push_back(shape);
  }
  /** The all_reduce; false (and no collective) when nothing was added. */
  bool reduce(dist::ProcessGroup& group) {
    if (parts_.empty()) return false;
    int64_t total = 0;
    for (const Shape& shape : shapes_) total += numel_of(shape);
    if (!autograd::sole_owner(flat_) || flat_.numel() != total || flat_.dtype() != dtype_ ||
        flat_.device() != device_)
      flat_ = empty({total}, {.dtype = dtype_, .device = device_});
    // Copies either way: the buffer must not alias the pending statistics.
    // Converted on the source's device, then moved (copies across devices
    // take equal dtypes): the header block is made on the CPU in f64.
    std::vector<Tensor> pieces;
    for (std::size_t i = 0; i < parts_.size(); ++i) {
      const int64_t numel = numel_of(shapes_[i]);
      if (!parts_[i].defined()) {
        pieces.push_back(zeros({numel}, {.dtype = dtype_, .device = device_}));
        continue;
      }
      const Tensor src = to_dtype(reshape(parts_[i], {numel}), dtype_);
      pieces.push_back(src.device() == device_ ? src : src.to(device_));
    }
    quanta::detail::copy_pieces(flat_, 0, pieces);
    parts_.clear();
    // Nothing to move (e.g. expired codes but no candidate anywhere): the
    // shapes are the same on every rank, so every rank skips alike.
    if (total > 0) group.all_reduce(flat_, dist::ReduceOp::sum);
    return true;
  }
  /** The next reduced tensor, in `dtype` (a view of the buffer when the
   * dtype matches: consume it before the next reduce). */
  Tensor take(DType dtype) {
    const Shape& shape = shapes_.at(next_++);
    const int64_t numel = numel_of(shape);
    Tensor t = to_dtype(reshape(slice(flat_, 0, at_, at_ + numel), shape), dtype);
    at_ += numel;
    return t;
  }

 private:
  DType dtype_;
  Device device_;  // the same on every rank (the codebooks'), never the data's
  Tensor& flat_;
  std::vector<Tensor> parts_;
  std::vector<Shape> shapes_;
  int64_t at_ = 0;
  std::size_t next_ = 0;
};

// Table `table`'s rows from the calls in pool slot `slot` of `per_table`
// (pending().candidates or init_samples: one block per call of the
// codebook): the calls whose index is `slot` modulo calls_per_forward(), in
// call order. [0, D] when there are none.
Tensor slot_rows(const Codebook& cb, const std::vector<std::vector<Tensor>>& per_table,
                 int64_t table, int64_t slot) {
  const int64_t period = cb.calls_per_forward();
  if (period == 1) return cb.table_rows(per_table, table);
  std::vector<Tensor> blocks;
  const auto t = static_cast<std::size_t>(table);
  if (t < per_table.size())
    for (std::size_t k = static_cast<std::size_t>(slot); k < per_table[t].size();
         k += static_cast<std::size_t>(period))
      blocks.push_back(per_table[t][k]);
  return cb.table_rows({blocks}, 0);
}

// Whether a codebook's pending statistics are as a reconciliation leaves
// them: nothing held.
bool cleared(const CodebookStatistics& p) {
  return p.steps == 0 && !p.counts.defined() && !p.sums.defined() && !p.tokens.defined() &&
         p.candidates.empty() && p.init_samples.empty() && !p.affine_count.defined() &&
         !p.affine_sum.defined() && !p.affine_sumsq.defined();
}

}  // namespace

QuantizerSync::QuantizerSync(std::shared_ptr<Module> module, dist::ProcessGroup& group)
    : module_(std::move(module)), group_(group) {
  if (!module_) throw std::invalid_argument("[QuantizerSync] module is null");
  std::unordered_set<Codebook*> seen;
  dist::ProcessGroup* g = &group_;
  for (auto& [path, m] : module_->named_modules()) {
    if (auto* vq = dynamic_cast<VectorQuantize*>(m)) {
      vq->set_update_in_forward(false);
      vq->batch_mean = [g](const Tensor& sum, const Tensor& count) {
        Tensor total = count.detach().clone();
        g->all_reduce(total);
        return local_batch_mean(dist::fn::all_reduce(*g, sum), total);
      };
    }
    if (auto* rvq = dynamic_cast<ResidualVQ*>(m)) rvq->set_update_in_forward(false);
    // A HierarchicalVQ's levels are VectorQuantize layers (turned off just
    // above when the traversal reaches them), and in its default mode a shared
    // codebook applies each level's EMA step inside the forward, before the
    // next level. Switching the layer itself keeps that off even if it is
    // reached first or its levels stop being plain submodules: every level's
    // statistics stay pending for the fused all_reduce of sync_state().
    if (auto* hvq = dynamic_cast<HierarchicalVQ*>(m)) hvq->set_update_in_forward(false);
    if (auto* lfq = dynamic_cast<LFQ*>(m))
      lfq->token_mean = [g](const Tensor& sum, int64_t count) {
        return dist::fn::global_mean(*g, sum, count);
      };
    if (auto* cb = dynamic_cast<Codebook*>(m))
      if (seen.insert(cb).second) codebooks_.push_back(cb);
    if (auto* s = dynamic_cast<StepKeyed*>(m)) streams_.push_back(s);
  }
  pin_streams();
}

void QuantizerSync::pin_streams() {
  for (StepKeyed* s : streams_) s->pin_random_step(step_);
}

void QuantizerSync::set_step(uint64_t step) {
  step_ = step;
  pin_streams();
}

void QuantizerSync::attach(dist::DataParallel& dp) {
  dp.add_step_hook([this](dist::ProcessGroup&) { sync_state(); });
}

QuantizerSync::Header QuantizerSync::local_header() const {
  Header h;
  for (Codebook* cb : codebooks_) {
    const CodebookOptions& o = cb->options();
    h.offset.push_back(int64_t(h.values.size()));
    const CodebookStatistics& p = cb->pending();
    const auto period = static_cast<std::size_t>(cb->calls_per_forward());
    h.values.push_back(p.steps);
    for (int64_t t = 0; t < o.num_codebooks; ++t) {
      std::vector<int64_t> rows(period, 0);  // per pool slot
      if (t < static_cast<int64_t>(p.candidates.size()))
        for (std::size_t k = 0; k < p.candidates[size_t(t)].size(); ++k)
          rows[k % period] += p.candidates[size_t(t)][k].size(0);
      h.values.insert(h.values.end(), rows.begin(), rows.end());
    }
  }
  h.width = int64_t(h.values.size());
  h.world = group_.size();
  return h;
}

namespace {
// The header travels inside the fused all_reduce(sum) as a [world, width]
// block that is zero except this rank's row: the sum is an all_gather, and
// an exact one, since every other term is zero. Each (non-negative) value is
// split into three 21-bit pieces, whole numbers that f32 and f64 both hold
// exactly, so any int64 count survives whatever the codebook dtype.
constexpr int kPieces = 3;
constexpr int64_t kPieceBits = 21;
constexpr int64_t kPieceMask = (int64_t(1) << kPieceBits) - 1;

Tensor scatter_header_row(const std::vector<int64_t>& row, int rank, int world) {
  std::vector<double> block(row.size() * kPieces * static_cast<std::size_t>(world), 0.0);
  double* mine = block.data() + row.size() * kPieces * static_cast<std::size_t>(rank);
  for (std::size_t i = 0; i < row.size(); ++i)
    for (int k = 0; k < kPieces; ++k)
      mine[i * kPieces + size_t(k)] = double((row[i] >> (kPieceBits * k)) & kPieceMask);
  return from_vector<double>(block, {int64_t(block.size())});
}

std::vector<int64_t> gather_header_rows(const Tensor& reduced) {
  const std::vector<double> pieces = reduced.to_vector<double>();
  std::vector<int64_t> values(pieces.size() / kPieces);
  for (std::size_t i = 0; i < values.size(); ++i)
    for (int k = 0; k < kPieces; ++k)
      values[i] |= int64_t(pieces[i * kPieces + size_t(k)]) << (kPieceBits * k);
  return values;
}
}  // namespace

int64_t QuantizerSync::Header::max_steps(int64_t codebook) const {
  int64_t most = 0;
  for (int r = 0; r < world; ++r)
    most = std::max(most, values[size_t(r * width + offset[size_t(codebook)])]);
  return most;
}

int64_t QuantizerSync::Header::candidates(int rank, int64_t codebook, int64_t table, int64_t slot,
                                          int64_t slots) const {
  return values[size_t(rank * width + offset[size_t(codebook)] + 1 + table * slots + slot)];
}

namespace {
// Where this rank's rows of one pool slot lie: pool positions
// [pool_begin, pool_begin + rows), rows [local_begin, ...) of its own.
struct HeldRange {
  int64_t pool_begin = 0, local_begin = 0, rows = 0;
};

// The replacement rows this rank holds: row c is the pool row `positions[c]`
// (of a pool of `pool` rows) where this rank holds it (in one of `ranges`,
// rows of `local`), zero elsewhere, so that the sum over ranks is every
// code's drawn row.
Tensor held_rows(const Tensor& positions, const Tensor& local, const std::vector<HeldRange>& ranges,
                 int64_t pool, int64_t dim, const TensorOptions& like) {
  const int64_t k = positions.numel();
  if (local.size(0) == 0) return zeros({k, dim}, like);
  // This rank holds the whole pool in one range (a single rank's one slot):
  // a position is its local row as it is (-1 where nothing was drawn).
  const bool whole_pool = ranges.size() == 1 && ranges[0].pool_begin == 0 &&
                          ranges[0].local_begin == 0 && ranges[0].rows == pool &&
                          local.size(0) == pool;
  Tensor at = whole_pool ? positions : constant_like(positions, -1.0);  // -1: held elsewhere
  if (!whole_pool)
    for (const HeldRange& r : ranges) {
      if (r.rows == 0) continue;
      const Tensor offset = positions - double(r.pool_begin);
      const Tensor in = logical_and(ge(offset, constant_like(offset, 0.0)),
                                    lt(offset, constant_like(offset, double(r.rows))));
      at = where(in, offset + double(r.local_begin), at);
    }
  const Tensor held = ge(at, constant_like(at, 0.0));
  const Tensor rows = index_select(local, 0, where(held, at, constant_like(at, 0.0)));
  return where(unsqueeze(held, -1), rows, shared_full({}, 0.0, like));
}
}  // namespace

std::vector<Tensor> QuantizerSync::pick_replacements(Codebook& cb, int64_t index,
                                                     const Header& header) {
  const int world = group_.size(), rank = group_.rank();
  const int64_t slots = cb.calls_per_forward();
  // Every rank's candidate counts came with the header: the pool is, slot
  // by slot (a codebook's calls in a forward), every rank's rows in rank
  // order, and every rank draws the same positions. This rank's rows are
  // its slots' rows in slot order.
  std::vector<int64_t> pool_sizes;
  std::vector<std::vector<HeldRange>> held;
  for (int64_t h = 0; h < cb.options().num_codebooks; ++h) {
    int64_t total = 0, local = 0;
    std::vector<HeldRange> ranges;
    for (int64_t j = 0; j < slots; ++j)
      for (int r = 0; r < world; ++r) {
        const int64_t n = header.candidates(r, index, h, j, slots);
        if (r == rank) {
          ranges.push_back({total, local, n});
          local += n;
        }
        total += n;
      }
    pool_sizes.push_back(total);
    held.push_back(std::move(ranges));
  }
  const std::vector<Tensor> positions = cb.draw_replacements(pool_sizes);
  std::vector<Tensor> rows;
  for (int64_t h = 0; h < cb.options().num_codebooks; ++h) {
    const Tensor& pos = positions[size_t(h)];
    if (!pos.defined()) {
      rows.emplace_back();
      continue;
    }
    std::vector<Tensor> local;
    for (int64_t j = 0; j < slots; ++j)
      local.push_back(slot_rows(cb, cb.pending().candidates, h, j));
    rows.push_back(held_rows(pos, slots == 1 ? local[0] : cat(local), held[size_t(h)],
                             pool_sizes[size_t(h)], cb.options().dim, options_of(cb.embed())));
  }
  return rows;
}

namespace {

// A codebook's pending statistics, in the fused buffer's order: folded counts
// and token totals, affine_param batch statistics, folded sums. A rank
// without statistics sends zeros.
void add_statistics(Fused& bulk, const Codebook& cb) {
  const CodebookOptions& o = cb.options();
  const CodebookStatistics& p = cb.pending();
  const int64_t g = o.num_codebooks, d = o.dim;
  bulk.add(p.counts, {g, o.codebook_size});
  bulk.add(p.tokens, {g});
  if (o.affine_param) {
    bulk.add(p.affine_count, {g});
    bulk.add(p.affine_sum, {g, 1, d});
    bulk.add(p.affine_sumsq, {g, 1, d});
  }
  bulk.add(p.sums, {g, o.codebook_size, d});
}

// Takes back what add_statistics sent, reduced, and applies it: affine
// statistics first, as in a forward, then the EMA step over `steps`
// forwards (the most any rank ran: a rank with an extra forward folded its
// counts one decay step further).
void apply_reduced_statistics(Fused& bulk, Codebook& cb, int64_t steps) {
  const DType dt = cb.embed().dtype();
  CodebookStatistics& p = cb.pending();
  p.counts = bulk.take(dt);
  p.tokens = bulk.take(dt);
  if (cb.options().affine_param) {
    p.affine_count = bulk.take(dt);
    p.affine_sum = bulk.take(dt);
    p.affine_sumsq = bulk.take(dt);
    cb.apply_affine_update();
  }
  p.sums = bulk.take(dt);
  p.steps = steps;
  if (p.steps == 0) {  // no forward on any rank: nothing to apply
    p = CodebookStatistics{};
    return;
  }
  cb.apply_cluster_ema();
  cb.apply_embed_ema();
}

}  // namespace

void QuantizerSync::sync_state() {
  NoGradGuard no_grad;
  const Reconciliation plan = plan_reconciliation();
  init_awaiting_codebooks();
  Header header = local_header();
  reduce_statistics(plan, header);
  replace_dead_codes(plan, header);
  ++step_;
  pin_streams();
  if (capture_open()) {
    // Inside a captured training step (engine/capture/device_graph.h) each
    // replay is one more reconciliation: its device work replays, and its
    // host part is made again here: the statistics handles the step's
    // forwards left (set again by their own hooks) applied and cleared, the
    // count advanced and the streams pinned to it.
    for (Codebook* cb : codebooks_)
      if (!cleared(cb->pending()))
        throw std::logic_error(
            "[QuantizerSync] a codebook keeps statistics after a captured reconciliation "
            "(k-means still awaited?): a replay could not repeat it");
    on_replay([this] {
      for (Codebook* cb : codebooks_) cb->pending() = CodebookStatistics{};
      ++step_;
      pin_streams();
    });
  }
}

QuantizerSync::Reconciliation QuantizerSync::plan_reconciliation() const {
  const std::size_t n = codebooks_.size();
  Reconciliation plan;
  // Which codebooks reconcile statistics: the initialised ones, the same on
  // every rank (initialisation is global). Decided before the k-means of
  // init_awaiting_codebooks(), whose statistics were taken against the zero
  // codes and mean nothing.
  plan.reduce.assign(n, false);
  for (std::size_t i = 0; i < n; ++i) {
    plan.reduce[i] = codebooks_[i]->initted();
    if (plan.reduce[i] && codebooks_[i]->embed().dtype() == DType::f64) plan.wide = DType::f64;
  }
  plan.device = n > 0 ? codebooks_[0]->embed().device() : Device::cpu();
  for (std::size_t i = 1; i < n; ++i)
    if (codebooks_[i]->embed().device() != plan.device)
      throw std::invalid_argument("[QuantizerSync::sync_state] codebooks on " + plan.device.str() +
                                  " and " + codebooks_[i]->embed().device().str() +
                                  ": reconciliation fuses them into one buffer; keep the "
                                  "quantizers on one device");
  return plan;
}

void QuantizerSync::init_awaiting_codebooks() {
  // Deferred k-means on the pooled samples of every rank: slot by slot (a
  // codebook's calls in a forward), every rank's rows in rank order, which is
  // one process's order on the whole batch. The same pool, hence the same
  // codes, on every rank; one all_gather_v per table and slot.
  for (Codebook* cb : codebooks_) {
    if (cb->initted()) continue;
    std::vector<Tensor> pools;
    for (int64_t h = 0; h < cb->options().num_codebooks; ++h) {
      std::vector<Tensor> slots;
      for (int64_t j = 0; j < cb->calls_per_forward(); ++j)
        slots.push_back(group_.all_gather_v(slot_rows(*cb, cb->pending().init_samples, h, j)));
      pools.push_back(slots.size() == 1 ? slots[0] : cat(slots));
    }
    cb->pending() = CodebookStatistics{};
    cb->init_from_samples(pools);
  }
}

void QuantizerSync::reduce_statistics(const Reconciliation& plan, Header& header) {
  // One fused all_reduce(sum), whatever the data: the header (every rank's
  // forward count and candidate rows per codebook, as a scattered block),
  // then every reconciled codebook's statistics.
  // One rank's header is its own: no block, and no read of the device.
  const bool gather_header = header.world > 1;
  Fused bulk(plan.wide, plan.device, staging_);
  if (gather_header &&
      std::find(plan.reduce.begin(), plan.reduce.end(), true) != plan.reduce.end()) {
    const Tensor block = scatter_header_row(header.values, group_.rank(), header.world);
    bulk.add(block, block.shape());
  }
  for (std::size_t i = 0; i < codebooks_.size(); ++i)
    if (plan.reduce[i]) add_statistics(bulk, *codebooks_[i]);
  if (!bulk.reduce(group_)) return;
  if (gather_header) header.values = gather_header_rows(bulk.take(DType::f64));
  for (std::size_t i = 0; i < codebooks_.size(); ++i)
    if (plan.reduce[i])
      apply_reduced_statistics(bulk, *codebooks_[i], header.max_steps(int64_t(i)));
}

void QuantizerSync::replace_dead_codes(const Reconciliation& plan, const Header& header) {
  // Which codes expire follows from the reduced cluster sizes, identical on
  // every rank, and is decided on the device: nothing here reads it back.
  // The replacements are drawn from the pool of every rank's candidates in
  // rank order (what one process would hold for the whole batch) without
  // moving the pool: the header carried the candidate counts, the
  // codebook's stream picks a pool position for every code (the same on
  // every rank), and each picked row is contributed by the rank that holds
  // it and zero elsewhere (an exact sum), in one all_reduce for every
  // codebook. It runs whenever expiry is on and some rank holds candidates,
  // known from the header alike on every rank, whether or not a code
  // expires: a fixed sequence of collectives with no host sync.
  std::vector<Codebook*> expiring;
  std::vector<std::vector<Tensor>> rows;
  for (std::size_t i = 0; i < codebooks_.size(); ++i) {
    Codebook& cb = *codebooks_[i];
    std::vector<Tensor> tables;
    if (plan.reduce[i] && cb.options().threshold_ema_dead_code > 0) {
      if (group_.size() == 1 && cb.calls_per_forward() == 1) {
        // One process, one slot: the pool is this process's candidates as
        // they lie, and each replacement is read from it where it was drawn
        // (the same draws and rows, no pool-wide row gather).
        cb.expire_codes();
        continue;
      }
      tables = pick_replacements(cb, int64_t(i), header);
    }
    if (std::any_of(tables.begin(), tables.end(), [](const Tensor& t) { return t.defined(); })) {
      expiring.push_back(&cb);
      rows.push_back(std::move(tables));
    } else {
      cb.pending().candidates.clear();
    }
  }
  if (expiring.empty()) return;
  if (group_.size() > 1) {
    Fused replacements(plan.wide, plan.device, replacement_staging_);
    for (const auto& tables : rows)
      for (const Tensor& r : tables)
        if (r.defined()) replacements.add(r, r.shape());
    replacements.reduce(group_);
    for (std::size_t e = 0; e < expiring.size(); ++e)
      for (Tensor& r : rows[e])
        if (r.defined()) r = replacements.take(expiring[e]->embed().dtype());
  }
  for (std::size_t e = 0; e < expiring.size(); ++e) expiring[e]->replace_expired(rows[e]);
}

}  // namespace quanta::quant
