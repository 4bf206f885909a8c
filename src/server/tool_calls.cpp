#include "server/tool_calls.h"

#include "server/openai_protocol.h"
#include "util/error.h"

namespace dflash::server {

using nlohmann::json;

namespace {

constexpr std::string_view kCallOpen = "<tool_call>", kCallClose = "</tool_call>";

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

bool all_space(std::string_view s) { return trim(s).empty(); }

size_t partial_tag(std::string_view s, std::string_view tag) {
  for (size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n)
    if (s.substr(s.size() - n) == tag.substr(0, n)) return n;
  return 0;
}

// A JSON value from model output; discarded (not thrown) when malformed or nested too deep.
json parse_json(std::string_view text) {
  if (json_depth_exceeds(text, kMaxJsonDepth)) return json::value_t::discarded;
  return json::parse(text, nullptr, /*allow_exceptions=*/false);
}

// End of the JSON object starting at s[i] == '{' (one past its '}'), or npos.
size_t object_end(std::string_view s, size_t i) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{') {
      ++depth;
    } else if (c == '}' && --depth == 0) {
      return i + 1;
    }
  }
  return std::string_view::npos;
}

}  // namespace

ToolCallFormat parse_tool_call_format(const std::string& name, const std::string& template_source) {
  if (name == "none") return ToolCallFormat::None;
  if (name == "hermes") return ToolCallFormat::Hermes;
  if (name == "llama3_json") return ToolCallFormat::Llama3Json;
  if (name != "auto") throw Error("unknown tool-call parser '" + name + "' (auto | hermes | llama3_json | none)");
  const bool llama = template_source.find("<|python_tag|>") != std::string::npos ||
                     template_source.find("<|start_header_id|>") != std::string::npos;
  return llama ? ToolCallFormat::Llama3Json : ToolCallFormat::Hermes;
}

ToolCallParser::ToolCallParser(ToolCallFormat format, const json& tools) : format_(format), tools_(tools) {
  if (!tools.is_array()) return;
  for (const auto& t : tools)
    if (t.is_object() && t.contains("function") && t["function"].is_object() && t["function"].contains("name") &&
        t["function"]["name"].is_string())
      names_.insert(t["function"]["name"].get<std::string>());
}

bool ToolCallParser::parse_call(const json& j, ToolCall& out) const {
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) return false;
  const std::string name = j["name"].get<std::string>();
  if (!names_.count(name)) return false;
  json args = j.contains("arguments") ? j["arguments"] : j.contains("parameters") ? j["parameters"] : json::object();
  if (args.is_string()) args = parse_json(args.get<std::string>());
  if (args.is_null()) args = json::object();
  if (!args.is_object()) return false;
  out = {{}, name, args.dump(-1, ' ', false, json::error_handler_t::replace)};
  return true;
}

// <function=NAME>\n<parameter=P>\nVALUE\n</parameter>...</function>; values are strings unless the
// tool's schema gives the parameter another type and the value parses as JSON.
bool ToolCallParser::parse_xml_call(std::string_view body, ToolCall& out) const {
  constexpr std::string_view kFn = "<function=", kFnEnd = "</function>", kPar = "<parameter=", kParEnd = "</parameter>";
  body = trim(body);
  if (!body.starts_with(kFn) || !body.ends_with(kFnEnd)) return false;
  body.remove_suffix(kFnEnd.size());
  const size_t gt = body.find('>');
  if (gt == std::string_view::npos) return false;
  const std::string name(trim(body.substr(kFn.size(), gt - kFn.size())));
  if (!names_.count(name)) return false;
  json props = json::object();
  for (const auto& t : tools_)
    if (t.contains("function") && t["function"].value("name", "") == name && t["function"].contains("parameters") &&
        t["function"]["parameters"].is_object() && t["function"]["parameters"].contains("properties"))
      props = t["function"]["parameters"]["properties"];
  json args = json::object();
  std::string_view rest = trim(body.substr(gt + 1));
  while (!rest.empty()) {
    if (!rest.starts_with(kPar)) return false;
    const size_t pgt = rest.find('>'), end = rest.find(kParEnd);
    if (pgt == std::string_view::npos || end == std::string_view::npos || end < pgt) return false;
    const std::string key(trim(rest.substr(kPar.size(), pgt - kPar.size())));
    std::string_view value = rest.substr(pgt + 1, end - pgt - 1);
    if (value.starts_with('\n')) value.remove_prefix(1);
    if (value.ends_with('\n')) value.remove_suffix(1);
    const bool is_string = props.is_object() && props.contains(key) && props[key].is_object() &&
                           props[key].value("type", "") == "string";
    json v = is_string ? json(json::value_t::discarded) : parse_json(value);
    args[key] = v.is_discarded() ? json(std::string(value)) : v;
    rest = trim(rest.substr(end + kParEnd.size()));
  }
  out = {{}, name, args.dump(-1, ' ', false, json::error_handler_t::replace)};
  return true;
}

// Trailing whitespace is held: dropped when a call follows, sent when more text does.
void ToolCallParser::add_content(Output& out, std::string_view text) {
  size_t end = text.size();
  while (end > 0 && is_space(text[end - 1])) --end;
  if (end > 0) {
    out.content += pending_space_;
    out.content += text.substr(0, end);
    pending_space_.clear();
  }
  pending_space_ += text.substr(end);
}

ToolCallParser::Output ToolCallParser::push_hermes() {
  Output out;
  for (;;) {
    if (!in_call_) {
      const size_t open = held_.find(kCallOpen);
      if (open == std::string::npos) {
        const size_t keep = partial_tag(held_, kCallOpen);
        add_content(out, std::string_view(held_).substr(0, held_.size() - keep));
        held_.erase(0, held_.size() - keep);
        return out;
      }
      add_content(out, std::string_view(held_).substr(0, open));
      held_.erase(0, open + kCallOpen.size());
      in_call_ = true;
    }
    const size_t close = held_.find(kCallClose);
    if (close == std::string::npos) return out;
    const std::string_view body = std::string_view(held_).substr(0, close);
    ToolCall call;
    if (parse_call(parse_json(trim(body)), call) || parse_xml_call(body, call)) {
      out.calls.push_back(std::move(call));
      ++n_calls_;
      pending_space_.clear();  // whitespace between calls is not content
    } else {
      add_content(out, std::string(kCallOpen) + std::string(body) + std::string(kCallClose));
    }
    held_.erase(0, close + kCallClose.size());
    in_call_ = false;
  }
}

std::vector<ToolCall> ToolCallParser::llama_calls(std::string_view text) const {
  std::vector<ToolCall> calls;
  size_t i = 0;
  for (;;) {
    while (i < text.size() && (is_space(text[i]) || text[i] == ';')) ++i;
    if (i == text.size()) return calls;
    if (text[i] != '{') return {};
    const size_t end = object_end(text, i);
    ToolCall call;
    if (end == std::string_view::npos || !parse_call(parse_json(text.substr(i, end - i)), call)) return {};
    calls.push_back(std::move(call));
    i = end;
  }
}

ToolCallParser::Output ToolCallParser::push(std::string_view text) {
  held_ += text;
  if (format_ == ToolCallFormat::Hermes) return push_hermes();
  Output out;
  if (format_ == ToolCallFormat::Llama3Json && !started_) {
    if (all_space(held_)) return out;
    started_ = true;
    llama_json_ = trim(held_).front() == '{';  // may be a call: held until the end
  }
  if (!llama_json_) {
    out.content = std::move(held_);
    held_.clear();
  }
  return out;
}

ToolCallParser::Output ToolCallParser::finish() {
  Output out;
  if (format_ == ToolCallFormat::Hermes) {
    if (in_call_) {
      ToolCall call;  // an unclosed last block counts when it parses (as vLLM's hermes parser)
      if (parse_call(parse_json(trim(held_)), call) || parse_xml_call(held_, call)) {
        out.calls.push_back(std::move(call));
        ++n_calls_;
        held_.clear();
      } else {
        held_.insert(0, kCallOpen);
      }
    }
  } else if (llama_json_) {
    out.calls = llama_calls(held_);
    n_calls_ += static_cast<int>(out.calls.size());
    if (!out.calls.empty()) held_.clear();
  }
  if (!held_.empty()) {
    out.content += pending_space_ + held_;
    pending_space_.clear();
  }
  if (n_calls_ == 0) out.content.insert(0, pending_space_);
  held_.clear();
  return out;
}

}  // namespace dflash::server
