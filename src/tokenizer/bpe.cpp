#include "tokenizer/bpe.h"

#include <queue>

#include "tokenizer/byte_level.h"
#include "util/error.h"

namespace dflash {

namespace {

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

bool empty_or_null(const nlohmann::json& m, const char* key) {
  return !m.contains(key) || m[key].is_null() || (m[key].is_string() && m[key].get<std::string>().empty());
}

}  // namespace

BpeModel::BpeModel(const nlohmann::json& m) {
  check(m.is_object() && m.value("type", std::string("BPE")) == "BPE",
        "tokenizer model: only \"BPE\" is supported, found \"", m.is_object() ? m.value("type", std::string()) : "", "\"");
  check(m.contains("vocab") && m["vocab"].is_object(), "tokenizer model: missing \"vocab\" object");
  check(m.contains("merges") && m["merges"].is_array(), "tokenizer model: missing \"merges\" list");
  check(empty_or_null(m, "continuing_subword_prefix"), "tokenizer model: continuing_subword_prefix is not supported");
  check(empty_or_null(m, "end_of_word_suffix"), "tokenizer model: end_of_word_suffix is not supported");
  check(!m.contains("dropout") || m["dropout"].is_null() || (m["dropout"].is_number() && m["dropout"] == 0),
        "tokenizer model: BPE dropout is not supported");
  check(!m.contains("byte_fallback") || m["byte_fallback"].is_null() || m["byte_fallback"] == false,
        "tokenizer model: byte_fallback is not supported");
  if (m.contains("ignore_merges") && m["ignore_merges"].is_boolean()) ignore_merges_ = m["ignore_merges"];

  for (const auto& [tok, id] : m["vocab"].items()) {
    check(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < (1 << 24),
          "tokenizer model: vocab entry \"", tok, "\" has an invalid id");
    const auto i = id.get<int32_t>();
    vocab_[tok] = i;
    if (static_cast<size_t>(i) >= id_to_token_.size()) id_to_token_.resize(i + 1);
    check(id_to_token_[i].empty(), "tokenizer model: id ", i, " appears twice in vocab");
    id_to_token_[i] = tok;
  }
  for (int b = 0; b < 256; ++b) {
    const auto it = vocab_.find(byte_level::encode(std::string(1, static_cast<char>(b))));
    byte_id_[b] = it == vocab_.end() ? -1 : it->second;
  }
  if (!empty_or_null(m, "unk_token")) {
    check(m["unk_token"].is_string(), "tokenizer model: unk_token must be a string");
    const auto it = vocab_.find(m["unk_token"].get<std::string>());
    check(it != vocab_.end(), "tokenizer model: unk_token \"", m["unk_token"].get<std::string>(), "\" is not in vocab");
    unk_id_ = it->second;
  }

  const auto& merges = m["merges"];
  merges_.reserve(merges.size() * 2);
  for (size_t r = 0; r < merges.size(); ++r) {
    const auto& e = merges[r];
    std::string a, b;
    if (e.is_string()) {
      const std::string s = e;
      const size_t sp = s.find(' ', 1);
      check(sp != std::string::npos && sp + 1 < s.size(), "tokenizer model: merge ", r, " \"", s, "\" is not \"a b\"");
      a = s.substr(0, sp), b = s.substr(sp + 1);
    } else {
      check(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string(), "tokenizer model: merge ", r,
            " is not a pair of strings");
      a = e[0], b = e[1];
    }
    const auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
    check(ia != vocab_.end() && ib != vocab_.end(), "tokenizer model: merge ", r, " (\"", a, "\" \"", b,
          "\") uses a token missing from vocab");
    check(iab != vocab_.end(), "tokenizer model: merge ", r, " result \"", a + b, "\" is missing from vocab");
    merges_.try_emplace(pair_key(ia->second, ib->second), Merge{static_cast<int32_t>(r), iab->second});
  }
}

void BpeModel::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() == 1 && byte_id_[static_cast<unsigned char>(piece[0])] >= 0) {
    out.push_back(byte_id_[static_cast<unsigned char>(piece[0])]);
    return;
  }
  const bool cacheable = piece.size() <= kCacheMaxPiece;
  if (cacheable) {
    std::lock_guard lock(cache_mutex_);
    const auto it = cache_.find(std::string(piece));
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t start = out.size();
  merge(piece, out);
  if (cacheable) {
    std::lock_guard lock(cache_mutex_);
    if (cache_.size() < kCacheMaxEntries) cache_.try_emplace(std::string(piece), out.begin() + start, out.end());
  }
}

void BpeModel::merge(std::string_view piece, std::vector<int32_t>& out) const {
  if (ignore_merges_) {
    const auto it = vocab_.find(byte_level::encode(piece));
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  // Symbols form a doubly linked list over the piece's bytes.
  const int n = static_cast<int>(piece.size());
  std::vector<int32_t> id(n);
  std::vector<int> prev(n), next(n);
  for (int i = 0; i < n; ++i) {
    const int32_t b = byte_id_[static_cast<unsigned char>(piece[i])];
    check(b >= 0 || unk_id_ >= 0, "tokenizer: byte ", static_cast<int>(static_cast<unsigned char>(piece[i])),
          " has no token and the model has no unk_token");
    id[i] = b >= 0 ? b : unk_id_;
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Cand {
    int32_t rank;
    int left, right;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<>> heap;
  auto push = [&](int l) {
    if (l < 0 || next[l] < 0) return;
    const auto it = merges_.find(pair_key(id[l], id[next[l]]));
    if (it != merges_.end()) heap.push({it->second.rank, l, next[l]});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  std::vector<bool> dead(n, false);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    if (dead[c.left] || dead[c.right] || next[c.left] != c.right) continue;
    const auto it = merges_.find(pair_key(id[c.left], id[c.right]));
    if (it == merges_.end() || it->second.rank != c.rank) continue;
    id[c.left] = it->second.id;
    dead[c.right] = true;
    next[c.left] = next[c.right];
    if (next[c.right] >= 0) prev[next[c.right]] = c.left;
    push(prev[c.left]);
    push(c.left);
  }
  for (int i = 0; i >= 0 && i < n; i = next[i]) out.push_back(id[i]);
}

}  // namespace dflash
