// Added and special tokens (tokenizer.json "added_tokens"), matched in text
// before pre-tokenization the way HF's AddedVocabulary does: leftmost-longest,
// honouring single_word, lstrip and rstrip; `normalized` tokens are matched in
// normalized text, the others in raw text.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace dflash {

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;

  static AddedToken from_json(const nlohmann::json& j);
};

// One span of text: an added token (id >= 0) or plain text to tokenize (id -1).
struct TextSpan {
  size_t begin, end;
  int32_t id;
};

class AddedTokenMatcher {
 public:
  AddedTokenMatcher() = default;
  // `tokens` must outlive the matcher; `contents` are the strings to find (possibly normalized).
  void build(const std::vector<const AddedToken*>& tokens, const std::vector<std::string>& contents);
  bool empty() const { return tokens_.empty(); }

  // Splits `text` into token and text spans covering it.
  void split(std::string_view text, std::vector<TextSpan>& out) const;

 private:
  struct Node {
    std::map<unsigned char, int> next;
    int token = -1;  // index into tokens_
  };
  std::vector<Node> trie_;
  std::vector<const AddedToken*> tokens_;
};

}  // namespace dflash
