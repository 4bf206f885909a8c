// tokenizer.json "pre_tokenizer": Split (regex or string, every behavior),
// ByteLevel, and Sequence. Pieces stay raw bytes: the byte-to-character map of
// ByteLevel is applied by the BPE model, which needs it anyway.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dflash {

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Splits every piece further; pieces are never empty.
  virtual void split(std::vector<std::string>& pieces) const = 0;
  // True when this (or a member of this Sequence) is ByteLevel.
  virtual bool byte_level() const { return false; }

  // null JSON -> nullptr (no pre-tokenizer).
  static std::unique_ptr<PreTokenizer> from_json(const nlohmann::json& j);
};

}  // namespace dflash
