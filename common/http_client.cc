#include "common/http_client.h"

#include <curl/curl.h>

#include <cstdlib>
#include <memory>
#include <mutex>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace tgis {
namespace {

void GlobalInit() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

struct Transfer {
  const HttpRequest* request;
  HttpResponse* response;
  bool sink_failed = false;
};

size_t OnHeader(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  std::string_view line(data, size * n);
  // A new status line (after a redirect or a 100 Continue) starts a new header set, and the
  // body callback needs the status of the answer whose body it gets: an error page is not the
  // file. "HTTP/1.1 206 Partial Content".
  if (line.rfind("HTTP/", 0) == 0) {
    t->response->headers.clear();
    const size_t sp = line.find(' ');
    t->response->status =
        sp == std::string_view::npos
            ? 0
            : std::strtol(std::string(line.substr(sp + 1, 3)).c_str(), nullptr, 10);
  }
  const size_t colon = line.find(':');
  if (colon != std::string_view::npos) {
    std::string name = absl::AsciiStrToLower(std::string(line.substr(0, colon)));
    std::string value(absl::StripAsciiWhitespace(std::string(line.substr(colon + 1))));
    t->response->headers[name] = value;
  }
  return size * n;
}

size_t OnBody(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  std::string_view bytes(data, size * n);
  // Error bodies (and bodies nobody streams) are kept for the message; a 2xx body goes to the
  // sink when there is one.
  if (t->request->sink && t->response->status / 100 == 2) {
    if (!t->request->sink(bytes)) {
      t->sink_failed = true;
      return 0;  // aborts the transfer
    }
  } else if (t->response->body.size() < (64u << 20)) {
    t->response->body.append(bytes);
  }
  return size * n;
}

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}

}  // namespace

std::string HttpResponse::Header(const std::string& lower_name) const {
  auto it = headers.find(lower_name);
  return it == headers.end() ? "" : it->second;
}

absl::StatusOr<HttpResponse> HttpFetch(const HttpRequest& request) {
  GlobalInit();
  std::unique_ptr<CURL, void (*)(CURL*)> curl(curl_easy_init(), curl_easy_cleanup);
  if (!curl) return absl::InternalError("libcurl: cannot create a handle");
  HttpResponse response;
  Transfer transfer{&request, &response};
  CURL* h = curl.get();
  curl_easy_setopt(h, CURLOPT_URL, request.url.c_str());
  if (request.method == "HEAD") {
    curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
  } else if (request.method == "POST") {
    curl_easy_setopt(h, CURLOPT_POST, 1L);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, request.body.data());
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(request.body.size()));
  } else if (request.method != "GET") {
    return absl::InvalidArgumentError(absl::StrCat("HTTP method ", request.method));
  }
  curl_easy_setopt(h, CURLOPT_FOLLOWLOCATION, request.follow_redirects ? 1L : 0L);
  curl_easy_setopt(h, CURLOPT_MAXREDIRS, 10L);
  curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT, request.connect_timeout_s);
  curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1024L);
  curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, request.low_speed_time_s);
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  if (request.timeout_s > 0) curl_easy_setopt(h, CURLOPT_TIMEOUT, request.timeout_s);
  curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, OnHeader);
  curl_easy_setopt(h, CURLOPT_HEADERDATA, &transfer);
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, OnBody);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, &transfer);
  for (const char* bundle : {"REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"}) {
    if (const std::string ca = Env(bundle); !ca.empty()) {
      curl_easy_setopt(h, CURLOPT_CAINFO, ca.c_str());
      break;
    }
  }
  struct curl_slist* list = nullptr;
  for (const auto& [k, v] : request.headers) {
    list = curl_slist_append(list, absl::StrCat(k, ": ", v).c_str());
  }
  std::unique_ptr<curl_slist, void (*)(curl_slist*)> headers(list, curl_slist_free_all);
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, list);
  const CURLcode rc = curl_easy_perform(h);
  long status = 0;
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
  if (status != 0) response.status = status;
  char* effective = nullptr;
  curl_easy_getinfo(h, CURLINFO_EFFECTIVE_URL, &effective);
  response.url = effective != nullptr ? effective : request.url;
  if (rc != CURLE_OK) {
    if (transfer.sink_failed) {
      return absl::InternalError(absl::StrCat(request.url, ": writing the download failed"));
    }
    return absl::UnavailableError(
        absl::StrCat(request.method, " ", request.url, ": ", curl_easy_strerror(rc)));
  }
  return response;
}

std::string UrlOrigin(const std::string& url) {
  const size_t scheme = url.find("://");
  if (scheme == std::string::npos) return "";
  const size_t path = url.find('/', scheme + 3);
  return path == std::string::npos ? url : url.substr(0, path);
}

std::string ResolveLocation(const std::string& base, const std::string& location) {
  if (location.find("://") != std::string::npos) return location;
  if (!location.empty() && location[0] == '/') return UrlOrigin(base) + location;
  // Relative to the base's folder (rare; the Hub sends absolute paths).
  const size_t slash = base.rfind('/');
  return base.substr(0, slash + 1) + location;
}

std::string UrlQuote(std::string_view s, std::string_view safe) {
  static const char* kHex = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : s) {
    if (absl::ascii_isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' ||
        safe.find(static_cast<char>(c)) != std::string_view::npos) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

}  // namespace tgis
