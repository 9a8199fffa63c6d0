// `text-generation-server download-weights`: fetches a Hugging Face Hub model repository's
// files into the local cache (hub_cache.h's layout, the one huggingface_hub reads and writes),
// as TGIS's command does with huggingface_hub. Downloads resume from <blob>.incomplete with an
// HTTP Range request; every file's size and checksum (the sha256 the Hub gives LFS files, the
// git blob sha1 of the others) are checked before the file enters the cache.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tgis::hub {

struct DownloadOptions {
  std::string repo_id;                  // "org/name"
  std::string revision;                 // a branch, tag or commit; empty: main
  std::vector<std::string> extensions;  // which files (SelectHubFiles)
  std::string endpoint;                 // EndpointFromEnvironment()
  std::string token;                    // empty: anonymous
  std::string cache_dir;                // CacheDir::path
  int max_attempts = 5;                 // per file, resuming after a dropped transfer
  int parallel_files = 4;               // files downloaded at once
};

struct DownloadResult {
  std::string snapshot_dir;
  std::string commit;
  std::vector<std::string> files;  // the repository paths fetched (or found cached)
  int64_t bytes_downloaded = 0;
};

absl::StatusOr<DownloadResult> DownloadFiles(const DownloadOptions& options);

// TGIS's --extension: comma separated; a single extension that is not one of the metadata
// extensions (.json .py .model .md) gets those four added.
std::vector<std::string> ExpandExtensions(const std::string& flag);
// TGIS's rule for which repository files are weights to fetch: at the top level, ending with
// one of `extensions`, and not training leftovers ("arguments", "args", "training" in the name).
bool IsWeightHubFile(const std::string& path, const std::vector<std::string>& extensions);

// HF_ENDPOINT, without a trailing slash; https://huggingface.co when unset.
std::string EndpointFromEnvironment();
// HF_TOKEN, else HUGGING_FACE_HUB_TOKEN, else the token file (HF_TOKEN_PATH, else
// $HF_HOME/token, else ~/.cache/huggingface/token); empty when none.
std::string TokenFromEnvironment();

// The hex digest the Hub's etag promises for `path`'s content: sha256 for a 64-hex etag (LFS),
// git's blob sha1 for a 40-hex one. Unavailable for other etags (nothing to check against).
absl::StatusOr<bool> ContentMatchesEtag(const std::string& path, const std::string& etag);

}  // namespace tgis::hub
