// Attributes, items, slices, iteration and operators of values, with the
// methods of str, dict and list that transformers' sandbox allows.
#include <algorithm>
#include <climits>
#include <cmath>

#include "llm/text/jinja/arguments.h"
#include "llm/text/jinja/context.h"
#include "llm/text/jinja/text_case.h"

namespace quanta::llm::jinja {

namespace {

Value code_point_string(char32_t c) { return Value(utf8(std::u32string(1, c))); }

// Python's str.strip family: `where` -1 left, 1 right, 0 both.
std::string strip(const std::string& s, const Value& chars, int where) {
  const std::u32string u = code_points(s);
  const std::u32string set = chars.is_string() ? code_points(chars.string()) : std::u32string();
  const auto drop = [&](char32_t c) {
    return chars.is_string() ? set.find(c) != std::u32string::npos : is_space(c);
  };
  std::size_t b = 0, e = u.size();
  if (where <= 0)
    while (b < e && drop(u[b])) ++b;
  if (where >= 0)
    while (e > b && drop(u[e - 1])) --e;
  return utf8(u.substr(b, e - b));
}

Array split(const std::string& s, const Value& separator, int64_t max_split, bool from_right) {
  Array out;
  if (separator.is_none() || separator.is_undefined()) {
    // Runs of whitespace, none at the ends.
    const std::u32string u = code_points(s);
    std::vector<std::pair<std::size_t, std::size_t>> words;
    for (std::size_t k = 0; k < u.size();) {
      while (k < u.size() && is_space(u[k])) ++k;
      if (k == u.size()) break;
      std::size_t e = k;
      while (e < u.size() && !is_space(u[e])) ++e;
      words.emplace_back(k, e);
      k = e;
    }
    if (max_split >= 0 && static_cast<int64_t>(words.size()) > max_split) {
      if (from_right) {
        const std::size_t keep = words.size() - static_cast<std::size_t>(max_split);
        // The rest as it is, leading whitespace included (Python's).
        out.push_back(Value(utf8(u.substr(0, words[keep - 1].second))));
        for (std::size_t k = keep; k < words.size(); ++k)
          out.push_back(Value(utf8(u.substr(words[k].first, words[k].second - words[k].first))));
        return out;
      }
      for (int64_t k = 0; k < max_split; ++k) {
        const auto& w = words[static_cast<std::size_t>(k)];
        out.push_back(Value(utf8(u.substr(w.first, w.second - w.first))));
      }
      // The rest as it is, trailing whitespace included (Python's).
      const std::size_t rest = words[static_cast<std::size_t>(max_split)].first;
      out.push_back(Value(utf8(u.substr(rest))));
      return out;
    }
    for (const auto& [b, e] : words) out.push_back(Value(utf8(u.substr(b, e - b))));
    return out;
  }
  if (!separator.is_string())
    throw std::invalid_argument("must be str or None, not " + separator.type_name());
  const std::string& sep = separator.string();
  if (sep.empty()) throw std::invalid_argument("empty separator");
  std::vector<std::string> parts;
  std::size_t from = 0;
  while (true) {
    const std::size_t at = s.find(sep, from);
    if (at == std::string::npos) break;
    parts.push_back(s.substr(from, at - from));
    from = at + sep.size();
  }
  parts.push_back(s.substr(from));
  if (max_split >= 0 && static_cast<int64_t>(parts.size()) > max_split + 1) {
    std::vector<std::string> joined;
    const std::size_t n = static_cast<std::size_t>(max_split);
    const auto join = [&](std::size_t b, std::size_t e) {
      std::string j;
      for (std::size_t k = b; k < e; ++k) j += (k > b ? sep : "") + parts[k];
      return j;
    };
    if (from_right) {
      joined.push_back(join(0, parts.size() - n));
      for (std::size_t k = parts.size() - n; k < parts.size(); ++k) joined.push_back(parts[k]);
    } else {
      for (std::size_t k = 0; k < n; ++k) joined.push_back(parts[k]);
      joined.push_back(join(n, parts.size()));
    }
    parts = std::move(joined);
  }
  for (std::string& p : parts) out.push_back(Value(std::move(p)));
  return out;
}

bool affix(const std::string& s, const Value& what, bool prefix) {
  const auto one = [&](const Value& v) {
    if (!v.is_string())
      throw std::invalid_argument(std::string(prefix ? "startswith" : "endswith") +
                                  " first arg must be str or a tuple of str, not " + v.type_name());
    const std::string& p = v.string();
    return p.size() <= s.size() && (prefix ? s.compare(0, p.size(), p) == 0
                                           : s.compare(s.size() - p.size(), p.size(), p) == 0);
  };
  if (what.is_array()) {
    for (const Value& v : what.items())
      if (one(v)) return true;
    return false;
  }
  return one(what);
}

// Python's str.format with {} {0} {name} fields (no format specs).
std::string format(const std::string& s, const Arguments& a) {
  std::string out;
  std::size_t next = 0;
  for (std::size_t k = 0; k < s.size(); ++k) {
    if (s[k] == '{' && k + 1 < s.size() && s[k + 1] == '{') {
      out += '{';
      ++k;
    } else if (s[k] == '}' && k + 1 < s.size() && s[k + 1] == '}') {
      out += '}';
      ++k;
    } else if (s[k] == '{') {
      const std::size_t e = s.find('}', k);
      if (e == std::string::npos)
        throw std::invalid_argument("Single '{' encountered in format string");
      const std::string field = s.substr(k + 1, e - k - 1);
      if (field.find_first_of(":!") != std::string::npos)
        throw std::invalid_argument("format specs are not supported in chat templates: {" + field +
                                    "}");
      Value v;
      if (field.empty()) {
        v = argument(a, next++, "");
      } else if (std::all_of(field.begin(), field.end(), ::isdigit)) {
        v = argument(a, std::stoul(field), "");
      } else {
        v = argument(a, SIZE_MAX, field.c_str());
      }
      if (v.is_undefined()) throw std::invalid_argument("format: no argument for {" + field + "}");
      out += v.to_string();
      k = e;
    } else {
      out += s[k];
    }
  }
  return out;
}

int64_t count(const std::string& s, const std::string& sub) {
  if (sub.empty()) return static_cast<int64_t>(code_points(s).size()) + 1;
  int64_t n = 0;
  for (std::size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size()))
    ++n;
  return n;
}

// The index of a byte offset in code points.
int64_t code_point_index(const std::string& s, std::size_t byte) {
  return static_cast<int64_t>(code_points(s.substr(0, byte)).size());
}

template <class Test>
bool all_chars(const std::string& s, Test test) {
  const std::u32string u = code_points(s);
  return !u.empty() && std::all_of(u.begin(), u.end(), test);
}

Value string_method(const std::string& self, const std::string& name) {
  const auto method = [&](auto body) {
    return Value::function("str." + name,
                           [self, body](Arguments& a) -> Value { return body(self, a); });
  };
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    const int where = name == "strip" ? 0 : name == "lstrip" ? -1 : 1;
    return method([where](const std::string& s, Arguments& a) {
      return Value(strip(s, argument(a, 0, "chars", Value::none()), where));
    });
  }
  if (name == "split" || name == "rsplit") {
    const bool right = name == "rsplit";
    return method([right](const std::string& s, Arguments& a) {
      return Value::array(split(s, argument(a, 0, "sep", Value::none()),
                                integer_argument(a, 1, "maxsplit", -1), right));
    });
  }
  if (name == "splitlines")
    return method([](const std::string& s, Arguments& a) {
      const bool keep = argument(a, 0, "keepends", Value(false)).truthy();
      Array out;
      std::size_t b = 0;
      for (std::size_t k = 0; k < s.size(); ++k)
        if (s[k] == '\n' || s[k] == '\r') {
          std::size_t e = k + (s[k] == '\r' && k + 1 < s.size() && s[k + 1] == '\n' ? 1 : 0);
          out.push_back(Value(s.substr(b, (keep ? e + 1 : k) - b)));
          k = e;
          b = e + 1;
        }
      if (b < s.size()) out.push_back(Value(s.substr(b)));
      return Value::array(std::move(out));
    });
  if (name == "startswith" || name == "endswith") {
    const bool prefix = name == "startswith";
    return method([prefix](const std::string& s, Arguments& a) {
      // Optional start and end: the code points [start, end) of s.
      const Value start = argument(a, 1, "start", Value::none());
      const Value end = argument(a, 2, "end", Value::none());
      const std::string part = start.is_none() && end.is_none()
                                   ? s
                                   : slice(Value(s), start, end, Value::none()).string();
      return Value(affix(part, argument(a, 0, prefix ? "prefix" : "suffix"), prefix));
    });
  }
  if (name == "upper")
    return method([](const std::string& s, Arguments&) { return Value(upper(s)); });
  if (name == "lower")
    return method([](const std::string& s, Arguments&) { return Value(lower(s)); });
  if (name == "title")
    return method([](const std::string& s, Arguments&) { return Value(python_title(s)); });
  if (name == "capitalize")
    return method([](const std::string& s, Arguments&) { return Value(capitalize(s)); });
  if (name == "replace")
    return method([](const std::string& s, Arguments& a) {
      const std::string from = string_argument(a, 0, "old"), to = string_argument(a, 1, "new");
      int64_t left = integer_argument(a, 2, "count", -1);
      std::string out;
      if (from.empty()) {
        const std::u32string u = code_points(s);
        for (std::size_t k = 0; k <= u.size(); ++k) {
          if (left != 0) {
            out += to;
            --left;
          }
          if (k < u.size()) out += utf8(u.substr(k, 1));
        }
        return Value(out);
      }
      std::size_t b = 0;
      for (std::size_t at = s.find(from); at != std::string::npos && left != 0;
           at = s.find(from, b), --left) {
        out += s.substr(b, at - b) + to;
        b = at + from.size();
      }
      return Value(out + s.substr(b));
    });
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex")
    return method([name](const std::string& s, Arguments& a) {
      const std::string sub = string_argument(a, 0, "sub");
      const std::size_t at = name[0] == 'r' ? s.rfind(sub) : s.find(sub);
      if (at == std::string::npos) {
        if (name.find("index") != std::string::npos)
          throw std::invalid_argument("substring not found");
        return Value(int64_t{-1});
      }
      return Value(code_point_index(s, at));
    });
  if (name == "count")
    return method([](const std::string& s, Arguments& a) {
      return Value(count(s, string_argument(a, 0, "sub")));
    });
  if (name == "join")
    return method([](const std::string& s, Arguments& a) {
      std::string out;
      bool first = true;
      for (const Value& v : iterate(argument(a, 0, "iterable"))) {
        if (!v.is_string())
          throw std::invalid_argument("sequence item: expected str instance, " + v.type_name() +
                                      " found");
        out += (first ? "" : s) + v.string();
        first = false;
      }
      return Value(out);
    });
  if (name == "format")
    return method([](const std::string& s, Arguments& a) { return Value(format(s, a)); });
  if (name == "isdigit")
    return method([](const std::string& s, Arguments&) {
      return Value(all_chars(s, [](char32_t c) { return c >= '0' && c <= '9'; }));
    });
  if (name == "isalpha")
    return method([](const std::string& s, Arguments&) {
      return Value(all_chars(s, [](char32_t c) { return cased(c); }));
    });
  if (name == "isalnum")
    return method([](const std::string& s, Arguments&) {
      return Value(all_chars(s, [](char32_t c) { return cased(c) || (c >= '0' && c <= '9'); }));
    });
  if (name == "isspace")
    return method([](const std::string& s, Arguments&) { return Value(all_chars(s, is_space)); });
  if (name == "islower" || name == "isupper") {
    const bool want_lower = name == "islower";
    return method([want_lower](const std::string& s, Arguments&) {
      bool any = false;
      for (char32_t c : code_points(s)) {
        if (!cased(c)) continue;
        any = true;
        if ((want_lower ? to_lower(c) : to_upper(c)) != c) return Value(false);
      }
      return Value(any);
    });
  }
  return Value::undefined("'str object' has no attribute '" + name + "'");
}

Value dict_method(const Value& self, const std::string& name) {
  if (name == "items" || name == "keys" || name == "values")
    return Value::function("dict." + name, [self, name](Arguments&) {
      Array out;
      for (const auto& [k, v] : self.fields())
        out.push_back(name == "items"  ? Value::array({Value(k), v}, true)
                      : name == "keys" ? Value(k)
                                       : v);
      return Value::array(std::move(out));
    });
  if (name == "get")
    return Value::function("dict.get", [self](Arguments& a) {
      const Value key = argument(a, 0, "key");
      const Value* v = key.is_string() ? self.field(key.string()) : nullptr;
      return v ? *v : argument(a, 1, "default", Value::none());
    });
  static const char* const mutating[] = {"update", "pop", "popitem", "setdefault", "clear"};
  for (const char* m : mutating)
    if (name == m)
      return Value::function("dict." + name, [name](Arguments&) -> Value {
        throw std::invalid_argument("access to attribute '" + name +
                                    "' of 'dict' object is unsafe.");
      });
  return Value::undefined("'dict object' has no attribute '" + name + "'");
}

Value list_method(const Value& self, const std::string& name) {
  if (name == "count")
    return Value::function("list.count", [self](Arguments& a) {
      const Value x = argument(a, 0, "value");
      return Value(static_cast<int64_t>(std::count_if(
          self.items().begin(), self.items().end(), [&](const Value& v) { return equal(v, x); })));
    });
  if (name == "index")
    return Value::function("list.index", [self](Arguments& a) {
      const Value x = argument(a, 0, "value");
      for (std::size_t k = 0; k < self.items().size(); ++k)
        if (equal(self.items()[k], x)) return Value(static_cast<int64_t>(k));
      throw std::invalid_argument(x.repr() + " is not in list");
    });
  static const char* const mutating[] = {"append", "extend", "insert", "pop",
                                         "remove", "clear",  "sort",   "reverse"};
  for (const char* m : mutating)
    if (name == m)
      return Value::function("list." + name, [name](Arguments&) -> Value {
        throw std::invalid_argument("access to attribute '" + name +
                                    "' of 'list' object is unsafe.");
      });
  return Value::undefined("'" + self.type_name() + " object' has no attribute '" + name + "'");
}

// Python's index of a sequence of `n` by a possibly negative `i`; -1 when
// outside.
int64_t position(int64_t i, int64_t n) {
  if (i < 0) i += n;
  return i < 0 || i >= n ? -1 : i;
}

}  // namespace

Value get_attribute(const Value& object, const std::string& name) {
  switch (object.kind()) {
    case Value::Kind::string:
      return string_method(object.string(), name);
    case Value::Kind::object: {
      if (!object.is_namespace()) {
        const Value m = dict_method(object, name);
        if (!m.is_undefined()) return m;
      }
      if (const Value* v = object.field(name)) return *v;
      return Value::undefined("'" + std::string(object.is_namespace() ? "Namespace" : "dict") +
                              " object' has no attribute '" + name + "'");
    }
    case Value::Kind::array:
      return list_method(object, name);
    default:
      return Value::undefined("'" + object.type_name() + " object' has no attribute '" + name +
                              "'");
  }
}

Value get_item(const Value& object, const Value& key) {
  if ((object.is_array() || object.is_string()) && key.is_integral()) {
    if (object.is_array()) {
      const int64_t n = static_cast<int64_t>(object.items().size());
      const int64_t p = position(key.integer(), n);
      if (p < 0)
        return Value::undefined(object.type_name() + " object has no element " + key.repr());
      return object.items()[static_cast<std::size_t>(p)];
    }
    const std::u32string u = code_points(object.string());
    const int64_t p = position(key.integer(), static_cast<int64_t>(u.size()));
    if (p < 0) return Value::undefined("str object has no element " + key.repr());
    return code_point_string(u[static_cast<std::size_t>(p)]);
  }
  if (object.is_object() && key.is_string()) {
    if (const Value* v = object.field(key.string())) return *v;
    if (!object.is_namespace()) {
      const Value m = dict_method(object, key.string());
      if (!m.is_undefined()) return m;
    }
    return Value::undefined("'dict object' has no attribute '" + key.string() + "'");
  }
  if (key.is_string()) return get_attribute(object, key.string());
  return Value::undefined("'" + object.type_name() + " object' has no element " + key.repr());
}

Value slice(const Value& object, const Value& start, const Value& stop, const Value& step) {
  const auto as_index = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.is_none() || v.is_undefined()) return std::nullopt;
    if (!v.is_integral())
      throw std::invalid_argument(std::string("slice ") + what + " must be an integer or None");
    return v.integer();
  };
  const int64_t s = as_index(step, "step").value_or(1);
  if (s == 0) throw std::invalid_argument("slice step cannot be zero");
  std::u32string text;
  int64_t n = 0;
  if (object.is_string()) {
    text = code_points(object.string());
    n = static_cast<int64_t>(text.size());
  } else if (object.is_array()) {
    n = static_cast<int64_t>(object.items().size());
  } else {
    throw std::invalid_argument("'" + object.type_name() + "' object is not subscriptable");
  }
  // Python's PySlice_AdjustIndices.
  const auto adjust = [&](std::optional<int64_t> v, int64_t missing) {
    if (!v) return missing;
    int64_t i = *v;
    if (i < 0) {
      i += n;
      if (i < 0) i = s < 0 ? -1 : 0;
    } else if (i >= n) {
      i = s < 0 ? n - 1 : n;
    }
    return i;
  };
  const int64_t b = adjust(as_index(start, "start"), s < 0 ? n - 1 : 0);
  const int64_t e = adjust(as_index(stop, "stop"), s < 0 ? -1 : n);
  std::vector<int64_t> picked;
  for (int64_t i = b; s > 0 ? i < e : i > e; i += s) picked.push_back(i);
  if (object.is_string()) {
    std::u32string out;
    for (int64_t i : picked) out.push_back(text[static_cast<std::size_t>(i)]);
    return Value(utf8(out));
  }
  Array out;
  for (int64_t i : picked) out.push_back(object.items()[static_cast<std::size_t>(i)]);
  return Value::array(std::move(out), object.is_tuple());
}

Array iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::undefined:
      return {};
    case Value::Kind::array:
      return v.items();
    case Value::Kind::object: {
      Array keys;
      for (const auto& [k, x] : v.fields()) keys.push_back(Value(k));
      return keys;
    }
    case Value::Kind::string: {
      Array chars;
      for (char32_t c : code_points(v.string())) chars.push_back(code_point_string(c));
      return chars;
    }
    default:
      throw std::invalid_argument("'" + v.type_name() + "' object is not iterable");
  }
}

bool contains(const Value& haystack, const Value& needle) {
  if (haystack.is_string()) {
    if (!needle.is_string())
      throw std::invalid_argument("'in <string>' requires string as left operand, not " +
                                  needle.type_name());
    return haystack.string().find(needle.string()) != std::string::npos;
  }
  if (haystack.is_object()) return needle.is_string() && haystack.field(needle.string()) != nullptr;
  if (haystack.is_array()) {
    for (const Value& v : haystack.items())
      if (equal(v, needle)) return true;
    return false;
  }
  if (haystack.is_undefined()) return false;
  throw std::invalid_argument("argument of type '" + haystack.type_name() + "' is not iterable");
}

namespace {

[[noreturn]] void unsupported(const std::string& op, const Value& a, const Value& b) {
  throw std::invalid_argument("unsupported operand type(s) for " + op + ": '" + a.type_name() +
                              "' and '" + b.type_name() + "'");
}

[[noreturn]] void beyond_64_bits() { throw std::invalid_argument("an integer beyond 64 bits"); }

// Python's ints are unbounded; templates' are refused past 64 bits rather
// than wrapped (checked before the operation: a signed overflow is
// undefined in C++).
int64_t integer_op(char op, int64_t x, int64_t y) {
  int64_t r = 0;
  const bool overflow = op == '+'   ? __builtin_add_overflow(x, y, &r)
                        : op == '-' ? __builtin_sub_overflow(x, y, &r)
                                    : __builtin_mul_overflow(x, y, &r);
  if (overflow) beyond_64_bits();
  return r;
}

// x ** y for y >= 0 by squaring: log2(y) products, so 1 ** 10**18 ends.
int64_t integer_power(int64_t x, int64_t y) {
  int64_t r = 1;
  while (y > 0) {
    if (y & 1) r = integer_op('*', r, x);
    y >>= 1;
    // A square still needed that overflows makes the result overflow too.
    if (y > 0) x = integer_op('*', x, x);
  }
  return r;
}

Value repeat(const Value& seq, int64_t times) {
  if (times < 0) times = 0;
  if (seq.is_string()) {
    std::string out;
    for (int64_t k = 0; k < times; ++k) out += seq.string();
    return Value(out);
  }
  Array out;
  for (int64_t k = 0; k < times; ++k) out.insert(out.end(), seq.items().begin(), seq.items().end());
  return Value::array(std::move(out), seq.is_tuple());
}

}  // namespace

Value arithmetic(const std::string& op, const Value& a, const Value& b) {
  if (a.is_numeric() && b.is_numeric()) {
    const bool ints = a.is_integral() && b.is_integral();
    const int64_t x = a.integer(), y = b.integer();
    const double p = a.number(), q = b.number();
    if (op == "+") return ints ? Value(integer_op('+', x, y)) : Value(p + q);
    if (op == "-") return ints ? Value(integer_op('-', x, y)) : Value(p - q);
    if (op == "*") return ints ? Value(integer_op('*', x, y)) : Value(p * q);
    if (op == "/") {
      if (q == 0) throw std::invalid_argument("division by zero");
      return Value(p / q);
    }
    if (op == "//" || op == "%") {
      if (q == 0)
        throw std::invalid_argument(op == "%" ? "integer modulo by zero"
                                              : "integer division or modulo by zero");
      if (ints) {
        // The one quotient beyond 64 bits (and a remainder C++ leaves
        // undefined there).
        if (y == -1) return op == "//" ? Value(integer_op('-', 0, x)) : Value(int64_t{0});
        int64_t d = x / y, m = x % y;
        if (m != 0 && ((m < 0) != (y < 0))) {
          --d;
          m += y;
        }
        return op == "//" ? Value(d) : Value(m);
      }
      const double d = std::floor(p / q);
      double m = std::fmod(p, q);
      if (m != 0 && ((m < 0) != (q < 0))) m += q;
      return op == "//" ? Value(d) : Value(m);
    }
    if (op == "**") {
      if (ints && y >= 0) return Value(integer_power(x, y));
      return Value(std::pow(p, q));
    }
  }
  if (op == "+") {
    // Markup + str escapes the str (markupsafe's __add__ and __radd__).
    if (a.is_string() && b.is_string() && (a.is_markup() || b.is_markup()))
      return Value::markup((a.is_markup() ? a.string() : html_escape(a.string())) +
                           (b.is_markup() ? b.string() : html_escape(b.string())));
    if (a.is_string() && b.is_string()) return Value(a.string() + b.string());
    if (a.is_array() && b.is_array() && a.is_tuple() == b.is_tuple()) {
      Array out = a.items();
      out.insert(out.end(), b.items().begin(), b.items().end());
      return Value::array(std::move(out), a.is_tuple());
    }
    if (a.is_string())
      throw std::invalid_argument("can only concatenate str (not \"" + b.type_name() +
                                  "\") to str");
  }
  if (op == "*") {
    if ((a.is_string() || a.is_array()) && b.is_integral()) return repeat(a, b.integer());
    if ((b.is_string() || b.is_array()) && a.is_integral()) return repeat(b, a.integer());
  }
  if (op == "%" && a.is_string())
    throw std::invalid_argument(
        "printf-style '%' formatting of strings is not supported in chat templates");
  unsupported(op, a, b);
}

}  // namespace quanta::llm::jinja
