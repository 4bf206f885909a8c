// `dflash chat-template`: renders chat requests with a tokenizer directory's
// chat template, as transformers' apply_chat_template(tokenize=False) does.
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "formats/chat_template.h"
#include "util/error.h"

namespace dflash::cli {

namespace {

struct ChatTemplateArgs {
  std::string tokenizer;
  bool jsonl = false, keep_going = false;
};

int run_chat_template(const ChatTemplateArgs& a) {
  check(a.jsonl, "chat-template reads requests with --jsonl");
  const ChatTemplate tmpl(a.tokenizer);
  std::string line;
  size_t n = 0;
  while (std::getline(std::cin, line)) {
    ++n;
    const auto req = nlohmann::ordered_json::parse(line, nullptr, false);
    check(!req.is_discarded() && req.is_object(), "stdin line ", n, ": expected a JSON object");
    std::string text;
    try {
      text = tmpl.render(req);
    } catch (const Error& e) {
      if (!a.keep_going) throw Error(cat("stdin line ", n, ": ", e.what()));
      std::printf("%s\n", nlohmann::json{{"error", e.what()}}.dump().c_str());
      continue;
    }
    std::printf("%s\n", nlohmann::json(text).dump().c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

Command add_chat_template(CLI::App& app) {
  auto a = std::make_shared<ChatTemplateArgs>();
  app.add_option("--tokenizer", a->tokenizer, "directory with tokenizer_config.json (or chat_template.jinja)")
      ->required();
  app.add_flag("--jsonl", a->jsonl,
               "read one request per stdin line ({\"messages\", \"tools\"?, \"add_generation_prompt\", ...}), "
               "print the rendered prompt as a JSON string per line");
  app.add_flag("--keep-going", a->keep_going, "print {\"error\": ...} for a request that fails and go on");
  return [a] { return run_chat_template(*a); };
}

}  // namespace dflash::cli
