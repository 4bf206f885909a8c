// tokenizer.json "model" of type BPE over byte-level characters: merge ranks
// applied lowest rank first (leftmost on ties) with a heap, so a long piece costs
// O(n log n), and a cache of recent pieces.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

namespace dflash {

class BpeModel {
 public:
  explicit BpeModel(const nlohmann::json& model);

  // Appends the ids of one pre-tokenized piece (raw bytes).
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;

  // Vocabulary entries, id -> token string (byte-level characters); empty where unused.
  const std::vector<std::string>& id_to_token() const { return id_to_token_; }
  const std::unordered_map<std::string, int32_t>& vocab() const { return vocab_; }

 private:
  void merge(std::string_view piece, std::vector<int32_t>& out) const;

  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::array<int32_t, 256> byte_id_{};  // id of each single-byte token, -1 if absent
  struct Merge {
    int32_t rank, id;
  };
  std::unordered_map<uint64_t, Merge> merges_;  // (left id << 32 | right id) -> rank and merged id
  bool ignore_merges_ = false;
  int32_t unk_id_ = -1;

  static constexpr size_t kCacheMaxPiece = 256, kCacheMaxEntries = 1 << 17;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace dflash
