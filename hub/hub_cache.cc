#include "hub/hub_cache.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

extern char** environ;

namespace tgis::hub {
namespace {
namespace fs = std::filesystem;

bool IsModelFolder(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec) && fs::exists(p / "config.json", ec);
}

std::string Get(const std::map<std::string, std::string>& env, const std::string& name) {
  auto it = env.find(name);
  return it == env.end() ? "" : it->second;
}
}  // namespace

absl::StatusOr<CacheDir> CacheDir::FromEnvironment(const std::map<std::string, std::string>& env) {
  CacheDir out;
  std::string var;
  if (env.count("HF_HUB_CACHE")) {
    var = "HF_HUB_CACHE";
    out.path = Get(env, var);
  }
  for (const char* deprecated : {"TRANSFORMERS_CACHE", "HUGGINGFACE_HUB_CACHE"}) {
    if (!env.count(deprecated)) continue;
    const std::string value = Get(env, deprecated);
    if (var.empty()) {
      var = deprecated;
      out.path = value;
    } else if (value != out.path) {
      return absl::InvalidArgumentError(
          absl::StrCat(deprecated, " and ", var, " env vars can't be set to different values"));
    }
    out.warning = absl::StrCat(deprecated,
                               " is deprecated and should not be used. Use HF_HUB_CACHE instead.");
  }
  if (out.path.empty() && !HfHome(env).empty()) out.path = (fs::path(HfHome(env)) / "hub").string();
  return out;
}

std::string HfHome(const std::map<std::string, std::string>& env) {
  if (!Get(env, "HF_HOME").empty()) return Get(env, "HF_HOME");
  if (!Get(env, "XDG_CACHE_HOME").empty()) {
    return (fs::path(Get(env, "XDG_CACHE_HOME")) / "huggingface").string();
  }
  if (!Get(env, "HOME").empty())
    return (fs::path(Get(env, "HOME")) / ".cache" / "huggingface").string();
  return "";
}

namespace {
std::map<std::string, std::string> ProcessEnvironment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string kv(*e);
    const size_t eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}
}  // namespace

absl::StatusOr<CacheDir> CacheDir::FromProcessEnvironment() {
  return FromEnvironment(ProcessEnvironment());
}

std::string HfHomeFromProcessEnvironment() { return HfHome(ProcessEnvironment()); }

std::string RepoFolderName(const std::string& repo_id) {
  return "models--" + absl::StrReplaceAll(repo_id, {{"/", "--"}});
}

bool OfflineFromEnvironment() {
  const char* v = std::getenv("HF_HUB_OFFLINE");
  if (v == nullptr) return false;
  const std::string s = absl::AsciiStrToUpper(v);
  return s == "1" || s == "ON" || s == "YES" || s == "TRUE";
}

bool HasFileEndingWith(const std::string& dir, const std::string& suffix) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (absl::EndsWith(e.path().filename().string(), suffix)) return true;
  }
  return false;
}

bool IsLocalPath(const std::string& model_name) {
  std::error_code ec;
  return fs::is_directory(model_name, ec);
}

absl::StatusOr<std::string> ResolveModel(const std::string& model_name, const std::string& revision,
                                         const std::string& cache) {
  if (model_name.empty()) {
    return absl::InvalidArgumentError("no model given (--model-name or MODEL_NAME)");
  }
  if (IsLocalPath(model_name)) {
    if (!IsModelFolder(model_name)) {
      return absl::NotFoundError(absl::StrCat(model_name, ": no config.json in this directory"));
    }
    return fs::absolute(model_name).string();
  }
  const std::string rev = revision.empty() ? "main" : revision;
  if (cache.empty()) {
    return absl::NotFoundError(absl::StrCat("model '", model_name,
                                            "' is not a directory and no Hugging Face cache is "
                                            "configured (HF_HUB_CACHE, HF_HOME or HOME)"));
  }
  const fs::path repo = fs::path(cache) / RepoFolderName(model_name);
  // A branch or tag resolves through refs/<name> to a commit; a commit names a snapshot.
  std::string commit = rev;
  std::ifstream ref(repo / "refs" / rev);
  if (ref) std::getline(ref, commit);
  const fs::path snap = repo / "snapshots" / commit;
  if (IsModelFolder(snap)) return snap.string();
  return absl::NotFoundError(absl::StrCat("model '", model_name, "' (revision ", rev,
                                          ") is not a directory and is not in the local Hugging "
                                          "Face cache; looked in: ",
                                          snap.string()));
}

}  // namespace tgis::hub
