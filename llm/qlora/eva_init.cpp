#include "llm/qlora/eva_init.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "engine/autograd/grad_mode.h"
#include "engine/cpu/parallel.h"
#include "engine/factory.h"
#include "engine/ops/incremental_pca.h"
#include "engine/ops/index.h"
#include "engine/ops/view.h"
#include "llm/qlora/layer_taps.h"
#include "llm/qlora/lora_targets.h"
#include "quant/nf4/nf4_linear.h"

namespace quanta::llm {

namespace {

// The positions of a batch whose inputs EVA takes, flat over [rows, length]
// (PEFT's mask: the real tokens, and with use_label_mask those whose label
// is not label_mask_value), in row-major order.
std::vector<int64_t> taken_positions(const LmBatch& b, const EvaConfig& config) {
  const int64_t rows = b.ids.size(0), length = b.ids.size(1);
  const std::vector<int64_t> labels = b.labels.to(Device::cpu()).to_vector<int64_t>();
  std::vector<int64_t> out;
  for (int64_t k = 0; k < rows; ++k) {
    const int64_t real = k < int64_t(b.lengths.size()) ? b.lengths[std::size_t(k)] : length;
    for (int64_t t = 0; t < real; ++t) {
      const int64_t at = k * length + t;
      if (!config.use_label_mask || labels[std::size_t(at)] != config.label_mask_value)
        out.push_back(at);
    }
  }
  return out;
}

// The rows of a layer's input x [..., features] at `positions`.
Tensor taken_rows(const Tensor& x, const Tensor& positions) {
  const int64_t features = x.size(-1);
  return index_select(reshape(x, {x.numel() / features, features}), 0, positions);
}

// One decomposition, of the input one or more layers read.
struct Fit {
  std::size_t target = 0;  // the first layer reading it
  int64_t components = 0;
  IncrementalPCA pca;
  std::vector<bool> converged;
  bool done = false;  // converged up to its rank: not fitted until that changes
  Tensor pending{};   // this pass's rows (f32, on the host)

  bool converged_up_to(int64_t rank) const {
    return std::all_of(converged.begin(), converged.begin() + rank, [](bool c) { return c; });
  }
};

// Each fit's pending rows into its decomposition, the SVDs on the CPU's
// threads, then its convergence: each component's cosine
// similarity to the one before >= tau. A fit with fewer rows than
// components keeps what it had (PEFT skips it too).
void fit_pending(std::vector<Fit>& fits, double tau) {
  std::vector<Fit*> taking;
  std::vector<IncrementalPCA*> pcas;
  std::vector<Tensor> rows;
  std::vector<std::vector<double>> previous;
  for (Fit& f : fits) {
    if (f.pending.defined() && f.pending.size(0) >= f.components) {
      taking.push_back(&f);
      pcas.push_back(&f.pca);
      rows.push_back(f.pending);
      previous.push_back(f.pca.components_values());
    }
    f.pending = Tensor();
  }
  // A thread's worth at a time: each decomposes a matrix of its batch's
  // rows in f64, so all at once would hold every layer's.
  const std::size_t chunk = std::size_t(std::max(1, num_threads()));
  for (std::size_t first = 0; first < pcas.size(); first += chunk) {
    const std::size_t last = std::min(pcas.size(), first + chunk);
    IncrementalPCA::partial_fit_all(
        {pcas.begin() + std::ptrdiff_t(first), pcas.begin() + std::ptrdiff_t(last)},
        {rows.begin() + std::ptrdiff_t(first), rows.begin() + std::ptrdiff_t(last)});
  }
  for (std::size_t i = 0; i < taking.size(); ++i) {
    Fit& f = *taking[i];
    if (previous[i].empty()) continue;
    const std::vector<double>& now = f.pca.components_values();
    const std::size_t d = now.size() / std::size_t(f.components);
    for (int64_t c = 0; c < f.components; ++c) {
      double dot = 0, a = 0, b = 0;
      for (std::size_t j = 0; j < d; ++j) {
        const double x = now[std::size_t(c) * d + j], y = previous[i][std::size_t(c) * d + j];
        dot += x * y;
        a += x * x;
        b += y * y;
      }
      f.converged[std::size_t(c)] = dot / std::max(std::sqrt(a * b), 1e-8) >= tau;
    }
  }
}

// The hash of the rows a layer read (PEFT compares the first batch's
// inputs by hash to find the layers that share one).
std::size_t rows_hash(const Tensor& rows) {
  const std::vector<float> v = rows.to(Device::cpu()).to(DType::f32).to_vector<float>();
  return std::hash<std::string_view>{}(
      std::string_view(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float)));
}

// A setting as a person writes it (0.99, not 0.990000).
std::string setting_text(double value) {
  std::ostringstream os;
  os << value;
  return os.str();
}

// A layer's most components, round(r x rho) as PEFT computes it (Python's
// round: half to even); refused above its input features.
int64_t most_components(const char* who, const EvaTarget& t, double rho, int64_t in_features) {
  const int64_t most = int64_t(std::nearbyint(double(t.r) * rho));
  if (most > in_features)
    throw std::invalid_argument(std::string("[") + who + "] layer " + t.name + " may take " +
                                std::to_string(most) + " components (round(r x rho), rho " +
                                setting_text(rho) + "), more than its " +
                                std::to_string(in_features) + " input features: lower rho or r");
  return most;
}

}  // namespace

EvaData eva_batches_in_order(const LmExamples& examples, int64_t rows) {
  if (rows < 1)
    throw std::invalid_argument("[eva_batches_in_order] rows must be >= 1, got " +
                                std::to_string(rows));
  EvaData data;
  data.batches = (examples.size() + rows - 1) / rows;
  data.batch = [&examples, rows](int64_t i) {
    std::vector<int64_t> picked;
    for (int64_t r = rows * i; r < std::min(examples.size(), rows * (i + 1)); ++r)
      picked.push_back(r);
    return examples.batch(from_vector<int64_t>(picked, {int64_t(picked.size())}));
  };
  return data;
}

EvaStarts eva_starts(CausalLM& model, const std::vector<EvaTarget>& targets,
                     const EvaConfig& config, const EvaData& data) {
  if (data.batches < 1 || !data.batch)
    throw std::invalid_argument("[eva_starts] EVA needs at least one batch of data");
  if (targets.empty()) throw std::invalid_argument("[eva_starts] no layers to start");
  for (const EvaTarget& t : targets)
    if (t.r < 1)
      throw std::invalid_argument("[eva_starts] layer " + t.name + " has r " + std::to_string(t.r));
  NoGradGuard no_grad;
  EvalModeGuard eval(model);
  std::vector<std::string> names;
  for (const EvaTarget& t : targets) names.push_back(t.name);
  LayerTaps taps(model, names, "eva_starts");
  const std::size_t n = targets.size();
  // Each layer's most components; the layers reading one input (which
  // have the same features) each as many as the most of them.
  std::vector<int64_t> most(n);
  int64_t budget = 0;
  for (std::size_t i = 0; i < n; ++i) {
    most[i] = most_components("eva_starts", targets[i], config.rho, taps.in_features(i));
    budget += targets[i].r;
  }
  const Device device = model.device();
  int64_t forwards = 0, positions = 0;
  const auto forward = [&](int64_t index, const std::function<void(const Tensor&)>& on_positions) {
    const LmBatch b = data.batch(index % data.batches);
    const std::vector<int64_t> taken = taken_positions(b, config);
    on_positions(from_vector<int64_t>(taken, {int64_t(taken.size())}).to(device));
    positions += int64_t(taken.size());
    model.hidden_states(b.ids.to(device), nullptr, Tensor(),
                        b.position_ids.defined() ? b.position_ids.to(device) : Tensor());
    ++forwards;
  };

  // The first batch: which layers read the same input.
  Tensor first_positions;
  std::vector<std::size_t> hashes(n);
  std::vector<bool> seen(n, false);
  for (std::size_t i = 0; i < n; ++i)
    taps.set(i, [&, i](const Tensor& x) {
      if (first_positions.numel() == 0) return;
      hashes[i] = rows_hash(taken_rows(x, first_positions));
      seen[i] = true;
    });
  forward(0, [&](const Tensor& p) { first_positions = p; });
  for (std::size_t i = 0; i < n; ++i) taps.remove(i);
  positions = 0;
  // input_of[i]: the first layer with the same input (i itself for the first).
  std::vector<std::size_t> input_of(n);
  for (std::size_t i = 0; i < n; ++i) {
    input_of[i] = i;
    for (std::size_t j = 0; j < i; ++j)
      if (seen[i] && seen[j] && input_of[j] == j && hashes[j] == hashes[i]) {
        input_of[i] = j;
        break;
      }
  }
  for (std::size_t i = 0; i < n; ++i) most[input_of[i]] = std::max(most[input_of[i]], most[i]);
  for (std::size_t i = 0; i < n; ++i) most[i] = most[input_of[i]];

  std::vector<Fit> fits;
  std::vector<std::size_t> fit_of(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (input_of[i] != i) {
      fit_of[i] = fit_of[input_of[i]];
      continue;
    }
    fit_of[i] = fits.size();
    std::optional<Generator> sketch;
    if (data.svd_niter >= 0) sketch = Generator::named(data.seed, "lora.eva." + targets[i].name);
    fits.push_back({i, most[i], IncrementalPCA(most[i], data.svd_niter, std::move(sketch)),
                    std::vector<bool>(std::size_t(most[i]), false)});
  }
  // PEFT's order of the explained variances it ranks (a stable sort keeps
  // equal values in it): the first layer of each input in model order, then
  // the others, input by input.
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < n; ++i)
    if (input_of[i] == i) order.push_back(i);
  for (std::size_t f = 0; f < fits.size(); ++f)
    for (std::size_t i = 0; i < n; ++i)
      if (input_of[i] != i && input_of[i] == fits[f].target) order.push_back(i);

  std::vector<int64_t> ranks = most;
  const auto redistribute = [&] {
    std::vector<std::pair<double, std::size_t>> shares;
    for (std::size_t i : order) {
      const std::vector<double>& ratio = fits[fit_of[i]].pca.explained_variance_ratio_values();
      for (int64_t c = 0; c < most[i]; ++c) shares.emplace_back(ratio[std::size_t(c)], i);
    }
    std::stable_sort(shares.begin(), shares.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    std::fill(ranks.begin(), ranks.end(), 0);
    for (std::size_t s = 0; s < std::min(shares.size(), std::size_t(budget)); ++s)
      ++ranks[shares[s].second];
    // The layer that holds the decomposition takes the largest rank of
    // those sharing it: its convergence is the one checked.
    for (std::size_t i : order)
      if (input_of[i] != i && ranks[input_of[i]] < ranks[i])
        std::swap(ranks[input_of[i]], ranks[i]);
  };

  int64_t batch = 0;
  while (true) {
    bool all_done = true;
    for (Fit& f : fits) {
      // A new rank can ask more of a fit that was done: it takes batches again.
      f.done = f.converged_up_to(ranks[f.target]);
      all_done = all_done && f.done;
    }
    if (all_done) break;
    if (forwards >= data.max_forwards) {
      std::string waiting;
      for (const Fit& f : fits)
        if (!f.done)
          waiting +=
              (waiting.empty() ? "" : ", ") + targets[f.target].name +
              (f.pca.fitted() ? ""
                              : " (never fitted: fewer positions than its " +
                                    std::to_string(f.components) + " components in every batch)");
      throw std::invalid_argument("[eva_starts] after " + std::to_string(forwards) +
                                  " forward passes over " + std::to_string(data.batches) +
                                  " batches, the inputs of " + waiting +
                                  " have not converged (tau " + setting_text(config.tau) +
                                  "): lower tau, raise the limit, or give more or longer examples");
    }
    Tensor taken;
    for (std::size_t f = 0; f < fits.size(); ++f) {
      if (fits[f].done) continue;
      taps.set(fits[f].target, [&, f](const Tensor& x) {
        if (taken.numel() > 0)
          fits[f].pending = taken_rows(x, taken).to(Device::cpu()).to(DType::f32);
      });
    }
    forward(batch++, [&](const Tensor& p) { taken = p; });
    for (const Fit& f : fits) taps.remove(f.target);
    fit_pending(fits, config.tau);
    int64_t converged = 0;
    for (const Fit& f : fits) converged += f.done;
    if (data.on_forward) data.on_forward(forwards, converged, int64_t(fits.size()));
    if (std::all_of(fits.begin(), fits.end(), [](const Fit& f) { return f.pca.fitted(); }))
      redistribute();
  }

  EvaStarts out;
  out.forwards = forwards;
  out.positions = positions;
  for (std::size_t i = 0; i < n; ++i) {
    EvaLayer l;
    l.name = targets[i].name;
    l.r = ranks[i];
    l.lora_alpha = targets[i].lora_alpha;
    if (config.adjust_scaling_factors && l.r != targets[i].r && l.r > 0)
      l.lora_alpha *= double(l.r) / double(targets[i].r);
    if (input_of[i] != i) l.input_of = targets[input_of[i]].name;
    if (l.r > 0) {
      const Fit& f = fits[fit_of[i]];
      const std::vector<double>& c = f.pca.components_values();
      const std::vector<double>& s = f.pca.singular_values_values();
      const std::size_t d = c.size() / std::size_t(f.components);
      std::vector<double> a(c.begin(), c.begin() + std::ptrdiff_t(std::size_t(l.r) * d));
      if (config.whiten)
        for (int64_t r = 0; r < l.r; ++r)
          for (std::size_t j = 0; j < d; ++j)
            a[std::size_t(r) * d + j] /= std::sqrt(s[std::size_t(r)]);
      l.lora_A = from_vector<double>(a, {l.r, int64_t(d)});
    }
    out.layers.push_back(std::move(l));
  }
  return out;
}

QLoRAReport apply_qlora_eva(CausalLM& model, QLoRAOptions& o, const EvaData& data,
                            EvaStarts* starts) {
  check_lora_settings(o.lora);
  if (o.lora.init_lora_weights != LoraInit::eva)
    throw std::invalid_argument(std::string("[apply_qlora_eva] init_lora_weights is ") +
                                lora_init_name(o.lora.init_lora_weights) + ", not eva");
  // The layers and their settings, refused as apply_qlora refuses them
  // before anything changes.
  std::vector<EvaTarget> targets;
  for (const auto& [name, shape] : planned_trained_tensors(model, o)) {
    constexpr std::string_view suffix = ".lora_A.weight";
    if (!name.ends_with(suffix)) continue;
    EvaTarget t;
    t.name = name.substr(0, name.size() - suffix.size());
    t.r = shape[0];
    t.lora_alpha = lora_layer_settings(o.lora, t.name)->lora_alpha;
    most_components("apply_qlora_eva", t, o.lora.eva_config.rho, shape[1]);
    targets.push_back(std::move(t));
  }
  if (data.batches < 1 || !data.batch)
    throw std::invalid_argument("[apply_qlora_eva] EVA needs at least one batch of data");
  // EVA reads the inputs the adapters will see: those of the NF4 base.
  bool quantized = false;
  for (auto& [name, m] : model.named_modules())
    quantized = quantized || dynamic_cast<quant::NF4Linear*>(m) != nullptr;
  std::optional<QLoRAReport> base;
  if (!quantized) base = quantize_base(model, o.quantization);
  const EvaStarts made = eva_starts(model, targets, o.lora.eva_config, data);

  LoraSettings& l = o.lora;
  std::vector<std::string> names;
  std::vector<std::pair<std::string, int64_t>> rank_pattern;
  std::vector<std::pair<std::string, double>> alpha_pattern;
  o.given_lora_A.clear();
  for (const EvaLayer& e : made.layers) {
    if (e.r == 0) continue;
    names.push_back(e.name);
    if (e.r != l.r) rank_pattern.emplace_back(e.name, e.r);
    if (e.lora_alpha != l.lora_alpha) alpha_pattern.emplace_back(e.name, e.lora_alpha);
    o.given_lora_A[e.name] = e.lora_A;
  }
  // PEFT shortens a list of 20 names or more to the suffixes that tell
  // them apart from every other module (the layers left without a rank
  // among those).
  if (names.size() >= 20) {
    std::vector<std::string> others;
    for (auto& [name, m] : model.named_modules())
      if (!name.empty() && std::find(names.begin(), names.end(), name) == names.end())
        others.push_back(name);
    l.target_modules = minimal_target_modules(names, others);
  } else {
    l.target_modules = names;
  }
  l.target_modules_regex.clear();
  l.exclude_modules.clear();
  l.exclude_modules_regex.clear();
  l.layers_to_transform.clear();
  l.layers_pattern.clear();
  l.rank_pattern = std::move(rank_pattern);
  l.alpha_pattern = std::move(alpha_pattern);
  QLoRAReport report = apply_qlora(model, o);
  if (base) {
    report.total_parameters = base->total_parameters;
    for (std::size_t i = 0; i < report.layers.size() && i < base->layers.size(); ++i)
      report.layers[i].bytes_before = base->layers[i].bytes_before;
  }
  if (starts) *starts = made;
  return report;
}

}  // namespace quanta::llm
