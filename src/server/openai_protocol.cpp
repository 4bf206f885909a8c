#include "server/openai_protocol.h"

#include <set>

#include "server/reasoning.h"
#include "server/request_fields.h"
#include "tokenizer/utf8.h"
#include "util/error.h"

namespace dflash::server {

using nlohmann::json;
using nlohmann::ordered_json;

std::string error_json(const std::string& message, const std::string& type, const std::string& param) {
  json e = {{"message", message}, {"type", type}, {"param", nullptr}, {"code", nullptr}};
  if (!param.empty()) e["param"] = param;
  return json{{"error", e}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

namespace {

[[noreturn]] void bad(const std::string& param, const std::string& message) { bad_field(param, message); }

const std::set<std::string> kCommonFields = {
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "logprobs", "top_k", "min_tokens",
    "ignore_eos"};
const std::set<std::string> kCompletionFields = {"prompt", "echo", "best_of", "suffix"};
// OpenAI's roles; a template renders any string, so anything else is refused here.
const std::set<std::string> kRoles = {"system", "developer", "user", "assistant", "tool", "function"};
const std::set<std::string> kChatFields = {"messages", "max_completion_tokens", "tools", "tool_choice",
                                           "parallel_tool_calls", "top_logprobs", "response_format",
                                           "chat_template_kwargs"};

// A parameter that is accepted only at its neutral value.
void require_neutral(const json& b, const std::string& key, const json& neutral, const std::string& why) {
  if (!b.contains(key) || b[key].is_null() || b[key] == neutral) return;
  bad(key, "'" + key + "' = " + b[key].dump() + " is not supported: " + why);
}

int int_field(const json& b, const std::string& key) {
  const json& v = b[key];
  if (!v.is_number_integer()) bad(key, "'" + key + "' must be an integer, got " + v.dump());
  const auto x = v.get<int64_t>();
  if (x <= 0) bad(key, "'" + key + "' must be positive, got " + std::to_string(x));
  if (x > (int64_t{1} << 30)) bad(key, "'" + key + "' = " + std::to_string(x) + " is absurdly large");
  return static_cast<int>(x);
}

std::vector<int32_t> prompt_ids(const json& p, const ProtocolContext& ctx) {
  if (p.is_string()) {
    const auto s = p.get<std::string>();
    if (s.empty()) bad("prompt", "'prompt' is empty");
    return ctx.tokenizer->encode(s);
  }
  if (p.is_array() && p.size() == 1 && p[0].is_string()) return prompt_ids(p[0], ctx);
  if (p.is_array() && !p.empty() && p[0].is_number_integer()) {
    std::vector<int32_t> ids;
    for (const auto& v : p) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= ctx.tokenizer->vocab_size())
        bad("prompt", "'prompt' token " + v.dump() + " is not a token id of this model");
      ids.push_back(v.get<int32_t>());
    }
    return ids;
  }
  if (p.is_array() && p.empty()) bad("prompt", "'prompt' is empty");
  bad("prompt", "'prompt' must be a string, a list with one string, or a list of token ids");
}

// Content parts [{"type": "text", "text": ...}] become one string, as templates expect.
ordered_json normalized_messages(const ordered_json& msgs) {
  if (!msgs.is_array() || msgs.empty()) bad("messages", "'messages' must be a non-empty list");
  ordered_json out = ordered_json::array();
  for (size_t i = 0; i < msgs.size(); ++i) {
    const std::string where = "messages[" + std::to_string(i) + "]";
    ordered_json m = msgs[i];
    if (!m.is_object()) bad(where, where + " must be an object");
    if (!m.contains("role") || !m["role"].is_string()) bad(where, where + " needs a string 'role'");
    if (!kRoles.count(m["role"].get<std::string>()))
      bad(where + ".role", where + ".role '" + m["role"].get<std::string>() +
                               "' is not one of system, developer, user, assistant, tool, function");
    if (m.contains("content") && m["content"].is_array()) {
      std::string text;
      for (const auto& part : m["content"]) {
        if (!part.is_object() || !part.contains("type") || part["type"] != "text" || !part.contains("text") ||
            !part["text"].is_string())
          bad(where, where + ": only text content parts are supported");
        text += part["text"].get<std::string>();
      }
      m["content"] = text;
    } else if (m.contains("content") && !m["content"].is_string() && !m["content"].is_null()) {
      bad(where, where + ".content must be a string, a list of text parts or null");
    }
    out.push_back(m);
  }
  return out;
}

}  // namespace

bool json_depth_exceeds(std::string_view text, size_t limit) {
  size_t depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return true;
    } else if (c == ']' || c == '}') {
      // A stray closer: the parser rejects the text at this point, before
      // anything after it is built.
      if (depth == 0) return false;
      --depth;
    }
  }
  return false;
}

nlohmann::ordered_json parse_body(const std::string& body) {
  if (const size_t at = utf8::first_invalid(body); at != std::string::npos)
    bad("", "the body is not valid UTF-8 (byte " + std::to_string(at) + ")");
  if (json_depth_exceeds(body, kMaxJsonDepth))
    bad("", "the body nests arrays and objects more than " + std::to_string(kMaxJsonDepth) + " levels deep");
  ordered_json b;
  try {
    b = ordered_json::parse(body);
  } catch (const std::exception& e) {
    bad("", std::string("the body is not valid JSON: ") + e.what());
  }
  if (!b.is_object()) bad("", "the body must be a JSON object");
  return b;
}

std::string render_chat(const nlohmann::ordered_json& b, const ProtocolContext& ctx, bool with_tools,
                        bool add_generation_prompt) {
  if (!ctx.chat_template) bad("messages", "this model has no chat template; use /v1/completions");
  if (!b.contains("messages")) bad("messages", "'messages' is required");
  ordered_json req = {{"messages", normalized_messages(b["messages"])}, {"add_generation_prompt", add_generation_prompt}};
  if (with_tools) req["tools"] = b["tools"];
  if (b.contains("chat_template_kwargs") && !b["chat_template_kwargs"].is_null()) {
    if (!b["chat_template_kwargs"].is_object()) bad("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    for (const auto& [k, v] : b["chat_template_kwargs"].items()) {
      if (k == "messages" || k == "tools" || k == "add_generation_prompt")
        bad("chat_template_kwargs", "'chat_template_kwargs' cannot set '" + k + "'");
      req[k] = v;
    }
  }
  try {
    return ctx.chat_template->render(req);
  } catch (const Error& e) {
    bad("messages", std::string("the chat template failed: ") + e.what());
  }
}

CompletionRequest parse_completion_request(const std::string& body, bool chat, const ProtocolContext& ctx) {
  const ordered_json b = parse_body(body);
  for (const auto& [k, v] : b.items()) {
    if (!kCommonFields.count(k) && !(chat ? kChatFields : kCompletionFields).count(k))
      bad(k, "unknown field '" + k + "'");
  }
  const json j = json(b);  // unordered view for lookups
  CompletionRequest r;
  if (j.contains("model") && !j["model"].is_string()) bad("model", "'model' must be a string");
  if (j.contains("model") && j["model"] != ctx.model_name)
    throw ApiError(404, "the model '" + j["model"].get<std::string>() + "' does not exist; this server serves '" +
                            ctx.model_name + "'", "model", "not_found_error");
  r.sampling = ctx.default_sampling;
  if (j.contains("temperature") && !j["temperature"].is_null()) {
    const double t = number_field(j, "temperature");
    if (t < 0 || t > 2) bad("temperature", "'temperature' must be in 0..2, got " + j["temperature"].dump());
    r.sampling.temperature = static_cast<float>(t);
  }
  if (j.contains("top_p") && !j["top_p"].is_null()) {
    const double p = number_field(j, "top_p");
    if (!(p > 0 && p <= 1)) bad("top_p", "'top_p' must be in (0, 1], got " + j["top_p"].dump());
    r.sampling.top_p = static_cast<float>(p);
  }
  if (j.contains("top_k") && !j["top_k"].is_null()) {
    const json& k = j["top_k"];
    if (!k.is_number_integer() || k.get<int64_t>() < -1 || k.get<int64_t>() > (int64_t{1} << 30))
      bad("top_k", "'top_k' must be an integer: -1 or 0 (off) or a positive count, got " + k.dump());
    r.sampling.top_k = std::max(0, k.get<int>());
  }
  if (j.contains("seed") && !j["seed"].is_null()) {
    if (!j["seed"].is_number_integer()) bad("seed", "'seed' must be an integer");
    r.sampling.seed = j["seed"].is_number_unsigned() ? j["seed"].get<uint64_t>()
                                                     : static_cast<uint64_t>(j["seed"].get<int64_t>());
    r.has_seed = true;
  }
  read_int(j, "n", 1, kMaxChoices, r.n);
  if (j.contains("best_of") && !j["best_of"].is_null() && j["best_of"] != r.n)
    bad("best_of", "'best_of' must equal 'n' (choices are not ranked)");
  read_penalties(j, ctx.tokenizer->vocab_size(), r.sampling);
  read_bool(j, "ignore_eos", r.ignore_eos);
  r.logprobs = read_logprobs(j, chat);
  require_neutral(j, "echo", false, "echo is not implemented");
  require_neutral(j, "suffix", "", "suffixes are not implemented");
  if (j.contains("response_format") && !j["response_format"].is_null() &&
      j["response_format"] != json{{"type", "text"}})
    bad("response_format", "only response_format {\"type\": \"text\"} is supported");

  r.chat = chat;
  if (j.contains("stream") && !j["stream"].is_null()) {
    if (!j["stream"].is_boolean()) bad("stream", "'stream' must be a boolean");
    r.stream = j["stream"].get<bool>();
  }
  if (j.contains("stream_options") && !j["stream_options"].is_null()) {
    const json& so = j["stream_options"];
    if (!r.stream) bad("stream_options", "'stream_options' is only allowed with stream: true");
    if (!so.is_object()) bad("stream_options", "'stream_options' must be an object");
    for (const auto& [k, v] : so.items())
      if (k != "include_usage") bad("stream_options", "unknown field 'stream_options." + k + "'");
    if (so.contains("include_usage")) {
      if (!so["include_usage"].is_boolean()) bad("stream_options", "'stream_options.include_usage' must be a boolean");
      r.include_usage = so["include_usage"].get<bool>();
    }
  }
  if (j.contains("stop") && !j["stop"].is_null()) {
    const json& s = j["stop"];
    if (s.is_string()) r.output.stop.push_back(s.get<std::string>());
    else if (s.is_array() && s.size() <= 16) {
      for (const auto& x : s) {
        if (!x.is_string()) bad("stop", "'stop' must be a string or a list of strings");
        r.output.stop.push_back(x.get<std::string>());
      }
    } else {
      bad("stop", "'stop' must be a string or a list of at most 16 strings");
    }
    for (const auto& x : r.output.stop)
      if (x.empty()) bad("stop", "'stop' strings must not be empty");
  }

  if (chat) {
    const ToolUse tools = read_tool_use(j);
    if (tools.parse) {
      r.output.tool_format = ctx.tool_format;
      r.output.tools = j["tools"];
      r.output.parallel_tool_calls = tools.parallel;
    }
    const std::string text = render_chat(b, ctx, tools.render, true);
    r.prompt_ids = ctx.tokenizer->encode(text);
    r.extra_eos = ctx.chat_eos;
    r.output.reasoning = ctx.reasoning;
    r.output.starts_in_reasoning = ctx.reasoning && prompt_opens_think(text);
  } else {
    if (!j.contains("prompt")) bad("prompt", "'prompt' is required");
    r.prompt_ids = prompt_ids(j["prompt"], ctx);
  }
  if (r.prompt_ids.empty()) bad(chat ? "messages" : "prompt", "the prompt is empty after tokenization");
  const auto n_prompt = static_cast<int64_t>(r.prompt_ids.size());
  if (n_prompt >= ctx.max_positions)
    bad(chat ? "messages" : "prompt", "the prompt has " + std::to_string(n_prompt) +
                                          " tokens; the model's context is " + std::to_string(ctx.max_positions));
  const char* limit_key = chat && j.contains("max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  if (j.contains(limit_key) && !j[limit_key].is_null()) {
    r.max_tokens = int_field(j, limit_key);
    if (n_prompt + r.max_tokens > ctx.max_positions)
      bad(limit_key, "the model's context is " + std::to_string(ctx.max_positions) + " tokens; the prompt has " +
                         std::to_string(n_prompt) + " and " + limit_key + " asks for " + std::to_string(r.max_tokens));
  } else {
    r.max_tokens = chat ? static_cast<int>(ctx.max_positions - n_prompt) : static_cast<int>(std::min<int64_t>(16, ctx.max_positions - n_prompt));
  }
  read_int(j, "min_tokens", 0, r.max_tokens, r.sampling.min_tokens);
  r.output.min_tokens = r.sampling.min_tokens;
  return r;
}

std::optional<std::string> finish_reason_text(FinishReason r) {
  switch (r) {
    case FinishReason::Eos: return "stop";
    case FinishReason::Length:
    case FinishReason::Context: return "length";
    case FinishReason::Cancelled:
    case FinishReason::Error: return std::nullopt;
  }
  return std::nullopt;
}

}  // namespace dflash::server
