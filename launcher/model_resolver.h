// MODEL_NAME -> a local model folder: a directory as given, or a hub id found in the local
// Hugging Face cache layout (models--org--name/snapshots/<revision>/). Nothing is downloaded.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tgis::launcher {

struct CacheDirs {
  std::string hf_hub_cache;        // HF_HUB_CACHE
  std::string hf_home;             // HF_HOME (its hub/ subfolder)
  std::string transformers_cache;  // TRANSFORMERS_CACHE (older TGIS deployments)
  std::string home;                // HOME (~/.cache/huggingface/hub)
  static CacheDirs FromEnvironment();
  // The hub cache folders to search, in order.
  std::vector<std::string> Candidates() const;
};

// `revision` may be a commit hash, a branch or tag name under refs/, or empty (main).
absl::StatusOr<std::string> ResolveModel(const std::string& model_name, const std::string& revision,
                                         const CacheDirs& dirs);

}  // namespace tgis::launcher
