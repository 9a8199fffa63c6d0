#include "server/weights.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace tgis::server {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using kernels::DType;
using kernels::Tensor;

struct Mapping {
  void* addr = MAP_FAILED;
  size_t size = 0;
  ~Mapping() {
    if (addr != MAP_FAILED) munmap(addr, size);
  }
};

absl::StatusOr<DType> ParseDType(const std::string& s) {
  if (s == "F32") return DType::kF32;
  if (s == "BF16") return DType::kBF16;
  if (s == "F16") return DType::kF16;
  if (s == "I32") return DType::kI32;
  if (s == "I64") return DType::kI64;
  if (s == "I8") return DType::kI8;
  return absl::InvalidArgumentError(absl::StrCat("unsupported dtype ", s));
}

absl::Status MapFile(const fs::path& path, std::map<std::string, Tensor>* out) {
  const std::string file = path.string();
  int fd = ::open(file.c_str(), O_RDONLY);
  if (fd < 0) return absl::NotFoundError(absl::StrCat(file, ": cannot open: ", strerror(errno)));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    return absl::InternalError(absl::StrCat(file, ": cannot stat"));
  }
  auto map = std::make_shared<Mapping>();
  map->size = static_cast<size_t>(st.st_size);
  if (map->size < 8) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(file, ": too small to be safetensors"));
  }
  map->addr = mmap(nullptr, map->size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map->addr == MAP_FAILED) {
    return absl::InternalError(absl::StrCat(file, ": mmap failed: ", strerror(errno)));
  }
  const auto* base = static_cast<const uint8_t*>(map->addr);
  uint64_t header_len;
  std::memcpy(&header_len, base, 8);
  if (header_len > map->size - 8) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": header length exceeds the file"));
  }
  Json header = Json::parse(reinterpret_cast<const char*>(base + 8),
                            reinterpret_cast<const char*>(base + 8 + header_len), nullptr, false);
  if (header.is_discarded() || !header.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": invalid JSON header"));
  }
  const size_t data_start = 8 + header_len;
  const size_t data_size = map->size - data_start;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const Json& t = it.value();
    const std::string where = absl::StrCat(file, ": tensor ", it.key());
    if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") ||
        !t.contains("data_offsets")) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": missing dtype/shape/data_offsets"));
    }
    auto dtype = ParseDType(t["dtype"].get<std::string>());
    if (!dtype.ok())
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", dtype.status().message()));
    kernels::Shape shape;
    int64_t numel = 1;
    for (const Json& d : t["shape"]) {
      shape.push_back(d.get<int64_t>());
      numel *= shape.back();
    }
    const auto begin = t["data_offsets"][0].get<uint64_t>();
    const auto end = t["data_offsets"][1].get<uint64_t>();
    if (end < begin || end > data_size ||
        end - begin != static_cast<uint64_t>(numel) * kernels::DTypeSize(*dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": data_offsets do not match its shape"));
    }
    if (shape.empty()) shape.push_back(1);  // scalars as [1]
    void* data = const_cast<uint8_t*>(base + data_start + begin);
    (*out)[it.key()] = Tensor::View(data, shape, *dtype, kernels::Device::kCpu, map);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::map<std::string, Tensor>> ReadSafetensorsFile(const std::string& path) {
  std::map<std::string, Tensor> tensors;
  if (absl::Status st = MapFile(path, &tensors); !st.ok()) return st;
  return tensors;
}

absl::StatusOr<std::unique_ptr<WeightStore>> WeightStore::Open(const std::string& model_dir) {
  const fs::path dir(model_dir);
  std::vector<fs::path> files;
  std::error_code ec;
  const fs::path index = dir / "model.safetensors.index.json";
  if (fs::exists(index, ec)) {
    std::ifstream in(index);
    std::stringstream buf;
    buf << in.rdbuf();
    Json j = Json::parse(buf.str(), nullptr, false);
    if (j.is_discarded() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index.string(), ": weight_map: missing or invalid"));
    }
    std::set<std::string> names;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      names.insert(it.value().get<std::string>());
    }
    for (const std::string& n : names) files.push_back(dir / n);
  } else if (fs::exists(dir / "model.safetensors", ec)) {
    files.push_back(dir / "model.safetensors");
  } else {
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      if (e.path().extension() == ".safetensors") files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
  }
  if (files.empty()) {
    return absl::NotFoundError(
        absl::StrCat(model_dir,
                     ": no model.safetensors, model.safetensors.index.json or *.safetensors (a "
                     "PyTorch .bin checkpoint must be converted with convert-to-safetensors)"));
  }
  auto store = std::make_unique<WeightStore>();
  store->dir_ = model_dir;
  for (const fs::path& f : files) {
    std::map<std::string, Tensor> found;
    if (auto st = MapFile(f, &found); !st.ok()) return st;
    for (auto& [name, t] : found) store->tensors_[name] = Entry{std::move(t), f.string()};
  }
  return store;
}

absl::StatusOr<Tensor> WeightStore::Get(const std::string& name, DType dtype) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(dir_, ": tensor ", name, " is not in the checkpoint"));
  }
  MarkRead(name);
  if (it->second.view.dtype() == dtype) return it->second.view;
  return it->second.view.To(dtype);
}

absl::StatusOr<Tensor> WeightStore::View(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(dir_, ": tensor ", name, " is not in the checkpoint"));
  }
  MarkRead(name);
  return it->second.view;
}

std::string WeightStore::FileOf(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? std::string() : it->second.file;
}

void WeightStore::MarkRead(const std::string& name) const {
  std::lock_guard<std::mutex> lock(read_mu_);
  read_.insert(name);
}

std::vector<std::string> WeightStore::Unread() const {
  std::lock_guard<std::mutex> lock(read_mu_);
  std::vector<std::string> out;
  for (const auto& [n, e] : tensors_) {
    if (read_.count(n) == 0) out.push_back(n);
  }
  return out;
}

std::vector<std::string> WeightStore::Names() const {
  std::vector<std::string> out;
  for (const auto& [n, e] : tensors_) out.push_back(n);
  return out;
}

}  // namespace tgis::server
