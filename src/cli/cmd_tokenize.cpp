// `dflash tokenize`: text -> token ids with a tokenizer.json, as HF
// `encode(text, add_special_tokens=False)` gives them (--add-special-tokens for True).
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace dflash::cli {

namespace {

struct TokenizeArgs {
  std::string tokenizer, text;
  bool jsonl = false, add_special = false, decode = false;
};

std::string ids_json(const std::vector<int32_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(ids[i]);
  }
  return s + "]";
}

int run_tokenize(const TokenizeArgs& a) {
  check(a.jsonl != !a.text.empty() || (a.jsonl && a.text.empty()), "give either --text T or --jsonl");
  const Tokenizer tok(a.tokenizer);
  if (!a.jsonl) {
    const auto ids = tok.encode(a.text, a.add_special);
    std::printf("%s\n", ids_json(ids).c_str());
    return 0;
  }
  std::string line;
  size_t n = 0;
  while (std::getline(std::cin, line)) {
    ++n;
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (a.decode) {
      check(!j.is_discarded() && j.is_array(), "stdin line ", n, ": expected a JSON array of token ids");
      std::vector<int32_t> ids;
      for (const auto& v : j) {
        check(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < INT32_MAX, "stdin line ", n,
              ": ", v.dump(), " is not a token id");
        ids.push_back(v.get<int32_t>());
      }
      std::string text = nlohmann::json(tok.decode(ids)).dump();
      std::printf("%s\n", text.c_str());
      continue;
    }
    check(!j.is_discarded() && j.is_string(), "stdin line ", n, ": expected a JSON string");
    const auto ids = tok.encode(j.get_ref<const std::string&>(), a.add_special);
    std::printf("%s\n", ids_json(ids).c_str());
  }
  return 0;
}

}  // namespace

Command add_tokenize(CLI::App& app) {
  auto a = std::make_shared<TokenizeArgs>();
  app.add_option("--tokenizer", a->tokenizer, "directory with tokenizer.json (or the file)")->required();
  app.add_option("--text", a->text, "text to tokenize; prints its ids as a JSON array");
  app.add_flag("--jsonl", a->jsonl, "read one JSON string per stdin line, print one JSON array of ids per line");
  app.add_flag("--decode", a->decode, "with --jsonl: read JSON arrays of ids and print the decoded text as JSON strings");
  app.add_flag("--add-special-tokens", a->add_special, "apply the post-processor (e.g. a BOS token)");
  return [a] { return run_tokenize(*a); };
}

}  // namespace dflash::cli
