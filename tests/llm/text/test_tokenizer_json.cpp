// Tokenizer over a BPE tokenizer.json: the ids Hugging Face tokenizers gives
// for texts that reach each rule, in the byte-level forms GPT-2, Llama 3,
// Qwen2 and SmolLM ship and the SentencePiece-converted ones of Llama 2,
// Mistral and Gemma (tests/data/llm/bpe/, made by make_bpe_tokenizers.py),
// the BOS of the post-processor's template, the EOS of
// tokenizer_config.json, decoding, and what is refused by name.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "llm/text/tokenizer.h"
#include "support/temp_dir.h"
#include "support/test_data.h"

using namespace quanta;
using nlohmann::json;

namespace {

std::string bpe_dir() { return quanta::testing::test_data("llm/bpe"); }

json read(const std::string& path) {
  std::ifstream in(path);
  REQUIRE_MESSAGE(in.good(), path);
  return json::parse(in);
}

// tokenizer.json of `dir` with `change` applied, written to tmp.
std::string changed(const testing::TempDir& tmp, const std::string& dir,
                    const std::function<void(json&)>& change) {
  json j = read(bpe_dir() + "/" + dir + "/tokenizer.json");
  change(j);
  const std::string path = (tmp.path() / "tokenizer.json").string();
  std::ofstream(path) << j.dump();
  return path;
}

std::string ids_text(const std::vector<int64_t>& ids) {
  std::string s;
  for (const int64_t id : ids) s += std::to_string(id) + " ";
  return s;
}

}  // namespace

TEST_CASE("Tokenizer: a tokenizer.json's ids equal Hugging Face tokenizers'") {
  const std::string any = bpe_dir() + "/gpt2/tokenizer.json";
  if (!llm::Tokenizer::available(any)) {
    CHECK_THROWS_WITH(llm::Tokenizer{any}, doctest::Contains("built without ICU"));
    return;
  }
  const json cases = read(bpe_dir() + "/cases.json");
  const std::vector<std::string> texts = cases.at("texts");
  for (const auto& [name, expected] : cases.at("tokenizers_cases").items()) {
    CAPTURE(name);
    const llm::Tokenizer tok(bpe_dir() + "/" + name + "/tokenizer.json");
    CHECK(tok.eos_id() == expected.at("eos_id").get<int64_t>());
    // Llama 3's template puts <|begin_of_text|> first, the SentencePiece
    // ones their <s> (1) or <bos> (3); the others have none.
    const int64_t bos = name == "llama3"                        ? 0
                        : name == "llama2" || name == "mistral" ? 1
                        : name == "gemma"                       ? 3
                                                                : -1;
    CHECK(tok.bos_id() == bos);
    for (size_t i = 0; i < texts.size(); ++i) {
      CAPTURE(texts[i]);
      const json& want = expected.at("cases")[i];
      CHECK(ids_text(tok.encode(texts[i], false)) ==
            ids_text(want.at("ids").get<std::vector<int64_t>>()));
      CHECK(ids_text(tok.encode(texts[i], true)) ==
            ids_text(want.at("with_special").get<std::vector<int64_t>>()));
      CHECK(tok.decode(want.at("ids").get<std::vector<int64_t>>()) ==
            want.at("decoded").get<std::string>());
    }
  }
}

TEST_CASE("Tokenizer: a folder's tokenizer class, as transformers 5 applies it") {
  // LlamaTokenizer's own Metaspace over the file's vocabulary and merges:
  // no prefix after a special token in the text unless `legacy`, none at
  // all without `add_prefix_space`; the other classes read the file as is.
  const std::string any = bpe_dir() + "/llama2/tokenizer.json";
  if (!llm::Tokenizer::available(any)) return;
  const json cases = read(bpe_dir() + "/class_cases.json");
  const std::vector<std::string> texts = cases.at("texts");
  int differing = 0;
  for (const json& c : cases.at("cases")) {
    const std::string name = c.at("tokenizer").get<std::string>();
    CAPTURE(name);
    CAPTURE(c.at("config").dump());
    testing::TempDir tmp;
    std::ofstream(tmp.path() / "tokenizer.json")
        << read(bpe_dir() + "/" + name + "/tokenizer.json").dump();
    std::ofstream(tmp.path() / "tokenizer_config.json") << c.at("config").dump();
    const llm::Tokenizer tok((tmp.path() / "tokenizer.json").string());
    const llm::Tokenizer as_file(bpe_dir() + "/" + name + "/tokenizer.json");
    for (size_t i = 0; i < texts.size(); ++i) {
      CAPTURE(texts[i]);
      const std::vector<int64_t> want = c.at("ids")[i].get<std::vector<int64_t>>();
      CHECK(ids_text(tok.encode(texts[i], false)) == ids_text(want));
      CHECK(ids_text(tok.encode(texts[i], true)) ==
            ids_text(c.at("with_special")[i].get<std::vector<int64_t>>()));
      CHECK(tok.decode(want) == c.at("decoded")[i].get<std::string>());
      differing += as_file.encode(texts[i], false) != want;
    }
  }
  // The fixture reaches the difference: the file alone would be wrong here.
  CHECK(differing >= 10);
}

TEST_CASE("Tokenizer: a folder with both files is read through its tokenizer.json") {
  const std::filesystem::path spm =
      std::filesystem::path(quanta::testing::test_data("llm/models/llama_gqa/tokenizer.model"));
  testing::TempDir tmp;
  const std::string dir = tmp.path().string();
  std::filesystem::copy_file(spm, tmp.path() / "tokenizer.model");
  CHECK(llm::tokenizer_model_in(dir) == (tmp.path() / "tokenizer.model").string());
  std::ofstream(tmp.path() / "tokenizer.json") << read(bpe_dir() + "/llama2/tokenizer.json").dump();
  if (!llm::Tokenizer::available((tmp.path() / "tokenizer.json").string())) {
    CHECK(llm::tokenizer_model_in(dir) == (tmp.path() / "tokenizer.model").string());
    return;
  }
  CHECK(llm::tokenizer_model_in(dir) == (tmp.path() / "tokenizer.json").string());
  // One this build refuses leaves the tokenizer.model.
  std::ofstream(tmp.path() / "tokenizer.json") << R"({"model": {"type": "WordPiece"}})";
  CHECK(llm::tokenizer_model_in(dir) == (tmp.path() / "tokenizer.model").string());
  std::filesystem::remove(tmp.path() / "tokenizer.model");
  CHECK(llm::tokenizer_model_in(dir) == (tmp.path() / "tokenizer.json").string());
}

TEST_CASE("Tokenizer: a model folder's tokenizer.json reads its text files") {
  const std::string source = bpe_dir() + "/qwen2";
  if (!llm::Tokenizer::available(source + "/tokenizer.json")) return;
  testing::TempDir tmp;
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
    std::filesystem::copy_file(source + "/" + f, tmp.path() / f);
  CHECK(llm::tokenizer_model_in(tmp.path().string()) == (tmp.path() / "tokenizer.json").string());
  const std::string text = (tmp.path() / "doc.txt").string();
  std::ofstream(text) << "Hello world";
  const llm::Tokenizer tok((tmp.path() / "tokenizer.json").string());
  CHECK(llm::encode_text_file(text, tmp.path().string()) == tok.encode("Hello world", true));
  // A tokenizer.model beside it changes nothing: transformers reads the
  // tokenizer.json.
  std::ofstream(tmp.path() / "tokenizer.model") << "x";
  CHECK(llm::tokenizer_model_in(tmp.path().string()) == (tmp.path() / "tokenizer.json").string());
}

TEST_CASE("Tokenizer: what a tokenizer.json holds that quanta does not run is named") {
  const std::string any = bpe_dir() + "/gpt2/tokenizer.json";
  if (!llm::Tokenizer::available(any)) return;
  testing::TempDir tmp;
  const auto error = [&](const std::string& dir, const std::function<void(json&)>& change) {
    const std::string path = changed(tmp, dir, change);
    try {
      llm::Tokenizer{path};
    } catch (const std::exception& e) {
      CHECK(std::string(e.what()).find(path) == 0);
      return std::string(e.what());
    }
    FAIL("no error");
    return std::string();
  };
  CHECK(error("gpt2", [](json& j) {
          j["model"]["type"] = "WordPiece";
        }).find("model type \"WordPiece\" is not supported") != std::string::npos);
  CHECK(error("gpt2", [](json& j) {
          j["normalizer"] = {{"type", "Lowercase"}};
        }).find("is not supported (NFC, Prepend, Replace of a String)") != std::string::npos);
  CHECK(error("gpt2", [](json& j) {
          j["pre_tokenizer"] = {{"type", "Whitespace"}};
        }).find("pre-tokenizer \"Whitespace\" is not supported") != std::string::npos);
  CHECK(error("gpt2", [](json& j) {
          j["pre_tokenizer"] = nullptr;
          j["decoder"] = nullptr;
        }).find("no decoder") != std::string::npos);
  CHECK(error("mistral", [](json& j) {
          j["pre_tokenizer"]["prepend_scheme"] = "sometimes";
        }).find("prepend_scheme \"sometimes\" is not always, first or never") != std::string::npos);
  CHECK(error("llama3", [](json& j) {
          j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "([";
        }).find("does not compile") != std::string::npos);
  CHECK(error("gpt2", [](json& j) {
          j["model"]["merges"][0] = json::array({"Ġ", "nope"});
        }).find("merge 0 (\"Ġ\" \"nope\") names \"nope\"") != std::string::npos);
  CHECK(error("gpt2", [](json& j) {
          j["decoder"] = {{"type", "WordPiece"}};
        }).find("decoder \"WordPiece\" is not supported") != std::string::npos);
  CHECK(error("gpt2", [](json& j) {
          j["model"]["ignore_merges"] = "yes";
        }).find("not a tokenizer.json quanta reads") != std::string::npos);
  CHECK(error("gpt2", [](json& j) {
          j["added_tokens"][0]["id"] = "zero";
        }).find("not a tokenizer.json quanta reads") != std::string::npos);
  CHECK(error("gpt2", [](json& j) { j = json::array(); }).find("not a tokenizer.json object") !=
        std::string::npos);
  // Merges as "a b" strings, as tokenizers before 0.20 wrote them: the same
  // ids.
  const llm::Tokenizer pairs(bpe_dir() + "/llama3/tokenizer.json");
  const std::string strings = changed(tmp, "llama3", [](json& j) {
    for (json& m : j["model"]["merges"])
      m = m[0].get<std::string>() + " " + m[1].get<std::string>();
  });
  const std::string text = "It's what we've done; numbers 1234 and café";
  CHECK(llm::Tokenizer(strings).encode(text) == pairs.encode(text));
  const llm::Tokenizer tok(any);
  CHECK_THROWS_WITH(tok.decode({5, 70000}), doctest::Contains("id 70000 is outside"));
}
