// Syntax tree of a parsed template.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "formats/jinja/value.h"

namespace dflash::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    Literal,   // value
    Name,      // name
    Attr,      // a.name
    Item,      // a[b]
    Slice,     // a[b:c:d] (null parts allowed)
    Call,      // a(args, kwargs)
    Filter,    // a | name(args, kwargs)
    Test,      // a is [not] name(args)
    Unary,     // op a   ("-", "+", "not")
    Binary,    // a op b (+ - * / // % ** ~ and or in, "not in")
    Compare,   // a op b op c ...
    Cond,      // a if b else c
    List,      // [items]
    Tuple,     // (items)
    Dict,      // {k: v}
  };
  Kind kind{};
  int line = 0;
  std::string name;  // Name, Attr, Filter, Test, operator
  bool negated = false;  // Test
  Value value;           // Literal
  std::vector<ExprPtr> args;  // operands, items (Dict: k0, v0, k1, v1...)
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;  // Compare
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

struct Stmt {
  enum class Kind { Text, Output, If, For, Set, SetBlock, Macro, Break, Continue, FilterBlock, With, Generation };
  Kind kind{};
  int line = 0;
  std::string text;                    // Text; Set/SetBlock/Macro name; FilterBlock filter name
  std::string attr;                    // Set: ns.attr target
  std::vector<std::string> targets;    // For / Set unpacking
  ExprPtr expr;                        // Output; For iterable; Set value; If: unused
  ExprPtr filter;                      // For ... if cond; FilterBlock: the Filter expr (operand unused)
  std::vector<std::pair<ExprPtr, Body>> branches;  // If/elif conditions and bodies
  Body body, else_body;
  std::vector<std::pair<std::string, ExprPtr>> params;  // Macro params with defaults; With assignments
};

}  // namespace dflash::jinja
