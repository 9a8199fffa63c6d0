#include "server/torch_zip.h"

#include "absl/strings/str_cat.h"

namespace tgis::server::torch_detail {
namespace {

constexpr uint32_t kLocalHeaderSig = 0x04034b50;
constexpr uint32_t kCentralHeaderSig = 0x02014b50;
constexpr uint32_t kEndSig = 0x06054b50;
constexpr uint32_t kZip64EndSig = 0x06064b50;
constexpr uint32_t kZip64LocatorSig = 0x07064b50;
constexpr size_t kEndSize = 22;
constexpr size_t kCentralHeaderSize = 46;
constexpr size_t kLocalHeaderSize = 30;

// Bounds-checked little-endian reads; a read past the end makes ok() false for good.
class Reader {
 public:
  explicit Reader(std::string_view data) : d_(data) {}
  uint64_t Get(uint64_t pos, size_t n) {
    if (pos > d_.size() || n > d_.size() - pos) {
      ok_ = false;
      return 0;
    }
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k) v |= uint64_t{static_cast<uint8_t>(d_[pos + k])} << (8 * k);
    return v;
  }
  std::string_view Bytes(uint64_t pos, uint64_t n) {
    if (pos > d_.size() || n > d_.size() - pos) {
      ok_ = false;
      return {};
    }
    return d_.substr(pos, n);
  }
  bool ok() const { return ok_; }

 private:
  std::string_view d_;
  bool ok_ = true;
};

absl::Status Corrupt(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("zip archive: ", what));
}

// The end-of-central-directory record is the last one whose comment reaches the end exactly.
bool FindEnd(std::string_view d, size_t* pos) {
  if (d.size() < kEndSize) return false;
  const size_t lowest = d.size() > kEndSize + 0xffff ? d.size() - kEndSize - 0xffff : 0;
  Reader r(d);
  for (size_t p = d.size() - kEndSize + 1; p-- > lowest;) {
    if (r.Get(p, 4) == kEndSig && p + kEndSize + r.Get(p + 20, 2) == d.size()) {
      *pos = p;
      return true;
    }
  }
  return false;
}

}  // namespace

absl::StatusOr<std::map<std::string, ZipEntry>> ReadZipDirectory(std::string_view archive) {
  size_t end;
  if (!FindEnd(archive, &end)) {
    return Corrupt("no end of central directory record (the file is truncated or not a zip)");
  }
  Reader r(archive);
  uint64_t disk = r.Get(end + 4, 2), cd_disk = r.Get(end + 6, 2);
  uint64_t count = r.Get(end + 10, 2);
  uint64_t cd_size = r.Get(end + 12, 4), cd_offset = r.Get(end + 16, 4);
  // Archives over 4 GiB (or 65535 entries) keep the real figures in the zip64 records.
  if (end >= 20 && r.Get(end - 20, 4) == kZip64LocatorSig) {
    const uint64_t z = r.Get(end - 20 + 8, 8);
    if (r.Get(z, 4) != kZip64EndSig) return Corrupt("zip64 end record not found");
    disk = r.Get(z + 16, 4);
    cd_disk = r.Get(z + 20, 4);
    count = r.Get(z + 32, 8);
    cd_size = r.Get(z + 40, 8);
    cd_offset = r.Get(z + 48, 8);
  }
  if (!r.ok()) return Corrupt("end of central directory record is cut off");
  if (disk != 0 || cd_disk != 0) return Corrupt("multi-disk archives are not supported");
  if (cd_offset > archive.size() || cd_size > archive.size() - cd_offset) {
    return Corrupt("central directory lies outside the file (truncated?)");
  }
  std::map<std::string, ZipEntry> entries;
  uint64_t p = cd_offset;
  for (uint64_t i = 0; i < count; ++i) {
    if (r.Get(p, 4) != kCentralHeaderSig || !r.ok()) {
      return Corrupt(absl::StrCat("central directory entry ", i, " is corrupt"));
    }
    const uint64_t flags = r.Get(p + 8, 2), method = r.Get(p + 10, 2);
    uint64_t csize = r.Get(p + 20, 4), usize = r.Get(p + 24, 4);
    const uint64_t name_len = r.Get(p + 28, 2), extra_len = r.Get(p + 30, 2);
    const uint64_t comment_len = r.Get(p + 32, 2);
    uint64_t local = r.Get(p + 42, 4);
    const std::string name(r.Bytes(p + kCentralHeaderSize, name_len));
    // Zip64 extra field: 64-bit values for exactly those fields that hold 0xffffffff.
    const uint64_t extra_end = p + kCentralHeaderSize + name_len + extra_len;
    for (uint64_t e = p + kCentralHeaderSize + name_len; e + 4 <= extra_end && r.ok();) {
      const uint64_t id = r.Get(e, 2), len = r.Get(e + 2, 2);
      uint64_t f = e + 4;
      if (id == 0x0001) {
        for (uint64_t* field : {&usize, &csize, &local}) {
          if (*field != 0xffffffff) continue;
          if (f + 8 > e + 4 + len) return Corrupt(absl::StrCat(name, ": short zip64 field"));
          *field = r.Get(f, 8);
          f += 8;
        }
      }
      e += 4 + len;
    }
    if (!r.ok()) return Corrupt(absl::StrCat("central directory entry ", i, " is cut off"));
    if (flags & 1) return Corrupt(absl::StrCat(name, ": encrypted entries are not supported"));
    if (method != 0) {
      return Corrupt(absl::StrCat(name, ": entry is compressed (method ", method,
                                  method == 8 ? ", deflate" : "",
                                  "); torch.save stores entries uncompressed, re-save the file "
                                  "with torch.save instead of re-zipping it"));
    }
    if (csize != usize) return Corrupt(absl::StrCat(name, ": stored entry changes size"));
    if (r.Get(local, 4) != kLocalHeaderSig) {
      return Corrupt(absl::StrCat(name, ": local header not found (truncated?)"));
    }
    const uint64_t data = local + kLocalHeaderSize + r.Get(local + 26, 2) + r.Get(local + 28, 2);
    if (!r.ok() || data > archive.size() || usize > archive.size() - data) {
      return Corrupt(absl::StrCat(name, ": data lies outside the file (truncated?)"));
    }
    entries[name] = ZipEntry{data, usize};
    p = extra_end + comment_len;
  }
  return entries;
}

}  // namespace tgis::server::torch_detail
