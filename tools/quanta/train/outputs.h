#pragma once
// The files a run leaves in its output folder besides the checkpoint: the
// metrics log (JSON lines) and the three PNGs.
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/tensor.h"
#include "train/metrics.h"
#include "train/vqvae.h"

namespace quanta::train {

/** Output file names inside --out. */
inline constexpr const char* kCheckpointFile = "checkpoint.safetensors";
inline constexpr const char* kMetricsFile = "metrics.jsonl";
inline constexpr const char* kReconstructionsFile = "reconstructions.png";
inline constexpr const char* kUsageFile = "codebook_usage.png";
inline constexpr const char* kLossFile = "loss.png";
/** Per-codebook charts drawn in codebook_usage.png at most. */
inline constexpr int64_t kMaxUsagePanels = 16;

/** `name` inside the output folder `dir`. */
std::string out_file(const std::string& dir, const char* name);

/** The records of a metrics file, in order ("kind": "header", "train" or "eval");
 * an absent file gives none; a malformed line is an error naming the file. */
std::vector<nlohmann::json> read_metrics(const std::string& path);
/** Rewrites `path` with `records` (atomically: temporary file and rename). */
void write_metrics(const std::string& path, const std::vector<nlohmann::json>& records);
/** Appends one record as a line. */
void append_metric(const std::string& path, const nlohmann::json& record);

/** The loss curve: train loss per logged step and test MSE per evaluation,
 * log-scaled y. */
void write_loss_plot(const std::string& path, const std::vector<nlohmann::json>& records);

/** The bar chart of code counts on the test set (a note instead of bars when
 * the quantizer has no codebook). With several codebooks (residual levels,
 * groups, heads) the chart of their summed counts is followed by one chart
 * per codebook, each titled with its usage and perplexity (the first
 * kMaxUsagePanels; the top title says when there are more). All count the
 * whole test set. */
void write_usage_plot(const std::string& path, const EvalResult& eval,
                      const std::string& quantizer_type);

/** Up to `n` test images (rows of 8) above their reconstructions by `model`,
 * rows labelled IN / OUT, under `caption` (what made them: the quantizer, the
 * step, the test MSE). */
void write_reconstructions(const std::string& path, VqVae& model, const Tensor& images,
                           const std::string& caption, int64_t n = 16);

/** The per-codebook lists of an evaluation as metrics.jsonl and `quanta eval
 * --json` write them: {"codebook_usage_per_level": [...],
 * "perplexity_per_level": [...]}, in index order; empty for one codebook. */
nlohmann::json per_codebook_fields(const EvalResult& eval);

/** A metric for printing: "n/a" for NaN, else printf("%.*f"). */
std::string fmt_metric(double v, int digits);
/** A fraction as a percentage with one decimal ("97.3%"); "n/a" for NaN. */
std::string fmt_percent(double fraction);

}  // namespace quanta::train
