// Blocking HTTP(S) requests over libcurl: for the Hub client, metadata (HEAD without following
// redirects, as the Hub answers LFS files with a redirect that carries their metadata), small
// JSON bodies and file bodies streamed to a sink; for OTLP/HTTP, POSTs of protobuf bodies. Proxies
// come from the usual variables (HTTPS_PROXY, NO_PROXY, ...) as libcurl reads them; TLS trust from
// the system store, or from REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE when set (what huggingface_hub's
// requests honours).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace tgis {

struct HttpResponse {
  long status = 0;
  std::map<std::string, std::string> headers;  // names lower-cased; the last value of a repeat
  std::string body;                            // unless streamed to a sink
  std::string url;                             // where the answer came from

  std::string Header(const std::string& lower_name) const;
};

struct HttpRequest {
  std::string method = "GET";  // GET, HEAD or POST
  std::string url;
  std::map<std::string, std::string> headers;
  std::string body;  // POST only
  bool follow_redirects = false;
  // Body bytes as they arrive (only for a 2xx answer); returning false aborts the transfer.
  std::function<bool(std::string_view)> sink;
  long connect_timeout_s = 10;
  // A transfer slower than 1 KiB/s for this long is abandoned (a stalled connection).
  long low_speed_time_s = 60;
  long timeout_s = 0;  // the whole transfer; 0: no limit
};

// Fails only when no HTTP answer came (DNS, connection, TLS, a dropped transfer); any HTTP
// status is a response for the caller to judge.
absl::StatusOr<HttpResponse> HttpFetch(const HttpRequest& request);

// "scheme://host[:port]" of an absolute URL ("" if it has none).
std::string UrlOrigin(const std::string& url);
// `location` (absolute, or a path on `base`'s origin) as an absolute URL.
std::string ResolveLocation(const std::string& base, const std::string& location);
// Percent-encodes everything except unreserved characters and those in `safe`.
std::string UrlQuote(std::string_view s, std::string_view safe = "/");

}  // namespace tgis
