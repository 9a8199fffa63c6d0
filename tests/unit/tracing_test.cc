// W3C trace context as the spec reads it, and the exporter's promise never to block: with the
// collector unreachable and the queue full, spans are dropped and counted.
#include "tracing/tracing.h"

#include <gtest/gtest.h>

namespace {

using tgis::tracing::SpanContext;

TEST(TraceparentTest, RoundTripsAndKeepsFlags) {
  const std::string h = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
  auto c = SpanContext::FromTraceparent(h);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->Traceparent(), h);
  EXPECT_EQ(c->flags, 1);
  EXPECT_EQ(c->trace_id[0], 0x4b);
  EXPECT_EQ(c->span_id[7], 0xb7);
}

TEST(TraceparentTest, RefusesWhatTheSpecRefuses) {
  for (const char* bad : {
           "",                                                           // empty
           "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",       // no flags
           "00-00000000000000000000000000000000-00f067aa0ba902b7-01",    // zero trace id
           "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",    // zero span id
           "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",    // version ff
           "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",    // uppercase
           "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",  // v00 with more
       }) {
    EXPECT_FALSE(SpanContext::FromTraceparent(bad).has_value()) << bad;
  }
  // A later version may carry more fields after the flags.
  EXPECT_TRUE(
      SpanContext::FromTraceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xyz")
          .has_value());
}

TEST(TracingTest, OffMeansNothingIsRecorded) {
  ASSERT_FALSE(tgis::tracing::TracingEnabled());
  tgis::tracing::Span s = tgis::tracing::StartSpan("x", nullptr);
  EXPECT_FALSE(s.recording());
  s.SetAttribute("k", int64_t{1});  // harmless
}

TEST(TracingTest, FullQueueDropsInsteadOfBlocking) {
  tgis::tracing::TracingOptions o;
  o.endpoint = "http://127.0.0.1:1";  // nothing listens there
  o.service_name = "test";
  o.max_queue_spans = 4;
  o.max_export_batch = 1000;  // never a full batch: the queue fills
  o.schedule_delay = std::chrono::hours(1);
  ASSERT_TRUE(tgis::tracing::InitTracing(o).ok());
  EXPECT_FALSE(tgis::tracing::InitTracing(o).ok());  // once per process
  tgis::tracing::Span parent = tgis::tracing::StartSpan("parent", nullptr);
  ASSERT_TRUE(parent.recording());
  for (int i = 0; i < 10; ++i) {
    tgis::tracing::Span child = tgis::tracing::StartSpan("child", &parent.context());
    EXPECT_EQ(child.context().trace_id, parent.context().trace_id);
    EXPECT_NE(child.context().span_id, parent.context().span_id);
  }
  EXPECT_EQ(tgis::tracing::DroppedSpans(), 6u);
  parent.End();
  tgis::tracing::ShutdownTracing();
  EXPECT_FALSE(tgis::tracing::TracingEnabled());
}

TEST(TracingTest, BadEndpointIsAnErrorNamingIt) {
  tgis::tracing::TracingOptions o;
  o.endpoint = "ftp://collector:4317";
  auto st = tgis::tracing::InitTracing(o);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("ftp://collector:4317"), std::string::npos);
}

}  // namespace
