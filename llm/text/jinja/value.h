#pragma once
// The values a chat template computes with: Python's None, bool, int,
// float, str, list (and tuple) and dict, Jinja's undefined, namespaces and
// callables, compared, tested for truth and printed by Python's rules, so
// that a template renders the text transformers renders.
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace quanta::llm::jinja {

class Value;
using Array = std::vector<Value>;
/** A dict's entries in insertion order (templates' dicts are small). */
using Fields = std::vector<std::pair<std::string, Value>>;

/** Positional and keyword arguments of a call. */
struct Arguments {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keywords;
};

using Function = std::function<Value(Arguments&)>;

class Value {
 public:
  enum class Kind { undefined, none, boolean, integer, number, string, array, object, function };

  /** Undefined, optionally naming what was looked up (for errors). */
  Value() = default;
  static Value undefined(std::string what);
  static Value none();
  Value(bool b);
  Value(int64_t i);
  Value(int i) : Value(static_cast<int64_t>(i)) {}
  Value(double d);
  Value(std::string s);
  Value(const char* s) : Value(std::string(s)) {}
  /** A list (shared: Python's reference semantics), or a tuple. */
  static Value array(Array items = {}, bool tuple = false);
  /** A dict, or a namespace() (whose attributes `set` may assign). */
  static Value object(Fields fields = {}, bool name_space = false);
  static Value function(std::string name, Function f);
  /** A str marked safe (Jinja's Markup: |safe, |escape), which escapes the
   * plain str added to it. */
  static Value markup(std::string s);
  static Value from_json(const nlohmann::ordered_json& j);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::undefined; }
  bool is_none() const { return kind_ == Kind::none; }
  bool is_string() const { return kind_ == Kind::string; }
  bool is_array() const { return kind_ == Kind::array; }
  bool is_object() const { return kind_ == Kind::object; }
  bool is_function() const { return kind_ == Kind::function; }
  bool is_boolean() const { return kind_ == Kind::boolean; }
  /** int or bool (Python's bool is an int). */
  bool is_integral() const { return kind_ == Kind::integer || kind_ == Kind::boolean; }
  bool is_numeric() const { return is_integral() || kind_ == Kind::number; }
  bool is_tuple() const { return kind_ == Kind::array && tuple_; }
  bool is_namespace() const { return kind_ == Kind::object && namespace_; }
  bool is_markup() const { return kind_ == Kind::string && namespace_; }

  bool boolean() const { return integer_ != 0; }
  int64_t integer() const { return integer_; }
  /** int, bool or float as a double. */
  double number() const { return kind_ == Kind::number ? number_ : static_cast<double>(integer_); }
  const std::string& string() const { return *string_; }
  Array& items() const { return *array_; }
  Fields& fields() const { return *object_; }
  const std::string& function_name() const { return *string_; }
  Value call(Arguments& args) const { return (*function_)(args); }
  /** What an undefined value stood for ("message.tool_calls"). */
  const std::string& what() const;

  /** A dict's entry, or nullptr. */
  Value* field(const std::string& key) const;
  void set_field(const std::string& key, Value v) const;

  /** Python's truth: none, undefined, false, 0, "", [] and {} are false. */
  bool truthy() const;
  /** Jinja's printing: str() of the value, undefined as "". */
  std::string to_string() const;
  /** Python's repr(). */
  std::string repr() const;
  /** The Python type name in messages ("dict", "str"). */
  std::string type_name() const;
  nlohmann::ordered_json to_json() const;

 private:
  Kind kind_ = Kind::undefined;
  bool tuple_ = false, namespace_ = false;
  int64_t integer_ = 0;
  double number_ = 0;
  std::shared_ptr<std::string> string_;
  std::shared_ptr<Array> array_;
  std::shared_ptr<Fields> object_;
  std::shared_ptr<Function> function_;
};

/** Python's ==: 1 == 1.0 == True, lists and dicts by content. */
bool equal(const Value& a, const Value& b);
/** Python's ordering of numbers, strings and lists: < 0, 0 or > 0; throws
 * std::invalid_argument for values Python cannot order. */
int compare(const Value& a, const Value& b);

/** HTML's escapes of & < > " ' (markupsafe's). */
std::string html_escape(const std::string& s);

/** Python's repr() of a float ("1.0", "0.30000000000000004", "1e+20"). */
std::string float_repr(double d);

/** json.dumps of `v` as transformers' tojson calls it: ensure_ascii off by
 * default, `indent` < 0 for none (then ", " and ": "; with an indent "," and
 * ": "), keys in order unless sort_keys. Throws std::invalid_argument for
 * an undefined value or a function. */
std::string to_json_text(const Value& v, int indent = -1, bool sort_keys = false,
                         bool ensure_ascii = false, const std::string& item_separator = "",
                         const std::string& key_separator = "");

/** UTF-8 text as code points and back (Python indexes strings by them). */
std::u32string code_points(const std::string& s);
std::string utf8(const std::u32string& s);

}  // namespace quanta::llm::jinja
