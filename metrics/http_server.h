// The HTTP side of the server on PORT: GET /health and GET /metrics.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

namespace httplib {
class Server;
}

namespace tgis::metrics {

class HttpServer {
 public:
  // `healthy` decides /health (200 or 503); `metrics` renders /metrics.
  HttpServer(std::function<bool()> healthy, std::function<std::string()> metrics);
  ~HttpServer();
  // Listens on 0.0.0.0:port in a background thread (port 0: any free port); false when the
  // port cannot be bound.
  bool Start(int port);
  // The port listened on, once started.
  int port() const { return port_; }
  // Why Start failed (e.g. "Address already in use").
  const std::string& error() const { return error_; }
  void Stop();

 private:
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::atomic<bool> listen_returned_{false};
  int port_ = 0;
  std::string error_;
};

}  // namespace tgis::metrics
