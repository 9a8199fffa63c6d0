"""The router's HTTP port: GET /health (503 before the shards are ready and after one dies, 200 once
a generation worked) and GET /metrics (TGIS's tgi_ metric table: valid exposition by promtool,
and every metric moves when what it counts happens)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs import Process, binary  # noqa: E402
from router_harness import (ROUTER_BINARY, SHARD_BINARY, RouterServer, binaries_missing,  # noqa: E402
                            fixture_model_dir, free_port, http_get, wait_until)

grpc = pytest.importorskip("grpc")

# TGIS README's metric table: name -> kind.
TGIS_METRICS = {
    "tgi_request_count": "counter", "tgi_request_input_count": "counter",
    "tgi_request_failure": "counter", "tgi_request_success": "counter",
    "tgi_request_max_new_tokens": "histogram", "tgi_request_input_length": "histogram",
    "tgi_request_raw_input_length": "summary",
    "tgi_request_mean_time_per_token_duration": "histogram",
    "tgi_request_validation_duration": "histogram", "tgi_request_queue_duration": "histogram",
    "tgi_request_generated_tokens": "histogram", "tgi_request_total_tokens": "histogram",
    "tgi_request_duration": "histogram", "tgi_request_inference_duration": "histogram",
    "tgi_batch_concatenation_count": "counter", "tgi_batch_inference_count": "counter",
    "tgi_batch_inference_success": "counter", "tgi_batch_inference_failure": "counter",
    "tgi_batch_inference_batch_size": "histogram", "tgi_batch_inference_duration": "histogram",
    "tgi_batch_inference_forward_duration": "histogram",
    "tgi_batch_inference_tokproc_duration": "histogram", "tgi_batch_next_tokens": "summary",
    "tgi_batch_current_size": "gauge", "tgi_batch_input_tokens": "gauge",
    "tgi_batch_max_remaining_tokens": "gauge", "tgi_queue_size": "gauge", "tgi_queue_jump": "counter",
    "tgi_granular_batch_addition": "counter", "tgi_prefill_weight_limit_exceeded": "counter",
    "tgi_prefill_padding_limit_exceeded": "counter", "tgi_prompt_load_failure": "counter",
    "tgi_prompt_load_duration": "histogram", "tgi_tokenize_request_count": "counter",
    "tgi_tokenize_request_input_count": "counter", "tgi_tokenize_request_tokens": "histogram",
    "tgi_tokenize_request_duration": "histogram",
}

KV_BLOCKS, BLOCK_SIZE = 64, 4  # 256 tokens of KV cache: the model's whole length
MAX_CONCURRENT = 8

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class Exposition:
    """A parsed text exposition: TYPE lines and samples."""

    def __init__(self, text: str):
        self.text = text
        self.types: dict[str, str] = {}
        self.samples: dict[tuple[str, frozenset], float] = {}
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ")
                self.types[name] = kind
            elif line and not line.startswith("#"):
                m = _SAMPLE.match(line)
                assert m, f"not a sample line: {line!r}"
                labels = frozenset(_LABEL.findall(m.group(2) or ""))
                self.samples[(m.group(1), labels)] = float(m.group(3))

    def value(self, name: str, **labels) -> float:
        """The sample with exactly these labels (0 when absent, as Prometheus counters start)."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def count(self, name: str, **labels) -> float:
        """A counter's value, or a histogram's observation count."""
        if self.types.get(name) in ("histogram", "summary"):
            return self.value(name + "_count", **labels)
        return self.value(name, **labels)


@pytest.fixture(scope="module")
def server():
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    s = RouterServer("gpt2", kv_blocks=KV_BLOCKS, block_size=BLOCK_SIZE,
                     router_args=["--max-new-tokens", "250",
                                  "--max-concurrent-requests", str(MAX_CONCURRENT)])
    yield s
    s.close()


def scrape(server) -> Exposition:
    status, text = server.http_get("/metrics")
    assert status == 200
    return Exposition(text)


def params(pb, max_new: int, min_new: int = 0, **kw):
    return pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=max_new,
                                                      min_new_tokens=min_new, **kw))


def test_health_is_503_until_the_shards_are_ready(tmp_path):
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    uds = str(tmp_path / "shard")
    model = fixture_model_dir("gpt2")
    port = free_port()
    router = Process([binary(ROUTER_BINARY), "--tokenizer-path", model, "--shard-uds-path", uds,
                      "--grpc-port", str(free_port()), "--port", str(port)])
    shard = None
    try:
        router.wait_for(lambda: "waiting for 1 shard(s)" in router.output(), timeout=20,
                        what="waiting for the shard")
        # TGIS's unhealthy answer: 503 with a JSON error.
        assert http_get(port, "/health") == (503, '{"error":"unhealthy"}'), router.output()
        status, text = http_get(port, "/metrics")  # Prometheus can scrape already
        assert status == 200 and "# TYPE tgi_request_count counter" in text
        shard = Process([binary(SHARD_BINARY), "serve", model, "--uds-path", uds,
                         "--kv-cache-blocks", "64", "--block-size", "4"])
        # The first probe after start runs a one-token health-check generation.
        assert wait_until(lambda: http_get(port, "/health")[0] == 200, timeout=30), router.output()
        assert "health check 1: generated 1 token(s)" in router.output()
        # Once a generation worked, probes do not generate again. TGIS answers 200 with an
        # empty body.
        for _ in range(3):
            assert http_get(port, "/health") == (200, "")
        assert "health check 2" not in router.output()
        # Not a client request: no request metric counts it.
        metrics = Exposition(http_get(port, "/metrics")[1])
        assert metrics.count("tgi_request_count", kind="single") == 0
        assert metrics.count("tgi_batch_inference_success", method="prefill") == 1
    finally:
        router.close()
        if shard is not None:
            shard.close()


def test_port_in_use_fails_at_start():
    if not binary(ROUTER_BINARY).exists():
        pytest.skip("router not built")
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = subprocess.run([str(binary(ROUTER_BINARY)), "--tokenizer-path", fixture_model_dir("gpt2"),
                            "--port", str(port), "--shard-uds-path", "/nonexistent/shard"],
                           capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    assert f"cannot listen on HTTP port {port}" in r.stderr
    assert "Address already in use" in r.stderr


def test_metrics_pass_promtool(server):
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    pb = server.pb
    server.stub.Generate(pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="Hi")],
                                                     params=params(pb, 3)), timeout=30)
    with pytest.raises(grpc.RpcError):
        server.stub.Generate(pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="Hi")], params=params(pb, 9999)), timeout=30)
    _, text = server.http_get("/metrics")
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=30)
    # 0: clean; 3: lint problems only; 1 would be a format error.
    assert r.returncode in (0, 3), r.stdout + r.stderr
    # The only lint problems allowed are those of the names TGIS mandates: counters without
    # _total (the _total spelling is exposed too), and counters whose names end in _count.
    counters = {n for n, k in TGIS_METRICS.items() if k == "counter"}
    for line in (r.stdout + r.stderr).splitlines():
        if not line.strip():
            continue
        m = re.fullmatch(r'(\S+) counter metrics should have "_total" suffix', line)
        if m:
            assert m.group(1) in counters, line
            continue
        m = re.fullmatch(r'(\S+) non-histogram and non-summary metrics should not have "_count" '
                         r'suffix', line)
        assert m, f"unexpected promtool complaint: {line}"
        assert m.group(1) in counters and m.group(1).endswith("_count"), line


def test_every_metric_is_exposed_with_its_kind(server):
    e = scrape(server)
    for name, kind in TGIS_METRICS.items():
        assert e.types.get(name) == kind, name
        if kind == "counter":
            assert e.types.get(name + "_total") == "counter", name


def test_every_metric_moves(server):
    pb = server.pb
    stub = server.stub
    before = scrape(server)

    # Unary: a single input, then a batch of two.
    stub.Generate(pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="Hello")],
                                              params=params(pb, 5, 5)), timeout=30)
    stub.Generate(pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text="one"), pb.GenerationRequest(text="two")],
        params=params(pb, 4, 4)), timeout=30)
    # Truncated inputs: their raw length is longer.
    stub.Generate(pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text="word " * 400), pb.GenerationRequest(text="x")],
        params=pb.Parameters(truncate_input_tokens=200,
                             stopping=pb.StoppingCriteria(max_new_tokens=10, min_new_tokens=10))),
        timeout=30)

    # A long stream will fill the KV cache; meanwhile a request that cannot fit waits (and
    # times out in the queue) while a small one jumps ahead of it and joins the running batch:
    # a granular admission too, as the sum of their final lengths exceeds the KV cache.
    stream = stub.GenerateStream(pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text="Hello"), params=params(pb, 250, 250)), timeout=60)
    next(stream)
    next(stream)  # the first token: the stream runs
    # The big one must time out in the queue long before the stream ends, and the small one
    # must get its first token well within the same limit and so join the running batch (a
    # concatenation). A fixed limit raced the stream on a fast CPU (its 250 tokens took under
    # 100 ms), so the limit is a third of the stream's remaining time as measured here: the
    # mean gap between the tokens it is sending now, over ten of them.
    gap_start = time.monotonic()
    for _ in range(10):
        next(stream)
    gap = (time.monotonic() - gap_start) / 10
    time_limit_ms = max(10, min(100, int(gap * 1000 * 238 / 3)))
    waiting = stub.Generate.future(pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text="word " * 300), pb.GenerationRequest(text="y")],
        params=pb.Parameters(truncate_input_tokens=230, stopping=pb.StoppingCriteria(
            max_new_tokens=20, time_limit_millis=time_limit_ms))), timeout=60)
    during = []
    while not waiting.done():
        during.append(scrape(server))
        time.sleep(0.002)  # leave the router and shard the CPU
    stream_messages = list(stream)
    assert stream_messages[-1].stop_reason == pb.MAX_TOKENS
    [big, small] = waiting.result().responses
    assert big.stop_reason == pb.TIME_LIMIT and big.generated_token_count == 0, time_limit_ms
    assert small.generated_token_count >= 1  # MAX_TOKENS, or TIME_LIMIT on a slow machine

    # Tokenize: one call of two inputs.
    tokenized = stub.Tokenize(pb.BatchedTokenizeRequest(
        requests=[pb.TokenizeRequest(text="Hello world"), pb.TokenizeRequest(text="again")]),
        timeout=30)
    tokens = sum(r.token_count for r in tokenized.responses)
    # Refused: invalid, too long for the model, an unknown prompt prefix, overload.
    for request in (
        pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="Hi")],
                                    params=params(pb, 251)),
        pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="word " * 300)]),
        pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="Hi")],
                                    prefix_id="no-such-prompt"),
        pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="Hi")] * (MAX_CONCURRENT + 1)),
    ):
        with pytest.raises(grpc.RpcError):
            stub.Generate(request, timeout=30)

    after = scrape(server)

    def delta(name, **labels):
        return after.count(name, **labels) - before.count(name, **labels)

    # Requests: single (1 + the invalid + the unknown prefix), batch (2 + granular pair +
    # waiting pair + the overload), stream (1).
    assert delta("tgi_request_count", kind="single") == 4
    assert delta("tgi_request_count", kind="batch") == 4
    assert delta("tgi_request_count", kind="stream") == 1
    assert delta("tgi_request_input_count") == 1 + 2 + 2 + 1 + 2 + 3 + MAX_CONCURRENT + 1
    def successes(e, kind):
        return sum(v for (name, labels), v in e.samples.items()
                   if name == "tgi_request_success" and ("kind", kind) in labels)

    assert successes(after, "single") - successes(before, "single") == 1
    assert successes(after, "batch") - successes(before, "batch") == 2 + 2 + 2
    assert successes(after, "stream") - successes(before, "stream") == 1
    assert delta("tgi_request_success", stop_reason="MAX_TOKENS", kind="single") == 1
    assert delta("tgi_request_success", stop_reason="MAX_TOKENS", kind="batch") >= 4
    assert delta("tgi_request_success", stop_reason="MAX_TOKENS", kind="stream") == 1
    assert delta("tgi_request_success", stop_reason="TIME_LIMIT", kind="batch") >= 1
    assert delta("tgi_request_failure", err="timeout") == 1
    assert delta("tgi_request_failure", err="validation") == 3
    assert delta("tgi_request_failure", err="conc_limit") == 1
    assert delta("tgi_prompt_load_failure") == 1
    generated = 1 + 2 + 2 + 1 + 1  # requests that ran (the timed-out one never did)
    for histogram in ("tgi_request_generated_tokens", "tgi_request_total_tokens",
                      "tgi_request_duration", "tgi_request_inference_duration",
                      "tgi_request_mean_time_per_token_duration"):
        assert delta(histogram) == generated + 1, histogram  # + the TIME_LIMIT one
    assert delta("tgi_request_queue_duration") == generated
    # Validated inputs; raw lengths also of the one refused as too long.
    assert delta("tgi_request_input_length") == generated + 1
    assert delta("tgi_request_max_new_tokens") == generated + 1
    assert delta("tgi_request_raw_input_length") == generated + 1 + 1
    assert delta("tgi_request_validation_duration") == 4 + 1
    assert (after.value("tgi_request_raw_input_length_sum")
            - before.value("tgi_request_raw_input_length_sum")
            > after.value("tgi_request_input_length_sum")
            - before.value("tgi_request_input_length_sum"))  # 400 words truncated to 200

    # Batches.
    assert delta("tgi_batch_inference_count", method="prefill") >= 5
    assert delta("tgi_batch_inference_success", method="prefill") == delta(
        "tgi_batch_inference_count", method="prefill")
    assert delta("tgi_batch_inference_count", method="next_token") >= 249
    assert delta("tgi_batch_inference_success", method="next_token") == delta(
        "tgi_batch_inference_count", method="next_token")
    for method in ("prefill", "next_token"):
        n = delta("tgi_batch_inference_count", method=method)
        assert delta("tgi_batch_inference_batch_size", method=method) == n
        for histogram in ("tgi_batch_inference_duration", "tgi_batch_inference_forward_duration",
                          "tgi_batch_inference_tokproc_duration"):
            assert delta(histogram, method=method, makeup="single_only") == n, histogram
    assert delta("tgi_batch_next_tokens") == delta("tgi_batch_inference_count", method="prefill")
    assert delta("tgi_batch_concatenation_count") >= 1
    assert delta("tgi_queue_jump") >= 1
    assert delta("tgi_granular_batch_addition") >= 1
    # Gauges, seen while the stream ran and the big request waited; all back to 0 after.
    for gauge in ("tgi_batch_current_size", "tgi_batch_input_tokens",
                  "tgi_batch_max_remaining_tokens", "tgi_queue_size"):
        assert max(e.value(gauge) for e in during) > 0, gauge
        assert after.value(gauge) == 0, gauge
    assert max(e.value("tgi_batch_current_size") for e in during) <= 2

    # Tokenize.
    assert delta("tgi_tokenize_request_count") == 1
    assert delta("tgi_tokenize_request_input_count") == 2
    assert delta("tgi_tokenize_request_tokens") == 1
    assert (after.value("tgi_tokenize_request_tokens_sum")
            - before.value("tgi_tokenize_request_tokens_sum")) == tokens
    assert delta("tgi_tokenize_request_duration") == 1

    # No event of ours: no prefill weight limit, no padding (ragged batches), no prompt tuning
    # (a prompt is never loaded). Present, at 0.
    for name in ("tgi_prefill_weight_limit_exceeded", "tgi_prefill_padding_limit_exceeded"):
        assert (name, frozenset()) in after.samples and after.value(name) == 0, name
    assert after.value("tgi_prompt_load_duration_count") == 0
    assert ("tgi_prompt_load_duration_count", frozenset()) in after.samples


def test_health_is_503_after_a_shard_dies(server):
    # Last in this module: it kills the module's shard.
    assert server.http_get("/health")[0] == 200
    pb = server.pb
    before = scrape(server)
    server.shard.close()
    with pytest.raises(grpc.RpcError):
        server.stub.Generate(pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="Hello")]), timeout=30)
    assert wait_until(lambda: server.http_get("/health")[0] == 503, timeout=15)
    after = scrape(server)
    assert (after.count("tgi_batch_inference_failure", method="prefill", reason="connection")
            - before.count("tgi_batch_inference_failure", method="prefill", reason="connection")) >= 1
    assert (after.count("tgi_request_failure", err="generate")
            - before.count("tgi_request_failure", err="generate")) == 1
    # Probes keep answering 503 (each tries a health-check generation, which fails).
    assert server.http_get("/health")[0] == 503
    assert server.router.alive()
