#pragma once
// A parsed template: expression and statement nodes, each evaluating or
// rendering itself against a Context (evaluate.cpp).
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "llm/text/jinja/value.h"

namespace quanta::llm::jinja {

struct Context;

struct Expr {
  int line = 0;
  virtual ~Expr() = default;
  virtual Value eval(Context& c) const = 0;
};
using ExprPtr = std::unique_ptr<Expr>;

struct Stmt {
  int line = 0;
  virtual ~Stmt() = default;
  virtual void run(Context& c) const = 0;
};
using Body = std::vector<std::unique_ptr<Stmt>>;

// Positional and keyword argument expressions of a call, filter or test.
struct ArgExprs {
  std::vector<ExprPtr> positional;
  std::vector<std::pair<std::string, ExprPtr>> keywords;
  Arguments eval(Context& c) const;
};

struct Literal : Expr {
  Value value;
  Value eval(Context& c) const override;
};
struct Name : Expr {
  std::string name;
  Value eval(Context& c) const override;
};
struct ListLiteral : Expr {
  std::vector<ExprPtr> items;
  bool tuple = false;
  Value eval(Context& c) const override;
};
struct DictLiteral : Expr {
  std::vector<std::pair<ExprPtr, ExprPtr>> entries;
  Value eval(Context& c) const override;
};
struct Attribute : Expr {
  ExprPtr object;
  std::string name;
  Value eval(Context& c) const override;
};
struct Item : Expr {
  ExprPtr object, key;
  Value eval(Context& c) const override;
};
struct Slice : Expr {
  ExprPtr object, start, stop, step;  // each may be null
  Value eval(Context& c) const override;
};
struct Call : Expr {
  ExprPtr callee;
  ArgExprs args;
  Value eval(Context& c) const override;
};
struct Filter : Expr {
  ExprPtr value;
  std::string name;
  ArgExprs args;
  Value eval(Context& c) const override;
};
struct Test : Expr {
  ExprPtr value;
  std::string name;
  ArgExprs args;
  bool negated = false;
  Value eval(Context& c) const override;
};
struct Unary : Expr {
  char op = '-';  // '-', '+' or '!' (not)
  ExprPtr operand;
  Value eval(Context& c) const override;
};
struct Binary : Expr {
  std::string op;  // + - * / // % ** ~ and or
  ExprPtr left, right;
  Value eval(Context& c) const override;
};
struct Compare : Expr {
  ExprPtr first;
  std::vector<std::pair<std::string, ExprPtr>> rest;  // == != < > <= >= in notin
  Value eval(Context& c) const override;
};
struct Conditional : Expr {
  ExprPtr condition, then, otherwise;  // otherwise may be null
  Value eval(Context& c) const override;
};

struct Text : Stmt {
  std::string text;
  void run(Context& c) const override;
};
struct Print : Stmt {
  ExprPtr value;
  void run(Context& c) const override;
};
struct If : Stmt {
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body otherwise;
  void run(Context& c) const override;
};
struct For : Stmt {
  std::vector<std::string> targets;
  ExprPtr iterable, filter;  // filter may be null
  Body body, otherwise;
  void run(Context& c) const override;
};
struct Set : Stmt {
  std::vector<std::string> targets;  // names, or
  ExprPtr name_space;                // a namespace's
  std::string attribute;             // attribute
  ExprPtr value;                     // null: the block's output,
  Body block;
  std::vector<std::pair<std::string, ArgExprs>> block_filters;  // through these
  void run(Context& c) const override;
};
struct Macro : Stmt {
  std::string name;
  std::vector<std::pair<std::string, ExprPtr>> parameters;  // default may be null
  Body body;
  void run(Context& c) const override;
};
struct LoopControl : Stmt {
  bool is_break = true;
  void run(Context& c) const override;
};
// A statement Jinja parses but transformers' environment cannot run
// ({% include %}: no loader): an error when reached.
struct Refused : Stmt {
  std::string what;
  void run(Context& c) const override;
};
struct Generation : Stmt {
  Body body;
  void run(Context& c) const override;
};

/** Parses lexed tokens into the template's top-level body. */
Body parse(const std::string& source);

}  // namespace quanta::llm::jinja
