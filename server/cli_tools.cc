#include "server/cli_tools.h"

#include <glog/logging.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "hub/download.h"
#include "hub/hub_cache.h"
#include "server/convert_checkpoint.h"

namespace tgis::server {
namespace {
namespace fs = std::filesystem;

int Fail(const std::string& message) {
  LOG(ERROR) << message;
  std::fprintf(stderr, "text-generation-server: %s\n", message.c_str());
  return 1;
}

// One positional MODEL_NAME and --name VALUE / --name=VALUE options from `valued`, and the
// flags in `switches` (given: "true"). Anything else is an error naming it.
struct Args {
  std::string model;
  std::map<std::string, std::string> opts;
};
std::optional<Args> Parse(int argc, char** argv, const std::set<std::string>& valued,
                          const std::set<std::string>& switches, std::string* error) {
  Args a;
  for (int i = 2; i < argc; ++i) {
    std::string arg = argv[i];
    if (!absl::StartsWith(arg, "--")) {
      if (!a.model.empty()) {
        *error = "unexpected argument '" + arg + "'";
        return std::nullopt;
      }
      a.model = arg;
      continue;
    }
    std::string name = arg.substr(2), value;
    const size_t eq = name.find('=');
    const bool inline_value = eq != std::string::npos;
    if (inline_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    for (char& c : name) c = c == '_' ? '-' : c;
    if (switches.count(name) && !inline_value) {
      a.opts[name] = "true";
    } else if (valued.count(name)) {
      if (!inline_value) {
        if (i + 1 >= argc) {
          *error = "--" + name + " needs a value";
          return std::nullopt;
        }
        value = argv[++i];
      }
      a.opts[name] = value;
    } else {
      *error = "unknown option --" + name;
      return std::nullopt;
    }
  }
  if (a.model.empty()) {
    *error = "missing MODEL_NAME";
    return std::nullopt;
  }
  return a;
}

std::string Opt(const Args& a, const std::string& name, const std::string& fallback = "") {
  auto it = a.opts.find(name);
  return it == a.opts.end() ? fallback : it->second;
}

// Converts `dir`'s .bin files; "nothing to do" outcomes are reported, not failures (as TGIS).
int Convert(const std::string& dir) {
  auto converted = ConvertToSafetensors(dir);
  if (absl::IsNotFound(converted.status()) || absl::IsAlreadyExists(converted.status())) {
    LOG(WARNING) << converted.status().message();
    return 0;
  }
  if (!converted.ok()) return Fail(std::string(converted.status().message()));
  for (const std::string& f : converted->written) LOG(INFO) << "wrote " << f;
  return 0;
}

absl::StatusOr<std::string> CacheDirOrError() {
  auto cache = hub::CacheDir::FromProcessEnvironment();
  if (!cache.ok()) return cache.status();
  if (!cache->warning.empty()) LOG(WARNING) << cache->warning;
  return cache->path;
}

}  // namespace

int RunDownloadWeights(int argc, char** argv) {
  std::string error;
  auto args = Parse(argc, argv, {"revision", "token", "extension"},
                    {"auto-convert", "no-auto-convert"}, &error);
  if (!args) {
    return Fail("download-weights: " + error +
                "\nusage: text-generation-server download-weights MODEL_NAME [--revision R] "
                "[--token T] [--extension .safetensors] [--auto-convert|--no-auto-convert]");
  }
  const std::string revision = Opt(*args, "revision");
  const std::vector<std::string> extensions =
      hub::ExpandExtensions(Opt(*args, "extension", ".safetensors"));
  const bool auto_convert = !args->opts.count("no-auto-convert");
  auto cache = CacheDirOrError();
  if (!cache.ok()) return Fail(std::string(cache.status().message()));

  std::string dir;
  std::vector<std::string> fetched;
  if (hub::IsLocalPath(args->model)) {
    LOG(INFO) << args->model << " is a local folder: nothing to download";
    dir = args->model;
  } else if (hub::OfflineFromEnvironment()) {
    auto cached = hub::ResolveModel(args->model, revision, *cache);
    if (!cached.ok()) {
      return Fail(absl::StrCat("HF_HUB_OFFLINE is set, so nothing can be downloaded, and ",
                               cached.status().message()));
    }
    LOG(INFO) << "HF_HUB_OFFLINE is set: using the cached " << *cached;
    dir = *cached;
  } else {
    hub::DownloadOptions o;
    o.repo_id = args->model;
    o.revision = revision;
    o.extensions = extensions;
    o.endpoint = hub::EndpointFromEnvironment();
    o.token = Opt(*args, "token", hub::TokenFromEnvironment());
    o.cache_dir = *cache;
    auto r = hub::DownloadFiles(o);
    if (!r.ok()) return Fail(std::string(r.status().message()));
    dir = r->snapshot_dir;
    fetched = r->files;
    // As TGIS: no safetensors weights on the Hub -> fetch the PyTorch ones and convert them.
    const bool want_st =
        std::find(extensions.begin(), extensions.end(), ".safetensors") != extensions.end();
    if (auto_convert && want_st && !hub::HasFileEndingWith(dir, ".safetensors")) {
      if (std::find(extensions.begin(), extensions.end(), ".bin") == extensions.end()) {
        LOG(INFO) << ".safetensors weights not found, downloading pytorch weights to convert...";
        o.extensions = {".bin"};
        auto bins = hub::DownloadFiles(o);
        if (!bins.ok()) return Fail(std::string(bins.status().message()));
      }
    }
  }
  if (auto_convert && !hub::HasFileEndingWith(dir, ".safetensors") &&
      hub::HasFileEndingWith(dir, ".bin")) {
    LOG(INFO) << ".safetensors weights not found, converting from pytorch weights...";
    if (int rc = Convert(dir); rc != 0) return rc;
  }
  LOG(INFO) << "model " << args->model << " is in " << dir;
  return 0;
}

int RunConvertToSafetensors(int argc, char** argv) {
  std::string error;
  auto args = Parse(argc, argv, {"revision"}, {}, &error);
  if (!args) {
    return Fail("convert-to-safetensors: " + error +
                "\nusage: text-generation-server convert-to-safetensors MODEL_NAME "
                "[--revision R]");
  }
  auto cache = CacheDirOrError();
  if (!cache.ok()) return Fail(std::string(cache.status().message()));
  auto dir = hub::ResolveModel(args->model, Opt(*args, "revision"), *cache);
  if (!dir.ok()) return Fail(std::string(dir.status().message()));
  return Convert(*dir);
}

}  // namespace tgis::server
