// `dflash tokenize`: text -> token ids with a tokenizer.json, as HF
// `encode(text, add_special_tokens=False)` gives them (--add-special-tokens for True).
#include <chrono>
#include <cstdio>
#include <fstream>
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
  std::string tokenizer, text, bench;
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

// Encodes every string of a JSONL file on one thread, twice (the second pass
// finds the piece cache warm), and prints throughput as JSON.
int run_bench(const Tokenizer& tok, const std::string& path, bool add_special) {
  std::ifstream f(path);
  check(f.good(), "cannot read ", path);
  std::vector<std::string> texts;
  std::string line;
  size_t bytes = 0;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    check(!j.is_discarded() && j.is_string(), path, ": line ", texts.size() + 1, " is not a JSON string");
    texts.push_back(j.get<std::string>());
    bytes += texts.back().size();
  }
  nlohmann::json out;
  out["strings"] = texts.size();
  out["bytes"] = bytes;
  for (const char* pass : {"cold", "warm"}) {
    size_t tokens = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (const auto& t : texts) tokens += tok.encode(t, add_special).size();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    out[pass] = {{"seconds", s}, {"MB_per_s", bytes / s / 1e6}, {"tokens", tokens}};
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

int run_tokenize(const TokenizeArgs& a) {
  const int modes = a.jsonl + !a.text.empty() + !a.bench.empty();
  check(modes == 1, "give one of --text T, --jsonl or --bench FILE");
  const Tokenizer tok(a.tokenizer);
  if (!a.bench.empty()) return run_bench(tok, a.bench, a.add_special);
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
  app.add_option("--bench", a->bench, "time encoding every JSON string of this JSONL file (one thread)");
  app.add_flag("--add-special-tokens", a->add_special, "apply the post-processor (e.g. a BOS token)");
  return [a] { return run_tokenize(*a); };
}

}  // namespace dflash::cli
