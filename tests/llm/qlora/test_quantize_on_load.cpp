// Loading a float model a layer at a time (LoadOptions::defer_layer_weights):
// the layers' linear weights stay in their files until apply_qlora or
// quantize_base reads each to quantize it. Checked here: the 4-bit bases,
// adapters and logits are those of a whole load, byte for byte, for every
// start that reads the weights (plain, PiSSA, OLoRA, LoftQ, CorDA, EVA) and
// for folders of other layouts (sharded, fused projections, biases, bf16,
// an image-text model's renamed decoder); a device never holds more than the
// converted model (sim counts its bytes, CUDA's allocator where a GPU is
// visible); a model with weights still in its
// files refuses to run, naming one; on several ranks, each layer sharded as
// it is converted (QLoRAOptions::on_layer_converted) leaves a rank its
// shards, never the whole 4-bit base, and the same logits.
#include <doctest/doctest.h>

#include <map>
#include <string>
#include <vector>

#include "dist/ranks.h"
#include "dist/sharded_units.h"
#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/io/safetensors.h"
#include "llm/model/model_folder.h"
#include "llm/qlora/bnb_folder.h"
#include "llm/qlora/corda_init.h"
#include "llm/qlora/eva_init.h"
#include "llm/qlora/qlora_model.h"
#include "random_windows.h"
#include "support/device_memory.h"
#include "support/gpu.h"
#include "support/random_llama_folder.h"
#include "support/relative_error.h"
#include "support/temp_dir.h"
#include "support/test_data.h"

using namespace quanta;
using namespace quanta::testing;

namespace {

std::string model_dir(const std::string& name) {
  return quanta::testing::test_data("llm/models/" + name);
}

llm::QLoRAOptions options(const std::string& init) {
  llm::QLoRAOptions o;
  o.lora.r = 4;
  o.lora.lora_alpha = 8;
  o.lora.target_modules = {"all-linear"};
  llm::set_lora_init(o.lora, init);
  o.quantization.compute_dtype = DType::f32;
  o.seed = 5;
  return o;
}

// Everything a converted model holds, as the bytes of one safetensors file:
// two models are the same when these are.
std::vector<uint8_t> model_bytes(llm::CausalLM& model) {
  io::TensorMap tensors = llm::bnb_base_tensors(model);
  for (const auto& [name, p] : model.named_parameters()) tensors.emplace_back(name, p.detach());
  return io::serialize_safetensors(tensors);
}

const Tensor kIds = from_vector<int64_t>({1, 5, 9, 2, 7, 3, 30, 41, 12, 0}, {2, 5});

std::vector<float> logits_of(llm::CausalLM& model) {
  NoGradGuard no_grad;
  return model.logits(kIds.to(model.device())).to(DType::f32).to_vector<float>();
}

// Converts the folder's model with `convert`, loaded whole and a layer at
// a time, on `dev`, and checks both end the same.
template <class Convert>
void check_same_conversion(const std::string& dir, Device dev, Convert convert) {
  auto whole = llm::load_causal_lm(dir, dev);
  auto deferred = llm::load_causal_lm(dir, dev, {.defer_layer_weights = true});
  CHECK(whole->deferred_weights().empty());
  CHECK_FALSE(deferred->deferred_weights().empty());
  convert(*whole);
  convert(*deferred);
  CHECK(deferred->deferred_weights().empty());
  CHECK(model_bytes(*deferred) == model_bytes(*whole));
  CHECK(logits_of(*deferred) == logits_of(*whole));
}

}  // namespace

TEST_CASE("a model loaded a layer at a time converts to the bytes of a whole load") {
  // Folder layouts: shards with an index, fused projections, biases, bf16
  // weights, an image-text model's decoder under the hub's names.
  for (const std::string name : {"llama_gqa", "mistral_sharded", "phi3_fused", "qwen2_bias",
                                 "llama_bf16", "gemma3_image_text"}) {
    INFO(name);
    check_same_conversion(model_dir(name), Device::cpu(),
                          [](llm::CausalLM& m) { llm::apply_qlora(m, options("true")); });
  }
  check_same_conversion(model_dir("llama_gqa"), Device::cpu(), [](llm::CausalLM& m) {
    llm::BaseQuantization q;
    q.compute_dtype = DType::f32;
    llm::quantize_base(m, q);
  });
  // The starts that read the float weights, on the CPU and the test devices.
  for (const Device dev : cpu_and_test_devices())
    for (const std::string init : {"pissa", "pissa_niter_2", "olora", "loftq"}) {
      INFO(dev.str(), " ", init);
      check_same_conversion(model_dir("llama_gqa"), dev,
                            [&](llm::CausalLM& m) { llm::apply_qlora(m, options(init)); });
    }
  // CorDA runs the float model over samples first (every weight read then);
  // EVA runs the 4-bit one (quantize_base reads them a layer at a time).
  const llm::LmExamples examples = random_windows(6, 16, 2);
  check_same_conversion(model_dir("llama_gqa"), Device::cpu(), [&](llm::CausalLM& m) {
    llm::QLoRAOptions o = options("corda");
    llm::apply_qlora_corda(m, o, llm::corda_samples_in_order(examples, 0));
  });
  check_same_conversion(model_dir("llama_gqa"), Device::cpu(), [&](llm::CausalLM& m) {
    llm::QLoRAOptions o = options("eva");
    llm::EvaData data = llm::eva_batches_in_order(examples, 2);
    data.svd_niter = -1;
    llm::apply_qlora_eva(m, o, data);
  });
}

TEST_CASE("a layer at a time, the device holds the converted model and never the float one") {
  // Layers of 64 and 128 KiB: the fixtures' 8 KiB layers converted with
  // adapters, in CUDA's size classes of 512 bytes or more, outweigh their
  // float form, and the float model's absence would prove nothing.
  TempDir tmp;
  const std::string dir = tmp.file("llama");
  write_random_llama(dir, RandomLlama{}, 3);
  for (const Device dev : test_devices()) {
    INFO(dev.str());
    const DeviceMemory memory(dev);
    const auto peak_of = [&](bool defer, int64_t* after) {
      memory.reset_peak();
      const int64_t before = memory.held();
      auto model = llm::load_causal_lm(dir, dev, {.defer_layer_weights = defer});
      llm::apply_qlora(*model, options("true"));
      synchronize(dev);
      *after = memory.held() - before;
      return memory.peak() - before;
    };
    int64_t whole_after = 0, deferred_after = 0;
    const int64_t whole_peak = peak_of(false, &whole_after);
    const int64_t deferred_peak = peak_of(true, &deferred_after);
    int64_t float_model = 0;
    for (const auto& [name, t] : llm::load_causal_lm(dir)->state_dict())
      float_model += memory.counted(t.nbytes());
    MESSAGE(dev.str(), ": float model ", float_model, " bytes, converted ", deferred_after,
            ", a whole load peaked at ", whole_peak);
    CHECK(float_model > deferred_after);
    CHECK(whole_after == deferred_after);
    // A whole load held the float model at once.
    CHECK(whole_peak >= float_model);
    // Nothing but the converted model reached the device, at any moment.
    CHECK(deferred_peak == deferred_after);
  }
}

TEST_CASE("weights still in their files: no forward, and read on request") {
  const std::string dir = model_dir("llama_gqa");
  auto whole = llm::load_causal_lm(dir);
  auto deferred = llm::load_causal_lm(dir, Device::cpu(), {.defer_layer_weights = true});
  const std::vector<std::string> names = deferred->deferred_weights();
  REQUIRE(names.size() == 14);
  CHECK(names.front() == "model.layers.0.self_attn.q_proj.weight");
  CHECK(deferred->find(names.front()).nbytes() == 32 * 32 * 4);
  CHECK_THROWS_WITH_AS(logits_of(*deferred),
                       doctest::Contains("14 weights are still in their files, "
                                         "model.layers.0.self_attn.q_proj.weight first"),
                       std::logic_error);
  CHECK_THROWS_WITH_AS(deferred->to(Device::sim(0)),
                       doctest::Contains("'model.layers.0.self_attn.q_proj.weight' holds no bytes "
                                         "here"),
                       std::invalid_argument);
  // One module's, then the rest.
  deferred->read_deferred_weights("model.layers.1.mlp");
  CHECK(deferred->deferred_weights().size() == 11);
  CHECK(max_abs(deferred->find("model.layers.1.mlp.up_proj.weight") -
                whole->find("model.layers.1.mlp.up_proj.weight")) == 0);
  // A prefix is a module's name, not the start of another's.
  deferred->read_deferred_weights("model.layers.1.mlp.up");
  CHECK(deferred->deferred_weights().size() == 11);
  deferred->read_deferred_weights();
  CHECK(deferred->deferred_weights().empty());
  CHECK(logits_of(*deferred) == logits_of(*whole));
  // A 4-bit folder holds no float layer weights: nothing to leave behind.
  auto four_bit =
      llm::load_base_model(quanta::testing::test_data("llm/qlora/transformers_4bit/llama_gqa"),
                           Device::cpu(), std::nullopt, {.defer_layer_weights = true});
  CHECK(four_bit->deferred_weights().empty());
}

TEST_CASE(
    "on_layer_converted announces each layer in order, once its base and adapters are final") {
  // LoftQ corrects a thread's worth of layers at a time after making them:
  // a layer is announced only after its correction.
  for (const std::string init : {"true", "loftq", "pissa", "olora"}) {
    CAPTURE(init);
    auto model =
        llm::load_causal_lm(model_dir("llama_gqa"), Device::cpu(), {.defer_layer_weights = true});
    std::vector<std::string> announced;
    std::map<std::string, std::vector<uint8_t>> at_announcement;
    const auto layer_bytes = [&](const std::string& layer) {
      io::TensorMap tensors;
      for (const auto& [name, t] : model->named_buffers())
        if (name.starts_with(layer + ".")) tensors.emplace_back(name, t);
      for (const auto& [name, t] : model->named_parameters())
        if (name.starts_with(layer + ".")) tensors.emplace_back(name, t.detach());
      return io::serialize_safetensors(tensors);
    };
    llm::QLoRAOptions o = options(init);
    o.on_layer_converted = [&](const std::string& layer) {
      announced.push_back(layer);
      at_announcement[layer] = layer_bytes(layer);
    };
    llm::apply_qlora(*model, o);
    CHECK(announced == model->layer_names());
    for (const std::string& layer : announced) {
      CAPTURE(layer);
      CHECK(at_announcement[layer] == layer_bytes(layer));
    }
  }
}

TEST_CASE("on 2 ranks, layers sharded as they are converted: a rank never holds the whole base") {
  // Layers whose bytes dwarf the shards' granules (256 bytes a tensor).
  TempDir tmp("quantize_on_load_ranks");
  const std::string dir = tmp.file("model");
  write_random_llama(dir, {.kv_heads = 2}, 4);
  auto errors = dist::testing::run_ranks(2, [&](dist::ProcessGroup& g) {
    // A sim device of each rank's own, so that each counts its own bytes.
    const Device dev = Device::sim(1 + g.rank());
    const auto held = [&] { return device_stats(dev).allocated_bytes; };
    // The converted model whole on one rank, from its load on.
    int64_t whole = 0, unit_bytes = 0, largest_unit = 0;
    std::vector<float> whole_logits;
    {
      const int64_t before = held();
      auto model = llm::load_causal_lm(dir, dev, {.defer_layer_weights = true});
      llm::apply_qlora(*model, options("true"));
      whole = held() - before;
      whole_logits = logits_of(*model);
      for (const std::string& layer : model->layer_names()) {
        int64_t bytes = 0;
        for (const auto& [name, b] : model->named_buffers())
          if (name.starts_with(layer + ".")) bytes += int64_t(b.nbytes());
        unit_bytes += bytes;
        largest_unit = std::max(largest_unit, bytes);
      }
    }
    reset_device_stats(dev);
    const int64_t before = held();
    auto model = llm::load_causal_lm(dir, dev, {.defer_layer_weights = true});
    dist::ShardedUnits shards(*model, g);
    llm::QLoRAOptions o = options("true");
    std::vector<std::string> announced;
    o.on_layer_converted = [&](const std::string& layer) {
      announced.push_back(layer);
      shards.shard(layer);
    };
    llm::apply_qlora(*model, o);
    CHECK(announced == model->layer_names());
    const int64_t after = held() - before, peak = device_stats(dev).peak_allocated_bytes - before;
    const int64_t base = int64_t(shards.full_bytes()), kept = int64_t(shards.shard_bytes());
    MESSAGE("rank " << g.rank() << ": the converted model " << whole << " bytes whole, " << after
                    << " sharded, peak " << peak << " (its 4-bit layers " << unit_bytes
                    << " bytes, " << base << " with granules, " << kept << " kept)");
    CHECK(kept * 2 <= base + 4 * 2 * 256);  // a granule of padding a unit and rank at most
    // The 4-bit layers' shards in place of the layers; the rest is whole.
    CHECK(after == whole - unit_bytes + kept);
    // At most one layer whole (and its shard, as it is cut) beyond that.
    CHECK(peak <= after + largest_unit + kept / 4 + 2 * 256);
    CHECK(peak < whole);
    // Every rank runs the forward (each layer gathered): the same logits.
    CHECK(logits_of(*model) == whole_logits);
  });
  REQUIRE(dist::testing::all_ok(errors));
}
