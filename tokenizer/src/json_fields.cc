#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "tokenizer/src/pipeline.h"

namespace tgis::tok {

absl::StatusOr<const Json*> Field(const Json& j, const std::string& path, const char* key) {
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": expected an object"));
  auto it = j.find(key);
  if (it == j.end()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ".", key, ": missing field"));
  }
  return &*it;
}

absl::StatusOr<std::string> StringField(const Json& j, const std::string& path, const char* key) {
  auto f = Field(j, path, key);
  if (!f.ok()) return f.status();
  if (!(*f)->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ".", key, ": expected a string"));
  }
  return (*f)->get<std::string>();
}

absl::StatusOr<bool> BoolField(const Json& j, const std::string& path, const char* key,
                               std::optional<bool> default_value) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (default_value) return *default_value;
    return absl::InvalidArgumentError(absl::StrCat(path, ".", key, ": missing field"));
  }
  if (!it->is_boolean()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ".", key, ": expected a boolean"));
  }
  return it->get<bool>();
}

absl::Status Unsupported(const std::string& path, std::string_view what) {
  return absl::UnimplementedError(absl::StrCat(path, ": unsupported ", std::string(what)));
}

absl::StatusOr<int32_t> TokenId(const Json& value, const std::string& where) {
  if (!value.is_number_integer()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": expected an integer token id"));
  }
  // Unsigned first: a uint64 beyond int64's range must not wrap to a small id.
  if (value.is_number_unsigned()
          ? value.get<uint64_t>() >= uint64_t{kMaxTokenIds}
          : (value.get<int64_t>() < 0 || value.get<int64_t>() >= kMaxTokenIds)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": token id ", value.dump(), " is not in [0, ", kMaxTokenIds, ")"));
  }
  return static_cast<int32_t>(value.get<int64_t>());
}

absl::StatusOr<int64_t> CountField(const Json& j, const std::string& path, const char* key,
                                   int64_t default_value, int64_t max) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return default_value;
  const bool in_range =
      it->is_number_unsigned()
          ? it->get<uint64_t>() <= static_cast<uint64_t>(max)
          : it->is_number_integer() && it->get<int64_t>() >= 0 && it->get<int64_t>() <= max;
  if (!in_range) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ".", key, ": ", it->dump(), " is not an integer in [0, ", max, "]"));
  }
  return it->get<int64_t>();
}

}  // namespace tgis::tok
