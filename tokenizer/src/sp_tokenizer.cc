// Tokenizer over a SentencePiece .model file (T5/mt0 spiece.model, Llama tokenizer.model).
#include "absl/strings/str_cat.h"
#include "tokenizer/sentencepiece.h"
#include "tokenizer/src/hf_tokenizer.h"
#include "tokenizer/src/sp_model.h"
#include "tokenizer/src/unicode.h"

namespace tgis::tok {
namespace {

class SpTokenizer : public Tokenizer {
 public:
  SpTokenizer(std::unique_ptr<SpModel> model, bool add_bos, bool add_eos)
      : model_(std::move(model)), add_bos_(add_bos), add_eos_(add_eos) {
    auto opt = [](int id) { return id >= 0 ? std::optional<int32_t>(id) : std::nullopt; };
    special_.bos = opt(model_->bos_id());
    special_.eos = opt(model_->eos_id());
    special_.pad = opt(model_->pad_id());
    special_.unk = opt(model_->unk_id());
  }

  absl::StatusOr<Encoding> Encode(std::string_view text, bool add_special_tokens) const override {
    if (size_t bad = FirstInvalidUtf8(text); bad != std::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("input is not valid UTF-8 (byte ", bad, ")"));
    }
    std::vector<SpPiece> pieces;
    std::string error;
    if (!model_->Encode(text, &pieces, &error)) return absl::InternalError(error);
    Encoding enc;
    auto add = [&enc](int32_t id, std::string piece, uint32_t b, uint32_t e) {
      enc.ids.push_back(id);
      enc.tokens.push_back(std::move(piece));
      enc.offsets.push_back(TokenOffset{b, e});
    };
    if (add_special_tokens && add_bos_ && special_.bos) {
      add(*special_.bos, model_->IdToPiece(*special_.bos), 0, 0);
    }
    for (SpPiece& p : pieces) add(p.id, std::move(p.piece), p.begin, p.end);
    if (add_special_tokens && add_eos_ && special_.eos) {
      add(*special_.eos, model_->IdToPiece(*special_.eos), 0, 0);
    }
    return enc;
  }

  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids,
                                     bool skip_special_tokens) const override {
    // SentencePiece drops control symbols when decoding; a caller that keeps special tokens
    // gets their piece text in place, as the Python tokenizers of these models do.
    std::string out;
    std::vector<int> run;
    auto flush = [&]() {
      if (!run.empty()) out += model_->DecodeIds(run);
      run.clear();
    };
    const int size = model_->Size();
    for (int32_t id : ids) {
      if (id < 0 || id >= size) continue;
      if (model_->IsControl(id)) {
        if (skip_special_tokens) continue;
        flush();
        out += model_->IdToPiece(id);
        continue;
      }
      run.push_back(id);
    }
    flush();
    return out;
  }

  std::optional<std::string> IdToToken(int32_t id) const override {
    if (id < 0 || id >= model_->Size()) return std::nullopt;
    return model_->IdToPiece(id);
  }
  std::optional<int32_t> TokenToId(std::string_view token) const override {
    int id = model_->PieceToId(token);
    if (model_->IsUnknown(id) && model_->IdToPiece(id) != token) return std::nullopt;
    return id;
  }
  size_t VocabSize() const override { return static_cast<size_t>(model_->Size()); }
  bool IsSpecial(int32_t id) const override {
    return id >= 0 && id < model_->Size() && model_->IsControl(id);
  }
  std::optional<std::string> TokenBytes(int32_t id) const override {
    if (id < 0 || id >= model_->Size() || model_->IsControl(id) || model_->IsUnknown(id)) {
      return std::nullopt;
    }
    std::string piece = model_->IdToPiece(id);
    if (model_->IsByte(id)) {  // <0xAB>
      return std::string(1, static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16)));
    }
    std::string out;
    static constexpr std::string_view kWordMarker = "\xe2\x96\x81";  // U+2581
    for (size_t i = 0; i < piece.size();) {
      if (piece.compare(i, kWordMarker.size(), kWordMarker) == 0) {
        out.push_back(' ');
        i += kWordMarker.size();
      } else {
        out.push_back(piece[i++]);
      }
    }
    return out;
  }
  bool DecodesAsByteGroup(int32_t id) const override {
    return id >= 0 && id < model_->Size() && model_->IsByte(id);
  }

 private:
  std::unique_ptr<SpModel> model_;
  bool add_bos_;
  bool add_eos_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadSpTokenizer(const std::string& file, bool add_bos,
                                                           bool add_eos) {
  std::string error;
  auto model = SpModel::Load(file, &error);
  if (!model) return absl::InvalidArgumentError(absl::StrCat(file, ": ", error));
  return std::unique_ptr<Tokenizer>(
      std::make_unique<SpTokenizer>(std::move(model), add_bos, add_eos));
}

}  // namespace tgis::tok

namespace tgis {
void EnableSentencePieceModels() { tok::SentencePieceLoader() = &tok::LoadSpTokenizer; }
}  // namespace tgis
