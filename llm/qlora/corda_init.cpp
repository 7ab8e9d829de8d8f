#include "llm/qlora/corda_init.h"

#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/io/safetensors.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/join.h"
#include "engine/ops/linalg.h"
#include "engine/ops/reduce.h"
#include "engine/ops/reductions.h"
#include "engine/ops/view.h"
#include "llm/qlora/layer_taps.h"

namespace quanta::llm {

namespace {

// Whether two tensors are one input: the same elements of the same storage.
bool same_input(const Tensor& a, const Tensor& b) {
  return a.storage() == b.storage() && a.offset() == b.offset() && a.shape() == b.shape() &&
         a.strides() == b.strides();
}

constexpr const char* kCovarianceFormat = "quanta.corda_covariances";

}  // namespace

void save_corda_covariances(const std::string& path, const std::vector<std::string>& layers,
                            const std::vector<Tensor>& covariances, int64_t samples) {
  if (layers.size() != covariances.size())
    throw std::invalid_argument("[save_corda_covariances] " + std::to_string(layers.size()) +
                                " layers and " + std::to_string(covariances.size()) +
                                " covariances");
  io::TensorMap tensors;
  nlohmann::ordered_json same = nlohmann::ordered_json::object();
  for (std::size_t i = 0; i < layers.size(); ++i) {
    std::size_t first = i;
    for (std::size_t j = 0; j < i && first == i; ++j)
      if (covariances[j].storage() == covariances[i].storage()) first = j;
    if (first == i)
      tensors.emplace_back(layers[i], covariances[i].to(DType::f32));
    else
      same[layers[i]] = layers[first];
  }
  io::save_safetensors(path, tensors,
                       {{"format", kCovarianceFormat},
                        {"samples", std::to_string(samples)},
                        {"same_input", same.dump()}});
}

std::vector<Tensor> load_corda_covariances(const std::string& path,
                                           const std::vector<std::string>& layers, Device device,
                                           int64_t* samples) {
  const io::SafetensorsFile file = io::load_safetensors(path);
  const auto format = file.metadata.find("format");
  if (format == file.metadata.end() || format->second != kCovarianceFormat)
    throw std::invalid_argument(path +
                                " is not a CorDA covariance file (its metadata has no "
                                "\"format\": \"" +
                                std::string(kCovarianceFormat) + "\")");
  std::map<std::string, Tensor> by_name;
  for (const auto& [name, t] : file.tensors) by_name[name] = t.to(device);
  nlohmann::json same = nlohmann::json::object();
  if (const auto it = file.metadata.find("same_input"); it != file.metadata.end())
    same = nlohmann::json::parse(it->second, nullptr, false);
  if (!same.is_object())
    throw std::invalid_argument(path + ": its \"same_input\" metadata is not a JSON object");
  std::vector<Tensor> out;
  for (const std::string& layer : layers) {
    std::string holder = layer;
    if (same.contains(layer) && same[layer].is_string()) holder = same[layer].get<std::string>();
    const auto it = by_name.find(holder);
    if (it == by_name.end())
      throw std::invalid_argument(path + " holds no input covariance for layer " + layer +
                                  " (it was written for other layers: delete it, or name "
                                  "another file, to read the samples again)");
    out.push_back(it->second);
  }
  if (samples) {
    const auto it = file.metadata.find("samples");
    try {
      *samples = it == file.metadata.end() ? 0 : std::stoll(it->second);
    } catch (const std::exception&) {
      throw std::invalid_argument(path + ": its \"samples\" metadata is not a count: \"" +
                                  it->second + "\"");
    }
  }
  return out;
}

CordaData corda_samples_in_order(const LmExamples& examples, int64_t count) {
  if (count < 0)
    throw std::invalid_argument("[corda_samples_in_order] count must be >= 0, got " +
                                std::to_string(count));
  CordaData data;
  data.samples = count == 0 ? examples.size() : std::min(count, examples.size());
  data.sample = [&examples](int64_t i) { return examples.batch(from_vector<int64_t>({i}, {1})); };
  return data;
}

std::vector<Tensor> corda_covariances(CausalLM& model, const std::vector<std::string>& layers,
                                      const CordaData& data) {
  if (data.samples < 1 || !data.sample)
    throw std::invalid_argument("[corda_covariances] CorDA needs at least one sample of data");
  // The passes run the float model: weights left in their files come in.
  model.read_deferred_weights();
  NoGradGuard no_grad;
  EvalModeGuard eval(model);
  LayerTaps taps(model, layers, "corda_covariances");
  const Device device = model.device();
  const std::size_t n = layers.size();
  std::vector<Tensor> covariance(n);
  // input_of[i]: the first layer reading layer i's input (i itself for the
  // first), found on the first sample by identity: the model hands them one
  // tensor.
  std::vector<std::size_t> input_of(n);
  std::vector<Tensor> first_inputs(n);
  // Each covariance's trace added this sample (a scalar on the device): one
  // host read per sample tells whether any became non-finite.
  std::vector<Tensor> traces(n);
  const auto add = [&](std::size_t i, const Tensor& x) {
    const int64_t features = x.size(-1);
    Tensor rows = reshape(x, {x.numel() / features, features}).to(DType::f32);
    // PEFT's scale: the largest value's magnitude (not the largest magnitude).
    rows = rows / abs(max(rows));
    const Tensor product = matmul(transpose(rows, 0, 1), rows);
    covariance[i] = covariance[i].defined() ? covariance[i] + product : product;
    traces[i] = sum(square(rows));
  };
  for (int64_t k = 0; k < data.samples; ++k) {
    const bool first = k == 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (!first && input_of[i] != i) continue;
      taps.set(i, [&, i, first](const Tensor& x) {
        if (first) {
          input_of[i] = i;
          for (std::size_t j = 0; j < i; ++j)
            if (first_inputs[j].defined() && input_of[j] == j && same_input(first_inputs[j], x)) {
              input_of[i] = j;
              break;
            }
          first_inputs[i] = x;
          if (input_of[i] != i) return;
        }
        add(i, x);
      });
    }
    const LmBatch b = data.sample(k);
    const int64_t length =
        b.lengths.empty() ? b.ids.size(1) : std::min(b.lengths[0], b.ids.size(1));
    const Tensor ids = narrow(narrow(b.ids, 0, 0, 1), 1, 0, length).contiguous();
    Tensor positions;
    if (b.position_ids.defined())
      positions = narrow(narrow(b.position_ids, 0, 0, 1), 1, 0, length).contiguous().to(device);
    model.hidden_states(ids.to(device), nullptr, Tensor(), positions);
    for (std::size_t i = 0; i < n; ++i) taps.remove(i);
    if (first) {
      first_inputs.clear();
      for (std::size_t i = 0; i < n; ++i)
        if (input_of[i] == i && !traces[i].defined())
          throw std::invalid_argument("[corda_covariances] layer " + layers[i] +
                                      " read no input in a forward pass of the model");
    }
    std::vector<Tensor> added;
    for (std::size_t i = 0; i < n; ++i)
      if (input_of[i] == i) added.push_back(reshape(traces[i], {1}));
    if (!std::isfinite(sum(cat(added, 0)).item()))
      for (std::size_t i = 0; i < n; ++i)
        if (input_of[i] == i && !std::isfinite(traces[i].item()))
          throw std::invalid_argument(
              "[corda_covariances] layer " + layers[i] +
              "'s input covariance is not finite after " + "sample " + std::to_string(k) +
              ": its inputs held NaN or Inf, or their largest value was 0 (PEFT refuses them too)");
    if (data.on_sample) data.on_sample(k + 1, data.samples);
  }
  for (std::size_t i = 0; i < n; ++i)
    covariance[i] =
        input_of[i] == i ? covariance[i] / double(data.samples) : covariance[input_of[i]];
  return covariance;
}

QLoRAReport apply_qlora_corda(CausalLM& model, QLoRAOptions& o, const CordaData& data) {
  check_lora_settings(o.lora);
  if (o.lora.init_lora_weights != LoraInit::corda)
    throw std::invalid_argument(std::string("[apply_qlora_corda] init_lora_weights is ") +
                                lora_init_name(o.lora.init_lora_weights) + ", not corda");
  // The layers, refused as apply_qlora refuses them before anything changes
  // (a 4-bit folder's layers are refused there: CorDA needs float weights).
  std::vector<std::string> names;
  std::vector<int64_t> in_features;
  o.corda_covariances.clear();
  for (const auto& [name, shape] : planned_trained_tensors(model, o)) {
    constexpr std::string_view suffix = ".lora_A.weight";
    if (name.ends_with(suffix)) {
      names.push_back(name.substr(0, name.size() - suffix.size()));
      in_features.push_back(shape[1]);
    }
  }
  const bool stored =
      !data.covariance_file.empty() && std::filesystem::exists(data.covariance_file);
  if (!stored && (data.samples < 1 || !data.sample))
    throw std::invalid_argument("[apply_qlora_corda] CorDA needs at least one sample of data");
  const std::vector<Tensor> covariances =
      stored ? load_corda_covariances(data.covariance_file, names, model.device())
             : corda_covariances(model, names, data);
  for (std::size_t i = 0; i < names.size(); ++i) {
    const int64_t in = in_features[i];
    if (covariances[i].shape() != Shape{in, in})
      throw std::invalid_argument(data.covariance_file + ": the input covariance of layer " +
                                  names[i] + " is " + shape_str(covariances[i].shape()) +
                                  ", the layer's is " + shape_str(Shape{in, in}) +
                                  " (a file written for another model?)");
  }
  if (!stored && !data.covariance_file.empty() && data.write_covariance_file)
    save_corda_covariances(data.covariance_file, names, covariances, data.samples);
  for (std::size_t i = 0; i < names.size(); ++i) o.corda_covariances[names[i]] = covariances[i];
  try {
    QLoRAReport report = apply_qlora(model, o);
    o.corda_covariances.clear();
    return report;
  } catch (...) {
    o.corda_covariances.clear();
    throw;
  }
}

}  // namespace quanta::llm
