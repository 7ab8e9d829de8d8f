// `quanta eval --model` and `quanta generate` on the tiny transformers models
// of tests/data/llm: the perplexity equals transformers' loss on the same
// windows, greedy tokens equal transformers' generate, and bad flags or
// inputs end in one clear line.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_runner.h"
#include "llm/data/token_file.h"
#include "llm/model/causal_lm.h"
#include "llm/model/generate.h"
#include "llm/model/lm_eval.h"
#include "llm/model/model_folder.h"
#include "llm/qlora/peft_folder.h"
#include "llm/text/tokenizer.h"
#include "quanta.h"
#include "support/random_llama_folder.h"
#include "support/test_data.h"

using namespace quanta;
using namespace quanta::test;

namespace {

std::string models() { return quanta::testing::test_data("llm/models/"); }

const Tensor& expected(const io::SafetensorsFile& f, const std::string& name) {
  for (const auto& [n, t] : f.tensors)
    if (n == name) return t;
  FAIL("expected file lacks " << name);
  static Tensor none;
  return none;
}

std::string ids_text(const std::vector<int64_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

}  // namespace

TEST_CASE("quanta eval --model: one window's loss equals transformers'") {
  const io::SafetensorsFile want =
      io::load_safetensors(quanta::testing::test_data("llm/expected/llama_gqa.safetensors"));
  // The expected file's two rows of 12 tokens as two windows.
  const std::vector<int64_t> ids = expected(want, "input_ids").to_vector<int64_t>();
  ScratchDir dir("llm_cli");
  llm::write_token_file(dir.file("tokens.bin"), ids, llm::TokenWidth::u16);
  for (const char* device : {"cpu", "sim"}) {
    const CliResult r =
        run_quanta({"eval", "--model", models() + "llama_gqa", "--data", dir.file("tokens.bin"),
                    "--seq-len", "12", "--device", device, "--json"});
    REQUIRE_MESSAGE(r.code == 0, r.err);
    const auto j = nlohmann::json::parse(r.out);
    CHECK(j.at("windows") == 2);
    CHECK(j.at("tokens") == 22);
    // transformers' loss is the mean over both rows' 22 predictions; with
    // equal windows that is the mean of the windows' means.
    const double loss = expected(want, "loss").to_vector<double>()[0];
    CHECK(std::abs(j.at("loss").get<double>() - loss) < 1e-5 * loss);
    CHECK(std::abs(j.at("perplexity").get<double>() - std::exp(loss)) < 1e-4 * std::exp(loss));
  }
  const CliResult text = run_quanta({"eval", "--model", models() + "llama_gqa", "--data",
                                     dir.file("tokens.bin"), "--seq-len", "12"});
  CHECK(contains(text.out, "perplexity"));
  // bf16 products (MixedPrecision): the tiny model's products are below the
  // size the CPU rounds, so the loss stays transformers' within bf16's reach.
  const CliResult mixed =
      run_quanta({"eval", "--model", models() + "llama_gqa", "--data", dir.file("tokens.bin"),
                  "--seq-len", "12", "--precision", "bf16", "--json"});
  REQUIRE_MESSAGE(mixed.code == 0, mixed.err);
  const auto jm = nlohmann::json::parse(mixed.out);
  CHECK(jm.at("precision") == "bf16");
  const double want_loss = expected(want, "loss").to_vector<double>()[0];
  CHECK(std::abs(jm.at("loss").get<double>() - want_loss) < 1e-2 * want_loss);
  check_one_line_error(
      run_quanta({"eval", "--model", models() + "llama_gqa", "--data", dir.file("tokens.bin"),
                  "--seq-len", "12", "--precision", "f16"}),
      2, "--precision");
  check_one_line_error(run_quanta({"eval", "--model", models() + "llama_gqa", "--data",
                                   dir.file("tokens.bin"), "--seq-len", "25"}),
                       1, "hold no window of 25");
  check_one_line_error(
      run_quanta({"eval", "--model", models() + "llama_gqa", "--data", dir.file("tokens.bin")}), 2,
      "--model needs --seq-len N");
  check_one_line_error(run_quanta({"eval", "--model", models() + "nonexistent", "--data",
                                   dir.file("tokens.bin"), "--seq-len", "4"}),
                       1, "cannot open");
}

// transformers' generate stops after an id of generation_config.json's
// eos_token_id (else config.json's), keeping it; the fixture's tokens were
// generated with eos_token_id=None, so a copy of the folder names one of them.
TEST_CASE("quanta generate: stops at the folder's end-of-sequence ids, as transformers does") {
  const io::SafetensorsFile want =
      io::load_safetensors(quanta::testing::test_data("llm/expected/llama_gqa.safetensors"));
  const std::vector<int64_t> all = expected(want, "generated").to_vector<int64_t>();
  const std::string prompt = ids_text(expected(want, "prompt").to_vector<int64_t>());
  // The first generated id not seen before it, past the first.
  size_t stop = 1;
  while (stop < all.size() && std::find(all.begin(), all.begin() + stop, all[stop]) !=
                                  all.begin() + static_cast<std::ptrdiff_t>(stop))
    ++stop;
  REQUIRE(stop < all.size());
  const std::vector<int64_t> until(all.begin(),
                                   all.begin() + static_cast<std::ptrdiff_t>(stop) + 1);
  ScratchDir dir("generate_eos");
  const std::string model = dir.file("model");
  fs::copy(models() + "llama_gqa", model);
  const auto ids = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {"generate", "--model",          model, "--prompt-ids",
                                     prompt,     "--max-new-tokens", "8",   "--json"};
    args.insert(args.end(), extra.begin(), extra.end());
    const CliResult r = run_quanta(args);
    REQUIRE_MESSAGE(r.code == 0, r.err);
    return nlohmann::json::parse(r.out).at("ids").get<std::vector<int64_t>>();
  };
  const auto write_json = [](const std::string& path, const nlohmann::json& j) {
    std::ofstream(path) << j.dump(2);
  };
  const std::string config_path = model + "/config.json";
  nlohmann::json config = nlohmann::json::parse(std::ifstream(config_path));
  // config.json's id, when there is no generation_config.json.
  config["eos_token_id"] = all[stop];
  write_json(config_path, config);
  CHECK(ids({}) == until);
  CHECK(ids({"--ignore-eos"}) == all);
  // generation_config.json's list wins over config.json's id.
  config["eos_token_id"] = 63;
  write_json(config_path, config);
  write_json(model + "/generation_config.json", {{"eos_token_id", {62, all[stop]}}});
  CHECK(ids({}) == until);
  CHECK(llm::eos_token_ids(model) == std::vector<int64_t>{62, all[stop]});
  write_json(model + "/generation_config.json", {{"eos_token_id", nullptr}});
  CHECK(llm::eos_token_ids(model).empty());
  CHECK(ids({}) == all);
  // A generation_config.json without the key: none, config.json not read
  // (transformers generated all 8 tokens there, in the peer environment).
  config["eos_token_id"] = all[stop];
  write_json(config_path, config);
  write_json(model + "/generation_config.json", {{"bos_token_id", 1}, {"do_sample", false}});
  CHECK(llm::eos_token_ids(model).empty());
  CHECK(ids({}) == all);
  // Negative ids are never generated: left out.
  write_json(model + "/generation_config.json", {{"eos_token_id", {-1, all[stop]}}});
  CHECK(llm::eos_token_ids(model) == std::vector<int64_t>{all[stop]});
  write_json(model + "/generation_config.json", {{"eos_token_id", "2"}});
  check_one_line_error(run_quanta({"generate", "--model", model, "--prompt-ids", prompt}), 1,
                       "generation_config.json: eos_token_id must be a token id or a list");
}

TEST_CASE("quanta generate: greedy tokens equal transformers' generate") {
  for (const char* name : {"llama_gqa", "qwen2_bias", "mistral_sharded", "qwen3_qk_norm",
                           "gemma_geglu", "gemma2_softcap", "gemma3_text", "mistral_window"}) {
    INFO("model ", name);
    const io::SafetensorsFile want = io::load_safetensors(
        quanta::testing::test_data(std::string("llm/expected/") + name + ".safetensors"));
    const CliResult r = run_quanta({"generate", "--model", models() + name, "--prompt-ids",
                                    ids_text(expected(want, "prompt").to_vector<int64_t>()),
                                    "--max-new-tokens", "8", "--json"});
    REQUIRE_MESSAGE(r.code == 0, r.err);
    CHECK(nlohmann::json::parse(r.out).at("ids").get<std::vector<int64_t>>() ==
          expected(want, "generated").to_vector<int64_t>());
  }
  // --precision bf16 takes the same greedy path (the tiny model's products
  // stay f32 below the CPU's bf16 size).
  const CliResult mixed =
      run_quanta({"generate", "--model", models() + "llama_gqa", "--prompt-ids", "3,4,5",
                  "--max-new-tokens", "4", "--precision", "bf16", "--json"});
  REQUIRE_MESSAGE(mixed.code == 0, mixed.err);
  CHECK(nlohmann::json::parse(mixed.out).at("ids").size() == 4);
  // Sampling: a seed gives the same tokens every run.
  const std::vector<std::string> sample = {"generate",     "--model", models() + "llama_gqa",
                                           "--prompt-ids", "3,4,5",   "--temperature",
                                           "0.9",          "--top-p", "0.8",
                                           "--seed",       "11"};
  const CliResult a = run_quanta(sample), b = run_quanta(sample);
  REQUIRE(a.code == 0);
  CHECK(a.out == b.out);
  check_one_line_error(
      run_quanta({"generate", "--model", models() + "llama_gqa", "--prompt-ids", "3,x"}), 2,
      "'x' is not an integer");
  check_one_line_error(
      run_quanta({"generate", "--model", models() + "llama_gqa", "--prompt-ids", "3,64"}), 1,
      "prompt id 64 at position 1 is outside [0, 64)");
}

// Llama sizes whose weights are tens of megabytes: what a memory figure can see.
const quanta::testing::RandomLlama kWide = {
    .vocab = 8192, .hidden = 512, .intermediate = 1024, .heads = 8, .kv_heads = 8, .head_dim = 64};

TEST_CASE("loading a model folder peaks near the weights' bytes, not twice them") {
  // About 75 MB of f32 weights, written by save_causal_lm.
  ScratchDir dir("llm_rss");
  const int64_t weights = quanta::testing::write_random_llama(dir.file("model"), kWide, 9);
  // meson test sets MALLOC_PERTURB_, whose fill touches every page malloc
  // hands out (the slack of huge-page-aligned blocks too): not what a user
  // runs with.
  ::unsetenv("MALLOC_PERTURB_");
  // Loading only (no forward: BLAS's own buffers are not the loader's), and
  // the same on a tiny model: the program and its libraries.
  const CliResult idle = run_quanta({"generate", "--model", models() + "llama_gqa", "--prompt-ids",
                                     "1,2", "--max-new-tokens", "0", "--json"});
  const CliResult r = run_quanta({"generate", "--model", dir.file("model"), "--prompt-ids", "1,2",
                                  "--max-new-tokens", "0", "--json"});
  REQUIRE_MESSAGE(idle.code == 0, idle.err);
  REQUIRE_MESSAGE(r.code == 0, r.err);
  const int64_t base = nlohmann::json::parse(idle.out).at("peak_rss_bytes").get<int64_t>();
  const int64_t peak = nlohmann::json::parse(r.out).at("peak_rss_bytes").get<int64_t>();
  MESSAGE("quanta generate on " << weights << " bytes of weights: peak RSS " << peak << " bytes, "
                                << peak - base << " over the tiny model's run");
  CHECK(peak - base > weights / 2);  // the measure sees the weights at all
#if defined(__SANITIZE_ADDRESS__)
  // AddressSanitizer's shadow adds an eighth of every byte touched, and its
  // allocator pads: the goal is for normal builds.
  CHECK(peak - base < weights * 14 / 10);
#else
  CHECK(peak - base < weights * 12 / 10);
#endif
}

TEST_CASE("quantizing a model folder reads a layer at a time: the float model is never whole") {
  // About 46 MB of f32 weights, nearly all in the layers' projections
  // (tied embeddings of 2048 rows).
  ScratchDir dir("llm_quantize_rss");
  quanta::testing::RandomLlama sizes = kWide;
  sizes.vocab = 2048;
  sizes.tied = true;
  const int64_t weights = quanta::testing::write_random_llama(dir.file("model"), sizes, 9);
  ::unsetenv("MALLOC_PERTURB_");  // as above: it touches every page malloc hands out
  const CliResult idle = run_quanta({"quantize", models() + "llama_gqa", dir.file("tiny4")});
  const CliResult r = run_quanta({"quantize", dir.file("model"), dir.file("model4")});
  REQUIRE_MESSAGE(idle.code == 0, idle.err);
  REQUIRE_MESSAGE(r.code == 0, r.err);
  // "...; peak resident memory 142,860,288 bytes"
  const auto peak_of = [](const CliResult& run) {
    const std::string key = "peak resident memory ";
    const std::size_t at = run.out.find(key);
    REQUIRE_MESSAGE(at != std::string::npos, run.out);
    std::string digits;
    for (std::size_t i = at + key.size(); i < run.out.size() && run.out[i] != ' '; ++i)
      if (run.out[i] != ',') digits += run.out[i];
    return std::stoll(digits);
  };
  const int64_t peak = peak_of(r), grown = peak - peak_of(idle);
  MESSAGE("quanta quantize on " << weights << " bytes of f32 weights: peak RSS " << peak
                                << " bytes, " << grown << " over the tiny model's run");
  // What must be held: the embeddings (4 MB), the 4-bit layers (about 5.5
  // MB) and a projection or two in f32 (2 MB each); the whole float model
  // would be all 46 MB.
  CHECK(grown > weights / 10);  // the measure sees the model at all
#if defined(__SANITIZE_ADDRESS__)
  CHECK(grown < weights * 6 / 10);
#else
  CHECK(grown < weights * 4 / 10);
#endif
}

TEST_CASE("quanta generate --prompt and eval on text, through the folder's tokenizer.model") {
  const std::string model = models() + "llama_gqa";
  if (!llm::Tokenizer::available("tokenizer.model")) {
    check_one_line_error(run_quanta({"generate", "--model", model, "--prompt", "hello world"}), 1,
                         "built without libsentencepiece");
    return;
  }
  // "hello world" is 23 32 26 42 46 (tokenizer_cases.tsv), after BOS 1.
  const CliResult text = run_quanta(
      {"generate", "--model", model, "--prompt", "hello world", "--max-new-tokens", "8", "--json"});
  const CliResult ids = run_quanta({"generate", "--model", model, "--prompt-ids",
                                    "1,23,32,26,42,46", "--max-new-tokens", "8", "--json"});
  REQUIRE_MESSAGE(text.code == 0, text.err);
  REQUIRE_MESSAGE(ids.code == 0, ids.err);
  const auto jt = nlohmann::json::parse(text.out), ji = nlohmann::json::parse(ids.out);
  CHECK(jt.at("prompt_ids") == ji.at("prompt_ids"));
  CHECK(jt.at("ids") == ji.at("ids"));
  CHECK(jt.at("text").get<std::string>().size() > 0);
  const CliResult plain = run_quanta(
      {"generate", "--model", model, "--prompt", "hello world", "--max-new-tokens", "8"});
  CHECK(plain.out.rfind("hello world", 0) == 0);
  // Text data: the same windows as the token file of its ids.
  ScratchDir dir("llm_text");
  const std::string corpus = "the quick brown fox jumps over the lazy dog, hello world";
  std::ofstream(dir.file("text.txt")) << corpus;
  const llm::Tokenizer tok(llm::tokenizer_model_in(model));
  llm::write_token_file(dir.file("text.bin"), tok.encode(corpus, true), llm::TokenWidth::u16);
  const CliResult a = run_quanta(
      {"eval", "--model", model, "--data", dir.file("text.txt"), "--seq-len", "8", "--json"});
  const CliResult b = run_quanta(
      {"eval", "--model", model, "--data", dir.file("text.bin"), "--seq-len", "8", "--json"});
  REQUIRE_MESSAGE(a.code == 0, a.err);
  REQUIRE_MESSAGE(b.code == 0, b.err);
  CHECK(nlohmann::json::parse(a.out).at("loss") == nlohmann::json::parse(b.out).at("loss"));
  check_one_line_error(
      run_quanta({"generate", "--model", models() + "qwen2_bias", "--prompt", "hello"}), 2,
      "--prompt needs");
}

TEST_CASE("quanta generate --prompt through the folder's tokenizer.json") {
  const std::string model = models() + "qwen2_bpe";
  if (!llm::Tokenizer::available(model + "/tokenizer.json")) {
    check_one_line_error(run_quanta({"generate", "--model", model, "--prompt", "hello world"}), 1,
                         "built without ICU");
    return;
  }
  const llm::Tokenizer tok(model + "/tokenizer.json");
  const std::string prompt = "<|im_start|>user\nhello world<|im_end|>";
  const std::vector<int64_t> want = tok.encode(prompt, true);
  std::string listed;
  for (const int64_t id : want) listed += (listed.empty() ? "" : ",") + std::to_string(id);
  const CliResult text = run_quanta(
      {"generate", "--model", model, "--prompt", prompt, "--max-new-tokens", "6", "--json"});
  const CliResult ids = run_quanta(
      {"generate", "--model", model, "--prompt-ids", listed, "--max-new-tokens", "6", "--json"});
  REQUIRE_MESSAGE(text.code == 0, text.err);
  REQUIRE_MESSAGE(ids.code == 0, ids.err);
  const auto jt = nlohmann::json::parse(text.out), ji = nlohmann::json::parse(ids.out);
  CHECK(jt.at("prompt_ids").get<std::vector<int64_t>>() == want);
  CHECK(jt.at("ids") == ji.at("ids"));
  CHECK(jt.at("text").get<std::string>() == tok.decode(jt.at("ids").get<std::vector<int64_t>>()));
  check_one_line_error(
      run_quanta({"generate", "--model", model, "--prompt", "hi", "--prompt-ids", "1"}), 2,
      "give the prompt as one of");
}

TEST_CASE("quanta tokenize: text and JSONL documents to the token file eval reads") {
  const std::string model = models() + "qwen2_bpe";
  if (!llm::Tokenizer::available(model + "/tokenizer.json")) return;
  const llm::Tokenizer tok(model + "/tokenizer.json");
  ScratchDir dir("llm_tokenize");
  const std::string a = "the quick brown fox jumps over the lazy dog, hello world",
                    b = "café <|im_start|>user\nhi<|im_end|>";
  std::ofstream(dir.file("a.txt")) << a;
  std::ofstream(dir.file("b.txt")) << b;
  {
    std::ofstream jsonl(dir.file("docs.jsonl"));
    jsonl << nlohmann::json{{"body", a}}.dump() << "\n\n"
          << nlohmann::json{{"body", b}}.dump() << "\n";
  }
  const auto ids_in = [](const std::string& path) {
    const llm::TokenFile f(path);
    CHECK(f.width() == llm::TokenWidth::u16);
    return f.read(0, f.size());
  };
  std::vector<int64_t> want = tok.encode(a, false);
  want.push_back(tok.eos_id());
  for (const int64_t id : tok.encode(b, false)) want.push_back(id);
  want.push_back(tok.eos_id());
  const CliResult text = run_quanta({"tokenize", "--model", model, "--text", dir.file("a.txt"),
                                     dir.file("b.txt"), "--out", dir.file("text.bin"), "--eos"});
  REQUIRE_MESSAGE(text.code == 0, text.err);
  CHECK(text.out.find("2 documents, " + std::to_string(want.size()) + " tokens (uint16)") !=
        std::string::npos);
  CHECK(ids_in(dir.file("text.bin")) == want);
  const CliResult jsonl =
      run_quanta({"tokenize", "--model", model, "--jsonl", dir.file("docs.jsonl"), "--field",
                  "body", "--out", dir.file("jsonl.bin"), "--eos"});
  REQUIRE_MESSAGE(jsonl.code == 0, jsonl.err);
  CHECK(ids_in(dir.file("jsonl.bin")) == want);
  // What eval reads from the text itself (a BOS first where there is one:
  // none here) equals the token file of it.
  REQUIRE(run_quanta({"tokenize", "--model", model, "--text", dir.file("a.txt"), "--out",
                      dir.file("a.bin")})
              .code == 0);
  const CliResult from_text = run_quanta(
      {"eval", "--model", model, "--data", dir.file("a.txt"), "--seq-len", "8", "--json"});
  const CliResult from_tokens = run_quanta(
      {"eval", "--model", model, "--data", dir.file("a.bin"), "--seq-len", "8", "--json"});
  REQUIRE_MESSAGE(from_text.code == 0, from_text.err);
  REQUIRE_MESSAGE(from_tokens.code == 0, from_tokens.err);
  CHECK(nlohmann::json::parse(from_text.out).at("loss") ==
        nlohmann::json::parse(from_tokens.out).at("loss"));
  check_one_line_error(run_quanta({"tokenize", "--model", model, "--text", dir.file("a.txt"),
                                   "--out", dir.file("x.bin"), "--bos"}),
                       2, "--bos: ");
  check_one_line_error(run_quanta({"tokenize", "--model", model, "--jsonl", dir.file("docs.jsonl"),
                                   "--out", dir.file("x.bin")}),
                       2, "docs.jsonl:1: no string field \"text\"");
  check_one_line_error(run_quanta({"tokenize", "--model", models() + "qwen2_bias", "--text",
                                   dir.file("a.txt"), "--out", dir.file("x.bin")}),
                       2, "has no tokenizer.model or tokenizer.json");
  check_one_line_error(run_quanta({"tokenize", "--model", model, "--out", dir.file("x.bin")}), 2,
                       "one of them");
  check_one_line_error(run_quanta({"tokenize", "--model", model, "--text", dir.file("a.txt"),
                                   "--out", dir.file("a.txt")}),
                       2, "--out");
}

TEST_CASE("quanta eval --model on JSONL: each example scored, completions alone on request") {
  const std::string model = models() + "llama_gqa";
  ScratchDir dir("llm_eval_jsonl");
  const std::vector<int64_t> ids = {5, 9, 2, 33, 4, 17, 60, 1, 8, 21, 40, 2, 7, 7, 30, 11};
  llm::write_token_file(dir.file("one.bin"), ids, llm::TokenWidth::u16);
  nlohmann::json line{{"input_ids", ids}};
  std::ofstream(dir.file("one.jsonl")) << line.dump() << "\n";
  // One example of 16 ids is one window of 16: the same 15 predictions.
  const CliResult a = run_quanta(
      {"eval", "--model", model, "--data", dir.file("one.jsonl"), "--seq-len", "16", "--json"});
  const CliResult b = run_quanta(
      {"eval", "--model", model, "--data", dir.file("one.bin"), "--seq-len", "16", "--json"});
  REQUIRE_MESSAGE(a.code == 0, a.err);
  REQUIRE_MESSAGE(b.code == 0, b.err);
  const auto ja = nlohmann::json::parse(a.out), jb = nlohmann::json::parse(b.out);
  CHECK(ja.at("tokens") == 15);
  CHECK(ja.at("examples") == 1);
  CHECK(ja.at("loss").get<double>() == doctest::Approx(jb.at("loss").get<double>()).epsilon(1e-12));
  // Pairs of ids: all their tokens, or the completions' alone.
  std::ofstream(dir.file("pairs.jsonl"))
      << R"({"prompt": [5, 9, 2, 33], "completion": [4, 17, 60]})"
      << "\n"
      << R"({"prompt": [1, 8], "completion": [21, 40, 2, 7]})"
      << "\n";
  const CliResult all = run_quanta(
      {"eval", "--model", model, "--data", dir.file("pairs.jsonl"), "--seq-len", "16", "--json"});
  const CliResult completions =
      run_quanta({"eval", "--model", model, "--data", dir.file("pairs.jsonl"), "--seq-len", "16",
                  "--completions-only", "--json"});
  REQUIRE_MESSAGE(all.code == 0, all.err);
  REQUIRE_MESSAGE(completions.code == 0, completions.err);
  CHECK(nlohmann::json::parse(all.out).at("tokens") == 6 + 5);
  CHECK(nlohmann::json::parse(completions.out).at("tokens") == 3 + 4);
  CHECK(nlohmann::json::parse(completions.out).at("completions_only") == true);
  check_one_line_error(run_quanta({"eval", "--model", model, "--data", dir.file("one.bin"),
                                   "--seq-len", "16", "--completions-only"}),
                       2, "--completions-only scores JSONL prompt-completion pairs");
}

TEST_CASE("quanta eval --model --document-start: a token file's documents scored apart") {
  const std::string model = models() + "llama_gqa";  // bos_token_id 1, vocab 64
  ScratchDir dir("llm_eval_documents");
  // Four documents, each a BOS first, two to a window of 16.
  const std::vector<std::vector<int64_t>> docs = {{1, 5, 9, 33, 4, 17, 60},
                                                  {1, 8, 21, 40, 2, 7, 7, 30, 11},
                                                  {1, 12, 13, 14, 15},
                                                  {1, 50, 51, 52, 3, 3, 3, 40, 41, 42, 43}};
  std::vector<int64_t> stream;
  {
    std::ofstream jsonl(dir.file("docs.jsonl"));
    for (const std::vector<int64_t>& d : docs) {
      stream.insert(stream.end(), d.begin(), d.end());
      jsonl << nlohmann::json{{"input_ids", d}}.dump() << "\n";
    }
  }
  llm::write_token_file(dir.file("docs.bin"), stream, llm::TokenWidth::u16);
  // Each document on its own, as a JSONL line is scored: the same 28
  // predictions, the same mean, on either device.
  const CliResult alone = run_quanta(
      {"eval", "--model", model, "--data", dir.file("docs.jsonl"), "--seq-len", "16", "--json"});
  REQUIRE_MESSAGE(alone.code == 0, alone.err);
  const auto ja = nlohmann::json::parse(alone.out);
  CHECK(ja.at("tokens") == 28);
  for (const char* device : {"cpu", "sim"})
    for (const char* flags : {"start", "end"}) {
      CAPTURE(device);
      CAPTURE(flags);
      // The same documents marked by their BOS, or by the ids that end the
      // first three (60, 11 and 15, found nowhere else).
      const bool start = std::string(flags) == "start";
      const CliResult split =
          run_quanta({"eval", "--model", model, "--data", dir.file("docs.bin"), "--seq-len", "16",
                      start ? "--document-start" : "--document-end", start ? "bos" : "60,11,15",
                      "--batch-size", "2", "--device", device, "--json"});
      REQUIRE_MESSAGE(split.code == 0, split.err);
      const auto j = nlohmann::json::parse(split.out);
      CHECK(j.at("windows") == 2);
      CHECK(j.at("documents") == 4);
      CHECK(j.at("tokens") == 28);
      CHECK(j.at(start ? "document_start" : "document_end") == (start ? "bos" : "60,11,15"));
      CHECK(j.at("loss").get<double>() ==
            doctest::Approx(ja.at("loss").get<double>()).epsilon(1e-5));
    }
  // Without the flag a window's second document sees the first: a
  // different loss over 30 predictions.
  const CliResult joined = run_quanta(
      {"eval", "--model", model, "--data", dir.file("docs.bin"), "--seq-len", "16", "--json"});
  REQUIRE_MESSAGE(joined.code == 0, joined.err);
  CHECK(nlohmann::json::parse(joined.out).at("tokens") == 30);
  const CliResult line = run_quanta({"eval", "--model", model, "--data", dir.file("docs.bin"),
                                     "--seq-len", "16", "--document-start", "1"});
  REQUIRE_MESSAGE(line.code == 0, line.err);
  CHECK(contains(line.out, "(2 windows of 16 tokens, 4 documents kept apart, 28 predictions)"));

  check_one_line_error(run_quanta({"eval", "--model", model, "--data", dir.file("docs.bin"),
                                   "--seq-len", "16", "--document-start", "1,x"}),
                       2, "--document-start \"1,x\": \"x\" is not a token id, bos or eos");
  check_one_line_error(run_quanta({"eval", "--model", model, "--data", dir.file("docs.jsonl"),
                                   "--seq-len", "16", "--document-end", "eos"}),
                       2, "a .jsonl's lines are examples already");
  check_one_line_error(run_quanta({"eval", "--model", model, "--data", dir.file("docs.bin"),
                                   "--seq-len", "16", "--document-end", "64"}),
                       2, "document end id 64 is outside the vocabulary of 64");
  check_one_line_error(run_quanta({"eval", "--model", model, "--data", dir.file("docs.bin"),
                                   "--seq-len", "16", "--document-end", "63"}),
                       1, "no token in its 32 windowed tokens marks a document boundary");
  // A folder that names no BOS: the flag says so rather than guessing.
  const std::string bare = dir.file("bare");
  std::filesystem::create_directories(bare);
  for (const char* f : {"model.safetensors", "tokenizer.model"})
    std::filesystem::copy_file(model + "/" + f, bare + "/" + f);
  nlohmann::json config = nlohmann::json::parse(std::ifstream(model + "/config.json"));
  config.erase("bos_token_id");
  std::ofstream(bare + "/config.json") << config.dump();
  check_one_line_error(run_quanta({"eval", "--model", bare, "--data", dir.file("docs.bin"),
                                   "--seq-len", "16", "--document-start", "bos"}),
                       2, "--document-start bos: " + bare + " names no bos_token_id");
}

TEST_CASE("quanta eval and generate --adapters: a PEFT folder over the NF4 base") {
  const std::string adapters = quanta::testing::test_data("llm/qlora/llama_gqa_all/adapter_init");
  const std::string base = models() + "llama_gqa";
  // The same model in process: the base quantized as the folder says, its adapters.
  auto model = llm::load_causal_lm(base);
  llm::apply_peft_adapters(*model, adapters, base);
  const std::vector<int64_t> ids = {5, 9, 2, 33, 4, 17, 60, 1, 8, 21, 40, 2, 7, 7, 30, 11};
  ScratchDir dir("llm_cli_adapters");
  llm::write_token_file(dir.file("tokens.bin"), ids, llm::TokenWidth::u16);
  const llm::WindowEval want =
      llm::evaluate_windows(*model, llm::TokenFile(dir.file("tokens.bin")), 8, 1);
  const CliResult r = run_quanta({"eval", "--model", base, "--adapters", adapters, "--data",
                                  dir.file("tokens.bin"), "--seq-len", "8", "--json"});
  REQUIRE_MESSAGE(r.code == 0, r.err);
  const auto j = nlohmann::json::parse(r.out);
  CHECK(j.at("adapters") == adapters);
  CHECK(j.at("loss").get<double>() == doctest::Approx(want.loss).epsilon(1e-12));
  const CliResult plain = run_quanta(
      {"eval", "--model", base, "--data", dir.file("tokens.bin"), "--seq-len", "8", "--json"});
  REQUIRE(plain.code == 0);
  CHECK(nlohmann::json::parse(plain.out).at("loss") != j.at("loss"));

  const std::vector<int64_t> greedy = llm::generate(*model, {5, 9, 2}, {.max_new_tokens = 8});
  const CliResult g = run_quanta({"generate", "--model", base, "--adapters", adapters,
                                  "--prompt-ids", "5,9,2", "--max-new-tokens", "8", "--json"});
  REQUIRE_MESSAGE(g.code == 0, g.err);
  CHECK(nlohmann::json::parse(g.out).at("ids").get<std::vector<int64_t>>() == greedy);

  // `quanta eval --adapters` scores what the same model does in process.
  const auto eval_matches = [&](const std::string& model_dir, const std::string& folder) {
    auto m = llm::load_causal_lm(model_dir);
    llm::apply_peft_adapters(*m, folder, model_dir);
    const llm::WindowEval want =
        llm::evaluate_windows(*m, llm::TokenFile(dir.file("tokens.bin")), 8, 1);
    const CliResult e = run_quanta({"eval", "--model", model_dir, "--adapters", folder, "--data",
                                    dir.file("tokens.bin"), "--seq-len", "8", "--json"});
    REQUIRE_MESSAGE(e.code == 0, e.err);
    CHECK(nlohmann::json::parse(e.out).at("loss").get<double>() ==
          doctest::Approx(want.loss).epsilon(1e-12));
    return std::pair{m, e};
  };
  // DoRA adapters: the tools keep each layer's norm (inference), the same
  // numbers as taking it each forward.
  {
    const std::string dora = quanta::testing::test_data("llm/qlora/quanta_written_dora/adapters");
    const auto [dora_model, e] = eval_matches(base, dora);
    const std::vector<int64_t> dora_greedy =
        llm::generate(*dora_model, {5, 9, 2}, {.max_new_tokens = 8});
    const CliResult dg = run_quanta({"generate", "--model", base, "--adapters", dora,
                                     "--prompt-ids", "5,9,2", "--max-new-tokens", "8", "--json"});
    REQUIRE_MESSAGE(dg.code == 0, dg.err);
    CHECK(nlohmann::json::parse(dg.out).at("ids").get<std::vector<int64_t>>() == dora_greedy);
  }
  // PEFT's all-linear over Gemma 3's image-text model adapted its vision
  // tower too: those tensors are left out (text never reaches them), said
  // on stderr, and the score is the decoder's adapters'.
  const auto [vlm_model, vlm] =
      eval_matches(models() + "gemma3_image_text",
                   quanta::testing::test_data("llm/qlora/gemma3_image_text_all/adapter_init"));
  CHECK(contains(vlm.err, "18 adapter tensors of the vision tower left out"));

  check_one_line_error(run_quanta({"generate", "--model", models() + "qwen2_bias", "--adapters",
                                   adapters, "--prompt-ids", "1"}),
                       1, "the adapters were made for base \"llama_gqa\"");
  check_one_line_error(run_quanta({"eval", "--adapters", adapters, "--data", "x"}), 2,
                       "--adapters goes with --model DIR");
  check_one_line_error(run_quanta({"generate", "--model", base, "--adapters", dir.file("none"),
                                   "--prompt-ids", "1"}),
                       1, "not an adapter folder");
  // The same base under another folder name: refused, unless --adapters-any-base.
  std::filesystem::copy(base, dir.file("renamed_base"));
  const std::vector<std::string> renamed = {"eval",
                                            "--model",
                                            dir.file("renamed_base"),
                                            "--data",
                                            dir.file("tokens.bin"),
                                            "--seq-len",
                                            "8",
                                            "--json",
                                            "--adapters",
                                            adapters};
  check_one_line_error(run_quanta(renamed), 1,
                       "the adapters were made for base \"llama_gqa\", not " +
                           dir.file("renamed_base") +
                           " (--adapters-any-base uses them anyway, their shapes checked)");
  std::vector<std::string> any_base = renamed;
  any_base.push_back("--adapters-any-base");
  const CliResult a = run_quanta(any_base);
  REQUIRE_MESSAGE(a.code == 0, a.err);
  CHECK(nlohmann::json::parse(a.out).at("loss") == j.at("loss"));
  check_one_line_error(
      run_quanta({"generate", "--model", base, "--adapters-any-base", "--prompt-ids", "1"}), 2,
      "--adapters-any-base goes with --adapters DIR");
  // A folder PEFT wrote before safetensors was its default: named.
  std::filesystem::create_directories(dir.file("pickled"));
  std::filesystem::copy(adapters + "/adapter_config.json", dir.file("pickled/adapter_config.json"));
  std::ofstream(dir.file("pickled/adapter_model.bin")) << "PK";
  check_one_line_error(run_quanta({"generate", "--model", base, "--adapters", dir.file("pickled"),
                                   "--prompt-ids", "1"}),
                       1, "the folder holds adapter_model.bin, PyTorch's pickle");
}

TEST_CASE("hostile model and adapter folders end every command in one line, writing nothing") {
  ScratchDir dir("llm_cli_hostile");
  const std::string model = dir.file("model"), adapters = dir.file("adapters");
  fs::copy(models() + "llama_gqa", model);
  fs::copy(quanta::testing::test_data("llm/qlora/llama_gqa_all/adapter_init"), adapters);
  auto config = nlohmann::json::parse(slurp(models() + "llama_gqa/config.json"));
  config["num_hidden_layers"] = 1000000000;
  std::ofstream(model + "/config.json") << config.dump();
  auto adapter_config = nlohmann::json::parse(slurp(adapters + "/adapter_config.json"));
  adapter_config["r"] = 1000000000;
  std::ofstream(adapters + "/adapter_config.json") << adapter_config.dump();
  llm::write_token_file(dir.file("tokens.bin"), {1, 2, 3, 4, 5, 6, 7, 8, 9}, llm::TokenWidth::u16);
  const std::string layers = "the config says num_hidden_layers 1000000000, the weights hold";
  check_one_line_error(run_quanta({"generate", "--model", model, "--prompt-ids", "1"}), 1, layers);
  check_one_line_error(
      run_quanta({"eval", "--model", model, "--data", dir.file("tokens.bin"), "--seq-len", "4"}), 1,
      layers);
  check_one_line_error(run_quanta({"quantize", model, dir.file("nf4")}), 1, layers);
  CHECK_FALSE(fs::exists(dir.file("nf4")));
  check_one_line_error(run_quanta({"finetune", "--model", model, "--data", dir.file("tokens.bin"),
                                   "--seq-len", "4", "--out", dir.file("run")}),
                       1, layers);
  // The run folder holds nothing but its lock: the corrected command runs in it.
  for (const auto& entry : fs::directory_iterator(dir.file("run")))
    CHECK(entry.path().filename() == ".quanta-lock");
  const std::string rank = "it has rank 4, the config gives the layer r 1000000000";
  check_one_line_error(run_quanta({"generate", "--model", models() + "llama_gqa", "--adapters",
                                   adapters, "--prompt-ids", "1"}),
                       1, rank);
  check_one_line_error(run_quanta({"eval", "--model", models() + "llama_gqa", "--adapters",
                                   adapters, "--data", dir.file("tokens.bin"), "--seq-len", "4"}),
                       1, rank);
}

TEST_CASE("quanta eval and finetune --model on conversations: the folder's chat template") {
  const std::string model = models() + "qwen2_bpe";
  if (!llm::Tokenizer::available(model + "/tokenizer.json")) return;
  ScratchDir dir("llm_chat");
  const std::string folder = dir.file("model");
  std::filesystem::create_directories(folder);
  for (const auto& f : std::filesystem::directory_iterator(model))
    std::filesystem::copy_file(f.path(), folder + "/" + f.path().filename().string());
  std::ofstream(folder + "/chat_template.jinja")
      << "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
  {
    std::ofstream jl(dir.file("chat.jsonl"));
    for (int i = 0; i < 4; ++i)
      jl << nlohmann::json{{"prompt",
                            {{{"role", "user"}, {"content", "say " + std::to_string(i)}}}},
                           {"completion",
                            {{{"role", "assistant"},
                              {"content", "the number " + std::to_string(i)}}}}}
                .dump()
         << "\n";
  }
  const CliResult all = run_quanta(
      {"eval", "--model", folder, "--data", dir.file("chat.jsonl"), "--seq-len", "64", "--json"});
  const CliResult completions =
      run_quanta({"eval", "--model", folder, "--data", dir.file("chat.jsonl"), "--seq-len", "64",
                  "--completions-only", "--json"});
  REQUIRE_MESSAGE(all.code == 0, all.err);
  REQUIRE_MESSAGE(completions.code == 0, completions.err);
  const int64_t scored_all = nlohmann::json::parse(all.out).at("tokens").get<int64_t>();
  const int64_t scored_completions =
      nlohmann::json::parse(completions.out).at("tokens").get<int64_t>();
  CHECK(scored_completions > 0);
  CHECK(scored_completions < scored_all);
  const CliResult tuned =
      run_quanta({"finetune", "--model", folder, "--data", dir.file("chat.jsonl"), "--seq-len",
                  "64", "--steps", "2", "--batch-size", "2", "--train-on-completions-only", "--out",
                  dir.file("run")});
  REQUIRE_MESSAGE(tuned.code == 0, tuned.err);
  CHECK(contains(tuned.out, "fine-tuning on 4 sequences"));
  std::filesystem::remove(folder + "/chat_template.jinja");
  check_one_line_error(
      run_quanta({"eval", "--model", folder, "--data", dir.file("chat.jsonl"), "--seq-len", "64"}),
      1, "chat.jsonl: line 1: a conversation needs the model folder's chat template");
}

TEST_CASE("quanta generate --chat and --messages: the prompt the chat template renders") {
  const std::string model = models() + "qwen2_bpe";
  if (!llm::Tokenizer::available(model + "/tokenizer.json")) return;
  ScratchDir dir("llm_generate_chat");
  const std::string folder = dir.file("model");
  std::filesystem::create_directories(folder);
  for (const auto& f : std::filesystem::directory_iterator(model))
    std::filesystem::copy_file(f.path(), folder + "/" + f.path().filename().string());
  check_one_line_error(run_quanta({"generate", "--model", folder, "--chat", "hi"}), 2,
                       "has no chat template");
  const std::string chatml =
      "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
  std::ofstream(folder + "/chat_template.jinja") << chatml;
  const llm::Tokenizer tok(folder + "/tokenizer.json");
  const auto prompt_of = [](const CliResult& r) {
    REQUIRE_MESSAGE(r.code == 0, r.err);
    return nlohmann::json::parse(r.out).at("prompt_ids").get<std::vector<int64_t>>();
  };
  // The template's text, tokenized without a BOS: what
  // apply_chat_template(add_generation_prompt=True) gives.
  const std::string rendered =
      "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nthe quick fox<|im_end|>\n"
      "<|im_start|>assistant\n";
  const std::vector<int64_t> want = tok.encode(rendered, false);
  const CliResult chat = run_quanta({"generate", "--model", folder, "--system", "be brief",
                                     "--chat", "the quick fox", "--max-new-tokens", "3", "--json"});
  CHECK(prompt_of(chat) == want);
  // The same ids and new tokens as --prompt-ids of them.
  const CliResult by_ids = run_quanta({"generate", "--model", folder, "--prompt-ids",
                                       ids_text(want), "--max-new-tokens", "3", "--json"});
  REQUIRE_MESSAGE(by_ids.code == 0, by_ids.err);
  CHECK(nlohmann::json::parse(chat.out).at("ids") == nlohmann::json::parse(by_ids.out).at("ids"));
  // The plain output is the reply's text alone.
  const CliResult plain = run_quanta({"generate", "--model", folder, "--chat", "the quick fox",
                                      "--system", "be brief", "--max-new-tokens", "3"});
  REQUIRE_MESSAGE(plain.code == 0, plain.err);
  CHECK(plain.out ==
        tok.decode(nlohmann::json::parse(chat.out).at("ids").get<std::vector<int64_t>>()) + "\n");
  // A conversation file: a list, or TRL's object; ending with the
  // assistant's message, the prompt continues it (no generation prompt).
  const nlohmann::json turns = {{{"role", "system"}, {"content", "be brief"}},
                                {{"role", "user"}, {"content", "the quick fox"}}};
  std::ofstream(dir.file("list.json")) << turns.dump();
  std::ofstream(dir.file("object.json")) << nlohmann::json{{"messages", turns}}.dump();
  nlohmann::json started = turns;
  started.push_back({{"role", "assistant"}, {"content", "jumps"}});
  std::ofstream(dir.file("started.json")) << started.dump();
  for (const char* file : {"list.json", "object.json"})
    CHECK(prompt_of(run_quanta({"generate", "--model", folder, "--messages", dir.file(file),
                                "--max-new-tokens", "1", "--json"})) == want);
  CHECK(prompt_of(run_quanta({"generate", "--model", folder, "--messages", dir.file("started.json"),
                              "--max-new-tokens", "1", "--json"})) ==
        tok.encode("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nthe quick "
                   "fox<|im_end|>\n<|im_start|>assistant\njumps",
                   false));
  // Template variables: a file's chat_template_kwargs, the flag's over them.
  std::ofstream(dir.file("flavour.jinja"))
      << "{{ messages[-1].content }} {{ flavour | default('plain') }}";
  std::ofstream(dir.file("kwargs.json")) << nlohmann::json{
      {"messages", turns},
      {"chat_template_kwargs",
       {{"flavour", "file"}}}}.dump();
  const auto flavoured = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {
        "generate",         "--model", folder,  "--chat-template-path", dir.file("flavour.jinja"),
        "--max-new-tokens", "1",       "--json"};
    args.insert(args.end(), extra.begin(), extra.end());
    return prompt_of(run_quanta(args));
  };
  CHECK(flavoured({"--chat", "the fox"}) == tok.encode("the fox plain", false));
  CHECK(flavoured({"--chat", "the fox", "--chat-template-kwargs", R"({"flavour": "flag"})"}) ==
        tok.encode("the fox flag", false));
  CHECK(flavoured({"--messages", dir.file("kwargs.json")}) ==
        tok.encode("the quick fox file", false));
  CHECK(flavoured({"--messages", dir.file("kwargs.json"), "--chat-template-kwargs",
                   R"({"flavour": "flag"})"}) == tok.encode("the quick fox flag", false));
  check_one_line_error(
      run_quanta({"generate", "--model", folder, "--chat", "hi", "--chat-template-kwargs", "[1]"}),
      2, "--chat-template-kwargs is not a JSON object");
  // Bad flags and files: one line each.
  check_one_line_error(
      run_quanta({"generate", "--model", folder, "--chat", "hi", "--prompt", "hi"}), 2,
      "give the prompt as one of --prompt TEXT, --prompt-ids 1,2,3, --chat TEXT or --messages");
  check_one_line_error(
      run_quanta({"generate", "--model", folder, "--prompt", "hi", "--system", "be brief"}), 2,
      "--system goes with --chat");
  check_one_line_error(
      run_quanta({"generate", "--model", folder, "--prompt", "hi", "--chat-template", "tool_use"}),
      2, "--chat-template, --chat-template-path and --chat-template-kwargs go with --chat or");
  check_one_line_error(
      run_quanta({"generate", "--model", folder, "--chat", "hi", "--chat-template", "tool_use"}), 1,
      "no chat template named \"tool_use\"");
  std::ofstream(dir.file("bad.json")) << R"({"messages": [{"content": "no role"}]})";
  check_one_line_error(
      run_quanta({"generate", "--model", folder, "--messages", dir.file("bad.json")}), 2,
      "bad.json: message 0 is not an object with a \"role\"");
  std::ofstream(dir.file("broken.json")) << "[{";
  check_one_line_error(
      run_quanta({"generate", "--model", folder, "--messages", dir.file("broken.json")}), 2,
      "broken.json is not JSON");
  check_one_line_error(
      run_quanta({"generate", "--model", folder, "--messages", dir.file("none.json")}), 2,
      "--messages: cannot open");
}

TEST_CASE(
    "quanta eval --assistant-only and finetune --assistant-only-loss: the assistant's turns") {
  const std::string model = models() + "qwen2_bpe";
  if (!llm::Tokenizer::available(model + "/tokenizer.json")) return;
  ScratchDir dir("llm_assistant");
  const std::string folder = dir.file("model");
  std::filesystem::create_directories(folder);
  for (const auto& f : std::filesystem::directory_iterator(model))
    std::filesystem::copy_file(f.path(), folder + "/" + f.path().filename().string());
  std::ofstream(folder + "/chat_template.jinja")
      << "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
         "{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}"
         "<|im_end|>{% endif %}\n{% endfor %}";
  {
    std::ofstream jl(dir.file("chat.jsonl"));
    for (int i = 0; i < 4; ++i)
      jl << nlohmann::json{{"messages",
                            {{{"role", "user"}, {"content", "say " + std::to_string(i)}},
                             {{"role", "assistant"},
                              {"content", "the number " + std::to_string(i)}},
                             {{"role", "user"}, {"content", "again"}},
                             {{"role", "assistant"}, {"content", std::to_string(i)}}}}}
                .dump()
         << "\n";
  }
  const auto scored = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {
        "eval", "--model", folder, "--data", dir.file("chat.jsonl"), "--seq-len", "128", "--json"};
    args.insert(args.end(), extra.begin(), extra.end());
    const CliResult r = run_quanta(args);
    REQUIRE_MESSAGE(r.code == 0, r.err);
    return nlohmann::json::parse(r.out);
  };
  const nlohmann::json all = scored({});
  const nlohmann::json assistant = scored({"--assistant-only"});
  CHECK(assistant.at("assistant_only") == true);
  // Each conversation scores its two replies and their <|im_end|>: the
  // tokens of "the number i", of "i", two ends; the next-token loss scores
  // each of them as a label.
  const llm::Tokenizer tok(folder + "/tokenizer.json");
  int64_t want = 0;
  for (int i = 0; i < 4; ++i)
    want += static_cast<int64_t>(tok.encode("the number " + std::to_string(i), false).size() +
                                 tok.encode(std::to_string(i), false).size() + 2);
  CHECK(assistant.at("tokens").get<int64_t>() == want);
  CHECK(assistant.at("tokens").get<int64_t>() < all.at("tokens").get<int64_t>());
  const CliResult tuned = run_quanta(
      {"finetune", "--model", folder, "--data", dir.file("chat.jsonl"), "--seq-len", "128",
       "--steps", "2", "--batch-size", "2", "--assistant-only-loss", "--out", dir.file("run")});
  REQUIRE_MESSAGE(tuned.code == 0, tuned.err);
  CHECK(contains(tuned.out, "fine-tuning on 4 sequences"));
  // Text and token files hold no conversations.
  std::ofstream(dir.file("doc.txt")) << "the quick brown fox jumps over the lazy dog";
  check_one_line_error(
      run_quanta({"finetune", "--model", folder, "--data", dir.file("doc.txt"), "--seq-len", "4",
                  "--steps", "1", "--assistant-only-loss", "--out", dir.file("run2")}),
      2, "--assistant-only-loss are for JSONL examples");
  check_one_line_error(run_quanta({"eval", "--model", folder, "--data", dir.file("doc.txt"),
                                   "--seq-len", "4", "--assistant-only"}),
                       2, "--assistant-only scores JSONL conversations");
  // A template without {% generation %} marks nothing: refused, naming the line.
  std::filesystem::rename(folder + "/chat_template.jinja", dir.file("training.jinja"));
  std::ofstream(folder + "/chat_template.jinja")
      << "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}";
  check_one_line_error(run_quanta({"eval", "--model", folder, "--data", dir.file("chat.jsonl"),
                                   "--seq-len", "128", "--assistant-only"}),
                       1, "chat.jsonl: line 1: the chat template marks no assistant tokens");
  // --chat-template-path brings one that does (TRL's chat_template_path).
  CHECK(scored({"--assistant-only", "--chat-template-path", dir.file("training.jinja")})
            .at("tokens")
            .get<int64_t>() == want);
  const CliResult with_path = run_quanta(
      {"finetune", "--model", folder, "--data", dir.file("chat.jsonl"), "--seq-len", "128",
       "--steps", "1", "--batch-size", "2", "--assistant-only-loss", "--chat-template-path",
       dir.file("training.jinja"), "--out", dir.file("run3"), "--merge-to", dir.file("merged")});
  CHECK_MESSAGE(with_path.code == 0, with_path.err);
  // The merged folder chats with the template the data was rendered with
  // (as TRL saves chat_template_path's), the base's named ones beside it.
  const auto text_of = [](const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  CHECK(text_of(dir.file("merged") + "/chat_template.jinja") ==
        text_of(dir.file("training.jinja")));
  std::filesystem::create_directories(folder + "/additional_chat_templates");
  std::ofstream(folder + "/additional_chat_templates/tool_use.jinja") << "tools";
  const CliResult plain_merge =
      run_quanta({"finetune", "--model", folder, "--data", dir.file("chat.jsonl"), "--seq-len",
                  "128", "--steps", "1", "--batch-size", "2", "--out", dir.file("run4"),
                  "--merge-to", dir.file("merged2")});
  REQUIRE_MESSAGE(plain_merge.code == 0, plain_merge.err);
  CHECK(text_of(dir.file("merged2") + "/chat_template.jinja") ==
        text_of(folder + "/chat_template.jinja"));
  CHECK(text_of(dir.file("merged2") + "/additional_chat_templates/tool_use.jinja") == "tools");
  std::filesystem::remove_all(folder + "/additional_chat_templates");
  check_one_line_error(
      run_quanta({"eval", "--model", folder, "--data", dir.file("chat.jsonl"), "--seq-len", "128",
                  "--chat-template-path", dir.file("none.jinja")}),
      2, "none.jinja: no such chat template file or folder");
  check_one_line_error(
      run_quanta({"eval", "--model", folder, "--data", dir.file("doc.txt"), "--seq-len", "4",
                  "--chat-template-path", dir.file("training.jinja")}),
      2, "--chat-template-path renders JSONL conversations");
  // generate takes it too.
  std::filesystem::remove(folder + "/chat_template.jinja");
  const CliResult g =
      run_quanta({"generate", "--model", folder, "--chat", "hi", "--chat-template-path",
                  dir.file("training.jinja"), "--max-new-tokens", "1", "--json"});
  REQUIRE_MESSAGE(g.code == 0, g.err);
  CHECK(nlohmann::json::parse(g.out).at("prompt_ids").get<std::vector<int64_t>>() ==
        tok.encode("<|im_start|>user\nhi<|im_end|>", false));  // trim_blocks ate the \n
}
