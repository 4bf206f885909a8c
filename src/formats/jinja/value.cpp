#include "formats/jinja/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <vector>

#include <utf8proc.h>

#include "tokenizer/utf8.h"
#include "util/error.h"

namespace dflash::jinja {

Value Value::undefined(std::string name) {
  Value v;
  v.name_ = std::move(name);
  return v;
}
Value Value::none() {
  Value v;
  v.kind_ = Kind::None;
  return v;
}
Value::Value(bool b) : kind_(Kind::Bool), b_(b) {}
Value::Value(int64_t i) : kind_(Kind::Int), i_(i) {}
Value::Value(double f) : kind_(Kind::Float), f_(f) {}
Value::Value(std::string s) : kind_(Kind::String), s_(std::make_shared<const std::string>(std::move(s))) {}
Value::Value(List l, bool tuple)
    : kind_(Kind::List), tuple_(tuple), l_(std::make_shared<const List>(std::move(l))) {}
Value::Value(std::shared_ptr<Dict> d, bool is_namespace)
    : kind_(is_namespace ? Kind::Namespace : Kind::Dict), d_(std::move(d)) {}
Value Value::function(std::string name, Function f) {
  Value v;
  v.kind_ = Kind::Function;
  v.name_ = std::move(name);
  v.fn_ = std::make_shared<const Function>(std::move(f));
  return v;
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::Undefined:
    case Kind::None: return false;
    case Kind::Bool: return b_;
    case Kind::Int: return i_ != 0;
    case Kind::Float: return f_ != 0;
    case Kind::String: return !s_->empty();
    case Kind::List: return !l_->empty();
    case Kind::Dict: return !d_->items.empty();
    default: return true;
  }
}

std::string Value::type_name() const {
  switch (kind_) {
    case Kind::Undefined: return "Undefined";
    case Kind::None: return "NoneType";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::String: return "str";
    case Kind::List: return "list";
    case Kind::Dict: return "dict";
    case Kind::Namespace: return "Namespace";
    case Kind::Function: return "function";
  }
  return "?";
}

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  // Shortest round-trip digits in scientific form, then Python's layout rules.
  const auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  const bool neg = sci[0] == '-';
  if (neg) sci.erase(0, 1);
  const size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp = std::stoi(sci.substr(e + 1));
  const int decpt = exp + 1;  // position of the decimal point after the first digit
  std::string out;
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out = "0." + std::string(-decpt, '0') + digits;
    } else if (static_cast<size_t>(decpt) >= digits.size()) {
      out = digits + std::string(decpt - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, decpt) + "." + digits.substr(decpt);
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    const int x = decpt - 1;
    out += x < 0 ? "e-" : "e+";
    const int ax = std::abs(x);
    if (ax < 10) out += '0';
    out += std::to_string(ax);
  }
  return neg ? "-" + out : out;
}

namespace {

// Python's str.isprintable() for one code point.
bool py_printable(char32_t c) {
  if (c == ' ') return true;
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  switch (cat) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS: return false;
    default: return true;
  }
}

void hex_escape(std::string& out, const char* prefix, uint32_t v, int width) {
  static const char* h = "0123456789abcdef";
  out += prefix;
  for (int k = width - 1; k >= 0; --k) out += h[(v >> (4 * k)) & 15];
}

}  // namespace

std::string py_str_repr(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
  const char q = has_single && !has_double ? '"' : '\'';
  std::string out(1, q);
  for (size_t i = 0; i < s.size();) {
    const char32_t c = utf8::next(s, i);
    if (c == static_cast<char32_t>(q) || c == '\\') out += '\\', out += static_cast<char>(c);
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7F) hex_escape(out, "\\x", c, 2);
    else if (c < 0x80 || py_printable(c)) utf8::append(out, c);
    else if (c < 0x100) hex_escape(out, "\\x", c, 2);
    else if (c < 0x10000) hex_escape(out, "\\u", c, 4);
    else hex_escape(out, "\\U", c, 8);
  }
  out += q;
  return out;
}

namespace {

// Containers being printed, innermost last. A namespace can hold itself
// ({% set ns.me = ns %}); one met again inside itself prints as Python's
// reprlib does ([...], {...}) instead of recursing without end.
thread_local std::vector<const void*> printing;

struct Printing {
  explicit Printing(const void* p) { printing.push_back(p); }
  ~Printing() { printing.pop_back(); }
  static bool active(const void* p) { return std::find(printing.begin(), printing.end(), p) != printing.end(); }
};

}  // namespace

std::string Value::repr() const {
  switch (kind_) {
    case Kind::String: return py_str_repr(*s_);
    case Kind::Undefined: return "";
    default: return str();
  }
}

std::string Value::str() const {
  switch (kind_) {
    case Kind::Undefined: return "";
    case Kind::None: return "None";
    case Kind::Bool: return b_ ? "True" : "False";
    case Kind::Int: return std::to_string(i_);
    case Kind::Float: return float_repr(f_);
    case Kind::String: return *s_;
    case Kind::List: {
      if (Printing::active(l_.get())) return tuple_ ? "(...)" : "[...]";
      const Printing guard(l_.get());
      std::string out = tuple_ ? "(" : "[";
      for (size_t i = 0; i < l_->size(); ++i) out += (i ? ", " : "") + (*l_)[i].repr();
      if (tuple_ && l_->size() == 1) out += ",";
      return out + (tuple_ ? ")" : "]");
    }
    case Kind::Dict:
    case Kind::Namespace: {
      if (Printing::active(d_.get())) return kind_ == Kind::Namespace ? "<Namespace {...}>" : "{...}";
      const Printing guard(d_.get());
      std::string out = kind_ == Kind::Namespace ? "<Namespace {" : "{";
      for (size_t i = 0; i < d_->items.size(); ++i) {
        out += (i ? ", " : "") + d_->items[i].first.repr() + ": " + d_->items[i].second.repr();
      }
      return out + (kind_ == Kind::Namespace ? "}>" : "}");
    }
    case Kind::Function: return "<function " + name_ + ">";
  }
  return "";
}

Value Value::from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::null: return none();
    case nlohmann::json::value_t::boolean: return Value(j.get<bool>());
    case nlohmann::json::value_t::number_integer: return Value(j.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      const auto u = j.get<uint64_t>();
      check(u <= static_cast<uint64_t>(INT64_MAX), "integer ", u, " is too large");
      return Value(static_cast<int64_t>(u));
    }
    case nlohmann::json::value_t::number_float: return Value(j.get<double>());
    case nlohmann::json::value_t::string: return Value(j.get<std::string>());
    case nlohmann::json::value_t::array: {
      List l;
      l.reserve(j.size());
      for (const auto& e : j) l.push_back(from_json(e));
      return Value(std::move(l));
    }
    case nlohmann::json::value_t::object: {
      auto d = std::make_shared<Dict>();
      for (const auto& [k, v] : j.items()) d->set(Value(k), from_json(v));
      return Value(d);
    }
    default: throw Error("unsupported JSON value");
  }
}

const Value* Dict::find(const Value& key) const {
  for (const auto& kv : items) {
    if (equals(kv.first, key)) return &kv.second;
  }
  return nullptr;
}
Value* Dict::find(const Value& key) {
  for (auto& kv : items) {
    if (equals(kv.first, key)) return &kv.second;
  }
  return nullptr;
}
void Dict::set(const Value& key, Value v) {
  if (Value* p = find(key)) *p = std::move(v);
  else items.emplace_back(key, std::move(v));
}

Value CallArgs::get(size_t i, const char* name, Value def) const {
  if (i < args.size()) return args[i];
  for (const auto& [k, v] : kwargs) {
    if (k == name) return v;
  }
  return def;
}
bool CallArgs::has(size_t i, const char* name) const {
  if (i < args.size()) return true;
  for (const auto& kv : kwargs) {
    if (kv.first == name) return true;
  }
  return false;
}

bool equals(const Value& a, const Value& b) {
  using K = Value::Kind;
  if (a.is_number() && b.is_number()) {
    if (a.kind() == K::Float || b.kind() == K::Float) return a.as_float() == b.as_float();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case K::Undefined:
    case K::None: return true;
    case K::String: return a.str_ref() == b.str_ref();
    case K::List: {
      if (a.is_tuple() != b.is_tuple() || a.list().size() != b.list().size()) return false;
      for (size_t i = 0; i < a.list().size(); ++i) {
        if (!equals(a.list()[i], b.list()[i])) return false;
      }
      return true;
    }
    case K::Dict: {
      if (a.dict().items.size() != b.dict().items.size()) return false;
      for (const auto& [k, v] : a.dict().items) {
        const Value* o = b.dict().find(k);
        if (!o || !equals(v, *o)) return false;
      }
      return true;
    }
    case K::Namespace: return a.dict_ptr() == b.dict_ptr();  // by identity, as Python
    case K::Function: return &a.fn() == &b.fn();
    default: return false;
  }
}

bool less(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind() == Value::Kind::Float || b.kind() == Value::Kind::Float) return a.as_float() < b.as_float();
    return a.as_int() < b.as_int();
  }
  if (a.is_string() && b.is_string()) {
    // Python compares code points; UTF-8 byte order is the same order.
    return a.str_ref() < b.str_ref();
  }
  if (a.is_list() && b.is_list()) {
    const auto &x = a.list(), &y = b.list();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!equals(x[i], y[i])) return less(x[i], y[i]);
    }
    return x.size() < y.size();
  }
  throw Error(cat("'<' not supported between instances of '", a.type_name(), "' and '", b.type_name(), "'"));
}

namespace {

void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) hex_escape(out, "\\u", c, 4);
        else out += static_cast<char>(c);
    }
  }
  out += '"';
}

void json_value(std::string& out, const Value& v, int indent, int level, const std::string& item_sep,
                const std::string& key_sep, bool sort_keys) {
  using K = Value::Kind;
  auto newline = [&](int lvl) {
    if (indent >= 0) out += "\n" + std::string(static_cast<size_t>(indent) * lvl, ' ');
  };
  switch (v.kind()) {
    case K::None: out += "null"; return;
    case K::Bool: out += v.as_bool() ? "true" : "false"; return;
    case K::Int: out += std::to_string(v.as_int()); return;
    case K::Float: {
      const double d = v.as_float();
      out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity") : float_repr(d);
      return;
    }
    case K::String: json_string(out, v.str_ref()); return;
    case K::List: {
      if (v.list().empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < v.list().size(); ++i) {
        if (i) out += item_sep;
        newline(level + 1);
        json_value(out, v.list()[i], indent, level + 1, item_sep, key_sep, sort_keys);
      }
      newline(level);
      out += ']';
      return;
    }
    case K::Dict: {
      if (v.dict().items.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<Value, Value>*> items;
      for (const auto& kv : v.dict().items) items.push_back(&kv);
      if (sort_keys) {
        std::stable_sort(items.begin(), items.end(), [](auto* x, auto* y) { return less(x->first, y->first); });
      }
      out += '{';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += item_sep;
        newline(level + 1);
        const Value& k = items[i]->first;
        if (k.is_string()) json_string(out, k.str_ref());
        else if (k.kind() == K::Int || k.kind() == K::Float) json_string(out, k.str());
        else if (k.kind() == K::Bool) out += k.as_bool() ? "\"true\"" : "\"false\"";
        else if (k.is_none()) out += "\"null\"";
        else throw Error(cat("tojson: keys must be str, int, float, bool or None, not ", k.type_name()));
        out += key_sep;
        json_value(out, items[i]->second, indent, level + 1, item_sep, key_sep, sort_keys);
      }
      newline(level);
      out += '}';
      return;
    }
    default: throw Error(cat("tojson: object of type ", v.type_name(), " is not JSON serializable"));
  }
}

}  // namespace

std::string to_json(const Value& v, int indent, const std::string& item_sep, const std::string& key_sep,
                    bool sort_keys) {
  std::string out;
  json_value(out, v, indent, 0, item_sep, key_sep, sort_keys);
  return out;
}

}  // namespace dflash::jinja
