// config.json as a model folder holds it: read, then a model built from it over the weights of
// the test fixture of the same model_type (so that the builders' reading of the config, shapes
// included, is exercised as at start), with the config's quantization applied as the shard
// applies it (its quantization_config over the quantized fixtures' GPTQ, AWQ, fp8,
// compressed-tensors and bitsandbytes tensors).
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "server/model_config.h"
#include "server/model_registry.h"
#include "server/quantization.h"
#include "server/weights.h"
#include "tests/fuzz/fuzz_files.h"

namespace {

namespace fs = std::filesystem;

// model_type -> scratch folders that hold a fixture's weights (links) and its other files.
std::map<std::string, std::vector<std::string>>& FolderByType() {
  static std::map<std::string, std::vector<std::string>> folders;
  return folders;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tgis::fuzz::QuietLogs();
  const fs::path models = fs::path(TGIS_FIXTURES_DIR) / "models";
  for (const auto& entry : fs::directory_iterator(models)) {
    if (!fs::exists(entry.path() / "config.json")) continue;
    auto config =
        nlohmann::json::parse(tgis::fuzz::ReadFile(entry.path() / "config.json"), nullptr, false);
    if (!config.is_object() || !config.contains("model_type")) continue;
    const fs::path folder = fs::path(tgis::fuzz::ScratchDir()) / entry.path().filename();
    fs::create_directories(folder);
    for (const auto& f : fs::directory_iterator(entry.path())) {
      const std::string name = f.path().filename().string();
      if (name == "config.json" || name == "golden.json") continue;
      fs::create_symlink(fs::absolute(f.path()), folder / name);
    }
    FolderByType()[config["model_type"].get<std::string>()].push_back(folder.string());
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  // The fixture to build over: the one of the config's model_type (any, when it names none),
  // picked by the input's length so that every fixture of a type gets its turn.
  auto json = nlohmann::json::parse(text, nullptr, false);
  std::string type;
  if (json.is_object() && json.contains("model_type") && json["model_type"].is_string()) {
    type = json["model_type"].get<std::string>();
  }
  auto it = FolderByType().find(type);
  if (it == FolderByType().end()) it = FolderByType().begin();
  const std::string& folder = it->second[size % it->second.size()];
  tgis::fuzz::WriteScratch(fs::path(folder).filename().string() + "/config.json", data, size);

  auto config = tgis::server::ModelRegistry::Get().LoadConfig(folder);
  if (!config.ok()) return 0;
  // One input in four as TGIS's --quantize bitsandbytes would serve it (int8 at load).
  const std::optional<std::string> flag =
      size % 4 == 3 ? std::optional<std::string>("bitsandbytes") : std::nullopt;
  auto quant = tgis::server::ReadQuantConfig(folder, *config, flag);
  if (!quant.ok()) return 0;
  auto weights = tgis::server::ModelRegistry::OpenWeights(folder, *config);
  if (!weights.ok()) return 0;
  (*weights)->set_quantization(*quant);
  (void)tgis::server::ModelRegistry::Get().Build(*config, **weights, tgis::kernels::DType::kF32);
  return 0;
}
