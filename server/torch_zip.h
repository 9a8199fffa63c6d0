// The central directory of a zip archive held in memory (internal to torch_file.cc): torch.save
// stores its records uncompressed, so an entry is a byte range of the file.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace tgis::server::torch_detail {

struct ZipEntry {
  uint64_t offset = 0;  // of the entry's data in the archive
  uint64_t size = 0;
};

// Entries by name. Zip64 archives are read; compressed, encrypted or multi-disk ones are
// refused. Errors do not name the file (the caller does).
absl::StatusOr<std::map<std::string, ZipEntry>> ReadZipDirectory(std::string_view archive);

}  // namespace tgis::server::torch_detail
