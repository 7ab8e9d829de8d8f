#include "llm/text/jinja/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace quanta::llm::jinja {

Value Value::undefined(std::string what) {
  Value v;
  v.string_ = std::make_shared<std::string>(std::move(what));
  return v;
}

Value Value::none() {
  Value v;
  v.kind_ = Kind::none;
  return v;
}

Value::Value(bool b) : kind_(Kind::boolean), integer_(b ? 1 : 0) {}
Value::Value(int64_t i) : kind_(Kind::integer), integer_(i) {}
Value::Value(double d) : kind_(Kind::number), number_(d) {}
Value::Value(std::string s)
    : kind_(Kind::string), string_(std::make_shared<std::string>(std::move(s))) {}

Value Value::array(Array items, bool tuple) {
  Value v;
  v.kind_ = Kind::array;
  v.tuple_ = tuple;
  v.array_ = std::make_shared<Array>(std::move(items));
  return v;
}

Value Value::object(Fields fields, bool name_space) {
  Value v;
  v.kind_ = Kind::object;
  v.namespace_ = name_space;
  v.object_ = std::make_shared<Fields>(std::move(fields));
  return v;
}

Value Value::function(std::string name, Function f) {
  Value v;
  v.kind_ = Kind::function;
  v.string_ = std::make_shared<std::string>(std::move(name));
  v.function_ = std::make_shared<Function>(std::move(f));
  return v;
}

Value Value::markup(std::string s) {
  Value v(std::move(s));
  v.namespace_ = true;  // on a str: marked safe
  return v;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

Value Value::from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned:
      return Value(static_cast<int64_t>(j.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float:
      return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      Array a;
      for (const nlohmann::ordered_json& e : j) a.push_back(from_json(e));
      return array(std::move(a));
    }
    case nlohmann::ordered_json::value_t::object: {
      Fields f;
      for (auto it = j.begin(); it != j.end(); ++it)
        f.emplace_back(it.key(), from_json(it.value()));
      return object(std::move(f));
    }
    default:
      throw std::invalid_argument("a JSON value of an unsupported type");
  }
}

const std::string& Value::what() const {
  static const std::string none;
  return string_ ? *string_ : none;
}

Value* Value::field(const std::string& key) const {
  for (auto& [k, v] : *object_)
    if (k == key) return &v;
  return nullptr;
}

void Value::set_field(const std::string& key, Value v) const {
  if (Value* f = field(key))
    *f = std::move(v);
  else
    object_->emplace_back(key, std::move(v));
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::undefined:
    case Kind::none:
      return false;
    case Kind::boolean:
    case Kind::integer:
      return integer_ != 0;
    case Kind::number:
      return number_ != 0;
    case Kind::string:
      return !string_->empty();
    case Kind::array:
      return !array_->empty();
    case Kind::object:
      return namespace_ || !object_->empty();
    case Kind::function:
      return true;
  }
  return false;
}

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  // The shortest digits that read back as d, placed as Python's repr places
  // them: positional for exponents -4..15, else d.ddde+XX.
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string s(buf, r.ptr);
  const bool negative = s[0] == '-';
  if (negative) s.erase(0, 1);
  const std::size_t e = s.find('e');
  const int exponent = std::stoi(s.substr(e + 1));
  std::string digits = s.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  std::string out;
  if (exponent >= -4 && exponent < 16) {
    if (exponent < 0) {
      out = "0." + std::string(static_cast<std::size_t>(-exponent - 1), '0') + digits;
    } else if (static_cast<int>(digits.size()) <= exponent + 1) {
      out =
          digits + std::string(static_cast<std::size_t>(exponent + 1) - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, static_cast<std::size_t>(exponent + 1)) + "." +
            digits.substr(static_cast<std::size_t>(exponent + 1));
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char ex[16];
    std::snprintf(ex, sizeof ex, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out += ex;
  }
  return negative ? "-" + out : out;
}

namespace {

std::string string_repr(const std::string& s) {
  const bool single = s.find('\'') == std::string::npos || s.find('"') != std::string::npos;
  const char quote = single ? '\'' : '"';
  std::string out(1, quote);
  for (unsigned char c : s) {
    if (c == quote || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + quote;
}

}  // namespace

std::string Value::to_string() const {
  switch (kind_) {
    case Kind::undefined:
      return "";
    case Kind::string:
      return *string_;
    default:
      return repr();
  }
}

std::string Value::repr() const {
  switch (kind_) {
    case Kind::undefined:
      return "Undefined";
    case Kind::none:
      return "None";
    case Kind::boolean:
      return integer_ ? "True" : "False";
    case Kind::integer:
      return std::to_string(integer_);
    case Kind::number:
      return float_repr(number_);
    case Kind::string:
      return string_repr(*string_);
    case Kind::array: {
      std::string s = tuple_ ? "(" : "[";
      for (std::size_t i = 0; i < array_->size(); ++i) s += (i ? ", " : "") + (*array_)[i].repr();
      if (tuple_ && array_->size() == 1) s += ",";
      return s + (tuple_ ? ")" : "]");
    }
    case Kind::object: {
      std::string s = namespace_ ? "Namespace(" : "{";
      bool first = true;
      for (const auto& [k, v] : *object_) {
        s += (first ? "" : ", ") + (namespace_ ? k + "=" : string_repr(k) + ": ") + v.repr();
        first = false;
      }
      return s + (namespace_ ? ")" : "}");
    }
    case Kind::function:
      return "<function " + *string_ + ">";
  }
  return "";
}

std::string Value::type_name() const {
  switch (kind_) {
    case Kind::undefined:
      return "Undefined";
    case Kind::none:
      return "NoneType";
    case Kind::boolean:
      return "bool";
    case Kind::integer:
      return "int";
    case Kind::number:
      return "float";
    case Kind::string:
      return "str";
    case Kind::array:
      return tuple_ ? "tuple" : "list";
    case Kind::object:
      return namespace_ ? "Namespace" : "dict";
    case Kind::function:
      return "function";
  }
  return "";
}

nlohmann::ordered_json Value::to_json() const {
  switch (kind_) {
    case Kind::none:
      return nullptr;
    case Kind::boolean:
      return integer_ != 0;
    case Kind::integer:
      return integer_;
    case Kind::number:
      return number_;
    case Kind::string:
      return *string_;
    case Kind::array: {
      nlohmann::ordered_json j = nlohmann::ordered_json::array();
      for (const Value& v : *array_) j.push_back(v.to_json());
      return j;
    }
    case Kind::object: {
      nlohmann::ordered_json j = nlohmann::ordered_json::object();
      for (const auto& [k, v] : *object_) j[k] = v.to_json();
      return j;
    }
    default:
      throw std::invalid_argument("Object of type " + type_name() + " is not JSON serializable");
  }
}

bool equal(const Value& a, const Value& b) {
  if (a.is_numeric() && b.is_numeric()) {
    if (a.is_integral() && b.is_integral()) return a.integer() == b.integer();
    return a.number() == b.number();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::undefined:
    case Value::Kind::none:
      return true;
    case Value::Kind::string:
      return a.string() == b.string();
    case Value::Kind::array: {
      if (a.items().size() != b.items().size()) return false;
      for (std::size_t i = 0; i < a.items().size(); ++i)
        if (!equal(a.items()[i], b.items()[i])) return false;
      return true;
    }
    case Value::Kind::object: {
      if (a.fields().size() != b.fields().size()) return false;
      for (const auto& [k, v] : a.fields()) {
        const Value* w = b.field(k);
        if (!w || !equal(v, *w)) return false;
      }
      return true;
    }
    default:
      return &a.fields() == &b.fields();
  }
}

int compare(const Value& a, const Value& b) {
  if (a.is_numeric() && b.is_numeric()) {
    if (a.is_integral() && b.is_integral())
      return a.integer() < b.integer() ? -1 : a.integer() > b.integer();
    return a.number() < b.number() ? -1 : a.number() > b.number();
  }
  if (a.is_string() && b.is_string()) {
    // UTF-8's byte order is its code points' order.
    const int c = a.string().compare(b.string());
    return c < 0 ? -1 : c > 0;
  }
  if (a.is_array() && b.is_array()) {
    const std::size_t n = std::min(a.items().size(), b.items().size());
    for (std::size_t i = 0; i < n; ++i)
      if (!equal(a.items()[i], b.items()[i])) return compare(a.items()[i], b.items()[i]);
    return a.items().size() < b.items().size() ? -1 : a.items().size() > b.items().size();
  }
  throw std::invalid_argument("'<' not supported between instances of '" + a.type_name() +
                              "' and '" + b.type_name() + "'");
}

std::u32string code_points(const std::string& s) {
  std::u32string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const int n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    char32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    for (int k = 1; k < n && i + static_cast<std::size_t>(k) < s.size(); ++k)
      cp = (cp << 6) | (static_cast<unsigned char>(s[i + static_cast<std::size_t>(k)]) & 0x3F);
    out.push_back(cp);
    i += static_cast<std::size_t>(n);
  }
  return out;
}

std::string utf8(const std::u32string& s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) {
    if (c < 0x80) {
      out += static_cast<char>(c);
    } else if (c < 0x800) {
      out += static_cast<char>(0xC0 | (c >> 6));
      out += static_cast<char>(0x80 | (c & 0x3F));
    } else if (c < 0x10000) {
      out += static_cast<char>(0xE0 | (c >> 12));
      out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (c & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (c >> 18));
      out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (c & 0x3F));
    }
  }
  return out;
}

namespace {

void json_string(const std::string& s, bool ensure_ascii, std::string& out) {
  out += '"';
  const auto escape_unit = [&](unsigned unit) {
    char hex[16];
    std::snprintf(hex, sizeof hex, "\\u%04x", unit & 0xFFFFu);
    out += hex;
  };
  for (char32_t c : code_points(s)) {
    switch (c) {
      case '"':
        out += "\\\"";
        continue;
      case '\\':
        out += "\\\\";
        continue;
      case '\n':
        out += "\\n";
        continue;
      case '\r':
        out += "\\r";
        continue;
      case '\t':
        out += "\\t";
        continue;
      case '\b':
        out += "\\b";
        continue;
      case '\f':
        out += "\\f";
        continue;
      default:
        break;
    }
    if (c < 0x20) {
      escape_unit(c);
    } else if (ensure_ascii && c > 0x7E) {
      if (c >= 0x10000) {
        const char32_t v = c - 0x10000;
        escape_unit(0xD800 + (v >> 10));
        escape_unit(0xDC00 + (v & 0x3FF));
      } else {
        escape_unit(c);
      }
    } else {
      out += utf8(std::u32string(1, c));
    }
  }
  out += '"';
}

void dump(const Value& v, int indent, int depth, bool sort_keys, bool ensure_ascii,
          const std::string& item_sep, const std::string& key_sep, std::string& out) {
  const auto newline = [&](int d) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<std::size_t>(indent) * static_cast<std::size_t>(d), ' ');
  };
  switch (v.kind()) {
    case Value::Kind::none:
      out += "null";
      return;
    case Value::Kind::boolean:
      out += v.boolean() ? "true" : "false";
      return;
    case Value::Kind::integer:
      out += std::to_string(v.integer());
      return;
    case Value::Kind::number:
      if (std::isnan(v.number()))
        out += "NaN";
      else if (std::isinf(v.number()))
        out += v.number() > 0 ? "Infinity" : "-Infinity";
      else
        out += float_repr(v.number());
      return;
    case Value::Kind::string:
      json_string(v.string(), ensure_ascii, out);
      return;
    case Value::Kind::array: {
      if (v.items().empty()) {
        out += "[]";
        return;
      }
      out += "[";
      for (std::size_t i = 0; i < v.items().size(); ++i) {
        if (i) out += item_sep;
        newline(depth + 1);
        dump(v.items()[i], indent, depth + 1, sort_keys, ensure_ascii, item_sep, key_sep, out);
      }
      newline(depth);
      out += "]";
      return;
    }
    case Value::Kind::object: {
      if (v.fields().empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& e : v.fields()) entries.push_back(&e);
      if (sort_keys)
        std::stable_sort(entries.begin(), entries.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      out += "{";
      for (std::size_t i = 0; i < entries.size(); ++i) {
        if (i) out += item_sep;
        newline(depth + 1);
        json_string(entries[i]->first, ensure_ascii, out);
        out += key_sep;
        dump(entries[i]->second, indent, depth + 1, sort_keys, ensure_ascii, item_sep, key_sep,
             out);
      }
      newline(depth);
      out += "}";
      return;
    }
    default:
      throw std::invalid_argument("Object of type " + v.type_name() + " is not JSON serializable");
  }
}

}  // namespace

std::string to_json_text(const Value& v, int indent, bool sort_keys, bool ensure_ascii,
                         const std::string& item_separator, const std::string& key_separator) {
  std::string out;
  const std::string item = !item_separator.empty() ? item_separator : indent >= 0 ? "," : ", ";
  const std::string key = !key_separator.empty() ? key_separator : ": ";
  dump(v, indent, 0, sort_keys, ensure_ascii, item, key, out);
  return out;
}

}  // namespace quanta::llm::jinja
