"""Speculative decoding by prompt lookup through the real router and shard (--speculate 4):
requests verify draft tokens copied from their own earlier tokens, several tokens may arrive
in one step, and every greedy output is still the one without it: transformers' goldens, stop
sequences and max_new_tokens cut where they would, streams equal to unary responses. (That
sampling keeps its distribution is tested statistically in tests/unit/sampling_test.cc.)"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from router_harness import binaries_missing, with_and_without  # noqa: E402
from test_metrics_health import Exposition  # noqa: E402
from test_router_generation import assert_stream_equals_unary, generate, params, stream  # noqa: E402

grpc = pytest.importorskip("grpc")


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def servers(request):
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    with with_and_without(request.param, ["--speculate", "4"]) as servers:
        yield servers


def test_golden_prompts_and_acceptance(servers):
    server, _, oracle = servers
    pb = server.pb
    for max_new in (16, 7):  # 7: max_new_tokens falls inside a draft
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=p["text"]) for p in oracle.prompts],
            params=params(pb, max_new=max_new, tokens=True, logprobs=True, ranks=True))
        responses = server.stub.Generate(request, timeout=60).responses
        for i, (p, r) in enumerate(zip(oracle.prompts, responses)):
            assert r.generated_token_count == max_new
            assert [t.text for t in r.tokens] == oracle.tokens(i, max_new), (max_new, i)
            assert [t.logprob for t in r.tokens] == pytest.approx(p["logprobs"][:max_new],
                                                                 abs=1e-3)
            assert all(t.rank == 1 for t in r.tokens)
    metrics = Exposition(server.http_get("/metrics")[1])
    # Both fixtures' goldens repeat tokens, which a one-token lookup drafts.
    assert metrics.count("tgis_accepted_draft_tokens_total") > 0
    assert (metrics.count("tgis_draft_tokens_total")
            >= metrics.count("tgis_accepted_draft_tokens_total"))


def test_stop_sequences_and_streams_as_without_speculation(servers):
    server, plain, oracle = servers
    pb = server.pb
    text = oracle.prompts[1]["text"]
    full = generate(plain, text, params(pb, max_new=24))
    # Stop sequences taken from the middle of the output: the stop falls inside a step's
    # tokens, and what follows it in that step must not leak out.
    for stop in (full.text[5:8], full.text[12:14]):
        if not stop.strip():
            continue
        p = params(pb, max_new=24, stop=[stop], tokens=True, logprobs=True)
        want = generate(plain, text, p)
        got = generate(server, text, p)
        assert (got.text, got.stop_reason, got.generated_token_count) == (
            want.text, want.stop_reason, want.generated_token_count)
        assert_stream_equals_unary(stream(server, text, p), got)
    # Sampling requests speculate too (rejection sampling keeps the distribution; the draws
    # differ from the plain server's): a seed still gives one output, in full.
    p = params(pb, max_new=16, method="sample", seed=5, tokens=True)
    first, again = generate(server, text, p), generate(server, text, p)
    assert first.text == again.text and first.generated_token_count == 16


def test_per_request_override_by_metadata(servers):
    """x-speculate-tokens (ours) sets one call's speculation whatever the server's SPECULATE:
    on a server without it the call speculates (drafts counted) and keeps the goldens; on a
    speculating server 0 turns it off for the call; a bad value is refused by name."""
    server, plain, oracle = servers
    pb = server.pb
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=p["text"]) for p in oracle.prompts],
        params=params(pb, max_new=16, tokens=True))

    def drafts(s):
        return Exposition(s.http_get("/metrics")[1]).count("tgis_draft_tokens_total")

    before = drafts(plain)
    responses = plain.stub.Generate(request, metadata=[("x-speculate-tokens", "4")],
                                    timeout=60).responses
    for i, r in enumerate(responses):
        assert [t.text for t in r.tokens] == oracle.tokens(i, 16)
    assert drafts(plain) > before
    before = drafts(server)
    responses = server.stub.Generate(request, metadata=[("x-speculate-tokens", "0")],
                                     timeout=60).responses
    for i, r in enumerate(responses):
        assert [t.text for t in r.tokens] == oracle.tokens(i, 16)
    assert drafts(server) == before
    for bad in ("many", "-1", "65"):
        with pytest.raises(grpc.RpcError) as e:
            server.stub.Generate(request, metadata=[("x-speculate-tokens", bad)], timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "x-speculate-tokens" in e.value.details()
