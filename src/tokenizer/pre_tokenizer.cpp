#include "tokenizer/pre_tokenizer.h"

#include "tokenizer/byte_level.h"
#include "tokenizer/regex.h"
#include "util/error.h"

namespace dflash {

namespace {

enum class Behavior { Isolated, Removed, MergedWithPrevious, MergedWithNext, Contiguous };

Behavior parse_behavior(const std::string& s) {
  if (s == "Isolated") return Behavior::Isolated;
  if (s == "Removed") return Behavior::Removed;
  if (s == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (s == "MergedWithNext") return Behavior::MergedWithNext;
  if (s == "Contiguous") return Behavior::Contiguous;
  throw Error(cat("pre_tokenizer Split: behavior \"", s, "\" is not supported"));
}

std::string escape_literal(const std::string& s) {
  std::string out = "\\Q";
  for (size_t i = 0; i < s.size(); ++i) {
    if (s.compare(i, 2, "\\E") == 0) {
      out += "\\E\\\\E\\Q";
      ++i;
    } else {
      out += s[i];
    }
  }
  return out + "\\E";
}

// Splits each piece at the matches of a pattern, HF's NormalizedString::split.
class Split : public PreTokenizer {
 public:
  Split(const std::string& pattern, Behavior behavior, bool invert)
      : regex_(pattern), behavior_(behavior), invert_(invert) {}

  void split(std::vector<std::string>& pieces) const override {
    std::vector<std::string> out;
    out.reserve(pieces.size() * 4);
    std::vector<std::pair<size_t, size_t>> matches;
    for (const std::string& piece : pieces) {
      regex_.find_all(piece, matches);
      split_one(piece, matches, out);
    }
    pieces.swap(out);
  }

 private:
  void split_one(const std::string& s, const std::vector<std::pair<size_t, size_t>>& matches,
                 std::vector<std::string>& out) const {
    // (begin, end, is_match) covering s.
    struct Seg {
      size_t b, e;
      bool m;
    };
    std::vector<Seg> segs;
    size_t prev = 0;
    for (auto [b, e] : matches) {
      if (prev != b) segs.push_back({prev, b, invert_});
      segs.push_back({b, e, !invert_});
      prev = e;
    }
    if (prev != s.size()) segs.push_back({prev, s.size(), invert_});

    auto emit = [&](size_t b, size_t e) {
      if (e > b) out.emplace_back(s, b, e - b);
    };
    switch (behavior_) {
      case Behavior::Isolated:
        for (const Seg& g : segs) emit(g.b, g.e);
        break;
      case Behavior::Removed:
        for (const Seg& g : segs) {
          if (!g.m) emit(g.b, g.e);
        }
        break;
      case Behavior::MergedWithPrevious: {
        size_t start = 0;
        bool open = false;
        for (const Seg& g : segs) {
          if (g.m) {
            emit(open ? start : g.b, g.e);
            open = false;
          } else {
            if (open) emit(start, g.b);
            start = g.b;
            open = true;
          }
        }
        if (open) emit(start, s.size());
        break;
      }
      case Behavior::MergedWithNext: {
        bool pending = false;
        size_t start = 0;
        for (const Seg& g : segs) {
          if (g.m) {
            if (pending) emit(start, g.b);
            start = g.b;
            pending = true;
          } else {
            emit(pending ? start : g.b, g.e);
            pending = false;
          }
        }
        if (pending) emit(start, s.size());
        break;
      }
      case Behavior::Contiguous: {
        size_t i = 0;
        while (i < segs.size()) {
          size_t j = i + 1;
          while (j < segs.size() && segs[j].m == segs[i].m) ++j;
          emit(segs[i].b, segs[j - 1].e);
          i = j;
        }
        break;
      }
    }
  }

  Regex regex_;
  Behavior behavior_;
  bool invert_;
};

class ByteLevelPre : public PreTokenizer {
 public:
  ByteLevelPre(bool add_prefix_space, bool use_regex) : add_prefix_space_(add_prefix_space) {
    if (use_regex) regex_ = std::make_unique<Split>(byte_level::kGpt2Pattern, Behavior::Isolated, false);
  }
  void split(std::vector<std::string>& pieces) const override {
    if (add_prefix_space_) {
      for (std::string& p : pieces) {
        if (p[0] != ' ') p.insert(p.begin(), ' ');
      }
    }
    if (regex_) regex_->split(pieces);
  }
  bool byte_level() const override { return true; }

 private:
  bool add_prefix_space_;
  std::unique_ptr<Split> regex_;
};

class Sequence : public PreTokenizer {
 public:
  explicit Sequence(std::vector<std::unique_ptr<PreTokenizer>> parts) : parts_(std::move(parts)) {}
  void split(std::vector<std::string>& pieces) const override {
    for (const auto& p : parts_) p->split(pieces);
  }
  bool byte_level() const override {
    for (const auto& p : parts_) {
      if (p->byte_level()) return true;
    }
    return false;
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

bool get_bool(const nlohmann::json& j, const char* key, bool def) {
  if (!j.contains(key) || j[key].is_null()) return def;
  check(j[key].is_boolean(), "pre_tokenizer: \"", key, "\" must be true or false");
  return j[key].get<bool>();
}

}  // namespace

std::unique_ptr<PreTokenizer> PreTokenizer::from_json(const nlohmann::json& j) {
  if (j.is_null()) return nullptr;
  check(j.is_object() && j.contains("type") && j["type"].is_string(),
        "pre_tokenizer: expected an object with a \"type\"");
  const std::string type = j["type"];
  if (type == "Split") {
    check(j.contains("pattern") && j["pattern"].is_object(), "pre_tokenizer Split: missing \"pattern\"");
    const auto& pat = j["pattern"];
    std::string regex;
    if (pat.contains("Regex") && pat["Regex"].is_string()) regex = pat["Regex"];
    else if (pat.contains("String") && pat["String"].is_string()) regex = escape_literal(pat["String"]);
    else throw Error("pre_tokenizer Split: \"pattern\" must be {\"Regex\": ...} or {\"String\": ...}");
    check(j.contains("behavior") && j["behavior"].is_string(), "pre_tokenizer Split: missing \"behavior\"");
    return std::make_unique<Split>(regex, parse_behavior(j["behavior"]), get_bool(j, "invert", false));
  }
  if (type == "ByteLevel") {
    return std::make_unique<ByteLevelPre>(get_bool(j, "add_prefix_space", true), get_bool(j, "use_regex", true));
  }
  if (type == "Sequence") {
    check(j.contains("pretokenizers") && j["pretokenizers"].is_array(),
          "pre_tokenizer Sequence: missing \"pretokenizers\" list");
    std::vector<std::unique_ptr<PreTokenizer>> parts;
    for (const auto& p : j["pretokenizers"]) {
      auto t = from_json(p);
      if (t) parts.push_back(std::move(t));
    }
    return std::make_unique<Sequence>(std::move(parts));
  }
  throw Error(cat("pre_tokenizer \"", type, "\" is not supported (supported: Split, ByteLevel, Sequence)"));
}

}  // namespace dflash
