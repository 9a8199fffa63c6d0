#include "launcher/model_resolver.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"

namespace tgis::launcher {
namespace {
namespace fs = std::filesystem;

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}

bool IsModelFolder(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec) && fs::exists(p / "config.json", ec);
}
}  // namespace

CacheDirs CacheDirs::FromEnvironment() {
  return CacheDirs{Env("HF_HUB_CACHE"), Env("HF_HOME"), Env("TRANSFORMERS_CACHE"), Env("HOME")};
}

std::vector<std::string> CacheDirs::Candidates() const {
  std::vector<std::string> out;
  if (!hf_hub_cache.empty()) out.push_back(hf_hub_cache);
  if (!hf_home.empty()) out.push_back((fs::path(hf_home) / "hub").string());
  if (!transformers_cache.empty()) out.push_back(transformers_cache);
  if (!home.empty()) out.push_back((fs::path(home) / ".cache" / "huggingface" / "hub").string());
  return out;
}

absl::StatusOr<std::string> ResolveModel(const std::string& model_name, const std::string& revision,
                                         const CacheDirs& dirs) {
  if (model_name.empty()) {
    return absl::InvalidArgumentError("no model given (--model-name or MODEL_NAME)");
  }
  std::error_code ec;
  if (fs::is_directory(model_name, ec)) {
    if (!IsModelFolder(model_name)) {
      return absl::NotFoundError(absl::StrCat(model_name, ": no config.json in this directory"));
    }
    return fs::absolute(model_name).string();
  }
  const std::string folder = "models--" + absl::StrReplaceAll(model_name, {{"/", "--"}});
  const std::string rev = revision.empty() ? "main" : revision;
  std::vector<std::string> looked;
  for (const std::string& cache : dirs.Candidates()) {
    const fs::path repo = fs::path(cache) / folder;
    looked.push_back(repo.string());
    if (!fs::is_directory(repo, ec)) continue;
    // A branch or tag resolves through refs/<name> to a commit; a commit names a snapshot.
    std::string commit = rev;
    std::ifstream ref(repo / "refs" / rev);
    if (ref) std::getline(ref, commit);
    const fs::path snap = repo / "snapshots" / commit;
    if (IsModelFolder(snap)) return snap.string();
    looked.back() = snap.string();
  }
  return absl::NotFoundError(
      absl::StrCat("model '", model_name, "' (revision ", rev,
                   ") is not a directory and is not in the local Hugging "
                   "Face cache; looked in: ",
                   looked.empty() ? "(no cache directory configured)" : absl::StrJoin(looked, ", "),
                   ". Nothing is downloaded at run time."));
}

}  // namespace tgis::launcher
