// Llama 1/2/3, Code Llama, TinyLlama, Mistral: the Llama layout; attention_bias (q/k/v/o) and
// mlp_bias (gate/up/down) as the config says; Mistral's sliding_window applies when set.
// Mistral Small 3.1 / 3.2's multimodal checkpoints (model_type mistral3,
// Mistral3ForConditionalGeneration) are served as their mistral language model, text only
// (LlavaStyleSource; the Pixtral vision tower, the projector and their config keys,
// vision_config, image_token_index, projector_hidden_act, vision_feature_layer,
// multimodal_projector_bias and spatial_merge_size, serve images only: not read).
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

void RegisterLlamaModels(ModelRegistry* r) {
  auto read = [](const ModelConfig& c, LlamaStyleOptions* opt) {
    if (auto st = ReadBiasKeys(c, /*mlp=*/true, opt); !st.ok()) return st;
    return ReadSlidingWindow(c, opt);
  };
  // Checkpoints saved by transformers before 4.31 hold each layer's rotary inv_freq buffer; we
  // compute the frequencies from the config (as transformers does since).
  const std::vector<std::string> ignored = {"model.layers.*.self_attn.rotary_emb.inv_freq"};
  RegisterLlamaStyle(r, "llama", read, ignored);
  RegisterLlamaStyle(r, "mistral", read, ignored);
  // MistralConfig's defaults (transformers 4.55), which it fills into a text_config that lacks
  // them (Mistral3Config reads text_config as MistralConfig(**text_config)).
  r->RegisterLanguageModelSource(LlavaStyleSource("mistral3", "mistral",
                                                  {{"model_type", "mistral"},
                                                   {"vocab_size", 32000},
                                                   {"hidden_size", 4096},
                                                   {"intermediate_size", 14336},
                                                   {"num_hidden_layers", 32},
                                                   {"num_attention_heads", 32},
                                                   {"num_key_value_heads", 8},
                                                   {"hidden_act", "silu"},
                                                   {"max_position_embeddings", 131072},
                                                   {"rms_norm_eps", 1e-6},
                                                   {"pad_token_id", nullptr},
                                                   {"bos_token_id", 1},
                                                   {"eos_token_id", 2},
                                                   {"tie_word_embeddings", false},
                                                   {"rope_theta", 10000.0},
                                                   {"sliding_window", 4096}}));
}

}  // namespace tgis::server
