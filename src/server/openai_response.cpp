#include "server/openai_response.h"

#include <algorithm>
#include <cmath>

namespace dflash::server {

using nlohmann::json;

namespace {

// JSON has no -infinity: vLLM reports -9999 for a token the processed logits ruled out.
double finite(float lp) { return std::isfinite(lp) ? lp : -9999.0; }

std::string token_text(const Tokenizer& tok, int32_t id) { return tok.output_bytes(id); }

json bytes_of(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

json chat_logprobs(const ResponseHead& h, const std::vector<LogprobEntry>& entries) {
  json content = json::array();
  for (const auto& e : entries) {
    const std::string t = token_text(*h.tokenizer, e.token);
    json top = json::array();
    for (size_t k = 0; k < e.lp.top.size() && static_cast<int>(k) < h.logprobs; ++k) {
      const std::string tk = token_text(*h.tokenizer, e.lp.top[k].first);
      top.push_back({{"token", tk}, {"logprob", finite(e.lp.top[k].second)}, {"bytes", bytes_of(tk)}});
    }
    content.push_back({{"token", t}, {"logprob", finite(e.lp.logprob)}, {"bytes", bytes_of(t)}, {"top_logprobs", top}});
  }
  return {{"content", content}};
}

json completion_logprobs(const ResponseHead& h, const std::vector<LogprobEntry>& entries, size_t& offset) {
  json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  for (const auto& e : entries) {
    const std::string t = token_text(*h.tokenizer, e.token);
    tokens.push_back(t);
    lps.push_back(finite(e.lp.logprob));
    json top = json::object();
    for (size_t k = 0; k < e.lp.top.size() && static_cast<int>(k) < h.logprobs; ++k)
      top[token_text(*h.tokenizer, e.lp.top[k].first)] = finite(e.lp.top[k].second);
    tops.push_back(top);
    offsets.push_back(offset);
    offset += t.size();
  }
  return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

json logprobs_json(const ResponseHead& h, const std::vector<LogprobEntry>& entries, size_t& offset) {
  if (h.logprobs < 0) return nullptr;
  return h.chat ? chat_logprobs(h, entries) : completion_logprobs(h, entries, offset);
}

json tool_call_json(const ToolCall& c, int index) {
  return {{"index", index}, {"id", c.id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}};
}

json head_json(const ResponseHead& h, bool chunk) {
  return {{"id", h.id},
          {"object", h.chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
          {"created", h.created},
          {"model", h.model}};
}

// Pieces of at most `n` bytes, cut at UTF-8 character boundaries.
std::vector<std::string> pieces(const std::string& s, size_t n) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < s.size()) {
    size_t end = std::min(s.size(), i + n);
    while (end < s.size() && end > i + 1 && (static_cast<unsigned char>(s[end]) & 0xC0) == 0x80) --end;
    out.push_back(s.substr(i, end - i));
    i = end;
  }
  return out;
}

}  // namespace

json usage_json(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

json completion_response(const ResponseHead& h, const std::vector<FinishedChoice>& choices, const Usage& u) {
  json out = head_json(h, false);
  json list = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceDelta& o = *choices[i].output;
    size_t offset = 0;
    json c = {{"index", i}, {"finish_reason", choices[i].finish_reason}, {"logprobs", logprobs_json(h, o.logprobs, offset)}};
    if (h.chat) {
      json m = {{"role", "assistant"}, {"content", o.content}};
      if (!o.calls.empty()) {
        if (o.content.empty()) m["content"] = nullptr;
        json calls = json::array();
        for (size_t k = 0; k < o.calls.size(); ++k) {
          json tc = tool_call_json(o.calls[k], static_cast<int>(k));
          tc.erase("index");
          calls.push_back(tc);
        }
        m["tool_calls"] = calls;
      }
      if (!o.reasoning.empty()) m["reasoning_content"] = o.reasoning;
      c["message"] = m;
    } else {
      c["text"] = o.content;
    }
    list.push_back(c);
  }
  out["choices"] = list;
  out["usage"] = usage_json(u);
  return out;
}

std::vector<json> completion_chunks(const ResponseHead& h, int index, const ChoiceDelta& d,
                                    const std::string& finish_reason, ChunkState& st) {
  std::vector<json> out;
  auto chunk = [&](json delta_or_text, json logprobs, const std::string& reason) {
    json c = {{"index", index}, {"logprobs", std::move(logprobs)}};
    c["finish_reason"] = reason.empty() ? json(nullptr) : json(reason);
    if (h.chat) c["delta"] = std::move(delta_or_text);
    else c["text"] = std::move(delta_or_text);
    json j = head_json(h, true);
    j["choices"] = json::array({c});
    out.push_back(std::move(j));
  };
  const bool has_text = !d.content.empty() || !d.reasoning.empty() || !d.logprobs.empty();
  if (h.chat) {
    if (has_text || st.first) {
      json delta = json::object();
      if (st.first) delta["role"] = "assistant";
      if (!d.content.empty() || (st.first && d.reasoning.empty())) delta["content"] = d.content;
      if (!d.reasoning.empty()) delta["reasoning_content"] = d.reasoning;
      st.first = false;
      chunk(delta, logprobs_json(h, d.logprobs, st.text_offset), "");
    }
    for (const ToolCall& call : d.calls) {
      const int k = st.n_calls_sent++;
      json head = tool_call_json(call, k);
      head["function"]["arguments"] = "";
      chunk({{"tool_calls", json::array({head})}}, nullptr, "");
      for (const std::string& p : pieces(call.arguments, 16))
        chunk({{"tool_calls", json::array({{{"index", k}, {"function", {{"arguments", p}}}}})}}, nullptr, "");
    }
    if (!finish_reason.empty()) chunk(json::object(), nullptr, finish_reason);
  } else {
    if (has_text) chunk(d.content, logprobs_json(h, d.logprobs, st.text_offset), "");
    if (!finish_reason.empty()) chunk("", nullptr, finish_reason);
  }
  return out;
}

json usage_chunk(const ResponseHead& h, const Usage& u) {
  json j = head_json(h, true);
  j["choices"] = json::array();
  j["usage"] = usage_json(u);
  return j;
}

}  // namespace dflash::server
