"""Chunked prefill through the real router and shard (--prefill-chunk-tokens): prompts are
computed a few tokens per step, beside the running requests' tokens, and every output is the
one without chunking: transformers' greedy goldens, seeded samples, streams equal to unary
responses, prompt details."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from router_harness import binaries_missing, with_and_without  # noqa: E402
from test_router_generation import assert_stream_equals_unary, generate, params, stream  # noqa: E402

grpc = pytest.importorskip("grpc")

LONG = ("The quick brown fox jumps over the lazy dog while the band plays on and the crowd "
        "keeps time with the drums until the very end of the night. ") * 3


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def servers(request):
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    with with_and_without(request.param, ["--prefill-chunk-tokens", "5"]) as servers:
        yield servers


def test_golden_prompts_in_one_batch(servers):
    chunked, _, oracle = servers
    pb = chunked.pb
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=p["text"]) for p in oracle.prompts],
        params=params(pb, tokens=True, logprobs=True))
    responses = chunked.stub.Generate(request, timeout=60).responses
    for i, (p, r) in enumerate(zip(oracle.prompts, responses)):
        assert r.input_token_count == len(p["input_ids"])
        assert [t.text for t in r.tokens] == oracle.tokens(i, 16), i
        assert [t.logprob for t in r.tokens] == pytest.approx(p["logprobs"], abs=1e-3)


def test_long_prompts_join_running_streams_with_the_same_outputs(servers):
    chunked, plain, _ = servers
    pb = chunked.pb
    jobs = [("Hello", params(pb, max_new=40, min_new=40, tokens=True, logprobs=True)),
            (LONG, params(pb, max_new=12, tokens=True, logprobs=True)),
            (LONG + " again", params(pb, max_new=12, method="sample", seed=3, tokens=True,
                                     logprobs=True)),
            ("Once more", params(pb, max_new=20, method="sample", seed=11, tokens=True))]

    def run(server):
        with ThreadPoolExecutor(len(jobs)) as pool:
            return list(pool.map(lambda job: generate(server, *job), jobs))

    for got, want in zip(run(chunked), run(plain)):
        assert got.text == want.text
        assert got.generated_token_count == want.generated_token_count
        assert [t.logprob for t in got.tokens] == pytest.approx([t.logprob for t in want.tokens],
                                                               abs=1e-3)
    # Streamed and unary agree under chunking too, prompt details included.
    p = params(pb, max_new=8, tokens=True, logprobs=True)
    p.response.input_tokens = True
    unary = generate(chunked, LONG, p)
    assert_stream_equals_unary(stream(chunked, LONG, p), unary)
    assert len(unary.input_tokens) == unary.input_token_count
