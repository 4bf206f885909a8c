#include "server/request_fields.h"

#include <charconv>

#include "server/openai_protocol.h"

namespace dflash::server {

using nlohmann::json;

namespace {

bool given(const json& b, const std::string& key) { return b.contains(key) && !b[key].is_null(); }

std::string range_text(double lo, double hi) {
  auto num = [](double v) {
    std::string s = std::to_string(v);
    s.erase(s.find_last_not_of('0') + 1);
    if (s.back() == '.') s.pop_back();
    return s;
  };
  return num(lo) + ".." + num(hi);
}

}  // namespace

void bad_field(const std::string& param, const std::string& message) { throw ApiError(400, message, param); }

double number_field(const json& b, const std::string& key) {
  if (!b[key].is_number()) bad_field(key, "'" + key + "' must be a number, got " + b[key].dump());
  return b[key].get<double>();
}

void read_number(const json& b, const std::string& key, double lo, double hi, float& out) {
  if (!given(b, key)) return;
  const double v = number_field(b, key);
  if (!(v >= lo && v <= hi)) bad_field(key, "'" + key + "' must be in " + range_text(lo, hi) + ", got " + b[key].dump());
  out = static_cast<float>(v);
}

void read_int(const json& b, const std::string& key, int64_t lo, int64_t hi, int& out) {
  if (!given(b, key)) return;
  const json& v = b[key];
  if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi)) ||
      v.get<int64_t>() < lo || v.get<int64_t>() > hi)
    bad_field(key, "'" + key + "' must be an integer in " + std::to_string(lo) + ".." + std::to_string(hi) + ", got " +
                       v.dump());
  out = static_cast<int>(v.get<int64_t>());
}

void read_bool(const json& b, const std::string& key, bool& out) {
  if (!given(b, key)) return;
  if (!b[key].is_boolean()) bad_field(key, "'" + key + "' must be a boolean, got " + b[key].dump());
  out = b[key].get<bool>();
}

void read_penalties(const json& b, int32_t n_vocab, SamplingParams& s) {
  read_number(b, "presence_penalty", -2, 2, s.presence_penalty);
  read_number(b, "frequency_penalty", -2, 2, s.frequency_penalty);
  if (given(b, "repetition_penalty")) {
    const double v = number_field(b, "repetition_penalty");
    if (!(v > 0 && v <= 10)) bad_field("repetition_penalty", "'repetition_penalty' must be in (0, 10], got " + b["repetition_penalty"].dump());
    s.repetition_penalty = static_cast<float>(v);
  }
  if (!given(b, "logit_bias")) return;
  const json& lb = b["logit_bias"];
  if (!lb.is_object()) bad_field("logit_bias", "'logit_bias' must be an object of token id -> bias");
  if (lb.size() > 1024) bad_field("logit_bias", "'logit_bias' has more than 1024 entries");
  s.logit_bias.clear();
  for (const auto& [k, v] : lb.items()) {
    int64_t id = -1;
    const auto [end, ec] = std::from_chars(k.data(), k.data() + k.size(), id);
    if (ec != std::errc() || end != k.data() + k.size() || id < 0 || id >= n_vocab)
      bad_field("logit_bias", "'logit_bias' key '" + k + "' is not a token id of this model (0.." +
                                  std::to_string(n_vocab - 1) + ")");
    if (!v.is_number() || !(v.get<double>() >= -100 && v.get<double>() <= 100))
      bad_field("logit_bias", "'logit_bias' values must be numbers in -100..100, got " + v.dump() + " for " + k);
    s.logit_bias.emplace_back(static_cast<int32_t>(id), v.get<float>());
  }
}

int read_logprobs(const json& b, bool chat) {
  if (!chat) {
    int n = -1;
    if (given(b, "logprobs") && b["logprobs"].is_boolean())
      bad_field("logprobs", "completions take 'logprobs' as an integer 0.." + std::to_string(kMaxLogprobs));
    read_int(b, "logprobs", 0, kMaxLogprobs, n);
    return n;
  }
  bool on = false;
  int top = 0;
  read_bool(b, "logprobs", on);
  read_int(b, "top_logprobs", 0, kMaxLogprobs, top);
  if (given(b, "top_logprobs") && !on)
    bad_field("top_logprobs", "'top_logprobs' needs 'logprobs': true");
  return on ? top : -1;
}

ToolUse read_tool_use(const json& b) {
  ToolUse u;
  const bool has_tools = given(b, "tools") && !b["tools"].empty();
  if (given(b, "tools")) {
    if (!b["tools"].is_array()) bad_field("tools", "'tools' must be a list");
    for (size_t i = 0; i < b["tools"].size(); ++i) {
      const json& t = b["tools"][i];
      const std::string where = "tools[" + std::to_string(i) + "]";
      if (!t.is_object() || t.value("type", json()) != "function" || !t.contains("function") ||
          !t["function"].is_object() || !t["function"].contains("name") || !t["function"]["name"].is_string())
        bad_field(where, where + " must be {\"type\": \"function\", \"function\": {\"name\": ..., ...}}");
    }
  }
  std::string choice = has_tools ? "auto" : "none";
  if (given(b, "tool_choice")) {
    const json& c = b["tool_choice"];
    if (c.is_object() || c == "required")
      bad_field("tool_choice", "tool_choice " + c.dump() + " cannot be enforced without constrained decoding, "
                                "which this server does not have; use \"auto\" or \"none\"");
    if (!c.is_string() || (c != "none" && c != "auto"))
      bad_field("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or a named function, got " + c.dump());
    choice = c.get<std::string>();
  }
  read_bool(b, "parallel_tool_calls", u.parallel);
  // "none": the tools are left out of the prompt, so that the model is not asked to call them.
  u.render = has_tools && choice == "auto";
  u.parse = u.render;
  return u;
}

}  // namespace dflash::server
