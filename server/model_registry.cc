#include "server/model_registry.h"

#include <fnmatch.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tgis::server {

ModelRegistry& ModelRegistry::Get() {
  static ModelRegistry* registry = [] {
    auto* r = new ModelRegistry();
    RegisterLlamaModels(r);
    RegisterQwen2Model(r);
    RegisterGraniteModel(r);
    RegisterGptOssModel(r);
    RegisterPhiModel(r);
    RegisterPhi3Model(r);
    RegisterGemmaModel(r);
    RegisterGemma2Model(r);
    RegisterGemma3Model(r);
    RegisterStarcoder2Model(r);
    RegisterStableLmModel(r);
    RegisterMixtralModel(r);
    RegisterCohereModel(r);
    RegisterOlmoModel(r);
    RegisterOlmo2Model(r);
    RegisterQwen3Model(r);
    RegisterGpt2Model(r);
    RegisterGptBigCodeModel(r);
    RegisterGptNeoxModel(r);
    RegisterBloomModel(r);
    RegisterFalconModel(r);
    RegisterMptModel(r);
    RegisterOptModel(r);
    RegisterT5Models(r);
    return r;
  }();
  return *registry;
}

void ModelRegistry::Register(const std::string& model_type, ModelBuilder builder,
                             std::vector<std::string> ignored) {
  builders_.push_back({model_type, std::move(builder), std::move(ignored)});
}

LanguageModelSource LlavaStyleSource(std::string wrapper_type, std::string text_type,
                                     nlohmann::json text_defaults) {
  return {.wrapper_type = std::move(wrapper_type),
          .text_type = std::move(text_type),
          .text_defaults = std::move(text_defaults),
          .inherited = {"eos_token_id", "bos_token_id", "pad_token_id", "quantization_config"},
          .tensor_prefixes = {{"language_model.model.", "model."},
                              {"language_model.lm_head.", "lm_head."},
                              {"model.language_model.", "model."}},
          .ignored = {"vision_tower.*", "multi_modal_projector.*", "model.vision_tower.*",
                      "model.multi_modal_projector.*"}};
}

void ModelRegistry::RegisterLanguageModelSource(LanguageModelSource source) {
  sources_.push_back(std::move(source));
}

absl::StatusOr<ModelConfig> ModelRegistry::LoadConfig(const std::string& model_dir) const {
  return ModelConfig::Load(model_dir, sources_);
}

absl::StatusOr<std::unique_ptr<WeightStore>> ModelRegistry::OpenWeights(
    const std::string& model_dir, const ModelConfig& config) {
  return WeightStore::Open(model_dir,
                           config.source ? config.source->tensor_prefixes : TensorRenames{});
}

namespace {

absl::Status CheckEveryTensorRead(const std::string& model_type, const WeightStore& weights,
                                  const std::vector<std::string>& ignored) {
  std::vector<std::string> unused;
  for (const std::string& name : weights.Unread()) {
    bool listed = false;
    for (const std::string& pattern : ignored) {
      listed = listed || fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
    }
    if (!listed) unused.push_back(name);
  }
  if (unused.empty()) return absl::OkStatus();
  std::string list;
  constexpr size_t kNamed = 8;
  for (size_t i = 0; i < unused.size() && i < kNamed; ++i) {
    absl::StrAppend(&list, i == 0 ? "" : ", ", unused[i], " (", weights.FileOf(unused[i]), ")");
  }
  if (unused.size() > kNamed) absl::StrAppend(&list, " and ", unused.size() - kNamed, " more");
  return absl::InvalidArgumentError(absl::StrCat(
      weights.dir(), ": the checkpoint has ", unused.size(), " tensor(s) that model_type '",
      model_type, "' does not use (a layout or config this server does not read): ", list));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> ModelRegistry::Build(
    const ModelConfig& config, const WeightStore& weights, kernels::DType dtype,
    std::shared_ptr<Communicator> comm) const {
  if (!comm) comm = MakeSingleProcessCommunicator();
  for (const Entry& e : builders_) {
    if (e.model_type != config.model_type) continue;
    absl::StatusOr<std::unique_ptr<Model>> model;
    try {
      model = e.builder(config, weights, dtype, comm);
    } catch (const nlohmann::json::exception& ex) {
      // A backstop: builders read config values through ModelConfig::Get, which names the key;
      // a value read otherwise with the wrong type lands here rather than aborting the shard.
      return absl::InvalidArgumentError(
          absl::StrCat(weights.dir(), "/config.json: a value of the wrong type: ", ex.what()));
    }
    if (!model.ok()) return model.status();
    std::vector<std::string> ignored = e.ignored;
    if (config.source) {
      ignored.insert(ignored.end(), config.source->ignored.begin(), config.source->ignored.end());
    }
    if (auto st = CheckEveryTensorRead(e.model_type, weights, ignored); !st.ok()) return st;
    return model;
  }
  return absl::UnimplementedError(
      absl::StrCat("config.json: model_type '", config.model_type,
                   "' is not supported; supported: ", absl::StrJoin(SupportedTypes(), ", ")));
}

std::vector<std::string> ModelRegistry::SupportedTypes() const {
  std::vector<std::string> out;
  for (const Entry& e : builders_) out.push_back(e.model_type);
  for (const LanguageModelSource& s : sources_) {
    out.push_back(absl::StrCat(s.wrapper_type, " (its ", s.text_type, ", text only)"));
  }
  return out;
}

}  // namespace tgis::server
