// Jinja2's built-in filters and tests, and the globals transformers adds,
// with their Jinja 3.1 behaviour (case-insensitive sort and unique,
// round half to even, indent's blank lines).
#include <algorithm>
#include <cmath>
#include <ctime>

#include "llm/text/jinja/arguments.h"
#include "llm/text/jinja/context.h"
#include "llm/text/jinja/template.h"
#include "llm/text/jinja/text_case.h"

namespace quanta::llm::jinja {

namespace {

// An item's attribute for sort, unique, map, selectattr...: dotted paths
// ("a.b") and integer parts as Jinja's make_attrgetter reads them.
Value attribute_of(const Value& item, const Value& attribute) {
  if (attribute.is_integral()) return get_item(item, attribute);
  Value v = item;
  const std::string path = attribute.to_string();
  std::size_t b = 0;
  while (b <= path.size()) {
    const std::size_t dot = std::min(path.find('.', b), path.size());
    const std::string part = path.substr(b, dot - b);
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
    v = digits ? get_item(v, Value(static_cast<int64_t>(std::stoll(part))))
               : get_item(v, Value(part));
    b = dot + 1;
  }
  return v;
}

// The key sort, unique, min and max compare: lowered strings unless
// case_sensitive.
Value sort_key(const Value& v, bool case_sensitive) {
  return !case_sensitive && v.is_string() ? Value(lower(v.string())) : v;
}

Value length(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::string:
      return Value(static_cast<int64_t>(code_points(v.string()).size()));
    case Value::Kind::array:
      return Value(static_cast<int64_t>(v.items().size()));
    case Value::Kind::object:
      return Value(static_cast<int64_t>(v.fields().size()));
    case Value::Kind::undefined:
      return Value(int64_t{0});
    default:
      throw std::invalid_argument("object of type '" + v.type_name() + "' has no len()");
  }
}

// Python's round(x, ndigits): half to even on the decimal value.
double round_half_even(double x, int64_t digits) {
  const double scale = std::pow(10.0, static_cast<double>(digits));
  const double y = x * scale;
  double r = std::nearbyint(y);  // the default rounding mode: half to even
  if (std::abs(y - std::trunc(y)) != 0.5) r = std::round(y);
  return r / scale;
}

std::string indent(const std::string& text, const Value& width, bool first, bool blank) {
  const std::string pad =
      width.is_string()
          ? width.string()
          : std::string(static_cast<std::size_t>(std::max<int64_t>(0, width.integer())), ' ');
  std::string s = text + "\n";
  std::vector<std::string> lines;
  for (std::size_t b = 0; b < s.size();) {
    const std::size_t nl = s.find('\n', b);
    lines.push_back(s.substr(b, nl - b));
    b = nl + 1;
  }
  std::string out;
  if (blank) {
    for (std::size_t k = 0; k < lines.size(); ++k) out += (k ? "\n" + pad : "") + lines[k];
  } else {
    out = lines[0];
    for (std::size_t k = 1; k < lines.size(); ++k)
      out += "\n" + (lines[k].empty() ? "" : pad) + lines[k];
  }
  return first ? pad + out : out;
}

// Jinja's title filter: each word after a run of "-", whitespace or an
// opening bracket capitalized.
std::string jinja_title(const std::string& s) {
  std::u32string u = code_points(s);
  bool start = true;
  for (char32_t& c : u) {
    const bool separator = c == '-' || is_space(c) || c == '(' || c == '{' || c == '[' || c == '<';
    if (separator) {
      start = true;
      continue;
    }
    c = start ? to_upper(c) : to_lower(c);
    start = false;
  }
  return utf8(u);
}

Value to_int(const Value& v, const Value& fallback, int64_t base) {
  if (v.is_integral()) return Value(v.integer());
  if (v.kind() == Value::Kind::number) return Value(static_cast<int64_t>(std::trunc(v.number())));
  if (v.is_string()) {
    // Python's int() and float() take surrounding whitespace.
    Arguments none;
    std::string s = get_attribute(v, "strip").call(none).string();
    std::erase(s, '_');
    try {
      std::size_t used = 0;
      const int64_t i = std::stoll(s, &used, static_cast<int>(base));
      if (used == s.size()) return Value(i);
    } catch (const std::exception&) {
    }
    try {
      std::size_t used = 0;
      const double d = std::stod(s, &used);
      if (used == s.size() && std::isfinite(d)) return Value(static_cast<int64_t>(std::trunc(d)));
    } catch (const std::exception&) {
    }
  }
  return fallback;
}

Value to_float(const Value& v, const Value& fallback) {
  if (v.is_numeric()) return Value(v.number());
  if (v.is_string()) {
    Arguments none;
    const std::string s = get_attribute(v, "strip").call(none).string();
    try {
      std::size_t used = 0;
      const double d = std::stod(s, &used);
      if (!s.empty() && used == s.size()) return Value(d);
    } catch (const std::exception&) {
    }
  }
  return fallback;
}

// The test `name` with the extra arguments from `first` on.
bool run_test(const std::string& name, const Value& v, const Arguments& a, std::size_t first) {
  Arguments rest;
  for (std::size_t k = first; k < a.positional.size(); ++k)
    rest.positional.push_back(a.positional[k]);
  return apply_test(name, v, rest);
}

Array select(const Value& seq, const Arguments& a, bool by_attribute, bool keep) {
  Array out;
  if (!seq.truthy()) return out;  // Jinja's: none selects nothing
  for (const Value& item : iterate(seq)) {
    const Value v = by_attribute ? attribute_of(item, argument(a, 0, "attribute")) : item;
    const std::size_t test_at = by_attribute ? 1 : 0;
    const bool pass = test_at < a.positional.size()
                          ? run_test(a.positional[test_at].to_string(), v, a, test_at + 1)
                          : v.truthy();
    if (pass == keep) out.push_back(item);
  }
  return out;
}

Value min_max(const Value& seq, const Arguments& a, bool want_max) {
  const bool case_sensitive = argument(a, 0, "case_sensitive", Value(false)).truthy();
  const Value attribute = argument(a, 1, "attribute", Value::none());
  const Array items = iterate(seq);
  if (items.empty())
    return Value::undefined("no " + std::string(want_max ? "max" : "min") +
                            " of an empty sequence");
  const Value* best = &items[0];
  const auto key = [&](const Value& v) {
    return sort_key(attribute.is_none() ? v : attribute_of(v, attribute), case_sensitive);
  };
  for (const Value& v : items) {
    const int c = compare(key(v), key(*best));
    if (want_max ? c > 0 : c < 0) best = &v;
  }
  return *best;
}

}  // namespace

Value apply_filter(const std::string& name, const Value& v, Arguments& a, Context& c) {
  static const char* const known[] = {
      "default", "d",           "length", "count",      "string",     "safe",   "e",
      "escape",  "forceescape", "tojson", "trim",       "upper",      "lower",  "capitalize",
      "title",   "replace",     "indent", "center",     "wordcount",  "list",   "first",
      "last",    "join",        "items",  "dictsort",   "sort",       "unique", "reverse",
      "map",     "select",      "reject", "selectattr", "rejectattr", "batch",  "max",
      "min",     "sum",         "abs",    "int",        "float",      "round",  "attr"};
  if (std::find(std::begin(known), std::end(known), name) == std::end(known))
    throw std::invalid_argument("No filter named '" + name + "'.");
  if (name == "default" || name == "d") {
    const bool boolean = argument(a, 1, "boolean", Value(false)).truthy();
    return v.is_undefined() || (boolean && !v.truthy()) ? argument(a, 0, "default_value", Value(""))
                                                        : v;
  }
  if (name == "length" || name == "count") return length(v);
  if (name == "string") return Value(v.to_string());
  if (name == "safe") return v.is_markup() ? v : Value::markup(v.to_string());
  if (name == "e" || name == "escape" || name == "forceescape")
    return v.is_markup() && name != "forceescape" ? v : Value::markup(html_escape(v.to_string()));
  if (name == "tojson") {
    const Value ind = argument(a, 0, "indent", Value::none());
    const Value separators = argument(a, 1, "separators", Value::none());
    std::string item_sep, key_sep;
    if (separators.is_array() && separators.items().size() == 2) {
      item_sep = separators.items()[0].to_string();
      key_sep = separators.items()[1].to_string();
    }
    return Value(to_json_text(v, ind.is_integral() ? static_cast<int>(ind.integer()) : -1,
                              argument(a, 2, "sort_keys", Value(false)).truthy(),
                              argument(a, 3, "ensure_ascii", Value(false)).truthy(), item_sep,
                              key_sep));
  }
  if (v.is_undefined() && name != "list" && name != "items" && name != "join" && name != "first" &&
      name != "last" && name != "trim" && name != "upper" && name != "lower" &&
      name != "capitalize" && name != "title" && name != "string" && name != "replace" &&
      name != "indent" && name != "map" && name != "select" && name != "reject" &&
      name != "selectattr" && name != "rejectattr")
    throw std::invalid_argument(v.what());
  if (name == "trim") {
    Arguments strip_args;
    strip_args.positional.push_back(argument(a, 0, "chars", Value::none()));
    return get_attribute(Value(v.to_string()), "strip").call(strip_args);
  }
  if (name == "upper") return Value(upper(v.to_string()));
  if (name == "lower") return Value(lower(v.to_string()));
  if (name == "capitalize") return Value(capitalize(v.to_string()));
  if (name == "title") return Value(jinja_title(v.to_string()));
  if (name == "replace") {
    Arguments r;
    r.positional = {argument(a, 0, "old"), argument(a, 1, "new")};
    const Value count = argument(a, 2, "count", Value::none());
    if (!count.is_none()) r.positional.push_back(count);
    return get_attribute(Value(v.to_string()), "replace").call(r);
  }
  if (name == "indent")
    return Value(indent(v.to_string(), argument(a, 0, "width", Value(int64_t{4})),
                        argument(a, 1, "first", Value(false)).truthy(),
                        argument(a, 2, "blank", Value(false)).truthy()));
  if (name == "center") {
    const std::u32string u = code_points(v.to_string());
    const int64_t width = integer_argument(a, 0, "width", 80);
    if (width <= static_cast<int64_t>(u.size())) return Value(v.to_string());
    const std::size_t pad = static_cast<std::size_t>(width) - u.size();
    // Python puts the odd space on the right unless the width is odd.
    const std::size_t left = pad / 2 + (pad & static_cast<std::size_t>(width) & 1);
    return Value(std::string(left, ' ') + v.to_string() + std::string(pad - left, ' '));
  }
  if (name == "wordcount") {
    int64_t n = 0;
    bool in_word = false;
    for (char32_t ch : code_points(v.to_string())) {
      const bool w = cased(ch) || (ch >= '0' && ch <= '9') || ch == '_' || ch >= 0x80;
      n += w && !in_word;
      in_word = w;
    }
    return Value(n);
  }
  if (name == "list") return Value::array(iterate(v));
  if (name == "first" || name == "last") {
    const Array items = iterate(v);
    if (items.empty()) return Value::undefined("the sequence is empty");
    return name == "first" ? items.front() : items.back();
  }
  if (name == "join") {
    const std::string sep = argument(a, 0, "d", Value("")).to_string();
    const Value attribute = argument(a, 1, "attribute", Value::none());
    std::string out;
    bool first = true;
    for (const Value& item : iterate(v)) {
      out += (first ? "" : sep) +
             (attribute.is_none() ? item : attribute_of(item, attribute)).to_string();
      first = false;
    }
    return Value(out);
  }
  if (name == "items") {
    if (v.is_undefined()) return Value::array();
    if (!v.is_object()) throw std::invalid_argument("Can only get item pairs from a mapping.");
    Array out;
    for (const auto& [k, x] : v.fields()) out.push_back(Value::array({Value(k), x}, true));
    return Value::array(std::move(out));
  }
  if (name == "dictsort") {
    if (!v.is_object())
      throw std::invalid_argument("You can only sort by either \"key\" or \"value\"");
    const bool case_sensitive = argument(a, 0, "case_sensitive", Value(false)).truthy();
    const std::string by = argument(a, 1, "by", Value("key")).to_string();
    const bool reverse = argument(a, 2, "reverse", Value(false)).truthy();
    if (by != "key" && by != "value")
      throw std::invalid_argument("You can only sort by either \"key\" or \"value\"");
    Array items;
    for (const auto& [k, x] : v.fields()) items.push_back(Value::array({Value(k), x}, true));
    const std::size_t at = by == "key" ? 0 : 1;
    std::stable_sort(items.begin(), items.end(), [&](const Value& p, const Value& q) {
      const int cmp =
          compare(sort_key(p.items()[at], case_sensitive), sort_key(q.items()[at], case_sensitive));
      return reverse ? cmp > 0 : cmp < 0;
    });
    return Value::array(std::move(items));
  }
  if (name == "sort") {
    const bool reverse = argument(a, 0, "reverse", Value(false)).truthy();
    const bool case_sensitive = argument(a, 1, "case_sensitive", Value(false)).truthy();
    const Value attribute = argument(a, 2, "attribute", Value::none());
    Array items = iterate(v);
    const auto key = [&](const Value& x) {
      return sort_key(attribute.is_none() ? x : attribute_of(x, attribute), case_sensitive);
    };
    std::stable_sort(items.begin(), items.end(), [&](const Value& p, const Value& q) {
      const int cmp = compare(key(p), key(q));
      return reverse ? cmp > 0 : cmp < 0;
    });
    return Value::array(std::move(items));
  }
  if (name == "unique") {
    const bool case_sensitive = argument(a, 0, "case_sensitive", Value(false)).truthy();
    const Value attribute = argument(a, 1, "attribute", Value::none());
    Array out, seen;
    for (const Value& item : iterate(v)) {
      const Value k =
          sort_key(attribute.is_none() ? item : attribute_of(item, attribute), case_sensitive);
      if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return equal(s, k); })) {
        seen.push_back(k);
        out.push_back(item);
      }
    }
    return Value::array(std::move(out));
  }
  if (name == "reverse") {
    if (v.is_string()) {
      std::u32string u = code_points(v.string());
      std::reverse(u.begin(), u.end());
      return Value(utf8(u));
    }
    Array items = iterate(v);
    std::reverse(items.begin(), items.end());
    return Value::array(std::move(items));
  }
  if (name == "map") {
    Array out;
    if (!v.truthy()) return Value::array();  // Jinja's: none maps to nothing
    const Value attribute = argument(a, SIZE_MAX, "attribute");
    if (!attribute.is_undefined()) {
      const Value fallback = argument(a, SIZE_MAX, "default");
      for (const Value& item : iterate(v)) {
        const Value x = attribute_of(item, attribute);
        out.push_back(x.is_undefined() && !fallback.is_undefined() ? fallback : x);
      }
      return Value::array(std::move(out));
    }
    if (a.positional.empty()) throw std::invalid_argument("map requires a filter argument");
    const std::string filter = a.positional[0].to_string();
    Arguments rest;
    rest.positional.assign(a.positional.begin() + 1, a.positional.end());
    rest.keywords = a.keywords;
    for (const Value& item : iterate(v)) out.push_back(apply_filter(filter, item, rest, c));
    return Value::array(std::move(out));
  }
  if (name == "select" || name == "reject")
    return Value::array(select(v, a, false, name == "select"));
  if (name == "selectattr" || name == "rejectattr")
    return Value::array(select(v, a, true, name == "selectattr"));
  if (name == "batch") {
    const int64_t size = integer_argument(a, 0, "linecount", 1);
    if (size <= 0) throw std::invalid_argument("batch size must be positive");
    const Value fill = argument(a, 1, "fill_with", Value::none());
    Array out, current;
    for (const Value& item : iterate(v)) {
      current.push_back(item);
      if (static_cast<int64_t>(current.size()) == size) {
        out.push_back(Value::array(std::move(current)));
        current.clear();
      }
    }
    if (!current.empty()) {
      if (!fill.is_none())
        while (static_cast<int64_t>(current.size()) < size) current.push_back(fill);
      out.push_back(Value::array(std::move(current)));
    }
    return Value::array(std::move(out));
  }
  if (name == "max" || name == "min") return min_max(v, a, name == "max");
  if (name == "sum") {
    const Value attribute = argument(a, 0, "attribute", Value::none());
    Value total = argument(a, 1, "start", Value(int64_t{0}));
    for (const Value& item : iterate(v))
      total = arithmetic("+", total, attribute.is_none() ? item : attribute_of(item, attribute));
    return total;
  }
  if (name == "abs") {
    if (!v.is_numeric())
      throw std::invalid_argument("bad operand type for abs(): '" + v.type_name() + "'");
    if (v.kind() == Value::Kind::number) return Value(std::abs(v.number()));
    return v.integer() < 0 ? arithmetic("-", Value(int64_t{0}), v) : Value(v.integer());
  }
  if (name == "int")
    return to_int(v, argument(a, 0, "default", Value(int64_t{0})),
                  integer_argument(a, 1, "base", 10));
  if (name == "float") return to_float(v, argument(a, 0, "default", Value(0.0)));
  if (name == "round") {
    const int64_t precision = integer_argument(a, 0, "precision", 0);
    const std::string method = argument(a, 1, "method", Value("common")).to_string();
    if (method == "common") {
      if (v.is_integral()) return Value(v.integer());
      return Value(round_half_even(v.number(), precision));
    }
    const double scale = std::pow(10.0, static_cast<double>(precision));
    if (method == "ceil") return Value(std::ceil(v.number() * scale) / scale);
    if (method == "floor") return Value(std::floor(v.number() * scale) / scale);
    throw std::invalid_argument("method must be common, ceil or floor");
  }
  if (name == "attr") return get_attribute(v, argument(a, 0, "name").to_string());
  throw std::invalid_argument("No filter named '" + name + "'.");
}

bool apply_test(const std::string& name, const Value& v, Arguments& a) {
  const auto other = [&] { return argument(a, 0, "other"); };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "boolean") return v.is_boolean();
  if (name == "true") return v.is_boolean() && v.boolean();
  if (name == "false") return v.is_boolean() && !v.boolean();
  if (name == "integer") return v.kind() == Value::Kind::integer;
  if (name == "float") return v.kind() == Value::Kind::number;
  if (name == "number") return v.is_numeric();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_object() && !v.is_namespace();
  if (name == "iterable") return v.is_string() || v.is_array() || v.is_object();
  if (name == "sequence")
    return v.is_string() || v.is_array() || (v.is_object() && !v.is_namespace());
  if (name == "callable") return v.is_function();
  if (name == "escaped") return false;
  if (name == "odd" || name == "even") {
    if (!v.is_integral()) throw std::invalid_argument("odd and even test integers");
    return (((v.integer() % 2) + 2) % 2 == 1) == (name == "odd");
  }
  if (name == "divisibleby") {
    const Value n = argument(a, 0, "num");
    if (!v.is_integral() || !n.is_integral() || n.integer() == 0)
      throw std::invalid_argument("divisibleby tests integers by a non-zero integer");
    return v.integer() % n.integer() == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==") return equal(v, other());
  if (name == "ne" || name == "!=") return !equal(v, other());
  if (name == "lt" || name == "lessthan" || name == "<") return compare(v, other()) < 0;
  if (name == "le" || name == "<=") return compare(v, other()) <= 0;
  if (name == "gt" || name == "greaterthan" || name == ">") return compare(v, other()) > 0;
  if (name == "ge" || name == ">=") return compare(v, other()) >= 0;
  if (name == "in") return contains(argument(a, 0, "seq"), v);
  if (name == "sameas") {
    const Value o = other();
    if (v.kind() != o.kind()) return false;
    if (v.is_none() || v.is_undefined()) return true;
    if (v.is_boolean()) return v.boolean() == o.boolean();
    if (v.is_array()) return &v.items() == &o.items();
    if (v.is_object()) return &v.fields() == &o.fields();
    return equal(v, o);
  }
  if (name == "lower" || name == "upper") {
    if (!v.is_string()) return false;
    Arguments none;
    return get_attribute(v, name == "lower" ? "islower" : "isupper").call(none).boolean();
  }
  throw std::invalid_argument("No test named '" + name + "'.");
}

std::unordered_map<std::string, Value> globals() {
  std::unordered_map<std::string, Value> g;
  g["range"] = Value::function("range", [](Arguments& a) {
    if (a.positional.empty() || a.positional.size() > 3)
      throw std::invalid_argument("range expected 1 to 3 arguments");
    for (const Value& v : a.positional)
      if (!v.is_integral()) throw std::invalid_argument("range takes integers, got " + v.repr());
    const int64_t start = a.positional.size() > 1 ? a.positional[0].integer() : 0;
    const int64_t stop =
        a.positional.size() > 1 ? a.positional[1].integer() : a.positional[0].integer();
    const int64_t step = a.positional.size() > 2 ? a.positional[2].integer() : 1;
    if (step == 0) throw std::invalid_argument("range() arg 3 must not be zero");
    const int64_t n = step > 0 ? (stop > start ? (stop - start + step - 1) / step : 0)
                               : (start > stop ? (start - stop - step - 1) / -step : 0);
    // Jinja's sandbox: MAX_RANGE.
    if (n > 100000)
      throw std::invalid_argument(
          "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    Array out;
    for (int64_t k = 0; k < n; ++k) out.push_back(Value(start + k * step));
    return Value::array(std::move(out));
  });
  const auto keyword_object = [](Arguments& a, bool name_space) {
    Fields f;
    for (const Value& p : a.positional) {
      if (!p.is_object())
        throw std::invalid_argument("expected a mapping as a positional argument");
      for (const auto& e : p.fields()) f.push_back(e);
    }
    for (const auto& [k, v] : a.keywords) {
      if (name_space && !k.empty() && k[0] == '_')
        throw std::invalid_argument("access to attribute '" + k +
                                    "' of 'Namespace' object is unsafe.");
      f.emplace_back(k, v);
    }
    return Value::object(std::move(f), name_space);
  };
  g["namespace"] = Value::function(
      "namespace", [keyword_object](Arguments& a) { return keyword_object(a, true); });
  g["dict"] =
      Value::function("dict", [keyword_object](Arguments& a) { return keyword_object(a, false); });
  g["raise_exception"] = Value::function("raise_exception", [](Arguments& a) -> Value {
    throw TemplateRaised(argument(a, 0, "message", Value("")).to_string());
  });
  g["strftime_now"] = Value::function("strftime_now", [](Arguments& a) {
    const std::string format = string_argument(a, 0, "format");
    const std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char buf[256];
    const std::size_t n = std::strftime(buf, sizeof buf, format.c_str(), &local);
    return Value(std::string(buf, n));
  });
  return g;
}

}  // namespace quanta::llm::jinja
