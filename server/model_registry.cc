#include "server/model_registry.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tgis::server {

ModelRegistry& ModelRegistry::Get() {
  static ModelRegistry* registry = [] {
    auto* r = new ModelRegistry();
    RegisterLlamaModels(r);
    RegisterQwen2Model(r);
    RegisterGpt2Model(r);
    RegisterGptBigCodeModel(r);
    RegisterGptNeoxModel(r);
    return r;
  }();
  return *registry;
}

void ModelRegistry::Register(const std::string& model_type, ModelBuilder builder) {
  builders_.emplace_back(model_type, std::move(builder));
}

absl::StatusOr<std::unique_ptr<CausalLM>> ModelRegistry::Build(
    const ModelConfig& config, const WeightStore& weights, kernels::DType dtype,
    std::shared_ptr<Communicator> comm) const {
  if (!comm) comm = MakeSingleProcessCommunicator();
  for (const auto& [type, builder] : builders_) {
    if (type == config.model_type) return builder(config, weights, dtype, comm);
  }
  return absl::UnimplementedError(
      absl::StrCat("config.json: model_type '", config.model_type,
                   "' is not supported; supported: ", absl::StrJoin(SupportedTypes(), ", ")));
}

std::vector<std::string> ModelRegistry::SupportedTypes() const {
  std::vector<std::string> out;
  for (const auto& [type, b] : builders_) out.push_back(type);
  return out;
}

}  // namespace tgis::server
