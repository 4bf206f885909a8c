// Runtime values of the template engine, with Python's semantics (what
// jinja2 does): str(), repr(), truthiness, ==, <, and json.dumps for tojson.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace dflash::jinja {

class Value;
using List = std::vector<Value>;
struct Dict;
struct CallArgs;
using Function = std::function<Value(CallArgs&)>;

class Value {
 public:
  enum class Kind { Undefined, None, Bool, Int, Float, String, List, Dict, Namespace, Function };

  Value() = default;  // undefined
  static Value undefined(std::string name = {});
  static Value none();
  Value(bool b);
  Value(int64_t i);
  Value(int i) : Value(static_cast<int64_t>(i)) {}
  Value(double f);
  Value(std::string s);
  Value(const char* s) : Value(std::string(s)) {}
  Value(List l, bool tuple = false);
  Value(std::shared_ptr<Dict> d, bool is_namespace = false);
  static Value function(std::string name, Function f);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::Undefined; }
  bool is_none() const { return kind_ == Kind::None; }
  bool is_string() const { return kind_ == Kind::String; }
  bool is_number() const { return kind_ == Kind::Int || kind_ == Kind::Float || kind_ == Kind::Bool; }
  bool is_list() const { return kind_ == Kind::List; }
  bool is_dict() const { return kind_ == Kind::Dict || kind_ == Kind::Namespace; }
  bool is_callable() const { return kind_ == Kind::Function; }
  bool is_tuple() const { return kind_ == Kind::List && tuple_; }

  bool as_bool() const { return b_; }
  int64_t as_int() const { return kind_ == Kind::Bool ? b_ : i_; }
  double as_float() const { return kind_ == Kind::Float ? f_ : static_cast<double>(as_int()); }
  const std::string& str_ref() const { return *s_; }
  const List& list() const { return *l_; }
  Dict& dict() const { return *d_; }
  const std::shared_ptr<Dict>& dict_ptr() const { return d_; }
  const Function& fn() const { return *fn_; }
  const std::string& name() const { return name_; }  // undefined variable or function name

  bool truthy() const;
  std::string str() const;   // Python str()
  std::string repr() const;  // Python repr()
  std::string type_name() const;

  static Value from_json(const nlohmann::ordered_json& j);

 private:
  Kind kind_ = Kind::Undefined;
  bool b_ = false;
  bool tuple_ = false;  // a List that Python would hold as a tuple
  int64_t i_ = 0;
  double f_ = 0;
  std::shared_ptr<const std::string> s_;
  std::shared_ptr<const List> l_;
  std::shared_ptr<Dict> d_;
  std::shared_ptr<const Function> fn_;
  std::string name_;
};

// Insertion-ordered mapping, like a Python dict.
struct Dict {
  std::vector<std::pair<Value, Value>> items;
  const Value* find(const Value& key) const;
  Value* find(const Value& key);
  void set(const Value& key, Value v);
};

struct CallArgs {
  std::vector<Value> args;
  std::vector<std::pair<std::string, Value>> kwargs;
  // Positional argument i or keyword `name`; `def` when absent.
  Value get(size_t i, const char* name, Value def = Value()) const;
  bool has(size_t i, const char* name) const;
};

bool equals(const Value& a, const Value& b);
// Python's a < b; throws for types without an order.
bool less(const Value& a, const Value& b);
std::string float_repr(double d);
std::string py_str_repr(const std::string& s);
// json.dumps(v, ensure_ascii=False, indent=..., separators=..., sort_keys=...)
std::string to_json(const Value& v, int indent, const std::string& item_sep, const std::string& key_sep, bool sort_keys);

}  // namespace dflash::jinja
