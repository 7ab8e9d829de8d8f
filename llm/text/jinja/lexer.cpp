#include "llm/text/jinja/lexer.h"

#include <cctype>
#include <cstring>

#include "llm/text/jinja/template.h"
#include "llm/text/jinja/value.h"

namespace quanta::llm::jinja {

namespace {

bool blank(char c) { return c == ' ' || c == '\t'; }
bool space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

class Lexer {
 public:
  explicit Lexer(const std::string& s) : s_(s) {}

  std::vector<Token> run() {
    bool line_starting = true;  // the text ahead starts a line
    bool trim_next = false;     // a "-" closed the tag before: strip what follows
    bool newline_next = false;  // a block or comment closed: drop one newline
    while (pos_ < s_.size()) {
      const std::size_t tag = next_tag(pos_);
      std::string text = s_.substr(pos_, tag - pos_);
      // What the tag before asked of this text.
      if (trim_next) {
        std::size_t k = 0;
        while (k < text.size() && space(text[k])) ++k;
        text.erase(0, k);
      } else if (newline_next && !text.empty() && text[0] == '\n') {
        text.erase(0, 1);
      }
      if (tag == s_.size()) {
        emit_text(text);
        break;
      }
      const char type = s_[tag + 1];  // '{', '%' or '#'
      const char sign = tag + 2 < s_.size() ? s_[tag + 2] : '\0';
      if (sign == '-') {
        std::size_t k = text.size();
        while (k > 0 && space(text[k - 1])) --k;
        text.resize(k);
      } else if (sign != '+' && type != '{') {
        // lstrip_blocks: a block or comment alone on its line takes the
        // line's indentation with it.
        const std::size_t nl = text.rfind('\n');
        const std::size_t from = nl == std::string::npos ? 0 : nl + 1;
        if (nl != std::string::npos || line_starting) {
          bool only_blank = true;
          for (std::size_t k = from; k < text.size(); ++k)
            only_blank = only_blank && blank(text[k]);
          if (only_blank) text.resize(from);
        }
      }
      emit_text(text);
      pos_ = tag + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      bool strip_after = false;
      if (type == '#') {
        const std::size_t end = s_.find("#}", pos_);
        if (end == std::string::npos) fail("an unclosed comment", line_at(tag));
        strip_after = end > pos_ && s_[end - 1] == '-';
        pos_ = end + 2;
      } else {
        Token begin;
        begin.kind = type == '{' ? Token::Kind::print_begin : Token::Kind::block_begin;
        begin.line = line_at(tag);
        const std::size_t first = tokens_.size();
        tokens_.push_back(begin);
        strip_after = expression(type == '{' ? '}' : '%');
        if (type == '%' && tokens_.size() == first + 3 && tokens_[first + 1].text == "raw" &&
            tokens_[first + 1].kind == Token::Kind::name) {
          tokens_.resize(first);
          strip_after = raw(strip_after);
        }
      }
      trim_next = strip_after;
      newline_next = type != '{';
      // Whether the text after this tag starts a line (for lstrip_blocks).
      line_starting = false;
      if (strip_after) {
        std::size_t k = pos_;
        while (k < s_.size() && space(s_[k])) ++k;
        line_starting = k > pos_ && s_[k - 1] == '\n';
      } else if (newline_next && pos_ < s_.size() && s_[pos_] == '\n') {
        line_starting = true;
      }
    }
    Token eof;
    eof.line = line_at(s_.size());
    tokens_.push_back(eof);
    return std::move(tokens_);
  }

 private:
  std::size_t next_tag(std::size_t from) const {
    for (std::size_t k = from; k + 1 < s_.size(); ++k)
      if (s_[k] == '{' && (s_[k + 1] == '{' || s_[k + 1] == '%' || s_[k + 1] == '#')) return k;
    return s_.size();
  }

  int line_at(std::size_t at) const {
    int line = 1;
    for (std::size_t k = 0; k < at && k < s_.size(); ++k) line += s_[k] == '\n';
    return line;
  }

  [[noreturn]] void fail(const std::string& what, int line) const {
    throw TemplateError("template line " + std::to_string(line) + ": " + what);
  }

  void emit_text(const std::string& text) {
    if (text.empty()) return;
    Token t;
    t.kind = Token::Kind::text;
    t.text = text;
    tokens_.push_back(std::move(t));
  }

  // Tokens up to the tag's close ("}}" or "%}"); returns whether it was
  // "-}}" / "-%}".
  bool expression(char close) {
    const int line = line_at(pos_);
    int depth = 0;  // brackets open: "}}" inside a dict literal closes the dict
    while (true) {
      while (pos_ < s_.size() && space(s_[pos_])) ++pos_;
      if (pos_ >= s_.size()) fail("an unclosed tag", line);
      const char c = s_[pos_];
      if (depth == 0 && c == '-' && pos_ + 2 < s_.size() && s_[pos_ + 1] == close &&
          s_[pos_ + 2] == '}') {
        pos_ += 3;
        push_end(line);
        return true;
      }
      if (depth == 0 && c == '+' && pos_ + 2 < s_.size() && s_[pos_ + 1] == close &&
          s_[pos_ + 2] == '}') {
        pos_ += 3;
        push_end(line);
        return false;
      }
      if (depth == 0 && c == close && pos_ + 1 < s_.size() && s_[pos_ + 1] == '}') {
        pos_ += 2;
        push_end(line);
        return false;
      }
      Token t;
      t.line = line_at(pos_);
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        const std::size_t b = pos_;
        while (pos_ < s_.size() &&
               (std::isalnum(static_cast<unsigned char>(s_[pos_])) || s_[pos_] == '_'))
          ++pos_;
        t.kind = Token::Kind::name;
        t.text = s_.substr(b, pos_ - b);
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        number(t);
      } else if (c == '\'' || c == '"') {
        t.kind = Token::Kind::string;
        t.text = string_literal(c, t.line);
      } else {
        static const char* const two[] = {"**", "//", "==", "!=", "<=", ">="};
        t.kind = Token::Kind::op;
        for (const char* op : two)
          if (s_.compare(pos_, 2, op) == 0) t.text = op;
        if (t.text.empty()) {
          if (!std::strchr("+-*/%~<>=()[]{},.:|", c))
            fail(std::string("unexpected character '") + c + "'", t.line);
          t.text = std::string(1, c);
          if (c == '(' || c == '[' || c == '{') ++depth;
          if ((c == ')' || c == ']' || c == '}') && depth > 0) --depth;
        }
        pos_ += t.text.size();
      }
      tokens_.push_back(std::move(t));
    }
  }

  void push_end(int line) {
    Token t;
    t.kind = Token::Kind::end;
    t.line = line;
    tokens_.push_back(t);
  }

  void number(Token& t) {
    const std::size_t b = pos_;
    while (pos_ < s_.size() &&
           (std::isdigit(static_cast<unsigned char>(s_[pos_])) || s_[pos_] == '_'))
      ++pos_;
    bool fraction = false;
    if (pos_ + 1 < s_.size() && s_[pos_] == '.' &&
        std::isdigit(static_cast<unsigned char>(s_[pos_ + 1]))) {
      fraction = true;
      ++pos_;
      while (pos_ < s_.size() &&
             (std::isdigit(static_cast<unsigned char>(s_[pos_])) || s_[pos_] == '_'))
        ++pos_;
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      std::size_t k = pos_ + 1;
      if (k < s_.size() && (s_[k] == '+' || s_[k] == '-')) ++k;
      if (k < s_.size() && std::isdigit(static_cast<unsigned char>(s_[k]))) {
        fraction = true;
        pos_ = k;
        while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_]))) ++pos_;
      }
    }
    std::string digits = s_.substr(b, pos_ - b);
    std::erase(digits, '_');
    if (fraction) {
      t.kind = Token::Kind::number;
      t.number = std::stod(digits);
    } else {
      t.kind = Token::Kind::integer;
      try {
        t.integer = std::stoll(digits);
      } catch (const std::exception&) {
        fail("the integer " + digits + " is too large", t.line);
      }
    }
  }

  std::string string_literal(char quote, int line) {
    ++pos_;
    std::string out;
    while (true) {
      if (pos_ >= s_.size()) fail("an unclosed string", line);
      const char c = s_[pos_++];
      if (c == quote) return out;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= s_.size()) fail("an unclosed string", line);
      const char e = s_[pos_++];
      switch (e) {
        case 'n':
          out += '\n';
          break;
        case 't':
          out += '\t';
          break;
        case 'r':
          out += '\r';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'v':
          out += '\v';
          break;
        case 'a':
          out += '\a';
          break;
        case '0':
          out += '\0';
          break;
        case '\\':
          out += '\\';
          break;
        case '\'':
          out += '\'';
          break;
        case '"':
          out += '"';
          break;
        case '\n':
          break;
        case 'x':
        case 'u':
        case 'U': {
          const std::size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          if (pos_ + n > s_.size()) fail("a bad \\" + std::string(1, e) + " escape", line);
          const std::string hex = s_.substr(pos_, n);
          for (char h : hex)
            if (!std::isxdigit(static_cast<unsigned char>(h)))
              fail("a bad \\" + std::string(1, e) + " escape", line);
          pos_ += n;
          out += utf8(std::u32string(1, static_cast<char32_t>(std::stoul(hex, nullptr, 16))));
          break;
        }
        default:  // Python keeps an unknown escape as written
          out += '\\';
          out += e;
      }
    }
  }

  // {% raw %} ... {% endraw %}: the text between, as written.
  bool raw(bool strip_after_open) {
    std::size_t k = pos_;
    while (true) {
      const std::size_t open = s_.find("{%", k);
      if (open == std::string::npos) fail("{% raw %} without {% endraw %}", line_at(pos_));
      std::size_t j = open + 2;
      const bool strip_before = j < s_.size() && s_[j] == '-';
      if (j < s_.size() && (s_[j] == '-' || s_[j] == '+')) ++j;
      while (j < s_.size() && space(s_[j])) ++j;
      if (s_.compare(j, 6, "endraw") != 0) {
        k = open + 2;
        continue;
      }
      j += 6;
      while (j < s_.size() && space(s_[j])) ++j;
      bool strip_after = false;
      if (j < s_.size() && (s_[j] == '-' || s_[j] == '+')) strip_after = s_[j++] == '-';
      if (s_.compare(j, 2, "%}") != 0) fail("a malformed {% endraw %}", line_at(j));
      std::string text = s_.substr(pos_, open - pos_);
      if (strip_after_open) {
        std::size_t b = 0;
        while (b < text.size() && space(text[b])) ++b;
        text.erase(0, b);
      } else if (!text.empty() && text[0] == '\n') {
        text.erase(0, 1);
      }
      if (strip_before) {
        std::size_t e = text.size();
        while (e > 0 && space(text[e - 1])) --e;
        text.resize(e);
      }
      emit_text(text);
      pos_ = j + 2;
      return strip_after;
    }
  }

  const std::string& s_;
  std::size_t pos_ = 0;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> lex(const std::string& source) {
  // As Jinja 3 reads a source: every line break (\r\n, \r, \n) as \n,
  // so a template saved with Windows line ends renders the same, and
  // keep_trailing_newline off (its default): one final newline goes.
  std::string s;
  s.reserve(source.size());
  for (std::size_t k = 0; k < source.size(); ++k) {
    if (source[k] != '\r') {
      s += source[k];
      continue;
    }
    s += '\n';
    if (k + 1 < source.size() && source[k + 1] == '\n') ++k;
  }
  if (!s.empty() && s.back() == '\n') s.pop_back();
  return Lexer(s).run();
}

}  // namespace quanta::llm::jinja
