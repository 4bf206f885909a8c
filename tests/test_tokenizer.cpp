// Tokenizer: exact ids of HF `tokenizers` 0.23 on the golden corpus (real
// Qwen3 tokenizer and two trained tokenizers that use the other supported
// components), decode round trips, streaming decode, and load-time errors.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <random>

#include <nlohmann/json.hpp>

#include "test_util.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"
#include "util/error.h"

namespace dflash {
namespace {

std::string golden(const std::string& rel) { return std::string(DFLASH_GENERATED_FIXTURES) + "/" + rel; }

std::vector<std::string> read_corpus() {
  std::ifstream f(golden("tokenizer_golden/corpus.jsonl"));
  std::vector<std::string> out;
  std::string line;
  while (std::getline(f, line)) out.push_back(nlohmann::json::parse(line).get<std::string>());
  return out;
}

const std::vector<std::string>& corpus() {
  static const std::vector<std::string> c = read_corpus();
  return c;
}

const Tokenizer& qwen3() {
  static const Tokenizer t(golden("qwen3"));
  return t;
}

// Streams ids through StreamDecoder; every chunk must be valid UTF-8.
std::string stream_decode(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  StreamDecoder sd(tok);
  std::string out;
  for (int32_t id : ids) {
    const std::string piece = sd.push(id);
    EXPECT_EQ(utf8::first_invalid(piece), std::string::npos);
    out += piece;
  }
  return out + sd.finish();
}

struct ParityCounts {
  size_t strings = 0, bytes = 0, mismatches = 0, round_trips = 0, round_trip_failures = 0, stream_failures = 0;
};

// Checks every golden row of `file`: ids, decode == text where HF round-trips,
// and streaming == one-shot decode.
ParityCounts check_golden(const Tokenizer& tok, const std::string& file, int32_t bos) {
  ParityCounts c;
  std::ifstream f(golden(file));
  EXPECT_TRUE(f.good()) << file;
  std::string line;
  size_t row = 0;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    const size_t index = j.contains("line") ? j["line"].get<size_t>() : row;
    ++row;
    const std::string& text = corpus().at(index);
    const auto want = j["ids"].get<std::vector<int32_t>>();
    const auto got = tok.encode(text);
    ++c.strings;
    c.bytes += text.size();
    if (got != want) {
      if (++c.mismatches <= 3) ADD_FAILURE() << file << " line " << index << ": ids differ for " << nlohmann::json(text);
      continue;
    }
    if (bos >= 0) {
      auto with = want;
      with.insert(with.begin(), bos);
      EXPECT_EQ(tok.encode(text, true), with) << index;
    }
    const std::string decoded = tok.decode(got);
    if (j["rt"].get<bool>()) {
      ++c.round_trips;
      if (decoded != text && ++c.round_trip_failures <= 3) ADD_FAILURE() << file << " line " << index << ": decode";
    }
    if (stream_decode(tok, got) != decoded) ++c.stream_failures;
  }
  return c;
}

TEST(Tokenizer, Qwen3MatchesHuggingFaceOnGoldenCorpus) {
  const ParityCounts c = check_golden(qwen3(), "tokenizer_golden/qwen3.jsonl", -1);
  std::printf("qwen3: %zu strings, %.2f MB, %zu id mismatches, %zu/%zu round trips ok, %zu stream mismatches\n",
              c.strings, c.bytes / 1e6, c.mismatches, c.round_trips - c.round_trip_failures, c.round_trips,
              c.stream_failures);
  EXPECT_GE(c.strings, 20000u);
  EXPECT_GE(c.bytes, 5000000u);
  EXPECT_EQ(c.mismatches, 0u);
  EXPECT_EQ(c.round_trip_failures, 0u);
  EXPECT_EQ(c.stream_failures, 0u);
}

TEST(Tokenizer, TrainedTokenizersMatchHuggingFace) {
  // llama3_style: NFKC, ignore_merges, TemplateProcessing BOS, added tokens with
  // lstrip/rstrip/single_word/normalized; gpt2_style: Contiguous/MergedWith*/
  // Removed splits and ByteLevel with add_prefix_space and its own regex.
  const Tokenizer llama(golden("tokenizer_golden/llama3_style"));
  const Tokenizer gpt2(golden("tokenizer_golden/gpt2_style"));
  const auto bos = llama.token_to_id("<|begin_of_text|>");
  ASSERT_TRUE(bos.has_value());
  for (auto [tok, file, b] : {std::tuple{&llama, "tokenizer_golden/llama3_style.jsonl", *bos},
                              std::tuple{&gpt2, "tokenizer_golden/gpt2_style.jsonl", -1}}) {
    const ParityCounts c = check_golden(*tok, file, b);
    std::printf("%s: %zu strings, %zu id mismatches, %zu round trips\n", file, c.strings, c.mismatches, c.round_trips);
    EXPECT_GT(c.strings, 3000u);
    EXPECT_EQ(c.mismatches, 0u);
    EXPECT_EQ(c.round_trip_failures, 0u);
    EXPECT_EQ(c.stream_failures, 0u);
  }
  if (::testing::Test::HasFailure()) return;
  // Without the BOS processor, add_special_tokens changes nothing.
  EXPECT_EQ(gpt2.encode("abc", true), gpt2.encode("abc", false));
}

TEST(Tokenizer, AddedTokenFlagsMatchHuggingFace) {
  // 129 strings around tokens with lstrip, rstrip, single_word and normalized set
  // (tests/fixtures/tokenizers/added_tokens_cases.jsonl), ids from HF tokenizers 0.23.2.
  for (const char* name : {"llama3_style", "gpt2_style"}) {
    const Tokenizer tok(golden(std::string("tokenizer_golden/") + name));
    std::ifstream f(test::fixture(std::string("tokenizers/") + name + "_added.jsonl"));
    std::string line;
    int n = 0;
    while (std::getline(f, line)) {
      const auto j = nlohmann::json::parse(line);
      const std::string text = j["text"];
      ++n;
      EXPECT_EQ(tok.encode(text), j["ids"].get<std::vector<int32_t>>()) << name << " " << nlohmann::json(text);
      EXPECT_EQ(tok.encode(text, true), j["ids_special"].get<std::vector<int32_t>>()) << name;
      if (j["rt"].get<bool>()) {
        EXPECT_EQ(tok.decode(tok.encode(text)), text) << name;
      }
    }
    EXPECT_EQ(n, 129) << name;
  }
}

TEST(Tokenizer, SpecialTokensAreMatchedInsideText) {
  const Tokenizer& t = qwen3();
  const auto im_start = *t.token_to_id("<|im_start|>");
  const auto ids = t.encode("x<|im_start|>user\n");
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids[1], im_start);
  EXPECT_TRUE(t.is_special(im_start));
  EXPECT_EQ(t.decode(ids), "x<|im_start|>user\n");
  EXPECT_EQ(t.decode(ids, true), "xuser\n");
  // An unfinished special token is plain text.
  const auto partial = t.encode("<|im_start");
  EXPECT_EQ(std::count(partial.begin(), partial.end(), im_start), 0);
}

TEST(Tokenizer, StreamingNeverSplitsACharacter) {
  const Tokenizer& t = qwen3();
  // Byte tokens of a 4-byte emoji, one at a time: nothing until the last byte.
  const std::string emoji = "\xF0\x9F\xA4\xB7";
  std::map<std::string, int32_t> single_byte;
  for (int32_t id = 0; id < t.vocab_size(); ++id) {
    if (t.token_bytes(id).size() == 1) single_byte.emplace(t.token_bytes(id), id);
  }
  std::vector<int32_t> byte_ids;
  for (char b : emoji) byte_ids.push_back(single_byte.at(std::string(1, b)));
  ASSERT_EQ(byte_ids.size(), 4u);
  StreamDecoder sd(t);
  EXPECT_EQ(sd.push(byte_ids[0]), "");
  EXPECT_EQ(sd.push(byte_ids[1]), "");
  EXPECT_EQ(sd.push(byte_ids[2]), "");
  EXPECT_EQ(sd.push(byte_ids[3]), emoji);
  // A broken sequence becomes U+FFFD once it cannot complete; a dangling start at the end too.
  StreamDecoder sd2(t);
  EXPECT_EQ(sd2.push(byte_ids[0]), "");
  EXPECT_EQ(sd2.push(*t.token_to_id("a")), "\xEF\xBF\xBD" "a");
  EXPECT_EQ(sd2.push(byte_ids[0]), "");
  EXPECT_EQ(sd2.finish(), "\xEF\xBF\xBD");
  // Random id sequences: streaming equals one-shot decoding.
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<int32_t> ids(1 + rng() % 40);
    for (auto& id : ids) id = static_cast<int32_t>(rng() % 300 < 200 ? rng() % 256 : rng() % t.vocab_size());
    EXPECT_EQ(stream_decode(t, ids), t.decode(ids));
  }
  // Ids of a model's padded embedding rows (Qwen3: vocabulary 151936, 151669 tokens) decode
  // to nothing, as in Hugging Face tokenizers; negative ids are refused.
  const std::vector<int32_t> padded{*t.token_to_id("a"), t.vocab_size(), 151935, *t.token_to_id("b")};
  EXPECT_EQ(t.decode(padded), "ab");
  EXPECT_EQ(stream_decode(t, padded), "ab");
  EXPECT_THROW(t.decode(std::vector<int32_t>{-1}), Error);
}

TEST(Tokenizer, LossyDecodingFollowsMaximalSubparts) {
  EXPECT_EQ(utf8::lossy("a\xC3"), "a\xEF\xBF\xBD");
  EXPECT_EQ(utf8::lossy("\xE2\x82x"), "\xEF\xBF\xBDx");                  // truncated 3-byte: one U+FFFD
  EXPECT_EQ(utf8::lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate: one per byte
  EXPECT_EQ(utf8::lossy("\xF4\x90\x80\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(utf8::lossy("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");        // overlong
  EXPECT_EQ(utf8::stable_prefix("ab\xE2\x82"), 2u);
  EXPECT_EQ(utf8::stable_prefix("ab\x80"), 3u);
}

TEST(Tokenizer, BadInputIsRejectedWithAClearMessage) {
  const Tokenizer& t = qwen3();
  try {
    t.encode("ok \xFF bad");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not valid UTF-8 (byte 3)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(t.decode(std::vector<int32_t>{-1}), Error);
  EXPECT_EQ(t.decode(std::vector<int32_t>{t.vocab_size()}), "");  // beyond the vocabulary: nothing, as HF
}

// A minimal valid tokenizer.json, then one component replaced.
nlohmann::json tiny_tokenizer() {
  nlohmann::json vocab = nlohmann::json::object();
  const std::string letters = "abc";
  for (size_t i = 0; i < letters.size(); ++i) vocab[std::string(1, letters[i])] = static_cast<int>(i);
  vocab["ab"] = 3;
  return {{"version", "1.0"},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}}},
          {"added_tokens", nlohmann::json::array()},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"a b"}}}}};
}

std::string load_error(const nlohmann::json& j) {
  try {
    Tokenizer t(j.dump(), "tokenizer.json");
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

TEST(Tokenizer, UnsupportedComponentsAreNamedAtLoad) {
  EXPECT_EQ(load_error(tiny_tokenizer()), "");
  Tokenizer tiny(tiny_tokenizer().dump(), "tiny");
  EXPECT_EQ(tiny.encode("abc"), (std::vector<int32_t>{3, 2}));

  auto with = [](const char* key, nlohmann::json v) {
    auto j = tiny_tokenizer();
    j[key] = std::move(v);
    return load_error(j);
  };
  EXPECT_NE(with("normalizer", {{"type", "Precompiled"}}).find("normalizer \"Precompiled\" is not supported"),
            std::string::npos);
  EXPECT_NE(with("pre_tokenizer", {{"type", "Metaspace"}}).find("pre_tokenizer \"Metaspace\""), std::string::npos);
  EXPECT_NE(with("pre_tokenizer", {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}})
                .find("does not compile"),
            std::string::npos);
  EXPECT_NE(with("decoder", {{"type", "WordPiece"}}).find("decoder \"WordPiece\""), std::string::npos);
  EXPECT_NE(with("post_processor", {{"type", "BertProcessing"}}).find("post_processor \"BertProcessing\""),
            std::string::npos);
  EXPECT_NE(with("model", {{"type", "Unigram"}}).find("only \"BPE\""), std::string::npos);
  auto j = tiny_tokenizer();
  j["model"]["merges"] = {"a z"};
  EXPECT_NE(load_error(j).find("missing from vocab"), std::string::npos);
  j = tiny_tokenizer();
  j["model"]["byte_fallback"] = true;
  EXPECT_NE(load_error(j).find("byte_fallback"), std::string::npos);
  EXPECT_NE(load_error(nlohmann::json::array()).find("not a JSON object"), std::string::npos);
  EXPECT_NE(load_error(nlohmann::json{{"added_tokens", {{{"id", 1}}}}, {"pre_tokenizer", {{"type", "ByteLevel"}}},
                                      {"model", tiny_tokenizer()["model"]}, {"decoder", {{"type", "ByteLevel"}}}})
                .find("added_tokens"),
            std::string::npos);
}

}  // namespace
}  // namespace dflash
