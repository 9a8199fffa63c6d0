"""OpenTelemetry tracing through the launcher (OTLP_ENDPOINT): the router's and the shards' spans
reach an OTLP/gRPC receiver that decodes them with the `opentelemetry-proto` package (a real
OTLP decoder checks our bytes), in the client's trace when it sends a W3C traceparent, with
each request's validation, queue wait and steps under it, and the shards' step spans under the
router's step spans. A collector that is down must not stop the serving."""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent import futures

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs import FIXTURES, Process, binary, free_port, need_binaries, wait_serving  # noqa: E402

grpc = pytest.importorskip("grpc")
trace_service_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc  # noqa: E402
from opentelemetry.proto.trace.v1 import trace_pb2  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span it is sent, with its resource's service.name."""

    def __init__(self):
        self.spans = []  # (service name, Span)
        self.lock = threading.Lock()
        self.port = free_port()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = {a.key: a.value.string_value for a in rs.resource.attributes}["service.name"]
                for ss in rs.scope_spans:
                    self.spans.extend((service, s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate, timeout=20.0):
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self.lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            time.sleep(0.2)
        with self.lock:
            names = sorted({(svc, s.name) for svc, s in self.spans})
        raise AssertionError(f"spans never arrived as expected; got {names}")


class HttpReceiver:
    """OTLP/HTTP: POST /v1/traces with a protobuf ExportTraceServiceRequest body."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.spans, self.content_types, self.paths = [], [], []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                with receiver.lock:
                    receiver.paths.append(self.path)
                    receiver.content_types.append(self.headers["Content-Type"])
                    for rs in request.resource_spans:
                        service = {a.key: a.value.string_value
                                   for a in rs.resource.attributes}["service.name"]
                        for ss in rs.scope_spans:
                            receiver.spans.extend((service, s) for s in ss.spans)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    wait_for = Receiver.wait_for


def launcher_env(tmp_path, endpoint: str, grpc_port: int, **extra) -> dict:
    return {"MODEL_NAME": str(FIXTURES / "models" / "llama"), "GRPC_PORT": str(grpc_port),
            "PORT": str(free_port()), "SHARD_UDS_PATH": str(tmp_path / "shard"),
            "KV_CACHE_BLOCKS": "64", "OTLP_ENDPOINT": endpoint,
            "TERMINATION_LOG": str(tmp_path / "termination-log"), **extra}


def launch(tmp_path, endpoint: str, **extra):
    need_binaries()
    grpc_port = free_port()
    proc = Process([binary("launcher/text-generation-launcher")],
                   env=launcher_env(tmp_path, endpoint, grpc_port, **extra))
    _, pb, stub = wait_serving(proc, grpc_port, 90)
    return proc, pb, stub


def test_streamed_request_spans_arrive_in_the_clients_trace(tmp_path):
    receiver = Receiver()
    proc, pb, stub = launch(tmp_path, f"http://127.0.0.1:{receiver.port}")
    try:
        request = pb.SingleGenerationRequest(
            request=pb.GenerationRequest(text="Hello world"),
            params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=4, min_new_tokens=4)))
        traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
        list(stub.GenerateStream(request, metadata=[("traceparent", traceparent)], timeout=60))

        def ours(spans):
            return [s for _, s in spans if s.trace_id.hex() == TRACE_ID]

        def complete(spans):
            mine = ours(spans)
            steps = [s for s in mine if s.name in ("prefill", "decode")]
            return any(s.name == "generate_stream" for s in mine) and len(steps) >= 4 and \
                sum(s.name == "detokenize" for s in mine) >= 4 and \
                any(svc.endswith(".server") for svc, _ in spans)

        spans = receiver.wait_for(complete)
        mine = {s.span_id: s for s in ours(spans)}
        by_name = {}
        for s in mine.values():
            by_name.setdefault(s.name, []).append(s)
        (call,) = by_name["generate_stream"]
        assert call.parent_span_id.hex() == CLIENT_SPAN
        assert call.kind == trace_pb2.Span.SPAN_KIND_SERVER
        (request_span,) = by_name["request"]
        assert request_span.parent_span_id == call.span_id
        attrs = {a.key: a.value for a in request_span.attributes}
        assert attrs["generated_tokens"].int_value == 4
        assert attrs["stop_reason"].string_value == "MAX_TOKENS"
        for name in ("validate", "queue"):
            (child,) = by_name[name]
            assert child.parent_span_id == request_span.span_id, name
        assert child.start_time_unix_nano <= child.end_time_unix_nano
        # Its steps: the prefill that brought token 1, then one decode per further token, each
        # with the handling of its token under it and a link to the router's step span.
        steps = by_name["prefill"] + by_name["decode"]
        assert len(by_name["prefill"]) == 1 and len(by_name["decode"]) == 3
        assert all(s.parent_span_id == request_span.span_id for s in steps)
        assert sorted(d.parent_span_id for d in by_name["detokenize"]) == \
            sorted(s.span_id for s in steps)
        router_steps = {s.span_id: s for svc, s in spans
                        if svc == "text-generation-inference.router" and s.name in ("prefill", "decode")
                        and not s.parent_span_id}
        for s in steps:
            (link,) = s.links
            assert link.span_id in router_steps, s.name
            assert router_steps[link.span_id].name == s.name
        # The shards' spans of those steps are children of the router's step spans.
        linked = {link.span_id for s in steps for link in s.links}
        shard_spans = [s for svc, s in spans if svc == "text-generation-inference.server"]
        children = [s for s in shard_spans if s.parent_span_id in linked]
        assert {s.name for s in children} == {"shard.prefill", "shard.decode"}
        for s in children:
            assert s.trace_id == router_steps[s.parent_span_id].trace_id
    finally:
        proc.close()
        receiver.server.stop(0)


def test_unreachable_collector_does_not_stop_serving(tmp_path):
    proc, pb, stub = launch(tmp_path, f"http://127.0.0.1:{free_port()}")
    try:
        for _ in range(3):
            r = stub.Generate(pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text="Hello")],
                params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=3))), timeout=60)
            assert r.responses[0].generated_token_count == 3
    finally:
        proc.close()


def test_otlp_over_http_protobuf(tmp_path):
    receiver = HttpReceiver()
    proc, pb, stub = launch(tmp_path, f"http://127.0.0.1:{receiver.port}",
                            OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")
    try:
        stub.Generate(pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="Hello")],
            params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=2))),
            metadata=[("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN}-01")], timeout=60)
        spans = receiver.wait_for(lambda spans: any(
            s.name == "generate" and s.trace_id.hex() == TRACE_ID for _, s in spans) and any(
            svc == "text-generation-inference.server" for svc, _ in spans))
        (call,) = [s for _, s in spans if s.name == "generate"]
        assert call.parent_span_id.hex() == CLIENT_SPAN
        assert set(receiver.paths) == {"/v1/traces"}
        assert set(receiver.content_types) == {"application/x-protobuf"}
    finally:
        proc.close()
        receiver.server.shutdown()


def test_unsupported_otlp_protocol_fails_at_start_naming_it(tmp_path):
    need_binaries()
    proc = Process([binary("launcher/text-generation-launcher")],
                   env=launcher_env(tmp_path, "http://127.0.0.1:4318", free_port(),
                                    OTEL_EXPORTER_OTLP_PROTOCOL="http/json"))
    try:
        assert proc.proc.wait(timeout=60) != 0
        assert "OTEL_EXPORTER_OTLP_PROTOCOL='http/json'" in proc.output()
    finally:
        proc.close()
