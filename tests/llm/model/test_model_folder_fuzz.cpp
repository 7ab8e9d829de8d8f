// Hostile Hugging Face model folders: every mistake in config.json, in the
// shard index or in the shards is refused with an error naming the file,
// and a bounded mutation fuzz (fixed seed, a few seconds) finds no crash, no
// hang and no error that names nothing. A folder that still loads after a
// mutation is a model whose config and weights agree.
#include <doctest/doctest.h>
#include <sys/stat.h>

#include <cmath>
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
#include "llm/qlora/bnb_folder.h"
#include "support/file_mutations.h"
#include "support/temp_dir.h"
#include "support/test_data.h"

using namespace quanta;
using namespace quanta::testing;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::string fixture(const std::string& name) {
  return quanta::testing::test_data("llm/models/" + name);
}

// A copy of fixture `name` at `dir` (replacing what is there).
std::string copy_fixture(const std::string& name, const std::string& dir) {
  fs::remove_all(dir);
  fs::copy(fixture(name), dir, fs::copy_options::recursive);
  return dir;
}

json read_json(const std::string& path) { return json::parse(read_text(path)); }
void write_json(const std::string& path, const json& j) { write_text(path, j.dump(2)); }

// What loading `dir` gave: a model, or an error.
struct Loaded {
  bool ok = false;
  std::string error;
};

Loaded load(const std::string& dir) {
  Loaded r;
  try {
    const std::shared_ptr<llm::CausalLM> model = llm::load_base_model(dir);
    // A folder that loads is a model whose weights match its config.
    REQUIRE(model != nullptr);
    r.ok = true;
  } catch (const std::exception& e) {
    r.error = e.what();
  }
  return r;
}

// Loading `dir` fails with an error that names `file` (a path inside the
// folder, or the folder itself) and says `what`.
void check_refused(const std::string& dir, const std::string& file, const std::string& what) {
  const Loaded r = load(dir);
  CAPTURE(r.error);
  REQUIRE_FALSE(r.ok);
  CHECK(r.error.find(file) != std::string::npos);
  CHECK(r.error.find(what) != std::string::npos);
}

// config.json of `dir` with `key` set to `value` (null: removed).
void set_config(const std::string& dir, const std::string& key, const json& value) {
  json c = read_json(dir + "/config.json");
  if (value.is_null())
    c.erase(key);
  else
    c[key] = value;
  write_json(dir + "/config.json", c);
}

}  // namespace

TEST_CASE("model folders: each config.json mistake is refused, naming the file and the key") {
  TempDir t("model_fuzz_config");
  const std::string dir = t.file("m"), config = dir + "/config.json";
  copy_fixture("llama_gqa", dir);
  REQUIRE(load(dir).ok);
  for (const char* key : {"model_type", "vocab_size", "hidden_size", "intermediate_size",
                          "num_hidden_layers", "num_attention_heads", "max_position_embeddings"}) {
    CAPTURE(key);
    copy_fixture("llama_gqa", dir);
    set_config(dir, key, nullptr);
    check_refused(dir, config, key);
  }
  struct Case {
    const char* key;
    json value;
    const char* says;
  };
  const Case cases[] = {
      {"vocab_size", 0, "\"vocab_size\" must be > 0"},
      {"hidden_size", -32, "\"hidden_size\" must be > 0"},
      {"intermediate_size", "48", "\"intermediate_size\" must be an integer"},
      {"num_attention_heads", 4.5, "\"num_attention_heads\" must be an integer"},
      {"num_key_value_heads", 3, "not a multiple of num_key_value_heads 3"},
      {"head_dim", 7, "head_dim must be even"},
      {"head_dim", 6, "self_attn.q_proj.weight is [32, 32], expected [24, 32]"},
      {"model_type", "gpt2", "model_type \"gpt2\" is not supported"},
      {"dtype", "int8", "dtype \"int8\" is not one quanta loads"},
      {"rms_norm_eps", -1.0, "\"rms_norm_eps\" must be >= 0"},
      {"tie_word_embeddings", "yes", "\"tie_word_embeddings\" must be true or false"},
      {"attention_dropout", 0.1, "\"attention_dropout\": 0.1 is not supported"},
      {"attention_dropout", "x", "\"attention_dropout\" must be a number"},
      {"rope_parameters", json{{"rope_theta", 10000.0}, {"rope_type", json::object()}},
       "\"rope_type\" must be a string"},
      // Sizes no machine holds: refused by the config's bounds before any
      // weight is compared or allocated.
      {"num_hidden_layers", int64_t(1000000000), "num_hidden_layers"},
      {"hidden_size", int64_t(1) << 40, "hidden_size"},
      {"vocab_size", int64_t(1) << 62, "vocab_size"},
      {"intermediate_size", int64_t(1) << 40, "intermediate_size"},
      {"max_position_embeddings", int64_t(1) << 62, "max_position_embeddings"},
      {"head_dim", int64_t(1) << 40, "head_dim"},
      // A plausible size that the weights disagree with.
      {"num_hidden_layers", 3, "num_hidden_layers"},
      {"vocab_size", 65, "model.embed_tokens.weight is [64, 32], expected [65, 32]"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.key);
    CAPTURE(c.value.dump());
    copy_fixture("llama_gqa", dir);
    set_config(dir, c.key, c.value);
    check_refused(dir, dir, c.says);
  }
  copy_fixture("llama_gqa", dir);
  write_text(config, "{\"model_type\": \"llama\", ");
  check_refused(dir, config, "not JSON");
  write_text(config, "[1, 2]");
  check_refused(dir, config, "not a JSON object");
  write_text(config, "");
  check_refused(dir, config, "not JSON");
  fs::remove(config);
  check_refused(dir, config, "cannot open");
  fs::create_directory(config);
  check_refused(dir, config, "not a regular file");
}

TEST_CASE("model folders: an index naming shards outside the folder, or missing, is refused") {
  TempDir t("model_fuzz_index");
  const std::string dir = t.file("m"), index = dir + "/model.safetensors.index.json";
  const std::string shard1 = "model-00001-of-00002.safetensors";
  const std::string shard2 = "model-00002-of-00002.safetensors";
  // A real shard outside the folder: only the path rule keeps it out.
  const std::string outside = t.file("outside.safetensors");
  fs::copy_file(fixture("mistral_sharded") + "/" + shard2, outside);
  const auto point_all_of = [&](const std::string& from, const std::string& to) {
    json j = read_json(index);
    for (auto& [name, file] : j["weight_map"].items())
      if (file == from) file = to;
    write_json(index, j);
  };
  copy_fixture("mistral_sharded", dir);
  REQUIRE(load(dir).ok);

  for (const std::string& bad : {std::string("../outside.safetensors"), outside,
                                 std::string("sub/") + shard2, std::string(".."), std::string()}) {
    CAPTURE(bad);
    copy_fixture("mistral_sharded", dir);
    point_all_of(shard2, bad);
    check_refused(dir, index, "not a file in the folder");
  }
  // A symlink out of the folder, to a file or to a folder.
  copy_fixture("mistral_sharded", dir);
  fs::remove(dir + "/" + shard2);
  fs::create_symlink(outside, dir + "/" + shard2);
  check_refused(dir, dir + "/" + shard2, "outside the folder");
  copy_fixture("mistral_sharded", dir);
  fs::remove(dir + "/config.json");
  fs::create_symlink(t.file("outside.json"), dir + "/config.json");
  write_text(t.file("outside.json"), read_text(fixture("mistral_sharded") + "/config.json"));
  check_refused(dir, dir + "/config.json", "outside the folder");
  // A symlink inside the folder is fine.
  copy_fixture("mistral_sharded", dir);
  fs::rename(dir + "/" + shard2, dir + "/real.safetensors");
  fs::create_symlink("real.safetensors", dir + "/" + shard2);
  CHECK(load(dir).ok);

  // A shard that is missing, is a folder, or is a FIFO (which must not block).
  copy_fixture("mistral_sharded", dir);
  fs::remove(dir + "/" + shard2);
  check_refused(dir, index, "lists shard " + shard2 + ", which is not in the folder");
  fs::create_directory(dir + "/" + shard2);
  check_refused(dir, shard2, "is not a regular file");
  fs::remove(dir + "/" + shard2);
  REQUIRE(::mkfifo((dir + "/" + shard2).c_str(), 0600) == 0);
  check_refused(dir, shard2, "is not a regular file");

  // A tensor in two shards, or in another shard than the index says.
  copy_fixture("mistral_sharded", dir);
  {
    io::SafetensorsFile a = io::load_safetensors(dir + "/" + shard1);
    io::SafetensorsFile b = io::load_safetensors(dir + "/" + shard2);
    b.tensors.push_back(a.tensors.front());
    io::save_safetensors(dir + "/" + shard2, b.tensors, b.metadata);
    check_refused(dir, shard2,
                  "holds " + a.tensors.front().first + ", which the index does not list");
  }
  copy_fixture("mistral_sharded", dir);
  {
    json j = read_json(index);
    const std::string moved = j["weight_map"].begin().key();
    j["weight_map"][moved] = j["weight_map"][moved] == shard1 ? shard2 : shard1;
    write_json(index, j);
    check_refused(dir, dir, moved);
  }
  // The index itself.
  copy_fixture("mistral_sharded", dir);
  write_json(index, json{{"weight_map", json::object()}});
  check_refused(dir, index, "weight_map is empty");
  write_json(index, json{{"weight_map", json::array()}});
  check_refused(dir, index, "has no \"weight_map\" object");
  write_json(index, json{{"weight_map", {{"lm_head.weight", 3}}}});
  check_refused(dir, index, "is not a file name");
  write_text(index, "{");
  check_refused(dir, index, "not JSON");
  fs::remove(index);
  check_refused(dir, dir, "holds neither model.safetensors nor model.safetensors.index.json");
}

TEST_CASE("model folders: shards that disagree with the config, or are cut, are refused") {
  TempDir t("model_fuzz_shards");
  const std::string dir = t.file("m"), weights = dir + "/model.safetensors";
  const auto rewrite = [&](const std::function<void(io::TensorMap&)>& change) {
    copy_fixture("llama_gqa", dir);
    io::SafetensorsFile f = io::load_safetensors(weights);
    change(f.tensors);
    io::save_safetensors(weights, f.tensors, f.metadata);
  };
  const auto find = [](io::TensorMap& m, const std::string& name) -> Tensor& {
    for (auto& [n, t] : m)
      if (n == name) return t;
    FAIL("no " << name);
    return m.front().second;
  };
  rewrite([&](io::TensorMap& m) {
    Tensor& t = find(m, "model.layers.1.mlp.up_proj.weight");
    t = t.to(DType::i32);
  });
  check_refused(dir, dir, "model.layers.1.mlp.up_proj.weight has dtype i32");
  rewrite([&](io::TensorMap& m) {
    Tensor& t = find(m, "model.norm.weight");
    t = zeros({31});
  });
  check_refused(dir, dir, "model.norm.weight is [31], expected [32]");
  rewrite([&](io::TensorMap& m) { m.erase(m.begin()); });
  check_refused(dir, dir, "missing (1)");
  rewrite([&](io::TensorMap& m) { m.push_back({"model.layers.7.extra.weight", zeros({2})}); });
  check_refused(dir, dir, "model.layers.7.extra.weight");

  // Cut short at every part of the file: header length, header, data.
  copy_fixture("llama_gqa", dir);
  const std::string whole = read_text(weights);
  for (const std::size_t keep :
       {std::size_t(0), std::size_t(5), std::size_t(20), whole.size() / 2, whole.size() - 1}) {
    CAPTURE(keep);
    write_text(weights, whole.substr(0, keep));
    const Loaded r = load(dir);
    CAPTURE(r.error);
    CHECK_FALSE(r.ok);
    CHECK(r.error.find(weights) != std::string::npos);
  }
}

TEST_CASE("model folders: a bounded mutation fuzz finds no crash and no error naming nothing") {
  TempDir t("model_fuzz_random");
  const std::string dir = t.file("m");
  std::mt19937_64 rng(20261129);  // the same mutations every run
  const std::vector<json> hostile = {0,
                                     -1,
                                     1,
                                     2,
                                     3,
                                     7,
                                     64,
                                     1e9,
                                     1e30,
                                     -1e30,
                                     1.5,
                                     "x",
                                     nullptr,
                                     true,
                                     false,
                                     json::array(),
                                     json::object(),
                                     int64_t(1) << 31,
                                     int64_t(1) << 40,
                                     int64_t(1) << 62,
                                     std::numeric_limits<int64_t>::min()};
  int loaded = 0, refused = 0;
  for (int i = 0; i < 300; ++i) {
    CAPTURE(i);
    const bool sharded = i % 2 == 1;
    copy_fixture(sharded ? "mistral_sharded" : "llama_gqa", dir);
    const std::string config = dir + "/config.json";
    const std::string index = dir + "/model.safetensors.index.json";
    const std::string weights =
        dir + (sharded ? "/model-00001-of-00002.safetensors" : "/model.safetensors");
    switch (rng() % 4) {
      case 0:  // a config value replaced (nested objects too)
        replace_json_value(config, rng, hostile);
        break;
      case 1:  // bytes of config.json or the index changed, cut or doubled
        change_bytes(sharded && rng() % 2 ? index : config, rng);
        break;
      default:  // bytes of a weights file's header (or its length) changed
        flip_header_bit(weights, rng);
        break;
    }
    const Loaded r = load(dir);
    if (r.ok) {
      ++loaded;
      continue;
    }
    ++refused;
    CAPTURE(r.error);
    CHECK(r.error.find(dir) != std::string::npos);  // names the folder or a file in it
  }
  MESSAGE(loaded << " of 300 mutated folders loaded (valid models), " << refused << " refused");
  CHECK(refused > 150);
}
