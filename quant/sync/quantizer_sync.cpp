#include "quant/sync/quantizer_sync.h"

#include <algorithm>
#include <stdexcept>
#include <unordered_set>

#include "dist/functional.h"
#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/ops/index.h"
#include "engine/ops/join.h"
#include "engine/ops/reductions.h"
#include "engine/ops/view.h"
#include "quant/scalar/lfq.h"
#include "quant/step_stream.h"
#include "quant/vq/codebook.h"
#include "quant/vq/residual_vq.h"
#include "quant/vq/vector_quantize.h"

namespace quanta::quant {
namespace {

// Tensors packed into one flat buffer for one all_reduce(sum), then read
// back in the order they were added. An undefined tensor (a rank without
// those statistics) is sent as zeros of its declared shape.
class Fused {
 public:
  explicit Fused(DType dtype) : dtype_(dtype) {}

  void add(const Tensor& t, const Shape& shape) {
    shapes_.push_back(shape);
    const int64_t numel = numel_of(shape);
    parts_.push_back(t.defined() ? reshape(to_dtype(t, dtype_), {numel})
                                 : zeros({numel}, {.dtype = dtype_}));
  }
  /** The all_reduce; false (and no collective) when nothing was added. */
  bool reduce(dist::ProcessGroup& group) {
    if (parts_.empty()) return false;
    // A copy either way: the buffer must not alias the pending statistics.
    flat_ = parts_.size() == 1 ? parts_[0].clone() : cat(parts_);
    parts_.clear();
    group.all_reduce(flat_, dist::ReduceOp::sum);
    return true;
  }
  /** The next reduced tensor, in `dtype`. */
  Tensor take(DType dtype) {
    const Shape& shape = shapes_.at(next_++);
    const int64_t numel = numel_of(shape);
    Tensor t = to_dtype(reshape(slice(flat_, 0, at_, at_ + numel), shape), dtype);
    at_ += numel;
    return t;
  }

 private:
  DType dtype_;
  std::vector<Tensor> parts_;
  std::vector<Shape> shapes_;
  Tensor flat_;
  int64_t at_ = 0;
  std::size_t next_ = 0;
};

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
    if (auto* lfq = dynamic_cast<LFQ*>(m))
      lfq->token_mean = [g](const Tensor& sum, int64_t count) {
        return dist::fn::global_mean(*g, sum, scalar(double(count), {.dtype = DType::f64}));
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

QuantizerSync::Header QuantizerSync::gather_header() {
  Header h;
  std::vector<int64_t> local;
  for (Codebook* cb : codebooks_) {
    const CodebookOptions& o = cb->options();
    h.offset.push_back(int64_t(local.size()));
    const CodebookStatistics& p = cb->pending();
    local.push_back(p.steps);
    for (int64_t t = 0; t < o.num_codebooks; ++t) {
      int64_t rows = 0;
      if (t < static_cast<int64_t>(p.candidates.size()))
        for (const Tensor& c : p.candidates[size_t(t)]) rows += c.size(0);
      local.push_back(rows);
    }
  }
  h.width = int64_t(local.size());
  h.world = group_.size();
  h.values = group_.all_gather(from_vector<int64_t>(local, {h.width})).to_vector<int64_t>();
  return h;
}

int64_t QuantizerSync::Header::max_steps(int64_t codebook) const {
  int64_t most = 0;
  for (int r = 0; r < world; ++r)
    most = std::max(most, values[size_t(r * width + offset[size_t(codebook)])]);
  return most;
}

int64_t QuantizerSync::Header::candidates(int rank, int64_t codebook, int64_t table) const {
  return values[size_t(rank * width + offset[size_t(codebook)] + 1 + table)];
}

std::vector<std::vector<Tensor>> QuantizerSync::pick_replacements(
    const std::vector<int64_t>& expiring, const Header& header) {
  const int world = group_.size(), rank = group_.rank();
  // This rank's candidate rows per (codebook, table); every rank's counts
  // came with the header.
  std::vector<Tensor> local_rows;
  std::vector<int64_t> table_codebook, table_index;
  for (int64_t i : expiring) {
    Codebook& cb = *codebooks_[static_cast<size_t>(i)];
    for (int64_t h = 0; h < cb.options().num_codebooks; ++h) {
      local_rows.push_back(cb.table_rows(cb.pending().candidates, h));
      table_codebook.push_back(i);
      table_index.push_back(h);
    }
  }
  auto count = [&](int r, int64_t t) {
    return header.candidates(r, table_codebook[size_t(t)], table_index[size_t(t)]);
  };
  std::vector<Codebook*> books;
  for (int64_t i : expiring) books.push_back(codebooks_[static_cast<size_t>(i)]);

  // Every rank draws the same positions and fills the rows it holds.
  std::vector<Tensor> picked;  // per table: [m, D], zeros where another rank holds the row
  int64_t t = 0;
  for (Codebook* cb : books) {
    std::vector<int64_t> pool_sizes;
    for (int64_t h = 0; h < cb->options().num_codebooks; ++h) {
      int64_t total = 0;
      for (int r = 0; r < world; ++r) total += count(r, t + h);
      pool_sizes.push_back(total);
    }
    const std::vector<Tensor> positions = cb->draw_replacements(pool_sizes);
    for (int64_t h = 0; h < cb->options().num_codebooks; ++h, ++t) {
      int64_t begin = 0;
      for (int r = 0; r < rank; ++r) begin += count(r, t);
      const int64_t mine = count(rank, t), d = cb->options().dim;
      const std::vector<int64_t> pos = positions[size_t(h)].to_vector<int64_t>();
      std::vector<int64_t> local_at, slot;
      for (std::size_t j = 0; j < pos.size(); ++j)
        if (pos[j] >= begin && pos[j] < begin + mine) {
          local_at.push_back(pos[j] - begin);
          slot.push_back(int64_t(j));
        }
      Tensor rows = zeros({int64_t(pos.size()), d}, options_of(cb->embed()));
      if (!slot.empty()) {
        const Tensor src = index_select(local_rows[size_t(t)], 0,
                                        from_vector<int64_t>(local_at, {int64_t(local_at.size())}));
        rows = index_add(rows, 0, from_vector<int64_t>(slot, {int64_t(slot.size())}), src);
      }
      picked.push_back(rows);
    }
  }
  std::vector<std::vector<Tensor>> out;
  t = 0;
  for (Codebook* cb : books) {
    out.emplace_back();
    for (int64_t h = 0; h < cb->options().num_codebooks; ++h, ++t)
      out.back().push_back(picked[size_t(t)]);
  }
  return out;
}

void QuantizerSync::sync_state() {
  NoGradGuard no_grad;
  const int64_t n = static_cast<int64_t>(codebooks_.size());
  if (n > 0) {
    // (1) One all_gather of a small header: per codebook, the forwards it
    // accumulated since the last sync (the most any rank ran is used: a rank
    // with an extra forward folded its counts one decay step further) and
    // the candidate rows per table (for the dead-code pool).
    const Header header = gather_header();
    std::vector<double> global_steps;
    for (int64_t i = 0; i < n; ++i) global_steps.push_back(double(header.max_steps(i)));

    // (2) Deferred k-means on the pooled samples of every rank (rank order):
    // the same pool, hence the same codes, on every rank.
    std::vector<bool> reduce_stats(static_cast<size_t>(n), false);
    for (int64_t i = 0; i < n; ++i) {
      Codebook& cb = *codebooks_[static_cast<size_t>(i)];
      const CodebookOptions& o = cb.options();
      if (!cb.initted()) {
        std::vector<Tensor> pools;
        for (int64_t h = 0; h < o.num_codebooks; ++h)
          pools.push_back(group_.all_gather_v(cb.table_rows(cb.pending().init_samples, h)));
        cb.pending() = CodebookStatistics{};
        cb.init_from_samples(pools);
        continue;  // statistics against the zero codes mean nothing
      }
      reduce_stats[static_cast<size_t>(i)] = global_steps[static_cast<size_t>(i)] > 0;
    }

    // (3) One small fused all_reduce of every codebook's folded counts and
    // token totals (ranks without statistics send zeros), in the widest
    // codebook dtype: cluster sizes take their EMA step from it, and with
    // them every rank alike knows which codes expire. (Not in the header: an
    // all_gather's bytes grow with the world size, an all_reduce's do not.)
    DType wide = DType::f32;
    std::vector<bool> reduce_affine(static_cast<size_t>(n), false);
    for (int64_t i = 0; i < n; ++i) {
      Codebook& cb = *codebooks_[static_cast<size_t>(i)];
      reduce_affine[static_cast<size_t>(i)] = cb.options().affine_param && cb.initted();
      if ((reduce_stats[static_cast<size_t>(i)] || reduce_affine[static_cast<size_t>(i)]) &&
          cb.embed().dtype() == DType::f64)
        wide = DType::f64;
    }
    Fused counts(wide);
    for (int64_t i = 0; i < n; ++i) {
      if (!reduce_stats[static_cast<size_t>(i)]) continue;
      const CodebookOptions& o = codebooks_[static_cast<size_t>(i)]->options();
      const CodebookStatistics& p = codebooks_[static_cast<size_t>(i)]->pending();
      counts.add(p.counts, {o.num_codebooks, o.codebook_size});
      counts.add(p.tokens, {o.num_codebooks});
    }
    if (counts.reduce(group_)) {
      for (int64_t i = 0; i < n; ++i) {
        if (!reduce_stats[static_cast<size_t>(i)]) continue;
        Codebook& cb = *codebooks_[static_cast<size_t>(i)];
        CodebookStatistics& p = cb.pending();
        const DType dt = cb.embed().dtype();
        p.counts = counts.take(dt);
        p.tokens = counts.take(dt);
        p.steps = static_cast<int64_t>(global_steps[static_cast<size_t>(i)]);
        cb.apply_cluster_ema();
      }
    }

    // (4) One large fused all_reduce: affine_param's batch statistics, the
    // folded sums, and the dead-code replacement rows. Which codes expire
    // follows from the reduced cluster sizes, identical on every rank. The
    // replacements are drawn from the pool of every rank's candidates in
    // rank order (what one process would hold for the whole batch) without
    // moving the pool: the header carried the candidate counts, the
    // codebook's stream picks pool positions (the same on every rank), and
    // each picked row is contributed by the rank that holds it and zero
    // elsewhere (an exact sum). Riding with the sums, the rows cost no
    // collective of their own.
    std::vector<int64_t> expiring;
    for (int64_t i = 0; i < n; ++i) {
      Codebook& cb = *codebooks_[static_cast<size_t>(i)];
      if (reduce_stats[static_cast<size_t>(i)] && cb.options().threshold_ema_dead_code > 0 &&
          any(cb.expired_codes()).item())
        expiring.push_back(i);
      else
        cb.pending().candidates.clear();
    }
    const std::vector<std::vector<Tensor>> rows = pick_replacements(expiring, header);
    Fused bulk(wide);
    for (int64_t i = 0; i < n; ++i) {
      if (!reduce_affine[static_cast<size_t>(i)]) continue;
      const int64_t g = codebooks_[static_cast<size_t>(i)]->options().num_codebooks,
                    d = codebooks_[static_cast<size_t>(i)]->options().dim;
      const CodebookStatistics& p = codebooks_[static_cast<size_t>(i)]->pending();
      bulk.add(p.affine_count, {g});
      bulk.add(p.affine_sum, {g, 1, d});
      bulk.add(p.affine_sumsq, {g, 1, d});
    }
    for (int64_t i = 0; i < n; ++i) {
      if (!reduce_stats[static_cast<size_t>(i)]) continue;
      const CodebookOptions& o = codebooks_[static_cast<size_t>(i)]->options();
      bulk.add(codebooks_[static_cast<size_t>(i)]->pending().sums,
               {o.num_codebooks, o.codebook_size, o.dim});
    }
    for (const auto& tables : rows)
      for (const Tensor& r : tables) bulk.add(r, r.shape());
    if (bulk.reduce(group_)) {
      for (int64_t i = 0; i < n; ++i) {
        if (!reduce_affine[static_cast<size_t>(i)]) continue;
        Codebook& cb = *codebooks_[static_cast<size_t>(i)];
        const DType dt = cb.embed().dtype();
        CodebookStatistics& p = cb.pending();
        p.affine_count = bulk.take(dt);
        p.affine_sum = bulk.take(dt);
        p.affine_sumsq = bulk.take(dt);
        cb.apply_affine_update();  // before the EMA step, as in a forward
      }
      for (int64_t i = 0; i < n; ++i) {
        if (!reduce_stats[static_cast<size_t>(i)]) continue;
        Codebook& cb = *codebooks_[static_cast<size_t>(i)];
        cb.pending().sums = bulk.take(cb.embed().dtype());
        cb.apply_embed_ema();
      }
      for (std::size_t e = 0; e < expiring.size(); ++e) {
        Codebook& cb = *codebooks_[static_cast<size_t>(expiring[e])];
        std::vector<Tensor> replacement;
        for (std::size_t h = 0; h < rows[e].size(); ++h)
          replacement.push_back(bulk.take(cb.embed().dtype()));
        cb.replace_expired(replacement);
      }
    }
  }
  ++step_;
  pin_streams();
}

}  // namespace quanta::quant
