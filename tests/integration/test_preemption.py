"""Preemption through the real router and shard (--preemption): requests are admitted by what
they need over the next block of tokens, so more run at once than the KV cache could hold to
their end; when it runs out, the newest are preempted and resumed later. Every request still
finishes, with the tokens it gets when it runs alone."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from router_harness import RouterServer, binaries_missing  # noqa: E402
from test_metrics_health import Exposition  # noqa: E402

grpc = pytest.importorskip("grpc")

KV_BLOCKS, BLOCK_SIZE = 64, 4  # 256 tokens
NEW_TOKENS = 100
PROMPTS = ["Hello there", "The weather today", "Once upon a time", "A list of numbers",
           "In the beginning", "Dear reader"]


def generate(server, text, seed=None):
    pb = server.pb
    p = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS,
                                                   min_new_tokens=NEW_TOKENS),
                      response=pb.ResponseOptions(generated_tokens=True, token_logprobs=True))
    if seed is not None:
        p.method = pb.SAMPLE
        p.sampling.seed = seed
        p.sampling.top_k = 20
    r = server.stub.Generate(pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=text)], params=p), timeout=120).responses[0]
    return r.stop_reason, r.text, [t.logprob for t in r.tokens]


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_requests_finish_with_their_own_tokens(caching):
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    server = RouterServer("gpt2", kv_blocks=KV_BLOCKS, block_size=BLOCK_SIZE,
                          router_args=["--preemption", "--max-new-tokens", str(NEW_TOKENS),
                                       "--max-batch-size", "8"],
                          shard_args=[f"--prefix-caching={'true' if caching else 'false'}"])
    try:
        pb = server.pb
        jobs = [(text, None) for text in PROMPTS] + [(text, 5 + i) for i, text in enumerate(PROMPTS)]
        alone = {job: generate(server, *job) for job in jobs}
        with ThreadPoolExecutor(len(jobs)) as pool:
            together = dict(zip(jobs, pool.map(lambda job: generate(server, *job), jobs)))
        for job in jobs:
            reason, text, logprobs = together[job]
            assert reason == pb.MAX_TOKENS, job
            assert text == alone[job][1], job
            assert logprobs == pytest.approx(alone[job][2], abs=1e-3), job
        status, body = server.http_get("/metrics")
        metrics = Exposition(body)
        # 12 requests of 100+ tokens in a 256-token cache: some were preempted, none failed.
        assert metrics.count("tgis_preemptions_total") > 0, server.log()[-3000:]
        assert "preempted after" in server.log()
        assert sum(v for (name, _), v in metrics.samples.items()
                   if name == "tgi_request_failure") == 0
    finally:
        server.close()
