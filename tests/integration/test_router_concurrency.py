"""Many mixed requests at once through the real router and shard: unary and batched Generate,
streams, stop sequences, seeded sampling, cancellations, gRPC deadlines and invalid requests.
Every valid request completes, none is lost, and each output equals that of the same request
sent alone (batching must not change results)."""

from __future__ import annotations

import os
import random
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from router_harness import Oracle, RouterServer, binaries_missing  # noqa: E402

grpc = pytest.importorskip("grpc")

N_REQUESTS = 200


@pytest.fixture(scope="module")
def server():
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    # A small batch, a KV cache that holds about ten requests, and a short wait before
    # prefills interrupt decoding: admission and joining the running batch happen all the time.
    s = RouterServer("llama", kv_blocks=128, block_size=4,
                     router_args=["--max-sequence-length", "64", "--max-new-tokens", "20",
                                  "--max-batch-size", "8", "--max-waiting-tokens", "4",
                                  "--max-concurrent-requests", "1000"])
    yield s
    s.close()


def make_specs(oracle: Oracle, rng: random.Random) -> list[dict]:
    prompts = [p["text"] for p in oracle.prompts]
    specs = []
    for i in range(N_REQUESTS):
        kind = rng.choices(["unary", "batch", "stream", "cancel", "deadline", "invalid"],
                           weights=[30, 12, 30, 10, 6, 12])[0]
        prompt = rng.randrange(len(prompts))
        spec = {"kind": kind, "texts": [prompts[prompt]], "max_new": rng.randint(2, 16),
                "sample_seed": rng.choice([None, None, rng.randrange(1000)]),
                "stop": None, "include": rng.random() < 0.5}
        if rng.random() < 0.4:
            # A stop sequence from the middle of the greedy output (it may or may not be reached).
            golden = oracle.text(prompt, 16)
            a = rng.randrange(max(1, len(golden) - 3))
            spec["stop"] = golden[a:a + rng.randint(2, 3)] or None
        if kind == "batch":
            spec["texts"] = [prompts[rng.randrange(len(prompts))] for _ in range(rng.randint(2, 4))]
        if kind == "invalid":
            spec["max_new"] = 21
        specs.append(spec)
    return specs


def params(pb, spec) -> object:
    p = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=spec["max_new"]),
                      response=pb.ResponseOptions(generated_tokens=True))
    if spec["stop"]:
        p.stopping.stop_sequences.append(spec["stop"])
        p.stopping.include_stop_sequence = spec["include"]
    if spec["sample_seed"] is not None:
        p.method = pb.SAMPLE
        p.sampling.top_k = 20
        p.sampling.seed = spec["sample_seed"]
    return p


def summary(r) -> tuple:
    return (r.text, r.generated_token_count, r.stop_reason, r.stop_sequence,
            tuple(t.text for t in r.tokens))


def run_alone(server, spec, text):
    pb = server.pb
    r = server.stub.Generate(pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=text)], params=params(pb, spec)), timeout=60)
    return summary(r.responses[0])


def run(server, stub, spec):
    """Sends one spec; returns (kind, outcome)."""
    pb = server.pb
    p = params(pb, spec)
    kind = spec["kind"]
    try:
        if kind in ("unary", "batch", "invalid"):
            r = stub.Generate(pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text=t) for t in spec["texts"]], params=p),
                timeout=60)
            return [summary(x) for x in r.responses]
        request = pb.SingleGenerationRequest(request=pb.GenerationRequest(text=spec["texts"][0]),
                                             params=p)
        if kind == "deadline":
            list(stub.GenerateStream(request, timeout=0.005))
            return "finished before the deadline"
        call = stub.GenerateStream(request, timeout=60)
        messages = []
        for m in call:
            messages.append(m)
            if kind == "cancel" and len(messages) == 2:
                call.cancel()
        last = messages[-1]
        text = "".join(m.text for m in messages)
        tokens = tuple(t.text for m in messages for t in m.tokens)
        return [(text, last.generated_token_count, last.stop_reason, last.stop_sequence, tokens)]
    except grpc.RpcError as e:
        return e.code()


def test_mixed_concurrent_requests(server):
    oracle = Oracle("llama")
    specs = make_specs(oracle, random.Random(1234))
    # What each request gives when sent alone.
    reference = {}
    for spec in specs:
        if spec["kind"] == "invalid":
            continue
        for text in spec["texts"]:
            key = (text, repr(params(server.pb, spec)))
            if key not in reference:
                reference[key] = run_alone(server, spec, text)

    channels = [server.new_stub() for _ in range(4)]
    with ThreadPoolExecutor(max_workers=64) as pool:
        futures = [pool.submit(run, server, channels[i % 4][1], spec)
                   for i, spec in enumerate(specs)]
        outcomes = [f.result(timeout=120) for f in futures]
    for channel, _ in channels:
        channel.close()

    counts = {}
    for spec, outcome in zip(specs, outcomes):
        kind = spec["kind"]
        counts[kind] = counts.get(kind, 0) + 1
        expected = [reference.get((t, repr(params(server.pb, spec)))) for t in spec["texts"]]
        if kind == "invalid":
            assert outcome == grpc.StatusCode.INVALID_ARGUMENT
        elif kind == "cancel":
            # Cancelled after two messages, unless it had already finished.
            assert outcome == grpc.StatusCode.CANCELLED or outcome == expected, outcome
        elif kind == "deadline":
            assert outcome in (grpc.StatusCode.DEADLINE_EXCEEDED, "finished before the deadline")
        else:
            assert outcome == expected, f"{kind} {spec}: {outcome} != {expected}"
    assert sum(counts.values()) == N_REQUESTS
    assert all(counts.get(k, 0) > 0 for k in ("unary", "batch", "stream", "cancel", "invalid"))

    # The router is still healthy, and the cancelled requests were noticed.
    spec = {"kind": "unary", "texts": [oracle.prompts[1]["text"]], "max_new": 16,
            "sample_seed": None, "stop": None, "include": True}
    text, count, reason, _, _ = run_alone(server, spec, spec["texts"][0])
    assert (text, count) == (oracle.text(1, 16), 16)
    log = server.log()
    assert "cancelled by the client" in log
    # Continuous batching happened: new requests were prefilled into a running batch.
    joined = [(int(n), int(total)) for n, total in re.findall(
        r"(\d+) new request\(s\), \d+ prompt tokens; (\d+) request\(s\) in the batch", log)]
    assert any(total > n for n, total in joined)
    assert max(total for _, total in joined) <= 8
    assert "lost by the batcher" not in log and "unknown request" not in log
