#include "formats/jinja/builtins.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>

#include <utf8proc.h>

#include "formats/jinja/interpreter.h"
#include "formats/jinja/lexer.h"
#include "tokenizer/utf8.h"
#include "util/error.h"

namespace dflash::jinja {

namespace {

using K = Value::Kind;

const std::string& need_str(const Value& v, const char* what) {
  check(v.is_string(), what, " must be a string, not ", v.type_name());
  return v.str_ref();
}

int64_t need_int(const Value& v, const char* what) {
  check(v.kind() == K::Int || v.kind() == K::Bool, what, " must be an integer, not ", v.type_name());
  return v.as_int();
}

// ---- Python str helpers (code-point based) ----

bool in_chars(char32_t c, const std::u32string* chars) {
  return chars ? chars->find(c) != std::u32string::npos : py_isspace(c);
}

std::string py_strip(const std::string& s, const Value& chars_v, bool left, bool right) {
  std::u32string chars;
  const std::u32string* set = nullptr;
  if (!chars_v.is_undefined() && !chars_v.is_none()) {
    chars = utf8::decode(need_str(chars_v, "strip() argument"));
    set = &chars;
  }
  const std::u32string u = utf8::decode(s);
  size_t b = 0, e = u.size();
  if (left) {
    while (b < e && in_chars(u[b], set)) ++b;
  }
  if (right) {
    while (e > b && in_chars(u[e - 1], set)) --e;
  }
  return utf8::encode(std::u32string_view(u).substr(b, e - b));
}

List py_split(const std::string& s, const Value& sep_v, int64_t maxsplit) {
  List out;
  if (sep_v.is_undefined() || sep_v.is_none()) {
    const std::u32string u = utf8::decode(s);
    size_t i = 0;
    while (true) {
      while (i < u.size() && py_isspace(u[i])) ++i;
      if (i >= u.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit) {
        size_t e = u.size();
        while (e > i && py_isspace(u[e - 1])) --e;
        out.push_back(Value(utf8::encode(std::u32string_view(u).substr(i, e - i))));
        break;
      }
      size_t j = i;
      while (j < u.size() && !py_isspace(u[j])) ++j;
      out.push_back(Value(utf8::encode(std::u32string_view(u).substr(i, j - i))));
      i = j;
    }
    return out;
  }
  const std::string& sep = need_str(sep_v, "split() separator");
  check(!sep.empty(), "empty separator");
  size_t i = 0;
  while (true) {
    const size_t j = s.find(sep, i);
    if (j == std::string::npos || (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit)) {
      out.push_back(Value(s.substr(i)));
      break;
    }
    out.push_back(Value(s.substr(i, j - i)));
    i = j + sep.size();
  }
  return out;
}

std::string map_case(const std::string& s, int mode) {  // 0 lower, 1 upper
  std::string out;
  for (size_t i = 0; i < s.size();) {
    const char32_t c = utf8::next(s, i);
    utf8::append(out, static_cast<char32_t>(mode ? utf8proc_toupper(static_cast<utf8proc_int32_t>(c))
                                                 : utf8proc_tolower(static_cast<utf8proc_int32_t>(c))));
  }
  return out;
}

bool is_cased_letter(char32_t c) {
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT;
}

std::string py_title(const std::string& s) {
  std::string out;
  bool prev_cased = false;
  for (size_t i = 0; i < s.size();) {
    const char32_t c = utf8::next(s, i);
    const auto cc = static_cast<utf8proc_int32_t>(c);
    utf8::append(out, static_cast<char32_t>(prev_cased ? utf8proc_tolower(cc) : utf8proc_totitle(cc)));
    prev_cased = is_cased_letter(c);
  }
  return out;
}

std::string py_capitalize(const std::string& s) {
  std::string out;
  bool first = true;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<utf8proc_int32_t>(utf8::next(s, i));
    utf8::append(out, static_cast<char32_t>(first ? utf8proc_totitle(c) : utf8proc_tolower(c)));
    first = false;
  }
  return out;
}

std::string py_replace(const std::string& s, const std::string& a, const std::string& b, int64_t count) {
  std::string out;
  if (a.empty()) {
    // Python inserts `b` between characters and at both ends.
    int64_t n = 0;
    size_t i = 0;
    if (count != 0) out += b, ++n;
    while (i < s.size()) {
      const size_t j = i;
      utf8::next(s, i);
      out.append(s, j, i - j);
      if (count < 0 || n < count) out += b, ++n;
    }
    return out;
  }
  size_t i = 0;
  int64_t n = 0;
  while (true) {
    const size_t j = (count >= 0 && n >= count) ? std::string::npos : s.find(a, i);
    if (j == std::string::npos) {
      out.append(s, i);
      break;
    }
    out.append(s, i, j - i);
    out += b;
    i = j + a.size();
    ++n;
  }
  return out;
}

Value bound(const std::string& name, Function f) { return Value::function(name, std::move(f)); }

bool starts_or_ends(const std::string& s, const Value& arg, bool start) {
  auto one = [&](const Value& p) {
    const std::string& x = need_str(p, start ? "startswith() argument" : "endswith() argument");
    if (x.size() > s.size()) return false;
    return start ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  if (arg.is_list()) {
    for (const Value& p : arg.list()) {
      if (one(p)) return true;
    }
    return false;
  }
  return one(arg);
}

Value string_method(const std::string& s, const std::string& name) {
  auto str = std::make_shared<const std::string>(s);
  auto m = [&](Function f) { return bound(name, std::move(f)); };
  if (name == "startswith" || name == "endswith") {
    const bool start = name == "startswith";
    return m([str, start](CallArgs& a) { return Value(starts_or_ends(*str, a.get(0, "prefix"), start)); });
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    const bool l = name != "rstrip", r = name != "lstrip";
    return m([str, l, r](CallArgs& a) { return Value(py_strip(*str, a.get(0, "chars"), l, r)); });
  }
  if (name == "split") {
    return m([str](CallArgs& a) {
      const Value ms = a.get(1, "maxsplit", Value(int64_t{-1}));
      return Value(py_split(*str, a.get(0, "sep"), need_int(ms, "maxsplit")));
    });
  }
  if (name == "rsplit") {
    return m([str](CallArgs& a) {
      check(!a.has(1, "maxsplit") || a.get(1, "maxsplit").as_int() < 0, "rsplit with maxsplit is not supported");
      return Value(py_split(*str, a.get(0, "sep"), -1));
    });
  }
  if (name == "splitlines") {
    return m([str](CallArgs&) {
      List out;
      size_t i = 0;
      while (i < str->size()) {
        size_t j = str->find_first_of("\r\n", i);
        if (j == std::string::npos) {
          out.push_back(Value(str->substr(i)));
          break;
        }
        out.push_back(Value(str->substr(i, j - i)));
        i = j + ((*str)[j] == '\r' && j + 1 < str->size() && (*str)[j + 1] == '\n' ? 2 : 1);
      }
      return Value(std::move(out));
    });
  }
  if (name == "upper" || name == "lower") {
    const int mode = name == "upper";
    return m([str, mode](CallArgs&) { return Value(map_case(*str, mode)); });
  }
  if (name == "title") return m([str](CallArgs&) { return Value(py_title(*str)); });
  if (name == "capitalize") return m([str](CallArgs&) { return Value(py_capitalize(*str)); });
  if (name == "replace") {
    return m([str](CallArgs& a) {
      return Value(py_replace(*str, need_str(a.get(0, "old"), "replace() argument"),
                              need_str(a.get(1, "new"), "replace() argument"),
                              need_int(a.get(2, "count", Value(int64_t{-1})), "count")));
    });
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
    return m([str, name](CallArgs& a) -> Value {
      const std::string& x = need_str(a.get(0, "sub"), "argument");
      check(!a.has(1, "start"), name, "() with start/end is not supported");
      if (name == "count") {
        if (x.empty()) return Value(static_cast<int64_t>(utf8::decode(*str).size() + 1));
        int64_t n = 0;
        for (size_t i = str->find(x); i != std::string::npos; i = str->find(x, i + x.size())) ++n;
        return Value(n);
      }
      const size_t pos = name[0] == 'r' ? str->rfind(x) : str->find(x);
      if (pos == std::string::npos) {
        check(name == "find" || name == "rfind", "substring not found");
        return Value(int64_t{-1});
      }
      return Value(static_cast<int64_t>(utf8::decode(std::string_view(*str).substr(0, pos)).size()));
    });
  }
  if (name == "join") {
    return m([str](CallArgs& a) {
      std::string out;
      const List items = iterate(a.get(0, "iterable"));
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += *str;
        out += need_str(items[i], "join() item");
      }
      return Value(std::move(out));
    });
  }
  if (name == "isdigit" || name == "isalpha" || name == "isspace" || name == "isalnum" || name == "islower" ||
      name == "isupper") {
    return m([str, name](CallArgs&) {
      if (str->empty()) return Value(false);
      bool cased = false, ok = true;
      for (size_t i = 0; i < str->size() && ok;) {
        const char32_t c = utf8::next(*str, i);
        const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
        const bool letter = cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO;
        const bool digit = cat == UTF8PROC_CATEGORY_ND;
        if (name == "isdigit") ok = digit;
        else if (name == "isalpha") ok = letter;
        else if (name == "isalnum") ok = letter || digit || (cat >= UTF8PROC_CATEGORY_ND && cat <= UTF8PROC_CATEGORY_NO);
        else if (name == "isspace") ok = py_isspace(c);
        else if (name == "islower") ok = cat != UTF8PROC_CATEGORY_LU && cat != UTF8PROC_CATEGORY_LT, cased |= cat == UTF8PROC_CATEGORY_LL;
        else ok = cat != UTF8PROC_CATEGORY_LL && cat != UTF8PROC_CATEGORY_LT, cased |= cat == UTF8PROC_CATEGORY_LU;
      }
      if (name == "islower" || name == "isupper") ok = ok && cased;
      return Value(ok);
    });
  }
  return Value::undefined(name);
}

Value dict_method(const Value& d, const std::string& name) {
  if (name == "items" || name == "keys" || name == "values") {
    return bound(name, [d, name](CallArgs&) {
      List out;
      for (const auto& [k, v] : d.dict().items) {
        if (name == "items") out.push_back(Value(List{k, v}, true));
        else out.push_back(name == "keys" ? k : v);
      }
      return Value(std::move(out));
    });
  }
  if (name == "get") {
    return bound(name, [d](CallArgs& a) {
      const Value* v = d.dict().find(a.get(0, "key"));
      return v ? *v : a.get(1, "default", Value::none());
    });
  }
  static const std::set<std::string> unsafe = {"pop", "popitem", "update", "setdefault", "clear", "copy", "fromkeys"};
  if (unsafe.count(name)) {
    return bound(name, [name](CallArgs&) -> Value { throw Error(cat("dict.", name, "() is not allowed in a sandbox")); });
  }
  return Value();  // not a method
}

Value list_method(const Value& l, const std::string& name) {
  if (name == "index" || name == "count") {
    return bound(name, [l, name](CallArgs& a) {
      const Value x = a.get(0, "value");
      int64_t n = 0;
      for (size_t i = 0; i < l.list().size(); ++i) {
        if (equals(l.list()[i], x)) {
          if (name == "index") return Value(static_cast<int64_t>(i));
          ++n;
        }
      }
      check(name == "count", "value is not in list");
      return Value(n);
    });
  }
  static const std::set<std::string> unsafe = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"};
  if (unsafe.count(name)) {
    return bound(name, [name](CallArgs&) -> Value { throw Error(cat("list.", name, "() is not allowed in a sandbox")); });
  }
  return Value::undefined(name);
}

// ---- filters ----

Value attr_path(const Value& v, const std::string& path) {
  Value cur = v;
  size_t i = 0;
  while (true) {
    const size_t j = path.find('.', i);
    const std::string part = path.substr(i, j == std::string::npos ? std::string::npos : j - i);
    const bool digits = !part.empty() && part.size() <= 18 && part.find_first_not_of("0123456789") == std::string::npos;
    cur = digits ? get_item(cur, Value(static_cast<int64_t>(std::stoll(part)))) : get_item(cur, Value(part));
    if (j == std::string::npos) return cur;
    i = j + 1;
  }
}

// Sort/unique/min/max key: lower-cased strings unless case_sensitive.
Value sort_key(const Value& v, bool case_sensitive, const Value& attribute) {
  Value k = attribute.is_undefined() || attribute.is_none() ? v : attr_path(v, attribute.str());
  if (!case_sensitive && k.is_string()) return Value(map_case(k.str_ref(), 0));
  return k;
}

std::string indent_text(const Interpreter& it, const std::string& s, const Value& width_v, bool first, bool blank) {
  // Python's ' ' * width: empty when negative; a huge one is over the output limit
  // (a negative width used to become a huge std::string length and abort).
  std::string pad;
  if (width_v.is_string()) {
    pad = width_v.str_ref();
  } else {
    const int64_t width = std::max<int64_t>(need_int(width_v, "width"), 0);
    it.check_size(static_cast<size_t>(width));
    pad.assign(static_cast<size_t>(width), ' ');
  }
  std::string out;
  size_t i = 0;
  bool is_first = true;
  // Python's splitlines() keeps the line ends; jinja rejoins with "\n".
  std::vector<std::string> lines;
  while (i <= s.size()) {
    const size_t j = s.find('\n', i);
    lines.push_back(s.substr(i, j == std::string::npos ? std::string::npos : j - i));
    if (j == std::string::npos) break;
    i = j + 1;
  }
  const bool trailing_newline = !s.empty() && s.back() == '\n';
  if (trailing_newline) lines.pop_back();
  it.check_size(s.size() + pad.size() * lines.size());
  for (size_t k = 0; k < lines.size(); ++k) {
    if (!is_first) out += "\n";
    const bool add = (k == 0 ? first : true) && (blank || !lines[k].empty() || k == 0);
    if (add && !(k == 0 && !first)) out += pad;
    out += lines[k];
    is_first = false;
  }
  if (trailing_newline) out += "\n";
  return out;
}

bool call_test(Interpreter& it, const Value& test_name, const Value& v, const List& extra) {
  CallArgs a;
  a.args = extra;
  return apply_test(it, need_str(test_name, "test name"), v, a);
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

const std::set<std::string>& filter_names() {
  static const std::set<std::string> names = {
      "abs",     "attr",      "capitalize", "center",     "count",  "d",       "default", "dictsort", "e",
      "escape",  "first",     "float",      "indent",     "int",    "items",   "join",    "last",     "length",
      "list",    "lower",     "map",        "max",        "min",    "reject",  "rejectattr", "replace", "reverse",
      "round",   "safe",      "select",     "selectattr", "sort",   "string",  "sum",     "title",    "tojson",
      "trim",    "unique",    "upper",      "wordcount"};
  return names;
}

const std::set<std::string>& test_names() {
  static const std::set<std::string> names = {
      "boolean", "callable", "defined", "divisibleby", "eq",       "equalto", "escaped",  "even",
      "false",   "float",    "ge",      "greaterthan", "gt",       "in",      "integer",  "iterable",
      "le",      "lessthan", "lower",   "lt",          "mapping",  "ne",      "none",     "number",
      "odd",     "sameas",   "sequence", "string",     "true",     "undefined", "upper",  "==",
      "!=",      "<",        "<=",      ">",           ">="};
  return names;
}

}  // namespace

bool has_filter(const std::string& name) { return filter_names().count(name) > 0; }
bool has_test(const std::string& name) { return test_names().count(name) > 0; }

int64_t length(const Value& v) {
  switch (v.kind()) {
    case K::Undefined: return 0;
    case K::String: return static_cast<int64_t>(utf8::decode(v.str_ref()).size());
    case K::List: return static_cast<int64_t>(v.list().size());
    case K::Dict:
    case K::Namespace: return static_cast<int64_t>(v.dict().items.size());
    default: throw Error(cat("object of type '", v.type_name(), "' has no len()"));
  }
}

List iterate(const Value& v) {
  switch (v.kind()) {
    case K::Undefined: return {};
    case K::List: return v.list();
    case K::Dict: {
      List out;
      for (const auto& kv : v.dict().items) out.push_back(kv.first);
      return out;
    }
    case K::String: {
      List out;
      const std::string& s = v.str_ref();
      for (size_t i = 0; i < s.size();) {
        const size_t j = i;
        utf8::next(s, i);
        out.push_back(Value(s.substr(j, i - j)));
      }
      return out;
    }
    default: throw Error(cat("'", v.type_name(), "' object is not iterable"));
  }
}

bool contains(const Value& c, const Value& item) {
  switch (c.kind()) {
    case K::String: return c.str_ref().find(need_str(item, "left operand of 'in <string>'")) != std::string::npos;
    case K::List:
      for (const Value& x : c.list()) {
        if (equals(x, item)) return true;
      }
      return false;
    case K::Dict: return c.dict().find(item) != nullptr;
    case K::Undefined: return false;
    default: throw Error(cat("argument of type '", c.type_name(), "' is not iterable"));
  }
}

Value get_attr(const Value& obj, const std::string& name) {
  switch (obj.kind()) {
    case K::String: return string_method(obj.str_ref(), name);
    case K::List: return list_method(obj, name);
    case K::Dict: {
      Value m = dict_method(obj, name);
      if (!m.is_undefined()) return m;
      const Value* v = obj.dict().find(Value(name));
      return v ? *v : Value::undefined(name);
    }
    case K::Namespace: {
      const Value* v = obj.dict().find(Value(name));
      return v ? *v : Value::undefined(name);
    }
    default: return Value::undefined(name);
  }
}

Value get_item(const Value& obj, const Value& key) {
  if ((obj.is_list() || obj.is_string()) && (key.kind() == K::Int || key.kind() == K::Bool)) {
    int64_t i = key.as_int();
    if (obj.is_list()) {
      const auto n = static_cast<int64_t>(obj.list().size());
      if (i < 0) i += n;
      return i >= 0 && i < n ? obj.list()[i] : Value::undefined();
    }
    const std::u32string u = utf8::decode(obj.str_ref());
    const auto n = static_cast<int64_t>(u.size());
    if (i < 0) i += n;
    return i >= 0 && i < n ? Value(utf8::encode(std::u32string(1, u[i]))) : Value::undefined();
  }
  if (obj.is_dict()) {
    const Value* v = obj.dict().find(key);
    if (v) return *v;
  }
  if (key.is_string()) return get_attr(obj, key.str_ref());
  return Value::undefined();
}

Value slice(const Value& obj, const Value& start_v, const Value& stop_v, const Value& step_v) {
  check(obj.is_list() || obj.is_string(), "'", obj.type_name(), "' object is not subscriptable");
  const int64_t step = step_v.is_none() ? 1 : need_int(step_v, "slice step");
  check(step != 0, "slice step cannot be zero");
  List items;
  std::u32string u;
  if (obj.is_list()) items = obj.list();
  else u = utf8::decode(obj.str_ref());
  const int64_t n = obj.is_list() ? static_cast<int64_t>(items.size()) : static_cast<int64_t>(u.size());
  auto norm = [&](const Value& v, int64_t def, bool is_start) {
    if (v.is_none()) return def;
    int64_t i = need_int(v, "slice index");
    if (i < 0) i += n;
    if (step > 0) return std::clamp<int64_t>(i, 0, n);
    (void)is_start;
    return std::clamp<int64_t>(i, -1, n - 1);
  };
  const int64_t start = norm(start_v, step > 0 ? 0 : n - 1, true);
  const int64_t stop = norm(stop_v, step > 0 ? n : -1, false);
  List out;
  std::u32string us;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
    if (obj.is_list()) out.push_back(items[i]);
    else us += u[i];
  }
  if (obj.is_list()) return Value(std::move(out));
  return Value(utf8::encode(us));
}

Value apply_filter(Interpreter& it, const std::string& name, const Value& in, CallArgs& a) {
  if (name == "tojson") {
    const Value indent = a.get(1, "indent", Value::none());
    const Value seps = a.get(2, "separators", Value::none());
    const bool sort_keys = a.get(3, "sort_keys", Value(false)).truthy();
    const int ind = indent.is_none() ? -1 : static_cast<int>(std::clamp<int64_t>(need_int(indent, "indent"), 0, 64));
    std::string item_sep = ind >= 0 ? "," : ", ", key_sep = ": ";
    if (!seps.is_none()) {
      const List s = iterate(seps);
      check(s.size() == 2, "separators must be a pair");
      item_sep = need_str(s[0], "separator"), key_sep = need_str(s[1], "separator");
    }
    return Value(to_json(in, ind, item_sep, key_sep, sort_keys));
  }
  if (name == "length" || name == "count") return Value(length(in));
  if (name == "trim") return Value(py_strip(in.str(), a.get(0, "chars"), true, true));
  if (name == "default" || name == "d") {
    const bool boolean = a.get(1, "boolean", Value(false)).truthy();
    if (in.is_undefined() || (boolean && !in.truthy())) return a.get(0, "default_value", Value(""));
    return in;
  }
  if (name == "items") {
    if (in.is_undefined()) return Value(List{});
    check(in.is_dict(), "can only get item pairs from a mapping");
    List out;
    for (const auto& [k, v] : in.dict().items) out.push_back(Value(List{k, v}, true));
    return Value(std::move(out));
  }
  if (name == "dictsort") {
    check(in.is_dict(), "dictsort needs a mapping");
    const bool cs = a.get(0, "case_sensitive", Value(false)).truthy();
    const std::string by = a.get(1, "by", Value("key")).str();
    const bool rev = a.get(2, "reverse", Value(false)).truthy();
    List out;
    for (const auto& [k, v] : in.dict().items) out.push_back(Value(List{k, v}, true));
    std::stable_sort(out.begin(), out.end(), [&](const Value& x, const Value& y) {
      const size_t i = by == "value" ? 1 : 0;
      const Value kx = sort_key(x.list()[i], cs, Value()), ky = sort_key(y.list()[i], cs, Value());
      return rev ? less(ky, kx) : less(kx, ky);
    });
    return Value(std::move(out));
  }
  if (name == "first" || name == "last") {
    const List items = iterate(in);
    if (items.empty()) return Value::undefined();
    return name == "first" ? items.front() : items.back();
  }
  if (name == "join") {
    const std::string sep = a.get(0, "d", Value("")).str();
    const Value attribute = a.get(1, "attribute");
    std::string out;
    const List items = iterate(in);
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out += sep;
      out += (attribute.is_undefined() || attribute.is_none() ? items[i] : attr_path(items[i], attribute.str())).str();
      it.check_size(out.size());
    }
    return Value(std::move(out));
  }
  if (name == "upper") return Value(map_case(in.str(), 1));
  if (name == "lower") return Value(map_case(in.str(), 0));
  if (name == "capitalize") return Value(py_capitalize(in.str()));
  if (name == "title") return Value(py_title(in.str()));
  if (name == "replace") {
    return Value(py_replace(in.str(), a.get(0, "old").str(), a.get(1, "new").str(),
                            need_int(a.get(2, "count", Value(int64_t{-1})), "count")));
  }
  if (name == "string") return in.is_string() ? in : Value(in.str());
  if (name == "safe") return in;
  if (name == "e" || name == "escape") return Value(html_escape(in.str()));
  if (name == "int") {
    const Value def = a.get(0, "default", Value(int64_t{0}));
    if (in.kind() == K::Int || in.kind() == K::Bool) return Value(in.as_int());
    if (in.kind() == K::Float) {
      if (!std::isfinite(in.as_float()) || std::fabs(in.as_float()) > 9.2e18) return def;
      return Value(static_cast<int64_t>(in.as_float()));
    }
    if (in.is_string()) {
      const std::string s = py_strip(in.str_ref(), Value(), true, true);
      try {
        size_t pos = 0;
        const long long v = std::stoll(s, &pos, 10);
        if (pos == s.size()) return Value(static_cast<int64_t>(v));
        const double d = std::stod(s, &pos);
        if (pos == s.size() && std::isfinite(d)) return Value(static_cast<int64_t>(d));
      } catch (const std::exception&) {
      }
    }
    return def;
  }
  if (name == "float") {
    const Value def = a.get(0, "default", Value(0.0));
    if (in.is_number()) return Value(in.as_float());
    if (in.is_string()) {
      try {
        size_t pos = 0;
        const std::string s = py_strip(in.str_ref(), Value(), true, true);
        const double d = std::stod(s, &pos);
        if (pos == s.size()) return Value(d);
      } catch (const std::exception&) {
      }
    }
    return def;
  }
  if (name == "list") return Value(iterate(in));
  if (name == "reverse") {
    if (in.is_string()) {
      std::u32string u = utf8::decode(in.str_ref());
      std::reverse(u.begin(), u.end());
      return Value(utf8::encode(u));
    }
    List items = iterate(in);
    std::reverse(items.begin(), items.end());
    return Value(std::move(items));
  }
  if (name == "unique") {
    const bool cs = a.get(0, "case_sensitive", Value(false)).truthy();
    const Value attribute = a.get(1, "attribute");
    List out, keys;
    for (const Value& v : iterate(in)) {
      const Value k = sort_key(v, cs, attribute);
      bool seen = false;
      for (const Value& x : keys) seen = seen || equals(x, k);
      if (!seen) keys.push_back(k), out.push_back(v);
    }
    return Value(std::move(out));
  }
  if (name == "sort") {
    const bool rev = a.get(0, "reverse", Value(false)).truthy();
    const bool cs = a.get(1, "case_sensitive", Value(false)).truthy();
    const Value attribute = a.get(2, "attribute");
    List items = iterate(in);
    std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
      const Value kx = sort_key(x, cs, attribute), ky = sort_key(y, cs, attribute);
      return rev ? less(ky, kx) : less(kx, ky);
    });
    return Value(std::move(items));
  }
  if (name == "min" || name == "max") {
    const bool cs = a.get(0, "case_sensitive", Value(false)).truthy();
    const Value attribute = a.get(1, "attribute");
    const List items = iterate(in);
    if (items.empty()) return Value::undefined();
    size_t best = 0;
    for (size_t i = 1; i < items.size(); ++i) {
      const Value ki = sort_key(items[i], cs, attribute), kb = sort_key(items[best], cs, attribute);
      if (name == "min" ? less(ki, kb) : less(kb, ki)) best = i;
    }
    return items[best];
  }
  if (name == "sum") {
    const Value attribute = a.get(0, "attribute");
    Value acc = a.get(1, "start", Value(int64_t{0}));
    for (const Value& v : iterate(in)) {
      const Value x = attribute.is_undefined() || attribute.is_none() ? v : attr_path(v, attribute.str());
      check(acc.is_number() && x.is_number(), "sum of non-numbers");
      if (acc.kind() == K::Float || x.kind() == K::Float) acc = Value(acc.as_float() + x.as_float());
      else {
        int64_t r;
        check(!__builtin_add_overflow(acc.as_int(), x.as_int(), &r), "integer overflow");
        acc = Value(r);
      }
    }
    return acc;
  }
  if (name == "abs") {
    check(in.is_number(), "bad operand type for abs(): '", in.type_name(), "'");
    if (in.kind() == K::Float) return Value(std::fabs(in.as_float()));
    check(in.as_int() != INT64_MIN, "integer overflow");
    return Value(std::abs(in.as_int()));
  }
  if (name == "round") {
    check(in.is_number(), "round needs a number");
    const int64_t prec = need_int(a.get(0, "precision", Value(int64_t{0})), "precision");
    const std::string method = a.get(1, "method", Value("common")).str();
    const double x = in.as_float();
    if (method == "common") {
      // Python's round(): the correctly rounded decimal, ties to even; printf does exactly that.
      if (prec >= 0 && std::isfinite(x)) {
        char buf[400];
        std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(std::min<int64_t>(prec, 300)), x);
        return Value(std::strtod(buf, nullptr));
      }
      const double m = std::pow(10.0, static_cast<double>(std::clamp<int64_t>(-prec, 0, 300)));
      return Value(std::nearbyint(x / m) * m);
    }
    const double m = std::pow(10.0, static_cast<double>(std::clamp<int64_t>(prec, -300, 300)));
    if (method == "ceil") return Value(std::ceil(x * m) / m);
    if (method == "floor") return Value(std::floor(x * m) / m);
    throw Error("method must be common, ceil or floor");
  }
  if (name == "indent") {
    return Value(indent_text(it, in.str(), a.get(0, "width", Value(int64_t{4})), a.get(1, "first", Value(false)).truthy(),
                             a.get(2, "blank", Value(false)).truthy()));
  }
  if (name == "center") {
    const int64_t width = need_int(a.get(0, "width", Value(int64_t{80})), "width");
    const std::string s = in.str();
    const int64_t len = static_cast<int64_t>(utf8::decode(s).size());
    if (width <= len) return Value(s);
    it.check_size(static_cast<size_t>(width));
    const int64_t total = width - len, left = total / 2 + (total & width & 1);
    return Value(std::string(left, ' ') + s + std::string(total - left, ' '));
  }
  if (name == "wordcount") return Value(static_cast<int64_t>(py_split(in.str(), Value(), -1).size()));
  if (name == "attr") return get_attr(in, need_str(a.get(0, "name"), "attribute name"));
  if (name == "map") {
    List out;
    const Value attribute = a.get(99, "attribute");
    if (!attribute.is_undefined()) {
      const Value def = a.get(99, "default");
      for (const Value& v : iterate(in)) {
        Value x = attr_path(v, attribute.str());
        out.push_back(x.is_undefined() && !def.is_undefined() ? def : x);
      }
      return Value(std::move(out));
    }
    check(!a.args.empty(), "map needs a filter name or attribute=");
    const std::string f = need_str(a.args[0], "filter name");
    check(has_filter(f), "no filter named '", f, "'");
    for (const Value& v : iterate(in)) {
      CallArgs sub;
      sub.args.assign(a.args.begin() + 1, a.args.end());
      sub.kwargs = a.kwargs;
      out.push_back(apply_filter(it, f, v, sub));
    }
    return Value(std::move(out));
  }
  if (name == "select" || name == "reject") {
    const bool want = name == "select";
    List out;
    for (const Value& v : iterate(in)) {
      bool ok;
      if (a.args.empty()) ok = v.truthy();
      else ok = call_test(it, a.args[0], v, List(a.args.begin() + 1, a.args.end()));
      if (ok == want) out.push_back(v);
    }
    return Value(std::move(out));
  }
  if (name == "selectattr" || name == "rejectattr") {
    const bool want = name == "selectattr";
    check(!a.args.empty(), name, " needs an attribute name");
    const std::string attr = need_str(a.args[0], "attribute name");
    List out;
    for (const Value& v : iterate(in)) {
      const Value x = attr_path(v, attr);
      bool ok;
      if (a.args.size() < 2) ok = x.truthy();
      else ok = call_test(it, a.args[1], x, List(a.args.begin() + 2, a.args.end()));
      if (ok == want) out.push_back(v);
    }
    return Value(std::move(out));
  }
  throw Error(cat("no filter named '", name, "'"));
}

bool apply_test(Interpreter& it, const std::string& name, const Value& v, CallArgs& a) {
  const Value arg = a.get(0, "other");
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "boolean") return v.kind() == K::Bool;
  if (name == "true") return v.kind() == K::Bool && v.as_bool();
  if (name == "false") return v.kind() == K::Bool && !v.as_bool();
  if (name == "integer") return v.kind() == K::Int;
  if (name == "float") return v.kind() == K::Float;
  if (name == "number") return v.is_number();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.kind() == K::Dict;
  if (name == "iterable") return v.is_undefined() || v.is_list() || v.kind() == K::Dict || v.is_string();
  if (name == "sequence") return v.is_list() || v.kind() == K::Dict || v.is_string();
  if (name == "callable") return v.is_callable();
  if (name == "escaped") return false;
  if (name == "lower" || name == "upper") {
    if (!v.is_string()) return false;
    CallArgs none;
    return string_method(v.str_ref(), name == "lower" ? "islower" : "isupper").fn()(none).as_bool();
  }
  if (name == "sameas") {
    if (v.kind() != arg.kind()) return false;
    switch (v.kind()) {
      case K::None:
      case K::Undefined: return true;
      case K::Bool: return v.as_bool() == arg.as_bool();
      case K::Int: return v.as_int() == arg.as_int() && v.as_int() >= -5 && v.as_int() <= 256;
      case K::List: return &v.list() == &arg.list();
      case K::Dict:
      case K::Namespace: return v.dict_ptr() == arg.dict_ptr();
      default: return false;
    }
  }
  if (name == "eq" || name == "equalto" || name == "==") return equals(v, arg);
  if (name == "ne" || name == "!=") return !equals(v, arg);
  if (name == "lt" || name == "lessthan" || name == "<") return less(v, arg);
  if (name == "le" || name == "<=") return less(v, arg) || equals(v, arg);
  if (name == "gt" || name == "greaterthan" || name == ">") return less(arg, v);
  if (name == "ge" || name == ">=") return less(arg, v) || equals(v, arg);
  if (name == "in") return contains(arg, v);
  if (name == "odd" || name == "even") {
    const int64_t i = need_int(v, "value");
    return ((i % 2) != 0) == (name == "odd");
  }
  if (name == "divisibleby") {
    const int64_t d = need_int(arg, "divisor");
    check(d != 0, "integer division or modulo by zero");
    return need_int(v, "value") % d == 0;
  }
  (void)it;
  throw Error(cat("no test named '", name, "'"));
}

}  // namespace dflash::jinja
