"""The router's life around its requests: SIGTERM drains running requests before exiting, and a
shard that dies fails the requests (not the router) and turns the health service NOT_SERVING."""

from __future__ import annotations

import os
import signal
import time
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs import Process, binary  # noqa: E402
from router_harness import (ROUTER_BINARY, RouterServer, binaries_missing,  # noqa: E402
                            fixture_model_dir, wait_until)

grpc = pytest.importorskip("grpc")

SERVING, NOT_SERVING = b"\x08\x01", b"\x08\x02"


@pytest.fixture
def server():
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    s = RouterServer("gpt2", router_args=["--max-new-tokens", "200"])
    yield s
    s.close()


def health(server) -> bytes:
    check = server.channel.unary_unary("/grpc.health.v1.Health/Check",
                                       request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
    return check(b"", timeout=10)


def test_sigterm_drains_running_requests(server):
    pb = server.pb
    call = server.stub.GenerateStream(pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text="Hello"),
        params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=200))), timeout=60)
    messages = [next(call), next(call)]  # admitted and generating
    server.router.proc.send_signal(signal.SIGTERM)
    messages += list(call)
    assert messages[-1].stop_reason == pb.MAX_TOKENS
    assert messages[-1].generated_token_count == 200
    assert server.router.proc.wait(timeout=30) == 0
    assert "draining" in server.log()


def test_dead_shard_fails_requests_and_health(server):
    pb = server.pb
    assert health(server) == SERVING
    server.shard.close()
    request = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="Hello")])
    with pytest.raises(grpc.RpcError) as e:
        server.stub.Generate(request, timeout=30)
    # TGIS: UNKNOWN, not UNAVAILABLE (which clients retry by themselves, resending a generation).
    assert e.value.code() == grpc.StatusCode.UNKNOWN
    assert e.value.details().startswith("Request failed during generation: ")
    assert wait_until(lambda: health(server) == NOT_SERVING)
    assert server.router.alive()


def test_two_shards_and_env_settings():
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    server = RouterServer("llama", num_shard=2,
                          env={"OUTPUT_SPECIAL_TOKENS": "true", "DEFAULT_INCLUDE_STOP_SEQS": "false"})
    try:
        pb = server.pb
        # EOS made likely by a strong length penalty; with OUTPUT_SPECIAL_TOKENS it is in the text.
        p = pb.Parameters(decoding=pb.DecodingParameters(
            repetition_penalty=1.01,
            length_penalty=pb.DecodingParameters.LengthPenalty(start_index=0, decay_factor=10)),
            stopping=pb.StoppingCriteria(max_new_tokens=16))
        r = server.stub.Generate(pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="Hello world!")], params=p), timeout=30).responses[0]
        assert r.stop_reason == pb.EOS_TOKEN
        assert r.text.endswith("</s>")
        # DEFAULT_INCLUDE_STOP_SEQS=false: a stop sequence is left out unless asked for.
        p = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=16, stop_sequences=["pam"]))
        r = server.stub.Generate(pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="Hello world!")], params=p), timeout=30).responses[0]
        assert (r.text, r.stop_reason) == ("ate u", pb.STOP_SEQUENCE)
        assert "2 shard(s)" in server.log()
    finally:
        server.close()


def test_sigterm_while_waiting_for_the_shards(tmp_path):
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    router = Process([binary(ROUTER_BINARY), "--tokenizer-path", fixture_model_dir("gpt2"),
                      "--shard-uds-path", str(tmp_path / "nobody"), "--grpc-port", "0",
                      "--port", "0"])
    try:
        router.wait_for(lambda: "waiting for 1 shard(s)" in router.output(), timeout=10,
                        what="waiting")
        router.proc.send_signal(signal.SIGTERM)
        assert router.proc.wait(timeout=5) == 0
    finally:
        router.close()


def test_requests_left_at_the_end_of_the_grace_period_are_ended_by_the_shutdown():
    """Not logged (nor answered) as cancelled by their clients: UNAVAILABLE "the server is
    shutting down", which a client may retry elsewhere, and a log line that says why."""
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    s = RouterServer("gpt2", router_args=["--max-new-tokens", "200",
                                          "--shutdown-grace-period", "0"])
    try:
        pb = s.pb
        call = s.stub.GenerateStream(pb.SingleGenerationRequest(
            request=pb.GenerationRequest(text="Hello"),
            params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=200))), timeout=60)
        next(call), next(call)  # admitted and generating
        s.router.proc.send_signal(signal.SIGSTOP)  # hold the router while the test gets ready
        s.router.proc.send_signal(signal.SIGTERM)
        s.router.proc.send_signal(signal.SIGCONT)
        try:
            rest = list(call)
            finished = rest and rest[-1].stop_reason == pb.MAX_TOKENS
        except grpc.RpcError as e:
            finished = False
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            assert e.details() == "the server is shutting down"
        assert s.router.proc.wait(timeout=30) == 0
        if not finished:
            assert "the shutdown grace period is over" in s.log()
        assert "cancelled by the client" not in s.log()
    finally:
        s.close()


def test_a_hung_shard_fails_the_step_and_health_not_the_clients_deadline():
    """A shard that stops answering (SIGSTOP) fails its batch after SHARD_STEP_TIMEOUT with
    TGIS's generation error, and the health service turns NOT_SERVING; it does not hold the
    request until the client's own deadline."""
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    s = RouterServer("gpt2", router_args=["--shard-step-timeout", "2"])
    try:
        pb = s.pb
        assert health(s) == SERVING
        s.shard.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                s.stub.Generate(pb.BatchedGenerationRequest(
                    requests=[pb.GenerationRequest(text="Hello")]), timeout=60)
            assert time.monotonic() - started < 30
            assert e.value.code() == grpc.StatusCode.UNKNOWN
            assert e.value.details().startswith("Request failed during generation: ")
            assert "Deadline Exceeded" in e.value.details()
            assert wait_until(lambda: health(s) == NOT_SERVING, timeout=30)
        finally:
            s.shard.proc.send_signal(signal.SIGCONT)
        assert s.router.alive()
    finally:
        s.close()
