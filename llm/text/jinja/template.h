#pragma once
// Jinja templates as Hugging Face chat templates use them: the language of
// Jinja2 with transformers' environment (trim_blocks, lstrip_blocks, loop
// controls, its tojson, raise_exception, strftime_now and {% generation %}
// marks), Python's semantics for the values. What the subset leaves out
// (template inheritance, includes, call blocks, filters no chat template
// uses) is refused when the template is parsed or the construct is reached,
// naming it and the line: a template renders as transformers renders it or
// not at all.
#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "llm/text/jinja/value.h"

namespace quanta::llm::jinja {

/** A template that cannot be parsed or rendered: "line N: what". */
struct TemplateError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/** raise_exception(message) called by the template: what() is the
 * template's own message. */
struct TemplateRaised : TemplateError {
  using TemplateError::TemplateError;
};

/** A render's text and the byte ranges [begin, end) of it that
 * {% generation %} blocks produced (assistant turns a loss may score). */
struct Rendered {
  std::string text;
  std::vector<std::pair<std::size_t, std::size_t>> generation_spans;
};

class Template {
 public:
  /** Parses `source`; throws TemplateError at the first construct it cannot
   * read or does not support. */
  explicit Template(const std::string& source);
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  /** Renders with `variables` (a dict: messages, add_generation_prompt,
   * bos_token, ...) beside the globals range, namespace, dict,
   * raise_exception and strftime_now. */
  Rendered render(const Value& variables) const;

  struct Body;

 private:
  std::unique_ptr<Body> body_;
};

}  // namespace quanta::llm::jinja
