// `quanta generate --model DIR (--prompt-ids 1,2,3 | --prompt TEXT | --chat
// TEXT | --messages FILE)`: new tokens from a Hugging Face model folder,
// greedy or sampled, with a KV cache, up to an end-of-sequence id; text
// through the folder's tokenizer.model or tokenizer.json, a conversation
// through its chat template.
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
#include "llm/text/chat_template.h"
#include "llm/text/tokenizer.h"
#include "peak_memory.h"
#include "precision_flag.h"

namespace quanta::cli {
namespace {

struct GenerateFlags {
  std::string model;
  AdapterFlags adapters;  // a PEFT adapter folder over the model
  std::string prompt_ids;
  std::string prompt;                // text, through the folder's tokenizer
  std::string chat;                  // a user message, through the chat template
  std::string system;                // a system message before it
  std::string messages_file;         // a conversation (JSON) through the chat template
  std::string chat_template;         // empty: the one transformers takes
  std::string chat_template_path;    // a .jinja file or folder instead of the model's
  std::string chat_template_kwargs;  // a JSON object of template variables
  int64_t max_new_tokens = 32;
  double temperature = 0.0;
  double top_p = 1.0;
  uint64_t seed = 0;
  bool ignore_eos = false;
  std::string device = "cpu";
  std::string precision = "f32";
  bool json = false;
};

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

// A JSON object of template variables, `what` naming where it came from.
nlohmann::ordered_json template_variables(const nlohmann::ordered_json& v,
                                          const std::string& what) {
  if (!v.is_null() && !v.is_object())
    throw UsageError(what + " is not a JSON object (e.g. {\"enable_thinking\": false})");
  return v.is_null() ? nlohmann::ordered_json::object() : v;
}

// The conversation of --messages FILE: a JSON list of messages, or an
// object with "messages" (and "tools", "chat_template_kwargs"), as a line of
// TRL's conversational data holds them.
void read_messages_file(const std::string& path, nlohmann::ordered_json& messages,
                        nlohmann::ordered_json& tools, nlohmann::ordered_json& variables) {
  std::ifstream in(path);
  if (!in) throw UsageError("--messages: cannot open " + path);
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw UsageError("--messages: " + path + " is not JSON (" + e.what() + ")");
  }
  if (j.is_object()) {
    if (!j.contains("messages"))
      throw UsageError("--messages: " + path + " is an object without \"messages\"");
    tools = j.value("tools", nlohmann::ordered_json());
    if (!tools.is_null() && !tools.is_array())
      throw UsageError("--messages: " + path + ": \"tools\" is not a list");
    variables = template_variables(j.value("chat_template_kwargs", nlohmann::ordered_json()),
                                   "--messages: " + path + ": \"chat_template_kwargs\"");
    j = j.at("messages");
  }
  if (!j.is_array() || j.empty())
    throw UsageError("--messages: " + path + " holds no list of messages");
  for (size_t i = 0; i < j.size(); ++i)
    if (!j[i].is_object() || !j[i].contains("role"))
      throw UsageError("--messages: " + path + ": message " + std::to_string(i) +
                       " is not an object with a \"role\"");
  messages = std::move(j);
}

// The prompt ids of a conversation, as transformers' text-generation
// pipeline makes them: the chat template with its generation prompt (or,
// when the last message is the assistant's, continuing that message),
// tokenized without a BOS (the template writes the special tokens).
std::vector<int64_t> conversation_ids(const GenerateFlags& f, const llm::Tokenizer& tokenizer) {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array(), tools;
  nlohmann::ordered_json variables = nlohmann::ordered_json::object();
  if (!f.messages_file.empty()) {
    read_messages_file(f.messages_file, messages, tools, variables);
  } else {
    if (!f.system.empty()) messages.push_back({{"role", "system"}, {"content", f.system}});
    messages.push_back({{"role", "user"}, {"content", f.chat}});
  }
  if (f.chat_template_path.empty() && !llm::ChatTemplate::available(f.model))
    throw UsageError(f.model +
                     " has no chat template (chat_template.jinja or tokenizer_config.json's "
                     "chat_template); give one with --chat-template-path, or the prompt as text "
                     "with --prompt");
  const llm::ChatTemplate chat =
      llm::ChatTemplate::from_folder(f.model, f.chat_template, f.chat_template_path);
  llm::ChatOptions o;
  if (messages.back().value("role", "") == "assistant")
    o.continue_final_message = "content";
  else
    o.add_generation_prompt = true;
  o.tools = tools;
  o.variables = variables;
  // The flag's variables over the file's.
  if (!f.chat_template_kwargs.empty()) {
    const auto given = nlohmann::ordered_json::parse(f.chat_template_kwargs, nullptr, false);
    if (given.is_discarded())
      throw UsageError("--chat-template-kwargs is not JSON (e.g. {\"enable_thinking\": false})");
    const nlohmann::ordered_json flag = template_variables(given, "--chat-template-kwargs");
    for (const auto& [key, value] : flag.items()) o.variables[key] = value;
  }
  return tokenizer.encode(chat.render(messages, o).text, false);
}

void run_generate(const GenerateFlags& f) {
  const int sources =
      !f.prompt.empty() + !f.prompt_ids.empty() + !f.chat.empty() + !f.messages_file.empty();
  if (sources != 1)
    throw UsageError(
        "give the prompt as one of --prompt TEXT, --prompt-ids 1,2,3, --chat TEXT or --messages "
        "FILE");
  if (!f.system.empty() && f.chat.empty())
    throw UsageError(
        "--system goes with --chat (a conversation file holds its own system message)");
  const bool conversation = !f.chat.empty() || !f.messages_file.empty();
  if ((!f.chat_template.empty() || !f.chat_template_path.empty() ||
       !f.chat_template_kwargs.empty()) &&
      !conversation)
    throw UsageError(
        "--chat-template, --chat-template-path and --chat-template-kwargs go with --chat or "
        "--messages");
  std::unique_ptr<llm::Tokenizer> tokenizer;
  if (f.prompt_ids.empty()) {
    const std::string path = llm::tokenizer_model_in(f.model);
    if (path.empty())
      throw UsageError(std::string(conversation ? "a conversation" : "--prompt") + " needs " +
                       f.model +
                       "/tokenizer.model or tokenizer.json; without either, pass the ids as "
                       "--prompt-ids");
    tokenizer = std::make_unique<llm::Tokenizer>(path);
  }
  const std::vector<int64_t> prompt = conversation ? conversation_ids(f, *tokenizer)
                                      : tokenizer  ? tokenizer->encode(f.prompt, true)
                                                   : parse_ids(f.prompt_ids);
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
  // A conversation prints the reply alone; a text prompt is continued.
  if (conversation) {
    std::cout << tokenizer->decode(ids) << "\n";
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
      "  quanta generate --model tests/data/llm/models/llama_gqa --prompt \"hello world\"\n"
      "  quanta generate --model DIR --system \"Answer briefly.\" --chat \"What is NF4?\"\n"
      "  quanta generate --model DIR --adapters RUN/adapters --messages conversation.json");
  sub->add_option("--model", f->model, "model folder: config.json and safetensors weights")
      ->required();
  add_adapter_flags(*sub, f->adapters);
  sub->add_option("--prompt-ids", f->prompt_ids, "the prompt as comma-separated token ids");
  sub->add_option("--prompt", f->prompt,
                  "the prompt as text, through the folder's tokenizer.model or tokenizer.json (a "
                  "BOS first where the tokenizer has one); prints the prompt and the new text");
  sub->add_option("--chat", f->chat,
                  "the prompt as a user message, through the folder's chat template with its "
                  "generation prompt; prints the reply");
  sub->add_option("--system", f->system, "a system message before --chat's");
  sub->add_option("--messages", f->messages_file,
                  "the prompt as a conversation: a JSON file holding a list of messages "
                  "({\"role\": ..., \"content\": ...}) or an object with \"messages\" and "
                  "\"tools\"; ending with the assistant's message, the reply continues it");
  sub->add_option(
      "--chat-template", f->chat_template,
      "which of the folder's named chat templates (additional_chat_templates/NAME.jinja "
      "or tokenizer_config.json's list, e.g. tool_use); by default the one "
      "transformers takes: tool_use for a conversation with tools, else default");
  sub->add_option("--chat-template-path", f->chat_template_path,
                  "render the conversation with this chat template instead of the folder's: a "
                  ".jinja file, or a model folder's templates");
  sub->add_option("--chat-template-kwargs", f->chat_template_kwargs,
                  "more variables for the chat template, a JSON object (transformers' "
                  "apply_chat_template keyword arguments, e.g. '{\"enable_thinking\": false}' "
                  "for Qwen3)");
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
