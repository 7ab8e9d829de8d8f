#include "llm/data/token_jsonl.h"

#include <algorithm>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "llm/text/assistant_mask.h"
#include "llm/text/chat_template.h"
#include "llm/text/tokenizer.h"

namespace quanta::llm {
namespace {

// Ordered: a message's keys reach the chat template in the line's order.
using ojson = nlohmann::ordered_json;

// The array `key` of `object` as whole numbers, each checked by `valid`.
template <class Valid>
std::vector<int64_t> whole_numbers(const ojson& object, const char* key, const std::string& where,
                                   Valid&& valid) {
  const ojson& a = object.at(key);
  if (!a.is_array()) throw std::runtime_error(where + key + " is not an array");
  std::vector<int64_t> out;
  out.reserve(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    const ojson& v = a[i];
    if (!v.is_number_integer())
      throw std::runtime_error(where + key + "[" + std::to_string(i) + "] is " + v.dump() +
                               ", not a whole number");
    const int64_t x = v.get<int64_t>();
    if (const std::string why = valid(x); !why.empty())
      throw std::runtime_error(where + key + "[" + std::to_string(i) + "] is " + std::to_string(x) +
                               ": " + why);
    out.push_back(x);
  }
  return out;
}

}  // namespace

PromptCompletion folder_text_reader(const std::string& model_dir, const TextReading& reading) {
  PromptCompletion p;
  p.completions_only = reading.completions_only;
  p.assistant_only = reading.assistant_only;
  // The template is read first: a bad path fails before any data.
  std::shared_ptr<const ChatTemplate> chat;
  if (!reading.chat_template_path.empty())
    chat = std::make_shared<const ChatTemplate>(
        ChatTemplate::from_folder(model_dir, "", reading.chat_template_path));
  else if (ChatTemplate::available(model_dir))
    chat = std::make_shared<const ChatTemplate>(ChatTemplate::from_folder(model_dir));
  const std::string model = tokenizer_model_in(model_dir);
  if (model.empty()) return p;
  if (!Tokenizer::available(model)) {
    p.encode = [model](const std::string&, bool) -> std::vector<int64_t> {
      Tokenizer unavailable(model);  // throws, naming what is missing
      return {};
    };
    return p;
  }
  auto tokenizer = std::make_shared<const Tokenizer>(model);
  p.encode = [tokenizer](const std::string& text, bool add_bos) {
    return tokenizer->encode(text, add_bos);
  };
  p.eos_id = tokenizer->eos_id();
  p.tokenizer = tokenizer;
  if (chat) {
    p.chat = [chat](const std::string& messages, const std::string& tools,
                    const std::string& variables, bool generation) {
      ChatOptions o;
      o.add_generation_prompt = generation;
      if (!tools.empty()) o.tools = ojson::parse(tools);
      if (!variables.empty()) o.variables = ojson::parse(variables);
      return chat->render(ojson::parse(messages), o);
    };
  }
  return p;
}

std::vector<TokenExample> read_token_jsonl(const std::string& path, const TokenLimits& limits,
                                           const PromptCompletion& prompts) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot open");
  const int64_t vocab = limits.vocab_size;
  auto id_ok = [&](int64_t x) -> std::string {
    if (x < 0) return "ids are >= 0";
    if (vocab > 0 && x >= vocab)
      return "outside the model's vocabulary of " + std::to_string(vocab);
    return "";
  };
  auto label_ok = [&](int64_t x) -> std::string {
    return x == kIgnoreIndex ? std::string() : id_ok(x);
  };
  std::vector<TokenExample> examples;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ": line " + std::to_string(n) + ": ";
    const ojson j = ojson::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) throw std::runtime_error(where + "not valid JSON");
    if (!j.is_object()) throw std::runtime_error(where + "not a JSON object");
    const bool pair = j.contains("prompt") || j.contains("completion");
    const bool conversation = j.contains("messages") && !pair && !j.contains("input_ids");
    // TRL's language-modeling lines: a document's text, trained whole (a
    // text kept beside ids or a pair is left aside, as other keys are).
    const bool text = j.contains("text") && !pair && !conversation && !j.contains("input_ids");
    if (pair && j.contains("input_ids"))
      throw std::runtime_error(where + "has both input_ids and a prompt or completion");
    if (!pair && prompts.completions_only)
      throw std::runtime_error(where +
                               "no prompt and completion (training on completions only needs "
                               "both on every line)");
    const auto is_messages = [](const ojson& v) {
      return v.is_array() && !v.empty() && v.front().is_object();
    };
    const bool chat_pair = pair && j.contains("prompt") && is_messages(j.at("prompt"));
    if (prompts.assistant_only && !conversation && !chat_pair)
      throw std::runtime_error(where +
                               "not a conversation (the assistant-only loss scores the "
                               "assistant's turns of messages, or of a conversational prompt "
                               "and completion)");
    if (!pair && !text && !conversation && !j.contains("input_ids"))
      throw std::runtime_error(where +
                               "no input_ids (nor a text, messages, or a prompt and a completion)");
    // Text through the encoder: a document starts with the BOS (where the
    // tokenizer has one).
    const auto encoded = [&](const char* key, bool first) {
      if (!prompts.encode)
        throw std::runtime_error(where + key +
                                 " is text, and there is no tokenizer to read it with (give "
                                 "ids, or a model folder with a tokenizer.model or "
                                 "tokenizer.json)");
      std::vector<int64_t> ids = prompts.encode(j.at(key).get<std::string>(), first);
      for (std::size_t i = 0; i < ids.size(); ++i)
        if (const std::string why = id_ok(ids[i]); !why.empty())
          throw std::runtime_error(where + key + " encodes to id " + std::to_string(ids[i]) + ": " +
                                   why);
      return ids;
    };
    // A conversation through the chat template, tokenized as
    // apply_chat_template(tokenize=True) does: the template writes the
    // special tokens, the tokenizer adds none.
    // With the assistant-only loss, `assistant` gets which tokens the
    // template's {% generation %} spans hold.
    const auto chat_ids = [&](const ojson& messages, bool generation,
                              std::vector<bool>* assistant = nullptr) {
      if (!prompts.chat)
        throw std::runtime_error(where +
                                 "a conversation needs the model folder's chat template "
                                 "(chat_template.jinja or tokenizer_config.json's chat_template)");
      if (!messages.is_array() || messages.empty())
        throw std::runtime_error(where + "messages must be a non-empty list of messages");
      const ojson tools = j.value("tools", ojson());
      if (!tools.is_null() && !tools.is_array())
        throw std::runtime_error(where + "tools is not a list");
      // TRL's per-example template arguments (enable_thinking, ...).
      const ojson kwargs = j.value("chat_template_kwargs", ojson());
      if (!kwargs.is_null() && !kwargs.is_object())
        throw std::runtime_error(where + "chat_template_kwargs is not an object");
      jinja::Rendered rendered;
      try {
        rendered = prompts.chat(messages.dump(), tools.is_null() ? "" : tools.dump(),
                                kwargs.is_null() ? "" : kwargs.dump(), generation);
      } catch (const std::exception& x) {
        throw std::runtime_error(where + "the chat template: " + x.what());
      }
      std::vector<TextSegment> segments;
      std::vector<int64_t> ids = prompts.tokenizer
                                     ? prompts.tokenizer->encode(rendered.text, false, &segments)
                                     : prompts.encode(rendered.text, false);
      for (std::size_t i = 0; i < ids.size(); ++i)
        if (const std::string why = id_ok(ids[i]); !why.empty())
          throw std::runtime_error(where + "the conversation encodes to id " +
                                   std::to_string(ids[i]) + ": " + why);
      if (assistant) {
        const PrefixEncoder prefix =
            prompts.tokenizer
                ? stretch_prefixes(*prompts.tokenizer, rendered.text, segments)
                : PrefixEncoder([&](std::size_t at) {
                    return PrefixIds{0, prompts.encode(rendered.text.substr(0, at), false)};
                  });
        *assistant = tokens_in_spans(ids, rendered.text, rendered.generation_spans, prefix);
        if (std::find(assistant->begin(), assistant->end(), true) == assistant->end())
          throw std::runtime_error(
              where +
              "the chat template marks no assistant tokens: the assistant-only loss needs a "
              "template whose assistant turns sit in {% generation %} blocks");
      }
      return ids;
    };
    // Labels -100 where the assistant-only loss does not score.
    const auto keep_assistant = [](std::vector<int64_t>& labels, const std::vector<bool>& mask) {
      for (std::size_t i = 0; i < labels.size(); ++i)
        if (!mask[i]) labels[i] = kIgnoreIndex;
    };
    TokenExample e;
    std::vector<bool> assistant;
    std::vector<bool>* want_assistant = prompts.assistant_only ? &assistant : nullptr;
    if (conversation) {
      e.input_ids = chat_ids(j.at("messages"), false, want_assistant);
      e.labels = e.input_ids;
      if (want_assistant) keep_assistant(e.labels, assistant);
    } else if (chat_pair && j.contains("completion")) {
      // TRL's conversational prompt-completion: the completion is what the
      // whole conversation adds to the prompt with its generation prompt.
      if (!is_messages(j.at("completion")))
        throw std::runtime_error(where + "the prompt is a list of messages, the completion is not");
      ojson all = j.at("prompt");
      for (const ojson& m : j.at("completion")) all.push_back(m);
      const std::vector<int64_t> prompt = chat_ids(j.at("prompt"), true);
      e.input_ids = chat_ids(all, false, want_assistant);
      if (e.input_ids.size() <= prompt.size() ||
          !std::equal(prompt.begin(), prompt.end(), e.input_ids.begin()))
        throw std::runtime_error(where +
                                 "the chat template renders the prompt (with its generation "
                                 "prompt) as other tokens than the start of the whole "
                                 "conversation: the completion cannot be told apart");
      e.labels = e.input_ids;
      if (prompts.completions_only)
        std::fill(e.labels.begin(), e.labels.begin() + std::ptrdiff_t(prompt.size()), kIgnoreIndex);
      if (want_assistant) keep_assistant(e.labels, assistant);
    } else if (text) {
      if (!j.at("text").is_string()) throw std::runtime_error(where + "text is not a string");
      // As TRL's SFT ends a text: the tokenizer's EOS after it.
      e.input_ids = encoded("text", true);
      if (prompts.eos_id >= 0) e.input_ids.push_back(prompts.eos_id);
      e.labels = e.input_ids;
    } else if (pair) {
      for (const char* key : {"prompt", "completion"})
        if (!j.contains(key)) throw std::runtime_error(where + "no " + key);
      // Text through the encoder, or ids as they are.
      const auto part = [&](const char* key, bool first) {
        return j.at(key).is_string() ? encoded(key, first) : whole_numbers(j, key, where, id_ok);
      };
      const std::vector<int64_t> prompt = part("prompt", true);
      std::vector<int64_t> completion = part("completion", false);
      if (prompts.eos_id >= 0 && j.at("completion").is_string())
        completion.push_back(prompts.eos_id);
      if (completion.empty()) throw std::runtime_error(where + "completion is empty");
      e.input_ids = prompt;
      e.input_ids.insert(e.input_ids.end(), completion.begin(), completion.end());
      e.labels = e.input_ids;
      if (prompts.completions_only)
        std::fill(e.labels.begin(), e.labels.begin() + std::ptrdiff_t(prompt.size()), kIgnoreIndex);
    } else {
      e.input_ids = whole_numbers(j, "input_ids", where, id_ok);
    }
    if (e.input_ids.empty()) throw std::runtime_error(where + "input_ids is empty");
    if (limits.max_length > 0 && static_cast<int64_t>(e.input_ids.size()) > limits.max_length)
      throw std::runtime_error(where + std::to_string(e.input_ids.size()) +
                               " tokens, longer than the model's " +
                               std::to_string(limits.max_length) + " positions");
    if (pair || text || conversation) {
      if (j.contains("labels"))
        throw std::runtime_error(where + "has labels beside " +
                                 (text           ? "a text"
                                  : conversation ? "messages"
                                                 : "a prompt and completion"));
    } else if (j.contains("labels") && !j["labels"].is_null()) {
      e.labels = whole_numbers(j, "labels", where, label_ok);
      if (e.labels.size() != e.input_ids.size())
        throw std::runtime_error(where + "labels has " + std::to_string(e.labels.size()) +
                                 " entries, input_ids " + std::to_string(e.input_ids.size()));
    } else {
      e.labels = e.input_ids;
    }
    examples.push_back(std::move(e));
  }
  if (in.bad()) throw std::runtime_error(path + ": cannot read");
  if (examples.empty()) throw std::runtime_error(path + ": holds no example (no non-empty line)");
  return examples;
}

}  // namespace quanta::llm
