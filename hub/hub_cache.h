// The local Hugging Face Hub cache, laid out as huggingface_hub writes it:
//   <cache>/models--org--name/blobs/<etag>
//   <cache>/models--org--name/snapshots/<commit>/<file>  -> ../../blobs/<etag>
//   <cache>/models--org--name/refs/<branch or tag>       holds the commit
// MODEL_NAME is a local model folder as given, or a hub id looked up in that cache.
#pragma once

#include <map>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace tgis::hub {

// The cache folder, chosen as TGIS's launcher chooses it: HF_HUB_CACHE; else the deprecated
// TRANSFORMERS_CACHE or HUGGINGFACE_HUB_CACHE (setting them to a different folder than
// HF_HUB_CACHE, or to two different folders, is an error); else HfHome(env)/hub. `env` maps
// variable names to values (unset: absent).
struct CacheDir {
  std::string path;     // empty when no variable gives one
  std::string warning;  // a deprecated variable was used; say so in the log
  static absl::StatusOr<CacheDir> FromEnvironment(const std::map<std::string, std::string>& env);
  static absl::StatusOr<CacheDir> FromProcessEnvironment();
};

// huggingface_hub's home folder: $HF_HOME; else $XDG_CACHE_HOME/huggingface; else
// $HOME/.cache/huggingface; "" when none of them is set.
std::string HfHome(const std::map<std::string, std::string>& env);
// The same from this process's environment.
std::string HfHomeFromProcessEnvironment();

// "org/name" -> "models--org--name".
std::string RepoFolderName(const std::string& repo_id);

// True when HF_HUB_OFFLINE is set to a true value (1, ON, YES, TRUE, any case), as
// huggingface_hub reads it.
bool OfflineFromEnvironment();

// A model folder: `model_name` itself when it is a directory (which must hold config.json),
// else the snapshot of hub id `model_name` at `revision` (a commit, or a branch or tag named
// under refs/; empty: main) in `cache`. NotFound says where it looked.
absl::StatusOr<std::string> ResolveModel(const std::string& model_name, const std::string& revision,
                                         const std::string& cache);

// Whether `model_name` names a local directory (rather than a hub id).
bool IsLocalPath(const std::string& model_name);

// Whether the folder holds a file whose name ends with `suffix` (".safetensors", ".bin").
bool HasFileEndingWith(const std::string& dir, const std::string& suffix);

}  // namespace tgis::hub
