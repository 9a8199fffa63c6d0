// Tokenization models of tokenizer.json: BPE, Unigram, WordPiece, WordLevel.
#include <algorithm>
#include <cstdio>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "tokenizer/src/pipeline.h"
#include "tokenizer/src/unicode.h"

namespace tgis::tok {
namespace {

// Vocabulary shared by the models: token <-> id.
class Vocab {
 public:
  void Add(std::string token, int32_t id) {
    if (id >= static_cast<int32_t>(id_to_token_.size())) id_to_token_.resize(id + 1);
    id_to_token_[id] = token;
    token_to_id_[std::move(token)] = id;
  }
  std::optional<int32_t> Find(std::string_view t) const {
    auto it = token_to_id_.find(absl::string_view(t.data(), t.size()));
    if (it == token_to_id_.end()) return std::nullopt;
    return it->second;
  }
  const std::string* Token(int32_t id) const {
    if (id < 0 || id >= static_cast<int32_t>(id_to_token_.size())) return nullptr;
    if (id_to_token_[id].empty() && !token_to_id_.contains("")) return nullptr;
    return &id_to_token_[id];
  }
  size_t size() const { return id_to_token_.size(); }

 private:
  absl::flat_hash_map<std::string, int32_t> token_to_id_;
  std::vector<std::string> id_to_token_;
};

absl::Status ReadVocabObject(const Json& j, const std::string& path, Vocab* vocab) {
  auto v = Field(j, path, "vocab");
  if (!v.ok()) return v.status();
  if (!(*v)->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ".vocab: expected an object"));
  }
  for (auto it = (*v)->begin(); it != (*v)->end(); ++it) {
    auto id = TokenId(it.value(), absl::StrCat(path, ".vocab[\"", it.key(), "\"]"));
    if (!id.ok()) return id.status();
    vocab->Add(it.key(), *id);
  }
  return absl::OkStatus();
}

std::optional<std::string> OptionalString(const Json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string()) return std::nullopt;
  return it->get<std::string>();
}

// ---------------------------------------------------------------- BPE

class BpeModel : public Model {
 public:
  static absl::StatusOr<std::unique_ptr<Model>> Load(const Json& j, const std::string& path);

  absl::Status Tokenize(std::string_view piece, std::vector<Token>* out) const override;
  std::optional<int32_t> TokenToId(std::string_view t) const override { return vocab_.Find(t); }
  const std::string* IdToToken(int32_t id) const override { return vocab_.Token(id); }
  size_t VocabSize() const override { return vocab_.size(); }

 private:
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    uint32_t len;  // bytes of the input it covers; 0 once merged away
  };
  struct MergeInfo {
    int32_t rank;
    int32_t new_id;
  };
  static uint64_t PairKey(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  const MergeInfo* FindMerge(int32_t a, int32_t b) const {
    auto it = merges_.find(PairKey(a, b));
    return it == merges_.end() ? nullptr : &it->second;
  }
  absl::Status MergeWord(std::string_view w, std::vector<Symbol>* symbols) const;
  void MergeAll(std::vector<Symbol>* symbols) const;

  Vocab vocab_;
  absl::flat_hash_map<uint64_t, MergeInfo> merges_;
  std::optional<std::string> unk_token_;
  std::optional<std::string> continuing_subword_prefix_;
  std::optional<std::string> end_of_word_suffix_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::array<int32_t, 256> byte_token_ids_{};  // ids of <0xXX>, -1 when absent

  // Word cache, as HF has: results do not depend on it.
  static constexpr size_t kCacheCapacity = 10000;
  static constexpr size_t kMaxCachedWordLength = 256;
  mutable std::mutex cache_mu_;
  mutable absl::flat_hash_map<std::string, std::vector<std::pair<int32_t, uint32_t>>> cache_;
};

absl::StatusOr<std::unique_ptr<Model>> BpeModel::Load(const Json& j, const std::string& path) {
  auto m = std::make_unique<BpeModel>();
  if (auto st = ReadVocabObject(j, path, &m->vocab_); !st.ok()) return st;
  if (auto it = j.find("dropout"); it != j.end() && !it->is_null() && it->get<double>() != 0.0) {
    return Unsupported(path + ".dropout", "BPE dropout (non-deterministic encoding)");
  }
  m->unk_token_ = OptionalString(j, "unk_token");
  m->continuing_subword_prefix_ = OptionalString(j, "continuing_subword_prefix");
  m->end_of_word_suffix_ = OptionalString(j, "end_of_word_suffix");
  auto fuse = BoolField(j, path, "fuse_unk", false);
  auto bf = BoolField(j, path, "byte_fallback", false);
  auto im = BoolField(j, path, "ignore_merges", false);
  if (!fuse.ok()) return fuse.status();
  if (!bf.ok()) return bf.status();
  if (!im.ok()) return im.status();
  m->fuse_unk_ = *fuse;
  m->byte_fallback_ = *bf;
  m->ignore_merges_ = *im;
  if (m->unk_token_ && !m->vocab_.Find(*m->unk_token_)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ".unk_token: '", *m->unk_token_, "' is not in the vocab"));
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    m->byte_token_ids_[b] = m->vocab_.Find(name).value_or(-1);
  }
  auto merges = Field(j, path, "merges");
  if (!merges.ok()) return merges.status();
  if (!(*merges)->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ".merges: expected an array"));
  }
  const size_t prefix_len =
      m->continuing_subword_prefix_ ? m->continuing_subword_prefix_->size() : 0;
  m->merges_.reserve((*merges)->size());
  int32_t rank = 0;
  for (const Json& e : **merges) {
    std::string a, b;
    if (e.is_string()) {
      const std::string& s = e.get_ref<const std::string&>();
      size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ".merges[", rank, "]: expected two tokens separated by a space"));
      }
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ".merges[", rank, "]: expected \"a b\" or [\"a\", \"b\"]"));
    }
    auto ida = m->vocab_.Find(a);
    auto idb = m->vocab_.Find(b);
    std::string merged = a + (prefix_len > 0 && b.size() >= prefix_len ? b.substr(prefix_len) : b);
    auto idm = m->vocab_.Find(merged);
    if (!ida || !idb || !idm) {
      return absl::InvalidArgumentError(absl::StrCat(path, ".merges[", rank, "]: token '",
                                                     !ida   ? a
                                                     : !idb ? b
                                                            : merged,
                                                     "' is not in the vocab"));
    }
    m->merges_.try_emplace(PairKey(*ida, *idb), MergeInfo{rank, *idm});
    ++rank;
  }
  return std::unique_ptr<Model>(std::move(m));
}

absl::Status BpeModel::MergeWord(std::string_view w, std::vector<Symbol>* symbols) const {
  symbols->clear();
  // A pending unknown piece (id, length): emitted when the next known piece comes, or fused
  // with the next unknown one (fuse_unk).
  bool has_unk = false;
  int32_t unk_id_pending = 0;
  uint32_t unk_len = 0;
  auto add = [symbols](int32_t id, uint32_t len) {
    int32_t idx = static_cast<int32_t>(symbols->size());
    symbols->push_back(Symbol{id, idx - 1, idx + 1, len});
  };
  std::string buf;
  for (size_t i = 0; i < w.size();) {
    const size_t n = Utf8SeqLen(static_cast<unsigned char>(w[i]));
    const bool is_first = i == 0;
    const bool is_last = i + n >= w.size();
    std::string_view s = w.substr(i, n);
    if ((!is_first && continuing_subword_prefix_) || (is_last && end_of_word_suffix_)) {
      buf.clear();
      if (!is_first && continuing_subword_prefix_) buf += *continuing_subword_prefix_;
      buf.append(s);
      if (is_last && end_of_word_suffix_) buf += *end_of_word_suffix_;
      s = buf;
    }
    if (auto id = vocab_.Find(s)) {
      if (has_unk) {
        add(unk_id_pending, unk_len);
        has_unk = false;
      }
      add(*id, n);
    } else {
      bool done = false;
      if (byte_fallback_) {
        bool all = true;
        for (char c : s) all = all && byte_token_ids_[static_cast<unsigned char>(c)] >= 0;
        if (all) {
          for (char c : s) add(byte_token_ids_[static_cast<unsigned char>(c)], 1);
          done = true;
        }
      }
      if (!done && unk_token_) {
        int32_t unk_id = *vocab_.Find(*unk_token_);
        if (has_unk && fuse_unk_) {
          unk_len += static_cast<uint32_t>(n);
        } else {
          if (has_unk) add(unk_id_pending, unk_len);
          has_unk = true;
          unk_id_pending = unk_id;
          unk_len = static_cast<uint32_t>(n);
        }
      }
    }
    i += n;
  }
  if (has_unk) add(unk_id_pending, unk_len);
  if (!symbols->empty()) symbols->back().next = -1;
  MergeAll(symbols);
  return absl::OkStatus();
}

void BpeModel::MergeAll(std::vector<Symbol>* symbols_ptr) const {
  std::vector<Symbol>& sym = *symbols_ptr;
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t new_id;
    bool operator<(const Candidate& o) const {
      // priority_queue pops the largest: make the lowest rank, then lowest pos, largest.
      if (rank != o.rank) return rank > o.rank;
      return pos > o.pos;
    }
  };
  std::vector<Candidate> storage;
  storage.reserve(sym.size());
  std::priority_queue<Candidate> queue(std::less<Candidate>(), std::move(storage));
  for (size_t i = 0; i + 1 < sym.size(); ++i) {
    if (const MergeInfo* m = FindMerge(sym[i].id, sym[i + 1].id)) {
      queue.push({m->rank, static_cast<int32_t>(i), m->new_id});
    }
  }
  while (!queue.empty()) {
    Candidate top = queue.top();
    queue.pop();
    Symbol& cur = sym[top.pos];
    if (cur.len == 0 || cur.next == -1) continue;
    const int32_t next_pos = cur.next;
    const Symbol right = sym[next_pos];
    const MergeInfo* m = FindMerge(cur.id, right.id);
    if (m == nullptr || m->new_id != top.new_id) continue;
    cur.id = top.new_id;
    cur.len += right.len;
    cur.next = right.next;
    sym[next_pos].len = 0;
    if (right.next > -1 && right.next < static_cast<int32_t>(sym.size())) {
      sym[right.next].prev = top.pos;
    }
    if (cur.prev >= 0) {
      if (const MergeInfo* pm = FindMerge(sym[cur.prev].id, cur.id)) {
        queue.push({pm->rank, cur.prev, pm->new_id});
      }
    }
    if (cur.next >= 0 && cur.next < static_cast<int32_t>(sym.size())) {
      if (const MergeInfo* nm = FindMerge(cur.id, sym[cur.next].id)) {
        queue.push({nm->rank, top.pos, nm->new_id});
      }
    }
  }
  sym.erase(std::remove_if(sym.begin(), sym.end(), [](const Symbol& s) { return s.len == 0; }),
            sym.end());
}

absl::Status BpeModel::Tokenize(std::string_view piece, std::vector<Token>* out) const {
  if (piece.empty()) return absl::OkStatus();
  if (ignore_merges_) {
    if (auto id = vocab_.Find(piece)) {
      out->push_back(Token{*id, std::string(piece), Span{0, static_cast<uint32_t>(piece.size())}});
      return absl::OkStatus();
    }
  }
  auto emit = [&](const std::vector<std::pair<int32_t, uint32_t>>& word) {
    uint32_t off = 0;
    for (auto [id, len] : word) {
      out->push_back(Token{id, *vocab_.Token(id), Span{off, off + len}});
      off += len;
    }
  };
  const bool cacheable = piece.size() < kMaxCachedWordLength;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu_);
    auto it = cache_.find(absl::string_view(piece.data(), piece.size()));
    if (it != cache_.end()) {
      emit(it->second);
      return absl::OkStatus();
    }
  }
  thread_local std::vector<Symbol> symbols;
  if (auto st = MergeWord(piece, &symbols); !st.ok()) return st;
  std::vector<std::pair<int32_t, uint32_t>> word;
  word.reserve(symbols.size());
  for (const Symbol& s : symbols) word.emplace_back(s.id, s.len);
  emit(word);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (cache_.size() < kCacheCapacity) cache_.emplace(std::string(piece), std::move(word));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------- Unigram

class UnigramModel : public Model {
 public:
  static absl::StatusOr<std::unique_ptr<Model>> Load(const Json& j, const std::string& path);
  absl::Status Tokenize(std::string_view piece, std::vector<Token>* out) const override;
  std::optional<int32_t> TokenToId(std::string_view t) const override { return vocab_.Find(t); }
  const std::string* IdToToken(int32_t id) const override { return vocab_.Token(id); }
  size_t VocabSize() const override { return vocab_.size(); }

 private:
  static constexpr double kUnkPenalty = 10.0;
  Vocab vocab_;
  std::vector<double> scores_;
  std::optional<int32_t> unk_id_;
  bool byte_fallback_ = false;
  double min_score_ = std::numeric_limits<double>::infinity();
  size_t max_piece_len_ = 0;
};

absl::StatusOr<std::unique_ptr<Model>> UnigramModel::Load(const Json& j, const std::string& path) {
  auto m = std::make_unique<UnigramModel>();
  auto v = Field(j, path, "vocab");
  if (!v.ok()) return v.status();
  if (!(*v)->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ".vocab: expected an array"));
  }
  int32_t id = 0;
  for (const Json& e : **v) {
    if (!e.is_array() || e.size() != 2 || !e[0].is_string() || !e[1].is_number()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ".vocab[", id, "]: expected [piece, score]"));
    }
    std::string piece = e[0].get<std::string>();
    double score = e[1].get<double>();
    m->max_piece_len_ = std::max(m->max_piece_len_, piece.size());
    m->vocab_.Add(std::move(piece), id);
    m->scores_.push_back(score);
    m->min_score_ = std::min(m->min_score_, score);
    ++id;
  }
  if (auto it = j.find("unk_id"); it != j.end() && !it->is_null()) {
    auto unk = TokenId(*it, path + ".unk_id");
    if (!unk.ok()) return unk.status();
    m->unk_id_ = *unk;
    if (*m->unk_id_ >= id) {
      return absl::InvalidArgumentError(absl::StrCat(path, ".unk_id: out of the vocab range"));
    }
  }
  auto bf = BoolField(j, path, "byte_fallback", false);
  if (!bf.ok()) return bf.status();
  m->byte_fallback_ = *bf;
  return std::unique_ptr<Model>(std::move(m));
}

absl::Status UnigramModel::Tokenize(std::string_view s, std::vector<Token>* out) const {
  if (s.empty()) return absl::OkStatus();
  struct Node {
    int32_t id = -1;
    double score = 0;
    int64_t starts_at = -1;
  };
  const size_t size = s.size();
  const double unk_score = min_score_ - kUnkPenalty;
  std::vector<Node> best(size + 1);
  for (size_t start = 0; start < size;) {
    const double till_here = best[start].score;
    bool has_single = false;
    const size_t mblen = Utf8SeqLen(static_cast<unsigned char>(s[start]));
    const size_t limit = std::min(size - start, max_piece_len_);
    for (size_t len = 1; len <= limit; ++len) {
      auto id = vocab_.Find(s.substr(start, len));
      if (!id) continue;
      Node& target = best[start + len];
      const double cand = scores_[*id] + till_here;
      if (target.starts_at < 0 || cand > target.score) {
        target.score = cand;
        target.starts_at = static_cast<int64_t>(start);
        target.id = *id;
      }
      if (len == mblen) has_single = true;
    }
    if (!has_single) {
      if (!unk_id_) {
        return absl::InvalidArgumentError("the Unigram model has no unk_id for an unknown piece");
      }
      Node& target = best[start + mblen];
      const double cand = unk_score + till_here;
      if (target.starts_at < 0 || cand > target.score) {
        target.score = cand;
        target.starts_at = static_cast<int64_t>(start);
        target.id = *unk_id_;
      }
    }
    start += mblen;
  }
  // Backtrack, fusing consecutive unknown pieces into one.
  std::vector<std::pair<size_t, size_t>> pieces;  // reversed [start, end)
  size_t ends_at = size;
  std::optional<std::pair<size_t, size_t>> unk_run;
  while (ends_at > 0) {
    const Node& node = best[ends_at];
    const size_t starts_at = static_cast<size_t>(node.starts_at);
    if (unk_id_ && node.id == *unk_id_) {
      if (unk_run) {
        unk_run->first = starts_at;
      } else {
        unk_run = std::make_pair(starts_at, ends_at);
      }
    } else {
      if (unk_run) {
        pieces.push_back(*unk_run);
        unk_run.reset();
      }
      pieces.emplace_back(starts_at, ends_at);
    }
    ends_at = starts_at;
  }
  if (unk_run) pieces.push_back(*unk_run);
  std::reverse(pieces.begin(), pieces.end());
  for (auto [a, b] : pieces) {
    std::string_view str = s.substr(a, b - a);
    Span off{static_cast<uint32_t>(a), static_cast<uint32_t>(b)};
    if (auto id = vocab_.Find(str)) {
      out->push_back(Token{*id, std::string(str), off});
      continue;
    }
    if (byte_fallback_) {
      std::vector<Token> bytes;
      for (char c : str) {
        char name[8];
        std::snprintf(name, sizeof(name), "<0x%02X>", static_cast<unsigned char>(c));
        auto bid = vocab_.Find(name);
        if (!bid) break;
        bytes.push_back(Token{*bid, name, off});
      }
      if (bytes.size() == str.size()) {
        for (Token& t : bytes) out->push_back(std::move(t));
        continue;
      }
    }
    if (!unk_id_) return absl::InvalidArgumentError("the Unigram model has no unk_id");
    out->push_back(Token{*unk_id_, std::string(str), off});
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------- WordPiece / WordLevel

class WordPieceModel : public Model {
 public:
  static absl::StatusOr<std::unique_ptr<Model>> Load(const Json& j, const std::string& path) {
    auto m = std::make_unique<WordPieceModel>();
    if (auto st = ReadVocabObject(j, path, &m->vocab_); !st.ok()) return st;
    auto unk = StringField(j, path, "unk_token");
    if (!unk.ok()) return unk.status();
    m->unk_ = *unk;
    if (!m->vocab_.Find(m->unk_)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ".unk_token: not in the vocab"));
    }
    m->prefix_ = OptionalString(j, "continuing_subword_prefix").value_or("##");
    auto max_chars =
        CountField(j, path, "max_input_chars_per_word", 100, std::numeric_limits<int64_t>::max());
    if (!max_chars.ok()) return max_chars.status();
    m->max_chars_ = static_cast<size_t>(*max_chars);
    return std::unique_ptr<Model>(std::move(m));
  }
  absl::Status Tokenize(std::string_view s, std::vector<Token>* out) const override {
    size_t chars = 0;
    for (size_t i = 0; i < s.size(); i += Utf8SeqLen(static_cast<unsigned char>(s[i]))) ++chars;
    const Span whole{0, static_cast<uint32_t>(s.size())};
    if (chars > max_chars_) {
      out->push_back(Token{*vocab_.Find(unk_), unk_, whole});
      return absl::OkStatus();
    }
    std::vector<Token> sub;
    size_t start = 0;
    while (start < s.size()) {
      size_t end = s.size();
      bool found = false;
      while (start < end) {
        std::string cand = start > 0 ? prefix_ + std::string(s.substr(start, end - start))
                                     : std::string(s.substr(start, end - start));
        if (auto id = vocab_.Find(cand)) {
          sub.push_back(
              Token{*id, cand, Span{static_cast<uint32_t>(start), static_cast<uint32_t>(end)}});
          found = true;
          break;
        }
        size_t back = end - 1;
        while (back > start && (static_cast<unsigned char>(s[back]) & 0xC0) == 0x80) --back;
        end = back;
      }
      if (!found) {
        out->push_back(Token{*vocab_.Find(unk_), unk_, whole});
        return absl::OkStatus();
      }
      start = end;
    }
    for (Token& t : sub) out->push_back(std::move(t));
    return absl::OkStatus();
  }
  std::optional<int32_t> TokenToId(std::string_view t) const override { return vocab_.Find(t); }
  const std::string* IdToToken(int32_t id) const override { return vocab_.Token(id); }
  size_t VocabSize() const override { return vocab_.size(); }

 private:
  Vocab vocab_;
  std::string unk_;
  std::string prefix_;
  size_t max_chars_ = 100;
};

class WordLevelModel : public Model {
 public:
  static absl::StatusOr<std::unique_ptr<Model>> Load(const Json& j, const std::string& path) {
    auto m = std::make_unique<WordLevelModel>();
    if (auto st = ReadVocabObject(j, path, &m->vocab_); !st.ok()) return st;
    m->unk_ = OptionalString(j, "unk_token").value_or("<unk>");
    return std::unique_ptr<Model>(std::move(m));
  }
  absl::Status Tokenize(std::string_view s, std::vector<Token>* out) const override {
    const Span whole{0, static_cast<uint32_t>(s.size())};
    if (auto id = vocab_.Find(s)) {
      out->push_back(Token{*id, std::string(s), whole});
    } else if (auto unk = vocab_.Find(unk_)) {
      out->push_back(Token{*unk, unk_, whole});
    } else {
      return absl::InvalidArgumentError("WordLevel: unknown word and no unk_token in the vocab");
    }
    return absl::OkStatus();
  }
  std::optional<int32_t> TokenToId(std::string_view t) const override { return vocab_.Find(t); }
  const std::string* IdToToken(int32_t id) const override { return vocab_.Token(id); }
  size_t VocabSize() const override { return vocab_.size(); }

 private:
  Vocab vocab_;
  std::string unk_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> MakeModel(const Json& j, const std::string& path) {
  if (!j.is_object()) return absl::InvalidArgumentError(path + ": expected an object");
  std::string type;
  if (auto it = j.find("type"); it != j.end() && it->is_string()) {
    type = it->get<std::string>();
  } else if (j.contains("merges")) {
    type = "BPE";  // older files omit the model type
  } else {
    return absl::InvalidArgumentError(path + ".type: missing field");
  }
  if (type == "BPE") return BpeModel::Load(j, path);
  if (type == "Unigram") return UnigramModel::Load(j, path);
  if (type == "WordPiece") return WordPieceModel::Load(j, path);
  if (type == "WordLevel") return WordLevelModel::Load(j, path);
  return Unsupported(path, absl::StrCat("model type '", type, "'"));
}

}  // namespace tgis::tok
