#include "server/convert_checkpoint.h"

#include <glog/logging.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/progress.h"
#include "nlohmann/json.hpp"

namespace tgis::server {
namespace {
namespace fs = std::filesystem;
using Json = nlohmann::json;

// torch dtype name -> safetensors dtype, in the order of the safetensors library's Dtype enum
// (it writes tensors by that order, largest first, then by name).
const std::vector<std::pair<std::string, std::string>>& DTypeTable() {
  static const std::vector<std::pair<std::string, std::string>> kTable = {
      {"bool", "BOOL"},
      {"uint8", "U8"},
      {"int8", "I8"},
      {"float8_e5m2", "F8_E5M2"},
      {"float8_e4m3fn", "F8_E4M3"},
      {"int16", "I16"},
      {"uint16", "U16"},
      {"float16", "F16"},
      {"bfloat16", "BF16"},
      {"int32", "I32"},
      {"uint32", "U32"},
      {"float32", "F32"},
      {"float64", "F64"},
      {"int64", "I64"},
      {"uint64", "U64"},
  };
  return kTable;
}

absl::StatusOr<std::pair<std::string, int>> SafetensorsDType(const std::string& torch_dtype) {
  const auto& t = DTypeTable();
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i].first == torch_dtype) return std::make_pair(t[i].second, static_cast<int>(i));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("dtype ", torch_dtype, " has no safetensors equivalent"));
}

// Files of the folder whose names end with `suffix`, in name order.
std::vector<fs::path> FilesEndingWith(const fs::path& dir, const std::string& suffix) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (e.is_regular_file(ec) && absl::EndsWith(name, suffix)) out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string StripPrefix(std::string s, const std::string& prefix) {
  if (absl::StartsWith(s, prefix)) s = s.substr(prefix.size());
  return s;
}

// "pytorch_model-00001-of-00002.bin" -> "model-00001-of-00002.safetensors".
std::string SafetensorsName(const fs::path& bin) {
  return StripPrefix(bin.stem().string(), "pytorch_") + ".safetensors";
}

absl::StatusOr<std::string> ReadText(const fs::path& p) {
  std::ifstream in(p);
  if (!in) return absl::NotFoundError(absl::StrCat(p.string(), ": cannot read"));
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

// Reads `path` back and checks each tensor's bytes, dtype and shape against what was written.
absl::Status VerifyWritten(const std::string& path,
                           const std::map<std::string, const TorchTensor*>& tensors) {
  // One tensor in memory at a time (the source tensors are already held).
  std::ifstream in(path, std::ios::binary);
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  if (!in || ec || n > size - 8) return absl::DataLossError(path + ": written header is cut off");
  std::string text(n, '\0');
  in.read(text.data(), static_cast<std::streamsize>(n));
  const Json header = Json::parse(text, nullptr, false);
  if (!header.is_object()) return absl::DataLossError(path + ": written header does not parse");
  std::string bytes;
  for (const auto& [name, t] : tensors) {
    const Json& h = header.contains(name) ? header[name] : Json();
    const auto dtype = SafetensorsDType(t->dtype);
    bool ok = h.is_object() && dtype.ok() && h["dtype"] == dtype->first &&
              h["shape"] == Json(t->shape) && h["data_offsets"].is_array() &&
              h["data_offsets"].size() == 2;
    if (ok) {
      const uint64_t begin = h["data_offsets"][0].get<uint64_t>();
      const uint64_t end = h["data_offsets"][1].get<uint64_t>();
      ok = begin <= end && end - begin == t->bytes.size() && end <= size - 8 - n;
      if (ok) {
        bytes.resize(end - begin);
        in.seekg(static_cast<std::streamoff>(8 + n + begin));
        in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
        ok = in && std::memcmp(bytes.data(), t->bytes.data(), bytes.size()) == 0;
      }
    }
    if (!ok) return absl::DataLossError(absl::StrCat(path, ": tensor ", name, " reads back wrong"));
  }
  return absl::OkStatus();
}

absl::Status ConvertFile(const fs::path& bin, const fs::path& out) {
  // Like torch.load, this holds the whole file's tensors in memory.
  auto loaded = ReadTorchFile(bin.string());
  if (!loaded.ok()) return loaded.status();
  std::map<std::string, TorchTensor> tensors = *std::move(loaded);
  // A training checkpoint ({"state_dict": {...}, ...}) converts its state dict only, as TGIS.
  if (std::any_of(tensors.begin(), tensors.end(),
                  [](const auto& kv) { return absl::StartsWith(kv.first, "state_dict."); })) {
    std::map<std::string, TorchTensor> inner;
    for (auto& [k, v] : tensors) {
      if (absl::StartsWith(k, "state_dict.")) {
        inner.emplace(k.substr(std::strlen("state_dict.")), std::move(v));
      }
    }
    tensors = std::move(inner);
  }
  auto drop = SharedNamesToDrop(tensors, TiedOutputNames());
  if (!drop.ok())
    return absl::Status(drop.status().code(),
                        absl::StrCat(bin.string(), ": ", drop.status().message()));
  std::map<std::string, std::string> metadata{{"format", "pt"}};
  std::map<std::string, const TorchTensor*> kept;
  for (const auto& [name, t] : tensors) {
    if (auto it = drop->find(name); it != drop->end()) {
      metadata.emplace(name, it->second);
    } else {
      kept[name] = &t;
    }
  }
  if (absl::Status st = WriteSafetensors(out.string(), kept, metadata); !st.ok()) return st;
  return VerifyWritten(out.string(), kept);
}

}  // namespace

const std::vector<std::string>& TiedOutputNames() {
  // lm_head.weight: the LM head of every decoder we serve; embed_out.weight: GPT-NeoX's;
  // encoder/decoder.embed_tokens.weight: T5's copies of shared.weight.
  static const std::vector<std::string> kNames = {"lm_head.weight", "embed_out.weight",
                                                  "encoder.embed_tokens.weight",
                                                  "decoder.embed_tokens.weight"};
  return kNames;
}

absl::StatusOr<std::map<std::string, std::string>> SharedNamesToDrop(
    const std::map<std::string, TorchTensor>& tensors, const std::vector<std::string>& discard) {
  // storage -> (first byte, end byte, name), then runs of overlapping byte ranges.
  std::map<std::string, std::vector<std::tuple<int64_t, int64_t, std::string>>> by_storage;
  for (const auto& [name, t] : tensors) {
    if (t.storage.empty() || t.storage_nbytes == 0) continue;
    by_storage[t.storage].emplace_back(t.first_byte, t.end_byte, name);
  }
  std::map<std::string, std::string> drop;
  const std::set<std::string> discarded(discard.begin(), discard.end());
  for (auto& [storage, areas] : by_storage) {
    std::sort(areas.begin(), areas.end());
    std::vector<std::vector<std::string>> groups;
    int64_t stop = -1;
    for (const auto& [first, end, name] : areas) {
      if (groups.empty() || first >= stop) groups.emplace_back();
      groups.back().push_back(name);
      stop = std::max(stop, end);
    }
    for (std::vector<std::string>& group : groups) {
      if (group.size() < 2) continue;
      std::sort(group.begin(), group.end());
      std::vector<std::string> complete, preferred;
      for (const std::string& name : group) {
        const TorchTensor& t = tensors.at(name);
        if (t.first_byte == 0 && static_cast<int64_t>(t.bytes.size()) == t.storage_nbytes) {
          complete.push_back(name);
          if (!discarded.count(name)) preferred.push_back(name);
        }
      }
      if (complete.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensors ", absl::StrJoin(group, ", "),
            " share storage but none covers all of it; refusing to write more than the "
            "checkpoint holds"));
      }
      const std::string keep = preferred.empty() ? complete.front() : preferred.front();
      for (const std::string& name : group) {
        if (name != keep) drop[name] = keep;
      }
    }
  }
  return drop;
}

absl::Status WriteSafetensors(const std::string& path,
                              const std::map<std::string, const TorchTensor*>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  struct Item {
    int rank;
    std::string name, dtype;
    const TorchTensor* t;
  };
  std::vector<Item> items;
  for (const auto& [name, t] : tensors) {
    auto dtype = SafetensorsDType(t->dtype);
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor ", name, ": ", dtype.status().message()));
    }
    items.push_back({dtype->second, name, dtype->first, t});
  }
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.name < b.name;
  });
  // The header as the safetensors library writes it: compact JSON, __metadata__ first, the
  // tensors in data order, padded with spaces to a multiple of 8 bytes.
  std::string header = "{";
  if (!metadata.empty()) header += "\"__metadata__\":" + Json(metadata).dump() + ",";
  uint64_t offset = 0;
  for (const Item& it : items) {
    const uint64_t end = offset + it.t->bytes.size();
    header += Json(it.name).dump() + ":{\"dtype\":\"" + it.dtype +
              "\",\"shape\":" + Json(it.t->shape).dump() + ",\"data_offsets\":[" +
              std::to_string(offset) + "," + std::to_string(end) + "]},";
    offset = end;
  }
  if (header.back() == ',') header.pop_back();
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    const uint64_t n = header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out.write(header.data(), static_cast<std::streamsize>(header.size()));
    for (const Item& it : items) {
      out.write(reinterpret_cast<const char*>(it.t->bytes.data()),
                static_cast<std::streamsize>(it.t->bytes.size()));
    }
    out.flush();
    if (!out) {
      std::error_code ec;
      fs::remove(tmp, ec);
      return absl::InternalError(absl::StrCat(tmp, ": write failed: ", std::strerror(errno)));
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return absl::InternalError(absl::StrCat(path, ": ", ec.message()));
  return absl::OkStatus();
}

absl::StatusOr<ConvertResult> ConvertToSafetensors(const std::string& model_dir) {
  const fs::path dir(model_dir);
  std::vector<fs::path> bins = FilesEndingWith(dir, ".bin");
  const std::vector<fs::path> indexes = FilesEndingWith(dir, ".bin.index.json");
  if (indexes.size() > 1) {
    std::vector<std::string> names;
    for (const auto& p : indexes) names.push_back(p.filename().string());
    return absl::InvalidArgumentError(
        absl::StrCat(model_dir, ": more than one .bin.index.json: ", absl::StrJoin(names, ", ")));
  }
  if (bins.empty()) {
    return absl::NotFoundError(absl::StrCat(model_dir, ": no pytorch .bin files to convert"));
  }
  std::vector<fs::path> outs;
  for (const fs::path& b : bins) outs.push_back(dir / SafetensorsName(b));
  for (const fs::path& o : outs) {
    if (fs::exists(o)) {
      return absl::AlreadyExistsError(absl::StrCat(
          o.string(), ": existing .safetensors weights found, remove them first to reconvert"));
    }
  }
  ConvertResult result;
  // The index is checked now and written last, so that a failed conversion leaves no index
  // that would stop the next attempt.
  fs::path st_index;
  Json index_json;
  if (!indexes.empty()) {
    const fs::path& index = indexes[0];
    std::string stem = StripPrefix(index.filename().string(), "pytorch_");
    stem = stem.substr(0, stem.size() - std::strlen(".bin.index.json"));
    st_index = dir / (stem + ".safetensors.index.json");
    if (fs::exists(st_index)) {
      return absl::AlreadyExistsError(
          absl::StrCat(st_index.string(), ": existing index found, remove it first to reconvert"));
    }
    auto text = ReadText(index);
    if (!text.ok()) return text.status();
    index_json = Json::parse(*text, nullptr, false);
    if (!index_json.is_object() || !index_json.contains("weight_map") ||
        !index_json["weight_map"].is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(index.string(), ": no weight_map object"));
    }
    for (auto& [name, file] : index_json["weight_map"].items()) {
      if (!file.is_string() || fs::path(file.get<std::string>()).has_parent_path() ||
          !fs::exists(dir / file.get<std::string>())) {
        return absl::InvalidArgumentError(absl::StrCat(index.string(), ": weight_map[\"", name,
                                                       "\"] = ", file.dump(),
                                                       " is not a .bin file of this folder"));
      }
      file = SafetensorsName(file.get<std::string>());
    }
  }
  // Not weights: what trainers save beside them.
  std::vector<std::pair<fs::path, fs::path>> pairs;
  for (size_t i = 0; i < bins.size(); ++i) {
    const std::string name = bins[i].filename().string();
    bool skip = false;
    for (const char* s : {"arguments", "args", "training", "optimizer", "scheduler", "index"}) {
      skip = skip || name.find(s) != std::string::npos;
    }
    if (!skip) pairs.emplace_back(bins[i], outs[i]);
  }
  int64_t total = 0;
  std::error_code ec;
  for (const auto& [bin, out] : pairs) total += static_cast<int64_t>(fs::file_size(bin, ec));
  LOG(INFO) << "Converting " << pairs.size() << " pytorch .bin files to .safetensors...";
  Progress progress("convert " + model_dir, total, static_cast<int>(pairs.size()));
  for (size_t i = 0; i < pairs.size(); ++i) {
    const auto& [bin, out] = pairs[i];
    LOG(INFO) << "Converting: [" << i + 1 << "/" << pairs.size() << "] \""
              << bin.filename().string() << "\"";
    const auto start = std::chrono::steady_clock::now();
    if (absl::Status st = ConvertFile(bin, out); !st.ok()) return st;
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    LOG(INFO) << "Converted: [" << i + 1 << "/" << pairs.size() << "] \"" << out.filename().string()
              << "\" -- Took: " << secs << "s";
    progress.AddBytes(static_cast<int64_t>(fs::file_size(bin, ec)));
    progress.FileDone();
    result.written.push_back(out.string());
  }
  if (!st_index.empty()) {
    std::ofstream(st_index) << index_json.dump(4);
    result.written.push_back(st_index.string());
  }
  progress.Finish();
  return result;
}

}  // namespace tgis::server
