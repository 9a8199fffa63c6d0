#include "metrics/http_server.h"

#include <httplib.h>

namespace tgis::metrics {

HttpServer::HttpServer(std::function<bool()> healthy, std::function<std::string()> metrics)
    : server_(std::make_unique<httplib::Server>()) {
  server_->Get("/health", [healthy](const httplib::Request&, httplib::Response& res) {
    const bool ok = healthy();
    res.status = ok ? 200 : 503;
    res.set_content(ok ? "OK" : "Service Unavailable", "text/plain");
  });
  server_->Get("/metrics", [metrics](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics(), "text/plain; version=0.0.4; charset=utf-8");
  });
}

HttpServer::~HttpServer() { Stop(); }

bool HttpServer::Start(int port) {
  if (!server_->bind_to_port("0.0.0.0", port)) return false;
  thread_ = std::thread([this] { server_->listen_after_bind(); });
  return true;
}

void HttpServer::Stop() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace tgis::metrics
