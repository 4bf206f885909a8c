// tokenizer.json "normalizer": Unicode normalization forms (through utf8proc),
// Lowercase, and Sequence of those. Anything else is rejected at load.
#pragma once

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace dflash {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual std::string normalize(std::string text) const = 0;

  // null JSON -> nullptr (no normalizer).
  static std::unique_ptr<Normalizer> from_json(const nlohmann::json& j);
};

}  // namespace dflash
