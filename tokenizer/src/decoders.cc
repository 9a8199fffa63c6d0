// Decoders of tokenizer.json: each turns token strings back into text pieces.
#include <limits>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "tokenizer/src/byte_level.h"
#include "tokenizer/src/pattern.h"
#include "tokenizer/src/pipeline.h"
#include "tokenizer/src/unicode.h"

namespace tgis::tok {
namespace {

class ByteLevelDecoder : public Decoder {
 public:
  std::string MidPiece(std::string token, bool*) const override {
    return DecodeChain({std::move(token)}, /*lossy=*/false);
  }
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    return {Utf8Lossy(DecodeChain(std::move(tokens), /*lossy=*/false))};
  }

 private:
  // The tokens' bytes (a token holding a character outside the table as it is).
  static std::string DecodeChain(std::vector<std::string> tokens, bool) {
    const ByteLevelTable& table = GetByteLevelTable();
    std::string bytes;
    for (const std::string& t : tokens) {
      size_t mark = bytes.size();
      bool all = true;
      for (size_t i = 0; i < t.size();) {
        char32_t c;
        i += Utf8Decode(t, i, &c);
        if (c >= table.char_to_byte.size() || table.char_to_byte[c] < 0) {
          all = false;
          break;
        }
        bytes.push_back(static_cast<char>(table.char_to_byte[c]));
      }
      if (!all) {
        bytes.resize(mark);
        bytes.append(t);
      }
    }
    return bytes;
  }
};

class MetaspaceDecoder : public Decoder {
 public:
  // In the middle of a text every replacement character is a space.
  std::string MidPiece(std::string token, bool*) const override {
    return DecodeChain({std::string(" "), std::move(token)})[1];
  }
  MetaspaceDecoder(char32_t replacement, bool prepend)
      : replacement_(replacement), prepend_(prepend) {}
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string out;
      const std::string& t = tokens[i];
      for (size_t p = 0; p < t.size();) {
        char32_t c;
        size_t n = Utf8Decode(t, p, &c);
        if (c == replacement_) {
          if (!(i == 0 && prepend_)) out.push_back(' ');
        } else {
          out.append(t, p, n);
        }
        p += n;
      }
      tokens[i] = std::move(out);
    }
    return tokens;
  }

 private:
  char32_t replacement_;
  bool prepend_;
};

class ReplaceDecoder : public Decoder {
 public:
  std::string MidPiece(std::string token, bool*) const override {
    return DecodeChain({std::move(token)})[0];
  }
  ReplaceDecoder(Pattern pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    for (std::string& t : tokens) {
      std::string out;
      for (const MatchSpan& m : pattern_.FindMatches(t)) {
        if (m.is_match) {
          out += content_;
        } else {
          out.append(t, m.start, m.end - m.start);
        }
      }
      t = std::move(out);
    }
    return tokens;
  }

 private:
  Pattern pattern_;
  std::string content_;
};

class ByteFallbackDecoder : public Decoder {
 public:
  // A byte token is its byte, whatever the bytes around it make.
  std::string MidPiece(std::string token, bool*) const override {
    const int byte = ParseByteToken(token);
    return byte >= 0 ? std::string(1, static_cast<char>(byte)) : token;
  }
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    std::vector<std::string> out;
    std::string pending;
    auto flush = [&]() {
      if (pending.empty()) return;
      if (IsValidUtf8(pending)) {
        out.push_back(pending);
      } else {
        for (size_t k = 0; k < pending.size(); ++k) out.emplace_back("\xEF\xBF\xBD");
      }
      pending.clear();
    };
    for (std::string& t : tokens) {
      int byte = ParseByteToken(t);
      if (byte >= 0) {
        pending.push_back(static_cast<char>(byte));
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    return out;
  }

  static int ParseByteToken(const std::string& t) {
    if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
    auto hex = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      return -1;
    };
    int hi = hex(t[3]), lo = hex(t[4]);
    if (hi < 0 || lo < 0) return -1;
    return hi * 16 + lo;
  }
};

class FuseDecoder : public Decoder {
 public:
  std::string MidPiece(std::string token, bool* whole_text) const override {
    *whole_text = true;
    return token;
  }
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    std::string all;
    for (const std::string& t : tokens) all += t;
    return {all};
  }
};

class StripDecoder : public Decoder {
 public:
  // After a Fuse it strips the ends of the whole text, never the middle.
  std::string MidPiece(std::string token, bool* whole_text) const override {
    return *whole_text ? token : DecodeChain({std::move(token)})[0];
  }
  StripDecoder(char32_t content, size_t start, size_t stop)
      : content_(content), start_(start), stop_(stop) {}
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    for (std::string& t : tokens) {
      std::vector<std::pair<size_t, char32_t>> chars;
      for (size_t p = 0; p < t.size();) {
        char32_t c;
        size_t n = Utf8Decode(t, p, &c);
        chars.emplace_back(p, c);
        p += n;
      }
      size_t start_cut = 0;
      for (size_t i = 0; i < std::min(start_, chars.size()); ++i) {
        if (chars[i].second != content_) break;
        start_cut = i + 1;
      }
      size_t stop_cut = chars.size();
      for (size_t i = 0; i < stop_ && i < chars.size(); ++i) {
        size_t index = chars.size() - i - 1;
        if (chars[index].second != content_) break;
        stop_cut = index;
      }
      if (stop_cut < start_cut) stop_cut = start_cut;
      size_t b0 = start_cut < chars.size() ? chars[start_cut].first : t.size();
      size_t b1 = stop_cut < chars.size() ? chars[stop_cut].first : t.size();
      t = t.substr(b0, b1 - b0);
    }
    return tokens;
  }

 private:
  char32_t content_;
  size_t start_, stop_;
};

class WordPieceDecoder : public Decoder {
 public:
  // In the middle of a text: the continuation prefix dropped, else a space before (cleanup's
  // rules, which read the neighbours, are not applied).
  std::string MidPiece(std::string token, bool*) const override {
    if (token.compare(0, prefix_.size(), prefix_) == 0) return token.substr(prefix_.size());
    return " " + token;
  }
  WordPieceDecoder(std::string prefix, bool cleanup)
      : prefix_(std::move(prefix)), cleanup_(cleanup) {}
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string& t = tokens[i];
      if (i != 0) {
        if (t.compare(0, prefix_.size(), prefix_) == 0) {
          t = t.substr(prefix_.size());
        } else {
          t = " " + t;
        }
      }
      if (cleanup_) t = Cleanup(t);
    }
    return tokens;
  }

  static std::string Cleanup(std::string s) {
    static const std::pair<const char*, const char*> kRules[] = {
        {" .", "."},   {" ?", "?"},     {" !", "!"},    {" ,", ","},
        {" ' ", "'"},  {" n't", "n't"}, {" 'm", "'m"},  {" do not", " don't"},
        {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
    for (auto [from, to] : kRules) {
      std::string out;
      const std::string f(from);
      size_t pos = 0;
      for (size_t hit = s.find(f); hit != std::string::npos; hit = s.find(f, pos)) {
        out.append(s, pos, hit - pos);
        out += to;
        pos = hit + f.size();
      }
      out.append(s, pos);
      s = std::move(out);
    }
    return s;
  }

 private:
  std::string prefix_;
  bool cleanup_;
};

class SequenceDecoder : public Decoder {
 public:
  std::string MidPiece(std::string token, bool* whole_text) const override {
    for (const auto& p : parts_) token = p->MidPiece(std::move(token), whole_text);
    return token;
  }
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> parts)
      : parts_(std::move(parts)) {}
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    for (const auto& p : parts_) tokens = p->DecodeChain(std::move(tokens));
    return tokens;
  }

 private:
  std::vector<std::unique_ptr<Decoder>> parts_;
};

absl::StatusOr<char32_t> OneChar(const Json& j, const std::string& path, const char* key) {
  auto s = StringField(j, path, key);
  if (!s.ok()) return s.status();
  if (s->empty() || !IsValidUtf8(*s)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ".", key, ": expected one character"));
  }
  char32_t c;
  if (static_cast<size_t>(Utf8Decode(*s, 0, &c)) != s->size()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ".", key, ": expected one character"));
  }
  return c;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Decoder>> MakeDecoder(const Json& j, const std::string& path) {
  auto type = StringField(j, path, "type");
  if (!type.ok()) return type.status();
  const std::string& t = *type;
  if (t == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (t == "Metaspace") {
    auto rep = OneChar(j, path, "replacement");
    if (!rep.ok()) return rep.status();
    bool prepend = true;
    if (auto it = j.find("prepend_scheme"); it != j.end() && it->is_string()) {
      prepend = it->get<std::string>() != "never";
    } else {
      auto aps = BoolField(j, path, "add_prefix_space", true);
      if (!aps.ok()) return aps.status();
      prepend = *aps;
    }
    return std::make_unique<MetaspaceDecoder>(*rep, prepend);
  }
  if (t == "Replace") {
    auto pat = Field(j, path, "pattern");
    if (!pat.ok()) return pat.status();
    auto p = Pattern::FromJson(**pat, path + ".pattern");
    if (!p.ok()) return p.status();
    auto content = StringField(j, path, "content");
    if (!content.ok()) return content.status();
    return std::make_unique<ReplaceDecoder>(std::move(*p), *content);
  }
  if (t == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (t == "Fuse") return std::make_unique<FuseDecoder>();
  if (t == "Strip") {
    auto c = OneChar(j, path, "content");
    if (!c.ok()) return c.status();
    constexpr int64_t kAny = std::numeric_limits<int64_t>::max();
    auto start = CountField(j, path, "start", 0, kAny);
    if (!start.ok()) return start.status();
    auto stop = CountField(j, path, "stop", 0, kAny);
    if (!stop.ok()) return stop.status();
    return std::make_unique<StripDecoder>(*c, static_cast<size_t>(*start),
                                          static_cast<size_t>(*stop));
  }
  if (t == "WordPiece") {
    std::string prefix = j.value("prefix", std::string("##"));
    bool cleanup = j.value("cleanup", true);
    return std::make_unique<WordPieceDecoder>(prefix, cleanup);
  }
  if (t == "Sequence") {
    auto list = Field(j, path, "decoders");
    if (!list.ok()) return list.status();
    std::vector<std::unique_ptr<Decoder>> parts;
    for (size_t i = 0; i < (*list)->size(); ++i) {
      auto d = MakeDecoder((**list)[i], absl::StrCat(path, ".decoders[", i, "]"));
      if (!d.ok()) return d.status();
      parts.push_back(std::move(*d));
    }
    return std::make_unique<SequenceDecoder>(std::move(parts));
  }
  return Unsupported(path, absl::StrCat("decoder type '", t, "'"));
}

}  // namespace tgis::tok
