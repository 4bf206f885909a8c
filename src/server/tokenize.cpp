#include "server/tokenize.h"

#include <set>

#include "server/request_fields.h"

namespace dflash::server {

using nlohmann::json;

namespace {

void check_fields(const nlohmann::ordered_json& b, const std::set<std::string>& allowed, const ProtocolContext& ctx) {
  for (const auto& [k, v] : b.items())
    if (!allowed.count(k)) bad_field(k, "unknown field '" + k + "'");
  if (b.contains("model") && !b["model"].is_null() && b["model"] != ctx.model_name)
    throw ApiError(404, "the model " + b["model"].dump() + " does not exist; this server serves '" + ctx.model_name + "'",
                   "model", "not_found_error");
}

}  // namespace

json tokenize_response(const std::string& body, const ProtocolContext& ctx) {
  const nlohmann::ordered_json b = parse_body(body);
  const json j = json(b);
  const bool chat = b.contains("messages");
  check_fields(b, chat ? std::set<std::string>{"model", "messages", "add_generation_prompt", "add_special_tokens",
                                               "tools", "chat_template_kwargs", "return_token_strs",
                                               "continue_final_message"}
                       : std::set<std::string>{"model", "prompt", "add_special_tokens", "return_token_strs"},
               ctx);
  bool special = false, strs = false, gen_prompt = true, cont = false;
  read_bool(j, "add_special_tokens", special);
  read_bool(j, "return_token_strs", strs);
  read_bool(j, "add_generation_prompt", gen_prompt);
  read_bool(j, "continue_final_message", cont);
  if (cont) bad_field("continue_final_message", "'continue_final_message' is not supported");
  std::string text;
  if (chat) {
    const ToolUse tools = read_tool_use(j);
    text = render_chat(b, ctx, tools.render, gen_prompt);
  } else {
    if (!j.contains("prompt") || !j["prompt"].is_string()) bad_field("prompt", "'prompt' must be a string (or give 'messages')");
    text = j["prompt"].get<std::string>();
  }
  const std::vector<int32_t> ids = ctx.tokenizer->encode(text, special);
  json out = {{"count", ids.size()}, {"max_model_len", ctx.max_positions}, {"tokens", ids}, {"token_strs", nullptr}};
  if (strs) {
    json s = json::array();
    for (int32_t id : ids) s.push_back(ctx.tokenizer->output_bytes(id));
    out["token_strs"] = s;
  }
  return out;
}

json detokenize_response(const std::string& body, const ProtocolContext& ctx) {
  const nlohmann::ordered_json b = parse_body(body);
  check_fields(b, {"model", "tokens"}, ctx);
  if (!b.contains("tokens") || !b["tokens"].is_array()) bad_field("tokens", "'tokens' must be a list of token ids");
  std::vector<int32_t> ids;
  for (const auto& v : b["tokens"]) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= ctx.tokenizer->vocab_size())
      bad_field("tokens", "'tokens' entry " + v.dump() + " is not a token id of this model");
    ids.push_back(v.get<int32_t>());
  }
  return {{"prompt", ctx.tokenizer->decode(ids)}};
}

}  // namespace dflash::server
