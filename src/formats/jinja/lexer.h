// Template source -> tokens, with jinja2's whitespace rules under Hugging
// Face's settings: trim_blocks, lstrip_blocks, newlines normalized to "\n",
// one trailing newline dropped, "-" and "+" whitespace control.
#pragma once

#include <string>
#include <vector>

namespace dflash::jinja {

struct Token {
  enum class Type { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, End };
  Type type;
  std::string text;  // data, name, operator, or the decoded string literal
  int line = 1;
};

std::vector<Token> tokenize(const std::string& source);

// Python's str.isspace() for one code point.
bool py_isspace(char32_t c);

}  // namespace dflash::jinja
