#include "server/torch_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "server/torch_pickle.h"
#include "server/torch_zip.h"

namespace tgis::server {
namespace {

static_assert(std::endian::native == std::endian::little, "torch files are read as little-endian");

using kernels::DType;
using kernels::Tensor;
using torch_detail::PyRef;
using torch_detail::PyValue;
using torch_detail::StorageRef;
using torch_detail::TensorRef;
using Kind = PyValue::Kind;

constexpr int kMaxDepth = 64;
// 0x1950a86a20f9469cfc6c, the legacy format's first pickle, as LONG1 bytes.
constexpr std::string_view kLegacyMagic("\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19", 10);

class MappedFile {
 public:
  ~MappedFile() {
    if (addr_ != MAP_FAILED) munmap(addr_, size_);
  }
  absl::Status Open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", strerror(errno)));
    struct stat st;
    if (fstat(fd, &st) != 0) {
      ::close(fd);
      return absl::InternalError(absl::StrCat(path, ": cannot stat: ", strerror(errno)));
    }
    size_ = static_cast<size_t>(st.st_size);
    if (size_ > 0) addr_ = mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    if (size_ > 0 && addr_ == MAP_FAILED) {
      return absl::InternalError(absl::StrCat(path, ": mmap failed: ", strerror(errno)));
    }
    return absl::OkStatus();
  }
  std::string_view data() const {
    return size_ == 0 ? std::string_view() : std::string_view(static_cast<char*>(addr_), size_);
  }

 private:
  void* addr_ = MAP_FAILED;
  size_t size_ = 0;
};

// What the pickle's persistent ids named: each storage key once, with its dtype and size.
struct Storages {
  std::map<std::string, StorageRef> roots;
  std::map<std::string, std::string_view> data;  // filled in by the format after the pickle
  bool big_endian = false;
};

// Turns ('storage', storage_class, key, location, numel[, view_metadata]) into a storage. The
// location (the device it was saved from) does not matter: everything is read to the host.
absl::StatusOr<PyRef> LoadStorage(const PyValue& pid, bool legacy, Storages* s) {
  const auto& it = pid.items;
  if (pid.kind != Kind::kTuple || it.empty() || it[0]->kind != Kind::kStr) {
    return absl::InvalidArgumentError("persistent id is not a tuple naming its kind");
  }
  if (it[0]->s != "storage") {
    return absl::InvalidArgumentError(absl::StrCat("persistent id of kind '", it[0]->s,
                                                   "' (a pickled nn.Module?); save a state_dict"));
  }
  StorageRef ref;
  if (it.size() != (legacy ? 6u : 5u) || it[1]->kind != Kind::kGlobal ||
      it[2]->kind != Kind::kStr || it[4]->kind != Kind::kInt || it[4]->i < 0 ||
      !torch_detail::LookupDType(it[1]->s, &ref.dtype, &ref.elem_size)) {
    return absl::InvalidArgumentError("malformed storage persistent id");
  }
  ref.key = it[2]->s;
  ref.numel = it[4]->i;
  if (ref.numel > (int64_t{1} << 56)) return absl::InvalidArgumentError("storage size too large");
  auto [root, fresh] = s->roots.emplace(ref.key, ref);
  if (!fresh && (root->second.dtype != ref.dtype || root->second.numel != ref.numel)) {
    return absl::InvalidArgumentError(
        absl::StrCat("storage ", ref.key, " is named with two dtypes or sizes"));
  }
  // Legacy storage views: (view_key, offset, numel) within the root, in elements.
  if (legacy && it[5]->kind != Kind::kNone) {
    const auto& v = it[5]->items;
    if (it[5]->kind != Kind::kTuple || v.size() != 3 || v[1]->kind != Kind::kInt ||
        v[2]->kind != Kind::kInt || v[1]->i < 0 || v[2]->i < 0 || v[1]->i > ref.numel ||
        v[2]->i > ref.numel - v[1]->i) {
      return absl::InvalidArgumentError("malformed storage view in a persistent id");
    }
    ref.offset = v[1]->i;
    ref.numel = v[2]->i;
  }
  PyRef out = torch_detail::NewValue(Kind::kStorage);
  out->storage = std::make_shared<StorageRef>(std::move(ref));
  return out;
}

bool MulOk(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

// Copies a (possibly strided) tensor out of its storage into row-major bytes.
absl::StatusOr<TorchTensor> Gather(const TensorRef& t, const Storages& s) {
  auto data_it = s.data.find(t.storage.key);
  if (data_it == s.data.end()) {
    return absl::InvalidArgumentError(absl::StrCat("storage ", t.storage.key, " has no data"));
  }
  const std::string_view data = data_it->second;
  TorchTensor out;
  out.dtype = t.dtype;
  out.shape = t.size;
  const int64_t es = static_cast<int64_t>(t.elem_size);
  int64_t numel = 1, last = 0, step;  // last: the highest element index the tensor touches
  for (size_t d = 0; d < t.size.size(); ++d) {
    if (!MulOk(numel, t.size[d], &numel)) return absl::InvalidArgumentError("size overflows");
  }
  for (size_t d = 0; d < t.size.size() && numel > 0; ++d) {
    if (!MulOk(t.size[d] - 1, t.stride[d], &step) || __builtin_add_overflow(last, step, &last)) {
      return absl::InvalidArgumentError("stride overflows");
    }
  }
  const int64_t view_begin = t.storage.offset * static_cast<int64_t>(t.storage.elem_size);
  const int64_t view_end = view_begin + t.storage.numel * static_cast<int64_t>(t.storage.elem_size);
  int64_t first_byte, end_byte;
  if (!MulOk(t.offset, es, &first_byte) ||
      __builtin_add_overflow(first_byte, view_begin, &first_byte) ||
      !MulOk(last + 1, es, &end_byte) || __builtin_add_overflow(end_byte, first_byte, &end_byte)) {
    return absl::InvalidArgumentError("storage offset overflows");
  }
  if (numel > 0 && (end_byte > view_end || view_end > static_cast<int64_t>(data.size()))) {
    return absl::InvalidArgumentError(absl::StrCat("tensor reaches past the end of storage ",
                                                   t.storage.key, " (truncated file?)"));
  }
  out.bytes.resize(static_cast<size_t>(numel * es));
  out.storage = t.storage.key;
  const StorageRef& root = s.roots.at(t.storage.key);
  out.storage_nbytes = root.numel * static_cast<int64_t>(root.elem_size);
  out.first_byte = first_byte;
  out.end_byte = numel == 0 ? first_byte : end_byte;
  if (numel == 0) return out;
  const char* base = data.data() + first_byte;
  const size_t rank = t.size.size();
  bool contiguous = true;  // dims of size 1 may carry any stride
  for (int64_t d = static_cast<int64_t>(rank) - 1, expect = 1; d >= 0; --d) {
    if (t.size[d] != 1 && t.stride[d] != expect) contiguous = false;
    expect *= t.size[d];
  }
  if (contiguous) std::memcpy(out.bytes.data(), base, out.bytes.size());
  // Else walk the elements in row-major order with an odometer over the dimensions.
  std::vector<int64_t> idx(rank, 0);
  int64_t src = 0;
  for (int64_t i = 0; i < numel && !contiguous; ++i) {
    std::memcpy(out.bytes.data() + i * es, base + src * es, es);
    for (size_t d = rank; d-- > 0;) {
      src += t.stride[d];
      if (++idx[d] < t.size[d]) break;
      src -= t.stride[d] * t.size[d];
      idx[d] = 0;
    }
  }
  if (s.big_endian) {
    // Complex numbers swap each half on its own.
    const size_t unit = t.dtype.rfind("complex", 0) == 0 ? t.elem_size / 2 : t.elem_size;
    for (size_t k = 0; k + unit <= out.bytes.size(); k += unit) {
      std::reverse(out.bytes.begin() + k, out.bytes.begin() + k + unit);
    }
  }
  return out;
}

absl::Status Flatten(const PyRef& v, const std::string& key, int depth, const Storages& s,
                     std::map<std::string, TorchTensor>* out) {
  const std::string where = key.empty() ? "the top-level object" : absl::StrCat("key '", key, "'");
  if (depth > kMaxDepth) return absl::InvalidArgumentError(where + ": nested too deeply");
  if (v->kind == Kind::kTensor) {
    auto t = Gather(*v->tensor, s);
    if (!t.ok()) return absl::InvalidArgumentError(absl::StrCat(where, ": ", t.status().message()));
    if (!out->emplace(key, *std::move(t)).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": appears twice"));
    }
    return absl::OkStatus();
  }
  if (v->kind != Kind::kDict) {
    return absl::InvalidArgumentError(absl::StrCat(where, " holds an object of type ",
                                                   torch_detail::KindName(v->kind),
                                                   ", not a tensor or a dict of tensors"));
  }
  for (const auto& [k, child] : v->entries) {
    if (k->kind != Kind::kStr) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " has a key of type ", torch_detail::KindName(k->kind)));
    }
    const std::string name = key.empty() ? k->s : absl::StrCat(key, ".", k->s);
    if (absl::Status st = Flatten(child, name, depth + 1, s, out); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::StatusOr<PyRef> ReadZip(std::string_view file, Storages* s) {
  auto entries = torch_detail::ReadZipDirectory(file);
  if (!entries.ok()) return entries.status();
  // The records sit under one folder whose name varies (the file's stem, or "archive").
  std::string prefix;
  int found = 0;
  for (const auto& [name, e] : *entries) {
    const size_t slash = name.find('/');
    if (slash != std::string::npos && name.substr(slash) == "/data.pkl") {
      prefix = name.substr(0, slash + 1);
      ++found;
    }
  }
  if (found != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "zip archive with ", found, " <folder>/data.pkl records; torch.save writes exactly one"));
  }
  if (entries->count(prefix + "constants.pkl")) {
    return absl::InvalidArgumentError("a TorchScript archive (torch.jit.save), not torch.save's");
  }
  auto bytes = [&](const torch_detail::ZipEntry& e) { return file.substr(e.offset, e.size); };
  if (auto it = entries->find(prefix + "byteorder"); it != entries->end()) {
    const std::string_view order = bytes(it->second);
    if (order != "little" && order != "big") {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown byteorder '", std::string(order), "'"));
    }
    s->big_endian = order == "big";
  }
  size_t used;
  auto root = torch_detail::Unpickle(
      bytes(entries->at(prefix + "data.pkl")),
      [s](const PyValue& pid) { return LoadStorage(pid, /*legacy=*/false, s); }, &used);
  if (!root.ok()) return root.status();
  for (const auto& [key, ref] : s->roots) {
    auto it = entries->find(absl::StrCat(prefix, "data/", key));
    if (it == entries->end()) {
      return absl::InvalidArgumentError(absl::StrCat("record ", prefix, "data/", key, " missing"));
    }
    s->data[key] = bytes(it->second);
  }
  return root;
}

// Pickles for the magic number, protocol version, system info and the object; then a pickled
// list of storage keys, then each storage's data behind an 8-byte element count.
absl::StatusOr<PyRef> ReadLegacy(std::string_view file, Storages* s) {
  const torch_detail::PersistentLoad none = [](const PyValue&) -> absl::StatusOr<PyRef> {
    return absl::InvalidArgumentError("unexpected persistent id");
  };
  size_t pos = 0, used;
  auto next = [&](const torch_detail::PersistentLoad& pl) -> absl::StatusOr<PyRef> {
    auto v = torch_detail::Unpickle(file.substr(pos), pl, &used);
    if (v.ok()) pos += used;
    return v;
  };
  auto magic = next(none);
  if (!magic.ok() || (*magic)->kind != Kind::kBigInt || (*magic)->s != kLegacyMagic) {
    return absl::InvalidArgumentError("not a torch.save file (no zip archive, no magic number)");
  }
  auto version = next(none);
  if (!version.ok()) return version.status();
  if ((*version)->kind != Kind::kInt || (*version)->i != 1001) {
    return absl::InvalidArgumentError("unknown legacy protocol version");
  }
  auto info = next(none);
  if (!info.ok()) return info.status();
  for (const auto& [k, v] : (*info)->entries) {
    if (k->s == "little_endian" && v->kind == Kind::kBool) s->big_endian = v->i == 0;
  }
  auto root = next([s](const PyValue& pid) { return LoadStorage(pid, /*legacy=*/true, s); });
  if (!root.ok()) return root.status();
  auto keys = next(none);
  if (!keys.ok()) return keys.status();
  if ((*keys)->kind != Kind::kList) return absl::InvalidArgumentError("storage key list missing");
  for (const PyRef& k : (*keys)->items) {
    auto it = s->roots.find(k->s);
    if (k->kind != Kind::kStr || it == s->roots.end()) {
      return absl::InvalidArgumentError(absl::StrCat("storage key '", k->s, "' is not used"));
    }
    const std::string_view header = file.substr(std::min(pos, file.size()), 8);
    uint64_t count = 0;
    for (size_t b = 0; b < header.size(); ++b) {
      const size_t shift = s->big_endian ? 8 * (7 - b) : 8 * b;
      count |= uint64_t{static_cast<uint8_t>(header[b])} << shift;
    }
    const uint64_t nbytes = count * it->second.elem_size;
    if (header.size() < 8 || count > file.size() || nbytes > file.size() - pos - 8) {
      return absl::InvalidArgumentError(
          absl::StrCat("data of storage ", k->s, " is cut off (truncated file?)"));
    }
    s->data[k->s] = file.substr(pos + 8, nbytes);
    pos += 8 + nbytes;
  }
  return root;
}

}  // namespace

absl::StatusOr<std::map<std::string, TorchTensor>> ReadTorchFile(const std::string& path) {
  MappedFile mapped;
  if (absl::Status st = mapped.Open(path); !st.ok()) return st;
  return ParseTorchFile(mapped.data(), path);
}

absl::StatusOr<std::map<std::string, TorchTensor>> ParseTorchFile(std::string_view file,
                                                                  const std::string& path) {
  auto fail = [&](absl::string_view msg) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", msg));
  };
  Storages storages;
  absl::StatusOr<PyRef> root;
  if (file.empty()) return fail("empty file");
  if (file.substr(0, 2) == "PK") {
    root = ReadZip(file, &storages);
  } else if (file.size() > 262 && file.substr(257, 5) == "ustar") {
    return fail("a tar archive: the torch.save format of torch < 1.0 is not supported");
  } else if (static_cast<uint8_t>(file[0]) == 0x80) {
    root = ReadLegacy(file, &storages);
  } else {
    return fail("not a torch.save file (neither a zip archive nor a pickle)");
  }
  if (!root.ok()) return fail(root.status().message());
  std::map<std::string, TorchTensor> out;
  if (absl::Status st = Flatten(*root, "", 0, storages, &out); !st.ok()) {
    return fail(st.message());
  }
  return out;
}

absl::StatusOr<Tensor> ToFloatTensor(const TorchTensor& t, DType dtype, const std::string& what) {
  const std::string prefix = what.empty() ? "" : absl::StrCat(what, ": ");
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "cannot convert to ", kernels::DTypeName(dtype), ", not a float"));
  }
  DType src;
  size_t es;
  if (t.dtype == "float32" || t.dtype == "float64") {
    src = DType::kF32;
    es = t.dtype == "float32" ? 4 : 8;
  } else if (t.dtype == "float16" || t.dtype == "bfloat16") {
    src = t.dtype == "float16" ? DType::kF16 : DType::kBF16;
    es = 2;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "tensor of dtype ", t.dtype,
                                                   " is not float64/float32/float16/bfloat16"));
  }
  kernels::Shape shape = t.shape.empty() ? kernels::Shape{1} : t.shape;
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0 || !MulOk(numel, d, &numel)) {
      return absl::InvalidArgumentError(absl::StrCat(prefix, "invalid shape"));
    }
  }
  if (t.bytes.size() != static_cast<size_t>(numel) * es) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "holds ", t.bytes.size(), " bytes, its shape needs ", numel * es));
  }
  Tensor host;
  if (t.dtype == "float64") {
    // Through float32, as torch's double -> half/bfloat16 conversions also go.
    std::vector<float> narrowed(static_cast<size_t>(numel));
    for (int64_t i = 0; i < numel; ++i) {
      double v;
      std::memcpy(&v, t.bytes.data() + i * 8, 8);
      narrowed[i] = static_cast<float>(v);
    }
    host = Tensor::FromHost(narrowed.data(), shape, DType::kF32);
  } else {
    host = Tensor::FromHost(t.bytes.data(), shape, src);
  }
  return host.dtype() == dtype ? host : host.To(dtype);
}

}  // namespace tgis::server
