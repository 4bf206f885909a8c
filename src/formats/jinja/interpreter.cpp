#include "formats/jinja/interpreter.h"

#include <cmath>
#include <ctime>

#include "formats/jinja/builtins.h"
#include "formats/jinja/parser.h"
#include "util/error.h"

namespace dflash::jinja {

namespace {

[[noreturn]] void fail_at(int line, const std::string& msg) { throw Error(cat("template line ", line, ": ", msg)); }

// a op b on int64 with Python's result or an overflow error.
template <typename F>
int64_t checked(F op, int64_t a, int64_t b, int line) {
  int64_t v = 0;
  if (op(a, b, &v)) fail_at(line, "integer overflow");
  return v;
}
const auto add_ov = [](int64_t a, int64_t b, int64_t* r) { return __builtin_add_overflow(a, b, r); };
const auto sub_ov = [](int64_t a, int64_t b, int64_t* r) { return __builtin_sub_overflow(a, b, r); };
const auto mul_ov = [](int64_t a, int64_t b, int64_t* r) { return __builtin_mul_overflow(a, b, r); };

int64_t floordiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

// Errors from built-ins get the template line; errors already located pass through.
[[noreturn]] void rethrow_at(int line, const std::string& prefix, const Error& e) {
  const std::string m = e.what();
  if (m.rfind("template", 0) == 0) throw e;
  fail_at(line, prefix + m);
}

}  // namespace

CallArgs Interpreter::eval_args(const Expr& e, const std::shared_ptr<Scope>& scope) {
  CallArgs a;
  for (size_t k = 1; k < e.args.size(); ++k) a.args.push_back(eval(*e.args[k], scope));
  for (const auto& [kn, kv] : e.kwargs) a.kwargs.emplace_back(kn, eval(*kv, scope));
  return a;
}

const Value* Scope::lookup(const std::string& name) const {
  for (const Scope* s = this; s; s = s->parent.get()) {
    const auto it = s->vars.find(name);
    if (it != s->vars.end()) return &it->second;
  }
  return nullptr;
}

void Interpreter::step() {
  if (++steps_ > limits_.max_steps) throw Error(cat("template stopped: more than ", limits_.max_steps, " steps"));
}

void Interpreter::check_size(size_t n) const {
  if (n > limits_.max_output) throw Error(cat("template stopped: output larger than ", limits_.max_output, " bytes"));
}

std::string Interpreter::render(const Body& body, const std::shared_ptr<Scope>& scope) {
  std::string out;
  const Flow f = exec(body, scope, out);
  if (f != Flow::Normal) throw Error("template: 'break' or 'continue' outside a for loop");
  return out;
}

Interpreter::Flow Interpreter::exec(const Body& body, const std::shared_ptr<Scope>& scope, std::string& out) {
  for (const auto& sp : body) {
    const Stmt& s = *sp;
    step();
    switch (s.kind) {
      case Stmt::Kind::Text: out += s.text; break;
      case Stmt::Kind::Output: out += eval(*s.expr, scope).str(); break;
      case Stmt::Kind::If: {
        bool done = false;
        for (const auto& [cond, b] : s.branches) {
          if (eval(*cond, scope).truthy()) {
            const Flow f = exec(b, scope, out);
            if (f != Flow::Normal) return f;
            done = true;
            break;
          }
        }
        if (!done) {
          const Flow f = exec(s.else_body, scope, out);
          if (f != Flow::Normal) return f;
        }
        break;
      }
      case Stmt::Kind::For: {
        const Flow f = exec_for(s, scope, out);
        if (f != Flow::Normal) return f;
        break;
      }
      case Stmt::Kind::Set: {
        Value v = eval(*s.expr, scope);
        if (!s.attr.empty()) {
          const Value* ns = scope->lookup(s.targets[0]);
          if (!ns || ns->kind() != Value::Kind::Namespace) {
            fail_at(s.line, cat("cannot assign attribute on non-namespace object '", s.targets[0], "'"));
          }
          ns->dict().set(Value(s.attr), std::move(v));
        } else if (s.targets.size() == 1) {
          scope->vars[s.targets[0]] = std::move(v);
        } else {
          const List items = iterate(v);
          if (items.size() != s.targets.size()) {
            fail_at(s.line, cat("cannot unpack ", items.size(), " values into ", s.targets.size(), " names"));
          }
          for (size_t i = 0; i < items.size(); ++i) scope->vars[s.targets[i]] = items[i];
        }
        break;
      }
      case Stmt::Kind::SetBlock: {
        std::string inner;
        const Flow f = exec(s.body, scope, inner);
        if (f != Flow::Normal) return f;
        scope->vars[s.targets[0]] = Value(std::move(inner));
        break;
      }
      case Stmt::Kind::Macro: scope->vars[s.text] = make_macro(s, scope); break;
      case Stmt::Kind::Break: return Flow::Break;
      case Stmt::Kind::Continue: return Flow::Continue;
      case Stmt::Kind::FilterBlock: {
        std::string inner;
        const Flow f = exec(s.body, scope, inner);
        if (f != Flow::Normal) return f;
        CallArgs args = eval_args(*s.filter, scope);
        out += apply_filter(*this, s.filter->name, Value(std::move(inner)), args).str();
        break;
      }
      case Stmt::Kind::With: {
        auto inner = std::make_shared<Scope>();
        inner->parent = scope;
        for (const auto& [n, e] : s.params) inner->vars[n] = eval(*e, scope);
        const Flow f = exec(s.body, inner, out);
        if (f != Flow::Normal) return f;
        break;
      }
      case Stmt::Kind::Generation: {
        const Flow f = exec(s.body, scope, out);
        if (f != Flow::Normal) return f;
        break;
      }
    }
    check_size(out.size());
  }
  return Flow::Normal;
}

Interpreter::Flow Interpreter::exec_for(const Stmt& s, const std::shared_ptr<Scope>& scope, std::string& out) {
  const Value seq = eval(*s.expr, scope);
  if (!seq.is_undefined() && !seq.is_list() && !seq.is_dict() && !seq.is_string()) {
    fail_at(s.line, cat("'", seq.type_name(), "' object is not iterable"));
  }
  List items = iterate(seq);
  auto bind = [&](Scope& sc, const Value& item) {
    if (s.targets.size() == 1) {
      sc.vars[s.targets[0]] = item;
      return;
    }
    const List parts = iterate(item);
    if (parts.size() != s.targets.size()) {
      fail_at(s.line, cat("cannot unpack ", parts.size(), " values into ", s.targets.size(), " loop variables"));
    }
    for (size_t k = 0; k < parts.size(); ++k) sc.vars[s.targets[k]] = parts[k];
  };
  if (s.filter) {
    List kept;
    for (const Value& item : items) {
      auto sc = std::make_shared<Scope>();
      sc->parent = scope;
      bind(*sc, item);
      if (eval(*s.filter, sc).truthy()) kept.push_back(item);
    }
    items = std::move(kept);
  }
  if (items.empty()) return exec(s.else_body, scope, out);
  const auto n = static_cast<int64_t>(items.size());
  const Value* outer_loop = scope->lookup("loop");
  const int64_t depth = outer_loop && outer_loop->is_dict() && outer_loop->dict().find(Value("depth"))
                            ? outer_loop->dict().find(Value("depth"))->as_int() + 1
                            : 1;
  bool run_else = true;
  for (int64_t i = 0; i < n; ++i) {
    step();
    auto sc = std::make_shared<Scope>();
    sc->parent = scope;
    bind(*sc, items[i]);
    auto loop = std::make_shared<Dict>();
    loop->set(Value("index"), Value(i + 1));
    loop->set(Value("index0"), Value(i));
    loop->set(Value("revindex"), Value(n - i));
    loop->set(Value("revindex0"), Value(n - i - 1));
    loop->set(Value("first"), Value(i == 0));
    loop->set(Value("last"), Value(i == n - 1));
    loop->set(Value("length"), Value(n));
    loop->set(Value("depth"), Value(depth));
    loop->set(Value("depth0"), Value(depth - 1));
    loop->set(Value("previtem"), i > 0 ? items[i - 1] : Value::undefined("previtem"));
    loop->set(Value("nextitem"), i + 1 < n ? items[i + 1] : Value::undefined("nextitem"));
    loop->set(Value("cycle"), Value::function("cycle", [i](CallArgs& a) -> Value {
                check(!a.args.empty(), "loop.cycle() needs at least one argument");
                return a.args[static_cast<size_t>(i) % a.args.size()];
              }));
    sc->vars["loop"] = Value(loop);
    const Flow f = exec(s.body, sc, out);
    if (f == Flow::Break) break;
    if (f == Flow::Normal) run_else = false;
  }
  // jinja2 clears its "else" flag at the end of each completed iteration, so
  // a loop whose last iteration ended in break or continue also runs "else".
  if (run_else) return exec(s.else_body, scope, out);
  return Flow::Normal;
}

Value Interpreter::make_macro(const Stmt& s, const std::shared_ptr<Scope>& scope) {
  const Stmt* def = &s;
  std::weak_ptr<Scope> weak = scope;  // the defining scope owns the macro: no cycle
  return Value::function(s.text, [this, def, weak](CallArgs& a) -> Value {
    auto parent = weak.lock();
    check(parent != nullptr, "macro '", def->text, "' called after its scope ended");
    check(a.args.size() <= def->params.size(), "macro '", def->text, "' takes ", def->params.size(),
          " arguments, got ", a.args.size());
    auto sc = std::make_shared<Scope>();
    sc->parent = parent;
    for (size_t k = 0; k < def->params.size(); ++k) {
      const auto& [pname, pdef] = def->params[k];
      if (k < a.args.size()) {
        sc->vars[pname] = a.args[k];
        continue;
      }
      bool found = false;
      for (const auto& [kn, kv] : a.kwargs) {
        if (kn == pname) sc->vars[pname] = kv, found = true;
      }
      if (!found) sc->vars[pname] = pdef ? eval(*pdef, sc) : Value::undefined(pname);
    }
    for (const auto& [kn, kv] : a.kwargs) {
      bool known = false;
      for (const auto& p : def->params) known |= p.first == kn;
      check(known, "macro '", def->text, "' has no parameter named '", kn, "'");
    }
    if (++call_depth_ > limits_.max_call_depth) {
      call_depth_ = 0;
      throw Error(cat("template stopped: macro calls nest deeper than ", limits_.max_call_depth));
    }
    std::string out;
    const Flow f = exec(def->body, sc, out);
    --call_depth_;
    check(f == Flow::Normal, "'break' or 'continue' outside a for loop in macro '", def->text, "'");
    return Value(std::move(out));
  });
}

Value Interpreter::call(const Value& fn, CallArgs& args, int line) {
  if (!fn.is_callable()) {
    if (fn.is_undefined()) fail_at(line, cat("'", fn.name(), "' is undefined"));
    fail_at(line, cat("'", fn.type_name(), "' object is not callable"));
  }
  try {
    return fn.fn()(args);
  } catch (const Error& e) {
    rethrow_at(line, "", e);
  }
}

Value Interpreter::eval(const Expr& e, const std::shared_ptr<Scope>& scope) {
  step();
  switch (e.kind) {
    case Expr::Kind::Literal: return e.value;
    case Expr::Kind::Name: {
      const Value* v = scope->lookup(e.name);
      return v ? *v : Value::undefined(e.name);
    }
    case Expr::Kind::Attr: {
      const Value obj = eval(*e.args[0], scope);
      if (obj.is_undefined()) {
        fail_at(e.line, obj.name().empty() ? cat("undefined value has no attribute '", e.name, "'")
                                           : cat("'", obj.name(), "' is undefined"));
      }
      try {
        return get_attr(obj, e.name);
      } catch (const Error& x) {
        fail_at(e.line, x.what());
      }
    }
    case Expr::Kind::Item: {
      const Value obj = eval(*e.args[0], scope);
      const Value key = eval(*e.args[1], scope);
      if (obj.is_undefined()) {
        fail_at(e.line, obj.name().empty() ? std::string("undefined value has no items")
                                           : cat("'", obj.name(), "' is undefined"));
      }
      try {
        return get_item(obj, key);
      } catch (const Error& x) {
        fail_at(e.line, x.what());
      }
    }
    case Expr::Kind::Slice: {
      const Value obj = eval(*e.args[0], scope);
      Value parts[3];
      for (int k = 0; k < 3; ++k) parts[k] = e.args[k + 1] ? eval(*e.args[k + 1], scope) : Value::none();
      try {
        return slice(obj, parts[0], parts[1], parts[2]);
      } catch (const Error& x) {
        fail_at(e.line, x.what());
      }
    }
    case Expr::Kind::Call: {
      const Value fn = eval(*e.args[0], scope);
      CallArgs a = eval_args(e, scope);
      Value r = call(fn, a, e.line);
      if (r.is_string()) check_size(r.str_ref().size());
      return r;
    }
    case Expr::Kind::Filter: {
      const Value in = eval(*e.args[0], scope);
      CallArgs a = eval_args(e, scope);
      try {
        Value r = apply_filter(*this, e.name, in, a);
        if (r.is_string()) check_size(r.str_ref().size());
        return r;
      } catch (const Error& x) {
        rethrow_at(e.line, "filter " + e.name + ": ", x);
      }
    }
    case Expr::Kind::Test: {
      const Value in = eval(*e.args[0], scope);
      CallArgs a = eval_args(e, scope);
      try {
        return Value(apply_test(*this, e.name, in, a) != e.negated);
      } catch (const Error& x) {
        rethrow_at(e.line, "test " + e.name + ": ", x);
      }
    }
    case Expr::Kind::Unary: {
      const Value v = eval(*e.args[0], scope);
      if (e.name == "not") return Value(!v.truthy());
      if (v.is_undefined()) fail_at(e.line, cat("'", v.name(), "' is undefined"));
      if (v.kind() == Value::Kind::Float) return Value(e.name == "-" ? -v.as_float() : v.as_float());
      if (v.is_number()) {
        const int64_t i = v.as_int();
        if (e.name == "-" && i == INT64_MIN) fail_at(e.line, "integer overflow");
        return Value(e.name == "-" ? -i : i);
      }
      fail_at(e.line, cat("bad operand type for unary ", e.name, ": '", v.type_name(), "'"));
    }
    case Expr::Kind::Binary: return binary(e, scope);
    case Expr::Kind::Compare: {
      Value left = eval(*e.args[0], scope);
      for (size_t k = 0; k < e.ops.size(); ++k) {
        Value right = eval(*e.args[k + 1], scope);
        const std::string& op = e.ops[k];
        bool r;
        try {
          if (op == "==") r = equals(left, right);
          else if (op == "!=") r = !equals(left, right);
          else if (op == "<") r = less(left, right);
          else if (op == ">") r = less(right, left);
          else if (op == "<=") r = less(left, right) || equals(left, right);
          else if (op == ">=") r = less(right, left) || equals(left, right);
          else if (op == "in") r = contains(right, left);
          else r = !contains(right, left);
        } catch (const Error& x) {
          fail_at(e.line, x.what());
        }
        if (!r) return Value(false);
        left = std::move(right);
      }
      return Value(true);
    }
    case Expr::Kind::Cond: {
      if (eval(*e.args[1], scope).truthy()) return eval(*e.args[0], scope);
      return e.args[2] ? eval(*e.args[2], scope) : Value::undefined();
    }
    case Expr::Kind::List:
    case Expr::Kind::Tuple: {
      List l;
      for (const auto& a : e.args) l.push_back(eval(*a, scope));
      return Value(std::move(l), e.kind == Expr::Kind::Tuple);
    }
    case Expr::Kind::Dict: {
      auto d = std::make_shared<Dict>();
      for (size_t k = 0; k + 1 < e.args.size(); k += 2) d->set(eval(*e.args[k], scope), eval(*e.args[k + 1], scope));
      return Value(d);
    }
  }
  return Value();
}

Value Interpreter::binary(const Expr& e, const std::shared_ptr<Scope>& scope) {
  const std::string& op = e.name;
  if (op == "and") {
    Value l = eval(*e.args[0], scope);
    return l.truthy() ? eval(*e.args[1], scope) : l;
  }
  if (op == "or") {
    Value l = eval(*e.args[0], scope);
    return l.truthy() ? l : eval(*e.args[1], scope);
  }
  const Value l = eval(*e.args[0], scope), r = eval(*e.args[1], scope);
  if (op == "~") {
    std::string s = l.str() + r.str();
    check_size(s.size());
    return Value(std::move(s));
  }
  for (const Value* v : {&l, &r}) {
    if (v->is_undefined()) fail_at(e.line, cat("'", v->name(), "' is undefined"));
  }
  auto type_error = [&]() {
    fail_at(e.line, cat("unsupported operand type(s) for ", op, ": '", l.type_name(), "' and '", r.type_name(), "'"));
  };
  if (op == "+") {
    if (l.is_string() && r.is_string()) {
      check_size(l.str_ref().size() + r.str_ref().size());
      return Value(l.str_ref() + r.str_ref());
    }
    if (l.is_list() && r.is_list()) {
      List out = l.list();
      out.insert(out.end(), r.list().begin(), r.list().end());
      return Value(std::move(out));
    }
  }
  if (op == "*" && ((l.is_string() || l.is_list()) && r.is_number() && r.kind() != Value::Kind::Float)) {
    const int64_t n = std::max<int64_t>(0, r.as_int());
    const size_t unit = l.is_string() ? l.str_ref().size() : l.list().size() * 16;
    if (unit && static_cast<uint64_t>(n) > limits_.max_output / unit) check_size(limits_.max_output + 1);
    if (l.is_string()) {
      std::string s;
      for (int64_t k = 0; k < n; ++k) s += l.str_ref();
      return Value(std::move(s));
    }
    List out;
    for (int64_t k = 0; k < n; ++k) out.insert(out.end(), l.list().begin(), l.list().end());
    return Value(std::move(out));
  }
  if (!l.is_number() || !r.is_number()) type_error();
  const bool fl = l.kind() == Value::Kind::Float || r.kind() == Value::Kind::Float;
  if (op == "/") {
    if (r.as_float() == 0) fail_at(e.line, "division by zero");
    return Value(l.as_float() / r.as_float());
  }
  if (fl) {
    const double a = l.as_float(), b = r.as_float();
    if (op == "+") return Value(a + b);
    if (op == "-") return Value(a - b);
    if (op == "*") return Value(a * b);
    if (op == "**") return Value(std::pow(a, b));
    if (b == 0) fail_at(e.line, "float division by zero");
    if (op == "//") return Value(std::floor(a / b));
    double m = std::fmod(a, b);
    if (m != 0 && ((m < 0) != (b < 0))) m += b;
    return Value(m);
  }
  const int64_t a = l.as_int(), b = r.as_int();
  if (op == "+") return Value(checked(add_ov, a, b, e.line));
  if (op == "-") return Value(checked(sub_ov, a, b, e.line));
  if (op == "*") return Value(checked(mul_ov, a, b, e.line));
  if (op == "**") {
    if (b < 0) return Value(std::pow(static_cast<double>(a), static_cast<double>(b)));
    int64_t acc = 1, base = a, ex = b;
    while (ex > 0) {
      if (ex & 1) acc = checked(mul_ov, acc, base, e.line);
      ex >>= 1;
      if (ex) base = checked(mul_ov, base, base, e.line);
    }
    return Value(acc);
  }
  if (b == 0) fail_at(e.line, "integer division or modulo by zero");
  if (a == INT64_MIN && b == -1) fail_at(e.line, "integer overflow");
  if (op == "//") return Value(floordiv(a, b));
  return Value(a - floordiv(a, b) * b);
}

namespace {

// jinja2's default globals that chat templates use, plus Hugging Face's.
// Namespaces made during one render. Attribute assignment can make one hold
// itself ({% set ns.me = ns %}), a shared_ptr cycle; clearing them all when the
// render ends frees them (nothing made in a render outlives it, and the
// `namespace` function is never called after it).
struct Namespaces {
  std::vector<std::weak_ptr<Dict>> made;
  ~Namespaces() {
    for (auto& w : made) {
      if (auto d = w.lock()) d->items.clear();
    }
  }
};

void add_globals(Scope& g, const RenderLimits& limits, Namespaces* namespaces) {
  g.vars["range"] = Value::function("range", [limits](CallArgs& a) {
    check(!a.args.empty() && a.args.size() <= 3, "range expects 1 to 3 arguments");
    for (const Value& v : a.args) check(v.kind() == Value::Kind::Int, "range arguments must be integers");
    int64_t start = 0, stop, step = 1;
    if (a.args.size() == 1) stop = a.args[0].as_int();
    else start = a.args[0].as_int(), stop = a.args[1].as_int();
    if (a.args.size() == 3) step = a.args[2].as_int();
    check(step != 0, "range() arg 3 must not be zero");
    List out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      check(out.size() < limits.max_output / 16, "template stopped: range() too long");
      out.push_back(Value(i));
    }
    return Value(std::move(out));
  });
  auto make_dict = [namespaces](CallArgs& a, bool ns) {
    auto d = std::make_shared<Dict>();
    if (ns) namespaces->made.push_back(d);
    check(a.args.size() <= 1, ns ? "namespace" : "dict", "() takes at most one positional argument");
    if (!a.args.empty()) {
      check(a.args[0].is_dict(), ns ? "namespace" : "dict", "() argument must be a mapping");
      for (const auto& kv : a.args[0].dict().items) d->set(kv.first, kv.second);
    }
    for (const auto& [k, v] : a.kwargs) d->set(Value(k), v);
    return Value(d, ns);
  };
  g.vars["namespace"] = Value::function("namespace", [make_dict](CallArgs& a) { return make_dict(a, true); });
  g.vars["dict"] = Value::function("dict", [make_dict](CallArgs& a) { return make_dict(a, false); });
  g.vars["raise_exception"] = Value::function("raise_exception", [](CallArgs& a) -> Value {
    throw Error(cat("template raised an exception: ", a.get(0, "message").str()));
  });
  g.vars["strftime_now"] = Value::function("strftime_now", [](CallArgs& a) {
    const std::string fmt = a.get(0, "format").str();
    const std::time_t t = std::time(nullptr);
    std::tm tm{};
    localtime_r(&t, &tm);
    char buf[256];
    const size_t n = std::strftime(buf, sizeof buf, fmt.c_str(), &tm);
    return Value(std::string(buf, n));
  });
}

}  // namespace

Template::Template(const std::string& source) : body_(parse(source)) {}
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;

std::string Template::render(const std::vector<std::pair<std::string, Value>>& vars, const RenderLimits& limits) const {
  Namespaces namespaces;  // destroyed last: clears what the scopes below leave in cycles
  Interpreter it(limits);
  auto globals = std::make_shared<Scope>();
  add_globals(*globals, limits, &namespaces);
  for (const auto& [k, v] : vars) globals->vars[k] = v;
  auto scope = std::make_shared<Scope>();
  scope->parent = globals;
  return it.render(body_, scope);
}

}  // namespace dflash::jinja
