// Hostile PEFT adapter folders: every mistake in adapter_config.json or
// adapter_model.safetensors is refused with an error naming the file,
// before the model is changed or anything of the config's sizes is
// allocated; a bounded mutation fuzz (fixed seed) finds no crash, no hang
// and no error that names nothing.
#include <doctest/doctest.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "engine/factory.h"
#include "engine/io/safetensors.h"
#include "llm/model/model_folder.h"
#include "llm/qlora/peft_folder.h"
#include "llm/qlora/qlora_model.h"
#include "support/file_mutations.h"
#include "support/temp_dir.h"
#include "support/test_data.h"

using namespace quanta;
using namespace quanta::testing;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::string base_dir() { return quanta::testing::test_data("llm/models/llama_gqa"); }

// A whole adapter folder for llama_gqa (r 4 on q_proj and v_proj, named
// after its base), made once and copied for each case.
class AdapterFolders {
 public:
  explicit AdapterFolders(const TempDir& t) : good_(t.file("good")), dir_(t.file("adapters")) {
    auto model = llm::load_causal_lm(base_dir());
    llm::QLoRAOptions o;
    o.lora.r = 4;
    o.lora.target_modules = {"q_proj", "v_proj"};
    o.lora.base_model_name_or_path = "llama_gqa";
    llm::apply_qlora(*model, o);
    llm::save_peft_adapters(*model, o.lora, o.quantization, good_);
  }
  // A fresh copy of the good folder.
  const std::string& fresh() const {
    fs::remove_all(dir_);
    fs::copy(good_, dir_, fs::copy_options::recursive);
    return dir_;
  }
  std::string config() const { return dir_ + "/" + llm::kAdapterConfigFile; }
  std::string weights() const { return dir_ + "/" + llm::kAdapterWeightsFile; }

 private:
  std::string good_, dir_;
};

struct Applied {
  bool ok = false;
  std::string error;
  bool model_unchanged = true;  // no layer converted when it failed
};

Applied apply(const std::string& dir) {
  Applied r;
  auto model = llm::load_causal_lm(base_dir());
  const std::size_t params = model->named_parameters().size();
  try {
    llm::apply_peft_adapters(*model, dir, base_dir());
    r.ok = true;
  } catch (const std::exception& e) {
    r.error = e.what();
    r.model_unchanged = model->named_parameters().size() == params;
  }
  return r;
}

void check_refused(const std::string& dir, const std::string& file, const std::string& what) {
  const Applied r = apply(dir);
  CAPTURE(r.error);
  REQUIRE_FALSE(r.ok);
  CHECK(r.error.find(file) != std::string::npos);
  CHECK(r.error.find(what) != std::string::npos);
}

}  // namespace

TEST_CASE("adapter folders: each adapter_config.json mistake is refused, naming file and field") {
  TempDir t("adapter_fuzz_config");
  const AdapterFolders folders(t);
  const std::string dir = folders.fresh();
  REQUIRE(apply(dir).ok);
  struct Case {
    const char* key;
    json value;  // null: the key removed
    const char* says;
  };
  const Case cases[] = {
      {"r", nullptr, "a LoRA field is missing or of the wrong type"},
      {"r", 0, "lora r must be positive"},
      {"r", -4, "lora r must be positive"},
      {"r", 2.5, "\"r\" must be an integer"},
      {"r", "4", "a LoRA field is missing or of the wrong type"},
      // Ranks the stored tensors do not have: refused before adapters of
      // that rank are allocated.
      {"r", 8, "has rank 4, the config gives the layer r 8"},
      {"r", int64_t(1000000000), "has rank 4, the config gives the layer r 1000000000"},
      {"lora_alpha", -1.0, "lora_alpha must be positive"},
      {"lora_alpha", "x", "a LoRA field is missing or of the wrong type"},
      {"lora_dropout", 1.0, "lora_dropout must be in [0, 1)"},
      {"target_modules", json::array(), "target_modules is empty"},
      {"target_modules", json::array({"gate_proj"}), "does not fit the model"},
      {"target_modules", json::array({"nothing_here"}), "nothing_here"},
      {"target_modules", 7, "a LoRA field is missing or of the wrong type"},
      {"peft_type", "PREFIX_TUNING", "only LORA adapters are read"},
      {"peft_type", 3, "peft_type"},
      {"task_type", "SEQ_CLS", "not CAUSAL_LM"},
      // DoRA claimed over a file without magnitudes.
      {"use_dora", true,
       "missing base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"},
      {"use_dora", "yes", "use_dora must be true or false"},
      // lora_bias claimed over a file without B's biases.
      {"lora_bias", true, "missing base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias"},
      {"lora_bias", 1, "lora_bias must be true or false"},
      // PEFT 0.21's options that change the forward.
      {"target_parameters", json::array({"mlp.experts.gate_up_proj"}), "target_parameters is set"},
      {"alora_invocation_tokens", json::array({5, 9}), "alora_invocation_tokens is set"},
      {"use_qalora", true, "use_qalora is set"},
      {"kasa_config", json{{"a", 1}}, "kasa_config is set"},
      {"monteclora_config", json{{"a", 1}}, "monteclora_config is set"},
      {"use_bdlora", json{{"a", 1}}, "use_bdlora is set"},
      {"arrow_config", json{{"top_k", 3}}, "arrow_config is set"},
      // {} is each of these with PEFT's defaults, and [] is aLoRA on 4-bit
      // layers: on, not unset.
      {"kasa_config", json::object(), "kasa_config is set"},
      {"monteclora_config", json::object(), "monteclora_config is set"},
      {"use_bdlora", json::object(), "use_bdlora is set"},
      {"arrow_config", json::object(), "arrow_config is set"},
      {"alora_invocation_tokens", json::array(), "alora_invocation_tokens is set"},
      // PEFT's layer choice and modules trained whole.
      {"target_modules", "(?P<x>q_proj)", "is not a regular expression quanta reads"},
      {"target_modules", ".*nothing", "matches no linear layer's full name"},
      {"rank_pattern", json{{"q_proj", int64_t(1000000000)}},
       "has rank 4, the config gives the layer r 1000000000"},
      {"rank_pattern", json{{"q_proj", 2.5}}, "rank_pattern \"q_proj\" must be an integer"},
      {"rank_pattern", 5, "rank_pattern must be an object"},
      {"alpha_pattern", json{{"q_proj", "x"}}, "alpha_pattern \"q_proj\" must be a number"},
      {"layers_to_transform", "x", "a LoRA field is missing or of the wrong type"},
      {"layers_pattern", "layers", "layers_pattern is given without layers_to_transform"},
      {"exclude_modules", json::array({"q_proj"}), "does not fit the model"},
      {"exclude_modules", "(", "exclude_modules: \"(\" is not a regular expression"},
      {"modules_to_save", json::array({"lm_head"}), "missing base_model.model.lm_head.weight"},
      {"modules_to_save", json::array({"q_proj"}), "a linear layer quantized to NF4"},
      {"modules_to_save", "lm_head", "a LoRA field is missing or of the wrong type"},
      {"bias", "everything", "bias must be none, all or lora_only, got \"everything\""},
      {"bias", 3, "bias must be a string"},
      // Token rows claimed over a file without them, or not token indices.
      {"trainable_token_indices", json::array({3}),
       "missing base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"},
      {"trainable_token_indices", json::array({64}), "token 64 is outside the vocabulary of 64"},
      {"trainable_token_indices", json::array({2.5}), "holds 2.5, not a token index"},
      {"trainable_token_indices", "3", "must be a list or an object"},
      {"trainable_token_indices", json{{"norm", {1}}}, "neither the embeddings"},
      {"trainable_token_indices", json{{"lm_head", 5}}, "must be a list of token indices"},
      {"base_model_name_or_path", "another-model", "made for base \"another-model\""},
      {"quanta_base_quantization", json{{"quant_type", "fp4"}}, "quant_type must be nf4"},
      {"quanta_base_quantization", json{{"blocksize", 0}}, "blocksize"},
      {"quanta_base_quantization", json{{"blocksize", -64}}, "blocksize"},
      {"quanta_base_quantization", json{{"blocksize", int64_t(1) << 40}}, "blocksize"},
      {"quanta_base_quantization", json{{"compute_dtype", "int8"}}, "int8"},
      {"quanta_base_quantization", 5, "quanta_base_quantization"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.key);
    CAPTURE(c.value.dump());
    folders.fresh();
    json j = json::parse(read_text(folders.config()));
    if (c.value.is_null())
      j.erase(c.key);
    else
      j[c.key] = c.value;
    write_text(folders.config(), j.dump(2));
    const Applied r = apply(dir);
    CAPTURE(r.error);
    REQUIRE_FALSE(r.ok);
    CHECK(r.error.find(dir) != std::string::npos);
    CHECK(r.error.find(c.says) != std::string::npos);
    CHECK(r.model_unchanged);
  }
  folders.fresh();
  write_text(folders.config(), "{\"r\": ");
  check_refused(dir, folders.config(), "not JSON");
  write_text(folders.config(), "[]");
  check_refused(dir, folders.config(), "is not a JSON object");
  fs::remove(folders.config());
  check_refused(dir, folders.config(), "cannot open");
  REQUIRE(::mkfifo(folders.config().c_str(), 0600) == 0);
  check_refused(dir, folders.config(), "is not a regular file");
  check_refused(t.file("no_such_folder"), "no_such_folder", "not an adapter folder");
}

TEST_CASE("adapter folders: adapter_model.safetensors that does not fit is refused, model intact") {
  TempDir t("adapter_fuzz_weights");
  const AdapterFolders folders(t);
  const std::string dir = folders.fresh();
  const auto rewrite = [&](const std::function<void(io::TensorMap&)>& change) {
    folders.fresh();
    io::SafetensorsFile f = io::load_safetensors(folders.weights());
    change(f.tensors);
    io::save_safetensors(folders.weights(), f.tensors, f.metadata);
  };
  rewrite([](io::TensorMap& m) { m.pop_back(); });
  check_refused(dir, folders.weights(), "missing base_model.model.model.layers.1");
  rewrite([](io::TensorMap& m) { m.push_back({"base_model.model.extra.weight", zeros({2})}); });
  check_refused(dir, folders.weights(), "unexpected base_model.model.extra.weight");
  rewrite([](io::TensorMap& m) { m[1].second = zeros({m[1].second.size(0) + 1, 4}); });
  check_refused(dir, folders.weights(), "the model's is");
  rewrite([](io::TensorMap& m) { m[1].second = m[1].second.to(DType::i32); });
  check_refused(dir, folders.weights(), "not floating");
  rewrite([](io::TensorMap& m) { m.clear(); });
  check_refused(dir, folders.weights(), "holds no lora_A tensor");
  // Another rank in the tensors than in the config (a folder from another run).
  rewrite([](io::TensorMap& m) {
    for (auto& [name, t] : m)
      t = name.find("lora_A") != std::string::npos ? zeros({2, t.size(1)}) : zeros({t.size(0), 2});
  });
  check_refused(dir, folders.weights(), "has rank 2, the config gives the layer r 4");

  folders.fresh();
  const std::string whole = read_text(folders.weights());
  for (const std::size_t keep :
       {std::size_t(0), std::size_t(7), std::size_t(30), whole.size() / 2, whole.size() - 1}) {
    CAPTURE(keep);
    write_text(folders.weights(), whole.substr(0, keep));
    const Applied r = apply(dir);
    CAPTURE(r.error);
    CHECK_FALSE(r.ok);
    CHECK(r.error.find(folders.weights()) != std::string::npos);
    CHECK(r.model_unchanged);
  }
  fs::remove(folders.weights());
  check_refused(dir, folders.weights(), "no such file");
  fs::create_directory(folders.weights());
  check_refused(dir, folders.weights(), "is not a regular file");
}

TEST_CASE("adapter folders: a bounded mutation fuzz finds no crash and no error naming nothing") {
  TempDir t("adapter_fuzz_random");
  const AdapterFolders folders(t);
  std::mt19937_64 rng(20261129);  // the same mutations every run
  const std::vector<json> hostile = {0,
                                     -1,
                                     1,
                                     2,
                                     4,
                                     8,
                                     1e9,
                                     1e30,
                                     -1e30,
                                     0.5,
                                     "x",
                                     nullptr,
                                     true,
                                     false,
                                     "LORA",
                                     "all-linear",
                                     json::array(),
                                     json::object(),
                                     json::array({"q_proj"}),
                                     int64_t(1) << 40,
                                     int64_t(1) << 62};
  int applied = 0, refused = 0;
  for (int i = 0; i < 200; ++i) {
    CAPTURE(i);
    const std::string dir = folders.fresh();
    switch (rng() % 3) {
      case 0:  // a config value replaced (one level into objects)
        replace_json_value(folders.config(), rng, hostile);
        break;
      case 1:  // bytes of the config changed, cut or doubled
        change_bytes(folders.config(), rng);
        break;
      default:  // a bit of the weights file's header (or its length) flipped
        flip_header_bit(folders.weights(), rng);
        break;
    }
    const Applied r = apply(dir);
    if (r.ok) {
      ++applied;
      continue;
    }
    ++refused;
    CAPTURE(r.error);
    CHECK(r.error.find(dir) != std::string::npos);
  }
  MESSAGE(applied << " of 200 mutated adapter folders applied, " << refused << " refused");
  CHECK(refused > 100);
}
