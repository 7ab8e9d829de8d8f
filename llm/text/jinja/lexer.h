#pragma once
// A template's source as tokens: text between tags, and the names,
// literals and operators inside {{ }} and {% %}, with Jinja's whitespace
// control applied as transformers configures it (trim_blocks,
// lstrip_blocks, "-" and "+" marks). Comments are dropped, raw blocks
// become text.
#include <cstdint>
#include <string>
#include <vector>

namespace quanta::llm::jinja {

struct Token {
  enum class Kind { text, print_begin, block_begin, end, name, integer, number, string, op, eof };
  Kind kind = Kind::eof;
  std::string text;  // text, name, operator or string value
  int64_t integer = 0;
  double number = 0;
  int line = 1;
};

/** Throws TemplateError naming the line of an unclosed tag or string, or a
 * character no expression has. */
std::vector<Token> lex(const std::string& source);

}  // namespace quanta::llm::jinja
