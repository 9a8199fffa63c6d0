#include "metrics/http_server.h"

#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

namespace tgis::metrics {

HttpServer::HttpServer(std::function<bool()> healthy, std::function<std::string()> metrics)
    : server_(std::make_unique<httplib::Server>()) {
  // httplib's default sets SO_REUSEPORT, which lets a second process bind a port that is in use
  // (and share its traffic) instead of failing; SO_REUSEADDR alone only reuses TIME_WAIT ports.
  server_->set_socket_options([](int sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  server_->Get("/health", [healthy](const httplib::Request&, httplib::Response& res) {
    const bool ok = healthy();
    // TGIS's answers: 200 with an empty body, or 503 with its JSON error.
    if (ok) {
      res.status = 200;
    } else {
      res.status = 503;
      res.set_content(R"({"error":"unhealthy"})", "application/json");
    }
  });
  server_->Get("/metrics", [metrics](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics(), "text/plain; version=0.0.4; charset=utf-8");
  });
}

HttpServer::~HttpServer() { Stop(); }

namespace {

// Why 0.0.0.0:port cannot be bound (httplib does not say): one more try, for errno.
std::string BindError(int port) {
  const int sock = socket(AF_INET, SOCK_STREAM, 0);
  if (sock < 0) return std::strerror(errno);
  int yes = 1;
  setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  std::string error = "cannot bind";
  if (bind(sock, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    error = std::strerror(errno);
  } else if (listen(sock, 1) != 0) {
    error = std::strerror(errno);
  }
  close(sock);
  return error;
}

}  // namespace

bool HttpServer::Start(int port) {
  if (port == 0) {
    port_ = server_->bind_to_any_port("0.0.0.0");
    if (port_ <= 0) {
      error_ = BindError(0);
      return false;
    }
  } else {
    if (!server_->bind_to_port("0.0.0.0", port)) {
      error_ = BindError(port);
      return false;
    }
    port_ = port;
  }
  thread_ = std::thread([this] {
    server_->listen_after_bind();
    listen_returned_ = true;
  });
  // httplib's stop() does nothing until the listening thread has marked the server running: a
  // Stop() right after Start() would otherwise leave that thread accepting forever.
  while (!server_->is_running() && !listen_returned_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

void HttpServer::Stop() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace tgis::metrics
