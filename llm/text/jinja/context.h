#pragma once
// What a render carries: the scopes of variables (the render's own at the
// bottom, one per for loop and macro call above), the output being written
// and the {% generation %} spans in it.
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "llm/text/jinja/value.h"

namespace quanta::llm::jinja {

struct Context {
  std::vector<std::unordered_map<std::string, Value>> scopes;
  std::string out;
  std::vector<std::pair<std::size_t, std::size_t>> spans;
  int depth = 0;  // macro calls in progress (bounded: no endless recursion)

  Value lookup(const std::string& name) const {
    for (auto it = scopes.rbegin(); it != scopes.rend(); ++it) {
      const auto f = it->find(name);
      if (f != it->end()) return f->second;
    }
    return Value::undefined("'" + name + "' is undefined");
  }
  void set(const std::string& name, Value v) { scopes.back()[name] = std::move(v); }
};

// Thrown by {% break %} and {% continue %} to the loop around them.
struct BreakLoop {};
struct ContinueLoop {};

/** Jinja's getattr: a method of the value (str.strip, dict.items) or else
 * the dict's entry; undefined when neither. */
Value get_attribute(const Value& object, const std::string& name);
/** Jinja's getitem: obj[key] (negative indexes from the end), else an
 * attribute of that name; undefined when neither. */
Value get_item(const Value& object, const Value& key);
/** Python's slicing of a str, list or tuple. */
Value slice(const Value& object, const Value& start, const Value& stop, const Value& step);
/** The built-in filter `name` of `value`. */
Value apply_filter(const std::string& name, const Value& value, Arguments& args, Context& c);
/** The built-in test `name` of `value`. */
bool apply_test(const std::string& name, const Value& value, Arguments& args);
/** The globals every render sees: range, namespace, dict, raise_exception,
 * strftime_now. */
std::unordered_map<std::string, Value> globals();
/** Python's iteration: a list's items, a dict's keys, a str's characters,
 * nothing for undefined. */
Array iterate(const Value& v);
/** Python's a + b, a - b, ... for the arithmetic operators. */
Value arithmetic(const std::string& op, const Value& a, const Value& b);
/** Python's `needle in haystack`. */
bool contains(const Value& haystack, const Value& needle);

}  // namespace quanta::llm::jinja
