// Writing a model folder's weights: save_pretrained's shards and index past
// max_shard_size (its split rule, file names and index), read back as the
// same model; a later save of the other layout leaves no stale weight file;
// max_shard_size's spellings.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "engine/factory.h"
#include "engine/io/safetensors.h"
#include "llm/model/model_folder.h"
#include "support/temp_dir.h"
#include "support/test_data.h"

using namespace quanta;
using namespace quanta::testing;
namespace fs = std::filesystem;

namespace {

std::set<std::string> weight_files(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename() != "config.json") out.insert(e.path().filename().string());
  return out;
}

nlohmann::json read_json(const std::string& path) {
  return nlohmann::json::parse(std::ifstream(path));
}

// Tensors of `sizes` f32 elements named t0, t1, ... in that order.
std::vector<io::TensorSource> sized(const std::vector<int64_t>& sizes) {
  std::vector<io::TensorSource> out;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const Tensor t = full({sizes[i]}, double(i));
    out.push_back(io::tensor_sources({{"t" + std::to_string(i), t}})[0]);
  }
  return out;
}

}  // namespace

TEST_CASE("write_model_weights splits as save_pretrained does, in order") {
  TempDir tmp;
  // 400-byte limit: 60, 60 (480 > 400: a new file), 150 floats over the
  // limit alone and listed when met, while the open file goes on; then 20
  // and 20 (exactly 400 bytes with the second 60).
  const std::vector<io::TensorSource> w = sized({60, 60, 150, 20, 20});
  llm::write_model_weights(tmp.path().string(), w, {.max_shard_bytes = 400});
  CHECK(weight_files(tmp.path().string()) ==
        std::set<std::string>{"model-00001-of-00003.safetensors",
                              "model-00002-of-00003.safetensors",
                              "model-00003-of-00003.safetensors", "model.safetensors.index.json"});
  const nlohmann::json index = read_json(tmp.file("model.safetensors.index.json"));
  CHECK(index["metadata"]["total_size"] == (60 + 60 + 150 + 20 + 20) * 4);
  CHECK(index["metadata"]["total_parameters"] == 310);
  CHECK(index["weight_map"] == nlohmann::json{{"t0", "model-00001-of-00003.safetensors"},
                                              {"t1", "model-00003-of-00003.safetensors"},
                                              {"t2", "model-00002-of-00003.safetensors"},
                                              {"t3", "model-00003-of-00003.safetensors"},
                                              {"t4", "model-00003-of-00003.safetensors"}});
  // Each shard holds what the index says, with its values.
  const io::SafetensorsFile third =
      io::load_safetensors(tmp.file("model-00003-of-00003.safetensors"));
  REQUIRE(third.tensors.size() == 3);
  CHECK(third.tensors[0].first == "t1");
  CHECK(third.tensors[0].second.to_vector<float>() == std::vector<float>(60, 1.0f));
  CHECK(third.metadata.at("format") == "pt");

  // Saved again in one file: the shards and the index go.
  llm::write_model_weights(tmp.path().string(), w);
  CHECK(weight_files(tmp.path().string()) == std::set<std::string>{"model.safetensors"});
  // And back to shards: the single file goes, once the shards are in place.
  llm::write_model_weights(tmp.path().string(), w, {.max_shard_bytes = 1000});
  CHECK(weight_files(tmp.path().string()) ==
        std::set<std::string>{"model-00001-of-00002.safetensors",
                              "model-00002-of-00002.safetensors", "model.safetensors.index.json"});
  CHECK_THROWS_WITH_AS(llm::write_model_weights(tmp.path().string(), w, {.max_shard_bytes = 0}),
                       doctest::Contains("max_shard_bytes must be positive"),
                       std::invalid_argument);
}

TEST_CASE("write_model_weights: an error while making a tensor leaves the folder as it was") {
  TempDir tmp;
  const std::string dir = tmp.path().string();
  const auto snapshot = [&] {
    std::map<std::string, std::string> files;
    for (const auto& e : fs::directory_iterator(dir)) {
      std::ifstream in(e.path(), std::ios::binary);
      files[e.path().filename().string()] = std::string(std::istreambuf_iterator<char>(in), {});
    }
    return files;
  };
  std::vector<io::TensorSource> failing = sized({60, 60, 150, 20, 20});
  failing[3].make = []() -> Tensor { throw std::runtime_error("out of memory"); };
  for (const uint64_t before_size : {uint64_t(400), llm::kDefaultMaxShardBytes}) {
    for (const uint64_t after_size : {uint64_t(400), uint64_t(1000), llm::kDefaultMaxShardBytes}) {
      CAPTURE(before_size);
      CAPTURE(after_size);
      for (const auto& e : fs::directory_iterator(dir)) fs::remove(e.path());
      llm::write_model_weights(dir, sized({60, 60, 150, 20, 20}), {.max_shard_bytes = before_size});
      const auto before = snapshot();
      CHECK_THROWS_WITH_AS(llm::write_model_weights(dir, failing, {.max_shard_bytes = after_size}),
                           "out of memory", std::runtime_error);
      CHECK(snapshot() == before);  // no temporary file left either
    }
  }
  // Refused from the names alone, across files, before anything is made.
  std::vector<io::TensorSource> twice = sized({60, 60, 150});
  twice.push_back(twice[0]);
  CHECK_THROWS_WITH_AS(llm::write_model_weights(dir, twice, {.max_shard_bytes = 400}),
                       doctest::Contains("duplicate tensor name 't0'"), std::invalid_argument);
}

TEST_CASE("save_causal_lm in shards reads back as the same model") {
  TempDir tmp;
  const std::string dir = quanta::testing::test_data("llm/models/llama_gqa");
  auto model = llm::load_causal_lm(dir);
  llm::save_causal_lm(*model, tmp.file("one"));
  llm::save_causal_lm(*model, tmp.file("shards"), {}, {.max_shard_bytes = 20000});
  CHECK(weight_files(tmp.file("one")) == std::set<std::string>{"model.safetensors"});
  const std::set<std::string> files = weight_files(tmp.file("shards"));
  CHECK(files.size() > 3);
  CHECK(files.count("model.safetensors.index.json") == 1);
  const StateDict a = llm::read_model_weights(tmp.file("one"));
  const StateDict b = llm::read_model_weights(tmp.file("shards"));
  REQUIRE(a.size() == b.size());
  std::map<std::string, std::vector<float>> by_name;
  for (const auto& [name, t] : a) by_name[name] = t.to_vector<float>();
  for (const auto& [name, t] : b) {
    CAPTURE(name);
    CHECK(by_name.at(name) == t.to_vector<float>());
  }
}

TEST_CASE("parse_shard_size reads transformers' max_shard_size") {
  CHECK(llm::parse_shard_size("5GB") == 5'000'000'000ull);
  CHECK(llm::parse_shard_size("50GB") == llm::kDefaultMaxShardBytes);
  CHECK(llm::parse_shard_size("500mb") == 500'000'000ull);
  CHECK(llm::parse_shard_size(" 1.5 GB ") == 1'500'000'000ull);
  CHECK(llm::parse_shard_size("2TB") == 2'000'000'000'000ull);
  CHECK(llm::parse_shard_size("100KB") == 100'000ull);
  CHECK(llm::parse_shard_size("123456") == 123456ull);
  CHECK(llm::parse_shard_size("999999999999999999") == 999'999'999'999'999'999ull);  // exact
  CHECK(llm::parse_shard_size("4.1GB") == 4'099'999'999ull);  // int(4.1 * 1e9), as the hub
  for (const char* bad : {"", "GB", "5GiB", "5 G", "-1GB", "0", "0MB", "five", "1e3", "nanGB",
                          "0x10GB", "1.5", "1e3MB", "1..5GB"}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(llm::parse_shard_size(bad), doctest::Contains("is not a size"),
                         std::invalid_argument);
  }
}

TEST_CASE("copy_tokenizer_files leaves a reused folder the base's tokenizer files alone") {
  TempDir tmp;
  const fs::path base = tmp.file("base"), out = tmp.file("out");
  fs::create_directories(base / "additional_chat_templates");
  fs::create_directories(out / "additional_chat_templates");
  const auto write = [](const fs::path& p, const std::string& text) { std::ofstream(p) << text; };
  write(base / "tokenizer.json", "{\"base\": 1}");
  write(base / "chat_template.jinja", "base template");
  write(base / "additional_chat_templates" / "tool_use.jinja", "base tools");
  // What an earlier model's merge left in the output folder.
  write(out / "tokenizer.json", "{\"old\": 1}");
  write(out / "tokenizer.model", "old sentencepiece");
  write(out / "generation_config.json", "{\"eos_token_id\": 7}");
  write(out / "additional_chat_templates" / "tool_use.jinja", "old tools");
  write(out / "additional_chat_templates" / "rag.jinja", "old rag");
  write(out / "config.json", "{\"eos_token_id\": 7}");
  write(base / "config.json", "{\"eos_token_id\": 2}");
  llm::copy_tokenizer_files(base.string(), out.string());
  const auto text = [](const fs::path& p) {
    std::ifstream in(p);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  CHECK(text(out / "tokenizer.json") == "{\"base\": 1}");
  CHECK(text(out / "chat_template.jinja") == "base template");
  CHECK(text(out / "additional_chat_templates" / "tool_use.jinja") == "base tools");
  CHECK_FALSE(fs::exists(out / "tokenizer.model"));
  CHECK_FALSE(fs::exists(out / "generation_config.json"));
  CHECK_FALSE(fs::exists(out / "additional_chat_templates" / "rag.jinja"));
  CHECK(read_json((out / "config.json").string())["eos_token_id"] == 2);
  // A base without named templates takes the folder's away, the folder too.
  fs::remove_all(base / "additional_chat_templates");
  llm::copy_tokenizer_files(base.string(), out.string());
  CHECK_FALSE(fs::exists(out / "additional_chat_templates"));
  CHECK(text(out / "tokenizer.json") == "{\"base\": 1}");
}
