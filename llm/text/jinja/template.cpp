#include "llm/text/jinja/template.h"

#include "llm/text/jinja/context.h"
#include "llm/text/jinja/nodes.h"

namespace quanta::llm::jinja {

struct Template::Body {
  jinja::Body statements;
};

Template::Template(const std::string& source) : body_(std::make_unique<Body>()) {
  body_->statements = parse(source);
}

Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

Rendered Template::render(const Value& variables) const {
  Context c;
  c.scopes.push_back(globals());
  c.scopes.emplace_back();
  if (variables.is_object())
    for (const auto& [k, v] : variables.fields()) c.scopes.back()[k] = v;
  try {
    for (const auto& s : body_->statements) s->run(c);
  } catch (const BreakLoop&) {
    throw TemplateError("{% break %} outside a for loop");
  } catch (const ContinueLoop&) {
    throw TemplateError("{% continue %} outside a for loop");
  }
  return {std::move(c.out), std::move(c.spans)};
}

}  // namespace quanta::llm::jinja
