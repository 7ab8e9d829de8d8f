// How each node evaluates or renders itself; errors from the values'
// operations come out as TemplateError naming the node's line.
#include <stdexcept>

#include "llm/text/jinja/context.h"
#include "llm/text/jinja/nodes.h"
#include "llm/text/jinja/template.h"

namespace quanta::llm::jinja {

namespace {

// f(), with a failure of the values' operations (std::logic_error:
// invalid_argument, out_of_range) named by `line`.
template <class F>
auto at_line(int line, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const TemplateError&) {
    throw;
  } catch (const std::logic_error& e) {
    throw TemplateError("template line " + std::to_string(line) + ": " + e.what());
  }
}

void require_defined(const Value& v) {
  if (v.is_undefined()) throw std::invalid_argument(v.what());
}

// Unpacks `item` into `names` (one name: the item itself).
void bind_targets(Context& c, const std::vector<std::string>& names, const Value& item) {
  if (names.size() == 1) {
    c.set(names[0], item);
    return;
  }
  const Array items = iterate(item);
  if (items.size() != names.size())
    throw std::invalid_argument("cannot unpack " + std::to_string(items.size()) + " values into " +
                                std::to_string(names.size()) + " names");
  for (std::size_t k = 0; k < names.size(); ++k) c.set(names[k], items[k]);
}

void run_body(const Body& body, Context& c) {
  for (const auto& s : body) s->run(c);
}

}  // namespace

Arguments ArgExprs::eval(Context& c) const {
  Arguments a;
  for (const ExprPtr& e : positional) a.positional.push_back(e->eval(c));
  for (const auto& [k, e] : keywords) a.keywords.emplace_back(k, e->eval(c));
  return a;
}

Value Literal::eval(Context&) const { return value; }

Value Name::eval(Context& c) const { return c.lookup(name); }

Value ListLiteral::eval(Context& c) const {
  Array a;
  for (const ExprPtr& e : items) a.push_back(e->eval(c));
  return Value::array(std::move(a), tuple);
}

Value DictLiteral::eval(Context& c) const {
  const Value d = Value::object();
  for (const auto& [k, v] : entries) {
    const Value key = k->eval(c);
    if (!key.is_string())
      throw TemplateError("template line " + std::to_string(line) +
                          ": dict keys must be strings in chat templates, got " + key.repr());
    d.set_field(key.string(), v->eval(c));
  }
  return d;
}

Value Attribute::eval(Context& c) const {
  const Value o = object->eval(c);
  return at_line(line, [&] {
    require_defined(o);
    return get_attribute(o, name);
  });
}

Value Item::eval(Context& c) const {
  const Value o = object->eval(c);
  const Value k = key->eval(c);
  return at_line(line, [&] {
    require_defined(o);
    return get_item(o, k);
  });
}

Value Slice::eval(Context& c) const {
  const Value o = object->eval(c);
  const Value a = start ? start->eval(c) : Value::none();
  const Value b = stop ? stop->eval(c) : Value::none();
  const Value s = step ? step->eval(c) : Value::none();
  return at_line(line, [&] {
    require_defined(o);
    return jinja::slice(o, a, b, s);
  });
}

Value Call::eval(Context& c) const {
  const Value f = callee->eval(c);
  Arguments a = args.eval(c);
  return at_line(line, [&] {
    require_defined(f);
    if (!f.is_function())
      throw std::invalid_argument("'" + f.type_name() + "' object is not callable");
    return f.call(a);
  });
}

Value Filter::eval(Context& c) const {
  const Value v = value->eval(c);
  Arguments a = args.eval(c);
  return at_line(line, [&] { return apply_filter(name, v, a, c); });
}

Value Test::eval(Context& c) const {
  const Value v = value->eval(c);
  Arguments a = args.eval(c);
  return at_line(line, [&] { return Value(apply_test(name, v, a) != negated); });
}

Value Unary::eval(Context& c) const {
  const Value v = operand->eval(c);
  if (op == '!') return Value(!v.truthy());
  return at_line(line, [&] {
    require_defined(v);
    if (!v.is_numeric())
      throw std::invalid_argument(std::string("bad operand type for unary ") + op + ": '" +
                                  v.type_name() + "'");
    if (op == '+') return v.is_boolean() ? Value(v.integer()) : v;
    return v.kind() == Value::Kind::number ? Value(-v.number())
                                           : arithmetic("-", Value(int64_t{0}), v);
  });
}

Value Binary::eval(Context& c) const {
  if (op == "and") {
    const Value l = left->eval(c);
    return l.truthy() ? right->eval(c) : l;
  }
  if (op == "or") {
    const Value l = left->eval(c);
    return l.truthy() ? l : right->eval(c);
  }
  const Value l = left->eval(c);
  const Value r = right->eval(c);
  if (op == "~") return Value(l.to_string() + r.to_string());
  return at_line(line, [&] {
    require_defined(l);
    require_defined(r);
    return arithmetic(op, l, r);
  });
}

Value Compare::eval(Context& c) const {
  Value l = first->eval(c);
  for (const auto& [op, e] : rest) {
    const Value r = e->eval(c);
    const bool ok = at_line(line, [&] {
      if (op == "==") return equal(l, r);
      if (op == "!=") return !equal(l, r);
      if (op == "in") return contains(r, l);
      if (op == "notin") return !contains(r, l);
      require_defined(l);
      require_defined(r);
      const int k = compare(l, r);
      if (op == "<") return k < 0;
      if (op == ">") return k > 0;
      if (op == "<=") return k <= 0;
      return k >= 0;
    });
    if (!ok) return Value(false);
    l = r;
  }
  return Value(true);
}

Value Conditional::eval(Context& c) const {
  if (condition->eval(c).truthy()) return then->eval(c);
  return otherwise ? otherwise->eval(c) : Value::undefined("the conditional's missing else");
}

void Text::run(Context& c) const { c.out += text; }

void Print::run(Context& c) const { c.out += value->eval(c).to_string(); }

void If::run(Context& c) const {
  for (const auto& [condition, body] : branches)
    if (condition->eval(c).truthy()) {
      run_body(body, c);
      return;
    }
  run_body(otherwise, c);
}

void For::run(Context& c) const {
  const Value source = iterable->eval(c);
  Array items = at_line(line, [&] {
    if (source.is_none()) throw std::invalid_argument("'NoneType' object is not iterable");
    if (source.is_numeric())
      throw std::invalid_argument("'" + source.type_name() + "' object is not iterable");
    return iterate(source);
  });
  // The loop's own scope: what the body sets stays in it (across
  // iterations, not after the loop).
  c.scopes.emplace_back();
  if (filter) {
    Array kept;
    for (const Value& item : items) {
      at_line(line, [&] { bind_targets(c, targets, item); });
      if (filter->eval(c).truthy()) kept.push_back(item);
    }
    items = std::move(kept);
  }
  const int64_t n = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < n; ++i) {
    at_line(line, [&] { bind_targets(c, targets, items[static_cast<std::size_t>(i)]); });
    const Value loop = Value::object({{"index", Value(i + 1)},
                                      {"index0", Value(i)},
                                      {"revindex", Value(n - i)},
                                      {"revindex0", Value(n - i - 1)},
                                      {"first", Value(i == 0)},
                                      {"last", Value(i == n - 1)},
                                      {"length", Value(n)},
                                      {"depth", Value(int64_t{1})},
                                      {"depth0", Value(int64_t{0})}});
    loop.set_field("previtem", i > 0 ? items[static_cast<std::size_t>(i - 1)]
                                     : Value::undefined("there is no previous item"));
    loop.set_field("nextitem", i + 1 < n ? items[static_cast<std::size_t>(i + 1)]
                                         : Value::undefined("there is no next item"));
    loop.set_field("cycle", Value::function("loop.cycle", [i](Arguments& a) {
                     if (a.positional.empty())
                       throw std::invalid_argument("no items for cycling given");
                     return a.positional[static_cast<std::size_t>(i) % a.positional.size()];
                   }));
    c.set("loop", loop);
    try {
      run_body(body, c);
    } catch (const ContinueLoop&) {
    } catch (const BreakLoop&) {
      break;
    }
  }
  c.scopes.pop_back();
  if (n == 0) run_body(otherwise, c);
}

void Set::run(Context& c) const {
  Value v;
  if (value) {
    v = value->eval(c);
  } else {
    std::string saved;
    std::swap(saved, c.out);
    run_body(block, c);
    std::swap(saved, c.out);
    v = Value(std::move(saved));
    for (const auto& [filter, args] : block_filters) {
      Arguments a = args.eval(c);
      v = at_line(line, [&] { return apply_filter(filter, v, a, c); });
    }
  }
  if (name_space) {
    const Value ns = name_space->eval(c);
    if (!ns.is_namespace())
      throw TemplateError("template line " + std::to_string(line) +
                          ": cannot assign attribute on non-namespace object");
    ns.set_field(attribute, std::move(v));
    return;
  }
  at_line(line, [&] { bind_targets(c, targets, v); });
}

void Macro::run(Context& c) const {
  Context* context = &c;
  const Macro* self = this;
  c.set(name, Value::function(name, [context, self](Arguments& a) {
          Context& ctx = *context;
          if (a.positional.size() > self->parameters.size())
            throw std::invalid_argument("macro '" + self->name + "' takes not more than " +
                                        std::to_string(self->parameters.size()) + " argument(s)");
          if (ctx.depth >= 100)
            throw std::invalid_argument("macro '" + self->name + "' recursed 100 deep");
          std::unordered_map<std::string, Value> scope;
          for (std::size_t k = 0; k < self->parameters.size(); ++k) {
            const auto& [p, fallback] = self->parameters[k];
            const Value* given = k < a.positional.size() ? &a.positional[k] : nullptr;
            for (const auto& [key, v] : a.keywords)
              if (key == p) given = &v;
            scope[p] = given      ? *given
                       : fallback ? fallback->eval(ctx)
                                  : Value::undefined("parameter '" + p + "' was not provided");
          }
          for (const auto& [key, v] : a.keywords) {
            bool known = false;
            for (const auto& param : self->parameters) known = known || param.first == key;
            if (!known)
              throw std::invalid_argument("macro '" + self->name + "' takes no keyword argument '" +
                                          key + "'");
          }
          std::string saved;
          std::swap(saved, ctx.out);
          ctx.scopes.push_back(std::move(scope));
          ++ctx.depth;
          try {
            run_body(self->body, ctx);
          } catch (...) {
            --ctx.depth;
            ctx.scopes.pop_back();
            std::swap(saved, ctx.out);
            throw;
          }
          --ctx.depth;
          ctx.scopes.pop_back();
          std::swap(saved, ctx.out);
          return Value(std::move(saved));
        }));
}

void LoopControl::run(Context&) const {
  if (is_break) throw BreakLoop{};
  throw ContinueLoop{};
}

void Refused::run(Context&) const {
  throw TemplateError("template line " + std::to_string(line) + ": " + what);
}

void Generation::run(Context& c) const {
  const std::size_t begin = c.out.size();
  run_body(body, c);
  c.spans.emplace_back(begin, c.out.size());
}

}  // namespace quanta::llm::jinja
