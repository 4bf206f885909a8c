// Filters, tests, attribute/item access and methods of strings, lists and
// dicts, with the behaviour of jinja2's built-ins and Python's str/dict methods.
#pragma once

#include <string>

#include "formats/jinja/value.h"

namespace dflash::jinja {

class Interpreter;

bool has_filter(const std::string& name);
bool has_test(const std::string& name);
// `in` is the value being filtered/tested; call.args exclude it.
Value apply_filter(Interpreter& it, const std::string& name, const Value& in, CallArgs& call);
bool apply_test(Interpreter& it, const std::string& name, const Value& in, CallArgs& call);

// jinja2 getattr / getitem semantics (methods of str, list and dict included).
Value get_attr(const Value& obj, const std::string& name);
Value get_item(const Value& obj, const Value& key);
Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);

// Python len() and iteration (dict -> keys, str -> characters).
int64_t length(const Value& v);
List iterate(const Value& v);
bool contains(const Value& container, const Value& item);

}  // namespace dflash::jinja
