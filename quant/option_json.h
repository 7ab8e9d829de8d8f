#pragma once
// Reading and showing a family's options by name as JSON, over its
// for_each_option (quant/option_fields.h): a reference case's constructor
// options, `quanta train`'s quantizer config, --print-config.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "quant/option_fields.h"

namespace quanta::quant {

namespace detail {

template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};

[[noreturn]] inline void bad_option(const std::string& who, std::string_view name,
                                    const std::string& want, const nlohmann::json& v) {
  throw std::invalid_argument(who + " option '" + std::string(name) + "' must be " + want +
                              ", got " + v.dump());
}

inline int64_t option_integer(const std::string& who, std::string_view name,
                              const nlohmann::json& v, OptionKind kind) {
  if (!v.is_number_integer())
    bad_option(who, name, kind == OptionKind::size ? "a whole number >= 1" : "a whole number", v);
  const int64_t n = v.get<int64_t>();
  if (kind == OptionKind::size && n < 1) bad_option(who, name, "a whole number >= 1", v);
  return n;
}

}  // namespace detail

/** Reads `v` into `field` (option `name` of `who`, for errors). null leaves
 * the field as it is (the reference's None: its default); a single number
 * read into a list is the one-element list. Throws std::invalid_argument
 * naming the option for a value of another type, or a size below 1. */
template <class T>
void read_option(const std::string& who, std::string_view name, const nlohmann::json& v, T& field,
                 OptionKind kind) {
  if (v.is_null()) return;
  if constexpr (detail::is_optional<T>::value) {
    typename T::value_type value{};
    read_option(who, name, v, value, kind);
    field = value;
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) detail::bad_option(who, name, "true or false", v);
    field = v.get<bool>();
  } else if constexpr (std::is_same_v<T, int64_t>) {
    field = detail::option_integer(who, name, v, kind);
  } else if constexpr (std::is_same_v<T, double>) {
    if (!v.is_number()) detail::bad_option(who, name, "a number", v);
    field = v.get<double>();
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!v.is_string()) detail::bad_option(who, name, "a string", v);
    field = v.get<std::string>();
  } else if constexpr (std::is_same_v<T, std::vector<double>>) {
    if (!v.is_array()) {
      field = {0.0};
      read_option(who, name, v, field[0], kind);
      return;
    }
    field.clear();
    for (const auto& e : v) {
      field.push_back(0.0);
      read_option(who, name, e, field.back(), kind);
    }
  } else {
    static_assert(std::is_same_v<T, std::vector<int64_t>>, "an option type without a reader");
    if (!v.is_array()) {
      field = {detail::option_integer(who, name, v, kind)};
      return;
    }
    field.clear();
    for (const auto& e : v) field.push_back(detail::option_integer(who, name, e, kind));
  }
}

/** `field` as JSON: an unset optional and a size of 0 (derived) are null, the
 * reference's None; a one-element list is its element. */
template <class T>
nlohmann::json option_json(const T& field, OptionKind kind) {
  if constexpr (std::is_same_v<T, int64_t>) {
    return kind == OptionKind::size && field == 0 ? nlohmann::json(nullptr) : nlohmann::json(field);
  } else if constexpr (detail::is_optional<T>::value) {
    return field ? nlohmann::json(*field) : nlohmann::json(nullptr);
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    return field.size() == 1 ? nlohmann::json(field[0]) : nlohmann::json(field);
  } else {
    return nlohmann::json(field);
  }
}

/** Sets option `key` of `opts` from `v` (read_option's rules); false when
 * `opts` has no option of that name. */
template <class Options>
bool set_option(Options& opts, const std::string& who, const std::string& key,
                const nlohmann::json& v) {
  bool found = false;
  for_each_option(opts, [&](std::string_view name, auto& field, OptionKind kind) {
    if (found || name != key) return;
    read_option(who, name, v, field, kind);
    found = true;
  });
  return found;
}

}  // namespace quanta::quant
