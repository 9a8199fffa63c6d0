// OpenTelemetry tracing with TGIS's flags (--otlp-endpoint, --otlp-service-name): spans made
// here and exported over OTLP (proto/otlp_trace.proto; gRPC, or HTTP with protobuf bodies when
// OTEL_EXPORTER_OTLP_PROTOCOL says http/protobuf) to a collector, batched, from a
// bounded queue that drops spans rather than block the serving path. W3C trace context
// (`traceparent`) links a client's trace to the router's spans and the router's steps to the
// shards'. With no endpoint configured every call here is a cheap no-op.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace opentelemetry::proto::collector::trace::v1 {
class Span;
}

namespace tgis::tracing {

struct SpanContext {
  std::array<uint8_t, 16> trace_id{};
  std::array<uint8_t, 8> span_id{};
  uint8_t flags = 1;  // sampled

  bool valid() const;
  // "00-<32 hex trace id>-<16 hex span id>-<2 hex flags>" (W3C Trace Context, version 00).
  std::string Traceparent() const;
  // A traceparent header as the W3C spec reads it (any version but ff; a future version may
  // carry more fields after the flags). nullopt for a malformed one or all-zero ids.
  static std::optional<SpanContext> FromTraceparent(std::string_view header);
};

enum class SpanKind { kInternal = 1, kServer = 2, kClient = 3 };

using SteadyTime = std::chrono::steady_clock::time_point;

// One span. Ends at End() or when destroyed (whichever first); a default-constructed span, or
// any span while tracing is off, records nothing. Movable, not copyable; not thread-safe (one
// owner at a time).
class Span {
 public:
  Span();
  ~Span();
  Span(Span&&) noexcept;
  Span& operator=(Span&&) noexcept;

  bool recording() const { return data_ != nullptr; }
  // Valid only while recording; children and links take it.
  const SpanContext& context() const { return context_; }
  void SetAttribute(const std::string& key, const std::string& value);
  void SetAttribute(const std::string& key, const char* value);
  void SetAttribute(const std::string& key, int64_t value);
  void SetAttribute(const std::string& key, double value);
  void SetAttribute(const std::string& key, bool value);
  void AddLink(const SpanContext& other);
  void SetError(const std::string& message);
  void End(std::optional<SteadyTime> end = std::nullopt);

 private:
  friend Span StartSpan(const std::string&, const SpanContext*, SpanKind,
                        std::optional<SteadyTime>);
  SpanContext context_;
  std::unique_ptr<opentelemetry::proto::collector::trace::v1::Span> data_;
};

// `parent` null or invalid: a root span in a new trace. `start` defaults to now.
Span StartSpan(const std::string& name, const SpanContext* parent,
               SpanKind kind = SpanKind::kInternal, std::optional<SteadyTime> start = std::nullopt);

enum class OtlpProtocol { kGrpc, kHttpProtobuf };

struct TracingOptions {
  // The collector's OTLP endpoint. gRPC: http://host:4317 (plaintext), https://host:4317 (TLS,
  // system roots) or host:port. HTTP: http(s)://host:4318, to which /v1/traces is added unless
  // the path already ends so. Empty: tracing off.
  std::string endpoint;
  OtlpProtocol protocol = OtlpProtocol::kGrpc;
  std::string service_name;  // the resource's service.name
  size_t max_queue_spans = 2048;
  size_t max_export_batch = 512;
  std::chrono::milliseconds schedule_delay{1000};
  std::chrono::milliseconds export_timeout{10000};
};

// Starts the exporter (once per process). A malformed endpoint is an error naming it.
absl::Status InitTracing(const TracingOptions& options);
// Exports what is queued (up to the export timeout) and stops the exporter.
void ShutdownTracing();
bool TracingEnabled();
// Spans dropped because the queue was full or an export failed, since start.
uint64_t DroppedSpans();
// Tracing for the life of a process's main(): started from the flags' values as the router and
// the shards take them (empty endpoint = off), and flushed and stopped when it goes out of
// scope. The protocol comes from OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else
// OTEL_EXPORTER_OTLP_PROTOCOL (the OpenTelemetry variables): grpc (default) or http/protobuf;
// http/json is refused by name.
class TracingSession {
 public:
  static absl::StatusOr<std::unique_ptr<TracingSession>> FromFlags(const std::string& endpoint,
                                                                   const std::string& service_name);
  ~TracingSession() { ShutdownTracing(); }

 private:
  TracingSession() = default;
};

}  // namespace tgis::tracing
