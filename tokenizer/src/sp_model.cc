#include "tokenizer/src/sp_model.h"

#include <sentencepiece_processor.h>

namespace tgis::tok {

struct SpModel::Impl {
  sentencepiece::SentencePieceProcessor sp;
};

SpModel::SpModel() : impl_(std::make_unique<Impl>()) {}
SpModel::~SpModel() = default;

std::unique_ptr<SpModel> SpModel::Load(const std::string& path, std::string* error) {
  std::unique_ptr<SpModel> m(new SpModel());
  auto status = m->impl_->sp.Load(path);
  if (!status.ok()) {
    *error = status.ToString();
    return nullptr;
  }
  return m;
}

bool SpModel::Encode(std::string_view text, std::vector<SpPiece>* out, std::string* error) const {
  sentencepiece::ImmutableSentencePieceText spt;
  auto status = impl_->sp.Encode(absl::string_view(text.data(), text.size()), spt.mutable_proto());
  if (!status.ok()) {
    *error = status.ToString();
    return false;
  }
  out->clear();
  out->reserve(spt.pieces_size());
  for (size_t i = 0; i < spt.pieces_size(); ++i) {
    const auto& p = spt.pieces(static_cast<int>(i));
    out->push_back(SpPiece{static_cast<int>(p.id()), std::string(p.piece()), p.begin(), p.end()});
  }
  return true;
}

std::string SpModel::DecodeIds(const std::vector<int>& ids) const {
  std::string out;
  impl_->sp.Decode(ids, &out).IgnoreError();
  return out;
}

int SpModel::PieceToId(std::string_view piece) const {
  return impl_->sp.PieceToId(absl::string_view(piece.data(), piece.size()));
}
std::string SpModel::IdToPiece(int id) const { return impl_->sp.IdToPiece(id); }
int SpModel::Size() const { return impl_->sp.GetPieceSize(); }
bool SpModel::IsControl(int id) const { return impl_->sp.IsControl(id); }
bool SpModel::IsUnknown(int id) const { return impl_->sp.IsUnknown(id); }
bool SpModel::IsByte(int id) const { return impl_->sp.IsByte(id); }
int SpModel::bos_id() const { return impl_->sp.bos_id(); }
int SpModel::eos_id() const { return impl_->sp.eos_id(); }
int SpModel::pad_id() const { return impl_->sp.pad_id(); }
int SpModel::unk_id() const { return impl_->sp.unk_id(); }

}  // namespace tgis::tok
