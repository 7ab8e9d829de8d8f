#include "train/outputs.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "engine/autograd/grad_mode.h"
#include "image/grid.h"
#include "image/plot.h"

namespace quanta::train {

std::string out_file(const std::string& dir, const char* name) {
  return (std::filesystem::path(dir) / name).string();
}

std::vector<nlohmann::json> read_metrics(const std::string& path) {
  std::vector<nlohmann::json> records;
  std::ifstream in(path);
  if (!in) return records;
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    try {
      records.push_back(nlohmann::json::parse(line));
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error(path + ": line " + std::to_string(n) + " is not JSON (" + e.what() +
                               ")");
    }
  }
  return records;
}

void write_metrics(const std::string& path, const std::vector<nlohmann::json>& records) {
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    for (const auto& r : records) out << r.dump() << "\n";
    if (!out.flush()) throw std::runtime_error(tmp + ": cannot write");
  }
  std::filesystem::rename(tmp, path);
}

void append_metric(const std::string& path, const nlohmann::json& record) {
  std::ofstream out(path, std::ios::app);
  out << record.dump() << "\n";
  if (!out.flush()) throw std::runtime_error(path + ": cannot append");
}

void write_loss_plot(const std::string& path, const std::vector<nlohmann::json>& records) {
  image::Series train{"train loss", {}, {}, {31, 119, 180}, false, 1};
  // Few points against hundreds: thicker, with markers, its last value named.
  image::Series test{"test mse", {}, {}, {214, 39, 40}, true, 2};
  for (const auto& r : records) {
    const std::string kind = r.value("kind", "");
    if (kind == "train" && r["loss"].is_number()) {
      train.x.push_back(r["step"].get<double>());
      train.y.push_back(r["loss"].get<double>());
    } else if (kind == "eval" && r["test_mse"].is_number()) {
      test.x.push_back(r["step"].get<double>());
      test.y.push_back(r["test_mse"].get<double>());
    }
  }
  if (!test.y.empty()) test.name += " (last " + fmt_metric(test.y.back(), 5) + ")";
  image::PlotSpec spec{"loss", "step", "loss (log scale)", 720, 440, true};
  image::write_png(path, image::line_plot({train, test}, spec).image());
}

namespace {

std::string usage_title(const std::string& what, double usage, double perplexity) {
  return what + ": " + fmt_percent(usage) + " used, perplexity " + fmt_metric(perplexity, 1);
}

}  // namespace

void write_usage_plot(const std::string& path, const EvalResult& eval,
                      const std::string& quantizer_type) {
  std::string title = "codebook usage (test set)";
  const size_t codebooks = eval.per_codebook.size();
  // Titles print 12 pixels a character: at most 60 fit the 720-pixel width.
  std::string what = "test set";
  if (codebooks > static_cast<size_t>(kMaxUsagePanels))
    what = "all " + std::to_string(codebooks) + " codebooks (" + std::to_string(kMaxUsagePanels) +
           " below)";
  else if (codebooks > 0)
    what = "all " + std::to_string(codebooks) + " codebooks";
  if (!eval.code_totals.empty()) title = usage_title(what, eval.usage, eval.perplexity);
  image::PlotSpec spec{title, "code index", "count", 720, 440, false};
  const std::string note =
      eval.code_totals.empty() ? "no codebook (quantizer " + quantizer_type + ")" : "";
  std::vector<image::Canvas> panels{image::bar_chart(eval.code_totals, spec, note)};
  for (size_t q = 0; q < std::min(codebooks, static_cast<size_t>(kMaxUsagePanels)); ++q) {
    const CodebookFigures& c = eval.per_codebook[q];
    const image::PlotSpec level{
        usage_title(c.name, c.usage, c.perplexity), "code index", "count", 720, 240, false};
    panels.push_back(image::bar_chart(c.counts, level));
  }
  image::write_png(path, image::stack_vertically(panels).image());
}

void write_reconstructions(const std::string& path, VqVae& model, const Tensor& images,
                           const std::string& caption, int64_t n) {
  const Tensor x = images.narrow(0, 0, std::min(n, images.size(0)));
  EvalModeGuard eval_mode(model);
  Tensor y;
  {
    NoGradGuard no_grad;
    y = model.forward(x.to(model.parameters().front().device())).to(Device::cpu());
  }
  image::write_png(path, image::reconstruction_figure(x, y, 8, caption).image());
}

std::string fmt_metric(double v, int digits) {
  if (!std::isfinite(v)) return "n/a";
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

nlohmann::json per_codebook_fields(const EvalResult& eval) {
  nlohmann::json fields = nlohmann::json::object();
  if (eval.per_codebook.empty()) return fields;
  nlohmann::json usage = nlohmann::json::array(), perplexity = nlohmann::json::array();
  for (const CodebookFigures& c : eval.per_codebook) {
    usage.push_back(c.usage);
    perplexity.push_back(c.perplexity);
  }
  fields["codebook_usage_per_level"] = usage;
  fields["perplexity_per_level"] = perplexity;
  return fields;
}

std::string fmt_percent(double fraction) {
  return std::isfinite(fraction) ? fmt_metric(100 * fraction, 1) + "%" : "n/a";
}

}  // namespace quanta::train
