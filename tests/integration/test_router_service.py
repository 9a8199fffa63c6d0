"""The router as a service: Tokenize against HF tokenizers, ModelInfo, the gRPC health and
reflection services, overload, client cancellation, the correlation id, startup failures."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs import binary  # noqa: E402
from router_harness import (ROUTER_BINARY, Oracle, RouterServer, binaries_missing,  # noqa: E402
                            fixture_model_dir, wait_until)

grpc = pytest.importorskip("grpc")

TEXTS = ["Hello world!", "", "The quick brown fox jumps over the lazy dog.",
         "Grüße aus Köln — ça va? 日本語のテキスト 🤖🚗", "  leading and trailing spaces  ",
         "line one\nline two\ttabbed"]


@pytest.fixture(scope="module")
def server():
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    # A KV cache of 224 tokens: one request of the maximum length (200) fills most of it.
    s = RouterServer("llama", kv_blocks=56, block_size=4,
                     router_args=["--max-sequence-length", "200", "--max-new-tokens", "190",
                                  "--max-concurrent-requests", "8", "--max-batch-size", "4"])
    yield s
    s.close()


@pytest.fixture(scope="module")
def oracle():
    return Oracle("llama")


def byte_offsets(text: str, char_offsets):
    """HF's Python offsets count characters; TGIS's (Rust) count bytes."""
    starts = [0]
    for ch in text:
        starts.append(starts[-1] + len(ch.encode()))
    return [(starts[a], starts[b]) for a, b in char_offsets]


def test_tokenize_matches_hf(server, oracle):
    pb = server.pb
    response = server.stub.Tokenize(pb.BatchedTokenizeRequest(
        requests=[pb.TokenizeRequest(text=t) for t in TEXTS], return_tokens=True,
        return_offsets=True))
    assert len(response.responses) == len(TEXTS)
    for text, r in zip(TEXTS, response.responses):
        e = oracle.tokenizer.encode(text)
        assert r.token_count == len(e.ids)
        assert list(r.tokens) == e.tokens
        assert [(o.start, o.end) for o in r.offsets] == byte_offsets(text, e.offsets)
    # Tokens and offsets only when asked.
    bare = server.stub.Tokenize(pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text=TEXTS[0])]))
    assert bare.responses[0].token_count == len(oracle.tokenizer.encode(TEXTS[0]).ids)
    assert not bare.responses[0].tokens and not bare.responses[0].offsets


def test_tokenize_truncation_and_generate_agree(server, oracle):
    pb = server.pb
    text = TEXTS[3]
    full = oracle.tokenizer.encode(text)
    for n in (1, 5, len(full.ids), len(full.ids) + 3):
        r = server.stub.Tokenize(pb.BatchedTokenizeRequest(
            requests=[pb.TokenizeRequest(text=text)], return_tokens=True, return_offsets=True,
            truncate_input_tokens=n)).responses[0]
        expected = min(n, len(full.ids))
        assert r.token_count == expected
        # TGIS's Tokenize keeps the plain tail of the tokens and offsets: the BOS goes first.
        assert list(r.tokens) == full.tokens[len(full.tokens) - expected:]
        tail = full.offsets[len(full.offsets) - expected:]
        assert [(o.start, o.end) for o in r.offsets] == byte_offsets(text, tail)
        g = server.stub.Generate(pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=text)],
            params=pb.Parameters(truncate_input_tokens=n,
                                 stopping=pb.StoppingCriteria(max_new_tokens=1)))).responses[0]
        assert g.input_token_count == r.token_count


def test_model_info(server):
    pb = server.pb
    info = server.stub.ModelInfo(pb.ModelInfoRequest(model_id="ignored"))
    assert info.model_kind == pb.ModelInfoResponse.DECODER_ONLY
    assert info.max_sequence_length == 200
    assert info.max_new_tokens == 190


def test_health_service(server):
    check = server.channel.unary_unary("/grpc.health.v1.Health/Check",
                                       request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
    # HealthCheckRequest{service: ""} is empty; HealthCheckResponse{status: SERVING (1)}.
    assert check(b"", timeout=10) == b"\x08\x01"


def test_reflection_lists_the_services(server):
    info = server.channel.stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        request_serializer=lambda b: b, response_deserializer=lambda b: b)
    # ServerReflectionRequest{list_services: ""} (field 7).
    replies = list(info(iter([b"\x3a\x00"]), timeout=10))
    assert len(replies) == 1
    assert b"fmaas.GenerationService" in replies[0]
    assert b"grpc.health.v1.Health" in replies[0]


def test_stream_without_request(server):
    pb = server.pb
    with pytest.raises(grpc.RpcError) as e:
        list(server.stub.GenerateStream(pb.SingleGenerationRequest(), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "missing request"


def test_overload_is_refused_at_once(server, oracle):
    pb = server.pb
    text = oracle.prompts[1]["text"]
    many = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=text)] * 9,
                                       params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=1)))
    start = time.time()
    with pytest.raises(grpc.RpcError) as e:
        server.stub.Generate(many, timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.value.details() == "Model is overloaded"
    assert time.time() - start < 2
    # Eight is within the limit.
    eight = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=text)] * 8,
                                        params=many.params)
    assert len(server.stub.Generate(eight, timeout=30).responses) == 8

    # Streams count too: with eight long streams running, a ninth is refused.
    params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=150))
    channel, stub = server.new_stub()
    calls = [stub.GenerateStream(pb.SingleGenerationRequest(request=pb.GenerationRequest(text="a"),
                                                            params=params)) for _ in range(8)]
    try:
        for c in calls:
            next(c)  # the first message: the request is admitted
        with pytest.raises(grpc.RpcError) as e:
            next(server.stub.GenerateStream(pb.SingleGenerationRequest(
                request=pb.GenerationRequest(text="a"), params=params), timeout=10))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert e.value.details() == "Model is overloaded"
    finally:
        for c in calls:
            c.cancel()
        channel.close()
    # The cancelled streams give their slots back.
    assert wait_until(lambda: _generate_ok(server, text), timeout=10)


def _generate_ok(server, text) -> bool:
    pb = server.pb
    try:
        server.stub.Generate(pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=text)] * 8,
            params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=1))), timeout=10)
        return True
    except grpc.RpcError:
        return False


def test_cancelled_stream_frees_its_kv_blocks(server, oracle):
    pb = server.pb
    # Each request may grow to 200 tokens in a 224-token KV cache, so the router runs them one
    # at a time; the first is cancelled when it holds ~56 tokens, and the second only gets the
    # 200 it needs from the shard if the first's blocks were freed there.
    prompt = oracle.prompts[3]["text"]  # 36 tokens
    params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=164))
    call = server.stub.GenerateStream(pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=prompt), params=params))
    second = server.stub.Generate.future(pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=prompt)], params=params), timeout=60)
    for m in call:
        if m.generated_token_count >= 20:
            break
    call.cancel()
    assert wait_until(lambda: "cancelled by the client after" in server.log(), timeout=10)
    r = second.result().responses[0]
    assert r.stop_reason == pb.MAX_TOKENS and r.generated_token_count == 164


def test_cancelled_unary_request_leaves(server, oracle):
    pb = server.pb
    params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=190))
    before = server.log().count("cancelled by the client")
    prefills = server.log().count("prefill of batch")
    future = server.stub.Generate.future(pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text="a")] * 2, params=params))
    # Cancelled once running (the two inputs run one after the other: each may reach 192 of
    # the 224 KV-cache tokens).
    assert wait_until(lambda: server.log().count("prefill of batch") > prefills, timeout=10)
    future.cancel()
    assert wait_until(lambda: server.log().count("cancelled by the client") >= before + 2,
                      timeout=10)
    # The router serves on.
    assert _generate_ok(server, "b")


def test_correlation_id_names_the_request_in_logs(server):
    pb = server.pb
    server.stub.Generate(pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="x")],
                                                     params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=2))),
                         metadata=[("x-correlation-id", "corr-4242")], timeout=10)
    assert wait_until(lambda: "correlation id corr-4242: generated 2 token(s)" in server.log())


def run_router(*args):
    return subprocess.run([str(binary(ROUTER_BINARY)), *args], capture_output=True, text=True,
                          timeout=30)


def test_bad_tokenizer_path_fails_at_start(tmp_path):
    if not binary(ROUTER_BINARY).exists():
        pytest.skip("router not built")
    missing = tmp_path / "nowhere"
    r = run_router("--tokenizer-path", str(missing))
    assert r.returncode != 0
    assert str(missing) in r.stderr
    # A model directory without tokenizer.json: the message names the file.
    (tmp_path / "model").mkdir()
    r = run_router("--tokenizer-path", str(tmp_path / "model"))
    assert r.returncode != 0
    assert str(tmp_path / "model" / "tokenizer.json") in r.stderr
    # A broken tokenizer.json names it too.
    (tmp_path / "model" / "tokenizer.json").write_text("{not json")
    r = run_router("--tokenizer-path", str(tmp_path / "model"))
    assert r.returncode != 0
    assert "tokenizer.json" in r.stderr
    # Unknown environment values are refused with the variable named.
    r = subprocess.run([str(binary(ROUTER_BINARY))], capture_output=True, text=True, timeout=30,
                       env={**os.environ, "MAX_BATCH_SIZE": "many",
                            "TOKENIZER_PATH": str(fixture_model_dir("llama"))})
    assert r.returncode != 0 and "MAX_BATCH_SIZE" in r.stderr


def test_tgis_defaults_max_new_tokens_and_concurrency():
    """TGIS lowers MAX_NEW_TOKENS to MAX_SEQUENCE_LENGTH - 1 when it is not below it (ModelInfo
    and validation both), and admits 512 concurrent inputs by default (each input of a batch
    takes one permit)."""
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    s = RouterServer("llama", kv_blocks=256, block_size=4,
                     router_args=["--max-sequence-length", "50", "--max-new-tokens", "1024"])
    try:
        pb = s.pb
        info = s.stub.ModelInfo(pb.ModelInfoRequest())
        assert info.max_sequence_length == 50
        assert info.max_new_tokens == 49
        with pytest.raises(grpc.RpcError) as e:
            s.stub.Generate(pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text="Hi")],
                params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=50))), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == "max_new_tokens must be <= 49"
        # 200 inputs in one call: over the old default of 96, within TGIS's 512.
        batch = s.stub.Generate(pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=f"Hi {i}") for i in range(200)],
            params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=1))), timeout=120)
        assert len(batch.responses) == 200
        assert all(r.generated_token_count == 1 for r in batch.responses)
    finally:
        s.close()


@pytest.mark.parametrize("var,value,expected", [
    ("MAX_NEW_TOKENS", "-5", "--max-new-tokens (MAX_NEW_TOKENS) is -5; it must be positive"),
    ("MAX_BATCH_SIZE", "0", "--max-batch-size (MAX_BATCH_SIZE) is 0; it must be positive"),
    ("MAX_SEQUENCE_LENGTH", "-1",
     "--max-sequence-length (MAX_SEQUENCE_LENGTH) is -1; it must be zero (unset) or positive"),
])
def test_a_bad_limit_fails_at_start_naming_it(var, value, expected):
    if not binary(ROUTER_BINARY).exists():
        pytest.skip("router not built")
    r = subprocess.run([str(binary(ROUTER_BINARY))], capture_output=True, text=True, timeout=30,
                       env={**os.environ, var: value,
                            "TOKENIZER_PATH": str(fixture_model_dir("llama"))})
    assert r.returncode != 0
    assert expected in r.stderr, r.stderr


def test_messages_over_tgis_4_mib_are_refused_and_the_router_serves_on(server):
    """TGIS's router (tonic) decodes requests of up to 4 MiB; a bigger one is refused before
    it is read (the router never holds it), and the next request is served."""
    pb = server.pb
    with pytest.raises(grpc.RpcError) as e:
        server.stub.Generate(pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="a" * (5 << 20))]), timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _generate_ok(server, "b")


def test_large_inputs_are_prepared_off_the_call_threads_and_small_ones_are_served(server):
    """Large inputs are tokenized on the router's preparation pool (not on the threads that
    accept calls), fail validation (TGIS's message, judged from a prefix of the input), and a
    small request sent meanwhile is answered."""
    import concurrent.futures

    from tokenizers import Tokenizer

    pb = server.pb
    big = "hello " * (20 << 10)  # ~120 kB (over the 64 KiB done inline), ~20k tokens
    tokens = len(Tokenizer.from_file(str(server.model_dir / "tokenizer.json")).encode(big).ids)

    def generate(text):
        try:
            return server.stub.Generate(pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text=text)],
                params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=1))),
                timeout=120).responses[0]
        except grpc.RpcError as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        bigs = [pool.submit(generate, big) for _ in range(3)]
        small = pool.submit(generate, "a")
        r = small.result(timeout=120)
        assert not isinstance(r, grpc.RpcError), r
        assert r.generated_token_count == 1
        for f in bigs:
            e = f.result(timeout=120)
            assert isinstance(e, grpc.RpcError)
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
            # TGIS's InputLength2, but from a prefix of the input: ~120 kB is over 64 bytes per
            # allowed token, so the router tokenized only enough of it to know it cannot fit.
            m = re.fullmatch(r"input tokens \(at least (\d+)\) plus prefix length \(0\) must be "
                             r"< 200", e.details())
            assert m, e.details()
            assert 200 <= int(m.group(1)) < tokens
    # Below that size the whole input is tokenized, and the message is TGIS's word for word.
    medium = "hello " * 5000
    e = generate(medium)
    assert isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.INVALID_ARGUMENT
    medium_tokens = len(Tokenizer.from_file(str(server.model_dir / "tokenizer.json")).encode(medium).ids)
    assert e.details() == f"input tokens ({medium_tokens}) plus prefix length (0) must be < 200"


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (payload < 128 bytes), written by hand: the Python
    protobuf library refuses to write invalid UTF-8 into a string field."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


@pytest.mark.parametrize("method,streaming,request_bytes,expected", [
    ("Generate", False, b"\xff\xff\xff\xff\xff",
     "could not be decoded as fmaas.BatchedGenerationRequest: the bytes are not a protobuf "
     "message"),
    ("Generate", False, _field(3, _field(2, b"caf\xc3")),
     "could not be decoded as fmaas.BatchedGenerationRequest: field fmaas.GenerationRequest.text "
     "is not valid UTF-8"),
    ("Generate", False, _field(10, _field(3, b"\x08")),
     "could not be decoded as fmaas.BatchedGenerationRequest: field fmaas.Parameters.stopping is "
     "not a valid fmaas.StoppingCriteria message"),
    ("GenerateStream", True, _field(2, b"\x80prefix"),
     "could not be decoded as fmaas.SingleGenerationRequest: field "
     "fmaas.SingleGenerationRequest.prefix_id is not valid UTF-8"),
    ("Tokenize", False, _field(2, _field(1, b"\xed\xa0\x80")),
     "could not be decoded as fmaas.BatchedTokenizeRequest: field fmaas.TokenizeRequest.text is "
     "not valid UTF-8"),
    ("ModelInfo", False, _field(1, b"\xfe"),
     "could not be decoded as fmaas.ModelInfoRequest: field fmaas.ModelInfoRequest.model_id is "
     "not valid UTF-8"),
])
def test_undecodable_requests_are_invalid_argument_naming_the_problem(server, method, streaming,
                                                                      request_bytes, expected):
    """A request protobuf cannot parse gets INVALID_ARGUMENT saying what is wrong (gRPC C++
    alone answers UNIMPLEMENTED with no details), and the router serves on."""
    path = f"/fmaas.GenerationService/{method}"
    call = (server.channel.unary_stream if streaming else server.channel.unary_unary)(path)
    with pytest.raises(grpc.RpcError) as e:
        result = call(request_bytes, timeout=30)
        if streaming:
            list(result)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == f"the request {expected}"
    assert _generate_ok(server, "b")
