#pragma once
// Small text helpers for error messages.
#include <string>
#include <vector>

namespace quanta {

/** `names` separated by `separator` ("a, b, c"; "" for none): the lists of
 * keys, ranks, options or problems that error messages name. */
inline std::string join_names(const std::vector<std::string>& names, const char* separator = ", ") {
  std::string s;
  for (size_t i = 0; i < names.size(); ++i) s += (i ? separator : "") + names[i];
  return s;
}

}  // namespace quanta
