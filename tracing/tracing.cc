#include "tracing/tracing.h"

#include <glog/logging.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/http_client.h"
#include "proto/otlp_trace.grpc.pb.h"

namespace tgis::tracing {
namespace {

namespace otlp = opentelemetry::proto::collector::trace::v1;

constexpr char kHex[] = "0123456789abcdef";

template <size_t N>
std::string Hex(const std::array<uint8_t, N>& bytes) {
  std::string out;
  for (uint8_t b : bytes) {
    out += kHex[b >> 4];
    out += kHex[b & 15];
  }
  return out;
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;  // the spec allows lowercase only
}

template <size_t N>
bool ParseHex(std::string_view s, std::array<uint8_t, N>* out) {
  if (s.size() != 2 * N) return false;
  for (size_t i = 0; i < N; ++i) {
    const int hi = HexDigit(s[2 * i]), lo = HexDigit(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    (*out)[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return true;
}

template <size_t N>
bool AllZero(const std::array<uint8_t, N>& a) {
  return std::all_of(a.begin(), a.end(), [](uint8_t b) { return b == 0; });
}

template <size_t N>
void RandomId(std::array<uint8_t, N>* out) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  do {
    for (size_t i = 0; i < N; i += 8) {
      const uint64_t r = rng();
      for (size_t k = 0; k < 8 && i + k < N; ++k) (*out)[i + k] = static_cast<uint8_t>(r >> 8 * k);
    }
  } while (AllZero(*out));
}

// Steady-clock times (what the servers measure with) as Unix nanoseconds.
uint64_t UnixNanos(SteadyTime t) {
  const auto system_now = std::chrono::system_clock::now();
  const auto steady_now = std::chrono::steady_clock::now();
  const auto unix = system_now.time_since_epoch() -
                    std::chrono::duration_cast<std::chrono::system_clock::duration>(steady_now - t);
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(unix).count());
}

otlp::KeyValue* AddAttribute(otlp::Span* s, const std::string& key) {
  otlp::KeyValue* kv = s->add_attributes();
  kv->set_key(key);
  return kv;
}

// The batching exporter: spans queue here (bounded; when full a span is dropped and counted),
// and one thread sends them in batches every schedule_delay, or as soon as a batch is full.
class Exporter {
 public:
  static Exporter& Get() {
    static Exporter* e = new Exporter();  // never destroyed: spans may end during exit
    return *e;
  }

  absl::Status Start(const TracingOptions& o) {
    std::lock_guard<std::mutex> lock(mu_);
    if (running_) return absl::FailedPreconditionError("tracing is already initialized");
    std::string target = o.endpoint;
    std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
    if (o.protocol == OtlpProtocol::kHttpProtobuf) {
      if (!absl::StartsWith(target, "http://") && !absl::StartsWith(target, "https://")) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--otlp-endpoint '", o.endpoint, "': OTLP/HTTP needs an http:// or https:// URL"));
      }
      while (!target.empty() && target.back() == '/') target.pop_back();
      if (!absl::EndsWith(target, "/v1/traces")) target += "/v1/traces";
      http_url_ = target;
    } else if (absl::StartsWith(target, "https://")) {
      creds = grpc::SslCredentials(grpc::SslCredentialsOptions());
      target = target.substr(8);
    } else if (absl::StartsWith(target, "http://")) {
      target = target.substr(7);
    } else if (target.find("://") != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("--otlp-endpoint '", o.endpoint,
                       "': an OTLP/gRPC endpoint is http://host:port or "
                       "https://host:port"));
    }
    while (!target.empty() && target.back() == '/') target.pop_back();
    if (target.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--otlp-endpoint '", o.endpoint, "': no host"));
    }
    options_ = o;
    if (o.protocol == OtlpProtocol::kGrpc) {
      stub_ = otlp::TraceService::NewStub(grpc::CreateChannel(target, creds));
    }
    resource_.Clear();
    otlp::KeyValue* name = resource_.add_attributes();
    name->set_key("service.name");
    name->mutable_value()->set_string_value(o.service_name);
    otlp::KeyValue* sdk = resource_.add_attributes();
    sdk->set_key("telemetry.sdk.name");
    sdk->mutable_value()->set_string_value("tgis-cpp");
    running_ = true;
    stop_ = false;
    enabled_.store(true);
    thread_ = std::thread([this] { Loop(); });
    LOG(INFO) << "tracing: exporting spans of service '" << o.service_name << "' to " << target
              << (o.protocol == OtlpProtocol::kGrpc ? " over OTLP/gRPC" : " over OTLP/HTTP");
    return absl::OkStatus();
  }

  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!running_) return;
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
    enabled_.store(false);
  }

  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  uint64_t dropped() const { return dropped_.load(); }

  void Push(std::unique_ptr<otlp::Span> span) {
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!running_ || stop_ || queue_.size() >= options_.max_queue_spans) {
        if (dropped_.fetch_add(1) % 1000 == 0 && running_) {
          LOG(WARNING) << "tracing: span queue full (" << options_.max_queue_spans
                       << "): dropping spans";
        }
        return;
      }
      queue_.push_back(std::move(span));
      wake = queue_.size() >= options_.max_export_batch;
    }
    if (wake) cv_.notify_one();
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait_for(lock, options_.schedule_delay,
                   [this] { return stop_ || queue_.size() >= options_.max_export_batch; });
      while (!queue_.empty()) {
        std::vector<std::unique_ptr<otlp::Span>> batch;
        while (!queue_.empty() && batch.size() < options_.max_export_batch) {
          batch.push_back(std::move(queue_.front()));
          queue_.pop_front();
        }
        lock.unlock();
        Send(std::move(batch));
        lock.lock();
        if (!stop_ && queue_.size() < options_.max_export_batch) break;
      }
      if (stop_) return;
    }
  }

  void Send(std::vector<std::unique_ptr<otlp::Span>> batch) {
    otlp::ExportTraceServiceRequest request;
    otlp::ResourceSpans* rs = request.add_resource_spans();
    *rs->mutable_resource() = resource_;
    otlp::ScopeSpans* ss = rs->add_scope_spans();
    ss->mutable_scope()->set_name("text-generation-inference");
    for (auto& s : batch) ss->mutable_spans()->AddAllocated(s.release());
    otlp::ExportTraceServiceResponse response;
    const absl::Status st = Export(request, &response);
    if (!st.ok()) {
      dropped_.fetch_add(ss->spans_size());
      // One line per failure streak, not per batch.
      if (!failing_) {
        LOG(WARNING) << "tracing: export of " << ss->spans_size() << " spans failed ("
                     << st.message() << "); dropping spans until the collector answers";
      }
      failing_ = true;
      return;
    }
    if (failing_) LOG(INFO) << "tracing: the collector answers again";
    failing_ = false;
    if (response.has_partial_success() && response.partial_success().rejected_spans() > 0) {
      LOG(WARNING) << "tracing: the collector rejected "
                   << response.partial_success().rejected_spans()
                   << " spans: " << response.partial_success().error_message();
    }
  }

  absl::Status Export(const otlp::ExportTraceServiceRequest& request,
                      otlp::ExportTraceServiceResponse* response) {
    const auto timeout_s =
        std::chrono::duration_cast<std::chrono::seconds>(options_.export_timeout);
    if (options_.protocol == OtlpProtocol::kHttpProtobuf) {
      HttpRequest post;
      post.method = "POST";
      post.url = http_url_;
      post.headers = {{"content-type", "application/x-protobuf"}};
      post.body = request.SerializeAsString();
      post.timeout_s = std::max<long>(1, static_cast<long>(timeout_s.count()));
      auto r = HttpFetch(post);
      if (!r.ok()) return r.status();
      if (r->status / 100 != 2) {
        return absl::UnavailableError(
            absl::StrCat("HTTP ", r->status, " ", r->body.substr(0, 200)));
      }
      response->ParseFromString(r->body);  // an empty body is an empty response
      return absl::OkStatus();
    }
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + options_.export_timeout);
    const grpc::Status st = stub_->Export(&context, request, response);
    if (!st.ok()) return absl::UnavailableError(st.error_message());
    return absl::OkStatus();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<otlp::Span>> queue_;
  bool running_ = false;
  bool stop_ = false;
  bool failing_ = false;  // exporter thread only
  std::atomic<bool> enabled_{false};
  std::atomic<uint64_t> dropped_{0};
  TracingOptions options_;
  otlp::Resource resource_;
  std::unique_ptr<otlp::TraceService::Stub> stub_;
  std::string http_url_;
  std::thread thread_;
};

}  // namespace

bool SpanContext::valid() const { return !AllZero(trace_id) && !AllZero(span_id); }

std::string SpanContext::Traceparent() const {
  const std::array<uint8_t, 1> f{flags};
  return absl::StrCat("00-", Hex(trace_id), "-", Hex(span_id), "-", Hex(f));
}

std::optional<SpanContext> SpanContext::FromTraceparent(std::string_view h) {
  // version "-" trace-id "-" parent-id "-" flags: 2 + 1 + 32 + 1 + 16 + 1 + 2 = 55 characters.
  if (h.size() < 55 || h[2] != '-' || h[35] != '-' || h[52] != '-') return std::nullopt;
  std::array<uint8_t, 1> version{}, flags{};
  SpanContext c;
  if (!ParseHex(h.substr(0, 2), &version) || version[0] == 0xff ||
      !ParseHex(h.substr(3, 32), &c.trace_id) || !ParseHex(h.substr(36, 16), &c.span_id) ||
      !ParseHex(h.substr(53, 2), &flags)) {
    return std::nullopt;
  }
  // Version 00 is exactly 55 characters; later versions may append "-..." fields.
  if ((version[0] == 0 && h.size() != 55) || (h.size() > 55 && h[55] != '-')) return std::nullopt;
  if (!c.valid()) return std::nullopt;
  c.flags = flags[0];
  return c;
}

Span::Span() = default;
Span::~Span() { End(); }
Span::Span(Span&& o) noexcept : context_(o.context_), data_(std::move(o.data_)) {}
Span& Span::operator=(Span&& o) noexcept {
  if (this != &o) {
    End();
    context_ = o.context_;
    data_ = std::move(o.data_);
  }
  return *this;
}

void Span::SetAttribute(const std::string& key, const std::string& value) {
  if (data_) AddAttribute(data_.get(), key)->mutable_value()->set_string_value(value);
}
void Span::SetAttribute(const std::string& key, const char* value) {
  SetAttribute(key, std::string(value));
}
void Span::SetAttribute(const std::string& key, int64_t value) {
  if (data_) AddAttribute(data_.get(), key)->mutable_value()->set_int_value(value);
}
void Span::SetAttribute(const std::string& key, double value) {
  if (data_) AddAttribute(data_.get(), key)->mutable_value()->set_double_value(value);
}
void Span::SetAttribute(const std::string& key, bool value) {
  if (data_) AddAttribute(data_.get(), key)->mutable_value()->set_bool_value(value);
}

void Span::AddLink(const SpanContext& other) {
  if (!data_ || !other.valid()) return;
  otlp::Span::Link* link = data_->add_links();
  link->set_trace_id(other.trace_id.data(), other.trace_id.size());
  link->set_span_id(other.span_id.data(), other.span_id.size());
  link->set_flags(other.flags);
}

void Span::SetError(const std::string& message) {
  if (!data_) return;
  data_->mutable_status()->set_code(otlp::Status::STATUS_CODE_ERROR);
  data_->mutable_status()->set_message(message);
}

void Span::End(std::optional<SteadyTime> end) {
  if (!data_) return;
  data_->set_end_time_unix_nano(UnixNanos(end.value_or(std::chrono::steady_clock::now())));
  Exporter::Get().Push(std::move(data_));
}

Span StartSpan(const std::string& name, const SpanContext* parent, SpanKind kind,
               std::optional<SteadyTime> start) {
  Span span;
  if (!Exporter::Get().enabled()) return span;
  auto data = std::make_unique<otlp::Span>();
  if (parent != nullptr && parent->valid()) {
    span.context_.trace_id = parent->trace_id;
    span.context_.flags = parent->flags;
    data->set_parent_span_id(parent->span_id.data(), parent->span_id.size());
  } else {
    RandomId(&span.context_.trace_id);
  }
  RandomId(&span.context_.span_id);
  data->set_trace_id(span.context_.trace_id.data(), span.context_.trace_id.size());
  data->set_span_id(span.context_.span_id.data(), span.context_.span_id.size());
  data->set_flags(span.context_.flags);
  data->set_name(name);
  data->set_kind(static_cast<otlp::Span::SpanKind>(kind));
  data->set_start_time_unix_nano(UnixNanos(start.value_or(std::chrono::steady_clock::now())));
  span.data_ = std::move(data);
  return span;
}

absl::Status InitTracing(const TracingOptions& options) {
  if (options.endpoint.empty()) return absl::OkStatus();
  return Exporter::Get().Start(options);
}

void ShutdownTracing() { Exporter::Get().Stop(); }
bool TracingEnabled() { return Exporter::Get().enabled(); }
uint64_t DroppedSpans() { return Exporter::Get().dropped(); }

absl::StatusOr<std::unique_ptr<TracingSession>> TracingSession::FromFlags(
    const std::string& endpoint, const std::string& service_name) {
  TracingOptions o;
  o.endpoint = endpoint;
  o.service_name = service_name;
  for (const char* var : {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"}) {
    const char* v = std::getenv(var);
    if (v == nullptr || *v == '\0') continue;
    const std::string protocol(v);
    if (protocol == "http/protobuf") {
      o.protocol = OtlpProtocol::kHttpProtobuf;
    } else if (protocol != "grpc") {
      return absl::InvalidArgumentError(absl::StrCat(
          var, "='", protocol, "': this server exports OTLP as grpc or http/protobuf"));
    }
    break;
  }
  if (absl::Status st = InitTracing(o); !st.ok()) return st;
  return std::unique_ptr<TracingSession>(new TracingSession());
}

}  // namespace tgis::tracing
