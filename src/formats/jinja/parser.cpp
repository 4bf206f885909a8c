#include "formats/jinja/parser.h"

#include "formats/jinja/builtins.h"
#include "formats/jinja/lexer.h"
#include "util/error.h"

namespace dflash::jinja {

namespace {

using T = Token::Type;
constexpr int kMaxDepth = 200;

class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : t_(std::move(toks)) {}

  Body parse_all() {
    std::string end;
    Body b = body({}, end);
    check(at(T::End), err("unexpected '", end, "'"));
    return b;
  }

 private:
  template <typename... A>
  std::string err(const A&... a) const {
    return cat("template line ", t_[p_].line, ": ", a...);
  }
  const Token& cur() const { return t_[p_]; }
  bool at(T type) const { return cur().type == type; }
  bool at_op(const char* op) const { return cur().type == T::Op && cur().text == op; }
  bool at_name(const char* n) const { return cur().type == T::Name && cur().text == n; }
  const Token& take() {
    const Token& k = t_[p_];
    if (k.type != T::End) ++p_;
    return k;
  }
  void expect_op(const char* op) {
    check(at_op(op), err("expected '", op, "', found '", cur().text, "'"));
    take();
  }
  std::string expect_name() {
    check(at(T::Name), err("expected a name, found '", cur().text, "'"));
    return take().text;
  }
  void expect_block_end() {
    check(at(T::BlockEnd), err("expected end of tag, found '", cur().text, "'"));
    take();
  }

  struct Guard {
    int& d;
    Guard(int& depth, const Parser& p) : d(depth) {
      check(++d <= kMaxDepth, p.err("template nests deeper than ", kMaxDepth, " levels"));
    }
    ~Guard() { --d; }
  };

  // Parses statements until a block tag named in `ends`; leaves `end` = that name
  // with the position after its name.
  Body body(const std::vector<std::string>& ends, std::string& end) {
    Guard g(depth_, *this);
    Body out;
    while (!at(T::End)) {
      const int line = cur().line;
      if (at(T::Text)) {
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::Text;
        s->text = take().text;
        out.push_back(std::move(s));
        continue;
      }
      if (at(T::VarBegin)) {
        take();
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::Output;
        s->line = line;
        s->expr = tuple_expr(true);
        check(at(T::VarEnd), err("expected '}}', found '", cur().text, "'"));
        take();
        out.push_back(std::move(s));
        continue;
      }
      check(at(T::BlockBegin), err("unexpected '", cur().text, "'"));
      take();
      const std::string kw = expect_name();
      for (const auto& e : ends) {
        if (kw == e) {
          end = kw;
          return out;
        }
      }
      out.push_back(statement(kw, line));
    }
    check(ends.empty(), err("missing {% ", ends.empty() ? "" : ends.back(), " %}"));
    return out;
  }

  std::unique_ptr<Stmt> statement(const std::string& kw, int line) {
    auto s = std::make_unique<Stmt>();
    s->line = line;
    std::string end;
    if (kw == "if") {
      s->kind = Stmt::Kind::If;
      ExprPtr cond = tuple_expr(false);
      while (true) {
        expect_block_end();
        Body b = body({"elif", "else", "endif"}, end);
        s->branches.emplace_back(std::move(cond), std::move(b));
        if (end == "elif") {
          cond = tuple_expr(false);
          continue;
        }
        if (end == "else") {
          expect_block_end();
          s->else_body = body({"endif"}, end);
        }
        break;
      }
      expect_block_end();
    } else if (kw == "for") {
      s->kind = Stmt::Kind::For;
      s->targets = target_names();
      check(at_name("in"), err("expected 'in' in for loop"));
      take();
      s->expr = tuple_expr(false, /*no_cond=*/true);
      if (at_name("if")) {
        take();
        s->filter = expression();
      }
      check(!at_name("recursive"), err("recursive for loops are not supported"));
      expect_block_end();
      s->body = body({"else", "endfor"}, end);
      if (end == "else") {
        expect_block_end();
        s->else_body = body({"endfor"}, end);
      }
      expect_block_end();
    } else if (kw == "set") {
      s->targets = target_names();
      if (s->targets.size() == 1 && at_op(".")) {
        take();
        s->attr = expect_name();
      }
      if (at_op("=")) {
        take();
        s->kind = Stmt::Kind::Set;
        s->expr = tuple_expr(false);
        expect_block_end();
      } else {
        check(s->targets.size() == 1 && s->attr.empty(), err("block set takes one name"));
        s->kind = Stmt::Kind::SetBlock;
        check(!at_op("|"), err("filtered block set is not supported"));
        expect_block_end();
        s->body = body({"endset"}, end);
        expect_block_end();
      }
    } else if (kw == "macro") {
      s->kind = Stmt::Kind::Macro;
      s->text = expect_name();
      expect_op("(");
      while (!at_op(")")) {
        std::string p = expect_name();
        ExprPtr def;
        if (at_op("=")) {
          take();
          def = expression();
        }
        s->params.emplace_back(std::move(p), std::move(def));
        if (!at_op(")")) expect_op(",");
      }
      take();
      expect_block_end();
      s->body = body({"endmacro"}, end);
      if (at(T::Name)) take();  // {% endmacro name %}
      expect_block_end();
    } else if (kw == "break" || kw == "continue") {
      check(loops_ > 0, err("'", kw, "' outside a for loop"));
      s->kind = kw == "break" ? Stmt::Kind::Break : Stmt::Kind::Continue;
      expect_block_end();
    } else if (kw == "filter") {
      s->kind = Stmt::Kind::FilterBlock;
      s->filter = make(Expr::Kind::Filter, line);
      s->filter->name = expect_name();
      check(has_filter(s->filter->name), err("no filter named '", s->filter->name, "'"));
      s->filter->args.push_back(make(Expr::Kind::Literal, line));
      if (at_op("(")) call_args(*s->filter);
      check(!at_op("|"), err("chained filters in {% filter %} are not supported"));
      expect_block_end();
      s->body = body({"endfilter"}, end);
      expect_block_end();
    } else if (kw == "with") {
      s->kind = Stmt::Kind::With;
      while (!at(T::BlockEnd)) {
        std::string n = expect_name();
        expect_op("=");
        s->params.emplace_back(std::move(n), expression());
        if (!at(T::BlockEnd)) expect_op(",");
      }
      take();
      s->body = body({"endwith"}, end);
      expect_block_end();
    } else if (kw == "generation") {
      s->kind = Stmt::Kind::Generation;
      expect_block_end();
      s->body = body({"endgeneration"}, end);
      expect_block_end();
    } else {
      const bool closing = kw.rfind("end", 0) == 0 || kw == "elif" || kw == "else";
      throw Error(err(closing ? "unexpected {% " : "the {% ", kw, closing ? " %}" : " %} tag is not supported"));
    }
    return s;
  }

  std::vector<std::string> target_names() {
    std::vector<std::string> names;
    const bool paren = at_op("(");
    if (paren) take();
    names.push_back(expect_name());
    while (at_op(",")) {
      take();
      names.push_back(expect_name());
    }
    if (paren) expect_op(")");
    return names;
  }

  ExprPtr make(Expr::Kind k, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->line = line;
    return e;
  }

  // expression (, expression)* -> a tuple when there is a comma.
  ExprPtr tuple_expr(bool allow_empty_end, bool no_cond = false) {
    const int line = cur().line;
    ExprPtr first = no_cond ? or_expr() : expression();
    if (!at_op(",")) return first;
    auto t = make(Expr::Kind::Tuple, line);
    t->args.push_back(std::move(first));
    while (at_op(",")) {
      take();
      if (at(T::BlockEnd) || at(T::VarEnd) || at_name("in") || at_name("if")) break;
      t->args.push_back(no_cond ? or_expr() : expression());
    }
    return t;
  }

  ExprPtr expression() {
    Guard g(depth_, *this);
    const int line = cur().line;
    ExprPtr e = or_expr();
    if (at_name("if")) {
      take();
      auto c = make(Expr::Kind::Cond, line);
      ExprPtr cond = or_expr();
      ExprPtr other;
      if (at_name("else")) {
        take();
        other = expression();
      }
      c->args.push_back(std::move(e));
      c->args.push_back(std::move(cond));
      c->args.push_back(std::move(other));
      return c;
    }
    return e;
  }

  ExprPtr binary(const char* op, ExprPtr l, ExprPtr r, int line) {
    auto b = make(Expr::Kind::Binary, line);
    b->name = op;
    b->args.push_back(std::move(l));
    b->args.push_back(std::move(r));
    return b;
  }

  // One left-associative precedence level: operand (op operand)*, where op is one
  // of `ops` (operator tokens, or keywords when `keyword`).
  template <typename Operand>
  ExprPtr left_assoc(std::initializer_list<const char*> ops, bool keyword, Operand operand) {
    ExprPtr l = operand();
    while (true) {
      const char* op = nullptr;
      for (const char* o : ops) {
        if (keyword ? at_name(o) : at_op(o)) op = o;
      }
      if (!op) return l;
      const int line = take().line;
      l = binary(op, std::move(l), operand(), line);
    }
  }
  ExprPtr or_expr() { return left_assoc({"or"}, true, [this] { return and_expr(); }); }
  ExprPtr and_expr() { return left_assoc({"and"}, true, [this] { return not_expr(); }); }
  ExprPtr not_expr() {
    if (at_name("not")) {
      Guard g(depth_, *this);
      auto u = make(Expr::Kind::Unary, take().line);
      u->name = "not";
      u->args.push_back(not_expr());
      return u;
    }
    return compare();
  }
  ExprPtr compare() {
    const int line = cur().line;
    ExprPtr first = math1();
    ExprPtr c;
    while (true) {
      std::string op;
      if (cur().type == T::Op && (cur().text == "==" || cur().text == "!=" || cur().text == "<" ||
                                  cur().text == ">" || cur().text == "<=" || cur().text == ">=")) {
        op = take().text;
      } else if (at_name("in")) {
        take();
        op = "in";
      } else if (at_name("not") && p_ + 1 < t_.size() && t_[p_ + 1].type == T::Name && t_[p_ + 1].text == "in") {
        take(), take();
        op = "not in";
      } else {
        break;
      }
      if (!c) {
        c = make(Expr::Kind::Compare, line);
        c->args.push_back(std::move(first));
      }
      c->ops.push_back(op);
      c->args.push_back(math1());
    }
    return c ? std::move(c) : std::move(first);
  }
  ExprPtr math1() { return left_assoc({"+", "-"}, false, [this] { return concat(); }); }
  ExprPtr concat() { return left_assoc({"~"}, false, [this] { return math2(); }); }
  ExprPtr math2() { return left_assoc({"*", "/", "//", "%"}, false, [this] { return power(); }); }
  ExprPtr power() { return left_assoc({"**"}, false, [this] { return unary(true); }); }
  ExprPtr unary(bool with_filter) {
    Guard g(depth_, *this);
    ExprPtr e;
    if (at_op("-") || at_op("+")) {
      const Token& op = take();
      e = make(Expr::Kind::Unary, op.line);
      e->name = op.text;
      e->args.push_back(unary(false));
    } else {
      e = primary();
    }
    e = postfix(std::move(e));
    if (with_filter) e = filter_tail(std::move(e));
    return e;
  }

  ExprPtr primary() {
    Guard g(depth_, *this);
    const Token& k = cur();
    const int line = k.line;
    if (k.type == T::Name) {
      take();
      auto e = make(Expr::Kind::Literal, line);
      if (k.text == "true" || k.text == "True") e->value = Value(true);
      else if (k.text == "false" || k.text == "False") e->value = Value(false);
      else if (k.text == "none" || k.text == "None") e->value = Value::none();
      else e->kind = Expr::Kind::Name, e->name = k.text;
      return e;
    }
    if (k.type == T::String) {
      std::string s;
      while (at(T::String)) s += take().text;
      auto e = make(Expr::Kind::Literal, line);
      e->value = Value(std::move(s));
      return e;
    }
    if (k.type == T::Int || k.type == T::Float) {
      take();
      auto e = make(Expr::Kind::Literal, line);
      try {
        if (k.type == T::Int) e->value = Value(static_cast<int64_t>(std::stoll(k.text)));
        else e->value = Value(std::stod(k.text));
      } catch (const std::exception&) {
        throw Error(err("number ", k.text, " is out of range"));
      }
      return e;
    }
    if (at_op("(")) {
      take();
      if (at_op(")")) {
        take();
        return make(Expr::Kind::Tuple, line);
      }
      ExprPtr e = expression();
      if (at_op(",")) {
        auto t = make(Expr::Kind::Tuple, line);
        t->args.push_back(std::move(e));
        while (at_op(",")) {
          take();
          if (at_op(")")) break;
          t->args.push_back(expression());
        }
        e = std::move(t);
      }
      expect_op(")");
      return e;
    }
    if (at_op("[")) {
      take();
      auto l = make(Expr::Kind::List, line);
      while (!at_op("]")) {
        l->args.push_back(expression());
        if (!at_op("]")) expect_op(",");
      }
      take();
      return l;
    }
    if (at_op("{")) {
      take();
      auto d = make(Expr::Kind::Dict, line);
      while (!at_op("}")) {
        d->args.push_back(expression());
        expect_op(":");
        d->args.push_back(expression());
        if (!at_op("}")) expect_op(",");
      }
      take();
      return d;
    }
    throw Error(err("unexpected '", k.text, "'"));
  }

  void call_args(Expr& e) {
    expect_op("(");
    while (!at_op(")")) {
      check(!at_op("*") && !at_op("**"), err("*args and **kwargs in calls are not supported"));
      if (at(T::Name) && p_ + 1 < t_.size() && t_[p_ + 1].type == T::Op && t_[p_ + 1].text == "=") {
        std::string n = take().text;
        take();
        e.kwargs.emplace_back(std::move(n), expression());
      } else {
        check(e.kwargs.empty(), err("positional argument after a keyword argument"));
        e.args.push_back(expression());
      }
      if (!at_op(")")) expect_op(",");
    }
    take();
  }

  ExprPtr postfix(ExprPtr e) {
    while (true) {
      const int line = cur().line;
      if (at_op(".")) {
        take();
        if (at(T::Int)) {
          auto it = make(Expr::Kind::Item, line);
          auto k = make(Expr::Kind::Literal, line);
          const std::string digits = take().text;
          check(digits.size() <= 18, err("index ", digits, " is out of range"));
          k->value = Value(static_cast<int64_t>(std::stoll(digits)));
          it->args.push_back(std::move(e));
          it->args.push_back(std::move(k));
          e = std::move(it);
          continue;
        }
        auto a = make(Expr::Kind::Attr, line);
        a->name = expect_name();
        a->args.push_back(std::move(e));
        e = std::move(a);
      } else if (at_op("[")) {
        take();
        ExprPtr parts[3];
        bool is_slice = false;
        for (int k = 0; k < 3; ++k) {
          if (!at_op(":") && !at_op("]")) parts[k] = expression();
          if (k < 2 && at_op(":")) {
            take();
            is_slice = true;
          } else {
            break;
          }
        }
        expect_op("]");
        auto s = make(is_slice ? Expr::Kind::Slice : Expr::Kind::Item, line);
        s->args.push_back(std::move(e));
        for (auto& part : parts) {
          if (is_slice) s->args.push_back(std::move(part));
        }
        if (!is_slice) {
          check(parts[0] != nullptr, err("empty subscript"));
          s->args.push_back(std::move(parts[0]));
        }
        e = std::move(s);
      } else if (at_op("(")) {
        auto c = make(Expr::Kind::Call, line);
        c->args.push_back(std::move(e));
        call_args(*c);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  ExprPtr filter_tail(ExprPtr e) {
    while (true) {
      const int line = cur().line;
      if (at_op("|")) {
        take();
        auto f = make(Expr::Kind::Filter, line);
        f->name = expect_name();
        while (at_op(".")) take(), f->name += "." + expect_name();
        check(has_filter(f->name), err("no filter named '", f->name, "'"));
        f->args.push_back(std::move(e));
        if (at_op("(")) call_args(*f);
        e = std::move(f);
      } else if (at_name("is")) {
        take();
        auto t = make(Expr::Kind::Test, line);
        if (at_name("not")) take(), t->negated = true;
        t->name = expect_name();
        check(has_test(t->name), err("no test named '", t->name, "'"));
        t->args.push_back(std::move(e));
        if (at_op("(")) {
          call_args(*t);
        } else if ((at(T::Name) && !at_name("else") && !at_name("or") && !at_name("and") && !at_name("if") &&
                    !at_name("is") && !at_name("in") && !at_name("not")) ||
                   at(T::String) || at(T::Int) || at(T::Float) || at_op("[") || at_op("{")) {
          t->args.push_back(postfix(primary()));
        }
        e = std::move(t);
      } else if (at_op("(")) {
        auto c = make(Expr::Kind::Call, line);
        c->args.push_back(std::move(e));
        call_args(*c);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  std::vector<Token> t_;
  size_t p_ = 0;
  int depth_ = 0;
  int loops_ = 1 << 20;  // break/continue placement is checked at render time
};

}  // namespace

Body parse(const std::string& source) { return Parser(tokenize(source)).parse_all(); }

}  // namespace dflash::jinja
