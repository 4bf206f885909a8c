// A Hugging Face tokenizer.json (byte-level BPE family: Qwen2/Qwen3, Llama-3,
// GPT-2) with the ids HF `tokenizers` produces. Unsupported components are
// rejected at load with an error naming them.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/added_tokens.h"
#include "tokenizer/bpe.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/pre_tokenizer.h"

namespace dflash {

class Tokenizer {
 public:
  // `path` is a tokenizer.json file or a directory holding one.
  explicit Tokenizer(const std::string& path);
  // From the JSON text itself; `source` names it in errors.
  Tokenizer(std::string_view json_text, const std::string& source);

  // Text (valid UTF-8) -> ids. add_special_tokens applies the post-processor
  // (e.g. Llama-3's BOS); HF's add_special_tokens=False leaves it out.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;

  // Ids -> text; invalid UTF-8 produced by partial tokens becomes U+FFFD. Ids
  // beyond the vocabulary (a model's padded embedding rows) decode to nothing,
  // as in Hugging Face tokenizers; negative ids are an error.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // Raw bytes a token decodes to (before UTF-8 repair); throws for ids outside the vocabulary.
  const std::string& token_bytes(int32_t id) const;
  // As token_bytes, but empty for ids beyond the vocabulary (what decode() uses).
  const std::string& output_bytes(int32_t id) const;
  bool is_special(int32_t id) const;
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // One past the largest id.
  int32_t vocab_size() const { return static_cast<int32_t>(token_bytes_.size()); }

 private:
  void load(std::string_view json_text, const std::string& source);
  void encode_text(std::string_view text, std::vector<int32_t>& out) const;

  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<BpeModel> model_;
  std::vector<AddedToken> added_;
  AddedTokenMatcher raw_matcher_, normalized_matcher_;
  std::vector<int32_t> prefix_ids_, suffix_ids_;  // post-processor, single sequence
  std::vector<std::string> token_bytes_;          // id -> decoded bytes
  std::vector<bool> special_;                     // id -> special added token
  std::unordered_map<std::string, int32_t> added_by_content_;
};

// Incremental detokenization: push ids one at a time and get text that is
// always valid UTF-8; concatenating every output and finish() equals decode().
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool skip_special_tokens = false)
      : tok_(tok), skip_special_(skip_special_tokens) {}
  std::string push(int32_t id);
  std::string finish();

 private:
  const Tokenizer& tok_;
  bool skip_special_;
  std::string pending_;  // bytes of a character not yet complete
};

}  // namespace dflash
