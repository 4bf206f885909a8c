// Evaluates a parsed template: scopes, control flow, macros and limits.
#pragma once

#include <memory>
#include <string>
#include <unordered_map>

#include "formats/jinja/ast.h"
#include "formats/jinja/template.h"

namespace dflash::jinja {

struct Scope {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Scope> parent;
  const Value* lookup(const std::string& name) const;
};

class Interpreter {
 public:
  explicit Interpreter(const RenderLimits& limits) : limits_(limits) {}

  std::string render(const Body& body, const std::shared_ptr<Scope>& scope);
  Value eval(const Expr& e, const std::shared_ptr<Scope>& scope);
  Value call(const Value& fn, CallArgs& args, int line);
  void step();
  void check_size(size_t n) const;

 private:
  enum class Flow { Normal, Break, Continue };
  Flow exec(const Body& body, const std::shared_ptr<Scope>& scope, std::string& out);
  Flow exec_for(const Stmt& s, const std::shared_ptr<Scope>& scope, std::string& out);
  Value binary(const Expr& e, const std::shared_ptr<Scope>& scope);
  // Evaluated arguments of a call, filter or test: args[1..] and kwargs.
  CallArgs eval_args(const Expr& e, const std::shared_ptr<Scope>& scope);
  Value make_macro(const Stmt& s, const std::shared_ptr<Scope>& scope);

  RenderLimits limits_;
  int64_t steps_ = 0;
  int call_depth_ = 0;
};

}  // namespace dflash::jinja
