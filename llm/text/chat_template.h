#pragma once
// A conversation as text through a model's chat template, as transformers'
// apply_chat_template(..., tokenize=False) renders it: the template of the
// folder's chat_template.jinja or tokenizer_config.json, its special tokens
// as variables, messages' None-valued keys dropped, reasoning fields
// aliased, continue_final_message and {% generation %} spans.
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

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
  /** `source` (as the template "default") with `special_tokens`
   * ({"bos_token": "<s>", ...}) as variables. Throws jinja::TemplateError
   * for a template it cannot read. */
  explicit ChatTemplate(const std::string& source,
                        nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object());
  /** Folder `dir`'s templates, as transformers reads them: the files
   * chat_template.jinja ("default") and additional_chat_templates/NAME.jinja,
   * else tokenizer_config.json's chat_template (a string, or a list of named
   * templates), with that file's special tokens. `template_path` replaces
   * the templates, not the special tokens (TRL's chat_template_path): a
   * Jinja file (the template "default"), or a folder read as `dir` is.
   * `name` picks one; empty,
   * each render takes the one transformers takes: "tool_use" when tools are
   * given and the folder has it, else "default". Throws
   * std::invalid_argument naming the folder when it has none, or none of
   * `name` (listing those it has), or several without a "default" and no
   * `name`; jinja::TemplateError naming the template it cannot read. */
  static ChatTemplate from_folder(const std::string& dir, const std::string& name = "",
                                  const std::string& template_path = "");
  /** Whether folder `dir` has a chat template. */
  static bool available(const std::string& dir);

  /** `messages` (a JSON array of dicts) rendered. Throws
   * std::invalid_argument for messages that are not dicts or a final
   * message without the field to continue, jinja::TemplateRaised for the
   * template's own raise_exception, jinja::TemplateError otherwise. */
  jinja::Rendered render(const nlohmann::ordered_json& messages,
                         const ChatOptions& options = {}) const;

  /** The templates' names, in the folder's order. */
  std::vector<std::string> names() const;
  /** Writes the templates into folder `dir` as transformers saves them:
   * "default" as chat_template.jinja, the others as
   * additional_chat_templates/NAME.jinja (replacing those there; files win
   * over tokenizer_config.json's chat_template when transformers reads). */
  void save(const std::string& dir) const;
  const nlohmann::ordered_json& special_tokens() const { return special_tokens_; }

 private:
  struct Named {
    std::string name, source;
    jinja::Template compiled;
  };
  ChatTemplate(std::vector<Named> templates, nlohmann::ordered_json special_tokens,
               std::string chosen);
  const Named& chosen(bool with_tools) const;

  std::vector<Named> templates_;
  nlohmann::ordered_json special_tokens_;
  std::string chosen_;  // empty: by the render's tools
};

}  // namespace quanta::llm
