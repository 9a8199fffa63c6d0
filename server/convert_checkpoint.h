// `text-generation-server convert-to-safetensors`: PyTorch .bin checkpoints (torch.save's zip or
// legacy format, read by torch_file.h's restricted unpickler, which executes nothing) written
// out as safetensors beside them, the way TGIS's command does it:
//   pytorch_model.bin                  -> model.safetensors
//   pytorch_model-00001-of-00002.bin   -> model-00001-of-00002.safetensors
//   pytorch_model.bin.index.json       -> model.safetensors.index.json (weight_map renamed)
// Tensors that share storage (tied weights) are written once, under one name, with the others
// recorded in the file's metadata as aliases of it ({"format": "pt", dropped: kept}), as
// safetensors' and transformers' converters do. Every written file is read back and compared.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/torch_file.h"

namespace tgis::server {

struct ConvertResult {
  std::vector<std::string> written;  // the safetensors (and index) files made
};

// Converts the .bin files of `model_dir`. AlreadyExists when a safetensors file it would write
// is there already (remove it to convert again); NotFound when there is no .bin file.
absl::StatusOr<ConvertResult> ConvertToSafetensors(const std::string& model_dir);

// The names to drop from a state dict so that each storage is written once: dropped -> kept.
// Among the names that view one storage (overlapping bytes), the kept one covers the whole
// storage and is the first in name order, preferring names not in `discard` (the tied copies of
// the input embeddings). Fails when no name covers the whole storage.
absl::StatusOr<std::map<std::string, std::string>> SharedNamesToDrop(
    const std::map<std::string, TorchTensor>& tensors, const std::vector<std::string>& discard);

// Writes `tensors` as a safetensors file (atomically: a temporary file renamed into place) with
// `metadata` as its __metadata__, tensors ordered as the safetensors library orders them.
absl::Status WriteSafetensors(const std::string& path,
                              const std::map<std::string, const TorchTensor*>& tensors,
                              const std::map<std::string, std::string>& metadata);

// The names transformers ties to the input embeddings (its models' _tied_weights_keys) in the
// architectures we serve: when such a name shares storage with another, the other is kept.
const std::vector<std::string>& TiedOutputNames();

}  // namespace tgis::server
