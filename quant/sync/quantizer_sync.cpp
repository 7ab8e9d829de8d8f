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
    h.offset.push_back(int64_t(local.size()));
    const CodebookStatistics& p = cb->pending();
    local.push_back(p.steps);
    for (int64_t t = 0; t < cb->options().num_codebooks; ++t) {
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

void QuantizerSync::replace_dead_codes(const std::vector<int64_t>& expiring, const Header& header) {
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
  std::vector<Tensor> parts;
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
      parts.push_back(reshape(rows, {int64_t(pos.size()) * d}));
      picked.push_back(rows);
    }
  }
  Tensor fused = contiguous(cat(parts));
  group_.all_reduce(fused, dist::ReduceOp::sum);

  int64_t at = 0;
  t = 0;
  for (Codebook* cb : books) {
    std::vector<Tensor> rows;
    for (int64_t h = 0; h < cb->options().num_codebooks; ++h, ++t) {
      const Shape shape = picked[size_t(t)].shape();
      const int64_t numel = shape[0] * shape[1];
      rows.push_back(reshape(slice(fused, 0, at, at + numel), shape));
      at += numel;
    }
    cb->replace_expired(rows);
  }
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

    // (3) One fused all_reduce of every codebook's folded counts, sums and
    // token totals (ranks without statistics send zeros), in the widest
    // codebook dtype (f32 codebooks: f32, half the bytes of f64; the sums
    // then differ from one process's by summation order only).
    DType wide = DType::f32;
    for (int64_t i = 0; i < n; ++i)
      if (reduce_stats[static_cast<size_t>(i)] &&
          codebooks_[static_cast<size_t>(i)]->embed().dtype() == DType::f64)
        wide = DType::f64;
    // affine_param's batch statistics ride along for every initialised
    // codebook that has them (zeros where a rank saw no rows).
    std::vector<bool> reduce_affine(static_cast<size_t>(n), false);
    for (int64_t i = 0; i < n; ++i) {
      Codebook& cb = *codebooks_[static_cast<size_t>(i)];
      reduce_affine[static_cast<size_t>(i)] = cb.options().affine_param && cb.initted();
      if (reduce_affine[static_cast<size_t>(i)] && cb.embed().dtype() == DType::f64)
        wide = DType::f64;
    }
    std::vector<Tensor> parts;
    for (int64_t i = 0; i < n; ++i) {
      if (!reduce_affine[static_cast<size_t>(i)]) continue;
      Codebook& cb = *codebooks_[static_cast<size_t>(i)];
      const int64_t g = cb.options().num_codebooks, d = cb.options().dim;
      const CodebookStatistics& p = cb.pending();
      const bool has = p.affine_count.defined();
      parts.push_back(has ? to_dtype(p.affine_count, wide) : zeros({g}, {.dtype = wide}));
      parts.push_back(has ? reshape(to_dtype(p.affine_sum, wide), {g * d})
                          : zeros({g * d}, {.dtype = wide}));
      parts.push_back(has ? reshape(to_dtype(p.affine_sumsq, wide), {g * d})
                          : zeros({g * d}, {.dtype = wide}));
    }
    for (int64_t i = 0; i < n; ++i) {
      if (!reduce_stats[static_cast<size_t>(i)]) continue;
      Codebook& cb = *codebooks_[static_cast<size_t>(i)];
      const CodebookOptions& o = cb.options();
      const int64_t g = o.num_codebooks, k = o.codebook_size, d = o.dim;
      const CodebookStatistics& p = cb.pending();
      const bool has = !p.empty();
      parts.push_back(has ? reshape(to_dtype(p.counts, wide), {g * k})
                          : zeros({g * k}, {.dtype = wide}));
      parts.push_back(has ? reshape(to_dtype(p.sums, wide), {g * k * d})
                          : zeros({g * k * d}, {.dtype = wide}));
      parts.push_back(has ? to_dtype(p.tokens, wide) : zeros({g}, {.dtype = wide}));
    }
    if (!parts.empty()) {
      Tensor fused = contiguous(cat(parts));
      group_.all_reduce(fused, dist::ReduceOp::sum);
      int64_t at = 0;
      auto take = [&](int64_t count, Shape shape, DType dt) {
        Tensor t = to_dtype(reshape(slice(fused, 0, at, at + count), shape), dt);
        at += count;
        return t;
      };
      for (int64_t i = 0; i < n; ++i) {
        if (!reduce_affine[static_cast<size_t>(i)]) continue;
        Codebook& cb = *codebooks_[static_cast<size_t>(i)];
        const int64_t g = cb.options().num_codebooks, d = cb.options().dim;
        const DType dt = cb.embed().dtype();
        CodebookStatistics& p = cb.pending();
        p.affine_count = take(g, {g}, dt);
        p.affine_sum = take(g * d, {g, 1, d}, dt);
        p.affine_sumsq = take(g * d, {g, 1, d}, dt);
        cb.apply_affine_update();  // before the EMA step, as in a forward
      }
      for (int64_t i = 0; i < n; ++i) {
        if (!reduce_stats[static_cast<size_t>(i)]) continue;
        Codebook& cb = *codebooks_[static_cast<size_t>(i)];
        const CodebookOptions& o = cb.options();
        const int64_t g = o.num_codebooks, k = o.codebook_size, d = o.dim;
        const DType dt = cb.embed().dtype();
        CodebookStatistics& p = cb.pending();
        p.counts = take(g * k, {g, k}, dt);
        p.sums = take(g * k * d, {g, k, d}, dt);
        p.tokens = take(g, {g}, dt);
        p.steps = static_cast<int64_t>(global_steps[static_cast<size_t>(i)]);
        cb.apply_ema_update();
      }
    }

    // (4) Dead codes: which expire follows from the reduced cluster sizes,
    // identical on every rank. The replacements are drawn from the pool of
    // every rank's candidates in rank order (what one process would hold for
    // the whole batch) without moving the pool: one all_gather of the
    // candidate counts, the codebook's stream picks pool positions (the same
    // on every rank), and one all_reduce(sum) moves just the picked rows,
    // each contributed by the rank that holds it and zero elsewhere (exact).
    std::vector<int64_t> expiring;
    for (int64_t i = 0; i < n; ++i) {
      Codebook& cb = *codebooks_[static_cast<size_t>(i)];
      if (reduce_stats[static_cast<size_t>(i)] && cb.options().threshold_ema_dead_code > 0 &&
          any(cb.expired_codes()).item())
        expiring.push_back(i);
      else
        cb.pending().candidates.clear();
    }
    if (!expiring.empty()) replace_dead_codes(expiring, header);
  }
  ++step_;
  pin_streams();
}

}  // namespace quanta::quant
