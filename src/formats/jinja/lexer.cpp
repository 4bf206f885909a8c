#include "formats/jinja/lexer.h"

#include <cctype>

#include "tokenizer/utf8.h"
#include "util/error.h"

namespace dflash::jinja {

bool py_isspace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

namespace {

// Length of the whitespace run starting at s[i] (Python's \s).
size_t space_run(const std::string& s, size_t i) {
  size_t j = i;
  while (j < s.size()) {
    size_t k = j;
    if (!py_isspace(utf8::next(s, k))) break;
    j = k;
  }
  return j - i;
}

std::string rstrip_py(const std::string& s) {
  // Walk forward remembering the end of the last non-space character.
  size_t i = 0, keep = 0;
  while (i < s.size()) {
    const char32_t c = utf8::next(s, i);
    if (!py_isspace(c)) keep = i;
  }
  return s.substr(0, keep);
}

bool all_space(const std::string& s, size_t from) {
  return from < s.size() && space_run(s, from) == s.size() - from;
}

// Decodes a string literal body the way jinja2 does (Python unicode-escape).
std::string unescape(const std::string& body, int line) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    if (body[i] != '\\' || i + 1 >= body.size()) {
      out += body[i];
      continue;
    }
    const char e = body[++i];
    auto hex = [&](int n) {
      uint32_t v = 0;
      for (int k = 0; k < n; ++k) {
        check(i + 1 < body.size() && std::isxdigit(static_cast<unsigned char>(body[i + 1])), "template line ", line,
              ": bad \\x/\\u escape in a string");
        const char h = body[++i];
        v = v * 16 + (std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
      }
      check(v <= 0x10FFFF && (v < 0xD800 || v > 0xDFFF), "template line ", line, ": escape is not a character");
      utf8::append(out, v);
    };
    switch (e) {
      case 'n': out += '\n'; break;
      case 't': out += '\t'; break;
      case 'r': out += '\r'; break;
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'v': out += '\v'; break;
      case '\n': break;
      case 'x': hex(2); break;
      case 'u': hex(4); break;
      case 'U': hex(8); break;
      default:
        if (e >= '0' && e <= '7') {
          uint32_t v = e - '0';
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7'; ++k) {
            v = v * 8 + (body[++i] - '0');
          }
          utf8::append(out, v);
        } else {
          check(e != 'N', "template line ", line, ": \\N{...} escapes are not supported");
          out += '\\';
          out += e;
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string src) : s_(std::move(src)) {}

  std::vector<Token> run() {
    bool line_starting = true;
    while (pos_ < s_.size()) {
      size_t tag = find_tag(pos_);
      std::string text = s_.substr(pos_, (tag == std::string::npos ? s_.size() : tag) - pos_);
      if (tag == std::string::npos) {
        emit_text(text);
        break;
      }
      const char kind = s_[tag + 1];
      const char sign = tag + 2 < s_.size() && (s_[tag + 2] == '-' || s_[tag + 2] == '+') ? s_[tag + 2] : 0;
      if (sign == '-') {
        text = rstrip_py(text);
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: drop spaces between the line start and a block or comment tag.
        const size_t nl = text.rfind('\n');
        const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
        if ((l_pos > 0 || line_starting) && all_space(text, l_pos)) text.resize(l_pos);
      }
      emit_text(text);
      pos_ = tag + 2 + (sign ? 1 : 0);
      if (kind == '#') {
        line_starting = comment();
      } else {
        line_starting = tag_body(kind == '{');
      }
    }
    out_.push_back({Token::Type::End, "", line_});
    return std::move(out_);
  }

 private:
  size_t find_tag(size_t from) const {
    size_t i = from;
    while ((i = s_.find('{', i)) != std::string::npos) {
      if (i + 1 < s_.size() && (s_[i + 1] == '{' || s_[i + 1] == '%' || s_[i + 1] == '#')) return i;
      ++i;
    }
    return std::string::npos;
  }

  void emit_text(const std::string& text) {
    if (!text.empty()) out_.push_back({Token::Type::Text, text, line_});
    for (char c : text) line_ += c == '\n';
  }

  // After a block or comment end: "-" eats all whitespace, trim_blocks one "\n".
  // Returns whether what was consumed ends with a newline.
  bool after_end(char sign, bool block) {
    if (sign == '-') {
      const size_t n = space_run(s_, pos_);
      for (size_t k = pos_; k < pos_ + n; ++k) line_ += s_[k] == '\n';
      pos_ += n;
      return n > 0 && s_[pos_ - 1] == '\n';
    }
    if (block && sign != '+' && pos_ < s_.size() && s_[pos_] == '\n') {
      ++pos_, ++line_;
      return true;
    }
    return false;
  }

  bool comment() {
    const size_t end = s_.find("#}", pos_);
    check(end != std::string::npos, "template line ", line_, ": comment is not closed");
    for (size_t k = pos_; k < end; ++k) line_ += s_[k] == '\n';
    const char sign = end > pos_ && (s_[end - 1] == '-' || s_[end - 1] == '+') ? s_[end - 1] : 0;
    pos_ = end + 2;
    return after_end(sign, true);
  }

  // Lexes the inside of {{ }} or {% %}; returns line_starting for the next text.
  bool tag_body(bool var) {
    out_.push_back({var ? Token::Type::VarBegin : Token::Type::BlockBegin, "", line_});
    const size_t first = out_.size();
    std::string brackets;  // open brackets, innermost last
    while (true) {
      const size_t depth = brackets.size();
      while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) line_ += s_[pos_++] == '\n';
      check(pos_ < s_.size(), "template line ", line_, ": tag is not closed");
      const char c = s_[pos_];
      // The end delimiter counts only when brackets are balanced.
      if (depth == 0) {
        const char* close = var ? "}}" : "%}";
        char sign = 0;
        size_t at = pos_;
        if ((c == '-' || c == '+') && s_.compare(pos_ + 1, 2, close) == 0) sign = c, at = pos_ + 1;
        if (s_.compare(at, 2, close) == 0 && !(var && sign == '+')) {
          pos_ = at + 2;
          out_.push_back({var ? Token::Type::VarEnd : Token::Type::BlockEnd, "", line_});
          if (!var && out_.size() > first && out_[first].type == Token::Type::Name && out_[first].text == "raw") {
            return raw(sign);
          }
          return after_end(sign, !var);
        }
      }
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t j = pos_;
        while (j < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[j])) || s_[j] == '_')) ++j;
        out_.push_back({Token::Type::Name, s_.substr(pos_, j - pos_), line_});
        pos_ = j;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        number();
      } else if (c == '\'' || c == '"') {
        string(c);
      } else {
        static const char* ops3[] = {"**", "//", "==", "!=", "<=", ">="};
        std::string op(1, c);
        for (const char* o : ops3) {
          if (s_.compare(pos_, 2, o) == 0) op = o;
        }
        static const std::string single = "+-*/%~[](){}<>=.:|,;";
        check(op.size() == 2 || single.find(c) != std::string::npos, "template line ", line_, ": unexpected character '",
              std::string(1, c), "'");
        if (op == "(" || op == "[" || op == "{") brackets += op;
        if (op == ")" || op == "]" || op == "}") {
          const char open = op == ")" ? '(' : op == "]" ? '[' : '{';
          check(!brackets.empty() && brackets.back() == open, "template line ", line_, ": unexpected '", op, "'");
          brackets.pop_back();
        }
        out_.push_back({Token::Type::Op, op, line_});
        pos_ += op.size();
      }
    }
  }

  void number() {
    size_t j = pos_;
    auto digits = [&] {
      while (j < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[j])) || s_[j] == '_')) ++j;
    };
    digits();
    bool is_float = false;
    if (j + 1 < s_.size() && s_[j] == '.' && std::isdigit(static_cast<unsigned char>(s_[j + 1]))) {
      is_float = true;
      ++j;
      digits();
    }
    if (j < s_.size() && (s_[j] == 'e' || s_[j] == 'E')) {
      size_t k = j + 1;
      if (k < s_.size() && (s_[k] == '+' || s_[k] == '-')) ++k;
      if (k < s_.size() && std::isdigit(static_cast<unsigned char>(s_[k]))) {
        is_float = true;
        j = k;
        digits();
      }
    }
    std::string t;
    for (size_t k = pos_; k < j; ++k) {
      if (s_[k] != '_') t += s_[k];
    }
    out_.push_back({is_float ? Token::Type::Float : Token::Type::Int, t, line_});
    pos_ = j;
  }

  void string(char q) {
    size_t j = pos_ + 1;
    while (j < s_.size() && s_[j] != q) {
      if (s_[j] == '\\') ++j;
      ++j;
    }
    check(j < s_.size(), "template line ", line_, ": string literal is not closed");
    const std::string body = s_.substr(pos_ + 1, j - pos_ - 1);
    out_.push_back({Token::Type::String, unescape(body, line_), line_});
    for (char c : body) line_ += c == '\n';
    pos_ = j + 1;
  }

  // {% raw %}...{% endraw %}: the body is text, whitespace control on both tags.
  bool raw(char open_sign) {
    out_.resize(out_.size() - 3);  // drop BlockBegin, "raw", BlockEnd
    after_end(open_sign, true);
    size_t i = pos_;
    while (true) {
      i = s_.find("{%", i);
      check(i != std::string::npos, "template line ", line_, ": {% raw %} is not closed by {% endraw %}");
      size_t k = i + 2;
      char sign = 0;
      if (k < s_.size() && (s_[k] == '-' || s_[k] == '+')) sign = s_[k++];
      while (k < s_.size() && std::isspace(static_cast<unsigned char>(s_[k]))) ++k;
      if (s_.compare(k, 6, "endraw") != 0) {
        i += 2;
        continue;
      }
      k += 6;
      while (k < s_.size() && std::isspace(static_cast<unsigned char>(s_[k]))) ++k;
      char esign = 0;
      if (k < s_.size() && (s_[k] == '-' || s_[k] == '+')) esign = s_[k++];
      if (s_.compare(k, 2, "%}") != 0) {
        i += 2;
        continue;
      }
      std::string body = s_.substr(pos_, i - pos_);
      if (sign == '-') body = rstrip_py(body);
      emit_text(body);
      for (size_t m = i; m < k + 2; ++m) line_ += s_[m] == '\n';
      pos_ = k + 2;
      return after_end(esign, true);
    }
  }

  std::string s_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> out_;
};

}  // namespace

std::vector<Token> tokenize(const std::string& source) {
  utf8::require_valid(source, "template source");
  // Newlines become "\n" everywhere; one trailing newline is dropped.
  std::string s;
  s.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      s += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      s += source[i];
    }
  }
  if (!s.empty() && s.back() == '\n') s.pop_back();
  return Lexer(std::move(s)).run();
}

}  // namespace dflash::jinja
