// `quanta generate --model DIR (--prompt-ids 1,2,3 | --prompt TEXT)`: new
// tokens from a Hugging Face model folder, greedy or sampled, with a KV
// cache, up to an end-of-sequence id; text through the folder's
// tokenizer.model or tokenizer.json.
#include "llm/model/generate.h"

#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "adapter_flags.h"
#include "commands.h"
#include "engine/precision.h"
#include "flag_checks.h"
#include "llm/model/model_folder.h"
#include "llm/qlora/bnb_folder.h"
#include "llm/qlora/peft_folder.h"
#include "llm/text/tokenizer.h"
#include "precision_flag.h"

namespace quanta::cli {
namespace {

struct GenerateFlags {
  std::string model;
  AdapterFlags adapters;  // a PEFT adapter folder over the model
  std::string prompt_ids;
  std::string prompt;  // text, through the folder's tokenizer
  int64_t max_new_tokens = 32;
  double temperature = 0.0;
  double top_p = 1.0;
  uint64_t seed = 0;
  bool ignore_eos = false;
  std::string device = "cpu";
  std::string precision = "f32";
  bool json = false;
};

// This process's peak resident memory (VmHWM), -1 where /proc cannot tell.
int64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return -1;
}

std::vector<int64_t> parse_ids(const std::string& text) {
  std::vector<int64_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size())
      throw UsageError("--prompt-ids: '" + item + "' is not an integer (expected e.g. 1,2,3)");
    ids.push_back(v);
  }
  if (ids.empty()) throw UsageError("--prompt-ids is empty");
  return ids;
}

void run_generate(const GenerateFlags& f) {
  if (f.prompt.empty() == f.prompt_ids.empty())
    throw UsageError("give the prompt as --prompt TEXT or --prompt-ids 1,2,3 (one of them)");
  std::unique_ptr<llm::Tokenizer> tokenizer;
  if (!f.prompt.empty()) {
    const std::string path = llm::tokenizer_model_in(f.model);
    if (path.empty())
      throw UsageError("--prompt needs " + f.model +
                       "/tokenizer.model or tokenizer.json; without either, pass the ids as "
                       "--prompt-ids");
    tokenizer = std::make_unique<llm::Tokenizer>(path);
  }
  const std::vector<int64_t> prompt =
      tokenizer ? tokenizer->encode(f.prompt, true) : parse_ids(f.prompt_ids);
  // As transformers' generate: stop at the folder's end-of-sequence id(s)
  // (read first: a bad value fails before the weights load).
  const std::vector<int64_t> eos =
      f.ignore_eos ? std::vector<int64_t>{} : llm::eos_token_ids(f.model);
  auto model = llm::load_base_model(f.model, device_flag(f.device));
  apply_adapter_flags(*model, f.adapters, f.model);
  llm::GenerateOptions o;
  o.max_new_tokens = f.max_new_tokens;
  o.temperature = f.temperature;
  o.top_p = f.top_p;
  o.seed = f.seed;
  o.eos_token_ids = eos;
  const std::vector<int64_t> ids = [&] {
    const MixedPrecision precision(f.precision == "bf16");
    return llm::generate(*model, prompt, o);
  }();
  if (f.json) {
    nlohmann::ordered_json j;
    j["model"] = f.model;
    if (!f.adapters.dir.empty()) j["adapters"] = f.adapters.dir;
    j["prompt_ids"] = prompt;
    j["ids"] = ids;
    if (tokenizer) j["text"] = tokenizer->decode(ids);
    j["peak_rss_bytes"] = peak_rss_bytes();
    std::cout << j.dump() << "\n";
    return;
  }
  if (tokenizer) {
    std::cout << f.prompt << tokenizer->decode(ids) << "\n";
    return;
  }
  for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? "," : "") << ids[i];
  std::cout << "\n";
}

}  // namespace

void add_generate(CLI::App& app) {
  auto f = std::make_shared<GenerateFlags>();
  CLI::App* sub = app.add_subcommand(
      "generate",
      "New token ids from a Hugging Face decoder folder (the model types docs/llm.md lists: "
      "Llama, Mistral, Qwen, Gemma, Phi-3, OLMo, SmolLM3, Granite, ...)");
  sub->footer(
      "Examples:\n"
      "  quanta generate --model tests/data/llm/models/llama_gqa --prompt-ids 5,9,2 "
      "--max-new-tokens 8\n"
      "  quanta generate --model DIR --prompt-ids 1,2 --temperature 0.8 --top-p 0.9 --seed 3\n"
      "  quanta generate --model tests/data/llm/models/llama_gqa --prompt \"hello world\"");
  sub->add_option("--model", f->model, "model folder: config.json and safetensors weights")
      ->required();
  add_adapter_flags(*sub, f->adapters);
  sub->add_option("--prompt-ids", f->prompt_ids, "the prompt as comma-separated token ids");
  sub->add_option("--prompt", f->prompt,
                  "the prompt as text, through the folder's tokenizer.model or tokenizer.json (a "
                  "BOS first where the tokenizer has one); prints the prompt and the new text");
  sub->add_option("--max-new-tokens", f->max_new_tokens,
                  "at most this many tokens: generation stops after an end-of-sequence token")
      ->capture_default_str()
      ->transform(integer_in(0, 1 << 20));
  sub->add_option("--temperature", f->temperature, "0: greedy; > 0: sample")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e6));
  sub->add_option("--top-p", f->top_p, "nucleus sampling's probability mass")
      ->capture_default_str()
      ->check(CLI::Range(1e-9, 1.0));
  sub->add_option("--seed", f->seed, "the sampler's seed")->capture_default_str();
  sub->add_flag("--ignore-eos", f->ignore_eos,
                "generate all --max-new-tokens, past the end-of-sequence id(s) the folder's "
                "generation_config.json (else config.json) names as eos_token_id");
  add_device_flag(*sub, f->device, "the model");
  add_precision_flag(*sub, f->precision, "the model's");
  sub->add_flag("--json", f->json,
                "print one JSON object: ids (the new tokens), peak_rss_bytes (VmHWM)");
  sub->callback([f] { run_generate(*f); });
}

}  // namespace quanta::cli
