"""Prefix caching through the real router and shard: prompts that share a long beginning give
the same tokens and logprobs with the cache on (the default) as with --prefix-caching=false,
seeded samples included, and the tgis_prefix_cache_* counters say what was reused."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from router_harness import Oracle, RouterServer, binaries_missing  # noqa: E402
from test_metrics_health import Exposition  # noqa: E402

grpc = pytest.importorskip("grpc")

SYSTEM = ("You are a careful assistant. Answer briefly and cite the manual when you can. "
          "The manual covers installation, upgrades, backups and the command line. ")
QUESTIONS = ["How do I upgrade?", "Where are backups kept?", "How do I upgrade?",
             "What does the command line offer?"]


def ask(server, texts, sample_seed=None):
    pb = server.pb
    p = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=12),
                      response=pb.ResponseOptions(generated_tokens=True, token_logprobs=True,
                                                  input_tokens=False))
    if sample_seed is not None:
        p.method = pb.SAMPLE
        p.sampling.seed = sample_seed
        p.sampling.top_k = 20
    out = []
    for text in texts:  # one at a time: each finds what the ones before left in the cache
        r = server.stub.Generate(pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=text)], params=p), timeout=60).responses[0]
        out.append((r.text, [t.text for t in r.tokens], [t.logprob for t in r.tokens],
                    r.input_token_count))
    return out


def metrics(server) -> Exposition:
    status, text = server.http_get("/metrics")
    assert status == 200
    return Exposition(text)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request):
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    return request.param


def run_workload(model, caching: bool):
    server = RouterServer(model, kv_blocks=128, block_size=4,
                          shard_args=[f"--prefix-caching={'true' if caching else 'false'}"])
    try:
        texts = [SYSTEM + q for q in QUESTIONS]
        greedy = ask(server, texts)
        sampled = ask(server, texts[:2] * 2, sample_seed=42)
        return greedy, sampled, metrics(server)
    finally:
        server.close()


def test_outputs_are_the_same_with_the_cache_on_and_off(model):
    on_greedy, on_sampled, on = run_workload(model, caching=True)
    off_greedy, off_sampled, off = run_workload(model, caching=False)
    for a, b in zip(on_greedy + on_sampled, off_greedy + off_sampled):
        assert a[0] == b[0] and a[1] == b[1] and a[3] == b[3]
        assert a[2] == pytest.approx(b[2], abs=1e-4)
    # The same question twice, and the same seed twice: the same output (logprobs within float
    # rounding: the second computes fewer rows in its prefill).
    for a, b in ((on_greedy[0], on_greedy[2]), (on_sampled[0], on_sampled[2])):
        assert a[:2] == b[:2]
        assert a[2] == pytest.approx(b[2], abs=1e-4)
    # Every request after the first shared the system prompt's whole blocks with one before.
    requests = len(on_greedy) + len(on_sampled)
    assert on.count("tgis_prefix_cache_hits_total") == requests - 1
    shortest = min(r[3] for r in on_greedy)
    assert on.count("tgis_prefix_cache_reused_tokens_total") >= (requests - 1) * (shortest // 2)
    assert off.count("tgis_prefix_cache_hits_total") == 0
    assert off.count("tgis_prefix_cache_reused_tokens_total") == 0


def test_golden_prompts_match_transformers_with_a_warm_cache(model):
    server = RouterServer(model, kv_blocks=128, block_size=4)
    oracle = Oracle(model)
    pb = server.pb
    try:
        p = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=16),
                          response=pb.ResponseOptions(generated_tokens=True, token_logprobs=True))
        for round_ in range(2):
            for i, prompt in enumerate(oracle.prompts):
                r = server.stub.Generate(pb.BatchedGenerationRequest(
                    requests=[pb.GenerationRequest(text=prompt["text"])], params=p),
                    timeout=60).responses[0]
                assert [t.text for t in r.tokens] == oracle.tokens(i, 16), (round_, i)
                assert [t.logprob for t in r.tokens] == pytest.approx(prompt["logprobs"], abs=1e-3)
        # The second round found every prompt with a whole block before its last token cached.
        reusable = sum(1 for prompt in oracle.prompts if len(prompt["input_ids"]) > 4)
        assert metrics(server).count("tgis_prefix_cache_hits_total") >= reusable > 0
    finally:
        server.close()
