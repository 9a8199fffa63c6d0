#include "server/prefix_store.h"

#include <glog/logging.h>

#include <cmath>
#include <filesystem>
#include <regex>

#include "absl/strings/str_cat.h"
#include "server/torch_file.h"
#include "server/weights.h"

namespace tgis::server {
namespace {

namespace fs = std::filesystem;
using kernels::DType;
using kernels::Tensor;

// How a TGIS client sees an exception raised in TGIS's PrefixLookup (gRPC Python's words).
absl::Status Raised(const char* type, const std::string& message) {
  return absl::UnknownError(absl::StrCat("Unexpected <class '", type, "'>: ", message));
}

absl::Status NotFound(const std::string& id) {
  return absl::NotFoundError(absl::StrCat("prefix id \"", id, "\" not found"));
}

const char* TorchName(DType t) {
  switch (t) {
    case DType::kF32:
      return "float32";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    default:
      return "other";
  }
}

bool AllFinite(const Tensor& t) {
  const Tensor f = t.dtype() == DType::kF32 ? t : t.To(DType::kF32);
  const float* p = f.data<float>();
  for (int64_t i = 0; i < f.numel(); ++i) {
    if (!std::isfinite(p[i])) return false;
  }
  return true;
}

// A tensor of a .pt file as f32 with its torch dtype name, or TGIS's error for a wrong one.
absl::StatusOr<std::pair<Tensor, std::string>> FromTorch(const TorchTensor& t,
                                                         const std::string& where) {
  absl::StatusOr<Tensor> f = ToFloatTensor(t, DType::kF32, where);
  if (!f.ok()) return Raised("Exception", "Invalid prefix embedding tensor");
  return std::make_pair(*std::move(f), t.dtype);
}

}  // namespace

absl::StatusOr<Tensor> PrefixStore::Process(const Tensor& prefix,
                                            const std::string& source_dtype) const {
  // TGIS's _process_prefix_tensor, check by check.
  if (prefix.rank() != 2) return Raised("Exception", "Invalid prefix embedding tensor");
  const int64_t n = prefix.dim(0);
  if (n == 0 || (options_.max_length > 0 && n > options_.max_length)) {
    return Raised("Exception", absl::StrCat("Invalid prefix embedding length of ", n));
  }
  if (options_.encoder_decoder && n % 2 != 0) {
    return Raised("Exception", "Encoder/decoder prefix tensor must be of even length");
  }
  if (prefix.dim(1) != options_.hidden) {
    return Raised("Exception", absl::StrCat("Prefix embedding tensor dim ", prefix.dim(1),
                                            " does not match model (", options_.hidden, ")"));
  }
  if (!AllFinite(prefix)) return Raised("Exception", "Prefix contains non-finite elements");
  // Every loader hands over an owned f32 copy, so no view of a mapped file outlives Load.
  Tensor converted = prefix.dtype() == options_.dtype ? prefix : prefix.To(options_.dtype);
  if (!AllFinite(converted)) {
    return Raised("Exception", absl::StrCat("Prefix contains non-finite elements after "
                                            "conversion from torch.",
                                            source_dtype, " to torch.", TorchName(options_.dtype)));
  }
  return options_.device == kernels::Device::kCpu ? converted : converted.ToDevice(options_.device);
}

int64_t Prefix::length(bool encoder_decoder) const {
  int64_t n = encoder ? encoder->dim(0) : 0;
  if (decoder) n += decoder->dim(0) + (encoder_decoder ? 1 : 0);
  return n;
}

absl::StatusOr<std::shared_ptr<const Tensor>> PrefixStore::LoadPt(const std::string& file) const {
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) return std::shared_ptr<const Tensor>();
  LOG(INFO) << "Loading new prefix " << file;
  auto tensors = ReadTorchFile(file);
  if (!tensors.ok()) return Raised("Exception", std::string(tensors.status().message()));
  auto it = tensors->find("");
  if (it == tensors->end() || tensors->size() != 1) {
    return Raised("Exception", "Invalid prefix embedding tensor");
  }
  auto t = FromTorch(it->second, file);
  if (!t.ok()) return t.status();
  auto processed = Process(t->first, t->second);
  if (!processed.ok()) return processed.status();
  return std::make_shared<const Tensor>(*std::move(processed));
}

absl::StatusOr<Prefix> PrefixStore::Load(const std::string& id) const {
  static const std::regex kValidId("[/\\w\\-]+");
  if (!std::regex_match(id, kValidId)) {
    return Raised("Exception", absl::StrCat("Invalid prefix id ", id,
                                            ", must contain only alphanumeric, _ and - and /"));
  }
  const fs::path root(options_.store_path);
  const fs::path dir = (root / id).lexically_normal();
  // No way out of the store ("a/../../x").
  if (dir.string().rfind(root.lexically_normal().string() + "/", 0) != 0) {
    return Raised("Exception", absl::StrCat("Invalid prefix id ", id));
  }
  std::error_code ec;
  if (std::optional<nlohmann::json> config = LoraAdapterConfig(dir)) {
    if (options_.model == nullptr || options_.encoder_decoder) {
      return absl::UnimplementedError(
          absl::StrCat("prefix id ", id, " is a LoRA adapter; this model serves none"));
    }
    LOG(INFO) << "Loading LoRA adapter " << id;
    absl::StatusOr<LoraAdapter> adapter = ReadLoraAdapter(dir, id, *config);
    if (!adapter.ok()) return adapter.status();
    absl::StatusOr<std::shared_ptr<const LoraWeights>> lora = options_.model->MakeLora(*adapter);
    if (!lora.ok()) return lora.status();
    return Prefix{nullptr, nullptr, *std::move(lora)};
  }
  bool peft = false;
  if (fs::is_directory(dir, ec)) {
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      peft = peft || e.path().stem() == "adapter_model";
    }
  }
  if (!peft) {
    auto decoder = LoadPt((dir / "decoder.pt").string());
    if (!decoder.ok()) return decoder.status();
    if (!options_.encoder_decoder) {
      if (!*decoder) return NotFound(id);
      // Decoder-only models use decoder.pt alone; TGIS reads an encoder.pt beside it and drops
      // it.
      if (fs::is_regular_file(dir / "encoder.pt", ec)) {
        LOG(WARNING) << "prefix " << id << ": encoder.pt is not used by a decoder-only model";
      }
      return Prefix{*decoder, nullptr, nullptr};
    }
    auto encoder = LoadPt((dir / "encoder.pt").string());
    if (!encoder.ok()) return encoder.status();
    if (!*decoder && !*encoder) return NotFound(id);
    return Prefix{*decoder, *encoder, nullptr};
  }
  if (options_.encoder_decoder) {
    return Raised("Exception", "encoder-decoder architectures not supported for peft models");
  }
  std::pair<Tensor, std::string> loaded;
  // safetensors first, as TGIS; a .bin if that is all there is.
  const fs::path st = dir / "adapter_model.safetensors", bin = dir / "adapter_model.bin";
  if (fs::is_regular_file(st, ec)) {
    LOG(INFO) << "Loading new prefix " << id << "/adapter_model.safetensors";
    auto tensors = ReadSafetensorsFile(st.string());
    if (!tensors.ok()) return Raised("Exception", std::string(tensors.status().message()));
    auto it = tensors->find("prompt_embeddings");
    if (it == tensors->end()) return Raised("KeyError", "'prompt_embeddings'");
    loaded = {it->second.To(DType::kF32), TorchName(it->second.dtype())};
  } else if (fs::is_regular_file(bin, ec)) {
    LOG(INFO) << "Loading new prefix " << id << "/adapter_model.bin";
    auto tensors = ReadTorchFile(bin.string());
    if (!tensors.ok()) return Raised("Exception", std::string(tensors.status().message()));
    auto it = tensors->find("prompt_embeddings");
    if (it == tensors->end()) return Raised("KeyError", "'prompt_embeddings'");
    auto t = FromTorch(it->second, bin.string());
    if (!t.ok()) return t.status();
    loaded = *std::move(t);
  } else {
    return NotFound(id);
  }
  auto processed = Process(loaded.first, loaded.second);
  if (!processed.ok()) return processed.status();
  return Prefix{std::make_shared<const Tensor>(*std::move(processed)), nullptr, nullptr};
}

absl::StatusOr<Prefix> PrefixStore::Get(const std::string& id) {
  if (options_.store_path.empty()) {
    // No store: every prefix is one that is not there (the reason goes to the log).
    LOG(WARNING) << "prefix " << id << " asked for, but PREFIX_STORE_PATH is not set";
    return NotFound(id);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (const Prefix* cached = cache_.Find(id)) return *cached;
  }
  // Loaded outside the lock, as TGIS does: a slow disk does not hold up cached prefixes.
  absl::StatusOr<Prefix> loaded = Load(id);
  if (!loaded.ok()) return loaded.status();
  double mb = 0;
  for (const auto& t : {loaded->decoder, loaded->encoder}) {
    if (t) mb += std::ceil(static_cast<double>(t->nbytes()) / 512.0) * 512.0 / (1 << 20);
  }
  if (loaded->lora) mb += static_cast<double>(loaded->lora->bytes()) / (1 << 20);
  std::lock_guard<std::mutex> lock(mu_);
  if (const Prefix* cached = cache_.Find(id)) return *cached;
  if (mb > options_.cache_mb) {
    return Raised("ValueError",
                  absl::StrCat("Prefix ID object ", id, " exceeds the allowed cache size"));
  }
  const Prefix& added = cache_.Insert(
      id, *std::move(loaded), mb, [](const std::string& evicted, const Prefix&, double) {
        LOG(INFO) << "Deleted prefix " << evicted << " from the prompt cache";
      });
  LOG(INFO) << "Added prefix " << id << " to the prompt cache, has "
            << added.length(options_.encoder_decoder) << " virtual tokens, total cache size is now "
            << cache_.total_cost() << "MiB";
  return added;
}

size_t PrefixStore::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cache_.size();
}

}  // namespace tgis::server
