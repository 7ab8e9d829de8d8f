#include "train/checkpoint.h"

#include <cmath>
#include <cstdio>
#include <stdexcept>

#include "engine/io/safetensors.h"
#include "train/config.h"

namespace quanta::train {

void save_checkpoint(const std::string& path, const Module& model, const Optimizer* optimizer,
                     const CheckpointInfo& info) {
  save_checkpoint(path, model.state_dict(), optimizer, info);
}

void save_checkpoint(const std::string& path, const StateDict& model_state,
                     const Optimizer* optimizer, const CheckpointInfo& info) {
  save_checkpoint(path, model_state, optimizer ? optimizer->state_dict() : StateDict{}, info);
}

void save_checkpoint(const std::string& path, const StateDict& model_state,
                     const StateDict& optimizer_state, const CheckpointInfo& info) {
  StateDict tensors = add_prefix(model_state, "model.");
  for (auto& entry : add_prefix(optimizer_state, "optim.")) tensors.push_back(std::move(entry));
  std::map<std::string, std::string> meta = {
      {"format", info.format},
      {"framework", "quanta"},
      {"config", info.config.dump()},
      {"step", std::to_string(info.step)},
      {"epoch", std::to_string(info.epoch)},
      {"data_order",
       "epoch e visits randperm(N) drawn from Generator::named(seed, \"data-order\")"
       ".fork(\"epoch-<e>\"); step s reads batch s mod ceil(N / batch_size) of its epoch"},
      {"rng", info.rng.dump()},
  };
  if (!info.results.empty()) meta["results"] = info.results.dump();
  if (!info.log_window.empty()) meta["log_window"] = info.log_window.dump();
  io::save_safetensors(path, tensors, meta);
}

Checkpoint load_checkpoint(const std::string& path, const std::string& format) {
  io::SafetensorsFile file = io::load_safetensors(path);
  auto meta = [&](const char* key) -> const std::string& {
    auto it = file.metadata.find(key);
    if (it == file.metadata.end())
      throw std::runtime_error(path + ": not a quanta training checkpoint (no '" +
                               std::string(key) + "' in its metadata)");
    return it->second;
  };
  if (meta("format") != format)
    throw std::runtime_error(path + ": checkpoint format '" + meta("format") + "', expected '" +
                             format + "'");
  Checkpoint ck;
  ck.info.format = format;
  try {
    ck.info.config = nlohmann::json::parse(meta("config"));
    ck.info.rng = nlohmann::json::parse(meta("rng"));
    ck.info.step = std::stoll(meta("step"));
    ck.info.epoch = std::stoll(meta("epoch"));
    if (auto it = file.metadata.find("results"); it != file.metadata.end())
      ck.info.results = nlohmann::json::parse(it->second);
    if (auto it = file.metadata.find("log_window"); it != file.metadata.end())
      ck.info.log_window = nlohmann::json::parse(it->second);
  } catch (const std::runtime_error&) {
    throw;
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": corrupt checkpoint metadata (" + e.what() + ")");
  }
  ck.model = strip_prefix(file.tensors, "model.");
  ck.optimizer = strip_prefix(file.tensors, "optim.");
  return ck;
}

std::unique_ptr<VqVae> restore_model(const Checkpoint& ck, const std::string& path) {
  TrainConfig cfg;
  try {
    cfg = config_from_json(ck.info.config);
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": bad config in the checkpoint (" + e.what() + ")");
  }
  Generator gen = Generator::named(cfg.seed, "model");
  auto model = std::make_unique<VqVae>(cfg.model,
                                       make_quantizer(cfg.quantizer, cfg.model.dim, cfg.seed), gen);
  try {
    model->load_state_dict(ck.model);
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": the model tensors do not fit its config (" + e.what() + ")");
  }
  model->quantizer().load_extra_state(ck.info.rng.value("quantizer", nlohmann::json::object()));
  model->eval();
  return model;
}

std::vector<std::string> non_finite_tensors(const Checkpoint& ck) {
  std::vector<std::string> bad;
  for (const auto& [name, t] : ck.model) {
    if (!is_floating(t.dtype())) continue;
    for (double v : t.to_vector<double>())
      if (!std::isfinite(v)) {
        bad.push_back("model." + name);
        break;
      }
  }
  return bad;
}

std::string non_finite_summary(const Checkpoint& ck, const std::string& path) {
  const std::vector<std::string> bad = non_finite_tensors(ck);
  if (bad.empty()) return "";
  std::string s = path + ": '" + bad.front() + "' holds NaN or Inf values";
  if (bad.size() > 1) s += " (and " + std::to_string(bad.size() - 1) + " more tensors)";
  return s;
}

std::string model_fingerprint(const Checkpoint& ck) {
  uint64_t h = 14695981039346656037ull;
  auto mix = [&h](const void* data, std::size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  };
  for (const auto& [name, t] : ck.model) {
    mix(name.data(), name.size() + 1);  // the terminating zero separates names
    for (int64_t d : t.shape()) mix(&d, sizeof d);
    const Tensor c = t.is_contiguous() ? t : t.contiguous();
    mix(c.raw_data(), c.nbytes());
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

}  // namespace quanta::train
