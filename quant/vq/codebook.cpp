#include "quant/vq/codebook.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "engine/autograd/grad_mode.h"
#include "engine/capture/device_graph.h"
#include "engine/dispatch.h"
#include "engine/factory.h"
#include "engine/nn/init.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/join.h"
#include "engine/ops/reduce.h"
#include "engine/ops/reductions.h"
#include "engine/ops/view.h"
#include "engine/random/sampling.h"
#include "quant/kernels/table.h"
#include "quant/streams.h"
#include "quant/vq/code_statistics.h"
#include "quant/vq/kmeans.h"
#include "quant/vq/nearest_code.h"

namespace quanta::quant {
namespace {

CodebookOptions checked(const CodebookOptions& o) {
  if (o.dim <= 0 || o.codebook_size <= 0 || o.num_codebooks <= 0)
    throw std::invalid_argument(
        "[Codebook] dim, codebook_size and num_codebooks must be positive, got " +
        std::to_string(o.dim) + ", " + std::to_string(o.codebook_size) + ", " +
        std::to_string(o.num_codebooks));
  if (!(o.decay >= 0 && o.decay <= 1))
    throw std::invalid_argument("[Codebook] decay must lie in [0, 1], got " +
                                std::to_string(o.decay));
  return o;
}

// The same seed for both streams: they differ by name.
uint64_t seed_of(Generator& gen) { return draw_seed(gen); }

// x = x keep + alpha a, in place (the EMA's lerp; x contiguous): one kernel
// with the bits of mul_(x, keep) and add_(x, a, alpha).
void ema_lerp_(const Tensor& x, const Tensor& a, double keep, double alpha) {
  const QuantKernelTable& kernels = quant_kernels_for("Codebook EMA", {&x, &a});
  const Tensor ac = contiguous(to_dtype(a, x.dtype()));
  if (ac.numel() != x.numel() || !x.is_contiguous())
    throw std::logic_error("[Codebook EMA] statistics of shape " + shape_str(a.shape()) +
                           " for a table of shape " + shape_str(x.shape()));
  kernels.ema_lerp(x.dtype(), x.numel(), keep, alpha, x.raw_data(), ac.raw_data());
}

}  // namespace

Codebook::Codebook(const CodebookOptions& opts, Generator& gen)
    : Module("Codebook"),
      opts_(checked(opts)),
      kmeans_gen_(Generator(0)),
      dead_code_gen_(Generator(0)) {
  const int64_t g = opts_.num_codebooks, k = opts_.codebook_size, d = opts_.dim;
  Tensor embed = zeros({g, k, d});
  if (!opts_.kmeans_init) {
    // kaiming_uniform_ on [G, K, D]: fan_in = K * D, bound sqrt(6 / fan_in).
    init::kaiming_uniform_(embed, gen);
    if (opts_.use_cosine_sim) embed = l2norm(embed);
  }
  const uint64_t seed = seed_of(gen);
  kmeans_gen_ = StepStream(Generator::named(seed, "vq.kmeans"));
  dead_code_gen_ = StepStream(Generator::named(seed, "vq.dead_code"));
  embed_ = opts_.embed_is_parameter ? register_parameter("embed", embed)
                                    : register_buffer("embed", embed);
  embed_avg_ = register_buffer("embed_avg", embed.clone());
  cluster_size_ = register_buffer("cluster_size", ones({g, k}));
  if (opts_.affine_param) {
    batch_mean_ = register_buffer("batch_mean", zeros({g, 1, d}));
    batch_var_ = register_buffer("batch_variance", ones({g, 1, d}));
    codebook_mean_ = register_buffer("codebook_mean", zeros({g, 1, d}));
    codebook_var_ = register_buffer("codebook_variance", ones({g, 1, d}));
    // vector-quantize-pytorch's names and form (f32 [1], 1 = not yet set), so
    // checkpoints move both ways; its batch statistics have no such flag.
    codebook_mean_needs_init_ = register_buffer("codebook_mean_needs_init", ones({1}));
    codebook_var_needs_init_ = register_buffer("codebook_variance_needs_init", ones({1}));
  }
  initted_ =
      register_buffer("initted", scalar(opts_.kmeans_init ? 0.0 : 1.0, {.dtype = DType::boolean}));
  initted_on_host_ = !opts_.kmeans_init;
}

bool Codebook::initted() const { return initted_on_host_; }

void Codebook::read_host_state() {
  initted_on_host_ = initted_.item() != 0.0;
  affine_initted_on_host_ = opts_.affine_param && codebook_mean_needs_init_.item() == 0.0 &&
                            codebook_var_needs_init_.item() == 0.0;
}

void Codebook::init_from_samples(const std::vector<Tensor>& samples) {
  const int64_t g = opts_.num_codebooks, k = opts_.codebook_size;
  if (static_cast<int64_t>(samples.size()) != g)
    throw std::invalid_argument(
        "[Codebook] init_from_samples needs one sample set per "
        "codebook: got " +
        std::to_string(samples.size()) + ", expected " + std::to_string(g));
  for (const Tensor& s : samples)
    if (s.size(0) == 0) return;  // an empty batch cannot seed k-means: wait
  NoGradGuard no_grad;
  std::vector<Tensor> means, bins;
  Generator& gen = kmeans_gen_.next();  // one stream for the tables, in turn
  for (const Tensor& s : samples) {
    KMeansResult r = kmeans(to_dtype(s.detach(), embed_.dtype()), k, opts_.kmeans_iters,
                            opts_.use_cosine_sim, gen);
    means.push_back(r.means);
    bins.push_back(r.bins);
  }
  const Tensor m = stack(means), b = stack(bins);
  copy_(embed_, m);
  copy_(embed_avg_, m * unsqueeze(b, -1));
  copy_(cluster_size_, b);
  // The reference recomputes embed from these statistics right away, so
  // codes that received no rows become (almost) zero.
  if (opts_.ema_update && !opts_.manual_ema_update) embed_from_statistics();
  fill_(initted_, 1.0);
  initted_on_host_ = true;
}

void Codebook::set_calls_per_forward(int64_t calls) {
  if (calls < 1)
    throw std::invalid_argument("[Codebook::set_calls_per_forward] calls " + std::to_string(calls) +
                                " must be >= 1");
  calls_per_forward_ = calls;
}

void Codebook::accumulate(const Tensor& x, const Tensor& indices, const Tensor& valid) {
  NoGradGuard no_grad;
  const int64_t g = opts_.num_codebooks, k = opts_.codebook_size;
  const auto opt = options_of(embed_);
  const bool first = pending_.empty();
  if (first) pending_.candidates.assign(static_cast<size_t>(g), {});
  const Tensor xs = to_dtype(x.detach(), embed_.dtype());
  std::vector<Tensor> counts, sums, tokens;
  for (int64_t h = 0; h < g; ++h) {
    Tensor rows = select(xs, 0, h), idx = select(indices, 0, h);
    if (valid.defined()) {
      // Only unmasked tokens count: gather their positions once.
      const Tensor keep = nonzero(select(valid, 0, h));
      rows = index_select(rows, 0, keep);
      idx = index_select(idx, 0, keep);
    }
    const int64_t n = rows.size(0);
    CodeStatistics st = code_statistics(idx, rows, k);
    counts.push_back(std::move(st.counts));
    sums.push_back(std::move(st.sums));
    tokens.push_back(scalar(double(n), opt));
    if (opts_.threshold_ema_dead_code > 0) pending_.candidates[h].push_back(rows);
  }
  // One table's statistics need no stacking copies: they are fresh tensors
  // of their own, viewed with the tables' leading dim.
  const auto tables = [g](const std::vector<Tensor>& per) {
    return g == 1 ? unsqueeze(per[0], 0) : stack(per);
  };
  if (first) {  // the common case: one forward per step, no fold, no add
    pending_.counts = tables(counts);
    pending_.sums = tables(sums);
    pending_.tokens = tables(tokens);
  } else {
    // Fold the earlier forwards' contributions one more decay step down.
    mul_(pending_.counts, opts_.decay);
    mul_(pending_.sums, opts_.decay);
    add_(pending_.counts, tables(counts));
    add_(pending_.sums, tables(sums));
    add_(pending_.tokens, tables(tokens));
  }
  pending_.steps += 1;
  // A captured step's replays rewrite these tensors; the host's handles to
  // them (cleared when the statistics are applied) are set again each time.
  // Only then: the copy of the statistics is not every forward's to make.
  if (capture_open()) on_replay([this, after = pending_] { pending_ = after; });
}

void Codebook::apply_ema_update() {
  apply_cluster_ema();
  apply_embed_ema();
}

void Codebook::apply_cluster_ema() {
  if (pending_.empty() || !pending_.counts.defined()) return;
  NoGradGuard no_grad;
  // cluster_size <- decay^s cluster_size + (1 - decay) folded counts (= s
  // reference lerps), in place.
  ema_lerp_(cluster_size_, pending_.counts, std::pow(opts_.decay, double(pending_.steps)),
            1.0 - opts_.decay);
  pending_.counts = Tensor();
}

void Codebook::embed_from_statistics() {
  // embed <- embed_avg / Laplace-smoothed cluster sizes, written in place:
  // no temporary, one kernel after the sizes' sums.
  const Tensor n = contiguous(sum(cluster_size_, {-1}));
  quant_kernels_for("Codebook EMA", {&embed_, &n})
      .ema_embed(embed_.dtype(), opts_.num_codebooks, opts_.codebook_size, opts_.dim, opts_.eps,
                 cluster_size_.raw_data(), n.raw_data(), embed_avg_.raw_data(), embed_.raw_data());
  if (opts_.use_cosine_sim) copy_(embed_, l2norm(embed_));
}

void Codebook::update_ema() {
  NoGradGuard no_grad;
  embed_from_statistics();
}

void Codebook::apply_embed_ema() {
  if (pending_.empty()) return;
  NoGradGuard no_grad;
  // The same lerp for embed_avg, in place: no [G, K, D] temporaries.
  ema_lerp_(embed_avg_, pending_.sums, std::pow(opts_.decay, double(pending_.steps)),
            1.0 - opts_.decay);
  if (opts_.ema_update && !opts_.manual_ema_update) embed_from_statistics();
  pending_.counts = Tensor();
  pending_.sums = Tensor();
  pending_.tokens = Tensor();
  pending_.steps = 0;
}

Tensor Codebook::expired_codes() const {
  NoGradGuard no_grad;
  if (opts_.threshold_ema_dead_code <= 0)
    return zeros(cluster_size_.shape(),
                 {.dtype = DType::boolean, .device = cluster_size_.device()});
  return lt(cluster_size_,
            shared_full({}, opts_.threshold_ema_dead_code, options_of(cluster_size_)));
}

std::vector<int64_t> Codebook::expired_counts() const {
  if (opts_.threshold_ema_dead_code <= 0)
    return std::vector<int64_t>(static_cast<std::size_t>(opts_.num_codebooks), 0);
  NoGradGuard no_grad;
  return sum(to_dtype(expired_codes(), DType::i64), {1}).to_vector<int64_t>();
}

Tensor Codebook::table_rows(const std::vector<std::vector<Tensor>>& per_table,
                            int64_t table) const {
  const auto t = static_cast<std::size_t>(table);
  if (t >= per_table.size() || per_table[t].empty())
    return zeros({0, opts_.dim}, options_of(embed_));
  // One forward's rows (the usual case) need no copy.
  return per_table[t].size() == 1 ? contiguous(per_table[t][0]) : contiguous(cat(per_table[t]));
}

void Codebook::expire_codes() {
  std::vector<Tensor> pools;
  for (int64_t h = 0; h < opts_.num_codebooks; ++h)
    pools.push_back(table_rows(pending_.candidates, h));
  expire_codes(pools);
}

void Codebook::expire_codes(const std::vector<Tensor>& pools) {
  std::vector<int64_t> sizes;
  for (const Tensor& p : pools) sizes.push_back(p.size(0));
  draw_replacements(sizes);
  write_replacements(pools, true);
}

std::vector<Tensor> Codebook::draw_replacements(const std::vector<int64_t>& pool_sizes) {
  NoGradGuard no_grad;
  const int64_t k = opts_.codebook_size;
  std::vector<Tensor> picks(static_cast<size_t>(opts_.num_codebooks));
  replacing_.assign(picks.size(), Tensor());
  if (opts_.threshold_ema_dead_code <= 0) return picks;
  const TensorOptions i64{.dtype = DType::i64, .device = embed_.device()};
  Tensor expired;                          // [G, K] i64, for a pool smaller than the codebook
  Generator& gen = dead_code_gen_.next();  // one stream for the tables, in turn
  for (int64_t h = 0; h < opts_.num_codebooks; ++h) {
    const int64_t n = h < static_cast<int64_t>(pool_sizes.size()) ? pool_sizes[size_t(h)] : 0;
    if (n <= 0) continue;
    // The draws are made whatever expires, so the stream advances the same
    // way on every rank and step without reading the device. With n >= K
    // rows every expiry fits the permutation.
    const Tensor draws = contiguous(randperm_prefix(n, std::min(n, k), gen, i64));
    if (n >= k) {
      // The j-th expired code takes draw j: one launch.
      const Tensor sizes = contiguous(select(cluster_size_, 0, h));
      const QuantKernelTable& kernels = quant_kernels_for("Codebook", {&sizes, &draws});
      picks[size_t(h)] = empty({k}, i64);
      kernels.dead_code_picks(sizes.dtype(), sizes.raw_data(), k, opts_.threshold_ema_dead_code,
                              static_cast<const int64_t*>(draws.raw_data()),
                              static_cast<int64_t*>(picks[size_t(h)].raw_data()));
    } else {
      // The first n expired codes in a random order of the codes.
      if (!expired.defined()) expired = to_dtype(expired_codes(), DType::i64);
      const Tensor order = randperm(k, gen, i64);
      const Tensor dead = gather(select(expired, 0, h), 0, order);
      const Tensor first =
          dead * to_dtype(le(cumsum(dead, 0), shared_full({}, double(n), i64)), DType::i64);
      const Tensor chosen = scatter(zeros({k}, i64), 0, order, first);
      const Tensor padded = cat({draws, zeros({k - n}, i64)});
      // The j-th chosen code takes draw j: its count of chosen codes before
      // it, in [0, k - 1] everywhere (cumsum less itself), so an index
      // gather takes without a clamp.
      const Tensor rank = cumsum(chosen, 0) - chosen;
      picks[size_t(h)] = where(to_dtype(chosen, DType::boolean), gather(padded, 0, rank),
                               shared_full({k}, -1.0, i64));
    }
    replacing_[size_t(h)] = picks[size_t(h)];
  }
  return picks;
}

void Codebook::replace_expired(const std::vector<Tensor>& rows) { write_replacements(rows, false); }

void Codebook::write_replacements(const std::vector<Tensor>& sources, bool from_pools) {
  pending_.candidates.clear();
  if (opts_.threshold_ema_dead_code <= 0) return;
  NoGradGuard no_grad;
  std::vector<Tensor> chosen;
  chosen.swap(replacing_);  // one draw, one replacement
  Tensor expired;           // for a table without a draw: made once, where one is
  const TensorOptions i64{.dtype = DType::i64, .device = embed_.device()};
  const int64_t k = opts_.codebook_size, d = opts_.dim;
  for (int64_t h = 0; h < opts_.num_codebooks && h < static_cast<int64_t>(sources.size()); ++h) {
    if (!sources[size_t(h)].defined()) continue;
    const Tensor& r = sources[size_t(h)];
    const bool drawn = h < static_cast<int64_t>(chosen.size()) && chosen[size_t(h)].defined();
    if (from_pools ? (r.dim() != 2 || r.size(1) != d)
                   : (r.dim() != 2 || r.size(0) != k || r.size(1) != d))
      throw std::invalid_argument("[Codebook] replace_expired: table " + std::to_string(h) +
                                  " takes rows of shape [" +
                                  (from_pools ? std::string("P") : std::to_string(k)) + ", " +
                                  std::to_string(d) + "], got " + shape_str(r.shape()));
    if (from_pools && !drawn) continue;  // an empty pool: nothing drawn, nothing replaced
    // The code's source row where it is replaced, -1 elsewhere, which the
    // kernel skips: only the replaced rows are written, with no read of how
    // many there are. Without a draw, every expired code takes its own row.
    Tensor picks;
    if (drawn) {
      picks = chosen[size_t(h)];
    } else {
      if (!expired.defined()) expired = expired_codes();
      picks = where(select(expired, 0, h), shared_arange(k, i64), shared_full({1}, -1.0, i64));
    }
    const Tensor src = contiguous(to_dtype(r, embed_.dtype()));
    const Tensor e = select(embed_, 0, h), avg = select(embed_avg_, 0, h),
                 size = select(cluster_size_, 0, h);
    const QuantKernelTable& kernels = quant_kernels_for("Codebook", {&e, &src, &picks});
    dispatch_float(e.dtype(), "Codebook", [](auto) {});  // f32 or f64
    kernels.replace_codes(e.dtype(), k, d, static_cast<const int64_t*>(picks.raw_data()),
                          from_pools, src.raw_data(), opts_.threshold_ema_dead_code, e.raw_data(),
                          avg.raw_data(), size.raw_data());
  }
}

void Codebook::add_init_samples(const Tensor& x, const Tensor& valid) {
  NoGradGuard no_grad;
  const int64_t g = opts_.num_codebooks;
  if (pending_.init_samples.empty()) pending_.init_samples.assign(static_cast<size_t>(g), {});
  const Tensor xs = to_dtype(x.detach(), embed_.dtype());
  for (int64_t h = 0; h < g; ++h) {
    Tensor rows = select(xs, 0, h);
    if (valid.defined()) rows = index_select(rows, 0, nonzero(select(valid, 0, h)));
    pending_.init_samples[static_cast<size_t>(h)].push_back(contiguous(rows));
  }
}

void Codebook::init_from_pending() {
  std::vector<Tensor> samples;
  for (int64_t h = 0; h < opts_.num_codebooks; ++h)
    samples.push_back(table_rows(pending_.init_samples, h));
  pending_ = CodebookStatistics{};
  init_from_samples(samples);
}

void Codebook::update_affine(const Tensor& x, const Tensor& valid) {
  if (!opts_.affine_param) return;
  NoGradGuard no_grad;
  const int64_t g = opts_.num_codebooks, d = opts_.dim;
  const Tensor xs = to_dtype(x.detach(), embed_.dtype());
  std::vector<Tensor> means, vars;
  for (int64_t h = 0; h < g; ++h) {
    Tensor rows = select(xs, 0, h);
    if (valid.defined()) rows = index_select(rows, 0, nonzero(select(valid, 0, h)));
    if (rows.size(0) == 0) return;  // nothing to learn the batch statistics from
    means.push_back(mean(rows, {0}, true));
    vars.push_back(var(rows, {0}, 0.0, true));
  }
  set_affine_statistics(reshape(stack(means), {g, 1, d}), reshape(stack(vars), {g, 1, d}));
}

void Codebook::accumulate_affine(const Tensor& x, const Tensor& valid) {
  if (!opts_.affine_param) return;
  NoGradGuard no_grad;
  const int64_t g = opts_.num_codebooks, d = opts_.dim;
  const Tensor xs = to_dtype(x.detach(), embed_.dtype());
  std::vector<Tensor> counts, sums, squares;
  for (int64_t h = 0; h < g; ++h) {
    Tensor rows = select(xs, 0, h);
    if (valid.defined()) rows = index_select(rows, 0, nonzero(select(valid, 0, h)));
    counts.push_back(scalar(double(rows.size(0)), options_of(embed_)));
    sums.push_back(sum(rows, {0}, true));
    squares.push_back(sum(square(rows), {0}, true));
  }
  CodebookStatistics& p = pending_;
  if (!p.affine_count.defined()) {
    p.affine_count = zeros({g}, options_of(embed_));
    p.affine_sum = zeros({g, 1, d}, options_of(embed_));
    p.affine_sumsq = zeros({g, 1, d}, options_of(embed_));
  }
  add_(p.affine_count, stack(counts));
  add_(p.affine_sum, reshape(stack(sums), {g, 1, d}));
  add_(p.affine_sumsq, reshape(stack(squares), {g, 1, d}));
}

void Codebook::apply_affine_update() {
  CodebookStatistics& p = pending_;
  if (!opts_.affine_param || !p.affine_count.defined()) return;
  NoGradGuard no_grad;
  const Tensor n = p.affine_count, s = p.affine_sum, sq = p.affine_sumsq;
  p.affine_count = p.affine_sum = p.affine_sumsq = Tensor();
  // A table without rows leaves every statistic as it is (as update_affine
  // does), decided on the device: the counts are not read back.
  const Tensor count =
      clamp(reshape(n, {opts_.num_codebooks, 1, 1}), 1.0, std::numeric_limits<double>::quiet_NaN());
  const Tensor b_mean = s / count;
  const Tensor b_var =
      clamp(sq / count - square(b_mean), 0.0, std::numeric_limits<double>::quiet_NaN());
  set_affine_statistics(b_mean, b_var, gt(min(n), constant_like(n, 0.0)));
}

void Codebook::set_affine_statistics(const Tensor& b_mean, const Tensor& b_var,
                                     const Tensor& apply) {
  const Tensor e = embed_.detach();
  const Tensor cb_mean = mean(e, {1}, true), cb_var = var(e, {1}, 0.0, true);
  // The first update sets the statistics, later ones blend them in: the
  // device's own flag says which, so an update skipped there (`apply`
  // false) leaves the first for the next one.
  const Tensor first = ne(codebook_mean_needs_init_, constant_like(codebook_mean_needs_init_, 0.0));
  auto update = [&](const Tensor& buf, const Tensor& value, double decay) {
    Tensor next = where(first, value, buf * decay + value * (1.0 - decay));
    if (apply.defined()) next = where(apply, next, buf);
    copy_(buf, next);
  };
  update(codebook_mean_, cb_mean, opts_.affine_param_codebook_decay);
  update(codebook_var_, cb_var, opts_.affine_param_codebook_decay);
  update(batch_mean_, b_mean, opts_.affine_param_batch_decay);
  update(batch_var_, b_var, opts_.affine_param_batch_decay);
  for (const Tensor& flag : {codebook_mean_needs_init_, codebook_var_needs_init_})
    copy_(flag, apply.defined() ? where(apply, zeros_like(flag), flag) : zeros_like(flag));
  // Once any update was made, the host applies the statistics; should the
  // device have skipped it, they still hold their initial zeros and ones,
  // with which affine_codes and to_codebook_space give their input back.
  affine_initted_on_host_ = true;
}

bool Codebook::affine_initted() const { return affine_initted_on_host_; }

namespace {
Tensor stddev(const Tensor& var) {
  return sqrt(clamp(var, 1e-5, std::numeric_limits<double>::quiet_NaN()));
}
}  // namespace

Tensor Codebook::affine_codes(const Tensor& codes) const {
  if (!affine_initted()) return codes;
  return (codes - codebook_mean_) * (stddev(batch_var_) / stddev(codebook_var_)) + batch_mean_;
}

Tensor Codebook::to_codebook_space(const Tensor& x) const {
  if (!affine_initted()) return x;
  return (x - batch_mean_) * (stddev(codebook_var_) / stddev(batch_var_)) + codebook_mean_;
}

void Codebook::update_state() {
  if (!initted()) {
    // A deferred k-means initialisation (nothing else is pending).
    if (!pending_.init_samples.empty()) init_from_pending();
    return;
  }
  apply_affine_update();
  apply_ema_update();
  expire_codes();
}

}  // namespace quanta::quant
