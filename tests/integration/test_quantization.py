"""Quantized checkpoints through the real router and shard, as a TGIS user serves them: a GPTQ
AWQ or fp8 folder as it is (its quantization config is detected), a dense one with
--quantize bitsandbytes. Outputs are transformers' on the dequantized weights
(tests/fixtures/make_quantized_fixtures.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from router_harness import Oracle, RouterServer, binaries_missing  # noqa: E402

grpc = pytest.importorskip("grpc")

CASES = [("llama_gptq4", []), ("llama_gptq8", []), ("llama_awq", []), ("llama_fp8", []),
         ("llama_fp8_fbgemm", ["--quantize", "fp8"]),
         ("llama_int8", ["--quantize", "bitsandbytes"])]


@pytest.mark.parametrize("model,shard_args", CASES, ids=[c[0] for c in CASES])
def test_golden_prompts_in_one_batch(model, shard_args):
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    server = RouterServer(model, shard_args=shard_args)
    oracle = Oracle(model)
    pb = server.pb
    try:
        p = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=16),
                          response=pb.ResponseOptions(generated_tokens=True, token_logprobs=True))
        reqs = [pb.GenerationRequest(text=prompt["text"]) for prompt in oracle.prompts]
        got = server.stub.Generate(pb.BatchedGenerationRequest(requests=reqs, params=p),
                                   timeout=60).responses
        for i, (r, prompt) in enumerate(zip(got, oracle.prompts)):
            assert [t.text for t in r.tokens] == oracle.tokens(i, 16), i
            assert [t.logprob for t in r.tokens] == pytest.approx(prompt["logprobs"], abs=1e-3)
    finally:
        server.close()
