#pragma once
// Reading a call's arguments by position or keyword, with defaults, for
// the built-in filters, tests, methods and globals.
#include <stdexcept>
#include <string>

#include "llm/text/jinja/value.h"

namespace quanta::llm::jinja {

/** Argument `index` (by position) or `name` (by keyword), else `fallback`. */
inline Value argument(const Arguments& a, std::size_t index, const char* name,
                      Value fallback = Value()) {
  for (const auto& [k, v] : a.keywords)
    if (k == name) return v;
  return index < a.positional.size() ? a.positional[index] : fallback;
}

inline int64_t integer_argument(const Arguments& a, std::size_t index, const char* name,
                                int64_t fallback) {
  const Value v = argument(a, index, name, Value(fallback));
  if (!v.is_integral())
    throw std::invalid_argument(std::string(name) + " must be an integer, got " + v.repr());
  return v.integer();
}

inline std::string string_argument(const Arguments& a, std::size_t index, const char* name) {
  const Value v = argument(a, index, name);
  if (!v.is_string())
    throw std::invalid_argument(std::string(name) + " must be a string, got " + v.repr());
  return v.string();
}

}  // namespace quanta::llm::jinja
