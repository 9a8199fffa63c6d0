// The HTTP side of the server on PORT: GET /health and GET /metrics.
#pragma once

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
  // Listens on 0.0.0.0:port in a background thread; false when the port cannot be bound.
  bool Start(int port);
  void Stop();

 private:
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
};

}  // namespace tgis::metrics
