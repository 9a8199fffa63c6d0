#include "hub/download.h"

#include <fcntl.h>
#include <glog/logging.h>
#include <openssl/evp.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/http_client.h"
#include "common/progress.h"
#include "hub/hub_cache.h"
#include "nlohmann/json.hpp"

namespace tgis::hub {
namespace {
namespace fs = std::filesystem;
using Json = nlohmann::json;

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}

// What a HEAD of the file's resolve URL tells (huggingface_hub's HfFileMetadata).
struct FileMeta {
  std::string path;  // in the repository
  std::string etag;  // unquoted
  int64_t size = -1;
  std::string location;  // where the bytes are (a CDN for LFS files)
  std::string commit;
};

// ETag: "abc" or W/"abc" -> abc (the form the cache names blobs by).
std::string NormalizeEtag(std::string etag) {
  if (absl::StartsWith(etag, "W/")) etag = etag.substr(2);
  if (etag.size() >= 2 && etag.front() == '"' && etag.back() == '"') {
    etag = etag.substr(1, etag.size() - 2);
  }
  return etag;
}

bool IsHex(const std::string& s, size_t n) {
  return s.size() == n && std::all_of(s.begin(), s.end(), [](char c) {
           return absl::ascii_isxdigit(c) && !absl::ascii_isupper(c);
         });
}

class Hub {
 public:
  explicit Hub(const DownloadOptions& o) : o_(o) {}

  std::map<std::string, std::string> Headers(const std::string& url) const {
    std::map<std::string, std::string> h{{"user-agent", "text-generation-server/0.1.0"}};
    // The token goes to the Hub itself, never to another host (a CDN with a signed URL).
    if (!o_.token.empty() && UrlOrigin(url) == UrlOrigin(o_.endpoint)) {
      h["authorization"] = "Bearer " + o_.token;
    }
    return h;
  }

  absl::Status HttpError(const std::string& what, const HttpResponse& r) const {
    std::string msg = absl::StrCat(what, ": HTTP ", r.status);
    if (const std::string code = r.Header("x-error-code"); !code.empty()) {
      absl::StrAppend(&msg, " ", code);
    }
    std::string detail = r.Header("x-error-message");
    if (detail.empty()) detail = r.body.substr(0, 300);
    if (!detail.empty()) absl::StrAppend(&msg, ": ", detail);
    if (r.status == 401 || r.status == 403) {
      absl::StrAppend(&msg, o_.token.empty()
                                ? " (a private or gated repository? set HF_TOKEN or pass --token)"
                                : " (is the token allowed to read this repository?)");
      return absl::PermissionDeniedError(msg);
    }
    if (r.status == 404) return absl::NotFoundError(msg);
    return absl::UnavailableError(msg);
  }

  // The repository at the revision: its commit and file list (HfApi.model_info).
  absl::StatusOr<std::pair<std::string, std::vector<std::string>>> Info() const {
    std::string url = absl::StrCat(o_.endpoint, "/api/models/", o_.repo_id);
    if (!o_.revision.empty()) absl::StrAppend(&url, "/revision/", UrlQuote(o_.revision, ""));
    HttpRequest req;
    req.url = url;
    req.headers = Headers(url);
    req.follow_redirects = true;
    auto r = HttpFetch(req);
    if (!r.ok()) return r.status();
    if (r->status != 200) return HttpError(absl::StrCat("model info of ", o_.repo_id), *r);
    Json j = Json::parse(r->body, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("sha") || !j["sha"].is_string() ||
        !j.contains("siblings") || !j["siblings"].is_array()) {
      return absl::DataLossError(absl::StrCat(url, ": not a model info answer (no sha/siblings)"));
    }
    std::vector<std::string> files;
    for (const Json& s : j["siblings"]) {
      if (s.is_object() && s.contains("rfilename") && s["rfilename"].is_string()) {
        files.push_back(s["rfilename"].get<std::string>());
      }
    }
    return std::make_pair(j["sha"].get<std::string>(), files);
  }

  // HEAD of the resolve URL, following only relative redirects (a renamed repository); an
  // absolute redirect is the LFS file's CDN location and carries the file's metadata.
  absl::StatusOr<FileMeta> Metadata(const std::string& commit, const std::string& path) const {
    std::string url = absl::StrCat(o_.endpoint, "/", o_.repo_id, "/resolve/", UrlQuote(commit, ""),
                                   "/", UrlQuote(path));
    for (int hop = 0; hop < 10; ++hop) {
      auto headers = Headers(url);
      headers["accept-encoding"] = "identity";  // the real size, not a compressed one
      HttpRequest req;
      req.method = "HEAD";
      req.url = url;
      req.headers = headers;
      auto r = HttpFetch(req);
      if (!r.ok()) return r.status();
      const std::string location = r->Header("location");
      if (r->status / 100 == 3 && !location.empty() && location.find("://") == std::string::npos) {
        url = ResolveLocation(url, location);
        continue;
      }
      if (r->status / 100 != 2 && r->status / 100 != 3) {
        return HttpError(absl::StrCat(o_.repo_id, "/", path), *r);
      }
      FileMeta m;
      m.path = path;
      m.commit = r->Header("x-repo-commit");
      std::string etag = r->Header("x-linked-etag");
      if (etag.empty()) etag = r->Header("etag");
      m.etag = NormalizeEtag(etag);
      std::string size = r->Header("x-linked-size");
      if (size.empty()) size = r->Header("content-length");
      m.size = size.empty() ? -1 : std::strtoll(size.c_str(), nullptr, 10);
      m.location = location.empty() ? url : ResolveLocation(url, location);
      if (m.etag.empty() || m.etag.find('/') != std::string::npos || m.etag == "." ||
          m.etag == "..") {
        return absl::DataLossError(absl::StrCat(url, ": no usable ETag ('", etag,
                                                "'), so the file cannot be cached reliably"));
      }
      if (m.size < 0) return absl::DataLossError(absl::StrCat(url, ": no Content-Length"));
      return m;
    }
    return absl::UnavailableError(absl::StrCat(url, ": too many redirects"));
  }

  // Fetches m's bytes into `incomplete`, resuming from what it already holds.
  // Returns the bytes received (those already in `incomplete` not counted).
  absl::StatusOr<int64_t> Fetch(const FileMeta& m, const fs::path& incomplete,
                                Progress* progress) const {
    absl::Status last;
    int64_t total_received = 0;
    for (int attempt = 1; attempt <= o_.max_attempts; ++attempt) {
      std::error_code ec;
      int64_t have =
          fs::exists(incomplete, ec) ? static_cast<int64_t>(fs::file_size(incomplete, ec)) : 0;
      if (have > m.size) {  // not this file's beginning: start again
        fs::remove(incomplete, ec);
        have = 0;
      }
      if (have == m.size) return total_received;
      auto headers = Headers(m.location);
      if (have > 0) headers["range"] = absl::StrCat("bytes=", have, "-");
      std::unique_ptr<FILE, int (*)(FILE*)> out(std::fopen(incomplete.c_str(), "ab"), std::fclose);
      if (!out) {
        return absl::PermissionDeniedError(
            absl::StrCat(incomplete.string(), ": cannot write: ", std::strerror(errno)));
      }
      int64_t received = 0;
      HttpRequest req;
      req.url = m.location;
      req.headers = headers;
      req.follow_redirects = true;
      req.sink = [&](std::string_view bytes) {
        if (std::fwrite(bytes.data(), 1, bytes.size(), out.get()) != bytes.size()) return false;
        received += static_cast<int64_t>(bytes.size());
        progress->AddBytes(static_cast<int64_t>(bytes.size()));
        return true;
      };
      auto r = HttpFetch(req);
      out.reset();
      total_received += received;
      // A server that ignores Range answers 200 with the whole file.
      const bool restarted = r.ok() && r->status == 200 && have > 0;
      if (r.ok() && r->status / 100 != 2) {
        if (r->status == 416) {  // our partial file is not this one's prefix
          fs::remove(incomplete, ec);
          last = HttpError(m.path, *r);
          continue;
        }
        return HttpError(absl::StrCat(o_.repo_id, "/", m.path), *r);
      }
      if (restarted) {
        // The body (the whole file) was appended after the old prefix: keep only the body.
        LOG(WARNING) << m.path << ": the server ignored the Range request; downloaded whole";
        if (absl::Status st = KeepTail(incomplete, received); !st.ok()) return st;
      }
      if (r.ok()) {
        const int64_t now = static_cast<int64_t>(fs::file_size(incomplete, ec));
        if (now == m.size) return total_received;
        last = absl::DataLossError(absl::StrCat(m.path, ": got ", now, " bytes of ", m.size));
        if (now > m.size) fs::remove(incomplete, ec);
      } else {
        last = r.status();
      }
      LOG(WARNING) << m.path << ": attempt " << attempt << " of " << o_.max_attempts << " failed ("
                   << last.message() << "); resuming";
      std::this_thread::sleep_for(std::chrono::milliseconds(200 * attempt));
    }
    return last;
  }

  // Moves the file's last `tail` bytes to its start and cuts it there, 1 MiB at a time (the
  // tail may be a whole multi-GB file).
  static absl::Status KeepTail(const fs::path& file, int64_t tail) {
    std::error_code ec;
    const int64_t size = static_cast<int64_t>(fs::file_size(file, ec));
    std::fstream f(file, std::ios::binary | std::ios::in | std::ios::out);
    std::vector<char> buf(1 << 20);
    for (int64_t done = 0; f && done < tail;) {
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(buf.size()), tail - done);
      f.seekg(size - tail + done);
      f.read(buf.data(), n);
      f.seekp(done);
      f.write(buf.data(), n);
      done += n;
    }
    f.close();
    if (f.fail() || ec) {
      return absl::InternalError(absl::StrCat(file.string(), ": rewrite failed"));
    }
    fs::resize_file(file, static_cast<uintmax_t>(tail), ec);
    if (ec) return absl::InternalError(absl::StrCat(file.string(), ": ", ec.message()));
    return absl::OkStatus();
  }

 private:
  const DownloadOptions& o_;
};

// An exclusive flock on the file huggingface_hub locks for the same blob, so that it and we
// never write one blob at once.
class BlobLock {
 public:
  explicit BlobLock(const fs::path& path) {
    std::error_code ec;
    fs::create_directories(path.parent_path(), ec);
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT, 0644);
    if (fd_ >= 0) flock(fd_, LOCK_EX);
  }
  ~BlobLock() {
    if (fd_ >= 0) {
      flock(fd_, LOCK_UN);
      ::close(fd_);
    }
  }

 private:
  int fd_ = -1;
};

absl::Status LinkSnapshot(const fs::path& blob, const fs::path& pointer) {
  std::error_code ec;
  fs::create_directories(pointer.parent_path(), ec);
  if (fs::is_symlink(pointer, ec) || fs::exists(pointer, ec)) {
    if (fs::is_symlink(pointer, ec) &&
        fs::read_symlink(pointer, ec) == fs::relative(blob, pointer.parent_path(), ec)) {
      return absl::OkStatus();
    }
    fs::remove(pointer, ec);
  }
  fs::create_symlink(fs::relative(blob, pointer.parent_path()), pointer, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat(pointer.string(), ": cannot link to ", blob.string(), ": ", ec.message()));
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<std::string> ExpandExtensions(const std::string& flag) {
  static const std::vector<std::string> kMeta = {".json", ".py", ".model", ".md"};
  std::vector<std::string> exts = absl::StrSplit(flag, ',');
  if (exts.size() == 1 && std::find(kMeta.begin(), kMeta.end(), exts[0]) == kMeta.end()) {
    exts.insert(exts.end(), kMeta.begin(), kMeta.end());
  }
  return exts;
}

bool IsWeightHubFile(const std::string& path, const std::vector<std::string>& extensions) {
  if (path.find('/') != std::string::npos) return false;
  for (const char* skip : {"arguments", "args", "training"}) {
    if (path.find(skip) != std::string::npos) return false;
  }
  return std::any_of(extensions.begin(), extensions.end(),
                     [&](const std::string& e) { return absl::EndsWith(path, e); });
}

std::string EndpointFromEnvironment() {
  std::string e = Env("HF_ENDPOINT");
  if (e.empty()) e = "https://huggingface.co";
  while (!e.empty() && e.back() == '/') e.pop_back();
  return e;
}

std::string TokenFromEnvironment() {
  for (const char* var : {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"}) {
    if (std::string t(absl::StripAsciiWhitespace(absl::string_view(Env(var)))); !t.empty()) {
      return t;
    }
  }
  fs::path file = Env("HF_TOKEN_PATH");
  if (file.empty() && !HfHomeFromProcessEnvironment().empty()) {
    file = fs::path(HfHomeFromProcessEnvironment()) / "token";
  }
  std::ifstream in(file);
  std::string token;
  if (in) std::getline(in, token);
  return std::string(absl::StripAsciiWhitespace(absl::string_view(token)));
}

absl::StatusOr<bool> ContentMatchesEtag(const std::string& path, const std::string& etag) {
  const bool lfs = IsHex(etag, 64);
  if (!lfs && !IsHex(etag, 40)) return absl::UnavailableError("etag is not a content hash");
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot read"));
  std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  EVP_DigestInit_ex(ctx.get(), lfs ? EVP_sha256() : EVP_sha1(), nullptr);
  if (!lfs) {
    // git hashes "blob <size>\0" followed by the content.
    std::error_code ec;
    const std::string header = absl::StrCat("blob ", fs::file_size(path, ec));
    EVP_DigestUpdate(ctx.get(), header.data(), header.size() + 1);
  }
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    EVP_DigestUpdate(ctx.get(), buf.data(), static_cast<size_t>(in.gcount()));
  }
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx.get(), md, &len);
  static const char* kHex = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) {
    hex += kHex[md[i] >> 4];
    hex += kHex[md[i] & 15];
  }
  return hex == etag;
}

absl::StatusOr<DownloadResult> DownloadFiles(const DownloadOptions& o) {
  if (o.cache_dir.empty()) {
    return absl::InvalidArgumentError("no Hugging Face cache folder (HF_HUB_CACHE, HF_HOME, HOME)");
  }
  Hub hub(o);
  auto info = hub.Info();
  if (!info.ok()) return info.status();
  const auto& [commit, siblings] = *info;
  if (!IsHex(commit, 40)) {
    return absl::DataLossError(
        absl::StrCat("model info of ", o.repo_id, ": sha '", commit, "' is not a commit hash"));
  }
  std::vector<FileMeta> metas;
  int64_t total = 0;
  for (const std::string& f : siblings) {
    if (!IsWeightHubFile(f, o.extensions)) continue;
    auto m = hub.Metadata(commit, f);
    if (!m.ok()) return m.status();
    total += m->size;
    metas.push_back(*std::move(m));
  }
  const fs::path repo = fs::path(o.cache_dir) / RepoFolderName(o.repo_id);
  const fs::path locks = fs::path(o.cache_dir) / ".locks" / RepoFolderName(o.repo_id);
  const fs::path snapshot = repo / "snapshots" / commit;
  std::error_code ec;
  fs::create_directories(repo / "blobs", ec);
  fs::create_directories(snapshot, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat(repo.string(), ": ", ec.message()));
  LOG(INFO) << "Downloading " << metas.size() << " files for model " << o.repo_id << " at "
            << commit << " (" << Progress::FormatBytes(static_cast<double>(total)) << ") into "
            << repo.string();
  Progress progress("download " + o.repo_id, total, static_cast<int>(metas.size()));
  DownloadResult result{snapshot.string(), commit, {}, 0};
  // One file into the cache: its blob (unless there already), then its snapshot link.
  std::atomic<int64_t> downloaded{0};
  auto one = [&](const FileMeta& m) -> absl::Status {
    std::error_code ec;
    const fs::path blob = repo / "blobs" / m.etag;
    BlobLock lock(locks / (m.etag + ".lock"));
    const bool cached =
        fs::exists(blob, ec) && static_cast<int64_t>(fs::file_size(blob, ec)) == m.size;
    if (cached) {
      progress.AddBytes(m.size);
    } else {
      const fs::path incomplete = blob.string() + ".incomplete";
      auto got = hub.Fetch(m, incomplete, &progress);
      if (!got.ok()) {
        return absl::Status(got.status().code(),
                            absl::StrCat("downloading ", m.path, ": ", got.status().message()));
      }
      downloaded += *got;
      auto match = ContentMatchesEtag(incomplete.string(), m.etag);
      if (match.ok() && !*match) {
        fs::remove(incomplete, ec);
        return absl::DataLossError(absl::StrCat(
            m.path, ": checksum mismatch: the downloaded bytes do not hash to the Hub's etag ",
            m.etag, " (removed; run again to retry)"));
      }
      if (!match.ok()) {
        LOG(WARNING) << m.path << ": etag " << m.etag
                     << " is not a content hash; only its size was checked";
      }
      fs::rename(incomplete, blob, ec);
      if (ec) return absl::InternalError(absl::StrCat(blob.string(), ": ", ec.message()));
    }
    if (absl::Status st = LinkSnapshot(blob, snapshot / m.path); !st.ok()) return st;
    progress.FileDone();
    return absl::OkStatus();
  };
  // Several files at once, as huggingface_hub does (a large model's shards come down in
  // parallel); the first failure stops the workers from taking more files.
  std::atomic<size_t> next{0};
  std::mutex failure_mu;
  absl::Status failure;
  auto worker = [&] {
    for (size_t i; (i = next.fetch_add(1)) < metas.size();) {
      absl::Status st = one(metas[i]);
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(failure_mu);
        if (failure.ok()) failure = st;
        next = metas.size();
      }
    }
  };
  std::vector<std::thread> workers;
  for (int w = 0; w < std::min<int>(o.parallel_files, static_cast<int>(metas.size())); ++w) {
    workers.emplace_back(worker);
  }
  for (std::thread& t : workers) t.join();
  if (!failure.ok()) return failure;
  for (const FileMeta& m : metas) result.files.push_back(m.path);
  result.bytes_downloaded = downloaded;
  // A branch or tag name points at the commit, so that later lookups by name find it.
  const std::string rev = o.revision.empty() ? "main" : o.revision;
  if (rev != commit) {
    const fs::path ref = repo / "refs" / rev;
    fs::create_directories(ref.parent_path(), ec);
    std::ofstream(ref, std::ios::trunc) << commit;
  }
  progress.Finish();
  return result;
}

}  // namespace tgis::hub
