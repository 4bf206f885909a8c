#include "tokenizer/tokenizer.h"

#include <filesystem>

#include "tokenizer/byte_level.h"
#include "tokenizer/utf8.h"
#include "util/error.h"
#include "util/mapped_file.h"

namespace dflash {

namespace {

// Post-processor -> ids around a single sequence. ByteLevel adds nothing.
void parse_post_processor(const nlohmann::json& j, std::vector<int32_t>& prefix, std::vector<int32_t>& suffix) {
  if (j.is_null()) return;
  check(j.is_object() && j.contains("type") && j["type"].is_string(), "post_processor: expected an object with a \"type\"");
  const std::string type = j["type"];
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    check(j.contains("processors") && j["processors"].is_array(), "post_processor Sequence: missing \"processors\"");
    for (const auto& p : j["processors"]) parse_post_processor(p, prefix, suffix);
    return;
  }
  check(type == "TemplateProcessing", "post_processor \"", type,
        "\" is not supported (supported: TemplateProcessing, ByteLevel, Sequence)");
  check(prefix.empty() && suffix.empty(), "post_processor: more than one TemplateProcessing");
  check(j.contains("single") && j["single"].is_array(), "post_processor TemplateProcessing: missing \"single\"");
  const auto& specials = j.value("special_tokens", nlohmann::json::object());
  bool seen_sequence = false;
  for (const auto& piece : j["single"]) {
    if (piece.contains("Sequence")) {
      check(!seen_sequence, "post_processor TemplateProcessing: \"single\" has two sequences");
      seen_sequence = true;
      continue;
    }
    check(piece.contains("SpecialToken") && piece["SpecialToken"].contains("id"),
          "post_processor TemplateProcessing: a \"single\" item is neither Sequence nor SpecialToken");
    const std::string name = piece["SpecialToken"]["id"];
    check(specials.contains(name) && specials[name].contains("ids") && specials[name]["ids"].is_array(),
          "post_processor TemplateProcessing: special token \"", name, "\" has no ids");
    for (const auto& id : specials[name]["ids"]) {
      check(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < (1 << 24),
            "post_processor TemplateProcessing: bad id for \"", name, "\"");
      (seen_sequence ? suffix : prefix).push_back(id.get<int32_t>());
    }
  }
  check(seen_sequence, "post_processor TemplateProcessing: \"single\" has no sequence");
}

void check_decoder(const nlohmann::json& j) {
  check(j.is_object() && j.contains("type") && j["type"].is_string(),
        "decoder: missing; only the ByteLevel decoder is supported");
  const std::string type = j["type"];
  if (type == "ByteLevel") return;
  if (type == "Sequence" && j.contains("decoders") && j["decoders"].is_array() && !j["decoders"].empty()) {
    for (const auto& d : j["decoders"]) check_decoder(d);
    return;
  }
  throw Error(cat("decoder \"", type, "\" is not supported (supported: ByteLevel)"));
}

// The ByteLevel decoder: a token whose characters all stand for bytes gives
// those bytes; any other token gives its own UTF-8 text.
std::string bytes_of_token(const std::string& token) {
  std::string out;
  size_t i = 0;
  while (i < token.size()) {
    const auto b = byte_level::byte_of(utf8::next(token, i));
    if (!b) return token;
    out += static_cast<char>(*b);
  }
  return out;
}

}  // namespace

Tokenizer::Tokenizer(const std::string& path) {
  std::filesystem::path p(path);
  if (std::filesystem::is_directory(p)) p /= "tokenizer.json";
  check(std::filesystem::is_regular_file(p), "tokenizer: ", p.string(), " not found");
  MappedFile f(p.string());
  load(std::string_view(reinterpret_cast<const char*>(f.data()), f.size()), p.string());
}

Tokenizer::Tokenizer(std::string_view json_text, const std::string& source) { load(json_text, source); }

void Tokenizer::load(std::string_view text, const std::string& source) {
  nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), nullptr, false);
  check(!j.is_discarded() && j.is_object(), source, ": not a JSON object");
  try {
    normalizer_ = Normalizer::from_json(j.value("normalizer", nlohmann::json()));
    pre_tokenizer_ = PreTokenizer::from_json(j.value("pre_tokenizer", nlohmann::json()));
    check(pre_tokenizer_ && pre_tokenizer_->byte_level(),
          "pre_tokenizer: only byte-level BPE is supported (no ByteLevel pre-tokenizer found)");
    check(j.contains("model"), "missing \"model\"");
    model_ = std::make_unique<BpeModel>(j["model"]);
    parse_post_processor(j.value("post_processor", nlohmann::json()), prefix_ids_, suffix_ids_);
    check_decoder(j.value("decoder", nlohmann::json()));
    if (j.contains("truncation")) check(j["truncation"].is_null(), "truncation is not supported");
    if (j.contains("padding")) check(j["padding"].is_null(), "padding is not supported");

    const auto& added = j.value("added_tokens", nlohmann::json::array());
    check(added.is_array(), "\"added_tokens\" must be a list");
    for (const auto& a : added) added_.push_back(AddedToken::from_json(a));
  } catch (const nlohmann::json::exception& e) {
    throw Error(cat(source, ": ", e.what()));
  } catch (const Error& e) {
    throw Error(cat(source, ": ", e.what()));
  }

  const auto& vocab = model_->id_to_token();
  int32_t n = static_cast<int32_t>(vocab.size());
  for (const auto& a : added_) n = std::max(n, a.id + 1);
  token_bytes_.assign(n, std::string());
  special_.assign(n, false);
  std::vector<bool> present(n, false);
  for (size_t i = 0; i < vocab.size(); ++i) {
    if (!vocab[i].empty()) token_bytes_[i] = bytes_of_token(vocab[i]), present[i] = true;
  }
  std::vector<const AddedToken*> raw, norm;
  std::vector<std::string> raw_text, norm_text;
  for (const auto& a : added_) {
    const auto in_vocab = model_->vocab().find(a.content);
    check(in_vocab == model_->vocab().end() || in_vocab->second == a.id, source, ": added token \"", a.content,
          "\" has id ", a.id, " but the vocab gives it ", in_vocab == model_->vocab().end() ? 0 : in_vocab->second);
    special_[a.id] = a.special;
    present[a.id] = true;
    added_by_content_.emplace(a.content, a.id);
    if (a.normalized) {
      // HF matches and decodes a normalized added token as its normalized text.
      norm.push_back(&a);
      norm_text.push_back(normalizer_ ? normalizer_->normalize(a.content) : a.content);
      token_bytes_[a.id] = bytes_of_token(norm_text.back());
    } else {
      token_bytes_[a.id] = bytes_of_token(a.content);
      raw.push_back(&a);
      raw_text.push_back(a.content);
    }
  }
  raw_matcher_.build(raw, raw_text);
  normalized_matcher_.build(norm, norm_text);
  for (int32_t id : prefix_ids_) check(id < n && present[id], source, ": post_processor uses unknown id ", id);
  for (int32_t id : suffix_ids_) check(id < n && present[id], source, ": post_processor uses unknown id ", id);
}

void Tokenizer::encode_text(std::string_view text, std::vector<int32_t>& out) const {
  std::string normalized = normalizer_ ? normalizer_->normalize(std::string(text)) : std::string(text);
  std::vector<TextSpan> spans;
  if (normalized_matcher_.empty()) spans.push_back({0, normalized.size(), -1});
  else normalized_matcher_.split(normalized, spans);
  std::vector<std::string> pieces;
  for (const TextSpan& s : spans) {
    if (s.id >= 0) {
      out.push_back(s.id);
      continue;
    }
    pieces.assign(1, normalized.substr(s.begin, s.end - s.begin));
    pre_tokenizer_->split(pieces);
    for (const std::string& p : pieces) model_->encode_piece(p, out);
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  utf8::require_valid(text, "text to tokenize");
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  if (add_special_tokens) out = prefix_ids_;
  if (!text.empty()) {
    std::vector<TextSpan> spans;
    if (raw_matcher_.empty()) spans.push_back({0, text.size(), -1});
    else raw_matcher_.split(text, spans);
    for (const TextSpan& s : spans) {
      if (s.id >= 0) out.push_back(s.id);
      else encode_text(text.substr(s.begin, s.end - s.begin), out);
    }
  }
  if (add_special_tokens) out.insert(out.end(), suffix_ids_.begin(), suffix_ids_.end());
  return out;
}

const std::string& Tokenizer::token_bytes(int32_t id) const {
  check(id >= 0 && id < vocab_size(), "token id ", id, " is out of range (vocabulary has ", vocab_size(), " ids)");
  return token_bytes_[id];
}

bool Tokenizer::is_special(int32_t id) const { return id >= 0 && id < vocab_size() && special_[id]; }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  const auto a = added_by_content_.find(std::string(token));
  if (a != added_by_content_.end()) return a->second;
  const auto v = model_->vocab().find(std::string(token));
  if (v != model_->vocab().end()) return v->second;
  return std::nullopt;
}

const std::string& Tokenizer::output_bytes(int32_t id) const {
  static const std::string none;
  check(id >= 0, "token id ", id, " is negative");
  return id < vocab_size() ? token_bytes_[static_cast<size_t>(id)] : none;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (skip_special_tokens && is_special(id)) continue;
    bytes += output_bytes(id);
  }
  return utf8::lossy(bytes);
}

std::string StreamDecoder::push(int32_t id) {
  const std::string& b = tok_.output_bytes(id);
  if (skip_special_ && tok_.is_special(id)) return {};
  pending_ += b;
  const size_t n = utf8::stable_prefix(pending_);
  std::string out = utf8::lossy(std::string_view(pending_).substr(0, n));
  pending_.erase(0, n);
  return out;
}

std::string StreamDecoder::finish() {
  std::string out = utf8::lossy(pending_);
  pending_.clear();
  return out;
}

}  // namespace dflash
