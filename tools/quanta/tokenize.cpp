// `quanta tokenize --model DIR (--text FILE... | --jsonl FILE) --out TOKENS`:
// text through a model folder's tokenizer into an llm.c token file, once,
// for the runs that read it after (what tools/tokenize.py does in Python).
#include <algorithm>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "flag_checks.h"
#include "llm/data/token_file.h"
#include "llm/text/tokenizer.h"

namespace quanta::cli {
namespace {

struct TokenizeFlags {
  std::string model;
  std::vector<std::string> text;
  std::string jsonl;
  std::string field = "text";
  std::string out;
  bool bos = false, eos = false;
};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void run_tokenize(const TokenizeFlags& f) {
  if (f.text.empty() == f.jsonl.empty())
    throw UsageError("give the documents as --text FILE... or --jsonl FILE (one of them)");
  std::vector<InputFile> inputs;
  for (const std::string& t : f.text) inputs.push_back({"the text " + t, t});
  if (!f.jsonl.empty()) inputs.push_back({"the JSONL file", f.jsonl});
  const std::string tokenizer = llm::tokenizer_model_in(f.model);
  if (!tokenizer.empty()) inputs.push_back({"the tokenizer", tokenizer});
  refuse_output_over_input("--out", f.out, inputs);
  const std::string& path = tokenizer;
  if (path.empty())
    throw UsageError(f.model + " has no tokenizer.model or tokenizer.json to tokenize with");
  const llm::Tokenizer tok(path);
  if (f.bos && tok.bos_id() < 0)
    throw UsageError("--bos: " + path + " has no BOS (its template puts none first)");
  if (f.eos && tok.eos_id() < 0)
    throw UsageError("--eos: " + path + " has no EOS (tokenizer_config.json's eos_token)");
  std::vector<int64_t> ids;
  int64_t documents = 0;
  const auto add = [&](const std::string& document) {
    const std::vector<int64_t> body = tok.encode(document, f.bos);
    ids.insert(ids.end(), body.begin(), body.end());
    if (f.eos) ids.push_back(tok.eos_id());
    ++documents;
  };
  for (const std::string& t : f.text) add(read_text(t));
  if (!f.jsonl.empty()) {
    std::ifstream in(f.jsonl);
    if (!in) throw std::runtime_error(f.jsonl + ": cannot open");
    std::string line;
    for (int64_t n = 1; std::getline(in, line); ++n) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        throw UsageError(f.jsonl + ":" + std::to_string(n) + ": not JSON (" + e.what() + ")");
      }
      if (!j.is_object() || !j.contains(f.field) || !j.at(f.field).is_string())
        throw UsageError(f.jsonl + ":" + std::to_string(n) + ": no string field \"" + f.field +
                         "\"");
      add(j.at(f.field).get<std::string>());
    }
  }
  int64_t largest = -1;
  for (const int64_t id : ids) largest = std::max(largest, id);
  const bool wide = tok.vocab_size() > 65536 || largest >= 65536;
  llm::write_token_file(f.out, ids, wide ? llm::TokenWidth::u32 : llm::TokenWidth::u16);
  std::cout << "tokenize: " << documents << (documents == 1 ? " document, " : " documents, ")
            << ids.size() << " tokens (" << (wide ? "uint32" : "uint16") << ") -> " << f.out
            << "\n";
}

}  // namespace

void add_tokenize(CLI::App& app) {
  auto f = std::make_shared<TokenizeFlags>();
  CLI::App* sub = app.add_subcommand(
      "tokenize",
      "Text through a model folder's tokenizer.model or tokenizer.json into an llm.c token "
      "file (what --data reads), once for many runs");
  sub->footer(
      "Examples:\n"
      "  quanta tokenize --model DIR --text corpus.txt --out corpus.bin --bos --eos\n"
      "  quanta tokenize --model DIR --jsonl data.jsonl --field text --out data.bin --eos");
  sub->add_option("--model", f->model, "model folder holding tokenizer.model or tokenizer.json")
      ->required();
  sub->add_option("--text", f->text, "UTF-8 text files, one document each");
  sub->add_option("--jsonl", f->jsonl, "one JSON object a line, one document each");
  sub->add_option("--field", f->field, "the JSONL field holding the text")->capture_default_str();
  sub->add_option("--out", f->out, "the token file to write (uint16 where the vocabulary fits)")
      ->required();
  sub->add_flag("--bos", f->bos, "the tokenizer's BOS before every document");
  sub->add_flag("--eos", f->eos, "the tokenizer's EOS after every document");
  sub->callback([f] { run_tokenize(*f); });
}

}  // namespace quanta::cli
