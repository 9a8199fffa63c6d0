// model_type (config.json) -> builder of a Model from the checkpoint.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/tensor.h"
#include "server/communicator.h"
#include "server/decoder_model.h"
#include "server/model_config.h"
#include "server/weights.h"

namespace tgis::server {

// `dtype`: the dtype linear weights are kept in (activations are f32 on the CPU). `comm`: the
// tensor-parallel group (never null; world size 1 for a single shard): a builder loads only this
// rank's slice of the weights (ShardLayout, ShardedLoader) and hands `comm` to the Model.
using ModelBuilder = std::function<absl::StatusOr<std::unique_ptr<Model>>(
    const ModelConfig&, const WeightStore&, kernels::DType dtype,
    std::shared_ptr<Communicator> comm)>;

class ModelRegistry {
 public:
  static ModelRegistry& Get();  // with every built-in architecture registered
  // `ignored`: glob patterns (fnmatch) of checkpoint tensors the architecture deliberately does
  // not read, each with its reason in the caller's comment (buffers older transformers saved,
  // say). Every other tensor a builder leaves unread fails the load.
  void Register(const std::string& model_type, ModelBuilder builder,
                std::vector<std::string> ignored = {});
  // A multimodal checkpoint type whose language model (a registered model_type) is served
  // alone. Load its config with LoadConfig and its weights with OpenWeights.
  void RegisterLanguageModelSource(LanguageModelSource source);
  // ModelConfig::Load with the registered sources.
  absl::StatusOr<ModelConfig> LoadConfig(const std::string& model_dir) const;
  // WeightStore::Open with the tensor names of config's source, if any.
  static absl::StatusOr<std::unique_ptr<WeightStore>> OpenWeights(const std::string& model_dir,
                                                                  const ModelConfig& config);
  // A null `comm` builds the whole model (world size 1). Fails, naming the tensors and their
  // files, when the checkpoint holds tensors the model did not read and does not ignore.
  absl::StatusOr<std::unique_ptr<Model>> Build(const ModelConfig& config,
                                               const WeightStore& weights, kernels::DType dtype,
                                               std::shared_ptr<Communicator> comm = nullptr) const;
  std::vector<std::string> SupportedTypes() const;

 private:
  struct Entry {
    std::string model_type;
    ModelBuilder builder;
    std::vector<std::string> ignored;
  };
  std::vector<Entry> builders_;
  std::vector<LanguageModelSource> sources_;
};

// A multimodal checkpoint as transformers' Llava-style classes save it (Gemma 3's and Mistral 3's
// ForConditionalGeneration): the language model under language_model.model.* and
// language_model.lm_head.* (4.50: the released checkpoints) or model.language_model.* and
// lm_head.* (4.52 on), beside vision_tower.* and multi_modal_projector.* (model.* from 4.52),
// which text-only serving does not read. text_config over `text_defaults`; the token ids and
// quantization_config of the top level apply where it has none.
LanguageModelSource LlavaStyleSource(std::string wrapper_type, std::string text_type,
                                     nlohmann::json text_defaults);

// Each architecture file defines one of these; ModelRegistry::Get calls them all.
void RegisterLlamaModels(ModelRegistry* r);   // llama, mistral, mistral3 (text only)
void RegisterQwen2Model(ModelRegistry* r);    // qwen2, qwen2_moe
void RegisterGraniteModel(ModelRegistry* r);  // granite, granitemoe(shared), granitemoehybrid
void RegisterGptOssModel(ModelRegistry* r);   // gpt_oss
void RegisterPhiModel(ModelRegistry* r);
void RegisterPhi3Model(ModelRegistry* r);
void RegisterGemmaModel(ModelRegistry* r);
void RegisterGemma2Model(ModelRegistry* r);
void RegisterGemma3Model(ModelRegistry* r);  // gemma3_text, gemma3 (text only)
void RegisterStarcoder2Model(ModelRegistry* r);
void RegisterStableLmModel(ModelRegistry* r);
void RegisterMixtralModel(ModelRegistry* r);
void RegisterCohereModel(ModelRegistry* r);
void RegisterOlmoModel(ModelRegistry* r);
void RegisterOlmo2Model(ModelRegistry* r);
void RegisterQwen3Model(ModelRegistry* r);
void RegisterGpt2Model(ModelRegistry* r);
void RegisterGptBigCodeModel(ModelRegistry* r);
void RegisterGptNeoxModel(ModelRegistry* r);
void RegisterBloomModel(ModelRegistry* r);
void RegisterFalconModel(ModelRegistry* r);  // falcon, RefinedWeb, RefinedWebModel
void RegisterMptModel(ModelRegistry* r);
void RegisterOptModel(ModelRegistry* r);
void RegisterT5Models(ModelRegistry* r);  // t5, mt5

}  // namespace tgis::server
