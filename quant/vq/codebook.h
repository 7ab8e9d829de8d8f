#pragma once
// The codebook of a VectorQuantize layer: G independent tables of K codes,
// their EMA statistics, k-means initialisation and dead-code expiry.
// State dict keys follow the reference: embed [G, K, D], embed_avg [G, K, D],
// cluster_size [G, K], initted (bool scalar).
#include <cstdint>

#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "quant/step_stream.h"
#include "quant/vq/codebook_statistics.h"

namespace quanta::quant {

/** How a Codebook is built (VectorQuantize fills these from its options). */
struct CodebookOptions {
  int64_t dim = 0;
  int64_t codebook_size = 0;
  int64_t num_codebooks = 1;
  bool kmeans_init = false;
  int64_t kmeans_iters = 10;
  double decay = 0.8;
  double eps = 1e-5;
  /** Codes whose EMA cluster size falls below this are replaced (0 = off). */
  double threshold_ema_dead_code = 0;
  bool use_cosine_sim = false;
  /** Recompute embed from the EMA statistics on apply_ema_update. */
  bool ema_update = true;
  /** With ema_update: the EMA step updates cluster_size and embed_avg but
   * leaves embed to an explicit update_ema(). */
  bool manual_ema_update = false;
  /** embed is an nn parameter (learnable codebook or orthogonal loss). */
  bool embed_is_parameter = false;
  /** Match the codes' running mean / variance to the inputs' (see
   * update_affine). */
  bool affine_param = false;
  double affine_param_batch_decay = 0.99;
  double affine_param_codebook_decay = 0.9;
};

class Codebook : public Module, public StepKeyed {
 public:
  /** Keys the k-means and dead-code draws by `step` (QuantizerSync pins it to
   * the reconciliation count, so a resumed run draws what the uninterrupted
   * one did). */
  void pin_random_step(uint64_t step) override {
    kmeans_gen_.pin(step);
    dead_code_gen_.pin(step);
  }
  /** Initial codes: kaiming-uniform U(-sqrt(6/(K D)), +sqrt(6/(K D))) drawn
   * from `gen` (l2-normalised for cosine), or zeros awaiting k-means. The
   * k-means and dead-code streams are keyed from `gen` too. */
  Codebook(const CodebookOptions& opts, Generator& gen);

  const CodebookOptions& options() const { return opts_; }
  /** [G, K, D] */
  const Tensor& embed() const { return embed_; }
  const Tensor& embed_avg() const { return embed_avg_; }
  const Tensor& cluster_size() const { return cluster_size_; }
  /** True once the codes are initialised (always, without k-means). */
  bool initted() const;

  /** How many times one forward of the owning layer calls this codebook: 1,
   * or the number of levels for a codebook shared by the levels of a
   * residual or hierarchical stack (the stack sets it). A distributed run
   * pools every rank's k-means samples and dead-code candidates by call,
   * then by rank (QuantizerSync): for one forward a step, exactly the order
   * in which one process on the whole batch holds them. */
  int64_t calls_per_forward() const { return calls_per_forward_; }
  /** Throws std::invalid_argument when `calls` < 1. */
  void set_calls_per_forward(int64_t calls);

  /** k-means initialisation from `samples`, one [N_g, D] tensor per codebook
   * (rows already projected/normalised, masked rows removed). Codebooks with
   * no rows are left uninitialised... and so is the whole codebook: nothing
   * happens unless every codebook has rows. Sets embed, embed_avg,
   * cluster_size as the reference does, then initted. */
  void init_from_samples(const std::vector<Tensor>& samples);

  /** Keeps one forward's rows `x` [G, T, D] (valid [G, T] bool, undefined =
   * all) as k-means samples for a deferred initialisation (pending().
   * init_samples); local only. */
  void add_init_samples(const Tensor& x, const Tensor& valid);
  /** Initialises from the pending init_samples (k-means on each codebook's
   * rows) and clears them, with every other pending statistic: statistics
   * gathered against the uninitialised codes mean nothing. */
  void init_from_pending();

  /** Adds one forward's statistics: `x` [G, T, D] the codebook inputs,
   * `indices` [G, T] their codes, `valid` [G, T] bool (undefined = all).
   * Local only; call it once per forward. */
  void accumulate(const Tensor& x, const Tensor& indices, const Tensor& valid);
  /** The statistics accumulated since the last update. */
  const CodebookStatistics& pending() const { return pending_; }
  /** Mutable, for a distributed wrapper that reduces them across ranks. */
  CodebookStatistics& pending() { return pending_; }

  /** EMA step from the pending statistics: cluster_size and embed_avg take
   * their folded lerps, then (with ema_update) embed = embed_avg / smoothed
   * cluster size, with Laplace smoothing (c + eps) / (n + K eps) * n,
   * l2-normalised for cosine. Counts and sums are then cleared; candidates
   * are kept for expire_codes. No-op when nothing is pending. */
  void apply_ema_update();
  /** The two halves of apply_ema_update(), for a caller that reduces the
   * counts before the sums (QuantizerSync decides dead codes from the
   * counts while the sums travel): the cluster_size lerp from pending
   * counts (then cleared; no-op when there are none)... */
  void apply_cluster_ema();
  /** ...then, after it, the embed_avg lerp and the embed recompute from
   * pending sums and the updated cluster_size; clears all pending
   * statistics but the candidates. */
  void apply_embed_ema();
  /** Dead-code expiry: every code whose cluster_size < threshold is replaced
   * by a pending candidate row (drawn from the dead-code stream), its
   * cluster_size reset to the threshold and embed_avg to row * threshold.
   * Clears the candidates. No-op when the threshold is 0 or none expired. */
  void expire_codes();
  /** One table's rows of `per_table` (pending().candidates or
   * init_samples: every forward's [S_i, D] block, concatenated), [0, D] when
   * there are none. */
  Tensor table_rows(const std::vector<std::vector<Tensor>>& per_table, int64_t table) const;
  /** Dead-code expiry drawing from `pools`, one [P_g, D] tensor of candidate
   * rows per codebook (a distributed run passes every rank's candidates in
   * rank order). Same rule as expire_codes(); pending candidates are cleared.
   * With P_g < the number of expired codes only P_g of them, chosen at
   * random, are replaced now (each by a distinct row); the rest stay expired
   * for a later step (vector-quantize-pytorch 1.32: drawing with replacement
   * made duplicate codes). */
  void expire_codes(const std::vector<Tensor>& pools);
  /** The two halves of expire_codes(pools), decided on the device without
   * reading it back (no host sync), for a caller that never holds the whole
   * pool (QuantizerSync). First the draw: for each table whose pool holds
   * `pool_sizes[g]` > 0 rows (every rank's candidates in rank order), the
   * pool position of each code's replacement, [K] int64, -1 for the codes
   * not replaced now. The codes replaced are the expired ones, or when the
   * pool holds fewer rows P than m = (codes expiring), P of them chosen by a
   * random permutation of the codes; the j-th of them (ascending) takes the
   * j-th entry of a random permutation of the pool, as the reference's
   * sample_vectors does. Undefined for a table with an empty pool, and for
   * every table when expiry is off. Draws from the dead-code stream (the
   * same on every rank, whatever expires) and remembers which codes it
   * chose for replace_expired... */
  std::vector<Tensor> draw_replacements(const std::vector<int64_t>& pool_sizes);
  /** ...then the replacement: `rows[g]` [K, D] (any float dtype) holds the
   * new row of every code of table g that the last draw_replacements chose
   * (the other rows are ignored; undefined leaves the table untouched; with
   * no draw since the last replacement, every expired code): embed takes the row,
   * embed_avg row * threshold, cluster_size the threshold. Clears the
   * pending candidates. Throws std::invalid_argument naming the table when a
   * shape is not [K, D]. */
  void replace_expired(const std::vector<Tensor>& rows);
  /** The codes that expire now: cluster_size < threshold, [G, K] bool
   * (all false when dead-code expiry is off). */
  Tensor expired_codes() const;
  /** How many codes of each table expire now: one read of the device (none
   * when dead-code expiry is off). Training never calls it. */
  std::vector<int64_t> expired_counts() const;
  /** embed <- embed_avg / Laplace-smoothed cluster sizes (l2-normalised for
   * cosine): what the EMA step ends with, for manual_ema_update. */
  void update_ema();
  /** apply_affine_update(), apply_ema_update() then expire_codes(); before
   * initialisation, the deferred k-means initialisation from pending samples
   * instead. */
  void update_state();

  // ---- affine_param: running statistics, buffers batch_mean, batch_variance,
  // codebook_mean, codebook_variance [G, 1, D], codebook_mean_needs_init and
  // codebook_variance_needs_init [1] (vector-quantize-pytorch's names) ----
  /** Updates the running mean and (biased) variance of the codes (decay
   * affine_param_codebook_decay) and of the valid rows of `x` [G, T, D]
   * (decay affine_param_batch_decay); the first call sets them. Like a batch
   * norm's running statistics these change in the (training) forward itself. */
  void update_affine(const Tensor& x, const Tensor& valid);
  /** The deferred form of update_affine (distributed training): adds the
   * valid rows' count, sum and sum of squares to pending(); local only. */
  void accumulate_affine(const Tensor& x, const Tensor& valid);
  /** Applies the pending affine statistics as update_affine would for one
   * batch holding all their rows (biased variance sumsq/n - mean^2), and
   * clears them. No-op when nothing is pending or a table saw no rows. */
  void apply_affine_update();
  /** `codes` [G, K, D] moved to the batch statistics:
   * (c - mean_cb) * std_b / std_cb + mean_b (std = sqrt(max(var, 1e-5)));
   * `codes` itself without affine_param or before the first update. */
  Tensor affine_codes(const Tensor& codes) const;
  /** The inverse map for inputs [G, T, D] (what the EMA statistics see). */
  Tensor to_codebook_space(const Tensor& x) const;

 private:
  // `apply` (a device bool scalar; undefined: true) keeps every statistic
  // as it is where false.
  void set_affine_statistics(const Tensor& batch_mean, const Tensor& batch_var,
                             const Tensor& apply = Tensor());
  // embed from embed_avg and cluster_size (ema_update): after k-means and
  // after every EMA step.
  void embed_from_statistics();
  // affine_param is on and its running statistics have been set once.
  bool affine_initted() const;
  // The host's copies of initted and the affine "needs init" flags: read
  // every forward, they must not cost a device read (Module::reload_host_state).
  void read_host_state() override;

  CodebookOptions opts_;
  int64_t calls_per_forward_ = 1;
  bool initted_on_host_ = false, affine_initted_on_host_ = false;
  Tensor embed_, embed_avg_, cluster_size_, initted_;
  Tensor batch_mean_, batch_var_, codebook_mean_, codebook_var_;
  Tensor codebook_mean_needs_init_, codebook_var_needs_init_;
  CodebookStatistics pending_;
  StepStream kmeans_gen_, dead_code_gen_;
  // Per table, [K] i64: the last draw_replacements' pool positions, -1 for
  // the codes it did not choose (undefined: that table's expired codes).
  std::vector<Tensor> replacing_;
  // replace_expired(sources) (from_pools false: [K, D] rows by code) or
  // expire_codes(pools)' second half (true: each replaced code's row at its
  // drawn pool position): one replace_codes launch a table.
  void write_replacements(const std::vector<Tensor>& sources, bool from_pools);
};

}  // namespace quanta::quant
