// The template's tokens as nodes, by Jinja2's grammar and precedence:
// conditional < or < and < not < comparisons < + - < ~ < * / // % < ** <
// unary - + < postfix (. [] ()) with filters and tests.
#include <algorithm>

#include "llm/text/jinja/lexer.h"
#include "llm/text/jinja/nodes.h"
#include "llm/text/jinja/template.h"

namespace quanta::llm::jinja {

namespace {

using K = Token::Kind;

template <class T>
std::unique_ptr<T> node(int line) {
  auto n = std::make_unique<T>();
  n->line = line;
  return n;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  Body top() {
    std::string ended;
    Body b = body({}, &ended);
    return b;
  }

 private:
  const Token& peek(std::size_t ahead = 0) const { return t_[std::min(i_ + ahead, t_.size() - 1)]; }
  const Token& next() { return t_[std::min(i_++, t_.size() - 1)]; }
  bool at_op(const char* op) const { return peek().kind == K::op && peek().text == op; }
  bool at_name(const char* name) const { return peek().kind == K::name && peek().text == name; }
  bool skip_op(const char* op) {
    if (!at_op(op)) return false;
    ++i_;
    return true;
  }
  bool skip_name(const char* name) {
    if (!at_name(name)) return false;
    ++i_;
    return true;
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw TemplateError("template line " + std::to_string(peek().line) + ": " + what);
  }
  std::string describe(const Token& t) const {
    switch (t.kind) {
      case K::end:
        return "the end of the tag";
      case K::eof:
        return "the end of the template";
      case K::text:
        return "text";
      case K::string:
        return "a string";
      case K::integer:
      case K::number:
        return "a number";
      default:
        return "'" + t.text + "'";
    }
  }
  void expect_op(const char* op) {
    if (!skip_op(op)) fail(std::string("expected '") + op + "', found " + describe(peek()));
  }
  void expect_end() {
    if (peek().kind != K::end) fail("expected the end of the tag, found " + describe(peek()));
    ++i_;
  }
  std::string expect_name(const char* what) {
    if (peek().kind != K::name)
      fail(std::string("expected ") + what + ", found " + describe(peek()));
    return next().text;
  }

  // Statements until a block tag named in `ends` (its name left in *ended,
  // the tag's name token consumed) or the end of the template.
  Body body(const std::vector<std::string>& ends, std::string* ended) {
    Body b;
    while (true) {
      const Token& tk = peek();
      if (tk.kind == K::eof) {
        if (!ends.empty())
          fail("the template ends inside a block: expected {% " + ends.front() + " %}");
        return b;
      }
      if (tk.kind == K::text) {
        auto s = node<Text>(tk.line);
        s->text = next().text;
        b.push_back(std::move(s));
        continue;
      }
      if (tk.kind == K::print_begin) {
        ++i_;
        auto s = node<Print>(tk.line);
        s->value = tuple_or_expression();
        expect_end();
        b.push_back(std::move(s));
        continue;
      }
      if (tk.kind != K::block_begin) fail("unexpected " + describe(tk));
      ++i_;
      const int line = peek().line;
      const std::string keyword = expect_name("a statement");
      if (std::find(ends.begin(), ends.end(), keyword) != ends.end()) {
        *ended = keyword;
        return b;
      }
      b.push_back(statement(keyword, line));
    }
  }

  std::unique_ptr<Stmt> statement(const std::string& keyword, int line) {
    if (keyword == "if") return if_statement(line);
    if (keyword == "for") return for_statement(line);
    if (keyword == "set") return set_statement(line);
    if (keyword == "macro") return macro_statement(line);
    if (keyword == "break" || keyword == "continue") {
      auto s = node<LoopControl>(line);
      s->is_break = keyword == "break";
      expect_end();
      return s;
    }
    if (keyword == "generation") {
      expect_end();
      auto s = node<Generation>(line);
      std::string ended;
      s->body = body({"endgeneration"}, &ended);
      expect_end();
      return s;
    }
    if (keyword == "include" || keyword == "import" || keyword == "from" || keyword == "extends") {
      // Parsed as Jinja parses them; they fail when reached, as they do
      // without a template loader.
      while (peek().kind != K::end && peek().kind != K::eof) ++i_;
      expect_end();
      auto s = node<Refused>(line);
      s->what =
          "{% " + keyword + " %} is not supported in chat templates (no other templates to load)";
      return s;
    }
    static const std::vector<std::string> unsupported = {"block",      "call", "filter", "with",
                                                         "autoescape", "do",   "trans"};
    if (std::find(unsupported.begin(), unsupported.end(), keyword) != unsupported.end())
      fail("{% " + keyword + " %} is not supported in chat templates");
    fail("unknown statement '" + keyword + "'");
  }

  std::unique_ptr<Stmt> if_statement(int line) {
    auto s = node<If>(line);
    ExprPtr condition = tuple_or_expression();
    expect_end();
    while (true) {
      std::string ended;
      Body b = body({"elif", "else", "endif"}, &ended);
      s->branches.emplace_back(std::move(condition), std::move(b));
      if (ended == "elif") {
        condition = tuple_or_expression();
        expect_end();
        continue;
      }
      if (ended == "else") {
        expect_end();
        s->otherwise = body({"endif"}, &ended);
      }
      expect_end();
      return s;
    }
  }

  std::vector<std::string> targets() {
    std::vector<std::string> names;
    const bool parens = skip_op("(");
    do {
      names.push_back(expect_name("a variable name"));
    } while (skip_op(","));
    if (parens) expect_op(")");
    return names;
  }

  std::unique_ptr<Stmt> for_statement(int line) {
    auto s = node<For>(line);
    s->targets = targets();
    if (!skip_name("in")) fail("expected 'in' in a for loop, found " + describe(peek()));
    s->iterable = tuple_or_expression(/*stop_at_if=*/true);
    if (skip_name("if")) s->filter = expression(false);
    if (at_name("recursive")) fail("recursive for loops are not supported in chat templates");
    expect_end();
    std::string ended;
    s->body = body({"else", "endfor"}, &ended);
    if (ended == "else") {
      expect_end();
      s->otherwise = body({"endfor"}, &ended);
    }
    expect_end();
    return s;
  }

  std::unique_ptr<Stmt> set_statement(int line) {
    auto s = node<Set>(line);
    if (peek().kind == K::name && peek(1).kind == K::op && peek(1).text == ".") {
      auto ns = node<Name>(peek().line);
      ns->name = next().text;
      ++i_;  // '.'
      s->name_space = std::move(ns);
      s->attribute = expect_name("an attribute name");
    } else {
      s->targets = targets();
    }
    if (skip_op("=")) {
      s->value = tuple_or_expression();
      expect_end();
      return s;
    }
    while (!s->name_space && s->targets.size() == 1 && skip_op("|")) {
      std::string f = expect_name("a filter name");
      ArgExprs args;
      if (skip_op("(")) args = call_arguments();
      s->block_filters.emplace_back(std::move(f), std::move(args));
    }
    if (!s->name_space && s->targets.size() == 1 && peek().kind == K::end) {
      ++i_;
      std::string ended;
      s->block = body({"endset"}, &ended);
      expect_end();
      return s;
    }
    fail("expected '=' in a set, found " + describe(peek()));
  }

  std::unique_ptr<Stmt> macro_statement(int line) {
    auto s = node<Macro>(line);
    s->name = expect_name("a macro name");
    expect_op("(");
    if (!at_op(")")) {
      do {
        std::string p = expect_name("a parameter name");
        ExprPtr d;
        if (skip_op("=")) d = expression(true);
        s->parameters.emplace_back(std::move(p), std::move(d));
      } while (skip_op(","));
    }
    expect_op(")");
    expect_end();
    std::string ended;
    s->body = body({"endmacro"}, &ended);
    if (peek().kind == K::name) ++i_;  // {% endmacro name %}
    expect_end();
    return s;
  }

  // An expression, or several separated by commas: a tuple.
  ExprPtr tuple_or_expression(bool stop_at_if = false) {
    const int line = peek().line;
    ExprPtr first = expression(!stop_at_if);
    if (!at_op(",")) return first;
    auto t = node<ListLiteral>(line);
    t->tuple = true;
    t->items.push_back(std::move(first));
    while (skip_op(",")) {
      if (peek().kind == K::end || at_op(")") || (stop_at_if && at_name("if"))) break;
      t->items.push_back(expression(!stop_at_if));
    }
    return t;
  }

  ExprPtr expression(bool conditional = true) {
    const int line = peek().line;
    ExprPtr e = or_expression();
    if (conditional && skip_name("if")) {
      auto c = node<Conditional>(line);
      c->then = std::move(e);
      c->condition = or_expression();
      if (skip_name("else")) c->otherwise = expression(true);
      return c;
    }
    return e;
  }

  ExprPtr binary(const std::string& op, ExprPtr left, ExprPtr right, int line) {
    auto b = node<Binary>(line);
    b->op = op;
    b->left = std::move(left);
    b->right = std::move(right);
    return b;
  }

  ExprPtr or_expression() {
    ExprPtr e = and_expression();
    while (at_name("or")) {
      const int line = next().line;
      e = binary("or", std::move(e), and_expression(), line);
    }
    return e;
  }
  ExprPtr and_expression() {
    ExprPtr e = not_expression();
    while (at_name("and")) {
      const int line = next().line;
      e = binary("and", std::move(e), not_expression(), line);
    }
    return e;
  }
  ExprPtr not_expression() {
    if (at_name("not")) {
      auto u = node<Unary>(next().line);
      u->op = '!';
      u->operand = not_expression();
      return u;
    }
    return comparison();
  }
  ExprPtr comparison() {
    const int line = peek().line;
    ExprPtr first = sum();
    std::vector<std::pair<std::string, ExprPtr>> rest;
    while (true) {
      std::string op;
      if (peek().kind == K::op &&
          (peek().text == "==" || peek().text == "!=" || peek().text == "<" || peek().text == ">" ||
           peek().text == "<=" || peek().text == ">=")) {
        op = next().text;
      } else if (at_name("in")) {
        ++i_;
        op = "in";
      } else if (at_name("not") && peek(1).kind == K::name && peek(1).text == "in") {
        i_ += 2;
        op = "notin";
      } else {
        break;
      }
      rest.emplace_back(op, sum());
    }
    if (rest.empty()) return first;
    auto c = node<Compare>(line);
    c->first = std::move(first);
    c->rest = std::move(rest);
    return c;
  }
  ExprPtr sum() {
    ExprPtr e = concatenation();
    while (at_op("+") || at_op("-")) {
      const Token& op = next();
      e = binary(op.text, std::move(e), concatenation(), op.line);
    }
    return e;
  }
  ExprPtr concatenation() {
    ExprPtr e = product();
    while (at_op("~")) {
      const int line = next().line;
      e = binary("~", std::move(e), product(), line);
    }
    return e;
  }
  ExprPtr product() {
    ExprPtr e = power();
    while (at_op("*") || at_op("/") || at_op("//") || at_op("%")) {
      const Token& op = next();
      e = binary(op.text, std::move(e), power(), op.line);
    }
    return e;
  }
  ExprPtr power() {
    ExprPtr e = unary(true);
    while (at_op("**")) {
      const int line = next().line;
      e = binary("**", std::move(e), unary(true), line);
    }
    return e;
  }
  ExprPtr unary(bool with_filters) {
    ExprPtr e;
    if (at_op("-") || at_op("+")) {
      auto u = node<Unary>(peek().line);
      u->op = next().text[0];
      u->operand = unary(false);
      e = std::move(u);
    } else {
      e = postfix(primary());
    }
    return with_filters ? filters(std::move(e)) : std::move(e);
  }

  ExprPtr primary() {
    const Token& tk = peek();
    const int line = tk.line;
    if (tk.kind == K::name) {
      const std::string n = next().text;
      auto lit = node<Literal>(line);
      if (n == "true" || n == "True") {
        lit->value = Value(true);
      } else if (n == "false" || n == "False") {
        lit->value = Value(false);
      } else if (n == "none" || n == "None") {
        lit->value = Value::none();
      } else {
        auto name = node<Name>(line);
        name->name = n;
        return name;
      }
      return lit;
    }
    if (tk.kind == K::string) {
      std::string s = next().text;
      while (peek().kind == K::string) s += next().text;  // adjacent literals join
      auto lit = node<Literal>(line);
      lit->value = Value(std::move(s));
      return lit;
    }
    if (tk.kind == K::integer || tk.kind == K::number) {
      auto lit = node<Literal>(line);
      lit->value = tk.kind == K::integer ? Value(tk.integer) : Value(tk.number);
      ++i_;
      return lit;
    }
    if (skip_op("(")) {
      if (skip_op(")")) {
        auto t = node<ListLiteral>(line);
        t->tuple = true;
        return t;
      }
      ExprPtr e = expression(true);
      if (at_op(",")) {
        auto t = node<ListLiteral>(line);
        t->tuple = true;
        t->items.push_back(std::move(e));
        while (skip_op(",") && !at_op(")")) t->items.push_back(expression(true));
        e = std::move(t);
      }
      expect_op(")");
      return e;
    }
    if (skip_op("[")) {
      auto l = node<ListLiteral>(line);
      while (!at_op("]")) {
        l->items.push_back(expression(true));
        if (!skip_op(",")) break;
      }
      expect_op("]");
      return l;
    }
    if (skip_op("{")) {
      auto d = node<DictLiteral>(line);
      while (!at_op("}")) {
        ExprPtr k = expression(true);
        expect_op(":");
        d->entries.emplace_back(std::move(k), expression(true));
        if (!skip_op(",")) break;
      }
      expect_op("}");
      return d;
    }
    fail("unexpected " + describe(tk) + " in an expression");
  }

  ArgExprs call_arguments() {
    ArgExprs a;
    while (!at_op(")")) {
      if (at_op("*") || at_op("**")) fail("*args and **kwargs are not supported in chat templates");
      if (peek().kind == K::name && peek(1).kind == K::op && peek(1).text == "=") {
        std::string k = next().text;
        ++i_;
        a.keywords.emplace_back(std::move(k), expression(true));
      } else {
        if (!a.keywords.empty()) fail("a positional argument follows a keyword argument");
        a.positional.push_back(expression(true));
      }
      if (!skip_op(",")) break;
    }
    expect_op(")");
    return a;
  }

  ExprPtr postfix(ExprPtr e) {
    while (true) {
      const int line = peek().line;
      if (skip_op(".")) {
        if (peek().kind == K::integer) {
          auto it = node<Item>(line);
          auto k = node<Literal>(line);
          k->value = Value(next().integer);
          it->object = std::move(e);
          it->key = std::move(k);
          e = std::move(it);
          continue;
        }
        auto a = node<Attribute>(line);
        a->object = std::move(e);
        a->name = expect_name("an attribute name");
        e = std::move(a);
      } else if (skip_op("[")) {
        e = subscript(std::move(e), line);
      } else if (skip_op("(")) {
        auto c = node<Call>(line);
        c->callee = std::move(e);
        c->args = call_arguments();
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  ExprPtr subscript(ExprPtr object, int line) {
    ExprPtr parts[3];
    int colons = 0;
    if (!at_op(":")) parts[0] = expression(true);
    while (colons < 2 && skip_op(":")) {
      ++colons;
      if (!at_op(":") && !at_op("]")) parts[colons] = expression(true);
    }
    expect_op("]");
    if (colons == 0) {
      if (!parts[0]) fail("an empty subscript");
      auto it = node<Item>(line);
      it->object = std::move(object);
      it->key = std::move(parts[0]);
      return it;
    }
    auto s = node<Slice>(line);
    s->object = std::move(object);
    s->start = std::move(parts[0]);
    s->stop = std::move(parts[1]);
    s->step = std::move(parts[2]);
    return s;
  }

  ExprPtr filters(ExprPtr e) {
    while (true) {
      const int line = peek().line;
      if (skip_op("|")) {
        auto f = node<Filter>(line);
        f->value = std::move(e);
        f->name = expect_name("a filter name");
        if (skip_op("(")) f->args = call_arguments();
        e = std::move(f);
      } else if (skip_name("is")) {
        auto t = node<Test>(line);
        t->value = std::move(e);
        t->negated = skip_name("not");
        t->name = expect_name("a test name");
        if (skip_op("(")) {
          t->args = call_arguments();
        } else {
          const Token& tk = peek();
          const bool word = tk.kind == K::name && tk.text != "else" && tk.text != "or" &&
                            tk.text != "and" && tk.text != "if" && tk.text != "in" &&
                            tk.text != "is" && tk.text != "not";
          if (word || tk.kind == K::string || tk.kind == K::integer || tk.kind == K::number ||
              (tk.kind == K::op && (tk.text == "[" || tk.text == "{")))
            t->args.positional.push_back(postfix(primary()));
        }
        e = std::move(t);
      } else if (skip_op("(")) {
        auto c = node<Call>(line);
        c->callee = std::move(e);
        c->args = call_arguments();
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  std::vector<Token> t_;
  std::size_t i_ = 0;
};

}  // namespace

Body parse(const std::string& source) { return Parser(lex(source)).top(); }

}  // namespace quanta::llm::jinja
