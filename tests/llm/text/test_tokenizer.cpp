// Tokenizer: the ids libsentencepiece's own spm_encode gives for a few texts
// (tests/data/llm/tokenizer_cases.tsv, make_tokenizer.sh), a BOS in front
// on request, decode back to the text, and clear errors.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "llm/text/tokenizer.h"
#include "support/temp_dir.h"
#include "support/test_data.h"

using namespace quanta;

namespace {

std::string data_dir() { return quanta::testing::test_data("llm"); }

}  // namespace

TEST_CASE("Tokenizer: ids equal spm_encode's, BOS first on request, decode inverts") {
  const std::string model = llm::tokenizer_model_in(data_dir() + "/models/llama_gqa");
  REQUIRE(!model.empty());
  if (!llm::Tokenizer::available(model)) {
    CHECK_THROWS_WITH(llm::Tokenizer{model}, doctest::Contains("built without libsentencepiece"));
    MESSAGE("skipped: quanta was built without libsentencepiece");
    return;
  }
  const llm::Tokenizer tok(model);
  CHECK(tok.vocab_size() == 64);
  CHECK(tok.bos_id() == 1);
  CHECK(tok.eos_id() == 2);
  std::ifstream cases(data_dir() + "/tokenizer_cases.tsv");
  std::string line;
  int n = 0;
  while (std::getline(cases, line)) {
    const auto tab = line.find('\t');
    const std::string text = line.substr(0, tab);
    std::vector<int64_t> want;
    std::istringstream ids(line.substr(tab + 1));
    for (int64_t id; ids >> id;) want.push_back(id);
    INFO("text '", text, "'");
    CHECK(tok.encode(text, false) == want);
    std::vector<int64_t> with_bos = {1};
    with_bos.insert(with_bos.end(), want.begin(), want.end());
    CHECK(tok.encode(text, true) == with_bos);
    ++n;
  }
  CHECK(n == 4);
  CHECK(tok.decode(tok.encode("hello world", true)) == "hello world");
  CHECK_THROWS_WITH(tok.decode({5, 64}), doctest::Contains("id 64 is outside the tokenizer's 64"));
}

TEST_CASE("Tokenizer: a tokenizer.model splits the special tokens out as transformers does") {
  // sentencepiece_cases.json (make_autotokenizer_cases.py): AutoTokenizer's
  // ids for the tiny model alone and with a tokenizer_config.json adding
  // tokens beyond its 64 pieces (one rstrip, one lstrip and not special).
  const std::string source = data_dir() + "/models/llama_gqa/tokenizer.model";
  if (!llm::Tokenizer::available(source)) return;
  std::ifstream in(data_dir() + "/sentencepiece_cases.json");
  REQUIRE(in.good());
  const nlohmann::json fixture = nlohmann::json::parse(in);
  const std::vector<std::string> texts = fixture.at("texts");
  for (const nlohmann::json& c : fixture.at("cases")) {
    CAPTURE(c.at("config").dump());
    testing::TempDir tmp;
    std::filesystem::copy_file(source, tmp.path() / "tokenizer.model");
    if (!c.at("config").is_null())
      std::ofstream(tmp.path() / "tokenizer_config.json") << c.at("config").dump();
    const llm::Tokenizer tok((tmp.path() / "tokenizer.model").string());
    CHECK(tok.vocab_size() == (c.at("config").is_null() ? 64 : 67));
    for (size_t i = 0; i < texts.size(); ++i) {
      CAPTURE(texts[i]);
      const std::vector<int64_t> want = c.at("ids")[i].get<std::vector<int64_t>>();
      CHECK(tok.encode(texts[i], false) == want);
      CHECK(tok.decode(want) == c.at("decoded")[i].get<std::string>());
    }
  }
  // An added_tokens_decoder key that is no id is named.
  testing::TempDir tmp;
  std::filesystem::copy_file(source, tmp.path() / "tokenizer.model");
  std::ofstream(tmp.path() / "tokenizer_config.json")
      << R"({"added_tokens_decoder": {"x1": {"content": "<a>"}}})";
  CHECK_THROWS_WITH(llm::Tokenizer((tmp.path() / "tokenizer.model").string()),
                    doctest::Contains("added_tokens_decoder entry \"x1\" is not an id"));
}

TEST_CASE("Tokenizer: a missing or broken tokenizer.model names the file") {
  if (!llm::Tokenizer::available("tokenizer.model")) return;
  testing::TempDir tmp;
  const std::string bad = (tmp.path() / "tokenizer.model").string();
  std::ofstream(bad) << "not a model";
  CHECK_THROWS_WITH(llm::Tokenizer{bad},
                    doctest::Contains((bad + ": not a SentencePiece model").c_str()));
  CHECK_THROWS_WITH(llm::Tokenizer{bad + ".none"}, doctest::Contains("not a SentencePiece model"));
  CHECK(llm::tokenizer_model_in(tmp.path().string() + "/nothing").empty());
}
