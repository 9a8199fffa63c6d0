#include "server/weights.h"

#include <fcntl.h>
#include <glog/logging.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <tuple>
#include <vector>

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
  if (s == "U8") return DType::kU8;  // bitsandbytes: weight_format, 4-bit codes, quant_state
  if (s == "F8_E4M3") return DType::kF8E4M3;  // fp8 checkpoints' linear weights only
  return absl::InvalidArgumentError(absl::StrCat("unsupported dtype ", s));
}

// The file's tensors as views of one read-only mapping; `mapped`, when given, gets the
// mapping's address and size.
absl::Status MapFile(const fs::path& path, std::map<std::string, Tensor>* out,
                     std::pair<void*, size_t>* mapped = nullptr) {
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
  auto tensors = ParseSafetensors(static_cast<const uint8_t*>(map->addr), map->size, file, map);
  if (!tensors.ok()) return tensors.status();
  if (mapped != nullptr) *mapped = {map->addr, map->size};
  *out = std::move(*tensors);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::map<std::string, Tensor>> ParseSafetensors(const uint8_t* base, size_t size,
                                                               const std::string& file,
                                                               std::shared_ptr<void> owner) {
  std::map<std::string, Tensor> tensors;
  if (size < 8) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": too small to be safetensors"));
  }
  uint64_t header_len;
  std::memcpy(&header_len, base, 8);
  if (header_len > size - 8) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": header length exceeds the file"));
  }
  // safetensors' own limit (MAX_HEADER_SIZE): beyond it, its reader refuses the file.
  constexpr uint64_t kMaxHeaderBytes = 100'000'000;
  if (header_len > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": a header of ", header_len,
                                                   " bytes, over safetensors' limit of ",
                                                   kMaxHeaderBytes));
  }
  Json header = Json::parse(reinterpret_cast<const char*>(base + 8),
                            reinterpret_cast<const char*>(base + 8 + header_len), nullptr, false);
  if (header.is_discarded() || !header.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": invalid JSON header"));
  }
  const size_t data_start = 8 + header_len;
  const size_t data_size = size - data_start;
  struct Span {
    uint64_t begin, end;
    std::string name;
    DType dtype;
    kernels::Shape shape;
  };
  std::vector<Span> spans;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      // Free-form text (as transformers writes {"format": "pt"}): a map of strings, as
      // safetensors' reader requires.
      const Json& m = it.value();
      if (!m.is_object() ||
          !std::all_of(m.begin(), m.end(), [](const Json& v) { return v.is_string(); })) {
        return absl::InvalidArgumentError(absl::StrCat(file, ": __metadata__ ",
                                                       m.dump().substr(0, 200),
                                                       " is not a map of strings to strings"));
      }
      continue;
    }
    const Json& t = it.value();
    const std::string where = absl::StrCat(file, ": tensor ", it.key());
    if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") ||
        !t.contains("data_offsets")) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": missing dtype/shape/data_offsets"));
    }
    if (!t["dtype"].is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": dtype ", t["dtype"].dump(), " is not a string"));
    }
    auto dtype = ParseDType(t["dtype"].get<std::string>());
    if (!dtype.ok())
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", dtype.status().message()));
    const Json& shape_json = t["shape"];
    const Json& offsets = t["data_offsets"];
    if (!shape_json.is_array() ||
        !std::all_of(shape_json.begin(), shape_json.end(),
                     [](const Json& d) { return d.is_number_unsigned(); })) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": shape ", shape_json.dump(),
                                                     " is not a list of non-negative integers"));
    }
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": data_offsets ", offsets.dump(),
                                                     " is not a pair of non-negative integers"));
    }
    kernels::Shape shape;
    // The element count, saturating: a shape whose bytes exceed the file cannot match below.
    uint64_t numel = 1;
    for (const Json& d : shape_json) {
      const uint64_t n = d.get<uint64_t>();
      if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": shape ", shape_json.dump(), " has a dimension too large"));
      }
      shape.push_back(static_cast<int64_t>(n));
      numel = (n != 0 && numel > std::numeric_limits<uint64_t>::max() / n) ? UINT64_MAX : numel * n;
    }
    const auto begin = offsets[0].get<uint64_t>();
    const auto end = offsets[1].get<uint64_t>();
    if (end < begin) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": data_offsets ", offsets.dump(), " end before they begin"));
    }
    if (end > data_size) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": data_offsets end at byte ", end,
                                                     " of the data, which has ", data_size,
                                                     " (a truncated file?)"));
    }
    const uint64_t elem = kernels::DTypeSize(*dtype);
    if (numel > (end - begin) / elem || end - begin != numel * elem) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": data_offsets span ", end - begin, " bytes; shape ", shape_json.dump(), " of ",
          t["dtype"].get<std::string>(), " needs ",
          numel > UINT64_MAX / elem ? std::string("more") : absl::StrCat(numel * elem)));
    }
    if (shape.empty()) shape.push_back(1);  // scalars as [1]
    spans.push_back({begin, end, it.key(), *dtype, std::move(shape)});
  }
  // As safetensors itself requires: the tensors' bytes tile the data exactly, without holes,
  // overlaps or trailing bytes (so that a file holds nothing else, and no tensor aliases
  // another).
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t covered = 0;
  for (const Span& span : spans) {
    if (span.begin != covered) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": tensor ", span.name, ": data_offsets [", span.begin, ", ", span.end,
                       "] ", span.begin < covered ? "overlap" : "leave a hole after",
                       " the tensors before, which end at byte ", covered,
                       " (safetensors data have no holes or overlaps)"));
    }
    covered = span.end;
  }
  if (covered != data_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": the tensors' data_offsets cover ", covered, " bytes of the ",
                     data_size, " after the header (safetensors data have no trailing bytes)"));
  }
  size_t unaligned = 0;
  for (const Span& span : spans) {
    const uint8_t* data = base + data_start + span.begin;
    if (reinterpret_cast<uintptr_t>(data) % kernels::DTypeSize(span.dtype) != 0) {
      // The format does not require alignment: safetensors' own writer pads the header to 8
      // bytes, but a file from another writer may place a tensor at any byte. Every kernel
      // reads elements of their own size, so such a tensor is copied to aligned memory.
      tensors[span.name] = Tensor::FromHost(data, span.shape, span.dtype);
      ++unaligned;
    } else {
      tensors[span.name] = Tensor::View(const_cast<uint8_t*>(data), span.shape, span.dtype,
                                        kernels::Device::kCpu, owner);
    }
  }
  if (unaligned > 0) {
    LOG(WARNING) << file << ": " << unaligned << " of " << tensors.size()
                 << " tensors do not start at a multiple of their element size; they were "
                    "copied to memory (the file's header is not padded as safetensors pads it)";
  }
  return tensors;
}

absl::StatusOr<std::map<std::string, Tensor>> ReadSafetensorsFile(const std::string& path) {
  std::map<std::string, Tensor> tensors;
  if (absl::Status st = MapFile(path, &tensors); !st.ok()) return st;
  return tensors;
}

absl::StatusOr<std::unique_ptr<WeightStore>> WeightStore::Open(const std::string& model_dir,
                                                               const TensorRenames& renames) {
  const fs::path dir(model_dir);
  std::vector<fs::path> files;
  std::map<std::string, std::string> placed;  // the index's weight_map: tensor -> file name
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
      // A file name, in this folder (no path: nothing outside the model is read).
      if (!it.value().is_string() || it.value().get<std::string>().empty() ||
          it.value().get<std::string>().find('/') != std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat(index.string(), ": weight_map[\"", it.key(),
                                                       "\"] = ", it.value().dump(),
                                                       " is not a file name of this folder"));
      }
      names.insert(it.value().get<std::string>());
      placed[it.key()] = it.value().get<std::string>();
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
    std::pair<void*, size_t> mapped;
    if (auto st = MapFile(f, &found, &mapped); !st.ok()) return st;
    store->mapped_.push_back(mapped);
    for (auto& [stored, t] : found) {
      if (auto where = placed.find(stored);
          where != placed.end() && where->second != f.filename().string()) {
        return absl::InvalidArgumentError(absl::StrCat(f.string(), ": tensor ", stored,
                                                       " is here, but ", index.string(),
                                                       " places it in ", where->second));
      }
      std::string name = stored;
      for (const auto& [from, to] : renames) {
        if (name.compare(0, from.size(), from) != 0) continue;
        name = to + name.substr(from.size());
        break;
      }
      // Which copy was meant is not for us to guess: a checkpoint holds each tensor once, in
      // the file its index names.
      if (auto had = store->tensors_.find(name); had != store->tensors_.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", name, name == stored ? "" : absl::StrCat(" (as ", stored, ")"),
                         " is in both ", had->second.file, " and ", f.string()));
      }
      store->tensors_[name] = Entry{std::move(t), f.string()};
    }
  }
  int64_t total = 0;
  for (const auto& [name, e] : store->tensors_) total += static_cast<int64_t>(e.view.nbytes());
  store->progress_ = std::make_unique<Progress>(
      absl::StrCat("loading weights (", files.size(), " files) from ", model_dir), total, 0);
  return store;
}

absl::StatusOr<Tensor> WeightStore::Get(const std::string& name, DType dtype) const {
  auto view = View(name);
  if (!view.ok() || view->dtype() == dtype) return view;
  return view->To(dtype);
}

absl::StatusOr<Tensor> WeightStore::View(const std::string& name, bool fp8_ok) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(dir_, ": tensor ", name, " is not in the checkpoint"));
  }
  if (it->second.view.dtype() == DType::kF8E4M3 && !fp8_ok) {
    // fp8 values mean nothing without their scales: only the fp8 linear loader reads them.
    return absl::InvalidArgumentError(absl::StrCat(
        it->second.file, ": tensor ", name,
        " is float8 e4m3: expected only as the linear weight of an fp8 checkpoint, with its "
        "weight_scale and a compressed-tensors or fbgemm_fp8 quantization_config"));
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
  if (read_.insert(name).second && progress_ != nullptr) {
    auto it = tensors_.find(name);
    if (it != tensors_.end()) progress_->AddBytes(static_cast<int64_t>(it->second.view.nbytes()));
  }
}

void WeightStore::FinishLoading() const {
  if (progress_ != nullptr) progress_->Finish();
}

void WeightStore::ReleaseMappedPages() const {
  for (const auto& [addr, size] : mapped_) {
    // Clean pages of a private read-only mapping: dropped here, read again on a later touch.
    if (madvise(addr, size, MADV_DONTNEED) != 0) {
      LOG(WARNING) << dir_
                   << ": madvise(MADV_DONTNEED) of a weights file failed: " << strerror(errno);
    }
  }
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
