// Internal to the quantization config readers (quantization.cc, compressed_tensors.cc): typed
// reads of a JSON object's keys whose errors name the file, the key and the value.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "server/model_config.h"

namespace tgis::server::config_keys {

using Json = nlohmann::json;

inline absl::StatusOr<int64_t> IntKey(const Json& j, const std::string& where, const char* key,
                                      std::optional<int64_t> default_value) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (default_value) return *default_value;
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", key, ": missing"));
  }
  if (!it->is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", key, " = ", it->dump(), ": expected an integer"));
  }
  return it->get<int64_t>();
}

// A quantization group size: -1 (one group per output row) or a positive column count.
inline absl::StatusOr<int64_t> GroupSizeKey(const Json& j, const std::string& where,
                                            const char* key = "group_size") {
  auto group = IntKey(j, where, key, std::nullopt);
  if (!group.ok()) return group.status();
  if (*group != -1 && *group <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", key, " = ", *group));
  }
  return *group;
}

inline absl::StatusOr<std::string> StringKey(const Json& j, const std::string& where,
                                             const char* key, const std::string& default_value) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return default_value;
  if (!it->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", key, " = ", it->dump(), ": expected a string"));
  }
  return it->get<std::string>();
}

inline absl::StatusOr<bool> BoolKey(const Json& j, const std::string& where, const char* key,
                                    bool default_value) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return default_value;
  if (!it->is_boolean()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", key, " = ", it->dump(), ": expected true or false"));
  }
  return it->get<bool>();
}

// A boolean key that must not be true: `what` says why.
inline absl::Status RejectIfTrue(const Json& j, const std::string& where, const char* key,
                                 const std::string& what) {
  auto b = BoolKey(j, where, key, false);
  if (!b.ok()) return b.status();
  if (*b) return absl::UnimplementedError(absl::StrCat(where, ": ", key, ": ", what));
  return absl::OkStatus();
}

// [rows, columns] as float8 blocks are given: two positive integers.
inline bool IsPositivePair(const Json& v) {
  return v.is_array() && v.size() == 2 && v[0].is_number_integer() && v[1].is_number_integer() &&
         v[0].get<int64_t>() > 0 && v[1].get<int64_t>() > 0;
}

inline absl::Status CheckKeys(const Json& j, const std::string& where,
                              const std::set<std::string>& read,
                              const std::set<std::string>& ignored) {
  for (const auto& [key, value] : j.items()) {
    if (read.count(key) == 0 && ignored.count(key) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": key '", key, "' is not understood by this server"));
    }
  }
  return absl::OkStatus();
}

}  // namespace tgis::server::config_keys
