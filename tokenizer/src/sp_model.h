// A thin wrapper over libsentencepiece with only standard types in its interface: Debian's
// sentencepiece header carries its own absl::string_view, which clashes with the real abseil,
// so sp_model.cc is the one file that includes it and it includes nothing of abseil.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace tgis::tok {

struct SpPiece {
  int id;
  std::string piece;
  uint32_t begin;
  uint32_t end;
};

class SpModel {
 public:
  // Returns null and sets *error when the file cannot be loaded.
  static std::unique_ptr<SpModel> Load(const std::string& path, std::string* error);
  ~SpModel();

  bool Encode(std::string_view text, std::vector<SpPiece>* out, std::string* error) const;
  std::string DecodeIds(const std::vector<int>& ids) const;
  int PieceToId(std::string_view piece) const;  // unk id when absent
  std::string IdToPiece(int id) const;
  int Size() const;
  bool IsControl(int id) const;
  bool IsUnknown(int id) const;
  bool IsByte(int id) const;
  int bos_id() const;
  int eos_id() const;
  int pad_id() const;
  int unk_id() const;

 private:
  SpModel();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tgis::tok
