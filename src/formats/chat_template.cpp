#include "formats/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "util/error.h"

namespace dflash {

namespace {

std::string read_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  check(f.good(), "cannot read ", p.string());
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// "eos_token": "<x>" or {"content": "<x>", ...}
std::optional<std::string> token_string(const nlohmann::ordered_json& cfg, const char* key) {
  if (!cfg.contains(key) || cfg[key].is_null()) return std::nullopt;
  const auto& v = cfg[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  throw Error(cat("tokenizer_config.json: \"", key, "\" must be a string or an object with \"content\""));
}

}  // namespace

ChatTemplate::ChatTemplate(const std::string& dir) : ChatTemplate(dir, std::string()) {}

ChatTemplate::ChatTemplate(const std::string& dir, const std::string& template_file) {
  const std::filesystem::path d(dir);
  const auto cfg_path = d / "tokenizer_config.json";
  nlohmann::ordered_json cfg = nlohmann::ordered_json::object();
  if (std::filesystem::exists(cfg_path)) {
    cfg = nlohmann::ordered_json::parse(read_file(cfg_path), nullptr, false);
    check(!cfg.is_discarded() && cfg.is_object(), cfg_path.string(), ": not a JSON object");
  }
  std::string source;
  if (!template_file.empty()) {
    source = read_file(template_file);
  } else if (std::filesystem::exists(d / "chat_template.jinja")) {
    source = read_file(d / "chat_template.jinja");
  } else if (cfg.contains("chat_template") && cfg["chat_template"].is_string()) {
    source = cfg["chat_template"].get<std::string>();
  } else if (cfg.contains("chat_template") && cfg["chat_template"].is_array()) {
    for (const auto& t : cfg["chat_template"]) {
      if (t.is_object() && t.value("name", "") == "default" && t.contains("template") && t["template"].is_string()) {
        source = t["template"].get<std::string>();
      }
    }
    check(!source.empty(), cfg_path.string(), ": \"chat_template\" list has no \"default\" template");
  } else {
    throw Error(cat(dir, ": no chat template (neither chat_template.jinja nor \"chat_template\" in tokenizer_config.json)"));
  }
  for (const char* key : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
    if (auto s = token_string(cfg, key)) special_[key] = *s;
  }
  eos_ = token_string(cfg, "eos_token");
  source_ = source;
  try {
    tmpl_.emplace(source);
  } catch (const Error& e) {
    throw Error(cat(dir, ": chat template: ", e.what()));
  }
}

ChatTemplate::ChatTemplate(const std::string& source, nlohmann::ordered_json special_tokens)
    : special_(std::move(special_tokens)), source_(source) {
  if (special_.contains("eos_token") && special_["eos_token"].is_string()) eos_ = special_["eos_token"];
  tmpl_.emplace(source);
}

std::string ChatTemplate::render(const nlohmann::ordered_json& request) const {
  check(request.is_object(), "chat request must be a JSON object");
  check(request.contains("messages") && request["messages"].is_array(), "chat request needs a \"messages\" list");
  std::vector<std::pair<std::string, jinja::Value>> vars;
  // As apply_chat_template: special tokens, then the caller's keys; tools and
  // documents are always defined (None when absent).
  for (const auto& [k, v] : special_.items()) vars.emplace_back(k, jinja::Value::from_json(v));
  vars.emplace_back("tools", jinja::Value::none());
  vars.emplace_back("documents", jinja::Value::none());
  vars.emplace_back("add_generation_prompt", jinja::Value(false));
  for (const auto& [k, v] : request.items()) vars.emplace_back(k, jinja::Value::from_json(v));
  return tmpl_->render(vars);
}

}  // namespace dflash
