#pragma once
// A conversation as text through a model's chat template, as transformers'
// apply_chat_template(..., tokenize=False) renders it: the template of the
// folder's chat_template.jinja or tokenizer_config.json, its special tokens
// as variables, messages' None-valued keys dropped, reasoning fields
// aliased, continue_final_message and {% generation %} spans.
#include <nlohmann/json.hpp>
#include <string>

#include "llm/text/jinja/template.h"

namespace quanta::llm {

struct ChatOptions {
  bool add_generation_prompt = false;
  /** The final message's field the text ends inside of ("content"), for a
   * reply to continue; empty: none. */
  std::string continue_final_message;
  /** Tool schemas (a JSON array) and documents; null: none. */
  nlohmann::ordered_json tools;
  nlohmann::ordered_json documents;
  /** More variables (date_string, enable_thinking, ...); they override the
   * special tokens of the same name. */
  nlohmann::ordered_json variables = nlohmann::ordered_json::object();
};

class ChatTemplate {
 public:
  /** `source` with `special_tokens` ({"bos_token": "<s>", ...}) as
   * variables. Throws jinja::TemplateError for a template it cannot read. */
  explicit ChatTemplate(const std::string& source,
                        nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object());
  /** Folder `dir`'s template: chat_template.jinja, else
   * tokenizer_config.json's chat_template (a string, or a list of named
   * templates, of which `name`), with that file's special tokens. Throws
   * std::invalid_argument naming the folder when it has none. */
  static ChatTemplate from_folder(const std::string& dir, const std::string& name = "default");
  /** Whether folder `dir` has a chat template. */
  static bool available(const std::string& dir);

  /** `messages` (a JSON array of dicts) rendered. Throws
   * std::invalid_argument for messages that are not dicts or a final
   * message without the field to continue, jinja::TemplateRaised for the
   * template's own raise_exception, jinja::TemplateError otherwise. */
  jinja::Rendered render(const nlohmann::ordered_json& messages,
                         const ChatOptions& options = {}) const;

  const std::string& source() const { return source_; }
  const nlohmann::ordered_json& special_tokens() const { return special_tokens_; }

 private:
  std::string source_;
  jinja::Template template_;
  nlohmann::ordered_json special_tokens_;
};

}  // namespace quanta::llm
